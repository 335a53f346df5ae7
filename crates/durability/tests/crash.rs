//! Crashes with a real process death: the test binary re-runs itself as a
//! child (the ignored test `crash_child`, told what to do through
//! environment variables), the child runs a real inline host on a data
//! directory the parent owns, and the parent kills it with SIGKILL at the
//! moment under test. The parent then opens a new host on the same
//! directory and checks what survived.
//!
//! The children run on real time, so their waits are short (an alarm min
//! delay of 1 s) and every wait of the parent is bounded; the parent's own
//! checks run on paused time.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::sync::mpsc;
use std::time::Duration;

use durability::alarms::IDEMPOTENCY_KEY_PREFIX;
use durability::lifecycle::{Entity, LifecycleEvent, Outcome, sync_hook};
use durability::migrations::MigrationTarget;
use durability::platform::{Context, Sql, Value, params};
use durability::{
    AlarmCall, Alarms, DurableCall, HandlerError, OperationResult, Operations, Recurrence,
    Scheduler,
};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, Namespace, ObjectContext};
use support::TestObject;

/// Which part the child plays (`op`, `alarm` or `migrate`).
const CHILD_SCENARIO_ENV: &str = "DURABILITY_CRASH_CHILD_SCENARIO";
const CHILD_DATA_ENV: &str = "DURABILITY_CRASH_CHILD_DATA";
const CHILD_JOURNAL_ENV: &str = "DURABILITY_CRASH_CHILD_JOURNAL";
const CHILD_TEST: &str = "crash_child";

/// Printed by a child handler after its side effect is on disk.
const SIDE_EFFECT_MARK: &str = "crash-child side effect ";
/// Printed by the child after each acknowledged rescheduling.
const RESCHEDULED_MARK: &str = "crash-child rescheduled ";
/// Printed by the child after each committed migration batch.
const MIGRATED_MARK: &str = "crash-child migrated ";

/// The longest the parent waits for a line of the child (real time): a
/// bound against a hung child, never a timing assumption.
const CHILD_LINE_BOUND: Duration = Duration::from_secs(30);
/// How long a hanging child handler waits before giving up on its own.
const CHILD_HANG: Duration = Duration::from_secs(30);

const NAMESPACE: &str = "crash";
const OBJECT: &str = "object";
const MAX_ATTEMPTS: u32 = 3;
const HOUR_MS: i64 = 3_600_000;

/// Appends `line` to the journal and syncs it: the side effect of a
/// handler, on disk before the handler goes on.
fn journal_append(path: &Path, line: &str) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    file.write_all(format!("{line}\n").as_bytes())?;
    file.sync_all()
}

fn journal(path: &Path) -> Vec<String> {
    match std::fs::read_to_string(path) {
        Ok(text) => text.lines().map(str::to_owned).collect(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(error) => panic!("journal {}: {error}", path.display()),
    }
}

/// An application object: one scheduler, operations and named alarms built
/// in its constructor, so an alarm that wakes it after a restart runs them.
struct Durable {
    ctx: ObjectContext,
    scheduler: Scheduler,
    ops: Operations,
    alarms: Alarms,
    /// Woken when the first attempt of a named alarm starts.
    alarm_started: Rc<tokio::sync::Notify>,
}

impl DurableObject for Durable {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        self.scheduler
            .alarm(Some(info))
            .await
            .map_err(|e| Box::new(e) as BoxError)
    }
}

