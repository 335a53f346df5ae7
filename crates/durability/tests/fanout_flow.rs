//! Fanout flow control per target (issue 14, part 2) on a real inline host
//! (real SQLite files), on paused tokio time: rate limits, concurrency,
//! durable pause across eviction and restart, changes while running, and
//! bad settings.

mod support;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Mutex;
use std::time::Duration;

use durability::ErrorKind;
use durability::error::{ConfigError, HandlerError};
use durability::fanout::{
    EnqueueOptions, EnqueueResult, Fanout, FanoutConfigError, FanoutError, FanoutInput,
    FanoutMessage, FlowControl, Target,
};
use durability::retry::Delay;
use durability::{Scheduler, platform::Context};
use support::{Harness, physical_alarm, query_i64};

/// A scheduler with default options whose alarm the object delegates to.
fn scheduler(h: &Harness) -> Scheduler {
    let scheduler = Scheduler::new(h.context()).unwrap();
    h.install(&scheduler);
    scheduler
}

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

fn inputs(prefix: &str, n: usize) -> Vec<FanoutInput<String>> {
    (0..n)
        .map(|i| FanoutInput::new(format!("body {i}")).id(format!("{prefix}-{i:04}")))
        .collect()
}

fn accept<T: std::fmt::Debug>(result: Result<EnqueueResult<T>, FanoutError>) {
    match result.unwrap() {
        EnqueueResult::Accepted { .. } => {}
        other => panic!("not accepted: {other:?}"),
    }
}

fn owed(ctx: &dyn Context, target: &str) -> i64 {
    query_i64(
        ctx,
        "SELECT COUNT(*) FROM durability_fanout_deliveries WHERE target_id = ?",
        &durability::platform::params![target],
    )
}

fn dead_or_parked(ctx: &dyn Context) -> i64 {
    query_i64(
        ctx,
        "SELECT (SELECT COUNT(*) FROM durability_fanout_parked) + \
         (SELECT COUNT(*) FROM durability_fanout_exceptions WHERE phase = 'dead_letter')",
        &[],
    )
}

/// Every delivery a consumer got, as (message id, attempt, clock ms).
#[derive(Clone, Default)]
struct Log(Rc<RefCell<Vec<(String, u32, i64)>>>);

impl Log {
    /// A consumer that records each message at the host's clock and acks
    /// it on return.
    fn acking(&self, scheduler: &Scheduler) -> Target<String> {
        let log = self.clone();
        let scheduler = scheduler.clone();
        Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
            let now = scheduler.now_ms();
            log.0
                .borrow_mut()
                .extend(batch.iter().map(|m| (m.id.clone(), m.attempt, now)));
            async { Ok::<_, HandlerError>(()) }
        })
        .ack_on_return(true)
    }

    fn len(&self) -> usize {
        self.0.borrow().len()
    }

    fn between(&self, from: i64, to: i64) -> usize {
        self.0
            .borrow()
            .iter()
            .filter(|(_, _, at)| (from..=to).contains(at))
            .count()
    }

    fn ids(&self) -> Vec<String> {
        self.0
            .borrow()
            .iter()
            .map(|(id, _, _)| id.clone())
            .collect()
    }
}

