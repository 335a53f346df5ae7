//! Recurring named alarms (issue 14) on a real inline host and paused tokio
//! time: a year of hourly ticks across both DST changes, a host down for
//! three days under each missed-tick policy, retries that do not shift later
//! ticks, and durable, idempotent replace/pause/resume/cancel.
//!
//! The object registers its schedules in its constructor, as an application
//! does, and its handler writes each run into the object's own SQLite table,
//! so runs survive a host restart and are read back from storage.

mod support;

use std::cell::Cell;
use std::path::Path;
use std::rc::Rc;
use std::time::Duration;

use durability::platform::{Context, Sql, params};
use durability::{
    AlarmCall, AlarmState, Alarms, HandlerError, MissedTicks, Recurrence, RecurrenceError,
    Scheduler,
};
use durability_host::{
    AlarmInfo, BoxError, DurableObject, Host, Namespace, ObjectContext, Synchronous,
};
use jiff::Timestamp;

const HOUR_MS: i64 = 3_600_000;
const DAY_MS: i64 = 24 * HOUR_MS;
/// 2025-01-01T00:00:00 in Europe/Paris (UTC+1).
const PARIS_2025_MS: i64 = 1_735_686_000_000;
/// 2026-01-01T00:00:00 in Europe/Paris.
const PARIS_2026_MS: i64 = 1_767_222_000_000;
/// 2025-01-06T00:30:00Z, a Monday far from any DST change.
const MONDAY_MS: i64 = 1_736_123_400_000;

/// What the object's schedules are; set before the host opens it.
#[derive(Clone)]
struct Plan {
    schedules: Vec<(&'static str, Recurrence)>,
    /// Attempts of each tick that fail before one succeeds.
    failures_per_tick: u32,
}

/// An application object: scheduler and named alarms built in its
/// constructor, every schedule registered there (a no-op when unchanged).
struct Clocked {
    ctx: ObjectContext,
    scheduler: Scheduler,
    alarms: Alarms,
}

impl DurableObject for Clocked {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        self.scheduler
            .alarm(Some(info))
            .await
            .map_err(|e| Box::new(e) as BoxError)
    }
}

/// One run as the handler saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    name: String,
    tick: i64,
    missed: i64,
    attempt: i64,
    key: String,
    ran_at: i64,
}

fn runs(sql: &dyn Sql, name: &str) -> Vec<Run> {
    sql.query(
        "SELECT name, tick, missed, attempt, key, ran_at FROM runs WHERE name = ? \
             ORDER BY ran_at, tick, attempt",
        &params![name],
    )
    .unwrap()
    .iter()
    .map(|row| Run {
        name: row.get(0).unwrap(),
        tick: row.get(1).unwrap(),
        missed: row.get(2).unwrap(),
        attempt: row.get(3).unwrap(),
        key: row.get(4).unwrap(),
        ran_at: row.get(5).unwrap(),
    })
    .collect()
}

fn build(ctx: ObjectContext, plan: &Plan) -> Result<Clocked, BoxError> {
    let storage = ctx.storage();
    storage.execute(
        "CREATE TABLE IF NOT EXISTS runs (name TEXT, tick INTEGER, missed INTEGER, \
         attempt INTEGER, key TEXT, ran_at INTEGER)",
        &[],
    )?;
    let scheduler = Scheduler::new(ctx.clone().into_dyn())?;
    let mut builder = Alarms::builder(&scheduler).max_attempts(5);
    for (name, _) in &plan.schedules {
        let record_ctx = ctx.clone();
        let failures = plan.failures_per_tick;
        builder = builder.handler(name, move |call: AlarmCall| {
            let ctx = record_ctx.clone();
            async move {
                let storage = ctx.storage();
                storage
                    .execute(
                        "INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?)",
                        &params![
                            call.name.as_str(),
                            call.scheduled_time,
                            i64::try_from(call.missed).unwrap(),
                            call.attempt,
                            call.idempotency_key.as_str(),
                            ctx.now_ms()
                        ],
                    )
                    .map_err(|e| HandlerError::new(e.to_string()))?;
                if call.attempt <= failures {
                    return Err(HandlerError::new("not yet"));
                }
                Ok(())
            }
        });
    }
    let alarms = builder.build()?;
    Ok(Clocked {
        ctx,
        scheduler,
        alarms,
    })
}

