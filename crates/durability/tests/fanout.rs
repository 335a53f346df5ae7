//! Fanout (queues.md §3) on a real inline host (real SQLite files), on
//! paused tokio time: one test per invariant of §3.20, then the parked dead
//! letters of issue 4, settlement, lifecycle events, memos, redrive, and bad
//! input. The SIGKILL tests are in `fanout_crash.rs`.

mod support;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use durability::error::{ConfigError, HandlerError, SerializedError};
use durability::fanout::{
    DeadLetterReason, EnqueueOptions, EnqueueRejection, EnqueueResult, Fanout, FanoutConfigError,
    FanoutError, FanoutInput, FanoutMessage, SettlementError, SettlementOutcome, Settling,
    StoredMessage, Target,
};
use durability::lifecycle::{LifecycleEvent, Outcome, TerminalReason};
use durability::platform::{Context, MAX_SAFE_INTEGER, params};
use durability::retry::{Delay, MethodPolicy};
use durability::{DurabilityError, Scheduler};
use support::{Events, Gate, Harness, physical_alarm, query_i64, table_snapshot};

/// The host clock of a fresh harness starts here.
const START_MS: i64 = 1_000_000;
/// The default attempt timeout.
const ATTEMPT_TIMEOUT_MS: i64 = 300_000;
/// The wait of a removed target's rows and of a failed DLQ write.
const INFRASTRUCTURE_RETRY_MS: i64 = 60_000;

/// Every fanout table, and the view of owed deliveries.
const FANOUT_TABLES: [&str; 7] = [
    "durability_fanout_messages",
    "durability_fanout_deliveries",
    "durability_fanout_exceptions",
    "durability_fanout_cursors",
    "durability_fanout_spans",
    "durability_fanout_seq",
    "durability_fanout_parked",
];

/// A scheduler with default options whose alarm the object delegates to.
fn scheduler(h: &Harness) -> Scheduler {
    let scheduler = Scheduler::new(h.context()).unwrap();
    h.install(&scheduler);
    scheduler
}

/// Lets background work (eager passes, timers due now, settlements) run,
/// moving the clock by one millisecond.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

fn count(ctx: &dyn Context, sql: &str) -> i64 {
    query_i64(ctx, sql, &[])
}

/// Owed deliveries (the view over cursors and exception rows).
fn deliveries(ctx: &dyn Context) -> i64 {
    count(ctx, "SELECT COUNT(*) FROM durability_fanout_deliveries")
}

fn manifests(ctx: &dyn Context) -> i64 {
    count(ctx, "SELECT COUNT(*) FROM durability_fanout_messages")
}

/// (attempt, next_attempt_at, phase) of the delivery of message key `key`
/// to `target`, if the row exists.
fn delivery(ctx: &dyn Context, key: &str, target: &str) -> Option<(u32, i64, String)> {
    ctx.storage()
        .query_row(
            "SELECT attempt, next_attempt_at, phase FROM durability_fanout_deliveries \
             WHERE message_key = ? AND target_id = ?",
            &params![key, target],
        )
        .unwrap()
        .map(|row| {
            (
                row.get(0).unwrap(),
                row.get(1).unwrap(),
                row.get(2).unwrap(),
            )
        })
}

fn snapshot(ctx: &dyn Context) -> Vec<Vec<Vec<durability::platform::Value>>> {
    let mut tables: Vec<_> = FANOUT_TABLES
        .iter()
        .map(|table| table_snapshot(ctx, table))
        .collect();
    tables.push(table_snapshot(ctx, "durability_memos"));
    tables
}

fn input(id: &str) -> FanoutInput<String> {
    FanoutInput::new(format!("body of {id}")).id(id)
}

fn inputs(ids: &[&str]) -> Vec<FanoutInput<String>> {
    ids.iter().map(|id| input(id)).collect()
}

fn accepted<T: std::fmt::Debug>(result: Result<EnqueueResult<T>, FanoutError>) -> T {
    match result.unwrap() {
        EnqueueResult::Accepted { value, .. } => value,
        EnqueueResult::Rejected { error, .. } => panic!("rejected: {error}"),
    }
}

fn rejected<T: std::fmt::Debug>(result: Result<EnqueueResult<T>, FanoutError>) -> EnqueueRejection {
    match result.unwrap() {
        EnqueueResult::Rejected { error, .. } => error,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// What a test consumer does with one message.
#[derive(Debug, Clone, PartialEq)]
enum Act {
    Ack,
    Retry,
    RetryAfter(u64),
    DeadLetter,
    /// Leave it unsettled.
    Leave,
    /// Leave it unsettled and make the whole call fail.
    Fail(HandlerError),
}

/// Every batch a consumer received, as (message id, attempt), in order.
#[derive(Clone, Default)]
struct Batches(Rc<RefCell<BatchLog>>);

/// Batches of (message id, attempt).
type BatchLog = Vec<Vec<(String, u32)>>;

impl Batches {
    fn record(&self, batch: &[FanoutMessage<String>]) {
        self.0
            .borrow_mut()
            .push(batch.iter().map(|m| (m.id.clone(), m.attempt)).collect());
    }

    fn all(&self) -> BatchLog {
        self.0.borrow().clone()
    }

    fn ids(&self) -> Vec<Vec<String>> {
        self.all()
            .into_iter()
            .map(|batch| batch.into_iter().map(|(id, _)| id).collect())
            .collect()
    }

    fn deliveries_of(&self, id: &str) -> Vec<u32> {
        self.all()
            .into_iter()
            .flatten()
            .filter(|(m, _)| m == id)
            .map(|(_, attempt)| attempt)
            .collect()
    }

    fn count(&self) -> usize {
        self.0.borrow().iter().map(Vec::len).sum()
    }
}

/// A consumer that records its batches and settles each message as `act`
/// says, awaiting its settlements before it returns.
fn consumer(
    batches: &Batches,
    act: impl Fn(&FanoutMessage<String>) -> Act + 'static,
) -> Target<String> {
    let batches = batches.clone();
    Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
        batches.record(&batch);
        let mut settlements: Vec<Settling> = Vec::new();
        let mut failure = None;
        for message in &batch {
            match act(message) {
                Act::Ack => settlements.push(message.ack()),
                Act::Retry => settlements.push(message.retry()),
                Act::RetryAfter(ms) => {
                    settlements.push(message.retry_after(Duration::from_millis(ms)));
                }
                Act::DeadLetter => settlements.push(message.dead_letter()),
                Act::Leave => {}
                Act::Fail(error) => failure = Some(error),
            }
        }
        async move {
            for settlement in settlements {
                settlement
                    .await
                    .map_err(|error| HandlerError::new(error.to_string()))?;
            }
            match failure {
                Some(error) => Err(error),
                None => Ok(()),
            }
        }
    })
}

fn acking(batches: &Batches) -> Target<String> {
    consumer(batches, |_| Act::Ack)
}

/// A DLQ (or storage target) that keeps what it receives.
#[derive(Clone, Default)]
struct Store(Rc<RefCell<Vec<StoredMessage<String>>>>);

impl Store {
    fn writer(
        &self,
    ) -> impl Fn(StoredMessage<String>) -> std::future::Ready<Result<(), HandlerError>> + 'static
    {
        let kept = Rc::clone(&self.0);
        move |stored| {
            kept.borrow_mut().push(stored);
            std::future::ready(Ok(()))
        }
    }

    fn all(&self) -> Vec<StoredMessage<String>> {
        self.0.borrow().clone()
    }
}

/// Every message is still owed to a target (or waits for a cursor to pass
/// its settled delivery), and no owed delivery lacks its message.
fn assert_manifests_consistent(ctx: &dyn Context) {
    let wrong = count(
        ctx,
        "SELECT COUNT(*) FROM durability_fanout_messages m WHERE NOT EXISTS \
         (SELECT 1 FROM durability_fanout_deliveries d WHERE d.message_key = m.key) \
         AND NOT EXISTS (SELECT 1 FROM durability_fanout_exceptions e WHERE e.seq = m.seq)",
    );
    assert_eq!(wrong, 0, "a message is left behind with nothing owed");
    let orphans = count(
        ctx,
        "SELECT COUNT(*) FROM durability_fanout_deliveries d WHERE NOT EXISTS \
         (SELECT 1 FROM durability_fanout_messages m WHERE m.key = d.message_key)",
    );
    assert_eq!(orphans, 0, "a delivery row without its manifest");
}

// ---------------------------------------------------------------------------
// §3.20 (1)

#[tokio::test(start_paused = true)]
async fn acceptance_is_atomic_everything_or_nothing() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("a", consumer(&Batches::default(), |_| Act::Leave))
            .target("b", consumer(&Batches::default(), |_| Act::Leave))
            .batch_delay(Duration::from_secs(3_600))
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(inputs(&["m0"]), &EnqueueOptions::all())
                .await,
        );
        let before = snapshot(&*ctx);
        // The third message names m0's key with another body: the first two,
        // valid on their own, are not written either.
        let batch = vec![
            input("m1"),
            input("m2"),
            FanoutInput::new("another body".to_owned()).id("m0"),
        ];
        let error = rejected(fanout.enqueue(batch, &EnqueueOptions::all()).await);
        assert_eq!(
            error,
            EnqueueRejection::DeduplicationConflict { key: "m0".into() }
        );
        assert_eq!(snapshot(&*ctx), before, "nothing of a rejected batch");
        // Accepted: every manifest, row and seq of the batch exists.
        let ids = accepted(
            fanout
                .enqueue(inputs(&["m1", "m2"]), &EnqueueOptions::all())
                .await,
        );
        assert_eq!(ids, vec!["m1", "m2"]);
        assert_eq!(manifests(&*ctx), 3);
        assert_eq!(deliveries(&*ctx), 6);
        assert_eq!(
            count(&*ctx, "SELECT next_seq FROM durability_fanout_seq"),
            3
        );
    })
    .await;
}

// §3.20 (2)
#[tokio::test(start_paused = true)]
async fn a_storage_failure_during_enqueue_is_an_error_never_a_rejection() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("a", consumer(&Batches::default(), |_| Act::Leave))
            .batch_delay(Duration::from_secs(3_600))
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(inputs(&["m0"]), &EnqueueOptions::all())
                .await,
        );
        assert_eq!(fanout.load().unwrap().outbound.pending_deliveries, 1);
        // The storage refuses the second row of the batch.
        ctx.storage()
            .execute_script(
                "CREATE TRIGGER refuse BEFORE INSERT ON durability_fanout_messages \
                 WHEN NEW.key = 'm2' BEGIN SELECT RAISE(ABORT, 'disk says no'); END;",
            )
            .unwrap();
        let before = snapshot(&*ctx);
        let result = fanout
            .enqueue(inputs(&["m1", "m2"]), &EnqueueOptions::all())
            .await;
        let error = result.expect_err("a storage failure is uncertain: an Err");
        assert!(
            matches!(error, FanoutError::Durability(DurabilityError::Storage(_))),
            "{error:?}"
        );
        assert_eq!(snapshot(&*ctx), before);
        // The failed transaction dropped the cached count; it is recounted.
        assert_eq!(fanout.load().unwrap().outbound.pending_deliveries, 1);
    })
    .await;
}

// §3.20 (3)
#[tokio::test(start_paused = true)]
async fn every_manifest_counts_its_rows_and_none_is_left_at_zero() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let (a, b, c) = (Batches::default(), Batches::default(), Batches::default());
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("a", acking(&a))
            .target(
                "b",
                consumer(&b, |m| {
                    if m.attempt < 3 {
                        Act::RetryAfter(10)
                    } else {
                        Act::Ack
                    }
                }),
            )
            .target(
                "c",
                consumer(&c, |m| {
                    if m.id == "m1" {
                        Act::DeadLetter
                    } else {
                        Act::Leave
                    }
                }),
            )
            .max_attempts(2)
            .retry_delay(Delay::Fixed { ms: 5.0 })
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(inputs(&["m0", "m1", "m2"]), &EnqueueOptions::all())
                .await,
        );
        assert_manifests_consistent(&*ctx);
        for _ in 0..20 {
            settle().await;
            assert_manifests_consistent(&*ctx);
            sleep_ms(4).await;
            assert_manifests_consistent(&*ctx);
        }
        // Everything settled (acked, or parked after its attempts): no
        // manifest is left behind.
        assert_eq!(deliveries(&*ctx), 0);
        assert_eq!(manifests(&*ctx), 0);
    })
    .await;
}