#[tokio::test(start_paused = true)]
async fn a_target_limited_to_10_per_second_gets_exactly_its_rate_while_an_unlimited_one_drains() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let (limited, free) = (Log::default(), Log::default());
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("limited", limited.acking(&scheduler))
            .target("free", free.acking(&scheduler))
            .flow_control(
                "limited",
                FlowControl::new().rate_limit(10, Duration::from_secs(1)),
            )
            .build()
            .unwrap();
        let start = scheduler.now_ms();
        accept(
            fanout
                .enqueue(inputs("m", 1_000), &EnqueueOptions::all())
                .await,
        );
        sleep_ms(1).await;
        // The unlimited target drains at once; the limited one had its
        // burst (a full bucket) and waits for its next token.
        assert_eq!(free.len(), 1_000);
        assert_eq!(limited.len(), 10);
        for _ in 0..600 {
            sleep_ms(100).await;
        }
        sleep_ms(50).await;
        // Exactly 10 a second over the minute after the burst, in order,
        // each once.
        assert_eq!(limited.between(start + 1, start + 60_000), 600);
        assert_eq!(limited.len(), 610);
        let expected: Vec<String> = (0..610).map(|i| format!("m-{i:04}")).collect();
        assert_eq!(limited.ids(), expected);
        // Woken when a batch's tokens were due (the scheduler's timer and
        // alarm are set to it), not by polling: a batch of 10 (the batch
        // size and the bucket) at exactly start + 1 s, + 2 s, ...
        let times: Vec<i64> = limited.0.borrow()[10..]
            .iter()
            .map(|(_, _, at)| *at)
            .collect();
        let due: Vec<i64> = (0..600).map(|k| start + 1_000 * (k / 10 + 1)).collect();
        assert_eq!(times, due);
        // Nothing dropped or dead-lettered: the rest is still owed.
        assert_eq!(owed(&*ctx, "limited"), 390);
        assert_eq!(owed(&*ctx, "free"), 0);
        assert_eq!(dead_or_parked(&*ctx), 0);
        assert_eq!(fanout.load().unwrap().outbound.pending_deliveries, 390);
        // Every delivery of the limited target was its first attempt: a
        // held-back message is never counted as a failed one.
        assert!(
            limited
                .0
                .borrow()
                .iter()
                .all(|(_, attempt, _)| *attempt == 1)
        );
        h.keep(fanout);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn concurrency_one_never_overlaps_two_deliveries() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let in_flight = Rc::new(Cell::new(0_u32));
        let most = Rc::new(Cell::new(0_u32));
        let delivered = Rc::new(Cell::new(0_u32));
        let target = {
            let (in_flight, most, delivered) = (
                Rc::clone(&in_flight),
                Rc::clone(&most),
                Rc::clone(&delivered),
            );
            Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                let (in_flight, most, delivered) = (
                    Rc::clone(&in_flight),
                    Rc::clone(&most),
                    Rc::clone(&delivered),
                );
                async move {
                    let n = u32::try_from(batch.len()).unwrap();
                    in_flight.set(in_flight.get() + n);
                    most.set(most.get().max(in_flight.get()));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    // Every third first attempt fails: retries go under
                    // the same limit.
                    let fail = batch
                        .iter()
                        .any(|m| m.attempt == 1 && m.id.ends_with(['0', '3', '6']));
                    in_flight.set(in_flight.get() - n);
                    if fail {
                        return Err(HandlerError::new("try again"));
                    }
                    delivered.set(delivered.get() + n);
                    Ok(())
                }
            })
            .ack_on_return(true)
        };
        let free = Log::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("one", target)
            .target("free", free.acking(&scheduler))
            .retry_delay(Delay::Fixed { ms: 10.0 })
            .flow_control("one", FlowControl::new().concurrency(1))
            .build()
            .unwrap();
        // Several calls, some while a delivery is in flight, each of which
        // starts a pass of its own.
        for round in 0..4 {
            accept(
                fanout
                    .enqueue(inputs(&format!("r{round}"), 10), &EnqueueOptions::all())
                    .await,
            );
            sleep_ms(20).await;
            fanout.alarm(None).await.unwrap();
        }
        sleep_ms(10_000).await;
        assert_eq!(delivered.get(), 40);
        assert_eq!(most.get(), 1, "two deliveries overlapped");
        assert_eq!(free.len(), 40);
        assert_eq!(owed(&*ctx, "one"), 0);
        assert_eq!(dead_or_parked(&*ctx), 0);
        h.keep(fanout);
    })
    .await;
}

/// Calls cross to the object's executor, so the records are statics.
static PAUSED: Mutex<Vec<String>> = Mutex::new(Vec::new());
static LIVE: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn recording(log: &'static Mutex<Vec<String>>) -> Target<String> {
    Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
        log.lock()
            .unwrap()
            .extend(batch.iter().map(|m| m.id.clone()));
        async { Ok::<_, HandlerError>(()) }
    })
    .ack_on_return(true)
}

