//! Backup, verify and restore of a data directory, on real SQLite files:
//! a backup taken while a host (of this process, or of a child process
//! killed with SIGKILL) writes holds every write acknowledged before its
//! object was copied; damaged copies and manifests are refused by name;
//! a restore refuses occupied directories and wakes the restored alarms.

mod support;

use std::io::{BufRead as _, Write as _};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use durability_host::backup::{self, BackupError, Manifest, Problem, Restore};
use durability_host::{Host, HostError, ObjectId};
use support::{Notes, epoch_ms, notes, notes_in, runtime};

const OBJECTS: usize = 12;

fn threaded_host(dir: &Path) -> Host {
    Host::builder(dir).threads(2).build().unwrap()
}

fn name(i: usize) -> String {
    format!("object-{i}")
}

/// Adds `note` to every object.
async fn add_everywhere(notes: &durability_host::Namespace<Notes>, note: &str) {
    for i in 0..OBJECTS {
        let note = note.to_owned();
        notes
            .stub(&name(i))
            .unwrap()
            .call(move |o: Rc<Notes>| async move { o.add(&note) })
            .await
            .unwrap()
            .unwrap();
    }
}

/// A data directory of `OBJECTS` objects with notes "a" and "b", and a
/// backup of it at `dest` taken by [`Host::backup`] while its host serves;
/// note "after" is written once the backup returned. Returns the ids.
fn served_and_backed_up(dir: &Path, dest: &Path) -> Vec<ObjectId> {
    runtime().block_on(async {
        let host = threaded_host(dir);
        let notes = notes(&host);
        add_everywhere(&notes, "a").await;
        add_everywhere(&notes, "b").await;
        let report = host.backup(dest).await.unwrap();
        assert_eq!(report.objects, OBJECTS as u64);
        assert_eq!(report.manifest_path, dest.join(backup::MANIFEST_FILE));
        add_everywhere(&notes, "after").await;
        host.shutdown().await;
        (0..OBJECTS)
            .map(|i| notes.id_of(&name(i)).unwrap())
            .collect()
    })
}

fn manifest_entry<'m>(manifest: &'m Manifest, id: &ObjectId) -> &'m backup::ObjectCopy {
    manifest
        .objects
        .iter()
        .find(|o| o.id == id.as_str())
        .unwrap()
}

#[test]
fn a_backup_taken_while_the_host_serves_restores_every_write_acknowledged_before_it() {
    let root = tempfile::tempdir().unwrap();
    let (data, dest, restored) = (
        root.path().join("data"),
        root.path().join("backup"),
        root.path().join("restored"),
    );
    let ids = served_and_backed_up(&data, &dest);

    let checked = backup::verify(&dest).unwrap();
    assert_eq!(checked.objects, OBJECTS as u64);
    for id in &ids {
        let entry = manifest_entry(&checked.manifest, id);
        assert_eq!(entry.namespace.as_deref(), Some("notes"));
        assert_eq!(entry.sha256.len(), 64);
    }
    assert_eq!(checked.manifest.host_version, env!("CARGO_PKG_VERSION"));
    let last = backup::last_backup(&data).expect("the backup is recorded in the data directory");
    assert_eq!(last.objects, OBJECTS as u64);

    let report = backup::restore(&dest, &restored, &Restore::all()).unwrap();
    assert_eq!(report.objects, OBJECTS as u64);
    for id in &ids {
        assert_eq!(notes_in(&restored, id), ["a", "b"], "object {id}");
    }
    assert!(restored.join(durability_host::INDEX_FILE).exists());
    assert!(!restored.join(backup::LAST_BACKUP_FILE).exists());
}

#[test]
fn backup_dir_copies_a_directory_that_a_host_holds() {
    let root = tempfile::tempdir().unwrap();
    let (data, dest) = (root.path().join("data"), root.path().join("backup"));
    runtime().block_on(async {
        let host = threaded_host(&data);
        let notes = notes(&host);
        add_everywhere(&notes, "a").await;
        // The lock is held (as by a host of another process): no journal
        // replay, a live copy.
        let report = durability_host::backup_dir(&data, &dest).unwrap();
        assert_eq!(report.objects, OBJECTS as u64);
        host.shutdown().await;
    });
    backup::verify(&dest).unwrap();
}

