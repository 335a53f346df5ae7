//! The kit's helpers, each against the real host: what they do, what they
//! refuse, and the host rules they rely on (an alarm without a handler is
//! kept, not cleared).

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use durability_host::{
    AlarmInfo, BoxError, CallError, DurableObject, Host, HostError, NoAlarmHandler, ObjectContext,
};
use durability_platform::{Context, StorageError, StorageExt, params};
use durability_test::{
    DEFAULT_CLOCK_START_MS, FiredAlarm, Gate, KitError, KitErrorKind, TestHost, block_on,
};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// An object with a `notes` table whose alarm handler records what it got
/// and can be told to fail or to wait on a gate.
struct Notes {
    ctx: ObjectContext,
    alarms: RefCell<Vec<AlarmInfo>>,
    fail_alarms: Cell<bool>,
    hold: RefCell<Option<Gate>>,
}

impl DurableObject for Notes {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        self.alarms.borrow_mut().push(info);
        let hold = self.hold.borrow().clone();
        if let Some(gate) = hold {
            gate.wait().await;
        }
        if self.fail_alarms.get() {
            return Err("failing on purpose".into());
        }
        Ok(())
    }
}

fn notes(ctx: ObjectContext) -> Result<Notes, BoxError> {
    ctx.storage()
        .execute_script("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, text TEXT)")?;
    Ok(Notes {
        ctx,
        alarms: RefCell::new(Vec::new()),
        fail_alarms: Cell::new(false),
        hold: RefCell::new(None),
    })
}

impl Notes {
    async fn arm(&self, at_ms: i64) -> Result<(), StorageError> {
        self.ctx.storage().set_alarm(at_ms).await
    }
}

/// An object type that does not implement `alarm`.
struct Plain(ObjectContext);
impl DurableObject for Plain {}

fn run(test: impl AsyncFnOnce() -> TestResult) -> TestResult {
    block_on(test())?
}

/// A kit whose objects stay in memory for a day, so their in-memory record
/// of alarms outlives long waits.
fn long_lived() -> Result<TestHost, KitError> {
    TestHost::builder()
        .idle_timeout(Duration::from_secs(86_400))
        .build()
}

#[test]
fn the_clock_starts_where_asked_and_advance_moves_it() -> TestResult {
    run(async || {
        let kit = TestHost::start()?;
        assert_eq!(kit.now_ms(), DEFAULT_CLOCK_START_MS);
        kit.advance(Duration::from_secs(90)).await;
        assert_eq!(kit.now_ms(), DEFAULT_CLOCK_START_MS + 90_000);
        kit.advance_to(DEFAULT_CLOCK_START_MS + 100_000).await;
        assert_eq!(kit.now_ms(), DEFAULT_CLOCK_START_MS + 100_000);
        kit.shutdown().await;
        let later = TestHost::builder().clock_start_ms(5_000).build()?;
        assert_eq!(later.now_ms(), 5_000);
        later.shutdown().await;
        Ok(())
    })
}

#[test]
fn run_hands_back_values_that_are_not_send() -> TestResult {
    run(async || {
        let kit = TestHost::start()?;
        let note = kit.namespace("notes", notes)?.object("a")?;
        let object: Rc<Notes> = note.run(|n: Rc<Notes>| async move { n }).await?;
        let again: Rc<Notes> = note.run(|n: Rc<Notes>| async move { n }).await?;
        assert!(Rc::ptr_eq(&object, &again), "the same live object");
        kit.shutdown().await;
        Ok(())
    })
}

#[test]
fn run_local_refuses_a_host_on_other_threads() -> TestResult {
    run(async || {
        let dir = tempfile::tempdir()?;
        let host = Host::builder(dir.path()).threads(1).build()?;
        let stub = host.namespace("notes", notes)?.stub("a")?;
        let refused = stub.run_local(|_n: Rc<Notes>| async {}).await;
        assert!(matches!(refused, Err(CallError::NotOnThisThread { .. })));
        host.shutdown().await;
        Ok(())
    })
}