/// Builds the object. `hang`: handlers block after their side effect (in
/// the child, until it is killed); otherwise they return at once.
fn build_durable(ctx: ObjectContext, journal: PathBuf, hang: bool) -> Result<Durable, BoxError> {
    let scheduler = Scheduler::builder(ctx.clone().into_dyn())
        .alarm_min_delay(Duration::from_secs(1))
        .build()?;
    let op_journal = journal.clone();
    let ops = Operations::builder(&scheduler)
        .handler("charge", move |call: DurableCall<String>| {
            let journal = op_journal.clone();
            async move {
                journal_append(&journal, &format!("op {} {}", call.id, call.attempt))?;
                if hang {
                    println!("{SIDE_EFFECT_MARK}op {}", call.attempt);
                    tokio::time::sleep(CHILD_HANG).await;
                }
                Ok::<_, HandlerError>(call.attempt)
            }
        })
        .max_attempts(MAX_ATTEMPTS)
        .build()?;
    let alarm_started = Rc::new(tokio::sync::Notify::new());
    let started = Rc::clone(&alarm_started);
    let alarms = Alarms::builder(&scheduler)
        .handler("nightly", move |call: AlarmCall| {
            let (journal, started) = (journal.clone(), Rc::clone(&started));
            async move {
                journal_append(
                    &journal,
                    &format!("alarm {} {}", call.idempotency_key, call.attempt),
                )?;
                started.notify_one();
                if hang {
                    println!("{SIDE_EFFECT_MARK}alarm {}", call.attempt);
                    tokio::time::sleep(CHILD_HANG).await;
                }
                Ok(())
            }
        })
        .max_attempts(MAX_ATTEMPTS)
        .build()?;
    Ok(Durable {
        ctx,
        scheduler,
        ops,
        alarms,
        alarm_started,
    })
}

fn durable_namespace(host: &Host, journal: &Path, hang: bool) -> Namespace<Durable> {
    let journal = journal.to_owned();
    host.namespace(NAMESPACE, move |ctx| {
        build_durable(ctx, journal.clone(), hang)
    })
    .unwrap()
}

/// A child process and the lines it prints. Killed when dropped, so a
/// failing test leaves no process behind.
struct Child {
    process: std::process::Child,
    lines: mpsc::Receiver<String>,
}

