//! A power cut during archiving loses nothing acknowledged (issue 31).
//!
//! The data directory and the archive share one power-cut filesystem, one
//! disk as on a real machine. A child process runs an archived host that
//! writes numbered notes and logs each acknowledgement to a file outside
//! the mount (the observer's record, which the cut must not touch). The
//! test kills it while a file of the archive is being written, cuts the
//! power with a fault and a seed, and then judges only what the disk
//! holds:
//!
//! 1. a host started again holds every acknowledged note;
//! 2. the archive's manifest reads, and a restore at the killed life's
//!    `through_ms` holds every note acknowledged by then and none begun
//!    after (a chunk the durable manifest names was written and synced
//!    before it, so a restore that finds one missing is a bug, not a
//!    tolerated outcome);
//! 3. the restarted host ships a new life, a restore at its end holds the
//!    notes of both lives, and a moment between the lives is refused as a
//!    gap or restored correctly.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use durability_host::archive::{self, ArchiveConfig, ArchiveError, ArchiveManifest};
use durability_host::{Host, HostError};
use durability_platform::EpochMs;
use durability_powercut::{Fault, PowerCutFs};
use support::{Notes, epoch_ms, notes, runtime};

/// Objects the writer spreads its notes over.
const OBJECTS: u64 = 4;
/// Ships often, so a kill at a random moment often meets a file of the
/// archive half written.
const SHIP_EVERY: Duration = Duration::from_millis(25);
/// A new base every few hundred milliseconds, so the runs also cut the
/// power while a base is being copied, and restores start from a later
/// base than the first.
const BASE_EVERY: Duration = Duration::from_millis(400);
/// Acknowledged notes the archive must hold before the kill is armed.
const ACKS_BEFORE_KILL: usize = 300;
/// How long the kill waits for a staged archive file before it kills
/// anyway (the writer may be between two ship cycles the whole time).
const KILL_WINDOW: Duration = Duration::from_secs(3);
/// Every fault that takes away what was not made durable.
const FAULTS: [Fault; 4] = [
    Fault::Drop,
    Fault::Reorder,
    Fault::Metadata,
    Fault::TornOverwrite,
];
/// Three seeds a fault: each fault meets each kind of [`Staged`] file.
const SEEDS: [u64; 3] = [1, 2, 3];
/// Seqs the parent's writes in the second life start above the child's
/// last logged one by this much: the seqs between may have been begun by
/// the child (the call the kill interrupted, a log line the kill cut
/// short) and may or may not be held.
const UNLOGGED_SEQS: u64 = 8;
/// Set only in the writer child: its run directory on the mount, then the
/// directory outside it for its acknowledgement log, one per line.
const CHILD_ENV: &str = "DURABILITY_ARCHIVE_POWER_CUT_CHILD";

fn name(seq: u64) -> String {
    format!("object-{}", seq % OBJECTS)
}

/// The paths of one run: the host's files on the mount, the observer's
/// beside it.
struct Run {
    on_mount: PathBuf,
    /// Outside the mount: what the cut must not touch, and the restores.
    observer: PathBuf,
    data: PathBuf,
    archive: PathBuf,
    /// `object seq begun_ms acked_ms` per acknowledged note.
    acks: PathBuf,
    /// The machine's boot id as the hosts read it: rewritten at the cut,
    /// as a reboot after a power loss would change it, so the restarted
    /// host treats the stop as one that may have lost unsynced writes.
    boot_id: PathBuf,
}

impl Run {
    fn new(on_mount: &Path, observer: &Path) -> Run {
        Run {
            on_mount: on_mount.to_path_buf(),
            observer: observer.to_path_buf(),
            data: on_mount.join("data"),
            archive: on_mount.join("archive"),
            acks: observer.join("acks.log"),
            boot_id: observer.join("boot_id"),
        }
    }

    fn host(&self) -> Result<Host, HostError> {
        let config = ArchiveConfig::new(&format!("file://{}", self.archive.display()))
            .expect("an absolute file:// URL")
            .ship_interval(SHIP_EVERY)
            .base_interval(BASE_EVERY);
        Host::builder(&self.data)
            .threads(2)
            .boot_id_file(&self.boot_id)
            .archive(config)
            .build()
    }