// §3.20 (4)
#[tokio::test(start_paused = true)]
async fn identical_work_is_deduplicated_and_any_difference_rejects_the_batch() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let (a, b) = (Batches::default(), Batches::default());
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("a", acking(&a))
            .target("b", consumer(&b, |_| Act::Leave))
            .build()
            .unwrap();
        let both = EnqueueOptions::to(["b", "a"]);
        accepted(fanout.enqueue(vec![input("m")], &both).await);
        settle().await;
        assert_eq!(a.deliveries_of("m"), vec![1]);
        assert!(delivery(&*ctx, "m", "a").is_none(), "acked by a");
        assert!(delivery(&*ctx, "m", "b").is_some(), "still owed to b");
        let before = snapshot(&*ctx);
        // Identical (the target order does not matter: the set is sorted).
        let ids = accepted(
            fanout
                .enqueue(vec![input("m")], &EnqueueOptions::to(["a", "b"]))
                .await,
        );
        assert_eq!(ids, vec!["m"]);
        settle().await;
        assert_eq!(
            a.deliveries_of("m"),
            vec![1],
            "no redelivery to a target that acked"
        );
        assert_eq!(
            snapshot(&*ctx)[0],
            before[0],
            "no new manifest for identical work"
        );
        // Any difference rejects, and names the key.
        let conflict = EnqueueRejection::DeduplicationConflict { key: "m".into() };
        let other_body = FanoutInput::new("other".to_owned()).id("m");
        assert_eq!(
            rejected(fanout.enqueue(vec![other_body], &both).await),
            conflict
        );
        assert_eq!(
            rejected(
                fanout
                    .enqueue(vec![input("m")], &EnqueueOptions::to(["a"]))
                    .await
            ),
            conflict
        );
        let other_id = FanoutInput::new("body of m".to_owned())
            .id("n")
            .deduplication_key("m");
        assert_eq!(
            rejected(fanout.enqueue(vec![other_id], &both).await),
            conflict
        );
        // Inside one batch: identical repeats share one registration, a
        // different one rejects the batch.
        let ids = accepted(fanout.enqueue(inputs(&["x", "x"]), &both).await);
        assert_eq!(ids, vec!["x", "x"]);
        assert_eq!(
            count(
                &*ctx,
                "SELECT COUNT(*) FROM durability_fanout_messages WHERE key = 'x'"
            ),
            1
        );
        let clash = vec![input("y"), FanoutInput::new("not y".to_owned()).id("y")];
        assert_eq!(
            rejected(fanout.enqueue(clash, &both).await),
            EnqueueRejection::DeduplicationConflict { key: "y".into() }
        );
        assert_eq!(
            count(
                &*ctx,
                "SELECT COUNT(*) FROM durability_fanout_messages WHERE key = 'y'"
            ),
            0
        );
    })
    .await;
}

// §3.20 (5)
#[tokio::test(start_paused = true)]
async fn once_its_manifest_is_gone_a_key_registers_a_new_generation() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let a = Batches::default();
        let identities = Rc::new(RefCell::new(Vec::new()));
        let seen = Rc::clone(&identities);
        let recorder = a.clone();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "a",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    recorder.record(&batch);
                    for m in &batch {
                        seen.borrow_mut().push(m.delivery_id.clone());
                    }
                    async { Ok::<_, HandlerError>(()) }
                })
                .ack_on_return(true),
            )
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(vec![input("m")], &EnqueueOptions::all())
                .await,
        );
        settle().await;
        assert_eq!(manifests(&*ctx), 0, "settled everywhere: manifest gone");
        accepted(
            fanout
                .enqueue(vec![input("m")], &EnqueueOptions::all())
                .await,
        );
        settle().await;
        assert_eq!(
            a.deliveries_of("m"),
            vec![1, 1],
            "delivered again, as new work"
        );
        let identities = identities.borrow();
        assert_eq!(identities.len(), 2);
        assert_ne!(identities[0], identities[1], "a new generation");
    })
    .await;
}

// §3.20 (6)
#[tokio::test(start_paused = true)]
async fn sequence_numbers_start_at_zero_and_grow_in_acceptance_order() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("a", consumer(&Batches::default(), |_| Act::Leave))
            .batch_delay(Duration::from_secs(3_600))
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(inputs(&["c", "a"]), &EnqueueOptions::all())
                .await,
        );
        // A rejected batch allocates nothing.
        let bad = vec![input("z"), FanoutInput::new(String::new()).id("")];
        rejected(fanout.enqueue(bad, &EnqueueOptions::all()).await);
        accepted(fanout.enqueue(inputs(&["b"]), &EnqueueOptions::all()).await);
        let rows = ctx
            .storage()
            .query(
                "SELECT id, seq FROM durability_fanout_messages ORDER BY seq",
                &[],
            )
            .unwrap();
        let seqs: Vec<(String, i64)> = rows
            .iter()
            .map(|row| (row.get(0).unwrap(), row.get(1).unwrap()))
            .collect();
        assert_eq!(
            seqs,
            vec![("c".into(), 0), ("a".into(), 1), ("b".into(), 2)]
        );
        let row_seqs = count(
            &*ctx,
            "SELECT COUNT(*) FROM durability_fanout_deliveries d JOIN durability_fanout_messages m \
             ON m.key = d.message_key WHERE d.seq <> m.seq",
        );
        assert_eq!(row_seqs, 0, "rows carry their manifest's seq");
    })
    .await;
}

// §3.20 (7)
#[tokio::test(start_paused = true)]
async fn first_deliveries_go_before_retries_each_by_sequence_a_bounded_batch_per_pass() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let t = Batches::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                consumer(&t, |m| match (m.id.as_str(), m.attempt) {
                    // m0 is due again later than m1, but comes first: retries
                    // go by sequence, not by due time.
                    ("m0", 1) => Act::RetryAfter(5),
                    ("m1" | "m2", 1) => Act::RetryAfter(0),
                    _ => Act::Ack,
                }),
            )
            .max_batch_size(3)
            .build()
            .unwrap();
        let ids = ["m0", "m1", "m2", "m3", "m4", "m5", "m6"];
        accepted(fanout.enqueue(inputs(&ids), &EnqueueOptions::all()).await);
        sleep_ms(10).await;
        assert_eq!(
            t.ids(),
            vec![
                vec!["m0", "m1", "m2"],
                // Due retries wait behind every due first delivery.
                vec!["m3", "m4", "m5"],
                vec!["m6", "m1", "m2"],
                vec!["m0"],
            ]
        );
        assert!(t.all().iter().all(|batch| batch.len() <= 3));
    })
    .await;
}

// §3.20 (8)
#[tokio::test(start_paused = true)]
async fn one_pass_per_target_at_a_time_and_targets_do_not_wait_for_each_other() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let gate = Gate::default();
        let running = Rc::new(Cell::new(0));
        let most = Rc::new(Cell::new(0));
        let (slow_batches, fast) = (Batches::default(), Batches::default());
        let slow = {
            let (gate, running, most, batches) = (
                gate.clone(),
                Rc::clone(&running),
                Rc::clone(&most),
                slow_batches.clone(),
            );
            Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                batches.record(&batch);
                let (gate, running, most) = (gate.clone(), Rc::clone(&running), Rc::clone(&most));
                running.set(running.get() + 1);
                most.set(most.get().max(running.get()));
                async move {
                    gate.wait().await;
                    running.set(running.get() - 1);
                    Ok::<_, HandlerError>(())
                }
            })
            .ack_on_return(true)
        };
        // A target of an older configuration, with due rows.
        {
            let old_scheduler = Scheduler::new(h.context()).unwrap();
            let old = Fanout::<String>::builder(&old_scheduler)
                .target("gone", consumer(&Batches::default(), |_| Act::Leave))
                .batch_delay(Duration::from_secs(3_600))
                .build()
                .unwrap();
            accepted(old.enqueue(inputs(&["g"]), &EnqueueOptions::all()).await);
        }
        sleep_ms(3_600_000).await;
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("slow", slow)
            .target("fast", acking(&fast))
            .max_batch_size(2)
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(
                    inputs(&["m0", "m1", "m2", "m3", "m4"]),
                    &EnqueueOptions::all(),
                )
                .await,
        );
        // Alarm runs meanwhile join the slow pass instead of starting one.
        for _ in 0..5 {
            let run = scheduler.clone();
            tokio::task::spawn_local(async move { run.alarm(None).await });
            settle().await;
        }
        // The slow target holds its first batch; the fast one delivered
        // everything meanwhile, and the removed one was postponed.
        assert_eq!(slow_batches.ids(), vec![vec!["m0", "m1"]]);
        assert_eq!(most.get(), 1);
        assert_eq!(fast.count(), 5);
        let (_, gone_due, _) = delivery(&*ctx, "g", "gone").unwrap();
        assert!(
            gone_due > START_MS + 3_600_000,
            "the removed target's row was postponed"
        );
        gate.open();
        sleep_ms(10).await;
        assert_eq!(slow_batches.count(), 5);
        assert_eq!(most.get(), 1, "never two passes of one target at once");
    })
    .await;
}

// §3.20 (9)
#[tokio::test(start_paused = true)]
async fn attempts_grow_by_one_per_claim_and_an_exhausted_row_never_reaches_the_consumer() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let t = Batches::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("t", consumer(&t, |_| Act::Fail(HandlerError::new("busy"))))
            .max_attempts(3)
            .retry_delay(Delay::Fixed { ms: 1_000.0 })
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        assert_eq!(delivery(&*ctx, "m", "t").unwrap().0, 1);
        sleep_ms(1_000).await;
        assert_eq!(delivery(&*ctx, "m", "t").unwrap().0, 2);
        sleep_ms(10_000).await;
        assert_eq!(t.deliveries_of("m"), vec![1, 2, 3]);
        // Out of attempts: parked, never handed over a fourth time.
        assert!(delivery(&*ctx, "m", "t").is_none());
        let parked = fanout.parked(None, 10).unwrap();
        assert_eq!(parked.len(), 1);
        assert_eq!(parked[0].attempts, 3);
        // A row found already at its maximum (the process died during its
        // last attempt) is dead-lettered without a delivery.
        accepted(fanout.enqueue(inputs(&["n"]), &EnqueueOptions::all()).await);
        // Its cursor's claim, as the process left it: attempt 3, deadline past.
        ctx.storage()
            .execute_script(
                "UPDATE durability_fanout_cursors SET \
                 next_seq = (SELECT seq FROM durability_fanout_messages WHERE key = 'n'), \
                 claim_end = (SELECT seq FROM durability_fanout_messages WHERE key = 'n') + 1, \
                 claim_attempt = 3, claim_deadline = 0 WHERE target_id = 't'",
            )
            .unwrap();
        sleep_ms(10_000).await;
        assert!(t.deliveries_of("n").len() <= 1);
        assert!(delivery(&*ctx, "n", "t").is_none());
        assert_eq!(fanout.parked(None, 10).unwrap().len(), 2);
    })
    .await;
}

// §3.20 (9), dead-letter phase
#[tokio::test(start_paused = true)]
async fn a_row_in_dead_letter_phase_is_never_handed_to_the_consumer() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let t = Batches::default();
        let writes = Rc::new(Cell::new(0));
        let counted = Rc::clone(&writes);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("t", consumer(&t, |_| Act::DeadLetter))
            .dlq(move |_stored: StoredMessage<String>| {
                counted.set(counted.get() + 1);
                async { Err::<(), _>(HandlerError::new("DLQ unavailable")) }
            })
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        for _ in 0..5 {
            sleep_ms(61_000).await;
        }
        assert_eq!(
            t.deliveries_of("m"),
            vec![1],
            "delivered once, then only the DLQ"
        );
        assert_eq!(writes.get(), 6, "the DLQ write is retried every minute");
        assert_eq!(delivery(&*ctx, "m", "t").unwrap().2, "dead_letter");
    })
    .await;
}

// §3.20 (10)
#[tokio::test(start_paused = true)]
async fn a_claimed_row_is_due_at_claim_time_plus_the_attempt_timeout() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let seen = Rc::new(RefCell::new(Vec::new()));
        let (observed, reader) = (Rc::clone(&seen), h.context());
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    let now = reader.now_ms();
                    let row = delivery(&*reader, &batch[0].id, "t").unwrap();
                    observed.borrow_mut().push((now, row.0, row.1));
                    async { Ok::<_, HandlerError>(()) }
                })
                .ack_on_return(true)
                .policy(MethodPolicy::new().attempt_timeout_ms(45_000)),
            )
            .target(
                "u",
                Target::consumer(|_: Vec<FanoutMessage<String>>| {
                    std::future::pending::<Result<(), HandlerError>>()
                }),
            )
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        let (claimed_at, attempt, due) = seen.borrow()[0];
        assert_eq!(attempt, 1);
        assert_eq!(due, claimed_at + 45_000);
        // The other target's row, claimed by its own policy (default timeout).
        let (attempt, due, _) = delivery(&*ctx, "m", "u").unwrap();
        assert_eq!(attempt, 1);
        assert_eq!(due, START_MS + ATTEMPT_TIMEOUT_MS);
    })
    .await;
}

// §3.20 (11)
#[tokio::test(start_paused = true)]
async fn the_first_settlement_is_binding_and_later_or_late_calls_are_rejected() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let kept: Rc<RefCell<Vec<FanoutMessage<String>>>> = Rc::default();
        let outcomes: Rc<RefCell<Vec<Result<(), SettlementError>>>> = Rc::default();
        let (keep, record) = (Rc::clone(&kept), Rc::clone(&outcomes));
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    let (keep, record) = (Rc::clone(&keep), Rc::clone(&record));
                    async move {
                        let message = &batch[0];
                        let first = message.ack();
                        let second = message.retry();
                        let third = message.dead_letter();
                        let outcome = first.await;
                        record.borrow_mut().push(outcome);
                        let outcome = second.await;
                        record.borrow_mut().push(outcome);
                        let outcome = third.await;
                        record.borrow_mut().push(outcome);
                        keep.borrow_mut().extend(batch);
                        Ok::<_, HandlerError>(())
                    }
                }),
            )
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        let already = SettlementError::AlreadySettled {
            id: "m".into(),
            outcome: SettlementOutcome::Ack,
        };
        assert_eq!(
            *outcomes.borrow(),
            vec![Ok(()), Err(already.clone()), Err(already)]
        );
        // After the consumer returned, the message is closed.
        let late = kept.borrow()[0].ack();
        let late = late.await;
        assert_eq!(
            late,
            Err(SettlementError::AlreadySettled {
                id: "m".into(),
                outcome: SettlementOutcome::Ack
            })
        );
    })
    .await;
}

