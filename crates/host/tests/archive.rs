//! The continuous archive and restores at a moment, with real parts: a
//! host of a child process writing acknowledged notes (SIGKILLed at the
//! end), restores at random moments of its run checked against its
//! acknowledgement log, damaged chunks refused by name, and a store that
//! fails while the host serves.

mod support;

use std::io::{BufRead as _, Write as _};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use durability_host::archive::{self, ArchiveConfig, ArchiveError};
use durability_host::{FlushMethod, Host, HostError, ObjectId, Synchronous};
use rand::Rng as _;
use support::{
    Notes, add_note, epoch_ms, notes, notes_in, numbered_notes, numbered_notes_of, object_named,
    runtime,
};

const OBJECTS: usize = 6;
/// Objects the child writer creates once the archive has a base.
const NEW_OBJECTS: usize = 3;
/// Ships often so a test's run spans many chunks.
const SHIP_EVERY: Duration = Duration::from_millis(50);

fn url(root: &Path) -> String {
    format!("file://{}", root.display())
}

fn archived_host(data: &Path, archive_root: &Path) -> Host {
    Host::builder(data)
        .threads(2)
        .archive(
            ArchiveConfig::new(&url(archive_root))
                .unwrap()
                .ship_interval(SHIP_EVERY),
        )
        .build()
        .unwrap()
}

fn name(i: usize) -> String {
    format!("object-{i}")
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn has_base(root: &Path) -> bool {
    archive::read_manifest(root).is_ok_and(|m| m.lives.iter().any(|l| !l.bases.is_empty()))
}

// ---- A host in a child process ------------------------------------------

const CHILD_ENV: &str = "DURABILITY_ARCHIVE_TEST_CHILD";

fn acks_file(data: &Path) -> PathBuf {
    data.with_file_name("acks.log")
}

/// The child of
/// [`a_restore_at_any_moment_holds_every_note_acknowledged_before_it_and_none_begun_after`]:
/// a host archiving to `archive/` beside its data directory adds numbered
/// notes until it is killed, and logs `object seq begun_ms acked_ms` for
/// each once its call returned (the reply released: the note durable).
#[test]
#[ignore = "the writer child of an archive test; run by that test"]
fn archive_writer_child() {
    let Some(data) = std::env::var_os(CHILD_ENV).map(PathBuf::from) else {
        return;
    };
    let archive_root = data.with_file_name("archive");
    let mut acks = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(acks_file(&data))
        .unwrap();
    runtime().block_on(async {
        let host = archived_host(&data, &archive_root);
        let notes = notes(&host);
        let mut objects = OBJECTS;
        for seq in 0u64.. {
            // Once a base exists, objects it cannot hold join: a restore
            // builds them from their first WAL frames.
            if objects == OBJECTS && seq % 100 == 0 && has_base(&archive_root) {
                objects = OBJECTS + NEW_OBJECTS;
            }
            let object = name(seq as usize % objects);
            let text = seq.to_string();
            let begun = epoch_ms();
            add_note(&notes, &object, text).await;
            writeln!(acks, "{object} {seq} {begun} {}", epoch_ms()).unwrap();
            if seq % 64 == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
}

/// (object, seq, begun_ms, acked_ms); a line the kill cut short is dropped.
fn read_acks(data: &Path) -> Vec<(String, u64, i64, i64)> {
    let Ok(file) = std::fs::File::open(acks_file(data)) else {
        return Vec::new();
    };
    std::io::BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| {
            let mut parts = line.split(' ');
            let (object, seq, begun, acked) =
                (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
            Some((
                object.to_owned(),
                seq.parse().ok()?,
                begun.parse().ok()?,
                acked.parse().ok()?,
            ))
        })
        .collect()
}

#[test]
fn a_restore_at_any_moment_holds_every_note_acknowledged_before_it_and_none_begun_after() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let archive_root = root.path().join("archive");
    std::fs::create_dir(&data).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "archive_writer_child",
            "--ignored",
            "--nocapture",
        ])
        .env(CHILD_ENV, &data)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_until("a base and 200 acknowledged notes", || {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the writer exited early"
        );
        has_base(&archive_root) && read_acks(&data).len() >= 200
    });
    let then = read_acks(&data).len();
    wait_until("2,000 more notes", || {
        read_acks(&data).len() >= then + 2_000
    });
    child.kill().unwrap();
    child.wait().unwrap();

    let acks = read_acks(&data);
    let manifest = archive::read_manifest(&archive_root).unwrap();
    let life = &manifest.lives[0];
    let base = &life.bases[0];
    assert!(life.through_ms > base.finished_ms, "{manifest:?}");
    let in_base = archive_root.join(&base.dir);
    let base_objects = durability_host::backup::read_manifest(&in_base)
        .unwrap()
        .objects
        .len();
    assert!(
        base_objects <= OBJECTS,
        "the base holds {base_objects} objects"
    );
    let mut rng = rand::rng();
    // The last moment first: every object exists then, and its ids name
    // them in the earlier restores (where the later ones may be absent).
    let mut moments = vec![life.through_ms];
    moments.extend((0..6).map(|_| rng.random_range(base.finished_ms..=life.through_ms)));
    let mut ids: Vec<(String, ObjectId)> = Vec::new();
    let mut checked = 0;
    for (n, at) in moments.into_iter().enumerate() {
        let restored = root.path().join(format!("restored-{n}"));
        let report = archive::restore_at(&archive_root, &restored, at)
            .unwrap_or_else(|e| panic!("restore at {at}: {e:?}"));
        assert_eq!(report.at_ms, at);
        if ids.is_empty() {
            ids = (0..OBJECTS + NEW_OBJECTS)
                .map(|i| (name(i), object_named(&restored, &name(i))))
                .collect();
        }
        for (object, id) in &ids {
            let held = numbered_notes(&restored, id);
            for (o, seq, begun, acked) in &acks {
                if o != object {
                    continue;
                }
                if *acked <= at {
                    assert!(
                        held.contains(seq),
                        "at {at}: {object} lost note {seq} acknowledged at {acked}"
                    );
                    checked += 1;
                }
                if *begun > at {
                    assert!(
                        !held.contains(seq),
                        "at {at}: {object} holds note {seq} begun at {begun}"
                    );
                }
            }
            let mine: Vec<u64> = acks
                .iter()
                .filter(|(o, ..)| o == object)
                .map(|(_, seq, ..)| *seq)
                .collect();
            let prefix: Vec<u64> = mine.iter().copied().take(held.len()).collect();
            assert_eq!(
                held.iter().copied().take(prefix.len()).collect::<Vec<_>>(),
                prefix,
                "at {at}: {object} is not a prefix of its writes"
            );
        }
    }
    assert!(
        checked >= 200,
        "only {checked} acknowledged notes were checked"
    );
}

