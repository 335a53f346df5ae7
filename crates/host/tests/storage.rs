//! One object's storage: transactions, the alarm inside them, faults.

mod support;

use std::rc::Rc;

use durability_host::{CallError, Host};
use durability_platform::{Context, Rollback, StorageError, StorageExt, params};
use support::{Notes, inline_host, local, notes};

#[tokio::test(start_paused = true)]
async fn rows_and_alarm_commit_together_and_roll_back_together() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let stub = notes(&host).stub("atomic").unwrap();
        let at = host.now_ms() + 3_600_000;
        let (texts, alarm) = stub
            .call(move |o: Rc<Notes>| async move {
                // A body that fails after writing a row and setting the alarm.
                let failed: Result<(), StorageError> = o
                    .ctx
                    .storage()
                    .transaction(move |txn| {
                        txn.execute("INSERT INTO notes (text) VALUES ('rolled back')", &[])?;
                        txn.set_alarm(at)?;
                        assert_eq!(txn.get_alarm()?, Some(at));
                        Err(StorageError::Sql {
                            message: "the body gives up".into(),
                        })
                    })
                    .await;
                assert!(failed.is_err());
                assert_eq!(o.texts().unwrap(), Vec::<String>::new());
                assert_eq!(o.alarm().await.unwrap(), None);
                o.add_with_alarm("committed", at).await.unwrap();
                (o.texts().unwrap(), o.alarm().await.unwrap())
            })
            .await
            .unwrap();
        assert_eq!(texts, vec!["committed".to_owned()]);
        assert_eq!(alarm, Some(at));
        // Evicted and read back from the file: both are durable.
        host.evict(stub.id()).await.unwrap();
        let (texts, alarm) = stub
            .call(|o: Rc<Notes>| async move { (o.texts().unwrap(), o.alarm().await.unwrap()) })
            .await
            .unwrap();
        assert_eq!(texts, vec!["committed".to_owned()]);
        assert_eq!(alarm, Some(at));
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_nested_transaction_rolls_back_alone() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let stub = notes(&host).stub("nested").unwrap();
        let texts = stub
            .call(|o: Rc<Notes>| async move {
                let storage = o.ctx.storage();
                let committed = storage.transaction_sync_dyn(&mut |sql| {
                    sql.execute("INSERT INTO notes (text) VALUES ('outer')", &[])
                        .map_err(|_| Rollback)?;
                    let inner = storage.transaction_sync_dyn(&mut |sql| {
                        sql.execute("INSERT INTO notes (text) VALUES ('inner')", &[])
                            .map_err(|_| Rollback)?;
                        Err(Rollback)
                    });
                    assert_eq!(inner, Ok(false));
                    Ok(())
                });
                assert_eq!(committed, Ok(true));
                o.texts().unwrap()
            })
            .await
            .unwrap();
        assert_eq!(texts, vec!["outer".to_owned()]);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_alarm_time_outside_safe_integers_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let stub = notes(&host).stub("bad alarm").unwrap();
        let (negative, huge, alarm) = stub
            .call(|o: Rc<Notes>| async move {
                let storage = o.ctx.storage();
                (
                    storage.set_alarm(-1).await,
                    storage
                        .set_alarm(durability_platform::MAX_SAFE_INTEGER + 1)
                        .await,
                    storage.get_alarm().await,
                )
            })
            .await
            .unwrap();
        assert_eq!(negative, Err(StorageError::InvalidAlarmTime { at_ms: -1 }));
        assert!(matches!(huge, Err(StorageError::InvalidAlarmTime { .. })));
        assert_eq!(alarm, Ok(None));
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_full_disk_fails_the_commit_with_a_typed_error_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let stub = notes(&host).stub("full").unwrap();
        let at = host.now_ms() + 60_000;
        let (result, texts, alarm, after) = stub
            .call(move |o: Rc<Notes>| async move {
                let storage = o.ctx.storage();
                o.add("before").unwrap();
                // A real SQLITE_FULL: the database may not grow past its size now.
                let pages: i64 = storage
                    .query_row("PRAGMA page_count", &[])
                    .unwrap()
                    .unwrap()
                    .get(0)
                    .unwrap();
                storage
                    .query(&format!("PRAGMA max_page_count = {pages}"), &[])
                    .unwrap();
                let result: Result<(), StorageError> = storage
                    .transaction(move |txn| {
                        txn.execute("INSERT INTO notes (text) VALUES ('small')", &[])?;
                        txn.set_alarm(at)?;
                        txn.execute(
                            "INSERT INTO notes (text) VALUES (?1)",
                            &params!["x".repeat(1 << 20)],
                        )?;
                        Ok(())
                    })
                    .await;
                let texts = o.texts().unwrap();
                let alarm = o.alarm().await.unwrap();
                storage
                    .query("PRAGMA max_page_count = 1073741823", &[])
                    .unwrap();
                let after = o.add("after");
                (result, texts, alarm, after)
            })
            .await
            .unwrap();
        assert!(
            matches!(result, Err(StorageError::Full { .. })),
            "{result:?}"
        );
        assert_eq!(texts, vec!["before".to_owned()]);
        assert_eq!(alarm, None);
        assert_eq!(after, Ok(()));
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_corrupt_object_file_fails_its_calls_and_others_keep_serving() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let notes = notes(&host);
        let broken = notes.stub("broken").unwrap();
        let path = host.object_file(broken.id());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, vec![0x5a; 8192]).unwrap();
        let result = broken.call(|o: Rc<Notes>| async move { o.texts() }).await;
        match result {
            Err(CallError::Storage { source, .. }) => {
                assert!(matches!(source, StorageError::Corrupt { .. }), "{source:?}")
            }
            other => panic!("expected a storage error, got {other:?}"),
        }
        let healthy = notes.stub("healthy").unwrap();
        healthy
            .call(|o: Rc<Notes>| async move { o.add("fine") })
            .await
            .unwrap()
            .unwrap();
        // A second call to the broken object fails the same way, no panic.
        assert!(matches!(
            broken.call(|o: Rc<Notes>| async move { o.texts() }).await,
            Err(CallError::Storage { .. })
        ));
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_failing_factory_is_a_typed_error_and_the_next_call_tries_again() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let attempts = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = attempts.clone();
        let ns = host
            .namespace("flaky", move |ctx| {
                if seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    return Err("migration failed".into());
                }
                Ok(Notes {
                    ctx,
                    alarms: Default::default(),
                    failing_alarms: Default::default(),
                })
            })
            .unwrap();
        let stub = ns.stub("x").unwrap();
        let first = stub.call(|_o: Rc<Notes>| async move {}).await;
        assert!(matches!(first, Err(CallError::Construct { ref message, .. }) if message == "migration failed"));
        assert!(stub.call(|_o: Rc<Notes>| async move {}).await.is_ok());
        assert_eq!(host.live_objects(), 1);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_host_clock_moves_with_paused_tokio_time() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = Host::builder(dir.path())
            .threads(0)
            .clock_start_ms(1_000_000)
            .build()
            .unwrap();
        assert_eq!(host.now_ms(), 1_000_000);
        let stub = notes(&host).stub("clock").unwrap();
        let (before, after) = stub
            .call(|o: Rc<Notes>| async move {
                let before = o.ctx.now_ms();
                o.ctx.sleep(std::time::Duration::from_secs(3600)).await;
                (before, o.ctx.now_ms())
            })
            .await
            .unwrap();
        assert_eq!(after - before, 3_600_000);
        host.shutdown().await;
    })
    .await;
}