// §3.20 (11), after return and after the deadline
#[tokio::test(start_paused = true)]
async fn settlement_calls_after_the_consumer_returned_or_timed_out_are_rejected() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let kept: Rc<RefCell<Vec<FanoutMessage<String>>>> = Rc::default();
        let late_outcome: Rc<RefCell<Option<Result<(), SettlementError>>>> = Rc::default();
        let (keep, late) = (Rc::clone(&kept), Rc::clone(&late_outcome));
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "returns",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    keep.borrow_mut().extend(batch);
                    async { Ok::<_, HandlerError>(()) }
                }),
            )
            .target(
                "hangs",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    let late = Rc::clone(&late);
                    async move {
                        // Runs past the deadline, then tries to settle.
                        tokio::time::sleep(Duration::from_millis(2_000)).await;
                        *late.borrow_mut() = Some(batch[0].ack().await);
                        Ok::<_, HandlerError>(())
                    }
                })
                .policy(MethodPolicy::new().attempt_timeout_ms(1_000)),
            )
            .retry_delay(Delay::Fixed { ms: 60_000.0 })
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        // The pass chose to retry the message left unsettled.
        let retried = SettlementError::AlreadySettled {
            id: "m".into(),
            outcome: SettlementOutcome::Retry,
        };
        let after_return = kept.borrow()[0].ack();
        assert_eq!(after_return.await, Err(retried.clone()));
        // Unsettled after return: retried with the reference's error.
        assert_eq!(delivery(&*ctx, "m", "returns").unwrap().0, 1);
        let last_error: String = ctx
            .storage()
            .query_row(
                "SELECT last_error FROM durability_fanout_deliveries WHERE target_id = 'returns'",
                &[],
            )
            .unwrap()
            .unwrap()
            .get(0)
            .unwrap();
        assert_eq!(last_error, "Consumer returned without settling the message");
        sleep_ms(2_500).await;
        // Likewise for the timed-out one, whose consumer is still running.
        assert_eq!(*late_outcome.borrow(), Some(Err(retried)));
        let (name, message): (String, String) = ctx
            .storage()
            .query_row(
                "SELECT last_error_name, last_error FROM durability_fanout_deliveries \
                 WHERE target_id = 'hangs'",
                &[],
            )
            .unwrap()
            .map(|row| (row.get(0).unwrap(), row.get(1).unwrap()))
            .unwrap();
        assert_eq!(name, "FanoutTimeoutError");
        assert_eq!(message, "Fanout delivery timed out after 1000ms");
    })
    .await;
}

// §3.20 (12)
#[tokio::test(start_paused = true)]
async fn a_settlement_by_a_stale_attempt_changes_nothing() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let kept: Rc<RefCell<Vec<FanoutMessage<String>>>> = Rc::default();
        let keep = Rc::clone(&kept);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    let first_attempt = batch[0].attempt == 1;
                    keep.borrow_mut().extend(batch);
                    async move {
                        if first_attempt {
                            // Runs past its deadline: the row is retried.
                            tokio::time::sleep(Duration::from_secs(10)).await;
                        } else {
                            std::future::pending::<()>().await;
                        }
                        Ok::<_, HandlerError>(())
                    }
                })
                .policy(MethodPolicy::new().attempt_timeout_ms(1_000)),
            )
            .retry_delay(Delay::Fixed { ms: 0.0 })
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        sleep_ms(1_500).await;
        assert_eq!(kept.borrow().len(), 2, "the second attempt runs");
        let before = snapshot(&*ctx);
        let stale = {
            let kept = kept.borrow();
            assert_eq!(kept[0].attempt, 1);
            [kept[0].ack(), kept[0].retry(), kept[0].dead_letter()]
        };
        for settlement in stale {
            assert!(settlement.await.is_err());
        }
        assert_eq!(snapshot(&*ctx), before, "the stale attempt changed nothing");
        // A settlement of the live attempt still works.
        let live = {
            let kept = kept.borrow();
            assert_eq!(kept[1].attempt, 2);
            kept[1].ack()
        };
        live.await.unwrap();
        assert!(delivery(&*ctx, "m", "t").is_none());
    })
    .await;
}

// §3.20 (13)
#[tokio::test(start_paused = true)]
async fn dead_letter_intent_commits_before_the_dlq_write_which_alone_is_retried() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let t = Batches::default();
        let attempts = Rc::new(RefCell::new(Vec::new()));
        let (seen, reader) = (Rc::clone(&attempts), h.context());
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                consumer(&t, |_| Act::Fail(HandlerError::new("poison"))),
            )
            .max_attempts(1)
            .dlq(move |stored: StoredMessage<String>| {
                // The intent is already durable when the write starts.
                let phase = delivery(&*reader, "m", "t").map(|row| row.2);
                seen.borrow_mut().push((reader.now_ms(), phase, stored));
                let failing = seen.borrow().len() < 3;
                async move {
                    if failing {
                        Err(HandlerError::new("DLQ down"))
                    } else {
                        Ok(())
                    }
                }
            })
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        sleep_ms(61_000).await;
        sleep_ms(61_000).await;
        let attempts = attempts.borrow();
        assert_eq!(attempts.len(), 3);
        for (_, phase, stored) in attempts.iter() {
            assert_eq!(phase.as_deref(), Some("dead_letter"));
            // Byte-identical every time: same id, timestamp, reason, error.
            assert_eq!(stored, &attempts[0].2);
        }
        assert!(attempts[1].0 - attempts[0].0 >= INFRASTRUCTURE_RETRY_MS);
        let failure = attempts[0].2.failure.clone().unwrap();
        assert_eq!(failure.reason, DeadLetterReason::Exhausted);
        assert_eq!(failure.error, Some(SerializedError::new("Error", "poison")));
        assert_eq!(
            t.deliveries_of("m"),
            vec![1],
            "never redelivered to the consumer"
        );
        assert!(
            delivery(&*ctx, "m", "t").is_none(),
            "removed after the write"
        );
    })
    .await;
}

// §3.20 (14), with the departure of issue 4
#[tokio::test(start_paused = true)]
async fn without_a_dlq_a_terminal_delivery_is_parked_not_dropped_and_terminal_is_emitted() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let events = Events::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("t", consumer(&Batches::default(), |_| Act::DeadLetter))
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        assert_eq!(deliveries(&*ctx), 0);
        assert_eq!(manifests(&*ctx), 0);
        let parked = fanout.parked(None, 10).unwrap();
        assert_eq!(parked.len(), 1);
        let entry = &parked[0];
        assert_eq!(entry.message_id, "m");
        assert_eq!(entry.target, "t");
        assert_eq!(entry.body, "body of m");
        assert_eq!(entry.attempts, 1);
        let failure = entry.failure.clone().unwrap();
        assert_eq!(failure.reason, DeadLetterReason::Explicit);
        assert_eq!(
            failure.error, None,
            "a first-attempt explicit dead letter has no error"
        );
        assert_eq!(
            events.trace("m"),
            vec!["registered", "attempt_started 1", "terminal 1"]
        );
        let terminal = events
            .all()
            .into_iter()
            .find_map(|event| match event {
                LifecycleEvent::Terminal { reason, error, .. } => Some((reason, error)),
                _ => None,
            })
            .unwrap();
        assert_eq!(terminal.0, TerminalReason::DeadLettered);
        assert_eq!(
            terminal.1,
            SerializedError::new("DeadLetter", "Dead-lettered by consumer")
        );
        // Parked work keeps no alarm armed.
        assert_eq!(physical_alarm(&*ctx).await, None);
    })
    .await;
}

// §3.20 (15)
#[tokio::test(start_paused = true)]
async fn a_storage_target_is_acked_only_after_its_write_and_a_failed_write_is_retried_alone() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let written = Rc::new(RefCell::new(Vec::new()));
        let failures = Rc::new(Cell::new(0));
        let (log, fails, reader) = (Rc::clone(&written), Rc::clone(&failures), h.context());
        let other = Batches::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "archive",
                Target::storage(move |stored: StoredMessage<String>| {
                    // The row is still owed while its write runs.
                    let owed = delivery(&*reader, &stored.message_id, "archive").is_some();
                    let fail = stored.message_id == "m1" && fails.get() < 2;
                    if fail {
                        fails.set(fails.get() + 1);
                    } else {
                        log.borrow_mut()
                            .push((stored.message_id.clone(), stored.attempts, owed));
                    }
                    async move {
                        if fail {
                            Err(HandlerError::new("bucket unavailable"))
                        } else {
                            Ok(())
                        }
                    }
                }),
            )
            .target("other", acking(&other))
            .retry_delay(Delay::Fixed { ms: 1_000.0 })
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(inputs(&["m0", "m1", "m2"]), &EnqueueOptions::all())
                .await,
        );
        settle().await;
        // m0 and m2 written and acked in the first batch; m1 failed alone.
        assert_eq!(
            *written.borrow(),
            vec![("m0".into(), 1, true), ("m2".into(), 1, true)]
        );
        assert!(delivery(&*ctx, "m0", "archive").is_none());
        assert_eq!(delivery(&*ctx, "m1", "archive").unwrap().0, 1);
        assert_eq!(other.count(), 3, "the other target is unaffected");
        sleep_ms(5_000).await;
        assert_eq!(
            written.borrow().last().cloned(),
            Some(("m1".into(), 3, true))
        );
        assert_eq!(deliveries(&*ctx), 0);
    })
    .await;
}

// §3.20 (16)
#[tokio::test(start_paused = true)]
async fn pending_deliveries_equals_the_row_count_and_is_recounted_after_a_failed_transaction() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("a", acking(&Batches::default()))
            .target(
                "b",
                consumer(&Batches::default(), |m| {
                    if m.attempt == 1 {
                        Act::RetryAfter(100)
                    } else {
                        Act::DeadLetter
                    }
                }),
            )
            .target("c", consumer(&Batches::default(), |_| Act::Leave))
            .retry_delay(Delay::Fixed { ms: 50.0 })
            .build()
            .unwrap();
        let check = |fanout: &Fanout<String>| {
            assert_eq!(
                fanout.load().unwrap().outbound.pending_deliveries,
                u64::try_from(deliveries(&*ctx)).unwrap()
            );
        };
        check(&fanout);
        accepted(
            fanout
                .enqueue(inputs(&["m0", "m1"]), &EnqueueOptions::all())
                .await,
        );
        check(&fanout);
        for _ in 0..10 {
            settle().await;
            check(&fanout);
            sleep_ms(30).await;
            check(&fanout);
        }
        // A transaction that fails (here an ack refused by the storage)
        // drops the cached count; the next read counts again.
        ctx.storage()
            .execute_script(
                "CREATE TRIGGER refuse BEFORE INSERT ON durability_fanout_exceptions \
                 WHEN NEW.status = 'settled' BEGIN SELECT RAISE(ABORT, 'disk says no'); END;",
            )
            .unwrap();
        accepted(
            fanout
                .enqueue(inputs(&["m2"]), &EnqueueOptions::to(["a"]))
                .await,
        );
        settle().await;
        check(&fanout);
        ctx.storage()
            .execute_script("DROP TRIGGER refuse;")
            .unwrap();
        sleep_ms(600_000).await;
        check(&fanout);
    })
    .await;
}

// §3.20 (17)
#[tokio::test(start_paused = true)]
async fn rows_of_a_removed_target_are_kept_and_pushed_a_minute_out_each_time_they_come_due() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let first = Scheduler::new(h.context()).unwrap();
        h.install(&first);
        let old = Fanout::<String>::builder(&first)
            .target("a", acking(&Batches::default()))
            .target(
                "b",
                consumer(&Batches::default(), |_| {
                    Act::Fail(HandlerError::new("down"))
                }),
            )
            .retry_delay(Delay::Fixed { ms: 1_000.0 })
            .build()
            .unwrap();
        accepted(old.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        let (attempt, _, _) = delivery(&*ctx, "m", "b").unwrap();
        assert_eq!(attempt, 1);
        drop(old);
        // A new configuration without "b".
        let second = scheduler(&h);
        let a = Batches::default();
        let fanout = Fanout::<String>::builder(&second)
            .target("a", acking(&a))
            .build()
            .unwrap();
        sleep_ms(1_000).await;
        let now = second.now_ms();
        second.alarm(None).await.unwrap();
        let (attempt, due, phase) = delivery(&*ctx, "m", "b").unwrap();
        assert_eq!((attempt, phase.as_str()), (1, "delivery"), "kept as it was");
        assert_eq!(due, now + INFRASTRUCTURE_RETRY_MS);
        assert_eq!(
            manifests(&*ctx),
            1,
            "its manifest stays, so the key stays taken"
        );
        sleep_ms(60_000).await;
        settle().await;
        let (_, due_again, _) = delivery(&*ctx, "m", "b").unwrap();
        assert_eq!(due_again, due + INFRASTRUCTURE_RETRY_MS);
        assert_eq!(fanout.load().unwrap().outbound.pending_deliveries, 1);
        // Configured again: delivered.
        drop(fanout);
        let third = scheduler(&h);
        let b = Batches::default();
        let _back = Fanout::<String>::builder(&third)
            .target("a", acking(&a))
            .target("b", acking(&b))
            .build()
            .unwrap();
        sleep_ms(61_000).await;
        assert_eq!(b.deliveries_of("m"), vec![2]);
        assert_eq!(deliveries(&*ctx), 0);
    })
    .await;
}