    /// A new boot id: before the first start (an unreadable file would
    /// count as a reboot after every stop, a kill with no cut too) and at
    /// each cut.
    fn reboot(&self) {
        std::fs::write(&self.boot_id, format!("{:032x}\n", rand::random::<u128>()))
            .expect("the boot id file, outside the mount");
    }
}

/// One acknowledged note.
#[derive(Debug, Clone)]
struct Ack {
    object: String,
    seq: u64,
    begun_ms: EpochMs,
    acked_ms: EpochMs,
}

/// The acknowledgements logged so far. A line the kill cut short has no
/// newline yet and is left out: its note was acknowledged, but what the
/// line says of it cannot be trusted.
fn read_acks(path: &Path) -> Vec<Ack> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => panic!("reading {}: {e}", path.display()),
    };
    text.split_inclusive('\n')
        .filter_map(|line| line.strip_suffix('\n'))
        .map(|line| {
            let parts: Vec<&str> = line.split(' ').collect();
            let [object, seq, begun, acked] = parts[..] else {
                panic!("a malformed acknowledgement line: {line:?}");
            };
            let number = |field: &str| -> i64 {
                field
                    .parse()
                    .unwrap_or_else(|e| panic!("{field:?} in {line:?}: {e}"))
            };
            Ack {
                object: object.to_owned(),
                seq: number(seq).try_into().expect("a non-negative seq"),
                begun_ms: number(begun),
                acked_ms: number(acked),
            }
        })
        .collect()
}

/// The writer child: an archived host adding numbered notes until it is
/// killed, logging each once its call returned (the reply released: the
/// note durable).
#[test]
#[ignore = "the writer child of the archive power-cut test; run by that test"]
fn archive_power_cut_writer_child() {
    let Some(args) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let args = args.to_string_lossy().into_owned();
    let (on_mount, observer) = args.split_once('\n').expect("two paths");
    let run = Run::new(Path::new(on_mount), Path::new(observer));
    let mut acks = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&run.acks)
        .expect("the acknowledgement log");
    runtime().block_on(async {
        let host = run.host().expect("the writer's host starts");
        let notes = notes(&host);
        for seq in 0u64.. {
            let object = name(seq);
            let text = seq.to_string();
            let begun = epoch_ms();
            notes
                .stub(&object)
                .expect("a valid object name")
                .call(move |o: Rc<Notes>| async move { o.add(&text) })
                .await
                .expect("the call is answered")
                .expect("the note is added");
            // One write per line: a kill leaves at most the last one cut
            // short, without its newline.
            acks.write_all(format!("{object} {seq} {begun} {}\n", epoch_ms()).as_bytes())
                .expect("logging the acknowledgement");
        }
    });
}

/// The notes each object holds in data directory `dir`, read from its
/// files without a host.
fn held_in(dir: &Path) -> BTreeMap<String, Vec<u64>> {
    let objects = durability_host::inspect::list_objects(dir)
        .unwrap_or_else(|e| panic!("listing the objects of {}: {e}", dir.display()));
    objects
        .into_iter()
        .filter(|o| o.namespace.as_deref() == Some("notes"))
        .map(|o| {
            let name = o.name.clone().expect("a notes object records its name");
            let held = durability_host::inspect::read_object(dir, &o.id, |sql| {
                sql.query("SELECT text FROM notes ORDER BY rowid", &[])
                    .expect("the notes table reads")
                    .iter()
                    .map(|row| {
                        let text = row.get::<String>(0).expect("a text note");
                        text.parse::<u64>().expect("a numbered note")
                    })
                    .collect::<Vec<_>>()
            })
            .unwrap_or_else(|e| panic!("reading {name}: {e}"))
            .unwrap_or_else(|| panic!("{name} ({}) is listed but has no file", o.id));
            (name, held)
        })
        .collect()
}