/// An object whose factory writes nothing: every commit in its file is the
/// host's own.
struct Quiet;

impl durability_host::DurableObject for Quiet {}

/// The commits in `file`'s write-ahead log: frames whose header carries a
/// database size, the SQLite file format's mark of a commit frame (a WAL
/// header is 32 bytes, a frame header 24, the page size is at byte 8).
fn wal_commits(file: &std::path::Path) -> usize {
    let mut wal = file.as_os_str().to_owned();
    wal.push("-wal");
    let bytes = std::fs::read(wal).unwrap_or_default();
    let Some(page_size) = bytes.get(8..12) else {
        return 0;
    };
    let page_size = u32::from_be_bytes(page_size.try_into().unwrap()) as usize;
    let mut commits = 0;
    let mut frame = 32;
    while let Some(header) = bytes.get(frame..frame + 24) {
        if header[4..8] != [0, 0, 0, 0] {
            commits += 1;
        }
        frame += 24 + page_size;
    }
    commits
}

#[tokio::test(start_paused = true)]
async fn a_new_object_file_is_set_up_in_one_commit_and_reopening_it_commits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let quiet = host.namespace("quiet", |_ctx| Ok(Quiet)).unwrap();
        let stub = quiet.stub("one commit").unwrap();
        let file = host.object_file(stub.id());
        stub.call(|_q: Rc<Quiet>| async {}).await.unwrap();
        // Tables, id, namespace and name: one transaction.
        assert_eq!(wal_commits(&file), 1);
        host.evict(stub.id()).await.unwrap();
        stub.call(|_q: Rc<Quiet>| async {}).await.unwrap();
        assert_eq!(wal_commits(&file), 0, "an existing file is only read");
        host.shutdown().await;
    })
    .await;
    // The file was made from the template under a scratch name: none stays.
    let scratch: Vec<_> = std::fs::read_dir(dir.path().join("objects"))
        .unwrap()
        .flat_map(|shard| std::fs::read_dir(shard.unwrap().path()).unwrap())
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with("-new"))
        .collect();
    assert_eq!(scratch, Vec::<String>::new());
    let listed = durability_host::inspect::list_objects(dir.path()).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].namespace.as_deref(), Some("quiet"));
    assert_eq!(listed[0].name.as_deref(), Some("one commit"));
    assert_eq!(listed[0].error, None);
}