// §3.20 (18)
#[tokio::test(start_paused = true)]
async fn with_a_batch_delay_first_attempts_are_due_at_the_next_multiple_of_it() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let t = Batches::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("t", acking(&t))
            .batch_delay(Duration::from_millis(700))
            .build()
            .unwrap();
        // START_MS (1_000_000) is not a multiple of 700.
        accepted(
            fanout
                .enqueue(inputs(&["m0"]), &EnqueueOptions::all())
                .await,
        );
        sleep_ms(150).await;
        accepted(
            fanout
                .enqueue(inputs(&["m1"]), &EnqueueOptions::all())
                .await,
        );
        let boundary = 1_000_300; // the smallest multiple of 700 >= 1_000_000
        assert_eq!(delivery(&*ctx, "m0", "t").unwrap().1, boundary);
        assert_eq!(delivery(&*ctx, "m1", "t").unwrap().1, boundary);
        assert!(t.all().is_empty(), "nothing before the window closes");
        sleep_ms(200).await;
        assert_eq!(t.ids(), vec![vec!["m0", "m1"]], "one batch at the boundary");
        // Exactly on a multiple: due at once.
        let now = scheduler.now_ms();
        let on_multiple = (now / 700 + 1) * 700;
        sleep_ms(u64::try_from(on_multiple - now).unwrap()).await;
        accepted(
            fanout
                .enqueue(inputs(&["m2"]), &EnqueueOptions::all())
                .await,
        );
        let created: i64 = count(
            &*ctx,
            "SELECT created_at FROM durability_fanout_messages WHERE key = 'm2'",
        );
        assert_eq!(created % 700, 0);
        assert_eq!(delivery(&*ctx, "m2", "t").unwrap().1, created);
    })
    .await;
}

// ---------------------------------------------------------------------------
// Parked dead letters (issue 4's departure)

#[tokio::test(start_paused = true)]
async fn parked_deliveries_are_listed_redriven_as_new_work_and_purged() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let t = Batches::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                consumer(&t, |m| {
                    if m.body.contains("poison") {
                        Act::Fail(HandlerError::new("poison"))
                    } else {
                        Act::Ack
                    }
                }),
            )
            .target("u", acking(&Batches::default()))
            .max_attempts(2)
            .retry_delay(Delay::Fixed { ms: 0.0 })
            .build()
            .unwrap();
        let batch: Vec<FanoutInput<String>> = (0..5)
            .map(|i| FanoutInput::new(format!("poison {i}")).id(format!("p{i}")))
            .collect();
        accepted(fanout.enqueue(batch, &EnqueueOptions::all()).await);
        sleep_ms(100).await;
        assert_eq!(deliveries(&*ctx), 0);
        // Paged, oldest first.
        let page = fanout.parked(None, 3).unwrap();
        assert_eq!(page.len(), 3);
        let rest = fanout.parked(page.last(), 3).unwrap();
        assert_eq!(rest.len(), 2);
        let mut all: Vec<_> = page
            .iter()
            .chain(&rest)
            .map(|e| e.message_id.clone())
            .collect();
        all.sort();
        assert_eq!(all, vec!["p0", "p1", "p2", "p3", "p4"]);
        assert!(
            page.iter()
                .chain(&rest)
                .all(|e| e.target == "t" && e.attempts == 2)
        );
        let failure = page[0].failure.clone().unwrap();
        assert_eq!(failure.reason, DeadLetterReason::Exhausted);
        assert_eq!(failure.error, Some(SerializedError::new("Error", "poison")));
        // A redrive registers new work for the one target and removes the
        // entry in the same transaction; the message id is kept.
        let ids = accepted(fanout.redrive_parked(&[page[0].id.as_str()]).await);
        assert_eq!(ids, vec![page[0].message_id.clone()]);
        assert_eq!(
            count(&*ctx, "SELECT COUNT(*) FROM durability_fanout_parked"),
            4
        );
        let key: String = ctx
            .storage()
            .query_row("SELECT key FROM durability_fanout_messages", &[])
            .unwrap()
            .unwrap()
            .get(0)
            .unwrap();
        assert_eq!(key, page[0].id, "keyed by the parked delivery identity");
        sleep_ms(100).await;
        // Poisoned again: parked again, under a new identity.
        assert_eq!(
            count(&*ctx, "SELECT COUNT(*) FROM durability_fanout_parked"),
            5
        );
        let redriven = &page[0].message_id;
        assert_eq!(t.deliveries_of(redriven), vec![1, 2, 1, 2]);
        // An unknown id rejects the whole redrive.
        let error = rejected(fanout.redrive_parked(&[rest[0].id.as_str(), "nope"]).await);
        assert_eq!(error, EnqueueRejection::UnknownParked { id: "nope".into() });
        assert_eq!(
            count(&*ctx, "SELECT COUNT(*) FROM durability_fanout_parked"),
            5
        );
        // Purge by id and by time.
        assert_eq!(
            fanout.purge_parked(&[rest[0].id.as_str(), "nope"]).unwrap(),
            1
        );
        let later = scheduler.now_ms() + 1;
        assert_eq!(fanout.purge_parked_before(later).unwrap(), 4);
        assert!(fanout.parked(None, 10).unwrap().is_empty());
        assert!(fanout.purge_parked_before(-1).is_err());
        assert_eq!(physical_alarm(&*ctx).await, None);
    })
    .await;
}

// ---------------------------------------------------------------------------
// Settlement details

#[tokio::test(start_paused = true)]
async fn ack_on_return_acks_the_unsettled_in_one_go_and_explicit_settlements_win() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let t = Batches::default();
        let events = Events::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                consumer(&t, |m| match m.id.as_str() {
                    "retry" if m.attempt == 1 => Act::RetryAfter(10),
                    "dead" => Act::DeadLetter,
                    _ => Act::Leave,
                })
                .ack_on_return(true),
            )
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(inputs(&["a", "retry", "dead", "b"]), &EnqueueOptions::all())
                .await,
        );
        settle().await;
        assert!(delivery(&*ctx, "a", "t").is_none());
        assert!(delivery(&*ctx, "b", "t").is_none());
        assert_eq!(delivery(&*ctx, "retry", "t").unwrap().0, 1, "its retry won");
        assert_eq!(
            fanout.parked(None, 10).unwrap().len(),
            1,
            "its dead letter won"
        );
        assert_eq!(
            events.trace("a"),
            vec![
                "registered",
                "attempt_started 1",
                "attempt_settled:completed 1"
            ]
        );
        sleep_ms(20).await;
        assert_eq!(t.deliveries_of("retry"), vec![1, 2]);
        assert_eq!(deliveries(&*ctx), 0, "acked on return the second time");
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_call_retries_its_unsettled_messages_with_the_error_and_keeps_its_acks() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let t = Batches::default();
        let events = Events::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                consumer(&t, |m| match m.id.as_str() {
                    "acked" => Act::Ack,
                    _ => Act::Fail(HandlerError::named("Upstream", "503")),
                })
                .ack_on_return(true),
            )
            .retry_delay(Delay::Fixed { ms: 1_000.0 })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(inputs(&["acked", "left"]), &EnqueueOptions::all())
                .await,
        );
        settle().await;
        assert!(
            delivery(&*ctx, "acked", "t").is_none(),
            "an ack started before the error stands"
        );
        let (attempt, due, _) = delivery(&*ctx, "left", "t").unwrap();
        assert_eq!(attempt, 1);
        assert_eq!(due, START_MS + 1_000);
        let settled = events
            .all()
            .into_iter()
            .find_map(|event| match event {
                LifecycleEvent::AttemptSettled {
                    outcome:
                        Outcome::RetryScheduled {
                            error,
                            next_attempt_at,
                        },
                    ..
                } => Some((error, next_attempt_at)),
                _ => None,
            })
            .unwrap();
        assert_eq!(
            settled,
            (SerializedError::new("Upstream", "503"), START_MS + 1_000)
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_non_retryable_consumer_error_dead_letters_at_once() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let t = Batches::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                consumer(&t, |_| Act::Fail(HandlerError::non_retryable("malformed"))),
            )
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        assert_eq!(t.deliveries_of("m"), vec![1]);
        let parked = fanout.parked(None, 10).unwrap();
        let failure = parked[0].failure.clone().unwrap();
        assert_eq!(failure.reason, DeadLetterReason::Exhausted);
        assert_eq!(
            failure.error,
            Some(SerializedError::new("NonRetryableError", "malformed"))
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_retry_policy_that_gives_up_dead_letters_with_its_error() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("t", consumer(&Batches::default(), |_| Act::Retry))
            .retry_delay(Delay::custom(|_, _| Ok(f64::NAN)))
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        let parked = fanout.parked(None, 10).unwrap();
        assert_eq!(
            parked[0].failure.clone().unwrap().error,
            Some(SerializedError::new(
                "DurableRetryPolicyError",
                "Retry policy for fanout must produce a non-negative safe-integer timestamp"
            ))
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_explicit_dead_letter_carries_the_previous_failure() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let store = Store::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                consumer(&Batches::default(), |m| {
                    if m.attempt == 1 {
                        Act::Fail(HandlerError::named("Timeout", "slow"))
                    } else {
                        Act::DeadLetter
                    }
                }),
            )
            .retry_delay(Delay::Fixed { ms: 0.0 })
            .dlq(store.writer())
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        sleep_ms(10).await;
        let written = store.all();
        assert_eq!(written.len(), 1);
        let entry = &written[0];
        assert_eq!(entry.attempts, 2);
        assert_eq!(entry.message_id, "m");
        let failure = entry.failure.clone().unwrap();
        assert_eq!(failure.reason, DeadLetterReason::Explicit);
        assert_eq!(failure.error, Some(SerializedError::new("Timeout", "slow")));
        assert!(
            fanout.parked(None, 10).unwrap().is_empty(),
            "with a DLQ nothing is parked"
        );
    })
    .await;
}

// §3.17: redrive from a DLQ, with the entry id as the deduplication key.
#[tokio::test(start_paused = true)]
async fn a_redrive_from_the_dlq_keyed_by_the_entry_id_is_new_work_for_one_target() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let store = Store::default();
        let healed = Rc::new(Cell::new(false));
        let is_healed = Rc::clone(&healed);
        let (a, b) = (Batches::default(), Batches::default());
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("a", acking(&a))
            .target(
                "b",
                consumer(&b, move |_| {
                    if is_healed.get() {
                        Act::Ack
                    } else {
                        Act::DeadLetter
                    }
                }),
            )
            .dlq(store.writer())
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        let entry = store.all().remove(0);
        healed.set(true);
        let redrive = FanoutInput::new(entry.body.clone())
            .id(entry.message_id.clone())
            .deduplication_key(entry.id.clone());
        let ids = accepted(
            fanout
                .enqueue(
                    vec![redrive.clone()],
                    &EnqueueOptions::to([entry.target.clone()]),
                )
                .await,
        );
        assert_eq!(ids, vec!["m"]);
        settle().await;
        assert_eq!(b.deliveries_of("m"), vec![1, 1], "a fresh attempt budget");
        assert_eq!(a.deliveries_of("m"), vec![1], "only the failed target");
        assert_eq!(deliveries(&*ctx), 0);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn memos_survive_a_retry_and_go_with_the_settled_delivery() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let side_effects = Rc::new(Cell::new(0));
        let effects = Rc::clone(&side_effects);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    let effects = Rc::clone(&effects);
                    async move {
                        for m in &batch {
                            let receipt: u32 = m
                                .memo
                                .memoize("charge", async {
                                    effects.set(effects.get() + 1);
                                    Ok::<_, HandlerError>(effects.get())
                                })
                                .await?;
                            assert_eq!(receipt, 1);
                            if m.attempt == 1 {
                                return Err(HandlerError::new("later step failed"));
                            }
                            m.ack()
                                .await
                                .map_err(|e| HandlerError::new(e.to_string()))?;
                        }
                        Ok(())
                    }
                }),
            )
            .retry_delay(Delay::Fixed { ms: 1_000.0 })
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        assert_eq!(count(&*ctx, "SELECT COUNT(*) FROM durability_memos"), 1);
        sleep_ms(1_000).await;
        assert_eq!(side_effects.get(), 1, "the retry reused the memo");
        assert_eq!(deliveries(&*ctx), 0);
        assert_eq!(
            count(&*ctx, "SELECT COUNT(*) FROM durability_memos"),
            0,
            "deleted with the delivery"
        );
    })
    .await;
}

// ---------------------------------------------------------------------------
// Lifecycle events (§3.15)