#[test]
fn an_alarm_set_by_the_object_fires_when_time_passes() -> TestResult {
    run(async || {
        let kit = TestHost::start()?;
        let note = kit.namespace("notes", notes)?.object("a")?;
        let at = kit.now_ms() + 10_000;
        note.run(move |n: Rc<Notes>| async move { n.arm(at).await })
            .await??;
        assert_eq!(note.stored_alarm()?, Some(at));
        kit.advance(Duration::from_secs(9)).await;
        assert_eq!(note.stored_alarm()?, Some(at), "not due yet");
        kit.advance(Duration::from_secs(1)).await;
        assert_eq!(note.stored_alarm()?, None, "delivered and cleared");
        let seen = note
            .run(|n: Rc<Notes>| async move { n.alarms.borrow().clone() })
            .await?;
        assert_eq!(
            seen,
            [AlarmInfo {
                retry_count: 0,
                is_retry: false
            }]
        );
        kit.shutdown().await;
        Ok(())
    })
}

#[test]
fn fire_alarm_runs_an_armed_alarm_now_with_the_chosen_info() -> TestResult {
    run(async || {
        let kit = long_lived()?;
        let note = kit.namespace("notes", notes)?.object("a")?;
        assert_eq!(note.fire_alarm().await?, FiredAlarm::NotArmed);
        let at = kit.now_ms() + 3_600_000;
        note.run(move |n: Rc<Notes>| async move { n.arm(at).await })
            .await??;
        let info = AlarmInfo {
            retry_count: 3,
            is_retry: true,
        };
        assert_eq!(note.fire_alarm_with(info).await?, FiredAlarm::Ran);
        assert_eq!(note.stored_alarm()?, None, "a delivery clears the alarm");
        let seen = note
            .run(|n: Rc<Notes>| async move { n.alarms.borrow().clone() })
            .await?;
        assert_eq!(seen, [info]);
        // The timed delivery does not follow the forced one.
        kit.advance(Duration::from_secs(7_200)).await;
        let runs = note
            .run(|n: Rc<Notes>| async move { n.alarms.borrow().len() })
            .await?;
        assert_eq!(runs, 1);
        kit.shutdown().await;
        Ok(())
    })
}

#[test]
fn a_failed_forced_run_is_retried_by_the_host_from_the_given_count() -> TestResult {
    run(async || {
        let kit = long_lived()?;
        let note = kit.namespace("notes", notes)?.object("a")?;
        let at = kit.now_ms() + 3_600_000;
        note.run(move |n: Rc<Notes>| async move {
            n.fail_alarms.set(true);
            n.arm(at).await
        })
        .await??;
        let fired = note
            .fire_alarm_with(AlarmInfo {
                retry_count: 5,
                is_retry: true,
            })
            .await?;
        assert_eq!(
            fired,
            FiredAlarm::Failed {
                message: "failing on purpose".into()
            }
        );
        // Retry 6 (the last) comes after 2^5 * 2 s = 64 s; then it is dropped.
        kit.advance(Duration::from_secs(64)).await;
        let counts: Vec<u32> =
            note.run(|n: Rc<Notes>| async move {
                n.alarms.borrow().iter().map(|i| i.retry_count).collect()
            })
            .await?;
        assert_eq!(counts, [5, 6]);
        assert_eq!(note.stored_alarm()?, None, "dropped after the last retry");
        kit.shutdown().await;
        Ok(())
    })
}

#[test]
fn fire_alarm_does_not_start_a_second_run_beside_a_running_one() -> TestResult {
    run(async || {
        let kit = TestHost::start()?;
        let note = kit.namespace("notes", notes)?.object("a")?;
        let gate = Gate::new();
        let held = gate.clone();
        let at = kit.now_ms() + 1_000;
        note.run(move |n: Rc<Notes>| async move {
            *n.hold.borrow_mut() = Some(held);
            n.arm(at).await
        })
        .await??;
        kit.advance(Duration::from_secs(1)).await;
        assert_eq!(note.fire_alarm().await?, FiredAlarm::AlreadyRunning);
        assert_eq!(note.stored_alarm()?, Some(at), "still armed while it runs");
        gate.open();
        kit.settle().await;
        assert_eq!(note.stored_alarm()?, None);
        kit.shutdown().await;
        Ok(())
    })
}