// ---- Refusals -----------------------------------------------------------

/// An archive of a host (this process) that wrote three rounds of notes
/// a few ship intervals apart, stopped cleanly. Returns (root, moment
/// after the last write).
fn archived_rounds(root: &Path) -> (PathBuf, i64) {
    let data = root.join("data");
    let archive_root = root.join("archive");
    runtime().block_on(async {
        let host = archived_host(&data, &archive_root);
        let notes = notes(&host);
        for round in 0..3u64 {
            for i in 0..OBJECTS {
                let text = (round * 100 + i as u64).to_string();
                add_note(&notes, &name(i), text).await;
            }
            tokio::time::sleep(SHIP_EVERY * 4).await;
            if round == 0 {
                while !has_base(&archive_root) {
                    tokio::time::sleep(SHIP_EVERY).await;
                }
            }
        }
        host.shutdown().await;
    });
    let manifest = archive::read_manifest(&archive_root).unwrap();
    (archive_root, manifest.lives[0].through_ms)
}

fn chunks(archive_root: &Path) -> Vec<PathBuf> {
    let manifest = archive::read_manifest(archive_root).unwrap();
    let dir = archive_root
        .join("lives")
        .join(&manifest.lives[0].id)
        .join("passes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

fn refused_naming(archive_root: &Path, at: i64, into: &Path, file: &Path) {
    match archive::restore_at(archive_root, into, at) {
        Err(ArchiveError::Damaged { file: named, .. }) => assert_eq!(named, file),
        other => panic!("expected a refusal naming {}: {other:?}", file.display()),
    }
    assert!(!into.exists(), "a refused restore left {}", into.display());
}

#[test]
fn a_truncated_corrupted_or_missing_chunk_is_refused_naming_its_file() {
    let root = tempfile::tempdir().unwrap();
    let (archive_root, at) = archived_rounds(root.path());
    let files = chunks(&archive_root);
    assert!(files.len() >= 2, "{files:?}");
    let whole = archive::restore_at(&archive_root, root.path().join("whole"), at).unwrap();
    assert!(whole.transactions > 0);

    let last = files.last().unwrap();
    let bytes = std::fs::read(last).unwrap();
    std::fs::write(last, &bytes[..bytes.len() - 100]).unwrap();
    refused_naming(&archive_root, at, &root.path().join("r1"), last);

    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 0x40;
    std::fs::write(last, &flipped).unwrap();
    refused_naming(&archive_root, at, &root.path().join("r2"), last);
    std::fs::write(last, &bytes).unwrap();

    // A chunk in the middle removed: the restore names it.
    let middle = &files[files.len() - 2];
    let kept = std::fs::read(middle).unwrap();
    std::fs::remove_file(middle).unwrap();
    refused_naming(&archive_root, at, &root.path().join("r3"), middle);
    std::fs::write(middle, kept).unwrap();
    archive::restore_at(&archive_root, root.path().join("again"), at).unwrap();
}

#[test]
fn moments_before_the_first_base_after_the_last_shipped_pass_or_in_a_gap_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let (archive_root, through) = archived_rounds(root.path());
    let manifest = archive::read_manifest(&archive_root).unwrap();
    let first = manifest.lives[0].bases[0].finished_ms;
    assert!(matches!(
        archive::restore_at(&archive_root, root.path().join("a"), first - 1),
        Err(ArchiveError::BeforeReach { .. })
    ));
    assert!(matches!(
        archive::restore_at(&archive_root, root.path().join("b"), through + 60_000),
        Err(ArchiveError::AfterReach { .. })
    ));
    // A second life killed before... here: started again, it records the
    // moments between the first life's end and its own base as a gap.
    let data = root.path().join("data");
    runtime().block_on(async {
        let host = archived_host(&data, &archive_root);
        let notes = notes(&host);
        add_note(&notes, &name(0), "999").await;
        while archive::read_manifest(&archive_root)
            .unwrap()
            .gaps
            .is_empty()
        {
            tokio::time::sleep(SHIP_EVERY).await;
        }
        host.shutdown().await;
    });
    let manifest = archive::read_manifest(&archive_root).unwrap();
    let gap = &manifest.gaps[0];
    assert!(gap.to_ms > gap.from_ms + 1, "{gap:?}");
    assert!(matches!(
        archive::restore_at(&archive_root, root.path().join("c"), gap.from_ms + 1),
        Err(ArchiveError::InGap { .. })
    ));
    let after = manifest.lives[1].through_ms;
    let restored = root.path().join("d");
    archive::restore_at(&archive_root, &restored, after).unwrap();
    assert_eq!(
        numbered_notes_of(&restored, "object-0"),
        vec![0, 100, 200, 999]
    );
}

#[test]
fn the_archive_is_refused_in_modes_without_the_journal_naming_the_mode() {
    let root = tempfile::tempdir().unwrap();
    let config = ArchiveConfig::new(&url(&root.path().join("archive"))).unwrap();
    let built = |b: durability_host::HostBuilder| b.archive(config.clone()).threads(1).build();
    let data = root.path().join("data");
    for (builder, mode) in [
        (
            Host::builder(&data).synchronous(Synchronous::Full),
            "Synchronous::Full",
        ),
        (
            Host::builder(&data).synchronous(Synchronous::Normal),
            "Synchronous::Normal",
        ),
        (
            Host::builder(&data).flush_method(FlushMethod::WalFiles),
            "FlushMethod::WalFiles",
        ),
    ] {
        match built(builder) {
            Err(HostError::ArchiveNeedsJournal { mode: named }) => assert_eq!(named, mode),
            Err(other) => panic!("{mode}: {other}"),
            Ok(_) => panic!("{mode}: built"),
        }
    }
}

#[test]
fn archive_settings_out_of_their_bounds_are_refused_at_build_naming_the_setting() {
    let root = tempfile::tempdir().unwrap();
    let config = ArchiveConfig::new(&url(&root.path().join("archive"))).unwrap();
    for (bad, named) in [
        (
            config.clone().retention(Duration::ZERO),
            "archive retention",
        ),
        (
            config.clone().ship_interval(Duration::ZERO),
            "archive ship_interval",
        ),
        (
            config.clone().ship_interval(Duration::from_secs(61)),
            "archive ship_interval",
        ),
        (
            config.clone().base_interval(Duration::ZERO),
            "archive base_interval",
        ),
    ] {
        match Host::builder(root.path().join("data"))
            .threads(1)
            .archive(bad)
            .build()
        {
            Err(HostError::InvalidSetting { setting, .. }) => assert_eq!(setting, named),
            Err(other) => panic!("{named}: {other}"),
            Ok(_) => panic!("{named}: built"),
        }
    }
    assert!(
        !root.path().join("archive").exists(),
        "a refused build wrote to the archive"
    );
}

#[test]
fn a_host_stopped_before_its_first_base_takes_one_on_its_way_out() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let archive_root = root.path().join("archive");
    runtime().block_on(async {
        // The first cycle would come a minute after the start.
        let host = Host::builder(&data)
            .threads(1)
            .archive(
                ArchiveConfig::new(&url(&archive_root))
                    .unwrap()
                    .ship_interval(Duration::from_secs(60)),
            )
            .build()
            .unwrap();
        let notes = notes(&host);
        add_note(&notes, &name(0), "7").await;
        host.shutdown().await;
    });
    let manifest = archive::read_manifest(&archive_root).unwrap();
    let life = &manifest.lives[0];
    assert!(life.closed, "{manifest:?}");
    assert_eq!(life.bases.len(), 1, "{manifest:?}");
    let restored = root.path().join("restored");
    archive::restore_at(&archive_root, &restored, life.through_ms).unwrap();
    assert_eq!(numbered_notes_of(&restored, &name(0)), vec![7]);
}