#[tokio::test(start_paused = true)]
async fn lifecycle_events_follow_each_delivery_and_hooks_cannot_change_anything() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let events = Events::default();
        let extra = Events::default();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                consumer(&Batches::default(), |m| {
                    if m.attempt == 1 { Act::Retry } else { Act::Ack }
                }),
            )
            .retry_delay(Delay::Fixed { ms: 5.0 })
            .max_attempts(2)
            .on_lifecycle_event(events.hook())
            .on_lifecycle_event(Rc::new(|_: &LifecycleEvent| {
                Some(Box::pin(async { Err(HandlerError::new("hook down")) })
                    as durability::platform::LocalBoxFuture<
                        'static,
                        Result<(), HandlerError>,
                    >)
            }))
            .build()
            .unwrap();
        let registration = fanout.lifecycle(extra.hook());
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        sleep_ms(20).await;
        assert_eq!(
            events.trace("m"),
            vec![
                "registered",
                "attempt_started 1",
                "attempt_settled:retry_scheduled 1",
                "attempt_started 2",
                "attempt_settled:completed 2",
            ]
        );
        assert_eq!(extra.trace("m"), events.trace("m"));
        let json = serde_json::to_value(&events.all()[0]).unwrap();
        assert_eq!(json["entityKind"], "fanout_delivery");
        assert_eq!(json["target"], "t");
        assert_eq!(json["attempt"], 0);
        assert_eq!(deliveries(&*ctx), 0, "a failing hook changed nothing");
        registration.detach();
        accepted(fanout.enqueue(inputs(&["n"]), &EnqueueOptions::all()).await);
        sleep_ms(20).await;
        assert!(extra.trace("n").is_empty(), "a detached hook hears nothing");
        assert!(!events.trace("n").is_empty());
    })
    .await;
}

// ---------------------------------------------------------------------------
// Load (§2) as fanout counts it

#[tokio::test(start_paused = true)]
async fn fanout_counts_one_inbound_per_enqueue_and_one_outbound_per_target_batch() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("a", acking(&Batches::default()))
            .target("b", acking(&Batches::default()))
            .max_batch_size(2)
            .build()
            .unwrap();
        let load = fanout.load().unwrap();
        assert_eq!(load.inbound.completed, 0);
        assert_eq!(load.inbound.average_processing_ms, None);
        let result = fanout
            .enqueue(inputs(&["m0", "m1", "m2"]), &EnqueueOptions::all())
            .await
            .unwrap();
        // The returned load already counts this call as completed.
        assert_eq!(result.load().inbound.completed, 1);
        assert_eq!(result.load().inbound.in_flight, 0);
        assert_eq!(result.load().outbound.pending_deliveries, 6);
        rejected(
            fanout
                .enqueue(inputs(&["x"]), &EnqueueOptions::to(["zz"]))
                .await,
        );
        sleep_ms(10).await;
        let load = fanout.load().unwrap();
        assert_eq!(load.inbound.completed, 2, "accepted and rejected alike");
        // Two targets, three messages, batches of two: four batches.
        assert_eq!(load.outbound.completed, 4);
        assert_eq!(load.outbound.pending_deliveries, 0);
        assert_eq!(load.window_ms, 60_000);
    })
    .await;
}

// ---------------------------------------------------------------------------
// Restart

#[tokio::test(start_paused = true)]
async fn delivery_resumes_from_the_alarm_after_eviction() {
    // Calls cross to the object's executor, so the record is a static.
    static DELIVERED: std::sync::Mutex<Vec<(String, u32)>> = std::sync::Mutex::new(Vec::new());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    tokio::task::LocalSet::new()
        .run_until(async move {
            let (host, objects) = support::open_harness_host(&path);
            let stub = objects.stub("mail").unwrap();
            stub.call(|h: Rc<Harness>| async move {
                let scheduler = scheduler(&h);
                let fanout = Fanout::<String>::builder(&scheduler)
                    .target(
                        "t",
                        Target::consumer(|_: Vec<FanoutMessage<String>>| {
                            std::future::pending::<Result<(), HandlerError>>()
                        })
                        .policy(MethodPolicy::new().attempt_timeout_ms(20_000)),
                    )
                    .build()
                    .unwrap();
                accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
                settle().await;
                h.keep(fanout);
            })
            .await
            .unwrap();
            // The process "dies" mid-batch.
            host.evict(stub.id()).await.unwrap();
            stub.call(move |h: Rc<Harness>| async move {
                let scheduler = scheduler(&h);
                let fanout = Fanout::<String>::builder(&scheduler)
                    .target(
                        "t",
                        Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                            let mut delivered = DELIVERED.lock().unwrap();
                            delivered.extend(batch.iter().map(|m| (m.id.clone(), m.attempt)));
                            async { Ok::<_, HandlerError>(()) }
                        })
                        .ack_on_return(true),
                    )
                    .build()
                    .unwrap();
                h.keep(fanout);
            })
            .await
            .unwrap();
            tokio::time::sleep(Duration::from_secs(30)).await;
            host.shutdown().await;
        })
        .await;
    // Not by a call: the claim deadline came, and the alarm delivered it.
    assert_eq!(*DELIVERED.lock().unwrap(), vec![("m".to_owned(), 2)]);
}

// ---------------------------------------------------------------------------
// Bad input

#[tokio::test(start_paused = true)]
async fn bad_targets_are_rejected_with_nothing_written() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("a", acking(&Batches::default()))
            .target("b", acking(&Batches::default()))
            .build()
            .unwrap();
        let before = snapshot(&*ctx);
        let cases = [
            (
                EnqueueOptions::to(Vec::<String>::new()),
                EnqueueRejection::NoTargets,
            ),
            (
                EnqueueOptions::to(["a", "c"]),
                EnqueueRejection::UnknownTarget { target: "c".into() },
            ),
            (
                EnqueueOptions::to(["b", "a", "b"]),
                EnqueueRejection::DuplicateTarget { target: "b".into() },
            ),
            (
                EnqueueOptions::to([""]),
                EnqueueRejection::UnknownTarget {
                    target: String::new(),
                },
            ),
        ];
        for (options, expected) in cases {
            let error = rejected(fanout.enqueue(inputs(&["m"]), &options).await);
            assert_eq!(error, expected);
            assert_eq!(error.serialize().name, "FanoutEnqueueError");
            assert!(
                error
                    .to_string()
                    .starts_with("Enqueue targets must be distinct configured target IDs"),
            );
        }
        assert_eq!(snapshot(&*ctx), before);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn empty_ids_and_keys_are_rejected_with_nothing_written() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("a", acking(&Batches::default()))
            .build()
            .unwrap();
        let before = snapshot(&*ctx);
        let empty_id = vec![input("ok"), FanoutInput::new("x".to_owned()).id("")];
        assert_eq!(
            rejected(fanout.enqueue(empty_id, &EnqueueOptions::all()).await),
            EnqueueRejection::EmptyId {
                index: 1,
                field: "id"
            }
        );
        let empty_key = vec![FanoutInput::new("x".to_owned()).deduplication_key("")];
        let error = rejected(fanout.enqueue(empty_key, &EnqueueOptions::all()).await);
        assert_eq!(
            error,
            EnqueueRejection::EmptyId {
                index: 0,
                field: "deduplication key"
            }
        );
        assert!(
            error
                .to_string()
                .starts_with("Message IDs and deduplication keys must be non-empty strings")
        );
        assert_eq!(snapshot(&*ctx), before);
        // An empty batch is accepted and writes nothing.
        let ids = accepted(fanout.enqueue(Vec::new(), &EnqueueOptions::all()).await);
        assert!(ids.is_empty());
        assert_eq!(snapshot(&*ctx), before);
        // Ids of any text are fine, and a missing id is generated.
        let odd = FanoutInput::new("x".to_owned()).id("ü/\"\n\u{0}");
        let generated = FanoutInput::new("y".to_owned());
        let ids = accepted(
            fanout
                .enqueue(vec![odd, generated], &EnqueueOptions::all())
                .await,
        );
        assert_eq!(ids[0], "ü/\"\n\u{0}");
        assert_eq!(ids[1].len(), 36, "a UUID");
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn bodies_that_are_too_large_or_not_json_are_rejected_with_nothing_written() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<serde_json::Value>::builder(&scheduler)
            .target(
                "a",
                Target::consumer(|_: Vec<FanoutMessage<serde_json::Value>>| async {
                    Ok::<_, HandlerError>(())
                }),
            )
            .build()
            .unwrap();
        let before = snapshot(&*ctx);
        let ten_mb = serde_json::Value::String("x".repeat(10 * 1024 * 1024));
        let batch = vec![
            FanoutInput::new(serde_json::json!("small")).id("s"),
            FanoutInput::new(ten_mb.clone()).id("big"),
        ];
        match rejected(fanout.enqueue(batch, &EnqueueOptions::all()).await) {
            EnqueueRejection::BodyTooLarge {
                index,
                bytes,
                max_bytes,
            } => {
                assert_eq!(index, 1);
                assert!(bytes > 10 * 1024 * 1024);
                assert_eq!(max_bytes, 1 << 20);
            }
            other => panic!("{other:?}"),
        }
        let nan = vec![FanoutInput::new(serde_json::json!({"n": 1})).id("n")];
        accepted(fanout.enqueue(nan, &EnqueueOptions::all()).await);
        assert_ne!(snapshot(&*ctx), before);
        drop(fanout);
        // Configurable, and a non-finite float is not JSON.
        let second = Scheduler::new(h.context()).unwrap();
        let small = Fanout::<f64>::builder(&second)
            .target(
                "a",
                Target::consumer(|_: Vec<FanoutMessage<f64>>| async { Ok::<_, HandlerError>(()) }),
            )
            // Counted on the body's own JSON: 12345.678 is 9 bytes.
            .max_body_bytes(8)
            .batch_delay(Duration::from_secs(3_600))
            .build()
            .unwrap();
        let before = snapshot(&*ctx);
        assert!(matches!(
            rejected(
                small
                    .enqueue(vec![FanoutInput::new(f64::NAN)], &EnqueueOptions::all())
                    .await
            ),
            EnqueueRejection::BodyNotJson { index: 0, .. }
        ));
        assert!(matches!(
            rejected(
                small
                    .enqueue(vec![FanoutInput::new(12_345.678)], &EnqueueOptions::all())
                    .await
            ),
            EnqueueRejection::BodyTooLarge {
                bytes: 9,
                max_bytes: 8,
                ..
            }
        ));
        assert_eq!(snapshot(&*ctx), before);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_retry_delay_that_overflows_the_clock_is_rejected_and_leaves_the_message_unsettled() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let results: Rc<RefCell<Vec<Result<(), SettlementError>>>> = Rc::default();
        let record = Rc::clone(&results);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    let record = Rc::clone(&record);
                    async move {
                        let m = &batch[0];
                        let huge = Duration::from_millis(u64::try_from(MAX_SAFE_INTEGER).unwrap());
                        let outcome = m.retry_after(huge).await;
                        record.borrow_mut().push(outcome);
                        let outcome = m.retry_after(Duration::MAX).await;
                        record.borrow_mut().push(outcome);
                        // Still unsettled: a valid settlement is accepted.
                        let outcome = m.ack().await;
                        record.borrow_mut().push(outcome);
                        Ok::<_, HandlerError>(())
                    }
                }),
            )
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        let results = results.borrow();
        assert!(matches!(
            results[0],
            Err(SettlementError::InvalidRetryDelay { delay_ms, now_ms })
                if delay_ms == u128::try_from(MAX_SAFE_INTEGER).unwrap() && now_ms == START_MS
        ));
        assert!(matches!(
            results[1],
            Err(SettlementError::InvalidRetryDelay { .. })
        ));
        assert_eq!(results[2], Ok(()));
        assert_eq!(deliveries(&*ctx), 0);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn invalid_configuration_is_a_typed_error_naming_the_rule() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let build = |f: &dyn Fn(
            durability::FanoutBuilder<String>,
        ) -> durability::FanoutBuilder<String>| {
            f(Fanout::<String>::builder(&scheduler)).build().map(|_| ())
        };
        let target = || acking(&Batches::default());
        assert!(matches!(build(&|b| b), Err(FanoutConfigError::NoTargets)));
        assert!(matches!(
            build(&|b| b.target("", target())),
            Err(FanoutConfigError::InvalidTarget { id, .. }) if id.is_empty()
        ));
        assert!(matches!(
            build(&|b| b.target("a", target()).target("a", target())),
            Err(FanoutConfigError::InvalidTarget { id, rule: "the id is configured twice" }) if id == "a"
        ));
        let storage_acking = || {
            Target::storage(|_: StoredMessage<String>| async { Ok::<_, HandlerError>(()) })
                .ack_on_return(true)
        };
        assert!(matches!(
            build(&|b| b.target("s", storage_acking())),
            Err(FanoutConfigError::InvalidTarget { .. })
        ));
        assert!(matches!(
            build(&|b| b.target("a", target()).max_batch_size(0)),
            Err(FanoutConfigError::Config(ConfigError::NotPositive { field })) if field == "max_batch_size"
        ));
        assert!(matches!(
            build(&|b| b.target("a", target()).max_body_bytes(0)),
            Err(FanoutConfigError::Config(ConfigError::NotPositive { field })) if field == "max_body_bytes"
        ));
        assert!(matches!(
            build(&|b| b.target("a", target()).batch_delay(Duration::from_millis(u64::MAX))),
            Err(FanoutConfigError::Config(ConfigError::OutOfRange { field, .. })) if field == "batch_delay"
        ));
        assert!(matches!(
            build(&|b| b.target("a", target()).batch_delay(Duration::MAX)),
            Err(FanoutConfigError::Config(ConfigError::NotWholeMilliseconds { field, .. })) if field == "batch_delay"
        ));
        assert!(matches!(
            build(&|b| b.target("a", target().policy(MethodPolicy::new().max_attempts(0)))),
            Err(FanoutConfigError::Config(ConfigError::NotPositive { field })) if field == "method(\"a\").max_attempts"
        ));
        assert!(matches!(
            build(&|b| b.target("a", target()).attempt_timeout(Duration::ZERO)),
            Err(FanoutConfigError::Config(ConfigError::NotPositive { .. }))
        ));
        // One fanout per scheduler.
        let _first = Fanout::<String>::builder(&scheduler)
            .target("a", target())
            .build()
            .unwrap();
        assert!(matches!(
            build(&|b| b.target("a", target())),
            Err(FanoutConfigError::Config(ConfigError::DuplicateParticipant { .. }))
        ));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn enqueue_results_serialize_in_the_reference_shape() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("a", acking(&Batches::default()))
            .build()
            .unwrap();
        let ok = fanout
            .enqueue(inputs(&["m"]), &EnqueueOptions::all())
            .await
            .unwrap();
        let json = serde_json::to_value(&ok).unwrap();
        assert_eq!(json["success"], true);
        assert_eq!(json["value"], serde_json::json!(["m"]));
        assert_eq!(json["load"]["windowMs"], 60_000);
        assert_eq!(json["load"]["outbound"]["pendingDeliveries"], 1);
        assert!(json["load"]["outbound"]["averageProcessingMs"].is_null());
        let no = fanout
            .enqueue(inputs(&["m"]), &EnqueueOptions::to(["zz"]))
            .await
            .unwrap();
        let json = serde_json::to_value(&no).unwrap();
        assert_eq!(json["success"], false);
        assert_eq!(json["error"]["name"], "FanoutEnqueueError");
        let _: HashMap<String, serde_json::Value> = serde_json::from_value(json).unwrap();
    })
    .await;
}