/// Opens a host over `dir` whose clock starts at `start_ms`, with the
/// object's schedules registered (the registration runs on the object).
async fn open(dir: &Path, start_ms: i64, plan: &Plan) -> (Host, Namespace<Clocked>) {
    let host = Host::builder(dir)
        .threads(0)
        .clock_start_ms(start_ms)
        // Counting ticks, not surviving power loss: skip the fsyncs.
        .synchronous(Synchronous::Normal)
        .build()
        .unwrap();
    let built = plan.clone();
    let objects = host
        .namespace("clocked", move |ctx| build(ctx, &built))
        .unwrap();
    let schedules = plan.schedules.clone();
    objects
        .stub("object")
        .unwrap()
        .call(move |o: Rc<Clocked>| async move {
            for (name, recurrence) in schedules {
                o.alarms
                    .schedule_recurring(name, &recurrence, &())
                    .await
                    .unwrap();
            }
        })
        .await
        .unwrap();
    (host, objects)
}

async fn on_object<R: Send + 'static>(
    objects: &Namespace<Clocked>,
    f: impl FnOnce(Rc<Clocked>) -> R + Send + 'static,
) -> R {
    on_object_async(objects, move |o| async move { f(o) }).await
}

async fn on_object_async<R, Fut>(
    objects: &Namespace<Clocked>,
    f: impl FnOnce(Rc<Clocked>) -> Fut + Send + 'static,
) -> R
where
    R: Send + 'static,
    Fut: std::future::Future<Output = R> + 'static,
{
    objects.stub("object").unwrap().call(f).await.unwrap()
}

/// Sleeps (paused time) until the host clock reads `at_ms`.
async fn sleep_until(host: &Host, at_ms: i64) {
    let ahead = at_ms - host.now_ms();
    assert!(ahead >= 0, "the clock is already past {at_ms}");
    tokio::time::sleep(Duration::from_millis(u64::try_from(ahead).unwrap())).await;
}

fn paris(ms: i64) -> jiff::Zoned {
    Timestamp::from_millisecond(ms)
        .unwrap()
        .in_tz("Europe/Paris")
        .unwrap()
}

fn local(ms: i64) -> String {
    paris(ms).strftime("%Y-%m-%d %H:%M %Z").to_string()
}

#[tokio::test(start_paused = true)]
async fn a_year_of_hourly_ticks_in_paris_runs_8760_times_across_both_dst_changes() {
    let dir = tempfile::tempdir().unwrap();
    let plan = Plan {
        schedules: vec![
            (
                "hourly",
                Recurrence::cron("0 * * * *", "Europe/Paris").unwrap(),
            ),
            // 02:30 does not exist on 30 March and happens twice on 26 October.
            (
                "nightly",
                Recurrence::cron("30 2 * * *", "Europe/Paris").unwrap(),
            ),
        ],
        failures_per_tick: 0,
    };
    tokio::task::LocalSet::new()
        .run_until(async {
            let (host, objects) = open(dir.path(), PARIS_2025_MS - 1_000, &plan).await;
            sleep_until(&host, PARIS_2026_MS - 1_000).await;
            let (hourly, nightly) = on_object(&objects, |o| {
                (
                    runs(o.ctx.storage(), "hourly"),
                    runs(o.ctx.storage(), "nightly"),
                )
            })
            .await;

            // One run per real hour: 23 local hours on 30 March, 25 on 26 October.
            assert_eq!(hourly.len(), 8_760);
            assert_eq!(hourly[0].tick, PARIS_2025_MS);
            for pair in hourly.windows(2) {
                assert_eq!(pair[1].tick - pair[0].tick, HOUR_MS, "{pair:?}");
            }
            assert!(hourly.iter().all(|r| r.missed == 0 && r.attempt == 1));
            assert!(hourly.iter().all(|r| r.ran_at == r.tick), "ran at its tick");
            let on_day = |day: &str| {
                hourly
                    .iter()
                    .filter(|r| local(r.tick).starts_with(day))
                    .count()
            };
            assert_eq!(on_day("2025-03-30"), 23);
            assert_eq!(on_day("2025-10-26"), 25);
            assert_eq!(on_day("2025-06-01"), 24);

            // A daily fixed time runs once every day, 365 times.
            assert_eq!(nightly.len(), 365);
            let days: std::collections::BTreeSet<String> = nightly
                .iter()
                .map(|r| local(r.tick)[..10].to_owned())
                .collect();
            assert_eq!(days.len(), 365, "one run per local day");
            // The skipped 02:30 runs at the first instant after the gap.
            let spring = nightly
                .iter()
                .find(|r| local(r.tick).starts_with("2025-03-30"))
                .unwrap();
            assert_eq!(local(spring.tick), "2025-03-30 03:00 CEST");
            // The repeated 02:30 runs once, at its first instant.
            let autumn: Vec<_> = nightly
                .iter()
                .filter(|r| local(r.tick).starts_with("2025-10-26"))
                .collect();
            assert_eq!(autumn.len(), 1);
            assert_eq!(local(autumn[0].tick), "2025-10-26 02:30 CEST");
            host.shutdown().await;
        })
        .await;
}