/// What a copy of the data breaks of the writers' record, as of moment
/// `at` (`EpochMs::MAX`: the data directory itself, which must hold every
/// acknowledged note): a note acknowledged by then and missing, a note
/// begun after it and held, a note no writer began (outside `unlogged`),
/// notes out of order. Returns the violations and how many acknowledged
/// notes were found where they must be.
fn judge(
    held: &BTreeMap<String, Vec<u64>>,
    acks: &[Ack],
    at: EpochMs,
    unlogged: &Range<u64>,
) -> (Vec<String>, usize) {
    let mut violations = Vec::new();
    let mut checked = 0;
    let empty = Vec::new();
    let mut begun: HashMap<&str, Vec<u64>> = HashMap::new();
    for ack in acks {
        begun.entry(&ack.object).or_default().push(ack.seq);
        let notes = held.get(&ack.object).unwrap_or(&empty);
        let holds = notes.contains(&ack.seq);
        if ack.acked_ms <= at {
            if holds {
                checked += 1;
            } else {
                violations.push(format!(
                    "{} lost note {} acknowledged at {}",
                    ack.object, ack.seq, ack.acked_ms
                ));
            }
        }
        if ack.begun_ms > at && holds {
            violations.push(format!(
                "{} holds note {} begun at {}, after {at}",
                ack.object, ack.seq, ack.begun_ms
            ));
        }
    }
    for (object, notes) in held {
        if notes.windows(2).any(|w| w[0] >= w[1]) {
            violations.push(format!("{object} holds its notes out of order: {notes:?}"));
        }
        let known = begun.get(object.as_str()).map_or(&[][..], Vec::as_slice);
        for seq in notes {
            if !known.contains(seq) && !unlogged.contains(seq) {
                violations.push(format!("{object} holds note {seq}, which no writer began"));
            }
        }
    }
    (violations, checked)
}

/// Restores the archive at `at` into `into` and judges the copy.
fn restore_and_judge(
    what: &str,
    run: &Run,
    into: &Path,
    at: EpochMs,
    acks: &[Ack],
    unlogged: &Range<u64>,
) -> (BTreeMap<String, Vec<u64>>, usize) {
    if let Err(error) = archive::restore_at(&run.archive, into, at) {
        panic!(
            "{what}: the restore at {at} failed: {error} ({error:?}); the manifest the cut \
             left names only what was synced before it, so this is a bug of the archive"
        );
    }
    let held = held_in(into);
    let (violations, checked) = judge(&held, acks, at, unlogged);
    assert!(
        violations.is_empty(),
        "{what}: the restore at {at}:\n{}",
        violations.join("\n")
    );
    (held, checked)
}

/// The kind of archive file a kill waits to see half written.
#[derive(Debug, Clone, Copy)]
enum Staged {
    /// A chunk of journal passes (`passes/.NAME.PID.tmp`).
    Chunk,
    /// The manifest (`.archive.json.PID.tmp`).
    Manifest,
    /// A base being copied (`bases/.NAME.partial-*`).
    Base,
}

impl Staged {
    fn of_seed(seed: u64) -> Staged {
        [Staged::Chunk, Staged::Manifest, Staged::Base][(seed % 3) as usize]
    }

    /// Whether such a file of `life` is being written now.
    fn seen(self, run: &Run, life: &str) -> bool {
        let lives = run.archive.join("lives").join(life);
        let (dir, marker) = match self {
            Staged::Chunk => (lives.join("passes"), ".passes."),
            Staged::Manifest => (run.archive.clone(), ".archive.json."),
            Staged::Base => (lives.join("bases"), ".partial-"),
        };
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.filter_map(Result::ok).any(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with('.') && name.contains(marker)
            })
        })
    }
}

fn manifest_of(run: &Run) -> Option<ArchiveManifest> {
    archive::read_manifest(&run.archive).ok()
}