#[test]
fn an_alarm_of_an_object_without_an_alarm_handler_is_kept_and_not_retried() -> TestResult {
    run(async || {
        let kit = TestHost::start()?;
        let plain = kit.namespace("plain", |ctx| Ok(Plain(ctx)))?.object("p")?;
        let at = kit.now_ms() + 1_000;
        plain
            .run(move |p: Rc<Plain>| async move { p.0.storage().set_alarm(at).await })
            .await??;
        kit.advance(Duration::from_secs(600)).await;
        assert_eq!(
            plain.stored_alarm()?,
            Some(at),
            "the alarm is not cleared: the work behind it would be stranded"
        );
        let fired = plain.fire_alarm().await?;
        assert_eq!(
            fired,
            FiredAlarm::Failed {
                message: NoAlarmHandler.to_string()
            }
        );
        assert_eq!(plain.stored_alarm()?, Some(at));
        kit.shutdown().await;
        Ok(())
    })
}

#[test]
fn evict_drops_memory_and_the_factory_builds_the_object_again() -> TestResult {
    run(async || {
        let kit = TestHost::start()?;
        let note = kit.namespace("notes", notes)?.object("a")?;
        let before = note.run(|n: Rc<Notes>| async move { n }).await?;
        note.evict().await?;
        let after = note.run(|n: Rc<Notes>| async move { n }).await?;
        assert!(!Rc::ptr_eq(&before, &after));
        kit.shutdown().await;
        Ok(())
    })
}

#[test]
fn restart_keeps_storage_and_alarms_drops_memory_and_continues_the_clock() -> TestResult {
    run(async || {
        let kit = TestHost::start()?;
        let objects = kit.namespace("notes", notes)?;
        let note = objects.object("a")?;
        let at = kit.now_ms() + 60_000;
        note.run(move |n: Rc<Notes>| async move {
            n.ctx
                .storage()
                .execute("INSERT INTO notes (text) VALUES ('kept')", &[])?;
            n.alarms.borrow_mut().push(AlarmInfo {
                retry_count: 99,
                is_retry: true,
            });
            n.arm(at).await
        })
        .await??;
        // A call still in flight when the host dies is aborted.
        let gate = Gate::new();
        let held = gate.clone();
        let stub = note.stub()?;
        let in_flight = tokio::task::spawn_local(async move {
            stub.run_local(move |_n: Rc<Notes>| async move { held.wait().await })
                .await
        });
        kit.settle().await;
        kit.advance(Duration::from_secs(10)).await;
        let before = kit.now_ms();
        kit.restart().await?;
        assert!(matches!(in_flight.await?, Err(CallError::Aborted { .. })));
        assert_eq!(kit.now_ms(), before, "the clock continues");
        assert_eq!(note.count("notes")?, 1);
        assert_eq!(note.stored_alarm()?, Some(at));
        let remembered = note
            .run(|n: Rc<Notes>| async move { n.alarms.borrow().len() })
            .await?;
        assert_eq!(remembered, 0, "memory is gone");
        kit.advance(Duration::from_secs(50)).await;
        assert_eq!(note.stored_alarm()?, None, "the new host delivered it");
        // The old host's handles are dead; the kit's follow the new host.
        assert!(
            objects
                .object("b")?
                .run(|_n: Rc<Notes>| async {})
                .await
                .is_ok()
        );
        gate.open();
        kit.shutdown().await;
        Ok(())
    })
}

#[test]
fn an_alarm_due_while_the_host_was_down_fires_at_restart() -> TestResult {
    run(async || {
        let kit = TestHost::start()?;
        let note = kit.namespace("notes", notes)?.object("a")?;
        let at = kit.now_ms() + 1;
        note.run(move |n: Rc<Notes>| async move { n.arm(at).await })
            .await??;
        kit.restart().await?;
        kit.advance(Duration::from_millis(5)).await;
        assert_eq!(note.stored_alarm()?, None);
        kit.shutdown().await;
        Ok(())
    })
}

#[test]
fn query_reads_committed_rows_without_waking_and_refuses_writes() -> TestResult {
    run(async || {
        let kit = TestHost::start()?;
        let note = kit.namespace("notes", notes)?.object("a")?;
        let never = kit
            .namespace("plain", |ctx| Ok(Plain(ctx)))?
            .object("none")?;
        let missing = never.query("SELECT 1", &[]);
        assert!(matches!(
            missing,
            Err(KitError::Host(HostError::Storage(
                StorageError::Unavailable { .. }
            )))
        ));
        assert_eq!(never.stored_alarm()?, None);
        note.run(|n: Rc<Notes>| async move {
            n.ctx.storage().execute(
                "INSERT INTO notes (text) VALUES (?1), (?2)",
                &params!["x", "y"],
            )
        })
        .await??;
        note.evict().await?;
        let rows = note.table("notes")?;
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].get::<String>(1)?, "y");
        assert_eq!(kit.host().live_objects(), 0, "reading did not wake it");
        let write = note.query("DELETE FROM notes", &[]);
        assert!(write.is_err());
        assert_eq!(note.count("notes")?, 2);
        // A hostile table name is an identifier, never SQL.
        let odd = note.table("notes\"; DROP TABLE notes; --");
        assert!(odd.is_err());
        assert_eq!(note.count("notes")?, 2);
        kit.shutdown().await;
        Ok(())
    })
}