/// Runs one missed-tick policy through a 3-day outage of an hourly
/// schedule: two runs, host down from 02:30 on Monday to 02:30 on Thursday
/// (72 ticks missed), then up until 04:30.
async fn three_days_down(policy: MissedTicks) -> Vec<Run> {
    let dir = tempfile::tempdir().unwrap();
    let plan = Plan {
        schedules: vec![(
            "hourly",
            Recurrence::cron("0 * * * *", "UTC")
                .unwrap()
                .missed_ticks(policy),
        )],
        failures_per_tick: 0,
    };
    tokio::task::LocalSet::new()
        .run_until(async {
            let (host, _) = open(dir.path(), MONDAY_MS, &plan).await;
            sleep_until(&host, MONDAY_MS + 2 * HOUR_MS).await;
            host.shutdown().await;
            drop(host);

            let back = MONDAY_MS + 2 * HOUR_MS + 3 * DAY_MS;
            let (host, objects) = open(dir.path(), back, &plan).await;
            sleep_until(&host, back + 2 * HOUR_MS).await;
            let all = on_object(&objects, |o| runs(o.ctx.storage(), "hourly")).await;
            host.shutdown().await;
            all
        })
        .await
}

fn ticks_and_missed(runs: &[Run]) -> Vec<(i64, i64)> {
    runs.iter()
        .map(|r| ((r.tick - MONDAY_MS + HOUR_MS / 2) / HOUR_MS, r.missed))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn host_down_three_days_skip_runs_the_next_future_tick_told_72_missed() {
    let runs = three_days_down(MissedTicks::Skip).await;
    // Hours since Monday 00:00 (ticks 1 and 2 before the outage).
    assert_eq!(ticks_and_missed(&runs), [(1, 0), (2, 0), (75, 72), (76, 0)]);
}

#[tokio::test(start_paused = true)]
async fn host_down_three_days_run_once_runs_the_latest_missed_tick_at_once() {
    let runs = three_days_down(MissedTicks::RunOnce).await;
    assert_eq!(
        ticks_and_missed(&runs),
        [(1, 0), (2, 0), (74, 71), (75, 0), (76, 0)]
    );
    let back = MONDAY_MS + 2 * HOUR_MS + 3 * DAY_MS;
    assert_eq!(runs[2].ran_at, back, "runs as soon as the host is back");
}

#[tokio::test(start_paused = true)]
async fn host_down_three_days_catch_up_runs_the_last_five_missed_ticks_in_order() {
    let runs = three_days_down(MissedTicks::CatchUp { max: 5 }).await;
    assert_eq!(
        ticks_and_missed(&runs),
        [
            (1, 0),
            (2, 0),
            (70, 67),
            (71, 0),
            (72, 0),
            (73, 0),
            (74, 0),
            (75, 0),
            (76, 0)
        ]
    );
    let keys: std::collections::HashSet<_> = runs.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys.len(), runs.len(), "each tick is its own occurrence");
}