#[test]
fn the_next_host_removes_the_half_written_files_a_killed_one_left_in_the_archive() {
    let root = tempfile::tempdir().unwrap();
    let (archive_root, _) = archived_rounds(root.path());
    let life = archive::read_manifest(&archive_root).unwrap().lives[0]
        .id
        .clone();
    let lives = archive_root.join("lives").join(&life);
    // What a writer killed mid-file leaves: a staged manifest, a staged
    // chunk, a base being copied.
    let leftovers = [
        archive_root.join(".archive.json.4242.tmp"),
        lives.join("passes/.00000000000000000001-00000000000000999999.passes.4242.tmp"),
        lives.join("bases/.1796620049127.partial-4242-7/objects/ab/copy.sqlite"),
    ];
    for file in &leftovers {
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, b"half written").unwrap();
    }
    let data = root.path().join("data");
    runtime().block_on(async {
        let host = archived_host(&data, &archive_root);
        while archive::read_manifest(&archive_root).unwrap().lives.len() < 2 {
            tokio::time::sleep(SHIP_EVERY).await;
        }
        host.shutdown().await;
    });
    for file in &leftovers {
        assert!(!file.exists(), "{} is still there", file.display());
    }
    assert!(!lives.join("bases/.1796620049127.partial-4242-7").exists());
    archive::verify(&archive_root).unwrap();
}