fn build(h: &Harness) -> Fanout<String> {
    let scheduler = scheduler(h);
    Fanout::<String>::builder(&scheduler)
        .target("paused", recording(&PAUSED))
        .target("live", recording(&LIVE))
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_paused_target_accepts_delivers_nothing_and_stays_paused_across_eviction_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    tokio::task::LocalSet::new()
        .run_until(async move {
            let (host, objects) = support::open_harness_host(&path);
            let stub = objects.stub("mail").unwrap();
            stub.call(|h: Rc<Harness>| async move {
                let fanout = build(&h);
                fanout.pause_target("paused").await.unwrap();
                fanout.pause_target("paused").await.unwrap(); // idempotent
                accept(fanout.enqueue(inputs("a", 5), &EnqueueOptions::all()).await);
                sleep_ms(1_000).await;
                assert_eq!(fanout.paused_targets().unwrap(), vec!["paused".to_owned()]);
                // Its backlog shows in the load snapshot.
                assert_eq!(fanout.load().unwrap().outbound.pending_deliveries, 5);
                // Nothing of a paused target keeps an alarm armed.
                assert_eq!(physical_alarm(&*h.context()).await, None);
                h.keep(fanout);
            })
            .await
            .unwrap();
            host.evict(stub.id()).await.unwrap();
            stub.call(|h: Rc<Harness>| async move {
                let fanout = build(&h);
                accept(fanout.enqueue(inputs("b", 3), &EnqueueOptions::all()).await);
                sleep_ms(60_000).await;
                assert_eq!(fanout.paused_targets().unwrap(), vec!["paused".to_owned()]);
                assert_eq!(fanout.load().unwrap().outbound.pending_deliveries, 8);
                assert_eq!(owed(&*h.context(), "paused"), 8);
                assert_eq!(fanout.backlog("paused").unwrap(), 8);
                assert_eq!(fanout.backlog("live").unwrap(), 0);
                h.keep(fanout);
            })
            .await
            .unwrap();
            host.shutdown().await;
            // A restart: a new host over the same files.
            let (host, objects) = support::open_harness_host(&path);
            let stub = objects.stub("mail").unwrap();
            stub.call(|h: Rc<Harness>| async move {
                let fanout = build(&h);
                sleep_ms(60_000).await;
                assert!(
                    PAUSED.lock().unwrap().is_empty(),
                    "a paused target got work"
                );
                assert_eq!(fanout.paused_targets().unwrap(), vec!["paused".to_owned()]);
                fanout.resume_target("paused").await.unwrap();
                fanout.resume_target("paused").await.unwrap(); // idempotent
                sleep_ms(1_000).await;
                assert!(fanout.paused_targets().unwrap().is_empty());
                assert_eq!(fanout.load().unwrap().outbound.pending_deliveries, 0);
                assert_eq!(dead_or_parked(&*h.context()), 0);
                h.keep(fanout);
            })
            .await
            .unwrap();
            host.shutdown().await;
        })
        .await;
    let mut expected: Vec<String> = (0..5).map(|i| format!("a-{i:04}")).collect();
    expected.extend((0..3).map(|i| format!("b-{i:04}")));
    assert_eq!(
        *PAUSED.lock().unwrap(),
        expected,
        "the backlog, in order, once"
    );
    assert_eq!(*LIVE.lock().unwrap(), expected);
}

