//! The alarm index is derived data: a missing, corrupt or incomplete
//! `index.sqlite` is rebuilt from the object files when the host starts,
//! and every armed alarm fires without anything calling its object.

mod support;

use std::path::Path;
use std::rc::Rc;
use std::time::Duration;

use durability_host::{Host, HostError, INDEX_FILE, RebuildReason, SQLITE_MAX_PATH_BYTES};
use durability_platform::Context;
use support::{Notes, local, notes};

const START_MS: i64 = 50_000_000;
const IN_A_MINUTE: i64 = START_MS + 60_000;

fn host_at(dir: &Path, start_ms: i64) -> Result<Host, HostError> {
    Host::builder(dir)
        .threads(0)
        .clock_start_ms(start_ms)
        .build()
}

/// A first host arms `armed` a minute ahead and touches `unarmed`, then
/// shuts down.
async fn arm(dir: &Path) {
    local(async {
        let host = host_at(dir, START_MS).unwrap();
        let notes = notes(&host);
        notes
            .stub("armed")
            .unwrap()
            .call(|o: Rc<Notes>| async move { o.ctx.storage().set_alarm(IN_A_MINUTE).await })
            .await
            .unwrap()
            .unwrap();
        notes
            .stub("unarmed")
            .unwrap()
            .call(|_o: Rc<Notes>| async move {})
            .await
            .unwrap();
        host.shutdown().await;
    })
    .await;
}

/// Starts a second host, waits past the alarm without calling anything,
/// and returns what the armed object's alarm log says and how the index
/// was rebuilt.
async fn restart_and_wait(dir: &Path) -> (Vec<(i64, i64)>, Option<durability_host::IndexRebuild>) {
    local(async {
        let host = host_at(dir, START_MS).unwrap();
        let rebuild = host.index_rebuild().cloned();
        let notes = notes(&host);
        tokio::time::sleep(Duration::from_secs(61)).await;
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
        (log, rebuild)
    })
    .await
}