#[test]
fn restored_alarms_that_are_due_fire_on_a_started_host_without_a_call() {
    let root = tempfile::tempdir().unwrap();
    let (data, dest, restored) = (
        root.path().join("data"),
        root.path().join("backup"),
        root.path().join("restored"),
    );
    let (armed, at) = runtime().block_on(async {
        let host = threaded_host(&data);
        let notes = notes(&host);
        let at = host.now_ms() + 3_600_000;
        notes
            .stub("armed")
            .unwrap()
            .call(move |o: Rc<Notes>| async move { o.add_with_alarm("armed", at).await })
            .await
            .unwrap()
            .unwrap();
        add_everywhere(&notes, "plain").await;
        host.backup(&dest).await.unwrap();
        host.shutdown().await;
        (notes.id_of("armed").unwrap(), at)
    });
    let manifest = backup::read_manifest(&dest).unwrap();
    assert_eq!(manifest_entry(&manifest, &armed).alarm_ms, Some(at));
    let report = backup::restore(&dest, &restored, &Restore::all()).unwrap();
    assert_eq!(report.alarms, 1);

    // Two hours later, on paused time: nothing calls the object.
    let paused = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let log = paused.block_on(support::local(async {
        let host = Host::builder(&restored)
            .threads(0)
            .clock_start_ms(at + 3_600_000)
            .build()
            .unwrap();
        assert!(
            host.index_rebuild().is_none(),
            "the restore left a complete index"
        );
        let notes = notes(&host);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            host.live_objects(),
            1,
            "the alarm alone constructed its object"
        );
        let log = notes
            .stub("armed")
            .unwrap()
            .call(|o: Rc<Notes>| async move { o.alarm_log().unwrap() })
            .await
            .unwrap();
        host.shutdown().await;
        log
    }));
    assert_eq!(log.len(), 1, "the restored due alarm fired once: {log:?}");
}

/// A backup of a few objects, and the path of one object's copy.
fn backup_with_copy(root: &Path) -> (PathBuf, PathBuf, ObjectId) {
    let (data, dest) = (root.join("data"), root.join("backup"));
    let ids = served_and_backed_up(&data, &dest);
    let id = ids.first().unwrap().clone();
    let file = dest.join(&manifest_entry(&backup::read_manifest(&dest).unwrap(), &id).file);
    (dest, file, id)
}

/// `verify` and `restore` both refuse the backup, naming `file` with a
/// problem `matches` accepts, and the restore writes nothing.
fn refused_naming(dest: &Path, file: &Path, matches: fn(&Problem) -> bool) {
    let restored = dest.with_file_name("restored");
    for result in [
        backup::verify(dest).map(|_| ()),
        backup::restore(dest, &restored, &Restore::all()).map(|_| ()),
    ] {
        match result {
            Err(BackupError::Damaged { bad, .. }) => {
                assert_eq!(bad.len(), 1, "{bad:?}");
                let bad = bad.first().unwrap();
                assert_eq!(bad.file, file);
                assert!(matches(&bad.problem), "{:?}", bad.problem);
                assert!(bad.to_string().contains(&file.display().to_string()));
            }
            other => panic!("expected Damaged, got {other:?}"),
        }
    }
    assert!(!restored.exists(), "a refused restore wrote nothing");
    assert!(
        std::fs::read_dir(dest.parent().unwrap())
            .unwrap()
            .all(|e| !e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains("restoring")),
        "no temporary directory is left"
    );
}

#[test]
fn a_truncated_copy_is_refused_by_verify_and_restore_naming_its_file() {
    let root = tempfile::tempdir().unwrap();
    let (dest, file, _) = backup_with_copy(root.path());
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    refused_naming(&dest, &file, |p| matches!(p, Problem::Size { .. }));
}