/// Base directories of the archive at `root`, as the disk holds them.
fn base_dirs_on_disk(root: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for life in std::fs::read_dir(root.join("lives")).unwrap() {
        let bases = life.unwrap().path().join("bases");
        if let Ok(entries) = std::fs::read_dir(bases) {
            dirs.extend(entries.map(|e| e.unwrap().path()));
        }
    }
    dirs.sort();
    dirs
}

#[test]
fn retention_drops_old_bases_and_the_chunks_before_them_keeping_every_moment_it_promises() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let archive_root = root.path().join("archive");
    let retention = Duration::from_millis(400);
    let mut written = Vec::new();
    let started = epoch_ms();
    runtime().block_on(async {
        let host = Host::builder(&data)
            .threads(2)
            .archive(
                ArchiveConfig::new(&url(&archive_root))
                    .unwrap()
                    .ship_interval(SHIP_EVERY)
                    .base_interval(Duration::from_millis(150))
                    .retention(retention),
            )
            .build()
            .unwrap();
        let notes = notes(&host);
        // Notes over about 2 s: a dozen bases, most of them past retention.
        for seq in 0..40u64 {
            let text = seq.to_string();
            add_note(&notes, &name(seq as usize % OBJECTS), text).await;
            written.push(seq);
            tokio::time::sleep(SHIP_EVERY).await;
        }
        host.shutdown().await;
    });
    let manifest = archive::read_manifest(&archive_root).unwrap();
    let life = &manifest.lives[0];
    let earliest = manifest.earliest_ms().unwrap();
    let through = manifest.through_ms().unwrap();
    // Old bases went, on disk and in the manifest; what stays still
    // reaches back a whole retention from the last base.
    assert!(
        life.bases.len() >= 2 && earliest > started + 300,
        "nothing was dropped: {manifest:?}"
    );
    let newest = life.bases.last().unwrap().finished_ms;
    assert!(
        newest - earliest >= retention.as_millis() as i64 - 150,
        "retention cut too deep: {earliest} .. {newest}"
    );
    let on_disk = base_dirs_on_disk(&archive_root);
    let named: Vec<PathBuf> = life
        .bases
        .iter()
        .map(|b| archive_root.join(&b.dir))
        .collect();
    assert_eq!(on_disk, named, "base directories beyond the manifest's");
    // The chunks before the oldest base's start are gone, but for the one
    // a restore from it reads first.
    let kept = chunks(&archive_root);
    let from = life.bases[0].from.unwrap();
    let before = kept
        .iter()
        .filter(|path| {
            let name = path.file_name().unwrap().to_str().unwrap();
            let (seq, start) = name.trim_end_matches(".passes").split_once('-').unwrap();
            (seq.parse::<u64>().unwrap(), start.parse::<u64>().unwrap()) < (from.seq, from.offset)
        })
        .count();
    assert!(
        before <= 2,
        "{before} chunks before the oldest base's start"
    );
    archive::verify(&archive_root).unwrap();
    // Every moment from the oldest base on restores; one before is refused.
    let restored = root.path().join("restored");
    archive::restore_at(&archive_root, &restored, through).unwrap();
    let mut held: Vec<u64> = (0..OBJECTS)
        .flat_map(|i| numbered_notes_of(&restored, &name(i)))
        .collect();
    held.sort_unstable();
    assert_eq!(held, written);
    archive::restore_at(&archive_root, root.path().join("at-earliest"), earliest).unwrap();
    assert!(matches!(
        archive::restore_at(&archive_root, root.path().join("before"), earliest - 1),
        Err(ArchiveError::BeforeReach { .. })
    ));
}