fn remove_index(dir: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let path = dir.join(format!("{INDEX_FILE}{suffix}"));
        if path.exists() {
            std::fs::remove_file(path).unwrap();
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_deleted_index_is_rebuilt_and_the_alarm_in_the_file_fires() {
    let dir = tempfile::tempdir().unwrap();
    arm(dir.path()).await;
    remove_index(dir.path());
    let (log, rebuild) = restart_and_wait(dir.path()).await;
    assert_eq!(log, vec![(IN_A_MINUTE, 0)]);
    let rebuild = rebuild.expect("the index was rebuilt");
    assert_eq!(rebuild.reason, RebuildReason::Missing);
    assert_eq!(
        (rebuild.objects, rebuild.alarms, rebuild.unreadable),
        (2, 1, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn garbage_in_the_index_is_moved_aside_and_rebuilt_not_a_start_failure() {
    let dir = tempfile::tempdir().unwrap();
    arm(dir.path()).await;
    remove_index(dir.path());
    std::fs::write(dir.path().join(INDEX_FILE), vec![0x5a_u8; 8192]).unwrap();
    let (log, rebuild) = restart_and_wait(dir.path()).await;
    assert_eq!(log, vec![(IN_A_MINUTE, 0)]);
    let rebuild = rebuild.expect("the index was rebuilt");
    assert_eq!(rebuild.reason, RebuildReason::Corrupt);
    assert_eq!(rebuild.alarms, 1);
    let aside = std::fs::read(dir.path().join("index.sqlite.corrupt")).unwrap();
    assert_eq!(aside, vec![0x5a_u8; 8192], "the damaged file is kept aside");
}

#[tokio::test(start_paused = true)]
async fn an_index_of_another_shape_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    arm(dir.path()).await;
    remove_index(dir.path());
    let index = rusqlite::Connection::open(dir.path().join(INDEX_FILE)).unwrap();
    index
        .execute_batch("CREATE TABLE alarms (something TEXT); PRAGMA user_version = 1;")
        .unwrap();
    drop(index);
    let (log, rebuild) = restart_and_wait(dir.path()).await;
    assert_eq!(log, vec![(IN_A_MINUTE, 0)]);
    assert_eq!(rebuild.map(|r| r.reason), Some(RebuildReason::Corrupt));
}

#[tokio::test(start_paused = true)]
async fn an_index_that_was_never_completely_built_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    arm(dir.path()).await;
    // What a crash in the middle of a rebuild (or an older release) leaves:
    // a sound database without the built version, missing an entry.
    let index = rusqlite::Connection::open(dir.path().join(INDEX_FILE)).unwrap();
    index
        .execute_batch("DELETE FROM alarms; PRAGMA user_version = 0;")
        .unwrap();
    drop(index);
    let (log, rebuild) = restart_and_wait(dir.path()).await;
    assert_eq!(log, vec![(IN_A_MINUTE, 0)]);
    assert_eq!(rebuild.map(|r| r.reason), Some(RebuildReason::Incomplete));
}

#[tokio::test(start_paused = true)]
async fn a_sound_index_is_not_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    arm(dir.path()).await;
    let (log, rebuild) = restart_and_wait(dir.path()).await;
    assert_eq!(log, vec![(IN_A_MINUTE, 0)]);
    assert_eq!(rebuild, None);
}

#[tokio::test(start_paused = true)]
async fn an_unreadable_object_file_is_counted_and_the_others_still_fire() {
    let dir = tempfile::tempdir().unwrap();
    arm(dir.path()).await;
    remove_index(dir.path());
    let unarmed = local(async {
        let host = host_at(dir.path(), START_MS).unwrap();
        let id = notes(&host).id_of("unarmed").unwrap();
        let file = host.object_file(&id);
        host.shutdown().await;
        file
    })
    .await;
    remove_index(dir.path());
    std::fs::write(&unarmed, b"not a database, not even close").unwrap();
    let (log, rebuild) = restart_and_wait(dir.path()).await;
    assert_eq!(log, vec![(IN_A_MINUTE, 0)]);
    let rebuild = rebuild.expect("the index was rebuilt");
    assert_eq!(
        (rebuild.objects, rebuild.alarms, rebuild.unreadable),
        (2, 1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn an_index_that_cannot_be_opened_fails_the_start_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join(INDEX_FILE)).unwrap();
    let error = local(async { host_at(dir.path(), START_MS).err() })
        .await
        .expect("a directory in the index's place is not an index");
    let message = error.to_string();
    assert!(
        matches!(error, HostError::Index { .. }) && message.contains(INDEX_FILE),
        "{message}"
    );
}

/// A data directory whose path, made absolute, is `len` bytes long.
fn dir_of_length(base: &Path, len: usize) -> std::path::PathBuf {
    let mut path = std::fs::canonicalize(base).unwrap();
    while path.as_os_str().len() < len {
        let room = len - path.as_os_str().len() - 1;
        // Components of at most 100 bytes; never leave room for a 0-byte one.
        let part = if room > 101 { 100 } else { room };
        path.push("d".repeat(part));
    }
    assert_eq!(path.as_os_str().len(), len);
    path
}

#[tokio::test(start_paused = true)]
async fn a_data_dir_too_long_for_sqlite_fails_once_at_start_naming_the_limit() {
    let base = tempfile::tempdir().unwrap();
    // The longest object path then just fits: `/objects/xx/<id>.sqlite`
    // plus SQLite's 8 reserved bytes is 91 bytes after the directory.
    let longest = dir_of_length(base.path(), SQLITE_MAX_PATH_BYTES - 91);
    local(async {
        let host = host_at(&longest, START_MS).unwrap();
        let texts = notes(&host)
            .stub("at the limit")
            .unwrap()
            .call(|o: Rc<Notes>| async move {
                o.add("fits")?;
                o.texts()
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(texts, vec!["fits".to_owned()]);
        host.shutdown().await;
    })
    .await;
    let too_long = dir_of_length(base.path(), SQLITE_MAX_PATH_BYTES - 90);
    let error = local(async { host_at(&too_long, START_MS).err() })
        .await
        .expect("one byte longer is refused at start");
    let message = error.to_string();
    assert!(
        matches!(error, HostError::PathTooLong { .. }) && message.contains("too long for SQLite"),
        "{message}"
    );
}