impl Child {
    fn spawn(scenario: &str, data: &Path, journal: &Path) -> Child {
        let mut process = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                CHILD_TEST,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_SCENARIO_ENV, scenario)
            .env(CHILD_DATA_ENV, data)
            .env(CHILD_JOURNAL_ENV, journal)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(process.stdout.take().unwrap());
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { return };
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        Child { process, lines }
    }

    /// Waits (bounded) for a line carrying `mark`; returns what follows it.
    fn wait_for(&self, mark: &str) -> String {
        loop {
            match self.lines.recv_timeout(CHILD_LINE_BOUND) {
                // The test harness may print its own text before ours.
                Ok(line) => {
                    if let Some((_, rest)) = line.split_once(mark) {
                        return rest.trim().to_owned();
                    }
                }
                Err(error) => panic!("the child never printed {mark:?}: {error}"),
            }
        }
    }

    /// SIGKILL: no destructor, no flush, no graceful shutdown.
    fn kill(mut self) {
        self.process.kill().unwrap();
        self.process.wait().unwrap();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// A data directory and a journal beside it.
struct Dirs {
    _root: tempfile::TempDir,
    data: PathBuf,
    journal: PathBuf,
}

fn dirs() -> Dirs {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let journal = root.path().join("journal.txt");
    Dirs {
        _root: root,
        data,
        journal,
    }
}

/// Runs `body` against a new host over `dir` on this (paused) test thread.
async fn after_restart<F, Fut, R>(body: F) -> R
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = R>,
{
    tokio::task::LocalSet::new().run_until(body()).await
}

fn query_row(sql: &dyn Sql, query: &str) -> Option<Vec<Value>> {
    sql.query_row(query, &[])
        .unwrap()
        .map(|row| row.values().to_vec())
}

#[tokio::test(start_paused = true)]
async fn a_handler_killed_after_its_side_effect_runs_again_and_attempts_never_exceed_max_attempts()
{
    let dirs = dirs();
    // Every attempt dies after its side effect, in a process of its own.
    for attempt in 1..=MAX_ATTEMPTS {
        let child = Child::spawn("op", &dirs.data, &dirs.journal);
        assert_eq!(child.wait_for(SIDE_EFFECT_MARK), format!("op {attempt}"));
        child.kill();
        let lines = journal(&dirs.journal);
        assert_eq!(
            lines.last().map(String::as_str),
            Some(format!("op order {attempt}").as_str())
        );
        assert_eq!(lines.len(), usize::try_from(attempt).unwrap());
    }

    after_restart(|| async {
        let host = Host::builder(&dirs.data).threads(0).build().unwrap();
        let objects = durable_namespace(&host, &dirs.journal, false);
        // The interrupted alarm delivery wakes the object on its own.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let (row, result) = objects
            .stub(OBJECT)
            .unwrap()
            .call(|o: Rc<Durable>| async move {
                let row = query_row(
                    o.ctx.storage(),
                    "SELECT status, attempt, last_error_name, last_error FROM durability_calls",
                );
                let result = format!("{:?}", o.ops.result::<u32>("charge", "order").unwrap());
                (row, result)
            })
            .await
            .unwrap();
        // The claim found the attempts used up: failed without a 4th run.
        assert_eq!(
            row,
            Some(vec![
                Value::from("failed"),
                Value::from(3_i64),
                Value::from("DurableAttemptsExhaustedError"),
                Value::from("Durable operation \"charge\" exhausted its 3 attempts"),
            ])
        );
        assert!(result.starts_with("Failed { attempt: 3"), "{result}");
        host.shutdown().await;
    })
    .await;
    assert_eq!(
        journal(&dirs.journal),
        ["op order 1", "op order 2", "op order 3"]
    );
}

#[tokio::test(start_paused = true)]
async fn after_a_crash_between_side_effect_and_completion_a_new_host_runs_the_handler_again() {
    let dirs = dirs();
    let child = Child::spawn("op", &dirs.data, &dirs.journal);
    assert_eq!(child.wait_for(SIDE_EFFECT_MARK), "op 1");
    child.kill();

    after_restart(|| async {
        let host = Host::builder(&dirs.data).threads(0).build().unwrap();
        let objects = durable_namespace(&host, &dirs.journal, false);
        tokio::time::sleep(Duration::from_secs(5)).await;
        let result = objects
            .stub(OBJECT)
            .unwrap()
            .call(|o: Rc<Durable>| async move {
                // The caller retries its registration after the crash: it is
                // deduplicated, not run a third time.
                o.ops.start("charge", "order", "payload").await.unwrap();
                o.ops.result::<u32>("charge", "order").unwrap()
                    == OperationResult::Completed { result: 2 }
            })
            .await
            .unwrap();
        assert!(result);
        host.shutdown().await;
    })
    .await;
    assert_eq!(journal(&dirs.journal), ["op order 1", "op order 2"]);
}

#[tokio::test(start_paused = true)]
async fn a_replacement_scheduled_while_a_named_alarm_runs_survives_a_kill_during_rescheduling() {
    let dirs = dirs();
    let child = Child::spawn("alarm", &dirs.data, &dirs.journal);
    assert_eq!(child.wait_for(SIDE_EFFECT_MARK), "alarm 1");
    // The child reschedules the running alarm in a loop; kill it somewhere
    // in the middle of one of those commits.
    let mut acknowledged = 0_i64;
    for _ in 0..20 {
        let line = child.wait_for(RESCHEDULED_MARK);
        acknowledged = line.parse().unwrap();
    }
    child.kill();
    let old_key = {
        let lines = journal(&dirs.journal);
        assert_eq!(lines.len(), 1, "{lines:?}");
        lines[0]
            .strip_prefix("alarm ")
            .and_then(|rest| rest.strip_suffix(" 1"))
            .unwrap()
            .to_owned()
    };

    let generation = after_restart(|| async {
        let host = Host::builder(&dirs.data).threads(0).build().unwrap();
        let objects = durable_namespace(&host, &dirs.journal, false);
        let stub = objects.stub(OBJECT).unwrap();
        let (generation, status, attempt, scheduled_at, alarm) = stub
            .call(|o: Rc<Durable>| async move {
                let row = o
                    .ctx
                    .storage()
                    .query_row(
                        "SELECT generation_id, status, attempt, scheduled_at FROM durability_alarms \
                         WHERE name = 'nightly'",
                        &[],
                    )
                    .unwrap()
                    .expect("the replacement survived");
                (
                    row.get::<String>(0).unwrap(),
                    row.get::<String>(1).unwrap(),
                    row.get::<i64>(2).unwrap(),
                    row.get::<i64>(3).unwrap(),
                    o.ctx.storage().get_alarm().await.unwrap(),
                )
            })
            .await
            .unwrap();
        // A replacement at least as new as the last acknowledged one, clean,
        // and covered by the physical alarm.
        assert_ne!(format!("{IDEMPOTENCY_KEY_PREFIX}{generation}"), old_key);
        assert_eq!((status.as_str(), attempt), ("pending", 0));
        assert!(scheduled_at >= acknowledged, "{scheduled_at} < {acknowledged}");
        assert_eq!(alarm, Some(scheduled_at));

        // It fires once at its time; the interrupted old occurrence never
        // runs again.
        tokio::time::sleep(Duration::from_millis(u64::try_from(2 * HOUR_MS).unwrap())).await;
        let remaining = stub
            .call(|o: Rc<Durable>| async move {
                support::query_i64(&o.ctx, "SELECT COUNT(*) FROM durability_alarms", &[])
            })
            .await
            .unwrap();
        assert_eq!(remaining, 0);
        host.shutdown().await;
        generation
    })
    .await;
    assert_eq!(
        journal(&dirs.journal),
        [
            format!("alarm {old_key} 1"),
            format!("alarm {IDEMPOTENCY_KEY_PREFIX}{generation} 1")
        ]
    );
}

/// The two schema states the migrate child moves between: every
/// `durability%` table and index with its SQL, and the operations history.
fn schema_state(sql: &dyn Sql) -> (Vec<Vec<Value>>, Vec<Vec<Value>>) {
    let schema = sql
        .query(
            "SELECT type, name, sql FROM sqlite_master WHERE name LIKE 'durability%' \
             ORDER BY type, name",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.values().to_vec())
        .collect();
    let history = sql
        .query(
            "SELECT name, capability FROM durability_migrations ORDER BY id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.values().to_vec())
        .collect();
    (schema, history)
}

const BEFORE_0004: &str = "durability_0002_pending_index";
/// Rows the migrate child keeps in `durability_calls`; both states keep them.
const MIGRATED_ROWS: i64 = 10;

#[tokio::test(start_paused = true)]
async fn a_kill_during_a_migration_batch_leaves_the_schema_before_or_after_it() {
    // The reference states, reached the way the child reaches them.
    let reference = tempfile::tempdir().unwrap();
    let (latest, before) = after_restart(|| async {
        let (host, objects) = support::open_host(reference.path());
        let states = objects
            .stub("reference")
            .unwrap()
            .call(|o: Rc<TestObject>| async move {
                let storage = o.ctx.storage();
                Operations::migrate(storage, MigrationTarget::Latest).unwrap();
                let latest = schema_state(storage);
                Operations::migrate(storage, MigrationTarget::Named(BEFORE_0004.into())).unwrap();
                let before = schema_state(storage);
                Operations::migrate(storage, MigrationTarget::Latest).unwrap();
                assert_eq!(schema_state(storage), latest);
                (format!("{latest:?}"), format!("{before:?}"))
            })
            .await
            .unwrap();
        host.shutdown().await;
        states
    })
    .await;
    assert_ne!(latest, before);

    let dirs = dirs();
    // Nanoseconds of the clock vary the kill point from run to run.
    let jitter = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    for round in 0..3_u32 {
        let child = Child::spawn("migrate", &dirs.data, &dirs.journal);
        for _ in 0..(3 + (jitter >> round) % 8) {
            child.wait_for(MIGRATED_MARK);
        }
        child.kill();
        let (state, rows) = after_restart(|| async {
            let (host, objects) = support::open_host(&dirs.data);
            let found = objects
                .stub(OBJECT)
                .unwrap()
                .call(|o: Rc<TestObject>| async move {
                    let storage = o.ctx.storage();
                    let rows =
                        support::query_i64(&o.ctx, "SELECT COUNT(*) FROM durability_calls", &[]);
                    (format!("{:?}", schema_state(storage)), rows)
                })
                .await
                .unwrap();
            host.shutdown().await;
            found
        })
        .await;
        assert!(
            state == latest || state == before,
            "round {round}: the schema is between two states:\n{state}"
        );
        assert_eq!(rows, MIGRATED_ROWS, "round {round}");
    }
}

/// The child half of every test above; does nothing unless the parent set
/// the scenario. Runs on real time.
#[tokio::test]
#[ignore = "run as a child process by the crash tests of this file"]
async fn crash_child() {
    let (Some(scenario), Some(data), Some(journal)) = (
        std::env::var_os(CHILD_SCENARIO_ENV),
        std::env::var_os(CHILD_DATA_ENV),
        std::env::var_os(CHILD_JOURNAL_ENV),
    ) else {
        return;
    };
    let (data, journal) = (PathBuf::from(data), PathBuf::from(journal));
    tokio::task::LocalSet::new()
        .run_until(async move {
            match scenario.to_str() {
                Some("op") => child_op(&data, &journal).await,
                Some("alarm") => child_alarm(&data, &journal).await,
                Some("migrate") => child_migrate(&data).await,
                Some(recurring) if recurring.starts_with(RECURRING_SCENARIO) => {
                    child_recurring(&data, &journal, recurring).await;
                }
                other => panic!("unknown crash child scenario {other:?}"),
            }
        })
        .await;
}

/// Registers the operation (deduplicated after the first run) and waits
/// while its handler, started eagerly or by the woken alarm, hangs after
/// its side effect.
async fn child_op(data: &Path, journal: &Path) {
    let host = Host::builder(data).threads(0).build().unwrap();
    let objects = durable_namespace(&host, journal, true);
    objects
        .stub(OBJECT)
        .unwrap()
        .call(|o: Rc<Durable>| async move {
            o.ops.start("charge", "order", "payload").await.unwrap();
        })
        .await
        .unwrap();
    tokio::time::sleep(CHILD_HANG).await;
}

/// Schedules the alarm due now and, while its handler hangs, reschedules
/// it for an hour later over and over.
async fn child_alarm(data: &Path, journal: &Path) {
    let host = Host::builder(data).threads(0).build().unwrap();
    let objects = durable_namespace(&host, journal, true);
    let stub = objects.stub(OBJECT).unwrap();
    stub.call(|o: Rc<Durable>| async move {
        let started = o.alarm_started.notified();
        o.alarms
            .schedule("nightly", o.scheduler.now_ms())
            .await
            .unwrap();
        started.await;
    })
    .await
    .unwrap();
    for i in 0_i64.. {
        let at = stub
            .call(move |o: Rc<Durable>| async move {
                let at = o.scheduler.now_ms() + HOUR_MS + i;
                o.alarms.schedule("nightly", at).await.unwrap();
                at
            })
            .await
            .unwrap();
        println!("{RESCHEDULED_MARK}{at}");
    }
}

/// Moves the operations schema between the states before and after the
/// 0004 table rebuild, in a loop, with rows in the table.
async fn child_migrate(data: &Path) {
    let (_host, objects) = support::open_host(data);
    objects
        .stub(OBJECT)
        .unwrap()
        .call(|o: Rc<TestObject>| async move {
            let storage = o.ctx.storage();
            Operations::migrate(storage, MigrationTarget::Latest).unwrap();
            let rows: i64 = storage
                .query_row("SELECT COUNT(*) FROM durability_calls", &[])
                .unwrap()
                .unwrap()
                .get(0)
                .unwrap();
            if rows == 0 {
                for i in 0..MIGRATED_ROWS {
                    storage
                        .execute(
                            "INSERT INTO durability_calls (id, operation, payload, status, \
                             next_attempt_at) VALUES (?, 'op', '{\"kind\":\"undefined\"}', \
                             'completed', 0)",
                            &params![format!("row-{i}")],
                        )
                        .unwrap();
                }
            }
            for i in 0_u64.. {
                let target = if i % 2 == 0 {
                    MigrationTarget::Named(BEFORE_0004.into())
                } else {
                    MigrationTarget::Latest
                };
                Operations::migrate(storage, target).unwrap();
                println!("{MIGRATED_MARK}{i}");
            }
        })
        .await
        .unwrap();
}

/// The recurring scenarios: `recurring:<kill point>:<anchor ms>`.
const RECURRING_SCENARIO: &str = "recurring";
/// Printed by the child's lifecycle hook once a run's completion (and with
/// it the next occurrence) has committed; the hook then blocks the thread.
const COMMITTED_MARK: &str = "crash-child committed ";

/// An object with one recurring alarm "heartbeat" (every hour from an
/// anchor, registered by each process on its first call). Its handler journals each run. `kill_point` makes
/// the child hang where the parent kills it: `side-effect` (after the
/// handler's journal line, before the completion) or `commit` (right after
/// the completion committed, in the lifecycle hook).
struct Ticking {
    ctx: ObjectContext,
    scheduler: Scheduler,
    alarms: Alarms,
}

impl DurableObject for Ticking {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        self.scheduler
            .alarm(Some(info))
            .await
            .map_err(|e| Box::new(e) as BoxError)
    }
}

fn hourly_from(anchor: i64) -> Recurrence {
    Recurrence::every(Duration::from_secs(3_600))
        .unwrap()
        .anchored_at(anchor)
        .unwrap()
}

fn ticking_namespace(
    host: &Host,
    journal: &Path,
    kill_point: Option<&'static str>,
) -> Namespace<Ticking> {
    let journal = journal.to_owned();
    host.namespace("ticking", move |ctx| {
        let scheduler = Scheduler::builder(ctx.clone().into_dyn())
            .alarm_min_delay(Duration::from_secs(1))
            .build()?;
        let journal = journal.clone();
        let hang_in_handler = kill_point == Some("side-effect");
        let mut builder =
            Alarms::builder(&scheduler).handler("heartbeat", move |call: AlarmCall| {
                let journal = journal.clone();
                async move {
                    journal_append(
                        &journal,
                        &format!(
                            "tick {} {} {}",
                            call.scheduled_time, call.idempotency_key, call.attempt
                        ),
                    )?;
                    if hang_in_handler {
                        println!("{SIDE_EFFECT_MARK}tick {}", call.scheduled_time);
                        tokio::time::sleep(CHILD_HANG).await;
                    }
                    Ok::<_, HandlerError>(())
                }
            });
        if kill_point == Some("commit") {
            builder = builder.on_lifecycle_event(sync_hook(|event: &LifecycleEvent| {
                if let LifecycleEvent::AttemptSettled {
                    entity: Entity::NamedAlarm { generation, .. },
                    outcome: Outcome::Completed { .. },
                    ..
                } = event
                {
                    println!("{COMMITTED_MARK}{generation}");
                    // Nothing of this process runs again: the parent kills it here.
                    std::thread::sleep(CHILD_HANG);
                }
            }));
        }
        let alarms = builder.build()?;
        Ok(Ticking {
            ctx,
            scheduler,
            alarms,
        })
    })
    .unwrap()
}

/// Registers the schedule (a no-op when the object already has it).
async fn register_hourly(objects: &Namespace<Ticking>, anchor: i64) -> Option<i64> {
    objects
        .stub(OBJECT)
        .unwrap()
        .call(move |o: Rc<Ticking>| async move {
            o.alarms
                .schedule_recurring("heartbeat", &hourly_from(anchor), &())
                .await
                .unwrap()
        })
        .await
        .unwrap()
}

/// (generation, scheduled_at, attempt) of every stored occurrence, and
/// (runs, last_tick) of the schedule.
async fn occurrences(objects: &Namespace<Ticking>) -> (Vec<Vec<Value>>, Option<Vec<Value>>) {
    objects
        .stub(OBJECT)
        .unwrap()
        .call(|o: Rc<Ticking>| async move {
            let sql = o.ctx.storage();
            let rows = sql
                .query(
                    "SELECT generation_id, scheduled_at, attempt FROM durability_alarms",
                    &[],
                )
                .unwrap()
                .iter()
                .map(|row| row.values().to_vec())
                .collect();
            let schedule = query_row(
                sql,
                "SELECT runs, last_tick FROM durability_alarm_schedules",
            );
            (rows, schedule)
        })
        .await
        .unwrap()
}

/// The anchor of a crash test's hourly schedule: a little ahead of the real
/// clock, so the child's first run comes soon.
fn soon_anchor() -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    i64::try_from(now.as_millis()).unwrap() + 1_500
}