#[test]
fn an_archive_catching_up_ships_the_backlog_in_chunks_of_bounded_size() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let archive_root = root.path().join("archive");
    let aside = root.path().join("archive-aside");
    // 40 notes of 1 MiB of random hex: over 40 MiB of journal, shipped
    // after the store comes back.
    let mut rng = rand::rng();
    let bodies: Vec<String> = (0..40)
        .map(|_| {
            (0..1 << 19)
                .map(|_| format!("{:02x}", rng.random::<u8>()))
                .collect()
        })
        .collect();
    runtime().block_on(async {
        let host = archived_host(&data, &archive_root);
        let notes = notes(&host);
        add_note(&notes, &name(0), "0").await;
        while !has_base(&archive_root) || host.archive_lag() != Some(Duration::ZERO) {
            tokio::time::sleep(SHIP_EVERY).await;
        }
        std::fs::rename(&archive_root, &aside).unwrap();
        std::fs::write(&archive_root, b"not a directory").unwrap();
        for body in &bodies {
            let body = body.clone();
            add_note(&notes, &name(1), body).await;
        }
        std::fs::remove_file(&archive_root).unwrap();
        std::fs::rename(&aside, &archive_root).unwrap();
        while host.archive_lag() != Some(Duration::ZERO) {
            tokio::time::sleep(SHIP_EVERY).await;
        }
        host.shutdown().await;
    });
    // How much journal each chunk holds, from the places its name gives
    // (segment, start): the next chunk's start less its own. However well
    // the data compresses, no chunk may span more than 16 MiB, and one
    // more 1 MiB pass riding along.
    let places: Vec<(u64, u64)> = chunks(&archive_root)
        .iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_str().unwrap();
            let (seq, start) = name.trim_end_matches(".passes").split_once('-').unwrap();
            (seq.parse().unwrap(), start.parse().unwrap())
        })
        .collect();
    let spans: Vec<u64> = places
        .windows(2)
        .filter(|w| w[0].0 == w[1].0)
        .map(|w| w[1].1 - w[0].1)
        .collect();
    assert!(
        spans.iter().filter(|&&span| span > 4 << 20).count() >= 2,
        "the backlog went in fewer pieces: {places:?}"
    );
    assert!(
        spans.iter().all(|&span| span <= 18 << 20),
        "a chunk over 16 MiB of journal: {places:?}"
    );
    let through = archive::read_manifest(&archive_root).unwrap().lives[0].through_ms;
    let restored = root.path().join("restored");
    archive::restore_at(&archive_root, &restored, through).unwrap();
    let held = notes_in(&restored, &object_named(&restored, &name(1)));
    assert!(
        held == bodies,
        "the restored notes differ from those written"
    );
}