#[tokio::test(start_paused = true)]
async fn a_failed_tick_retries_with_its_key_and_does_not_shift_the_next_tick() {
    let dir = tempfile::tempdir().unwrap();
    let plan = Plan {
        schedules: vec![(
            "hourly",
            Recurrence::every(Duration::from_secs(3_600)).unwrap(),
        )],
        failures_per_tick: 2,
    };
    tokio::task::LocalSet::new()
        .run_until(async {
            let start = MONDAY_MS; // 01:00 is the first tick
            let (host, objects) = open(dir.path(), start, &plan).await;
            sleep_until(&host, start + 2 * HOUR_MS).await;
            let all = on_object(&objects, |o| runs(o.ctx.storage(), "hourly")).await;
            let first_tick = MONDAY_MS + HOUR_MS / 2;
            let ticks: Vec<(i64, i64)> = all
                .iter()
                .map(|r| (r.tick - first_tick, r.attempt))
                .collect();
            assert_eq!(
                ticks,
                [
                    (0, 1),
                    (0, 2),
                    (0, 3),
                    (HOUR_MS, 1),
                    (HOUR_MS, 2),
                    (HOUR_MS, 3)
                ]
            );
            // Same key across one tick's attempts, a new one per tick.
            assert!(all[..3].iter().all(|r| r.key == all[0].key));
            assert!(all[3..].iter().all(|r| r.key == all[3].key));
            assert_ne!(all[0].key, all[3].key);
            // The second tick ran at its own time, not an hour after the
            // first tick's last retry.
            assert_eq!(all[3].ran_at, first_tick + HOUR_MS);
            host.shutdown().await;
        })
        .await;
}