#[tokio::test(start_paused = true)]
async fn a_kill_right_after_a_recurring_run_commits_leaves_exactly_one_next_occurrence() {
    let dirs = dirs();
    let anchor = soon_anchor();
    let child = Child::spawn(
        &format!("{RECURRING_SCENARIO}:commit:{anchor}"),
        &dirs.data,
        &dirs.journal,
    );
    let settled_generation = child.wait_for(COMMITTED_MARK);
    child.kill();
    let lines = journal(&dirs.journal);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with(&format!("tick {anchor} {IDEMPOTENCY_KEY_PREFIX}")));
    assert!(lines[0].ends_with(" 1"));

    after_restart(|| async {
        let host = Host::builder(&dirs.data).threads(0).build().unwrap();
        let objects = ticking_namespace(&host, &dirs.journal, None);
        assert_eq!(
            register_hourly(&objects, anchor).await,
            Some(anchor + HOUR_MS)
        );
        let (rows, schedule) = occurrences(&objects).await;
        assert_eq!(rows.len(), 1, "exactly one next occurrence: {rows:?}");
        assert_ne!(rows[0][0], Value::from(settled_generation.as_str()));
        assert_eq!(
            rows[0][1..],
            [Value::from(anchor + HOUR_MS), Value::from(0_i64)]
        );
        assert_eq!(
            schedule,
            Some(vec![Value::from(1_i64), Value::from(anchor)])
        );
        // The interrupted delivery and the next tick: the next tick runs once.
        tokio::time::sleep(Duration::from_millis(
            u64::try_from(HOUR_MS).unwrap() + 5_000,
        ))
        .await;
        let (rows, _) = occurrences(&objects).await;
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0][1], Value::from(anchor + 2 * HOUR_MS));
        host.shutdown().await;
    })
    .await;
    let lines = journal(&dirs.journal);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[1].starts_with(&format!("tick {} ", anchor + HOUR_MS)));
    assert_ne!(lines[0].split(' ').nth(2), lines[1].split(' ').nth(2));
}