#[test]
fn fail_next_commit_fails_one_commit_of_the_objects_code_and_writes_nothing() -> TestResult {
    run(async || {
        let kit = TestHost::start()?;
        let note = kit.namespace("notes", notes)?.object("a")?;
        note.fail_next_commit_with(StorageError::Full {
            message: "disk full (test)".into(),
        })
        .await?;
        let insert = |text: &'static str| {
            note.run(move |n: Rc<Notes>| async move {
                let at = n.ctx.now_ms() + 1_000;
                n.ctx
                    .storage()
                    .transaction(move |txn| {
                        txn.execute("INSERT INTO notes (text) VALUES (?1)", &params![text])?;
                        txn.set_alarm(at)
                    })
                    .await
            })
        };
        let failed = insert("lost").await?;
        assert!(matches!(failed, Err(StorageError::Full { .. })));
        assert_eq!(note.count("notes")?, 0);
        assert_eq!(
            note.stored_alarm()?,
            None,
            "the alarm rolled back with the rows"
        );
        insert("kept").await??;
        assert_eq!(note.count("notes")?, 1, "armed once");
        kit.shutdown().await;
        Ok(())
    })
}

#[test]
fn run_gives_a_host_in_one_call_and_shuts_it_down() -> TestResult {
    let dir = tempfile::tempdir()?;
    let now = TestHost::builder()
        .clock_start_ms(42_000)
        .data_dir(dir.path())
        .run(async |kit: TestHost| Ok::<_, KitError>(kit.now_ms()))?;
    assert_eq!(now, 42_000);
    // Shut down: the directory's lock is free for another host.
    block_on(async {
        let again = TestHost::builder().data_dir(dir.path()).build()?;
        again.shutdown().await;
        Ok::<_, KitError>(())
    })??;
    Ok(())
}

#[test]
fn kit_errors_have_a_matchable_kind() -> TestResult {
    run(async || {
        let kit = TestHost::start()?;
        let bad = kit.namespace("", notes);
        let Err(error) = bad else {
            return Err("a bad namespace name was accepted".into());
        };
        assert_eq!(error.kind(), KitErrorKind::Host);
        kit.shutdown().await;
        Ok(())
    })
}

/// The host's testing API is not only for inline hosts: a threaded host
/// restarts on its directory and fires alarms on demand too (only
/// `run_local` needs the objects on the caller's thread).
#[test]
fn a_threaded_host_restarts_and_fires_alarms_on_demand() -> TestResult {
    run(async || {
        let dir = tempfile::tempdir()?;
        let host = Host::builder(dir.path()).threads(2).build()?;
        let stub = host.namespace("notes", notes)?.stub("a")?;
        let at = host.now_ms() + 3_600_000;
        stub.call(move |n: Rc<Notes>| async move {
            n.ctx
                .storage()
                .execute("INSERT INTO notes (text) VALUES ('kept')", &[])?;
            n.arm(at).await
        })
        .await??;
        let host = host.restart().await?;
        assert!(
            stub.call(|_n: Rc<Notes>| async {}).await.is_err(),
            "the old host's stubs are dead"
        );
        let stub = host.registered_namespace::<Notes>("notes")?.stub("a")?;
        assert_eq!(host.stored_alarm(stub.id())?, Some(at));
        assert_eq!(
            stub.fire_alarm(AlarmInfo {
                retry_count: 0,
                is_retry: false
            })
            .await?,
            FiredAlarm::Ran
        );
        assert_eq!(host.stored_alarm(stub.id())?, None);
        let rows = host.query_object(stub.id(), "SELECT text FROM notes", &[])?;
        assert_eq!(rows.len(), 1);
        assert!(matches!(
            host.registered_namespace::<Notes>("missing"),
            Err(HostError::UnknownNamespace { .. })
        ));
        host.shutdown().await;
        Ok(())
    })
}