/// Runs the writer until its archive has a base and shipped chunks that
/// hold `ACKS_BEFORE_KILL` acknowledged notes, then kills it, preferably
/// while a file of the `staged` kind is half written. Returns whether one
/// was.
fn write_then_kill(run: &Run, staged: Staged) -> bool {
    let child = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            "--exact",
            "archive_power_cut_writer_child",
            "--ignored",
            "--nocapture",
        ])
        .env(
            CHILD_ENV,
            format!("{}\n{}", run.on_mount.display(), run.observer.display()),
        )
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("the writer child starts");
    let mut writer = Writer(child);
    let deadline = Instant::now() + Duration::from_secs(60);
    let life = loop {
        if let Some(status) = writer.0.try_wait().expect("polling the writer") {
            panic!("the writer exited early: {status}");
        }
        assert!(Instant::now() < deadline, "the writer made no progress");
        // A restorable moment (chunks shipped after the first base
        // finished; before it the killed life could only be refused, as
        // `BeforeReach`, truthfully but with no restore to judge) that
        // covers `ACKS_BEFORE_KILL` acknowledgements: the writer runs
        // ahead of the archive by a few ship cycles.
        let shipping = manifest_of(run).and_then(|m| {
            let life = m.lives.into_iter().next()?;
            let first = life.bases.first()?;
            let shipped = read_acks(&run.acks)
                .iter()
                .filter(|a| a.acked_ms <= life.through_ms)
                .count();
            (life.through_ms > first.finished_ms && shipped >= ACKS_BEFORE_KILL).then_some(life.id)
        });
        if let Some(life) = shipping {
            break life;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let window = Instant::now() + KILL_WINDOW;
    let mut seen = false;
    while !seen && Instant::now() < window {
        seen = staged.seen(run, &life);
    }
    writer.0.kill().expect("killing the writer");
    writer.0.wait().expect("reaping the writer");
    seen
}

/// The writer child, killed and reaped however the parent leaves: a
/// failed assertion must not leave it writing on the mount.
struct Writer(std::process::Child);

impl Drop for Writer {
    fn drop(&mut self) {
        // Already reaped after a kill: both are no-ops then.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What one run checked.
#[derive(Default)]
struct Tally {
    runs: usize,
    killed_while_staging: usize,
    notes_checked: usize,
    /// Moments between the two lives refused as a gap (the others were
    /// restored and judged).
    refused_as_gap: usize,
}

/// One run: write, kill, cut with `fault` and `seed`, judge. Returns its
/// paths.
fn run_one(
    fs: &PowerCutFs,
    observer_root: &Path,
    fault: Fault,
    seed: u64,
    tally: &mut Tally,
) -> Run {
    let staged = Staged::of_seed(seed);
    let label = format!("{fault:?}-{seed}-{staged:?}");
    let observer = observer_root.join(&label);
    std::fs::create_dir(&observer).expect("the observer's directory");
    let run = Run::new(&fs.mountpoint().join(&label), &observer);
    run.reboot();

    tally.killed_while_staging += usize::from(write_then_kill(&run, staged));
    run.reboot();
    let cut = fs
        .cut(fault, seed)
        .unwrap_or_else(|e| panic!("{label}: the cut failed: {e}"));
    let what = format!("{label} ({cut:?})");
    let acks = read_acks(&run.acks);
    let last_logged = acks
        .iter()
        .map(|a| a.seq)
        .max()
        .expect("acknowledged notes");
    let unlogged = last_logged + 1..last_logged + 1 + UNLOGGED_SEQS;

    // 2. The killed life, as the cut left the archive.
    let manifest = archive::read_manifest(&run.archive)
        .unwrap_or_else(|e| panic!("{what}: the manifest does not read after the cut: {e}"));
    let killed = manifest.lives.first().expect("the killed life").clone();
    assert!(!killed.bases.is_empty(), "{what}: no base: {manifest:?}");
    let (held, checked) = restore_and_judge(
        &format!("{what}, killed life"),
        &run,
        &run.observer.join("restored-killed"),
        killed.through_ms,
        &acks,
        &unlogged,
    );
    // Half: the manifest the cut leaves may be a ship cycle older than
    // the one that armed the kill, never older than that (each `put`
    // syncs the directory before the next begins).
    assert!(
        checked >= ACKS_BEFORE_KILL / 2,
        "{what}: only {checked} acknowledged notes were shipped by {} ({} logged, the last at {}): {killed:?}",
        killed.through_ms,
        acks.len(),
        acks.last().map_or(0, |a| a.acked_ms),
    );
    tally.notes_checked += checked;
    judge_catches_a_damaged_copy(held, &acks, killed.through_ms, &unlogged);
    // A moment inside the killed life: from an older base, replay cut at
    // a pass boundary inside a chunk.
    let inside = rand::random_range(killed.bases[0].finished_ms..=killed.through_ms);
    let (_, checked) = restore_and_judge(
        &format!("{what}, inside the killed life"),
        &run,
        &run.observer.join("restored-inside"),
        inside,
        &acks,
        &unlogged,
    );
    tally.notes_checked += checked;

    // 1 and 3. A host started again, archiving, writes a note per object.
    let mut both = acks.clone();
    runtime().block_on(async {
        let host = run
            .host()
            .unwrap_or_else(|e| panic!("{what}: the host does not start after the cut: {e}"));
        let notes = notes(&host);
        for seq in unlogged.end..unlogged.end + OBJECTS {
            let object = name(seq);
            let text = seq.to_string();
            let begun_ms = epoch_ms();
            notes
                .stub(&object)
                .expect("a valid object name")
                .call(move |o: Rc<Notes>| async move { o.add(&text) })
                .await
                .unwrap_or_else(|e| panic!("{what}: a call after the restart: {e}"))
                .unwrap_or_else(|e| panic!("{what}: a note after the restart: {e}"));
            both.push(Ack {
                object,
                seq,
                begun_ms,
                acked_ms: epoch_ms(),
            });
        }
        let written = epoch_ms();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !manifest_of(&run).is_some_and(|m| {
            m.lives.get(1).is_some_and(|l| {
                !l.bases.is_empty() && l.shipped.is_some() && l.through_ms >= written
            })
        }) {
            assert!(
                Instant::now() < deadline,
                "{what}: the new life did not ship"
            );
            tokio::time::sleep(SHIP_EVERY).await;
        }
        host.shutdown().await;
    });
    let (violations, checked) = judge(&held_in(&run.data), &both, EpochMs::MAX, &unlogged);
    assert!(
        violations.is_empty(),
        "{what}: the data directory after the restart:\n{}",
        violations.join("\n")
    );
    tally.notes_checked += checked;

    let manifest = archive::read_manifest(&run.archive)
        .unwrap_or_else(|e| panic!("{what}: the manifest after the restart: {e}"));
    let [first, second] = &manifest.lives[..] else {
        panic!("{what}: two lives expected: {manifest:?}");
    };
    let (_, checked) = restore_and_judge(
        &format!("{what}, both lives"),
        &run,
        &run.observer.join("restored-both"),
        second.through_ms,
        &both,
        &unlogged,
    );
    // Every note of both lives was acknowledged before the new life's
    // end: all of them are checked, none is out of the restore's reach.
    assert_eq!(
        checked,
        both.len(),
        "{what}: checked at {}",
        second.through_ms
    );
    tally.notes_checked += checked;

    let new_base = second.bases[0].finished_ms;
    assert!(
        new_base > first.through_ms + 1,
        "{what}: no moment between the lives: {manifest:?}"
    );
    let between = first.through_ms + (new_base - first.through_ms) / 2;
    let into = run.observer.join("restored-between");
    match archive::restore_at(&run.archive, &into, between) {
        Err(ArchiveError::InGap { .. }) => tally.refused_as_gap += 1,
        Ok(_) => {
            let (violations, checked) = judge(&held_in(&into), &both, between, &unlogged);
            assert!(
                violations.is_empty(),
                "{what}: between the lives, at {between}:\n{}",
                violations.join("\n")
            );
            tally.notes_checked += checked;
        }
        Err(other) => panic!("{what}: between the lives, at {between}: {other:?}"),
    }
    tally.runs += 1;
    run
}

/// The negative control: the judge of a restored copy fails it once a
/// note it must hold is taken out, or one begun after the moment is put
/// in, so a passing run is not a judge that passes everything.
fn judge_catches_a_damaged_copy(
    mut held: BTreeMap<String, Vec<u64>>,
    acks: &[Ack],
    at: EpochMs,
    unlogged: &Range<u64>,
) {
    let last = acks
        .iter()
        .rev()
        .find(|a| a.acked_ms <= at)
        .expect("a note acknowledged by the moment");
    held.get_mut(&last.object)
        .expect("its object is held")
        .retain(|seq| *seq != last.seq);
    let (violations, _) = judge(&held, acks, at, unlogged);
    assert!(
        violations.iter().any(|v| v.contains("lost note")),
        "a copy without note {} passed: {violations:?}",
        last.seq
    );
    // Put back, and a note begun after the moment added instead.
    let later = Ack {
        object: last.object.clone(),
        seq: unlogged.end,
        begun_ms: at + 1,
        acked_ms: at + 2,
    };
    let notes = held.entry(last.object.clone()).or_default();
    notes.push(last.seq);
    notes.push(later.seq);
    let mut with_later = acks.to_vec();
    with_later.push(later);
    let (violations, _) = judge(&held, &with_later, at, unlogged);
    assert!(
        violations.iter().any(|v| v.contains("begun at")),
        "a copy with a note begun after {at} passed: {violations:?}"
    );
}

/// The negative control of the archive's side: a chunk the durable
/// manifest names, written again as `put` would write it without its
/// `fsync` (its data unsynced, its name synced), is emptied by a `Drop`
/// cut, and the restore of the killed life, which the runs require to
/// succeed, refuses it naming the file. So an archive that skipped a
/// chunk's fsync would fail this test.
fn a_chunk_written_without_its_fsync_fails_the_restore(fs: &PowerCutFs, run: &Run) {
    let manifest = archive::read_manifest(&run.archive).expect("the manifest reads");
    let killed = &manifest.lives[0];
    let base = killed
        .bases
        .iter()
        .filter(|b| b.finished_ms <= killed.through_ms)
        .max_by_key(|b| b.finished_ms)
        .expect("a base the killed life restores from");
    let passes = run.archive.join("lives").join(&killed.id).join("passes");
    let mut chunks: Vec<PathBuf> = std::fs::read_dir(&passes)
        .expect("the killed life's chunks")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "passes"))
        .collect();
    chunks.sort();
    // The chunk holding where the base began (names are zero-padded
    // positions, so they sort as positions do): every restore from the
    // base reads it.
    let from = base
        .from
        .map(|p| format!("{:020}-{:020}.passes", p.seq, p.offset));
    let chunk = chunks
        .iter()
        .rev()
        .find(|c| {
            from.as_deref()
                .is_some_and(|f| c.file_name().is_some_and(|n| n <= f))
        })
        .or(chunks.first())
        .expect("a chunk of the killed life")
        .clone();
    let bytes = std::fs::read(&chunk).expect("the chunk reads");
    std::fs::remove_file(&chunk).expect("the chunk is removed");
    std::fs::write(&chunk, &bytes).expect("the chunk is written again");
    std::fs::File::open(&passes)
        .and_then(|dir| dir.sync_all())
        .expect("its name is synced");
    fs.cut(Fault::Drop, 0).expect("the cut");
    let into = run.observer.join("restored-unsynced");
    match archive::restore_at(&run.archive, &into, killed.through_ms) {
        Err(ArchiveError::Damaged { file, .. }) => assert_eq!(file, chunk),
        other => panic!(
            "a chunk emptied by the cut was not refused naming {}: {other:?}",
            chunk.display()
        ),
    }
}

#[test]
fn a_power_cut_during_archiving_loses_nothing_acknowledged() {
    let started = Instant::now();
    let root = tempfile::tempdir().expect("a temporary directory");
    let (backing, mountpoint, observer) = (
        root.path().join("disk"),
        root.path().join("mnt"),
        root.path().join("observer"),
    );
    for dir in [&backing, &mountpoint, &observer] {
        std::fs::create_dir(dir).expect("the test's directories");
    }
    let fs = PowerCutFs::mount(&backing, &mountpoint)
        .expect("mounting the power-cut filesystem (needs root and /dev/fuse)");
    let mut tally = Tally::default();
    let mut last = None;
    for fault in FAULTS {
        for seed in SEEDS {
            last = Some(run_one(&fs, &observer, fault, seed, &mut tally));
        }
    }
    a_chunk_written_without_its_fsync_fails_the_restore(&fs, &last.expect("at least one run"));
    fs.unmount().expect("unmounting the power-cut filesystem");
    assert_eq!(tally.runs, FAULTS.len() * SEEDS.len());
    // Most kills must land while an archive file is half written, or the
    // runs test little more than a kill between two ship cycles.
    assert!(
        tally.killed_while_staging * 2 >= tally.runs,
        "only {} of {} kills met a staged archive file",
        tally.killed_while_staging,
        tally.runs
    );
    println!(
        "{} runs ({} killed while an archive file was staged), {} acknowledged notes checked, \
         {} moments between lives refused as a gap, in {:.1?}",
        tally.runs,
        tally.killed_while_staging,
        tally.notes_checked,
        tally.refused_as_gap,
        started.elapsed()
    );
}