#[tokio::test(start_paused = true)]
async fn a_paused_target_holds_its_retries_too_and_resuming_delivers_them() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let attempts = Rc::new(RefCell::new(Vec::new()));
        let target = {
            let attempts = Rc::clone(&attempts);
            Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                attempts
                    .borrow_mut()
                    .extend(batch.iter().map(|m| m.attempt));
                let fail = batch.iter().any(|m| m.attempt == 1);
                async move {
                    if fail {
                        Err(HandlerError::new("down"))
                    } else {
                        Ok(())
                    }
                }
            })
            .ack_on_return(true)
        };
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("t", target)
            .retry_delay(Delay::Fixed { ms: 1_000.0 })
            .build()
            .unwrap();
        accept(fanout.enqueue(inputs("m", 1), &EnqueueOptions::all()).await);
        sleep_ms(1).await;
        assert_eq!(*attempts.borrow(), vec![1]);
        fanout.pause_target("t").await.unwrap();
        assert_eq!(physical_alarm(&*ctx).await, None);
        sleep_ms(30_000).await;
        assert_eq!(*attempts.borrow(), vec![1], "a paused target got a retry");
        assert_eq!(owed(&*ctx, "t"), 1);
        fanout.resume_target("t").await.unwrap();
        sleep_ms(10).await;
        assert_eq!(*attempts.borrow(), vec![1, 2]);
        assert_eq!(owed(&*ctx, "t"), 0);
        // Unknown targets: a typed error, nothing written.
        let error = fanout.pause_target("nobody").await.unwrap_err();
        assert!(matches!(error, FanoutError::UnknownTarget { ref target } if target == "nobody"));
        assert_eq!(error.kind(), ErrorKind::NotFound);
        assert_eq!(
            query_i64(
                &*ctx,
                "SELECT COUNT(*) FROM durability_fanout_cursors WHERE target_id = 'nobody'",
                &[]
            ),
            0
        );
        h.keep(fanout);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn limits_change_while_running_and_a_looser_one_wakes_the_target_at_once() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let log = Log::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("t", log.acking(&scheduler))
            .flow_control(
                "t",
                FlowControl::new().rate_limit(1, Duration::from_secs(3_600)),
            )
            .build()
            .unwrap();
        let start = scheduler.now_ms();
        accept(
            fanout
                .enqueue(inputs("m", 50), &EnqueueOptions::all())
                .await,
        );
        sleep_ms(1).await;
        assert_eq!(log.len(), 1);
        assert_eq!(physical_alarm(&*ctx).await, Some(start + 3_600_000));
        // Tighter and looser, while running.
        fanout
            .set_flow_control("t", FlowControl::new().concurrency(5))
            .unwrap();
        sleep_ms(1).await;
        assert_eq!(log.len(), 50, "no rate limit any more: drained at once");
        // Batches of at most 5 now.
        fanout
            .set_flow_control(
                "t",
                FlowControl::new().rate_limit(2, Duration::from_millis(1_000)),
            )
            .unwrap();
        let now = scheduler.now_ms();
        accept(
            fanout
                .enqueue(inputs("n", 10), &EnqueueOptions::all())
                .await,
        );
        sleep_ms(1).await;
        assert_eq!(log.between(now, now + 1), 2, "a full bucket of 2");
        sleep_ms(4_000).await;
        assert_eq!(log.len(), 60);
        h.keep(fanout);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn bad_flow_settings_are_typed_errors_naming_the_setter_and_rule() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let build = |flow: FlowControl, target: &str| {
            Fanout::<String>::builder(&scheduler)
                .target("t", Target::consumer(|_: Vec<FanoutMessage<String>>| async { Ok(()) }))
                .flow_control(target, flow)
                .build()
                .unwrap_err()
        };
        let error = build(FlowControl::new().concurrency(0), "t");
        assert!(
            matches!(&error, FanoutConfigError::Config(ConfigError::NotPositive { field }) if field == "concurrency"),
            "{error}"
        );
        let error = build(FlowControl::new().concurrency(100_001), "t");
        assert!(
            matches!(&error, FanoutConfigError::Config(ConfigError::OutOfRange { field, min: 1, max: 100_000 }) if field == "concurrency"),
            "{error}"
        );
        let error = build(
            FlowControl::new().rate_limit(0, Duration::from_secs(1)),
            "t",
        );
        assert!(
            matches!(&error, FanoutConfigError::Config(ConfigError::NotPositive { field }) if field == "rate_limit.deliveries"),
            "{error}"
        );
        let error = build(
            FlowControl::new().rate_limit(5, Duration::from_micros(10_500)),
            "t",
        );
        assert!(
            matches!(&error, FanoutConfigError::Config(ConfigError::NotWholeMilliseconds { field, .. }) if field == "rate_limit.interval"),
            "{error}"
        );
        let error = build(
            FlowControl::new().rate_limit(5, Duration::from_millis(2_147_483_648)),
            "t",
        );
        assert!(
            matches!(&error, FanoutConfigError::Config(ConfigError::DurationOutOfRange { field, min_ms: 1, max_ms: 2_147_483_647 }) if field == "rate_limit.interval"),
            "{error}"
        );
        let error = build(FlowControl::new().concurrency(1), "elsewhere");
        assert!(
            matches!(&error, FanoutConfigError::InvalidTarget { id, .. } if id == "elsewhere"),
            "{error}"
        );
        // While running: the same errors, and the limits stay as they were.
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("t", Target::consumer(|_: Vec<FanoutMessage<String>>| async { Ok(()) }))
            .build()
            .unwrap();
        let error = fanout
            .set_flow_control("t", FlowControl::new().rate_limit(1, Duration::ZERO))
            .unwrap_err();
        assert!(
            matches!(&error, FanoutConfigError::Config(ConfigError::DurationOutOfRange { field, .. }) if field == "rate_limit.interval"),
            "{error}"
        );
        let error = fanout
            .set_flow_control("other", FlowControl::new())
            .unwrap_err();
        assert_eq!(error.kind(), ErrorKind::InvalidConfig);
    })
    .await;
}