// §3.16
#[tokio::test(start_paused = true)]
async fn a_target_added_later_never_receives_older_messages() {
    support::on_harness(|h| async move {
        let first = Scheduler::new(h.context()).unwrap();
        h.install(&first);
        let old = Fanout::<String>::builder(&first)
            .target("a", consumer(&Batches::default(), |_| Act::Leave))
            .batch_delay(Duration::from_secs(60))
            .build()
            .unwrap();
        accepted(old.enqueue(inputs(&["old"]), &EnqueueOptions::all()).await);
        drop(old);
        let second = scheduler(&h);
        let (a, b) = (Batches::default(), Batches::default());
        let fanout = Fanout::<String>::builder(&second)
            .target("a", acking(&a))
            .target("b", acking(&b))
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(inputs(&["new"]), &EnqueueOptions::all())
                .await,
        );
        sleep_ms(61_000).await;
        assert_eq!(a.deliveries_of("old"), vec![1]);
        assert!(
            b.deliveries_of("old").is_empty(),
            "its targets were frozen at acceptance"
        );
        assert_eq!(b.deliveries_of("new"), vec![1]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn migrating_to_none_drops_the_fanout_tables_and_their_memos() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(|batch: Vec<FanoutMessage<String>>| async move {
                    let _: u32 = batch[0]
                        .memo
                        .memoize("step", async { Ok::<_, HandlerError>(7) })
                        .await?;
                    Err(HandlerError::new("again later"))
                }),
            )
            .retry_delay(Delay::Fixed { ms: 60_000.0 })
            .build()
            .unwrap();
        accepted(fanout.enqueue(inputs(&["m"]), &EnqueueOptions::all()).await);
        settle().await;
        assert_eq!(count(&*ctx, "SELECT COUNT(*) FROM durability_memos"), 1);
        drop(fanout);
        let report =
            Fanout::<String>::migrate(ctx.storage(), durability::migrations::MigrationTarget::None)
                .unwrap();
        assert_eq!(
            report.rolled_back,
            vec![
                "durability_0015_fanout_paused_targets",
                "durability_0013_fanout_cursors",
                "durability_0009_create_fanout_parked",
                "durability_0005_create_fanout"
            ]
        );
        let left = count(
            &*ctx,
            "SELECT COUNT(*) FROM sqlite_master WHERE name LIKE 'durability_fanout%'",
        );
        assert_eq!(left, 0);
        assert_eq!(count(&*ctx, "SELECT COUNT(*) FROM durability_memos"), 0);
    })
    .await;
}

// ---------------------------------------------------------------------------
// Bodies the consumer side cannot decode (issue 10, defect 1)

/// A body type whose stored form outlived its decoder: any string is
/// written, but one starting with "poison" is refused when read back, as a
/// body stored before a change of the Rust type would be.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
struct Picky(String);

impl TryFrom<String> for Picky {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        if text.starts_with("poison") {
            Err(format!("cannot read {text:?}"))
        } else {
            Ok(Picky(text))
        }
    }
}

impl From<Picky> for String {
    fn from(body: Picky) -> String {
        body.0
    }
}

/// `(attempt, phase, last_error)` of a delivery row, if it exists.
fn delivery_failure(ctx: &dyn Context, key: &str) -> Option<(u32, String, Option<String>)> {
    ctx.storage()
        .query_row(
            "SELECT attempt, phase, last_error FROM durability_fanout_deliveries \
             WHERE message_key = ?",
            &params![key],
        )
        .unwrap()
        .map(|row| {
            (
                row.get(0).unwrap(),
                row.get(1).unwrap(),
                row.get(2).unwrap(),
            )
        })
}

/// `(reason, error_message)` of the parked entry of message `id`.
fn parked_failure(ctx: &dyn Context, id: &str) -> Option<(String, Option<String>)> {
    ctx.storage()
        .query_row(
            "SELECT reason, error_message FROM durability_fanout_parked WHERE message_id = ?",
            &params![id],
        )
        .unwrap()
        .map(|row| (row.get(0).unwrap(), row.get(1).unwrap()))
}

#[tokio::test(start_paused = true)]
async fn an_undecodable_body_is_a_failed_attempt_even_with_ack_on_return_and_ends_parked() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let seen = Rc::new(RefCell::new(Vec::<String>::new()));
        let record = Rc::clone(&seen);
        let fanout = Fanout::<Picky>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(move |batch: Vec<FanoutMessage<Picky>>| {
                    record
                        .borrow_mut()
                        .extend(batch.iter().map(|m| m.body.0.clone()));
                    async { Ok::<_, HandlerError>(()) }
                })
                .ack_on_return(true)
                .policy(MethodPolicy::new().max_attempts(2)),
            )
            .retry_delay(Delay::Fixed { ms: 10.0 })
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(
                    vec![
                        FanoutInput::new(Picky("fine".into())).id("good"),
                        FanoutInput::new(Picky("poison pill".into())).id("bad"),
                    ],
                    &EnqueueOptions::all(),
                )
                .await,
        );
        settle().await;
        assert_eq!(*seen.borrow(), vec!["fine".to_owned()]);
        let (attempt, phase, error) =
            delivery_failure(&*ctx, "bad").expect("the undecodable delivery was dropped");
        assert_eq!((attempt, phase.as_str()), (1, "delivery"));
        assert!(
            error.as_deref().is_some_and(|e| e.contains("cannot read")),
            "the decode error is the attempt's failure: {error:?}"
        );
        sleep_ms(20).await;
        assert_eq!(deliveries(&*ctx), 0);
        let (reason, error) = parked_failure(&*ctx, "bad").expect("parked, not dropped");
        assert_eq!(reason, "exhausted");
        assert!(error.is_some_and(|e| e.contains("cannot read")));
        assert_eq!(*seen.borrow(), vec!["fine".to_owned()], "never handed over");
        assert_manifests_consistent(&*ctx);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_batch_of_only_undecodable_bodies_is_not_acked_on_return() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<Picky>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(|_: Vec<FanoutMessage<Picky>>| async {
                    Ok::<_, HandlerError>(())
                })
                .ack_on_return(true),
            )
            .retry_delay(Delay::Fixed { ms: 60_000.0 })
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(
                    vec![FanoutInput::new(Picky("poison".into())).id("bad")],
                    &EnqueueOptions::all(),
                )
                .await,
        );
        settle().await;
        let (attempt, _, error) = delivery_failure(&*ctx, "bad").expect("kept for a retry");
        assert_eq!(attempt, 1);
        assert!(error.is_some_and(|e| e.contains("cannot read")));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_undecodable_body_bound_for_a_dlq_is_parked_instead_of_retried_for_ever() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let dlq = Rc::new(Cell::new(0_u32));
        let writes = Rc::clone(&dlq);
        let fanout = Fanout::<Picky>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(|_: Vec<FanoutMessage<Picky>>| async {
                    Ok::<_, HandlerError>(())
                })
                .ack_on_return(true)
                .policy(MethodPolicy::new().max_attempts(1)),
            )
            .dlq(move |_: StoredMessage<Picky>| {
                writes.set(writes.get() + 1);
                async { Ok::<_, HandlerError>(()) }
            })
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(
                    vec![FanoutInput::new(Picky("poison".into())).id("bad")],
                    &EnqueueOptions::all(),
                )
                .await,
        );
        settle().await;
        sleep_ms(2 * INFRASTRUCTURE_RETRY_MS as u64).await;
        assert_eq!(
            dlq.get(),
            0,
            "the DLQ cannot be given a body nobody can read"
        );
        assert_eq!(deliveries(&*ctx), 0);
        let (reason, error) = parked_failure(&*ctx, "bad").expect("parked, not dropped");
        assert_eq!(reason, "exhausted");
        assert!(error.is_some_and(|e| e.contains("cannot read")));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_undecodable_body_for_a_storage_target_fails_with_its_own_decode_error() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<Picky>::builder(&scheduler)
            .target(
                "s",
                Target::storage(|stored: StoredMessage<Picky>| async move {
                    if stored.message_id == "other" {
                        Err(HandlerError::new("disk full"))
                    } else {
                        Ok(())
                    }
                }),
            )
            .retry_delay(Delay::Fixed { ms: 60_000.0 })
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(
                    vec![
                        FanoutInput::new(Picky("fine".into())).id("other"),
                        FanoutInput::new(Picky("poison".into())).id("bad"),
                    ],
                    &EnqueueOptions::all(),
                )
                .await,
        );
        settle().await;
        let (_, _, error) = delivery_failure(&*ctx, "bad").expect("kept for a retry");
        assert!(
            error.as_deref().is_some_and(|e| e.contains("cannot read")),
            "{error:?}"
        );
        let (_, _, error) = delivery_failure(&*ctx, "other").expect("kept for a retry");
        assert_eq!(error.as_deref(), Some("disk full"));
    })
    .await;
}

// Issue 10, defects 1 to 3: a body nested deeper than the decoder reads
// back is refused at enqueue, whatever its depth, nothing written.
#[tokio::test(start_paused = true)]
async fn a_body_nested_deeper_than_the_decoder_reads_is_rejected_with_nothing_written() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<serde_json::Value>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(|_: Vec<FanoutMessage<serde_json::Value>>| async {
                    Ok::<_, HandlerError>(())
                })
                .ack_on_return(true),
            )
            .build()
            .unwrap();
        let before = snapshot(&*ctx);
        for depth in [127, 10_000] {
            let body = support::nested_json(depth);
            let batch = vec![
                FanoutInput::new(serde_json::json!(1)).id("fine"),
                FanoutInput::new(body).id("deep"),
            ];
            let error = rejected(fanout.enqueue(batch, &EnqueueOptions::all()).await);
            assert!(
                matches!(error, EnqueueRejection::BodyNotJson { index: 1, .. }),
                "{error:?}"
            );
            assert!(error.to_string().contains("limit of 100 levels"), "{error}");
        }
        assert_eq!(snapshot(&*ctx), before);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_parked_body_that_does_not_decode_never_hides_the_other_parked_entries() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let fanout = Fanout::<Picky>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(|batch: Vec<FanoutMessage<Picky>>| {
                    let settled: Vec<Settling> = batch.iter().map(|m| m.dead_letter()).collect();
                    async move {
                        for settling in settled {
                            settling
                                .await
                                .map_err(|e| HandlerError::new(e.to_string()))?;
                        }
                        Ok::<_, HandlerError>(())
                    }
                })
                .policy(MethodPolicy::new().max_attempts(1)),
            )
            .build()
            .unwrap();
        // One at a time, so they are parked in this order.
        for (id, body) in [("a", "first"), ("bad", "poison"), ("z", "last")] {
            let batch = vec![FanoutInput::new(Picky(body.into())).id(id)];
            accepted(fanout.enqueue(batch, &EnqueueOptions::all()).await);
            settle().await;
        }
        let page = fanout.parked(None, 10).unwrap();
        let ids: Vec<&str> = page.iter().map(|e| e.message_id.as_str()).collect();
        assert_eq!(ids, ["a"], "the page ends before the undecodable entry");
        let error = fanout.parked(page.last(), 10).unwrap_err();
        let FanoutError::Durability(DurabilityError::Decode { key, .. }) = &error else {
            panic!("expected a decode error, got {error:?}");
        };
        assert_eq!(fanout.purge_parked(&[key.as_str()]).unwrap(), 1);
        let rest = fanout.parked(page.last(), 10).unwrap();
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].message_id, "z");
    })
    .await;
}