#[test]
fn a_corrupted_copy_is_refused_by_verify_and_restore_naming_its_file() {
    let root = tempfile::tempdir().unwrap();
    let (dest, file, _) = backup_with_copy(root.path());
    let mut bytes = std::fs::read(&file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();
    refused_naming(&dest, &file, |p| matches!(p, Problem::Checksum { .. }));
}

#[test]
fn a_missing_copy_is_refused_naming_its_file() {
    let root = tempfile::tempdir().unwrap();
    let (dest, file, _) = backup_with_copy(root.path());
    std::fs::remove_file(&file).unwrap();
    refused_naming(&dest, &file, |p| matches!(p, Problem::Missing));
}

#[test]
fn a_copy_that_is_not_a_sound_database_fails_the_integrity_check() {
    let root = tempfile::tempdir().unwrap();
    let (dest, file, id) = backup_with_copy(root.path());
    // Damage whose checksum the manifest agrees with: only SQLite's own
    // check can tell.
    let mut bytes = std::fs::read(&file).unwrap();
    let page = 2048;
    for byte in bytes.iter_mut().skip(page).take(page) {
        *byte = 0x55;
    }
    std::fs::write(&file, &bytes).unwrap();
    let manifest_path = dest.join(backup::MANIFEST_FILE);
    let mut manifest: Manifest =
        serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    let digest = sha256_hex(&bytes);
    for object in &mut manifest.objects {
        if object.id == id.as_str() {
            object.sha256 = digest.clone();
        }
    }
    resign(&mut manifest);
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    refused_naming(&dest, &file, |p| matches!(p, Problem::Integrity { .. }));
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Recomputes a manifest's checksum as the release does.
fn resign(manifest: &mut Manifest) {
    manifest.checksum = String::new();
    manifest.checksum = sha256_hex(&serde_json::to_vec(&*manifest).unwrap());
}

#[test]
fn a_missing_or_damaged_manifest_is_refused_by_verify_and_restore() {
    let root = tempfile::tempdir().unwrap();
    let (dest, _, _) = backup_with_copy(root.path());
    let path = dest.join(backup::MANIFEST_FILE);
    let good = std::fs::read(&path).unwrap();
    let restored = root.path().join("restored");
    let refused = |expect: fn(&BackupError) -> bool| {
        let verified = backup::verify(&dest).unwrap_err();
        assert!(expect(&verified), "{verified:?}");
        assert!(verified.to_string().contains(&path.display().to_string()));
        let restore = backup::restore(&dest, &restored, &Restore::all()).unwrap_err();
        assert!(expect(&restore), "{restore:?}");
        assert!(!restored.exists());
    };

    std::fs::write(&path, &good[..good.len() / 2]).unwrap();
    refused(|e| matches!(e, BackupError::BadManifest { .. }));

    // Still valid JSON, one object less: the checksum tells.
    let mut manifest: Manifest = serde_json::from_slice(&good).unwrap();
    manifest.objects.pop();
    std::fs::write(&path, serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
    refused(|e| matches!(e, BackupError::BadManifest { .. }));

    std::fs::remove_file(&path).unwrap();
    refused(|e| matches!(e, BackupError::NoManifest { .. }));

    std::fs::write(&path, &good).unwrap();
    backup::verify(&dest).unwrap();
}

#[test]
fn verify_writes_nothing_into_the_backup() {
    let root = tempfile::tempdir().unwrap();
    let (dest, file, _) = backup_with_copy(root.path());
    let shard = file.parent().unwrap();
    let before: Vec<_> = std::fs::read_dir(shard)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    backup::verify(&dest).unwrap();
    let after: Vec<_> = std::fs::read_dir(shard)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before, after, "no -shm or -wal appeared beside the copy");
}

#[test]
fn restore_refuses_a_directory_that_is_not_empty_or_that_a_host_holds() {
    let root = tempfile::tempdir().unwrap();
    let (dest, _, _) = backup_with_copy(root.path());
    let occupied = root.path().join("occupied");
    std::fs::create_dir(&occupied).unwrap();
    std::fs::write(occupied.join("keep.txt"), b"mine").unwrap();
    let refused = backup::restore(&dest, &occupied, &Restore::all()).unwrap_err();
    assert!(
        matches!(&refused, BackupError::NotEmpty { entry, .. } if entry == "keep.txt"),
        "{refused:?}"
    );
    assert_eq!(std::fs::read(occupied.join("keep.txt")).unwrap(), b"mine");

    let held = root.path().join("held");
    runtime().block_on(async {
        let host = threaded_host(&held);
        let refused = backup::restore(&dest, &held, &Restore::all()).unwrap_err();
        assert!(
            matches!(
                &refused,
                BackupError::Host(HostError::DataDirInUse { holder_pid: Some(pid), .. })
                    if *pid == std::process::id()
            ),
            "{refused:?}"
        );
        host.shutdown().await;
    });

    // An empty directory is fine.
    let empty = root.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    backup::restore(&dest, &empty, &Restore::all()).unwrap();
}

#[test]
fn restore_of_chosen_objects_writes_only_those() {
    let root = tempfile::tempdir().unwrap();
    let (data, dest) = (root.path().join("data"), root.path().join("backup"));
    let ids = served_and_backed_up(&data, &dest);
    let (one, other) = (ids.first().unwrap(), ids.get(1).unwrap());
    let restored = root.path().join("restored");
    let report = backup::restore(
        &dest,
        &restored,
        &Restore::only([one.as_str(), one.as_str()]),
    )
    .unwrap();
    assert_eq!(report.objects, 1);
    assert_eq!(notes_in(&restored, one), ["a", "b"]);
    assert!(notes_in(&restored, other).is_empty());

    let unknown = "f".repeat(64);
    let refused = backup::restore(
        &dest,
        root.path().join("r2"),
        &Restore::only([unknown.clone()]),
    )
    .unwrap_err();
    assert!(
        matches!(&refused, BackupError::UnknownObject { id, .. } if *id == unknown),
        "{refused:?}"
    );
    let refused =
        backup::restore(&dest, root.path().join("r3"), &Restore::only(["../../etc"])).unwrap_err();
    assert!(
        matches!(&refused, BackupError::InvalidObjectId { .. }),
        "{refused:?}"
    );
}

#[test]
fn a_backup_never_writes_over_an_existing_destination_or_inside_its_data_directory() {
    let root = tempfile::tempdir().unwrap();
    let (data, dest) = (root.path().join("data"), root.path().join("backup"));
    served_and_backed_up(&data, &dest);
    let manifest = std::fs::read(dest.join(backup::MANIFEST_FILE)).unwrap();
    let refused = durability_host::backup_dir(&data, &dest).unwrap_err();
    assert!(
        matches!(refused, BackupError::DestinationExists { .. }),
        "{refused:?}"
    );
    assert_eq!(
        std::fs::read(dest.join(backup::MANIFEST_FILE)).unwrap(),
        manifest
    );
    let refused = durability_host::backup_dir(&data, data.join("backups/1")).unwrap_err();
    assert!(
        matches!(refused, BackupError::InvalidDestination { .. }),
        "{refused:?}"
    );
}

// ---- A host in a child process, killed with SIGKILL ---------------------

/// Where the child writer's data directory is; set only for the child.
const CHILD_DIR_ENV: &str = "DURABILITY_BACKUP_TEST_CHILD_DIR";
const WRITER_OBJECTS: usize = 8;

fn acks_file(data: &Path) -> PathBuf {
    data.with_file_name("acks.log")
}

/// The child of
/// [`a_backup_while_a_host_of_another_process_writes_holds_every_acknowledged_write`]:
/// a host that adds numbered notes to its objects until it is killed, and
/// appends `object seq ms` to an acknowledgement log once each call
/// returned (its reply released: the note is durable).
#[test]
#[ignore = "the writer child of a backup test; run by that test"]
fn backup_writer_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR_ENV).map(PathBuf::from) else {
        return;
    };
    let mut acks = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(acks_file(&dir))
        .unwrap();
    runtime().block_on(async {
        let host = threaded_host(&dir);
        let notes = notes(&host);
        for seq in 0u64.. {
            let object = name(seq as usize % WRITER_OBJECTS);
            let text = seq.to_string();
            notes
                .stub(&object)
                .unwrap()
                .call(move |o: Rc<Notes>| async move { o.add(&text) })
                .await
                .unwrap()
                .unwrap();
            writeln!(acks, "{object} {seq} {}", epoch_ms()).unwrap();
        }
    });
}

