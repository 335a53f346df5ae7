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

/// Rewrites what the index says about the last run, as a power loss and a
/// reboot would leave it: the run never recorded a clean stop, its boot id
/// is not this boot's, and the lowering written without a sync of its own
/// did not reach the disk (the alarm row is gone).
fn as_after_power_loss(dir: &Path, boot_id: &str, lose_alarms: bool) {
    let conn = rusqlite::Connection::open(dir.join(INDEX_FILE)).unwrap();
    conn.execute(
        "INSERT OR REPLACE INTO host_run (key, value) VALUES ('clean', '0')",
        [],
    )
    .unwrap();
    conn.execute(
        "INSERT OR REPLACE INTO host_run (key, value) VALUES ('boot_id', ?1)",
        [boot_id],
    )
    .unwrap();
    if lose_alarms {
        conn.execute("DELETE FROM alarms", []).unwrap();
    }
}

/// What the index records about whether the last run stopped cleanly.
fn recorded_clean(dir: &Path) -> String {
    let conn = rusqlite::Connection::open(dir.join(INDEX_FILE)).unwrap();
    conn.query_row(
        "SELECT value FROM host_run WHERE key = 'clean'",
        [],
        |row| row.get(0),
    )
    .unwrap()
}

fn this_boot() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_owned())
        .unwrap_or_default()
}

#[tokio::test(start_paused = true)]
async fn after_an_unclean_stop_and_a_reboot_the_index_is_rebuilt_and_a_lost_lowering_fires() {
    let dir = tempfile::tempdir().unwrap();
    arm(dir.path()).await;
    as_after_power_loss(dir.path(), "a-boot-before-the-power-loss", true);
    let (log, rebuild) = restart_and_wait(dir.path()).await;
    assert_eq!(log, vec![(IN_A_MINUTE, 0)], "the alarm in the file fired");
    let rebuild = rebuild.expect("the index was rebuilt");
    assert_eq!(rebuild.reason, RebuildReason::UncleanReboot);
    assert_eq!(
        (rebuild.objects, rebuild.alarms, rebuild.unreadable),
        (2, 1, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn an_unclean_stop_on_the_same_boot_keeps_the_index_a_process_crash_loses_no_write() {
    if this_boot().is_empty() {
        // Without a boot id every unclean stop rebuilds (tested above).
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    arm(dir.path()).await;
    as_after_power_loss(dir.path(), &this_boot(), false);
    let (log, rebuild) = restart_and_wait(dir.path()).await;
    assert_eq!(log, vec![(IN_A_MINUTE, 0)]);
    assert_eq!(rebuild, None, "same boot: the page cache kept every write");
}

#[tokio::test(start_paused = true)]
async fn a_clean_shutdown_is_recorded_so_a_reboot_alone_rebuilds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    arm(dir.path()).await;
    assert_eq!(
        recorded_clean(dir.path()),
        "1",
        "shutdown recorded a clean stop"
    );
    let conn = rusqlite::Connection::open(dir.path().join(INDEX_FILE)).unwrap();
    conn.execute(
        "UPDATE host_run SET value = 'another-boot' WHERE key = 'boot_id'",
        [],
    )
    .unwrap();
    drop(conn);
    let (log, rebuild) = restart_and_wait(dir.path()).await;
    assert_eq!(log, vec![(IN_A_MINUTE, 0)]);
    assert_eq!(rebuild, None);
}

#[tokio::test(start_paused = true)]
async fn a_running_group_commit_host_is_recorded_as_not_stopped_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = host_at(dir.path(), START_MS).unwrap();
        assert_eq!(
            recorded_clean(dir.path()),
            "0",
            "recorded before any object opens"
        );
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_full_mode_run_syncs_its_lowerings_and_needs_no_rebuild_after_a_reboot() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = Host::builder(dir.path())
            .threads(0)
            .clock_start_ms(START_MS)
            .synchronous(durability_host::Synchronous::Full)
            .build()
            .unwrap();
        notes(&host)
            .stub("armed")
            .unwrap()
            .call(|o: Rc<Notes>| async move { o.ctx.storage().set_alarm(IN_A_MINUTE).await })
            .await
            .unwrap()
            .unwrap();
        // Dropped without a shutdown, as by a crash.
        drop(host);
    })
    .await;
    let conn = rusqlite::Connection::open(dir.path().join(INDEX_FILE)).unwrap();
    conn.execute(
        "INSERT OR REPLACE INTO host_run (key, value) VALUES ('boot_id', 'another-boot')",
        [],
    )
    .unwrap();
    drop(conn);
    let (log, rebuild) = restart_and_wait(dir.path()).await;
    assert_eq!(log, vec![(IN_A_MINUTE, 0)]);
    assert_eq!(rebuild, None, "a FULL run records itself as clean");
}