// Issue 10, defect 8: ids and keys have the limit of every capability, and
// max_body_bytes counts the body's own JSON, not the stored envelope.
#[tokio::test(start_paused = true)]
async fn overlong_ids_and_keys_are_rejected_and_the_body_limit_counts_the_bodys_own_json() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("t", acking(&Batches::default()))
            .max_body_bytes(10)
            .build()
            .unwrap();
        let before = snapshot(&*ctx);
        let long = "i".repeat(1025);
        for overlong in [
            FanoutInput::new("b".to_owned()).id(long.as_str()),
            FanoutInput::new("b".to_owned())
                .id("m")
                .deduplication_key(long.as_str()),
        ] {
            let error = rejected(
                fanout
                    .enqueue(
                        vec![FanoutInput::new("ok".to_owned()).id("ok"), overlong],
                        &EnqueueOptions::all(),
                    )
                    .await,
            );
            assert!(
                error.to_string().starts_with("message 1: ")
                    && error
                        .to_string()
                        .ends_with("is 1025 bytes, above the limit of 1024 (MAX_ID_BYTES)"),
                "{error}"
            );
        }
        // "12345678" is 10 bytes of JSON (its quotes included), 35 stored.
        let error = rejected(
            fanout
                .enqueue(
                    vec![FanoutInput::new("123456789".to_owned()).id("over")],
                    &EnqueueOptions::all(),
                )
                .await,
        );
        assert_eq!(
            error.to_string(),
            "the body of message 0 is 11 bytes of JSON, above the limit of 10 (max_body_bytes)"
        );
        assert_eq!(snapshot(&*ctx), before);
        accepted(
            fanout
                .enqueue(
                    vec![FanoutInput::new("12345678".to_owned()).id(&*"i".repeat(1024))],
                    &EnqueueOptions::all(),
                )
                .await,
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_enqueue_or_redrive_of_more_than_max_enqueue_messages_is_rejected_whole() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target("t", acking(&Batches::default()))
            .max_enqueue_messages(2)
            .build()
            .unwrap();
        let before = snapshot(&*ctx);
        let error = rejected(
            fanout
                .enqueue(inputs(&["a", "b", "c"]), &EnqueueOptions::all())
                .await,
        );
        assert_eq!(
            error.to_string(),
            "messages holds 3 items, above the limit of 2 per call (max_enqueue_messages)"
        );
        let error = rejected(fanout.redrive_parked(&["x", "y", "z"]).await);
        assert!(matches!(error, EnqueueRejection::TooManyMessages(_)));
        assert_eq!(snapshot(&*ctx), before);
        accepted(
            fanout
                .enqueue(inputs(&["a", "b"]), &EnqueueOptions::all())
                .await,
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn count_and_size_settings_are_bounded_at_build_naming_the_setter() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let build = |configure: &dyn Fn(
            durability::fanout::FanoutBuilder<String>,
        ) -> durability::fanout::FanoutBuilder<String>| {
            configure(
                Fanout::<String>::builder(&scheduler).target("t", acking(&Batches::default())),
            )
            .build()
            .map(|_| ())
        };
        let cases: [(&dyn Fn(_) -> _, &str, u64); 3] = [
            (&|b: durability::fanout::FanoutBuilder<String>| b.max_body_bytes(usize::MAX), "max_body_bytes", 32 << 20),
            (&|b: durability::fanout::FanoutBuilder<String>| b.max_batch_size(usize::MAX), "max_batch_size", 100_000),
            (&|b: durability::fanout::FanoutBuilder<String>| b.max_enqueue_messages(100_001), "max_enqueue_messages", 100_000),
        ];
        for (configure, setter, max) in cases {
            match build(configure) {
                Err(FanoutConfigError::Config(ConfigError::OutOfRange { field, min: 1, max: m })) => {
                    assert_eq!((field.as_str(), m), (setter, max));
                }
                other => panic!("{setter}: {other:?}"),
            }
        }
        assert!(matches!(
            build(&|b| b.max_enqueue_messages(0)),
            Err(FanoutConfigError::Config(ConfigError::NotPositive { field })) if field == "max_enqueue_messages"
        ));
    })
    .await;
}

// ---------------------------------------------------------------------------
// Per-target cursors, rows only for exceptions (issue 13)

/// A database of the layout before migration 0013, with a delivery in
/// every state it had: first deliveries (`f`, to a and b), a retry waiting
/// with a memo (`r`), dead-letter intent whose DLQ write is owed (`d` to b;
/// a already acked it), a claim in flight of a dead process (`i`), and a
/// parked entry.
const OLD_LAYOUT_ROWS: &str = "
INSERT INTO durability_fanout_messages (key, id, payload, targets, remaining, seq, created_at, generation_id) VALUES
  ('f', 'f', '{\"kind\":\"value\",\"value\":\"body of f\"}', '[\"a\",\"b\"]', 2, 0, 999000, 'gf'),
  ('r', 'r', '{\"kind\":\"value\",\"value\":\"body of r\"}', '[\"a\"]', 1, 1, 999000, 'gr'),
  ('d', 'd', '{\"kind\":\"value\",\"value\":\"body of d\"}', '[\"a\",\"b\"]', 1, 2, 999000, 'gd'),
  ('i', 'i', '{\"kind\":\"value\",\"value\":\"body of i\"}', '[\"b\"]', 1, 3, 999000, 'gi');
INSERT INTO durability_fanout_deliveries (id, message_key, target_id, seq, status, phase, attempt, next_attempt_at, last_error, last_error_name, created_at, generation_id, dead_lettered_at, dead_letter_reason) VALUES
  ('[\"f\",\"a\"]', 'f', 'a', 0, 'pending', 'delivery', 0, 999000, NULL, NULL, 999000, 'gf', NULL, NULL),
  ('[\"f\",\"b\"]', 'f', 'b', 0, 'pending', 'delivery', 0, 999000, NULL, NULL, 999000, 'gf', NULL, NULL),
  ('[\"r\",\"a\"]', 'r', 'a', 1, 'pending', 'delivery', 2, 1000500, 'busy', 'Error', 999000, 'gr', NULL, NULL),
  ('[\"d\",\"b\"]', 'd', 'b', 2, 'pending', 'dead_letter', 1, 999500, 'bad', 'Error', 999000, 'gd', 999400, 'explicit'),
  ('[\"i\",\"b\"]', 'i', 'b', 3, 'pending', 'delivery', 1, 1200000, NULL, NULL, 999000, 'gi', NULL, NULL);
UPDATE durability_fanout_seq SET next_seq = 4;
INSERT INTO durability_fanout_parked (id, message_id, message_key, target_id, payload, enqueued_at, parked_at, attempts, reason, error_name, error_message) VALUES
  ('[\"gp\",\"a\"]', 'p', 'p', 'a', '{\"kind\":\"value\",\"value\":\"body of p\"}', 998000, 998500, 5, 'exhausted', 'Error', 'gone');
INSERT INTO durability_memos (record_table, record_key, memo_key, generation_id, value, created_at) VALUES
  ('durability_fanout_deliveries', '[\"r\",\"a\"]', 'charge', 'gr', '{\"kind\":\"value\",\"value\":7}', 999100);
";

const OLD_DELIVERIES: &str = "SELECT id, message_key, target_id, seq, status, phase, attempt, \
     next_attempt_at, last_error, last_error_name, created_at, generation_id, dead_lettered_at, \
     dead_letter_reason FROM durability_fanout_deliveries ORDER BY id";

fn rows(ctx: &dyn Context, sql: &str) -> Vec<Vec<durability::platform::Value>> {
    ctx.storage()
        .query(sql, &[])
        .unwrap()
        .iter()
        .map(|row| row.values().to_vec())
        .collect()
}

#[tokio::test(start_paused = true)]
async fn migration_0013_carries_every_old_delivery_over_once_and_its_down_script_back() {
    use durability::migrations::{MEMOS_CAPABILITY, MigrationTarget, migrate};
    support::on_harness(|h| async move {
        let ctx = h.context();
        let before_cursors = MigrationTarget::Named("durability_0009_create_fanout_parked".into());
        Fanout::<String>::migrate(ctx.storage(), before_cursors.clone()).unwrap();
        migrate(
            ctx.storage(),
            MEMOS_CAPABILITY,
            durability::memo::MEMO_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        ctx.storage().execute_script(OLD_LAYOUT_ROWS).unwrap();
        let old_deliveries = rows(&*ctx, OLD_DELIVERIES);
        let old_messages = rows(
            &*ctx,
            "SELECT * FROM durability_fanout_messages ORDER BY key",
        );
        let parked = table_snapshot(&*ctx, "durability_fanout_parked");
        let memos = table_snapshot(&*ctx, "durability_memos");

        // Up: every owed delivery is there once, exactly as it was.
        let report = Fanout::<String>::migrate(ctx.storage(), MigrationTarget::Latest).unwrap();
        assert_eq!(
            report.applied,
            vec![
                "durability_0013_fanout_cursors",
                "durability_0015_fanout_paused_targets"
            ]
        );
        assert_eq!(rows(&*ctx, OLD_DELIVERIES), old_deliveries);
        assert_eq!(
            rows(
                &*ctx,
                "SELECT key, id, payload, targets, seq, created_at, generation_id \
                 FROM durability_fanout_messages ORDER BY key"
            ),
            old_messages
                .iter()
                .map(|m| [&m[..4], &m[5..]].concat())
                .collect::<Vec<_>>()
        );
        assert_eq!(table_snapshot(&*ctx, "durability_fanout_parked"), parked);
        assert_eq!(table_snapshot(&*ctx, "durability_memos"), memos);

        // Down: the old layout, row for row.
        let report = Fanout::<String>::migrate(ctx.storage(), before_cursors).unwrap();
        assert_eq!(
            report.rolled_back,
            vec![
                "durability_0015_fanout_paused_targets",
                "durability_0013_fanout_cursors"
            ]
        );
        assert_eq!(rows(&*ctx, OLD_DELIVERIES), old_deliveries);
        assert_eq!(
            rows(
                &*ctx,
                "SELECT * FROM durability_fanout_messages ORDER BY key"
            ),
            old_messages
        );
        assert_eq!(table_snapshot(&*ctx, "durability_memos"), memos);

        // Up again by building the fanout, and drain: each delivery once,
        // its attempt counting on, the memo reused, the dead letter to the
        // DLQ without its consumer, the parked entry kept.
        let scheduler = scheduler(&h);
        let charged = Rc::new(Cell::new(0));
        let (a, b, dlq) = (Batches::default(), Batches::default(), Store::default());
        let (a_log, charges) = (a.clone(), Rc::clone(&charged));
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "a",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    a_log.record(&batch);
                    let charges = Rc::clone(&charges);
                    async move {
                        for message in &batch {
                            let charged: i64 = message
                                .memo
                                .memoize("charge", async {
                                    charges.set(charges.get() + 1);
                                    Ok::<_, HandlerError>(99)
                                })
                                .await
                                .map_err(|e| HandlerError::new(format!("{e:?}")))?;
                            if message.id == "r" {
                                assert_eq!(charged, 7, "the carried memo");
                            }
                        }
                        Ok::<_, HandlerError>(())
                    }
                })
                .ack_on_return(true),
            )
            .target("b", acking(&b))
            .dlq(dlq.writer())
            .build()
            .unwrap();
        assert_eq!(fanout.load().unwrap().outbound.pending_deliveries, 5);
        // The alarm the old layout had armed fires (rows written straight
        // into the file armed none).
        scheduler.alarm(None).await.unwrap();
        sleep_ms(300_000).await;
        assert_eq!(
            a.all(),
            vec![vec![("f".to_owned(), 1)], vec![("r".to_owned(), 3)]]
        );
        assert_eq!(
            b.all(),
            vec![vec![("f".to_owned(), 1)], vec![("i".to_owned(), 2)]]
        );
        assert_eq!(charged.get(), 1, "only f ran its step; r reused the memo");
        let letters = dlq.all();
        assert_eq!(letters.len(), 1);
        assert_eq!(letters[0].message_id, "d");
        assert_eq!(letters[0].target, "b");
        assert_eq!(letters[0].stored_at, 999_400);
        assert_eq!(
            letters[0].failure.as_ref().map(|f| f.reason),
            Some(DeadLetterReason::Explicit)
        );
        assert_eq!(fanout.parked(None, 10).unwrap().len(), 1);
        assert_eq!(deliveries(&*ctx), 0);
        assert_eq!(manifests(&*ctx), 0);
        assert_eq!(fanout.load().unwrap().outbound.pending_deliveries, 0);
        assert_eq!(count(&*ctx, "SELECT COUNT(*) FROM durability_memos"), 0);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_permanently_failing_message_never_holds_back_the_rest_of_its_target() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let seen: Rc<RefCell<Vec<(String, u32, i64)>>> = Rc::default();
        let (log, clock) = (Rc::clone(&seen), h.context());
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    let now = clock.now_ms();
                    let mut retried = Vec::new();
                    for message in &batch {
                        log.borrow_mut()
                            .push((message.id.clone(), message.attempt, now));
                        if message.id == "poison" {
                            retried.push(message.retry());
                        }
                    }
                    async move {
                        for settlement in retried {
                            settlement
                                .await
                                .map_err(|e| HandlerError::new(e.to_string()))?;
                        }
                        Ok::<_, HandlerError>(())
                    }
                })
                .ack_on_return(true),
            )
            .max_attempts(1_000)
            .retry_delay(Delay::Fixed { ms: 20.0 })
            .max_batch_size(10)
            .build()
            .unwrap();
        accepted(
            fanout
                .enqueue(inputs(&["poison"]), &EnqueueOptions::all())
                .await,
        );
        let mut enqueued_at = HashMap::new();
        for round in 0..50 {
            let ids: Vec<String> = (0..10).map(|i| format!("r{round}-{i}")).collect();
            let now = ctx.now_ms();
            for id in &ids {
                enqueued_at.insert(id.clone(), now);
            }
            let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
            accepted(fanout.enqueue(inputs(&refs), &EnqueueOptions::all()).await);
            // While the poison's exception row waits, the cursor is past it.
            assert!(count(&*ctx, "SELECT COUNT(*) FROM durability_fanout_exceptions") <= 1);
            sleep_ms(5).await;
        }
        let seen = seen.borrow();
        // Every other message: delivered once, on its first attempt, in the
        // pass its own enqueue started.
        for (id, at) in &enqueued_at {
            let got: Vec<_> = seen.iter().filter(|(m, _, _)| m == id).collect();
            assert_eq!(got.len(), 1, "{id} delivered once");
            assert_eq!(got[0].1, 1, "{id} on its first attempt");
            assert_eq!(got[0].2, *at, "{id} not held back");
        }
        // The poison kept failing all along, every 20 ms.
        let poison = seen.iter().filter(|(m, _, _)| m == "poison").count();
        assert!(poison >= 10, "the poison was retried {poison} times");
        // It is the only delivery with a row, and the only message kept.
        assert_eq!(
            count(&*ctx, "SELECT COUNT(*) FROM durability_fanout_exceptions"),
            1
        );
        assert_eq!(deliveries(&*ctx), 1);
        assert_eq!(manifests(&*ctx), 1);
        assert_eq!(fanout.load().unwrap().outbound.pending_deliveries, 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_backlog_acked_on_return_goes_in_bounded_ordered_batches_each_claimed_before_delivery() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let t = Batches::default();
        let claims_seen: Rc<RefCell<Vec<(u32, i64)>>> = Rc::default();
        let (log, seen, reader) = (t.clone(), Rc::clone(&claims_seen), h.context());
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    log.record(&batch);
                    // The claim as stored while the target has the batch.
                    let claim = delivery(&*reader, &batch[0].id, "t").unwrap();
                    seen.borrow_mut().push((claim.0, claim.1));
                    async { Ok::<_, HandlerError>(()) }
                })
                .ack_on_return(true)
                .policy(MethodPolicy::new().attempt_timeout_ms(45_000)),
            )
            .max_batch_size(10)
            .batch_delay(Duration::from_secs(60))
            .build()
            .unwrap();
        let ids: Vec<String> = (0..35).map(|i| format!("m{i:02}")).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        accepted(fanout.enqueue(inputs(&refs), &EnqueueOptions::all()).await);
        sleep_ms(60_000).await;
        let batches = t.ids();
        assert_eq!(
            batches.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![10, 10, 10, 5]
        );
        assert_eq!(batches.concat(), ids, "in acceptance order, each once");
        assert!(t.all().iter().flatten().all(|(_, attempt)| *attempt == 1));
        // Every batch was durably claimed (attempt 1, due at its deadline)
        // before the target had it.
        assert!(
            claims_seen
                .borrow()
                .iter()
                .all(|(attempt, due)| *attempt == 1 && *due > START_MS + 45_000)
        );
        assert_eq!(deliveries(&*ctx), 0);
        assert_eq!(manifests(&*ctx), 0);
        assert_eq!(
            count(&*ctx, "SELECT COUNT(*) FROM durability_fanout_exceptions"),
            0
        );
    })
    .await;
}