/// The acknowledgement log: (object name, seq, ms). A line the kill cut
/// short is dropped.
fn read_acks(data: &Path) -> Vec<(String, u64, i64)> {
    let file = std::fs::File::open(acks_file(data)).unwrap();
    std::io::BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| {
            let mut parts = line.split(' ');
            let (object, seq, ms) = (parts.next()?, parts.next()?, parts.next()?);
            Some((object.to_owned(), seq.parse().ok()?, ms.parse().ok()?))
        })
        .collect()
}

fn wait_for_acks(data: &Path, at_least: usize, child: &mut std::process::Child) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !acks_file(data).exists() || read_acks(data).len() < at_least {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the writer child exited early"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "the writer child made no progress"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Checks a restored directory against the acknowledgements: every note
/// acknowledged before its object's copy began (all of them when
/// `copied_ms` is `None`) is there, and each object holds a gapless
/// prefix of its own writes. Returns how many acknowledged notes it
/// found.
fn check_restored(
    restored: &Path,
    acks: &[(String, u64, i64)],
    manifest: &Manifest,
    ids: &[(String, ObjectId)],
    all_acknowledged: bool,
) -> usize {
    let mut found = 0;
    for (object, id) in ids {
        let held: Vec<u64> = notes_in(restored, id)
            .iter()
            .map(|t| t.parse().unwrap())
            .collect();
        let mine: Vec<u64> = acks
            .iter()
            .filter(|(o, _, _)| o == object)
            .map(|(_, seq, _)| *seq)
            .collect();
        let copied_ms = manifest_entry(manifest, id).copied_ms;
        for (o, seq, ms) in acks {
            if o == object && (all_acknowledged || *ms < copied_ms) {
                assert!(
                    held.contains(seq),
                    "{object}: acknowledged note {seq} is lost"
                );
                found += 1;
            }
        }
        // Writes of one object are sequential: the copy is a prefix of
        // them (with at most the one in flight beyond the acknowledged).
        let prefix: Vec<u64> = mine.iter().copied().take(held.len()).collect();
        let acked_part: Vec<u64> = held.iter().copied().take(prefix.len()).collect();
        assert_eq!(acked_part, prefix, "{object}: not a prefix of its writes");
        assert!(held.len() <= mine.len() + 1, "{object}: notes nobody wrote");
    }
    found
}

#[test]
fn a_backup_while_a_host_of_another_process_writes_holds_every_acknowledged_write() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "backup_writer_child", "--ignored", "--nocapture"])
        .env(CHILD_DIR_ENV, &data)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for_acks(&data, 300, &mut child);
    let live = root.path().join("live");
    let report = durability_host::backup_dir(&data, &live);
    let acked_then = read_acks(&data).len();
    wait_for_acks(&data, acked_then + 100, &mut child);
    child.kill().unwrap();
    child.wait().unwrap();
    let report = report.unwrap();
    assert_eq!(report.objects, WRITER_OBJECTS as u64);

    let acks = read_acks(&data);
    let ids: Vec<(String, ObjectId)> = (0..WRITER_OBJECTS)
        .map(|i| {
            let object = name(i);
            let id = report
                .manifest
                .objects
                .iter()
                .find(|o| o.name.as_deref() == Some(&object))
                .map(|o| ObjectId::new(o.id.clone()))
                .unwrap();
            (object, id)
        })
        .collect();
    let restored = root.path().join("restored");
    backup::restore(&live, &restored, &Restore::all()).unwrap();
    let found = check_restored(&restored, &acks, &report.manifest, &ids, false);
    assert!(found >= 300, "only {found} acknowledged notes were checked");

    // After the kill no host holds the directory: a backup replays the
    // journal first, and holds every acknowledged note.
    let stopped = root.path().join("stopped");
    let report = durability_host::backup_dir(&data, &stopped).unwrap();
    let restored = root.path().join("restored-stopped");
    backup::restore(&stopped, &restored, &Restore::all()).unwrap();
    let found = check_restored(&restored, &acks, &report.manifest, &ids, true);
    assert_eq!(found, acks.len());
}