fn indexed_at(dir: &Path, id: &durability_platform::ObjectId) -> Option<i64> {
    let conn = rusqlite::Connection::open(dir.join(INDEX_FILE)).unwrap();
    conn.query_row(
        "SELECT at_ms FROM alarms WHERE id = ?1",
        [id.as_str()],
        |row| row.get(0),
    )
    .ok()
}

#[tokio::test(start_paused = true)]
async fn a_later_or_cleared_alarm_reaches_the_index_when_its_object_closes() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = host_at(dir.path(), START_MS).unwrap();
        let stub = notes(&host).stub("armed").unwrap();
        let set = |at: i64| {
            let stub = stub.clone();
            async move {
                stub.call(move |o: Rc<Notes>| async move { o.ctx.storage().set_alarm(at).await })
                    .await
                    .unwrap()
                    .unwrap();
            }
        };
        set(IN_A_MINUTE).await;
        assert_eq!(
            indexed_at(dir.path(), stub.id()),
            Some(IN_A_MINUTE),
            "lowered first"
        );
        set(IN_A_MINUTE + 5_000).await;
        assert_eq!(
            indexed_at(dir.path(), stub.id()),
            Some(IN_A_MINUTE),
            "a later alarm leaves the index early while the object is live"
        );
        stub.call(|o: Rc<Notes>| async move { o.ctx.storage().delete_alarm().await })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            indexed_at(dir.path(), stub.id()),
            Some(IN_A_MINUTE),
            "stale, not missing"
        );
        set(IN_A_MINUTE - 5_000).await;
        assert_eq!(
            indexed_at(dir.path(), stub.id()),
            Some(IN_A_MINUTE - 5_000),
            "an earlier alarm lowers the index before its commit"
        );
        set(IN_A_MINUTE + 9_000).await;
        host.evict(stub.id()).await.unwrap();
        assert_eq!(
            indexed_at(dir.path(), stub.id()),
            Some(IN_A_MINUTE + 9_000),
            "exact once the object closed"
        );
        stub.call(|o: Rc<Notes>| async move { o.ctx.storage().delete_alarm().await })
            .await
            .unwrap()
            .unwrap();
        host.shutdown().await;
        assert_eq!(
            indexed_at(dir.path(), stub.id()),
            None,
            "cleared at shutdown"
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_boot_id_file_a_builder_names_decides_whether_the_machine_rebooted() {
    // A power-cut test cuts a filesystem without a reboot: it names a boot
    // id file of its own and rewrites it at every cut.
    let dir = tempfile::tempdir().unwrap();
    let boot_id = dir.path().join("boot-id");
    arm(dir.path()).await;
    as_after_power_loss(dir.path(), "boot-before-the-cut", false);
    let rebuild_with = |id: &'static str| {
        let (data, boot_id) = (dir.path().to_path_buf(), boot_id.clone());
        local(async move {
            std::fs::write(&boot_id, format!("{id}\n")).unwrap();
            let host = Host::builder(&data)
                .threads(0)
                .clock_start_ms(START_MS)
                .boot_id_file(&boot_id)
                .build()
                .unwrap();
            let rebuild = host.index_rebuild().map(|r| r.reason);
            // Not shut down: the stop stays unclean for the next start.
            drop(host);
            rebuild
        })
    };
    assert_eq!(rebuild_with("boot-before-the-cut").await, None, "same boot");
    assert_eq!(
        rebuild_with("boot-after-the-cut").await,
        Some(RebuildReason::UncleanReboot)
    );
}