#[tokio::test(start_paused = true)]
async fn a_terminally_failed_tick_is_recorded_and_the_schedule_goes_on() {
    support::on_harness(|h| async move {
        let scheduler = Scheduler::new(h.context()).unwrap();
        h.install(&scheduler);
        let calls = Rc::new(Cell::new(0));
        let counter = Rc::clone(&calls);
        let alarms = Alarms::builder(&scheduler)
            .handler("flaky", move |call: AlarmCall| {
                counter.set(counter.get() + 1);
                let fail = call.scheduled_time % (2 * HOUR_MS) == 0;
                async move {
                    if fail {
                        Err(HandlerError::non_retryable("boom"))
                    } else {
                        Ok(())
                    }
                }
            })
            .build()
            .unwrap();
        let every_hour = Recurrence::every(Duration::from_secs(3_600)).unwrap();
        let first = alarms
            .schedule_recurring("flaky", &every_hour, &())
            .await
            .unwrap()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(
            u64::try_from(first - scheduler.now_ms() + 2 * HOUR_MS + 1).unwrap(),
        ))
        .await;
        assert_eq!(calls.get(), 3);
        let entry = alarms.get("flaky").unwrap().unwrap();
        assert_eq!(entry.state, AlarmState::Pending);
        assert_eq!(entry.runs, 3);
        assert_eq!(entry.next_run_at, Some(first + 3 * HOUR_MS));
        // Two of the three ticks were even hours, one of them the last
        // failure or not: the error shows until a success clears it.
        let last_failed = (first + 2 * HOUR_MS) % (2 * HOUR_MS) == 0;
        assert_eq!(entry.last_error.is_some(), last_failed, "{entry:?}");
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn replace_pause_resume_and_cancel_are_durable_and_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let plan = Plan {
        schedules: vec![(
            "hourly",
            Recurrence::every(Duration::from_secs(3_600)).unwrap(),
        )],
        failures_per_tick: 0,
    };
    tokio::task::LocalSet::new()
        .run_until(async {
            // The clock starts at 00:30; ticks are on the full hours.
            let one = MONDAY_MS + HOUR_MS / 2;
            let (host, objects) = open(dir.path(), MONDAY_MS, &plan).await;
            on_object_async(&objects, move |o| async move {
                let before = o.alarms.list().unwrap();
                assert_eq!(before.len(), 1);
                assert_eq!(before[0].state, AlarmState::Pending);
                assert_eq!(before[0].next_run_at, Some(one));
                let hourly = Recurrence::every(Duration::from_secs(3_600)).unwrap();
                assert_eq!(before[0].recurrence.as_ref(), Some(&hourly));
                // The same registration again changes nothing.
                let next = o.alarms.schedule_recurring("hourly", &hourly, &()).await;
                assert_eq!(next.unwrap(), Some(one));
                assert_eq!(o.alarms.list().unwrap(), before);
                assert!(o.alarms.pause("hourly").await.unwrap());
                assert!(!o.alarms.pause("hourly").await.unwrap());
                let paused = o.alarms.get("hourly").unwrap().unwrap();
                assert_eq!(
                    (paused.state, paused.next_run_at),
                    (AlarmState::Paused, None)
                );
            })
            .await;
            // Paused across an eviction and two ticks; registering the same
            // schedule again (as a constructor does) keeps it paused.
            host.evict(&objects.id_of("object").unwrap()).await.unwrap();
            sleep_until(&host, one + HOUR_MS + 60_000).await;
            let resumed_at = on_object_async(&objects, move |o| async move {
                let hourly = Recurrence::every(Duration::from_secs(3_600)).unwrap();
                let next = o.alarms.schedule_recurring("hourly", &hourly, &()).await;
                assert_eq!(next.unwrap(), None, "still paused");
                assert!(runs(o.ctx.storage(), "hourly").is_empty());
                let resumed = o.alarms.resume("hourly").await.unwrap();
                assert_eq!(o.alarms.resume("hourly").await.unwrap(), resumed);
                resumed
            })
            .await;
            assert_eq!(resumed_at, one + 2 * HOUR_MS, "no tick of the pause");
            sleep_until(&host, one + 2 * HOUR_MS + 60_000).await;
            on_object_async(&objects, move |o| async move {
                let ran = runs(o.ctx.storage(), "hourly");
                assert_eq!(ran.len(), 1);
                assert_eq!((ran[0].tick, ran[0].missed), (one + 2 * HOUR_MS, 0));
                // A different schedule replaces it.
                let half = Recurrence::every(Duration::from_secs(1_800)).unwrap();
                let next = o.alarms.schedule_recurring("hourly", &half, &()).await;
                assert_eq!(next.unwrap(), Some(one + 2 * HOUR_MS + HOUR_MS / 2));
                assert_eq!(o.alarms.get("hourly").unwrap().unwrap().runs, 0);
                assert!(o.alarms.cancel("hourly").await.unwrap());
                assert!(!o.alarms.cancel("hourly").await.unwrap());
                assert!(o.alarms.list().unwrap().is_empty());
                assert!(matches!(
                    o.alarms.pause("hourly").await,
                    Err(durability::DurabilityError::NotRecurring { .. })
                ));
            })
            .await;
            host.evict(&objects.id_of("object").unwrap()).await.unwrap();
            sleep_until(&host, MONDAY_MS + 6 * HOUR_MS).await;
            let ran = on_object(&objects, |o| runs(o.ctx.storage(), "hourly").len()).await;
            assert_eq!(ran, 1, "nothing runs after the cancel");
            host.shutdown().await;
        })
        .await;
}

#[tokio::test(start_paused = true)]
async fn bad_recurring_input_is_a_typed_error_and_writes_nothing() {
    assert!(matches!(
        Recurrence::cron("61 * * * *", "UTC"),
        Err(RecurrenceError::InvalidCron { .. })
    ));
    assert!(matches!(
        Recurrence::cron("0 8 * * *", "Mars/Olympus"),
        Err(RecurrenceError::UnknownTimeZone { .. })
    ));
    assert!(matches!(
        Recurrence::every(Duration::ZERO),
        Err(RecurrenceError::OutOfRange {
            field: "interval (ms)",
            ..
        })
    ));
    assert!(matches!(
        Recurrence::cron("0 8 * * *", "UTC").unwrap().anchored_at(5),
        Err(RecurrenceError::AnchorOnCron { .. })
    ));
    // Six fields: seconds first.
    let every_ten_seconds = Recurrence::cron("*/10 * * * * *", "UTC").unwrap();
    assert_eq!(every_ten_seconds.next_after(1_001), Some(10_000));
    support::on_harness(|h| async move {
        let scheduler = Scheduler::new(h.context()).unwrap();
        let alarms = Alarms::builder(&scheduler)
            .handler("known", |_: AlarmCall| async { Ok(()) })
            .build()
            .unwrap();
        let hourly = Recurrence::every(Duration::from_secs(3_600)).unwrap();
        let zero = hourly.clone().missed_ticks(MissedTicks::CatchUp { max: 0 });
        assert!(matches!(
            alarms.schedule_recurring("known", &zero, &()).await,
            Err(durability::DurabilityError::Recurrence(
                RecurrenceError::OutOfRange {
                    field: "missed_ticks.catch_up.max",
                    ..
                }
            ))
        ));
        let never = Recurrence::cron("0 0 30 2 *", "UTC").unwrap();
        assert!(matches!(
            alarms.schedule_recurring("known", &never, &()).await,
            Err(durability::DurabilityError::Recurrence(
                RecurrenceError::NoNextTick { .. }
            ))
        ));
        assert!(matches!(
            alarms.schedule_recurring("unknown", &hourly, &()).await,
            Err(durability::DurabilityError::UnknownHandler { .. })
        ));
        assert!(alarms.list().unwrap().is_empty());
        // Matchable kinds: bad input, and a name without a schedule.
        let bad = alarms
            .schedule_recurring("known", &zero, &())
            .await
            .unwrap_err();
        assert_eq!(bad.kind(), durability::ErrorKind::InvalidInput);
        let absent = alarms.resume("known").await.unwrap_err();
        assert_eq!(absent.kind(), durability::ErrorKind::NotFound);
        let huge = "x".repeat(2 << 20);
        let too_large = alarms
            .schedule_recurring("known", &hourly, &huge)
            .await
            .unwrap_err();
        assert_eq!(too_large.kind(), durability::ErrorKind::TooLarge);
        assert!(alarms.list().unwrap().is_empty());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_handler_receives_the_payload_and_its_tick() {
    support::on_harness(|h| async move {
        let scheduler = Scheduler::new(h.context()).unwrap();
        h.install(&scheduler);
        let seen = Rc::new(std::cell::RefCell::new(Vec::new()));
        let record = Rc::clone(&seen);
        let alarms = Alarms::builder(&scheduler)
            .handler("digest", move |call: AlarmCall| {
                let to: Result<Vec<String>, _> = call.payload_as();
                record.borrow_mut().push((call.scheduled_time, to.unwrap()));
                async { Ok(()) }
            })
            .build()
            .unwrap();
        let every_minute = Recurrence::cron("* * * * *", "UTC").unwrap();
        let first = alarms
            .schedule_recurring("digest", &every_minute, &["ops@example.com"])
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first % 60_000, 0);
        tokio::time::sleep(Duration::from_millis(
            u64::try_from(first + 60_001 - scheduler.now_ms()).unwrap(),
        ))
        .await;
        let to = vec!["ops@example.com".to_owned()];
        assert_eq!(*seen.borrow(), [(first, to.clone()), (first + 60_000, to)]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn purge_before_removes_a_schedule_with_its_occurrence() {
    support::on_harness(|h| async move {
        let scheduler = Scheduler::new(h.context()).unwrap();
        h.install(&scheduler);
        let runs = Rc::new(Cell::new(0));
        let counter = Rc::clone(&runs);
        let alarms = Alarms::builder(&scheduler)
            .handler("hourly", move |_: AlarmCall| {
                counter.set(counter.get() + 1);
                async { Ok(()) }
            })
            .build()
            .unwrap();
        let every_hour = Recurrence::every(Duration::from_secs(3_600)).unwrap();
        alarms
            .schedule_recurring("hourly", &every_hour, &())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(alarms.purge_before(scheduler.now_ms()).await.unwrap(), 1);
        assert!(alarms.list().unwrap().is_empty());
        let schedules = support::query_i64(
            &*h.context(),
            "SELECT COUNT(*) FROM durability_alarm_schedules",
            &[],
        );
        assert_eq!(schedules, 0);
        tokio::time::sleep(Duration::from_secs(3 * 3_600)).await;
        assert_eq!(runs.get(), 0);
    })
    .await;
}

/// Ticks closer together than the physical alarm's minimum distance (15 s
/// by default) run from the in-memory timer at their own times: the
/// completing transaction of a tick reconciles while the tick still runs,
/// and the next occurrence must still get its timer.
#[tokio::test(start_paused = true)]
async fn ticks_closer_than_the_physical_alarm_run_at_their_own_times() {
    let dir = tempfile::tempdir().unwrap();
    let plan = Plan {
        schedules: vec![("fast", Recurrence::every(Duration::from_secs(2)).unwrap())],
        failures_per_tick: 0,
    };
    tokio::task::LocalSet::new()
        .run_until(async {
            let start = MONDAY_MS;
            let (host, objects) = open(dir.path(), start, &plan).await;
            sleep_until(&host, start + 9_000).await;
            let runs = on_object(&objects, |o| runs(o.ctx.storage(), "fast")).await;
            assert!(
                runs.len() >= 4,
                "a tick every 2 s for 9 s, not one per physical alarm: {runs:?}"
            );
            for run in &runs {
                assert!(
                    run.ran_at - run.tick < 1_000,
                    "each tick ran at its own time: {run:?}"
                );
            }
            host.shutdown().await;
        })
        .await;
}