// ---- A store that fails -------------------------------------------------

#[test]
fn a_failing_store_lets_the_host_serve_shows_the_lag_and_catches_up_losing_nothing() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let archive_root = root.path().join("archive");
    let aside = root.path().join("archive-aside");
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::set_global_recorder(recorder).unwrap();
    let lag_gauge = || {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .find(|(key, ..)| key.key().name() == durability_host::telemetry::ARCHIVE_LAG)
            .and_then(|(.., value)| match value {
                metrics_util::debugging::DebugValue::Gauge(v) => Some(v.into_inner()),
                _ => None,
            })
    };
    let at = runtime().block_on(async {
        let host = archived_host(&data, &archive_root);
        let notes = notes(&host);
        let add = |i: usize, seq: u64| {
            let text = seq.to_string();
            let stub = notes.stub(&name(i)).unwrap();
            async move {
                stub.call(move |o: Rc<Notes>| async move { o.add(&text) })
                    .await
                    .unwrap()
                    .unwrap();
            }
        };
        for i in 0..OBJECTS {
            add(i, 1).await;
        }
        while !has_base(&archive_root) || host.archive_lag() != Some(Duration::ZERO) {
            tokio::time::sleep(SHIP_EVERY).await;
        }
        // The store goes away: a file where its directory was.
        std::fs::rename(&archive_root, &aside).unwrap();
        std::fs::write(&archive_root, b"not a directory").unwrap();
        for i in 0..OBJECTS {
            add(i, 2).await;
        }
        while host.archive_lag().unwrap() < SHIP_EVERY * 4 {
            tokio::time::sleep(SHIP_EVERY).await;
        }
        assert!(lag_gauge().is_some_and(|v| v > 0.0), "{:?}", lag_gauge());
        // Still serving while behind.
        for i in 0..OBJECTS {
            add(i, 3).await;
        }
        let written = epoch_ms();
        std::fs::remove_file(&archive_root).unwrap();
        std::fs::rename(&aside, &archive_root).unwrap();
        while host.archive_lag() != Some(Duration::ZERO) {
            tokio::time::sleep(SHIP_EVERY).await;
        }
        assert_eq!(lag_gauge(), Some(0.0));
        host.shutdown().await;
        written
    });
    let restored = root.path().join("restored");
    archive::restore_at(&archive_root, &restored, at).unwrap();
    for object in durability_host::inspect::list_objects(&restored).unwrap() {
        assert_eq!(
            numbered_notes(&restored, &ObjectId::new(object.id.clone())),
            vec![1, 2, 3],
            "{object:?}"
        );
    }
}