/// Found by `durability fuzz` (seed 2, case 2807): damaged fanout rows (in
/// the layout of then, a manifest whose `remaining` was i64::MIN; here a
/// cursor of the wrong type, and a sequence row of the wrong types) made
/// every pass fail while each commit re-armed the
/// in-memory timer for the still-due work: the scheduler looped at full
/// speed without time moving. A failed run now holds the timer back until
/// its fallback alarm.
#[tokio::test(start_paused = true)]
async fn a_pass_that_keeps_failing_on_damaged_rows_retries_at_the_fallback_pace() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let runs = Rc::new(Cell::new(0u32));
        let runaway = Rc::new(tokio::sync::Notify::new());
        let failed_run = {
            let (runs, runaway) = (Rc::clone(&runs), Rc::clone(&runaway));
            Rc::new(move |_: &durability::AlarmRetryInfo| {
                runs.set(runs.get() + 1);
                if runs.get() > 500 {
                    runaway.notify_one();
                }
                None
            })
        };
        let scheduler = Scheduler::builder(h.context())
            .on_alarm_retry(failed_run)
            .build()
            .unwrap();
        h.install(&scheduler);
        let target = Target::consumer(|_batch: Vec<FanoutMessage<serde_json::Value>>| async {
            Ok::<_, HandlerError>(())
        })
        .ack_on_return(true);
        let fanout = Fanout::<serde_json::Value>::builder(&scheduler)
            .target("inbox", target)
            .build()
            .unwrap();
        let input = FanoutInput::new(serde_json::json!({"n": 1})).id("m-1");
        accepted(fanout.enqueue(vec![input], &EnqueueOptions::all()).await);
        let sql = ctx.storage();
        let _ = sql.execute(
            "UPDATE durability_fanout_parked SET target_id = ?",
            &[durability::platform::Value::Blob(vec![0, 159, 146, 150])],
        );
        let _ = sql.execute(
            "INSERT INTO durability_fanout_seq VALUES (?, ?)",
            &params![i64::MIN, 1.5],
        );
        // In the cursor layout (migration 0013) the damage that fails every
        // pass is a target cursor of the wrong type.
        sql.execute("UPDATE durability_fanout_cursors SET next_seq = 1.5", &[])
            .unwrap();
        let drive = async {
            for round in 0..6u32 {
                let _ = scheduler.alarm(None).await;
                tokio::time::sleep(Duration::from_secs(4u64.pow(round))).await;
            }
        };
        tokio::select! {
            () = runaway.notified() => panic!(
                "{} failed runs without time moving: a hot loop",
                runs.get()
            ),
            () = drive => {}
        }
        // 1,365 s of driving: six direct runs, then at most the timer and the
        // physical alarm once per 15 s fallback.
        assert!(
            runs.get() <= 6 + 2 * (1_365 / 15) + 10,
            "{} failed runs",
            runs.get()
        );
        assert!(runs.get() >= 2, "the damaged work is still retried");
    })
    .await;
}

/// The object's context, counting the sleeps the scheduler asks for: a run
/// that re-arms its timer at once, forever, asks for sleeps without the
/// (paused) clock ever moving.
struct CountingSleeps {
    inner: Rc<dyn Context>,
    sleeps: Rc<Cell<u64>>,
    /// Notified at the 20,000th sleep.
    runaway: Rc<tokio::sync::Notify>,
}

impl Context for CountingSleeps {
    fn id(&self) -> &durability::platform::ObjectId {
        self.inner.id()
    }
    fn storage(&self) -> &dyn durability::platform::Storage {
        self.inner.storage()
    }
    fn now_ms(&self) -> i64 {
        self.inner.now_ms()
    }
    fn sleep(&self, duration: Duration) -> durability::platform::LocalBoxFuture<'static, ()> {
        self.sleeps.set(self.sleeps.get() + 1);
        if self.sleeps.get() == 20_000 {
            self.runaway.notify_one();
        }
        self.inner.sleep(duration)
    }
    fn random_bytes(&self, buf: &mut [u8]) {
        self.inner.random_bytes(buf);
    }
    fn spawn(&self, task: durability::platform::LocalBoxFuture<'static, ()>) {
        self.inner.spawn(task);
    }
    fn wait_until(&self, task: durability::platform::LocalBoxFuture<'static, ()>) {
        self.inner.wait_until(task);
    }
}

/// Drives `scheduler` for 1,365 virtual seconds (six direct runs with
/// growing sleeps between) and returns what `on_alarm_retry` was told;
/// panics on a hot loop (20,000 sleeps asked for).
async fn drive_and_report(
    h: &Harness,
    build: impl FnOnce(Rc<dyn Context>, durability::scheduler::AlarmRetryHook) -> Scheduler,
    damage: impl AsyncFnOnce(&Scheduler, &dyn Context),
) -> Vec<String> {
    let sleeps = Rc::new(Cell::new(0u64));
    let runaway = Rc::new(tokio::sync::Notify::new());
    let ctx: Rc<dyn Context> = Rc::new(CountingSleeps {
        inner: h.context(),
        sleeps: Rc::clone(&sleeps),
        runaway: Rc::clone(&runaway),
    });
    let reports = Rc::new(RefCell::new(Vec::<String>::new()));
    let report = {
        let reports = Rc::clone(&reports);
        Rc::new(move |info: &durability::AlarmRetryInfo| {
            reports.borrow_mut().push(info.error.message.clone());
            None
        })
    };
    let scheduler = build(Rc::clone(&ctx), report);
    h.install(&scheduler);
    damage(&scheduler, ctx.as_ref()).await;
    let drive = async {
        for round in 0..6u32 {
            let _ = scheduler.alarm(None).await;
            tokio::time::sleep(Duration::from_secs(4u64.pow(round))).await;
        }
    };
    tokio::select! {
        () = runaway.notified() => panic!(
            "{} sleeps asked for without the work advancing: a hot loop",
            sleeps.get()
        ),
        () = drive => {}
    }
    let reports = reports.borrow().clone();
    // Six direct runs, then about two runs per 15 s fallback (the one that
    // notes the count, the one that finds it unchanged).
    assert!(reports.len() >= 2, "the damage is reported: {reports:?}");
    assert!(
        reports.len() <= 6 + 2 * (1_365 / 15) + 10,
        "{} reports",
        reports.len()
    );
    reports
}

/// Found by the fuzzer (`malformed-rows`, seed 5 case 1679: a cursor moved
/// past every span it owes; seed 77 case 782 and seed 5 case 2827: a
/// `claim_attempt` of the wrong type): the pass claimed nothing and
/// returned `Ok`, while the reconcile still saw the span due, so each run
/// re-armed the timer at once, a hot loop. The cursor now fails to decode,
/// naming itself, and the run retries at the fallback pace.
#[tokio::test(start_paused = true)]
async fn a_damaged_cursor_fails_its_pass_by_name_and_retries_at_the_fallback_pace() {
    use durability::platform::Value;
    for (table, column, value) in [
        ("cursors", "next_seq", Value::Integer(i64::MAX)),
        ("cursors", "claim_attempt", Value::Text(String::new())),
        ("cursors", "claim_attempt", Value::Blob(vec![0, 159])),
        ("cursors", "claim_attempt", Value::Integer(-3)),
        // A claim that ends before the cursor (taking it again would move
        // the cursor back), and a span ending at i64::MAX (seed 11, cases
        // 5126 and 19228: its end wrapped around and the message was
        // delivered again and again).
        ("cursors", "claim_end", Value::Integer(-5)),
        ("spans", "last_seq", Value::Integer(i64::MAX)),
    ] {
        support::on_harness(move |h| async move {
            let keep = Rc::new(RefCell::new(None));
            let reports = drive_and_report(
                &h,
                |ctx, report| {
                    Scheduler::builder(ctx)
                        .on_alarm_retry(report)
                        .build()
                        .unwrap()
                },
                async |scheduler, ctx| {
                    let target =
                        Target::consumer(|_batch: Vec<FanoutMessage<serde_json::Value>>| async {
                            Ok::<_, HandlerError>(())
                        })
                        .ack_on_return(true);
                    let fanout = Fanout::<serde_json::Value>::builder(scheduler)
                        .target("inbox", target)
                        .build()
                        .unwrap();
                    let input = FanoutInput::new(serde_json::json!({"n": 1})).id("m-1");
                    accepted(fanout.enqueue(vec![input], &EnqueueOptions::all()).await);
                    ctx.storage()
                        .execute(
                            &format!("UPDATE durability_fanout_{table} SET {column} = ?"),
                            &[value],
                        )
                        .unwrap();
                    *keep.borrow_mut() = Some(fanout);
                },
            )
            .await;
            assert!(
                reports.iter().all(|message| message
                    .contains("\"inbox\" of durability_fanout_cursors does not decode")),
                "{table}.{column}: each report names the damaged cursor: {reports:?}"
            );
        })
        .await;
    }
}