#[tokio::test(start_paused = true)]
async fn a_kill_between_a_recurring_side_effect_and_its_commit_reruns_that_tick_only() {
    let dirs = dirs();
    let anchor = soon_anchor();
    let child = Child::spawn(
        &format!("{RECURRING_SCENARIO}:side-effect:{anchor}"),
        &dirs.data,
        &dirs.journal,
    );
    assert_eq!(child.wait_for(SIDE_EFFECT_MARK), format!("tick {anchor}"));
    child.kill();

    after_restart(|| async {
        let host = Host::builder(&dirs.data).threads(0).build().unwrap();
        let objects = ticking_namespace(&host, &dirs.journal, None);
        register_hourly(&objects, anchor).await;
        // The interrupted alarm delivery re-runs the same occurrence.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let (rows, schedule) = occurrences(&objects).await;
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(
            rows[0][1..],
            [Value::from(anchor + HOUR_MS), Value::from(0_i64)]
        );
        assert_eq!(
            schedule,
            Some(vec![Value::from(1_i64), Value::from(anchor)])
        );
        host.shutdown().await;
    })
    .await;
    let lines = journal(&dirs.journal);
    assert_eq!(lines.len(), 2, "{lines:?}");
    let first: Vec<&str> = lines[0].split(' ').collect();
    let second: Vec<&str> = lines[1].split(' ').collect();
    // Same tick, same key, the next attempt: at-least-once of one tick.
    assert_eq!(first[..3], second[..3]);
    assert_eq!((first[3], second[3]), ("1", "2"));
}

/// Runs the hourly schedule from the anchor in the scenario and waits to
/// be killed at the kill point.
async fn child_recurring(data: &Path, journal: &Path, scenario: &str) {
    let mut parts = scenario.split(':').skip(1);
    let kill_point = match parts.next() {
        Some("commit") => "commit",
        Some("side-effect") => "side-effect",
        other => panic!("unknown kill point {other:?}"),
    };
    let anchor: i64 = parts.next().unwrap().parse().unwrap();
    let host = Host::builder(data).threads(0).build().unwrap();
    let objects = ticking_namespace(&host, journal, Some(kill_point));
    register_hourly(&objects, anchor).await;
    tokio::time::sleep(CHILD_HANG).await;
}
