//! Durable operations (core.md §7) on a real inline host: one test per
//! invariant of §7.9, then retries, timeouts, purge, lifecycle events and
//! bad input. Everything runs on paused tokio time on one object.

mod support;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use durability::codec::CodecError;
use durability::error::{ConfigError, DurabilityError, HandlerError, SerializedError};
use durability::lifecycle::{LifecycleEvent, Outcome, TerminalReason};
use durability::platform::{Context, params};
use durability::retry::{Delay, MethodPolicy};
use durability::{
    AlarmRetryInfo, DurableCall, OperationResult, Operations, Registration, Scheduler,
};
use support::{Events, Gate, Harness, physical_alarm, query_i64, table_snapshot};

/// The host clock of a fresh harness starts here.
const START_MS: i64 = 1_000_000;
/// The scheduler's default minimum distance of the physical alarm.
const MIN_DELAY_MS: i64 = 15_000;
const LONG_WAIT: Duration = Duration::from_secs(3_600);

/// A scheduler with default options whose alarm the object delegates to.
fn scheduler(h: &Harness) -> Scheduler {
    let scheduler = Scheduler::new(h.context()).unwrap();
    h.install(&scheduler);
    scheduler
}

fn status_of(ctx: &dyn Context, id: &str) -> Option<String> {
    ctx.storage()
        .query_row(
            "SELECT status FROM durability_calls WHERE id = ?",
            &params![id],
        )
        .unwrap()
        .map(|row| row.get::<String>(0).unwrap())
}

fn calls(ctx: &dyn Context) -> i64 {
    query_i64(ctx, "SELECT COUNT(*) FROM durability_calls", &[])
}

/// Lets background work (eager starts, timers at "now") run without moving
/// the clock by more than a millisecond.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

// §7.9 (1)
#[tokio::test(start_paused = true)]
async fn registration_resolves_only_after_row_and_alarm_commit_together() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let gate = Gate::default();
        let held = gate.clone();
        let ops = Operations::builder(&scheduler)
            .handler("slow", move |_: DurableCall<()>| {
                let held = held.clone();
                async move {
                    held.wait().await;
                    Ok::<_, HandlerError>(())
                }
            })
            .handler("other", |_: DurableCall<()>| async {
                Ok::<_, HandlerError>(())
            })
            .build()
            .unwrap();
        assert_eq!(physical_alarm(&*ctx).await, None);

        let now = scheduler.now_ms();
        assert_eq!(
            ops.start("slow", "a", &()).await.unwrap(),
            Registration::Created
        );
        // No await has run since `start` returned: what it waited for is the
        // commit of the row together with the alarm that covers it.
        assert_eq!(status_of(&*ctx, "a").as_deref(), Some("pending"));
        assert_eq!(physical_alarm(&*ctx).await, Some(now + MIN_DELAY_MS));

        // A registration that fails rolls back as a whole: neither a row nor
        // an alarm change.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let before = table_snapshot(&*ctx, "durability_calls");
        let alarm = physical_alarm(&*ctx).await;
        assert!(matches!(
            ops.start("other", "a", &()).await,
            Err(DurabilityError::DuplicateCall { .. })
        ));
        assert_eq!(table_snapshot(&*ctx, "durability_calls"), before);
        assert_eq!(physical_alarm(&*ctx).await, alarm);
        gate.open();
        settle().await;
        assert_eq!(status_of(&*ctx, "a").as_deref(), Some("completed"));
    })
    .await;
}

// §7.9 (2)
#[tokio::test(start_paused = true)]
async fn second_registration_of_an_id_writes_nothing_emits_nothing_starts_nothing() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let events = Events::default();
        let runs = Rc::new(Cell::new(0_u32));
        let gate = Gate::default();
        let (counted, held) = (Rc::clone(&runs), gate.clone());
        let ops = Operations::builder(&scheduler)
            .handler("op", move |call: DurableCall<String>| {
                counted.set(counted.get() + 1);
                let held = held.clone();
                async move {
                    match call.payload.as_str() {
                        "fail" => Err(HandlerError::non_retryable("refused")),
                        "block" => {
                            held.wait().await;
                            Ok(call.payload)
                        }
                        _ => Ok(call.payload),
                    }
                }
            })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        ops.start("op", "done", "ok").await.unwrap();
        ops.start("op", "failed", "fail").await.unwrap();
        ops.start("op", "running", "block").await.unwrap();
        settle().await;
        assert_eq!(status_of(&*ctx, "done").as_deref(), Some("completed"));
        assert_eq!(status_of(&*ctx, "failed").as_deref(), Some("failed"));
        assert_eq!(status_of(&*ctx, "running").as_deref(), Some("pending"));

        let rows = table_snapshot(&*ctx, "durability_calls");
        let alarm = physical_alarm(&*ctx).await;
        let (emitted, started) = (events.all().len(), runs.get());
        for id in ["done", "failed", "running"] {
            // A different payload is not detected: the first registration wins.
            assert_eq!(
                ops.start("op", id, "a different payload").await.unwrap(),
                Registration::Existing
            );
        }
        settle().await;
        assert_eq!(table_snapshot(&*ctx, "durability_calls"), rows);
        assert_eq!(physical_alarm(&*ctx).await, alarm);
        assert_eq!(events.all().len(), emitted);
        assert_eq!(runs.get(), started);

        gate.open();
        let result = ops
            .wait::<String>("op", "running", LONG_WAIT)
            .await
            .unwrap();
        assert_eq!(
            result,
            OperationResult::Completed {
                result: "block".into()
            }
        );
        assert_eq!(runs.get(), 3);
    })
    .await;
}

// §7.9 (3)
#[tokio::test(start_paused = true)]
async fn an_id_owned_by_another_operation_is_rejected_and_writes_nothing() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let events = Events::default();
        let ops = Operations::builder(&scheduler)
            .handler("charge", |call: DurableCall<u32>| async move {
                Ok::<_, HandlerError>(call.payload)
            })
            .handler("refund", |call: DurableCall<u32>| async move {
                Ok::<_, HandlerError>(call.payload)
            })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        ops.start("charge", "order-1", &10_u32).await.unwrap();
        settle().await;
        let rows = table_snapshot(&*ctx, "durability_calls");
        let emitted = events.all().len();

        let error = ops.start("refund", "order-1", &99_u32).await.unwrap_err();
        match &error {
            DurabilityError::DuplicateCall {
                id,
                existing,
                requested,
            } => {
                assert_eq!(
                    (id.as_str(), existing.as_str(), requested.as_str()),
                    ("order-1", "charge", "refund")
                );
            }
            other => panic!("expected DuplicateCall, got {other:?}"),
        }
        assert_eq!(
            error.to_string(),
            "Durable call \"order-1\" already belongs to operation \"charge\", not \"refund\""
        );
        // Reading under the wrong operation is a mismatch naming both, not
        // a duplicate call (nothing was called twice).
        let mismatch = ops.result::<u32>("refund", "order-1").unwrap_err();
        assert!(matches!(
            &mismatch,
            DurabilityError::OperationMismatch { id, registered, requested }
                if (id.as_str(), registered.as_str(), requested.as_str())
                    == ("order-1", "charge", "refund")
        ));
        assert_eq!(mismatch.kind(), durability::ErrorKind::OperationMismatch);
        assert!(matches!(
            ops.wait::<u32>("refund", "order-1", LONG_WAIT).await,
            Err(DurabilityError::OperationMismatch { .. })
        ));
        settle().await;
        assert_eq!(table_snapshot(&*ctx, "durability_calls"), rows);
        assert_eq!(events.all().len(), emitted);

        // Two concurrent registrations of one id under different operations:
        // exactly one wins, the other is rejected.
        let (a, b) = futures::join!(
            ops.start("charge", "order-2", &1_u32),
            ops.start("refund", "order-2", &2_u32)
        );
        assert_eq!(
            usize::from(a.is_ok()) + usize::from(b.is_ok()),
            1,
            "{a:?} / {b:?}"
        );
        let loser = if a.is_ok() { b } else { a };
        assert!(matches!(loser, Err(DurabilityError::DuplicateCall { .. })));
        assert_eq!(
            query_i64(
                &*ctx,
                "SELECT COUNT(*) FROM durability_calls WHERE id = 'order-2'",
                &[]
            ),
            1
        );
    })
    .await;
}

// §7.9 (4)
#[tokio::test(start_paused = true)]
async fn at_most_one_execution_per_id_and_generation_runs_at_a_time() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let running = Rc::new(Cell::new(0_u32));
        let most = Rc::new(Cell::new(0_u32));
        let attempts = Rc::new(Cell::new(0_u32));
        let (r, m, a) = (Rc::clone(&running), Rc::clone(&most), Rc::clone(&attempts));
        let ops = Operations::builder(&scheduler)
            // Each attempt ignores its abort signal and runs for a minute,
            // far beyond the 1 s timeout: retries become due while it runs.
            .handler("stubborn", move |call: DurableCall<()>| {
                let (r, m, a) = (Rc::clone(&r), Rc::clone(&m), Rc::clone(&a));
                async move {
                    a.set(a.get() + 1);
                    r.set(r.get() + 1);
                    m.set(m.get().max(r.get()));
                    if call.attempt < 3 {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                    }
                    r.set(r.get() - 1);
                    if call.attempt < 3 {
                        Err(HandlerError::new("not yet"))
                    } else {
                        Ok(call.attempt)
                    }
                }
            })
            .attempt_timeout(Duration::from_secs(1))
            .retry_delay(Delay::Fixed { ms: 100.0 })
            .build()
            .unwrap();
        ops.start("stubborn", "a", &()).await.unwrap();
        // Extra alarm runs and timer runs while the first attempt holds on:
        // each finds the execution active and waits instead of starting one.
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let extra = scheduler.clone();
            tokio::task::spawn_local(async move { extra.alarm(None).await });
        }
        let result = ops.wait::<u32>("stubborn", "a", LONG_WAIT).await.unwrap();
        assert_eq!(result, OperationResult::Completed { result: 3 });
        assert_eq!(most.get(), 1, "two executions of one generation overlapped");
        assert_eq!(attempts.get(), 3);
    })
    .await;
}

// §7.9 (5)
#[tokio::test(start_paused = true)]
async fn eager_start_only_when_a_permit_is_free() {
    support::on_harness(|h| async move {
        let scheduler = Scheduler::builder(h.context())
            .alarm_concurrency(1)
            .build()
            .unwrap();
        h.install(&scheduler);
        let events = Events::default();
        let gate = Gate::default();
        let started = Rc::new(RefCell::new(Vec::<String>::new()));
        let (held, log) = (gate.clone(), Rc::clone(&started));
        let ops = Operations::builder(&scheduler)
            .handler("job", move |call: DurableCall<()>| {
                log.borrow_mut().push(call.id.clone());
                let held = held.clone();
                async move {
                    held.wait().await;
                    Ok::<_, HandlerError>(())
                }
            })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        let registered_at = scheduler.now_ms();
        ops.start("job", "first", &()).await.unwrap();
        settle().await;
        // The one permit was free: the handler started at registration time.
        assert_eq!(*started.borrow(), ["first"]);
        assert!(events.all().iter().any(|event| matches!(
            event,
            LifecycleEvent::AttemptStarted { timestamp, .. } if *timestamp == registered_at
        )));

        let second_at = scheduler.now_ms();
        ops.start("job", "second", &()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        // No permit was free: nothing started, not even from the timer or
        // the physical alarm, until the first handler gives its permit back.
        assert_eq!(*started.borrow(), ["first"]);
        assert_eq!(
            ops.result::<()>("job", "second").unwrap(),
            OperationResult::Pending {
                attempt: 0,
                next_attempt_at: second_at,
                last_error: None
            }
        );
        gate.open();
        let second = ops.wait::<()>("job", "second", LONG_WAIT).await.unwrap();
        assert_eq!(second, OperationResult::Completed { result: () });
        assert_eq!(*started.borrow(), ["first", "second"]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_eager_start_claims_its_first_attempt_in_the_registrations_commit() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::builder(h.context())
            .alarm_concurrency(1)
            .build()
            .unwrap();
        h.install(&scheduler);
        let gate = Gate::default();
        let held = gate.clone();
        let attempts = Rc::new(RefCell::new(Vec::<u32>::new()));
        let seen = Rc::clone(&attempts);
        let ops = Operations::builder(&scheduler)
            .handler("job", move |call: DurableCall<()>| {
                seen.borrow_mut().push(call.attempt);
                let held = held.clone();
                async move {
                    held.wait().await;
                    Ok::<_, HandlerError>(())
                }
            })
            .build()
            .unwrap();
        let attempt_of = |id: &str| {
            query_i64(
                &*ctx,
                "SELECT attempt FROM durability_calls WHERE id = ?",
                &params![id],
            )
        };
        // A free permit: the attempt is counted by the registration itself,
        // before the handler was even scheduled (no await in between).
        ops.start("job", "eager", &()).await.unwrap();
        assert_eq!(attempt_of("eager"), 1);
        assert!(attempts.borrow().is_empty());
        settle().await;
        // The handler runs that attempt; it claims no second one.
        assert_eq!(*attempts.borrow(), [1]);
        assert_eq!(attempt_of("eager"), 1);
        // No permit free: registered unclaimed, claimed when a permit frees.
        ops.start("job", "queued", &()).await.unwrap();
        assert_eq!(attempt_of("queued"), 0);
        gate.open();
        let done = ops.wait::<()>("job", "queued", LONG_WAIT).await.unwrap();
        assert_eq!(done, OperationResult::Completed { result: () });
        assert_eq!(*attempts.borrow(), [1, 1]);
        assert_eq!(attempt_of("queued"), 1);
        // A repeated registration claims nothing.
        ops.start("job", "eager", &()).await.unwrap();
        assert_eq!(attempt_of("eager"), 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_completion_in_a_due_pass_claims_the_next_due_record_in_its_own_commit() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::builder(h.context())
            .alarm_concurrency(1)
            .build()
            .unwrap();
        h.install(&scheduler);
        let gate = Gate::default();
        let held = gate.clone();
        // What the storage held right after each completion committed.
        let seen = Rc::new(RefCell::new(Vec::<(String, i64)>::new()));
        let (log, reader) = (Rc::clone(&seen), Rc::clone(&ctx));
        let hook: durability::lifecycle::LifecycleHook = Rc::new(move |event: &LifecycleEvent| {
            if let LifecycleEvent::AttemptSettled {
                entity: durability::lifecycle::Entity::Operation { id, .. },
                outcome: Outcome::Completed { .. },
                ..
            } = event
            {
                let claimed_after = query_i64(
                    &*reader,
                    "SELECT COUNT(*) FROM durability_calls WHERE status = 'pending' AND attempt = 1",
                    &[],
                );
                log.borrow_mut().push((id.clone(), claimed_after));
            }
            None
        });
        let ops = Operations::builder(&scheduler)
            .handler("job", move |call: DurableCall<()>| {
                let held = held.clone();
                async move {
                    if call.id == "first" {
                        held.wait().await;
                    }
                    Ok::<_, HandlerError>(())
                }
            })
            .on_lifecycle_event(hook)
            .build()
            .unwrap();
        // "first" takes the only permit; the others wait for a due pass.
        for id in ["first", "b", "c", "d"] {
            ops.start("job", id, &()).await.unwrap();
        }
        gate.open();
        for id in ["b", "c", "d"] {
            let done = ops.wait::<()>("job", id, LONG_WAIT).await.unwrap();
            assert_eq!(done, OperationResult::Completed { result: () });
        }
        let seen = seen.borrow().clone();
        // b's completion claimed c, c's claimed d, in the same commit: the
        // next record's attempt was counted when the hook ran.
        let after = |id: &str| seen.iter().find(|(done, _)| done == id).map(|(_, n)| *n);
        assert_eq!(after("b"), Some(1));
        assert_eq!(after("c"), Some(1));
        assert_eq!(after("d"), Some(0));
        // No attempt was spent twice.
        assert_eq!(
            query_i64(&*ctx, "SELECT MAX(attempt) FROM durability_calls", &[]),
            1
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_due_pass_never_claims_again_an_attempt_claimed_ahead_of_its_execution() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let ops = Operations::builder(&scheduler)
            .handler("job", |_: DurableCall<()>| async {
                Ok::<_, HandlerError>(())
            })
            .build()
            .unwrap();
        // The due pass is queued first; the registration then claims the
        // first attempt for its eager start, which runs after the pass has
        // read the row: the pass must leave it to the eager start.
        let (pass, registered) =
            futures::join!(scheduler.alarm(None), ops.start("job", "raced", &()));
        pass.unwrap();
        registered.unwrap();
        let done = ops.wait::<()>("job", "raced", LONG_WAIT).await.unwrap();
        assert_eq!(done, OperationResult::Completed { result: () });
        assert_eq!(
            query_i64(
                &*ctx,
                "SELECT attempt FROM durability_calls WHERE id = ?",
                &params!["raced"]
            ),
            1,
            "an attempt was spent twice"
        );
    })
    .await;
}

// §7.9 (6)
#[tokio::test(start_paused = true)]
async fn non_serializable_result_fails_after_exactly_one_attempt() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let runs = Rc::new(Cell::new(0_u32));
        let counted = Rc::clone(&runs);
        let ops = Operations::builder(&scheduler)
            .handler("measure", move |_: DurableCall<()>| {
                counted.set(counted.get() + 1);
                async { Ok::<_, HandlerError>(vec![1.0, f64::NAN]) }
            })
            .max_attempts(5)
            .build()
            .unwrap();
        ops.start("measure", "a", &()).await.unwrap();
        let result = ops
            .wait::<Vec<f64>>("measure", "a", LONG_WAIT)
            .await
            .unwrap();
        assert_eq!(
            result,
            OperationResult::Failed {
                attempt: 1,
                error: SerializedError::new(
                    "DurableResultSerializationError",
                    "Result for durable operation \"measure\" is not JSON-serializable"
                )
            }
        );
        tokio::time::sleep(LONG_WAIT).await;
        assert_eq!(runs.get(), 1, "the handler must not run again");
    })
    .await;
}

// §7.9 (7)
#[tokio::test(start_paused = true)]
async fn stored_operation_without_handler_fails_on_first_claim() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        // A row stored by a deployment that still had the "retired" handler.
        let earlier = Operations::builder(&scheduler)
            .handler("retired", |_: DurableCall<()>| async {
                Ok::<_, HandlerError>(())
            })
            .build()
            .unwrap();
        drop(earlier);
        ctx.storage()
            .execute(
                "INSERT INTO durability_calls (id, operation, payload, status, attempt, \
                 next_attempt_at, generation_id, created_at) \
                 VALUES ('a', 'retired', '{\"kind\":\"value\",\"value\":null}', 'pending', 0, ?, 'g1', ?)",
                &params![START_MS, START_MS],
            )
            .unwrap();
        let events = Events::default();
        let ops = Operations::builder(&scheduler)
            .handler("current", |_: DurableCall<()>| async {
                Ok::<_, HandlerError>(())
            })
            .max_attempts(5)
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        scheduler.alarm(None).await.unwrap();
        let result = ops.wait::<()>("retired", "a", LONG_WAIT).await.unwrap();
        assert_eq!(
            result,
            OperationResult::Failed {
                attempt: 1,
                error: SerializedError::new(
                    "NonRetryableError",
                    "No handler registered for operation \"retired\""
                )
            }
        );
        assert_eq!(events.trace("a"), ["attempt_started 1", "attempt_settled:failed 1"]);

        // Registering a name this helper has no handler for is refused and
        // stores nothing: a typo never becomes a row that can only fail.
        let refused = ops.start("typo", "b", &()).await;
        assert!(matches!(
            refused,
            Err(durability::DurabilityError::UnknownHandler { kind: "operation", .. })
        ));
        let result = ops.result::<()>("typo", "b").unwrap();
        assert_eq!(result, OperationResult::NotFound);
    })
    .await;
}

// §7.9 (8)
#[tokio::test(start_paused = true)]
async fn completed_and_failed_rows_stay_deduplicated_until_purged() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let runs = Rc::new(Cell::new(0_u32));
        let counted = Rc::clone(&runs);
        let ops = Operations::builder(&scheduler)
            .handler("op", move |call: DurableCall<bool>| {
                counted.set(counted.get() + 1);
                async move {
                    if call.payload {
                        Ok(call.attempt)
                    } else {
                        Err(HandlerError::non_retryable("no"))
                    }
                }
            })
            .build()
            .unwrap();
        ops.start("op", "ok", &true).await.unwrap();
        ops.start("op", "bad", &false).await.unwrap();
        settle().await;
        assert_eq!(runs.get(), 2);

        // A month later both ids are still taken.
        tokio::time::sleep(Duration::from_secs(30 * 86_400)).await;
        assert_eq!(status_of(&*ctx, "ok").as_deref(), Some("completed"));
        assert_eq!(status_of(&*ctx, "bad").as_deref(), Some("failed"));
        for (id, payload) in [("ok", true), ("bad", false)] {
            assert_eq!(
                ops.start("op", id, &payload).await.unwrap(),
                Registration::Existing
            );
        }
        settle().await;
        assert_eq!(runs.get(), 2);

        // Purged, the ids are free again and run as new registrations.
        let now = scheduler.now_ms();
        assert_eq!(ops.purge_before(now).await.unwrap(), 2);
        assert_eq!(calls(&*ctx), 0);
        assert_eq!(
            ops.start("op", "ok", &true).await.unwrap(),
            Registration::Created
        );
        settle().await;
        assert_eq!(runs.get(), 3);
    })
    .await;
}

// §7.9 (9)
#[tokio::test(start_paused = true)]
async fn get_result_never_mutates() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let events = Events::default();
        let gate = Gate::default();
        let held = gate.clone();
        let ops = Operations::builder(&scheduler)
            .handler("op", move |call: DurableCall<u8>| {
                let held = held.clone();
                async move {
                    match call.payload {
                        0 => Ok(7_u8),
                        1 => Err(HandlerError::non_retryable("no")),
                        2 => Err(HandlerError::new("later")),
                        _ => {
                            held.wait().await;
                            Ok(0)
                        }
                    }
                }
            })
            .retry_delay(Delay::Fixed { ms: 60_000.0 })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        for (id, payload) in [
            ("done", 0_u8),
            ("failed", 1),
            ("retrying", 2),
            ("running", 3),
        ] {
            ops.start("op", id, &payload).await.unwrap();
        }
        settle().await;
        let rows = table_snapshot(&*ctx, "durability_calls");
        let alarm = physical_alarm(&*ctx).await;
        let emitted = events.all().len();

        assert_eq!(
            ops.result::<u8>("op", "done").unwrap(),
            OperationResult::Completed { result: 7 }
        );
        assert!(matches!(
            ops.result::<u8>("op", "failed").unwrap(),
            OperationResult::Failed { attempt: 1, .. }
        ));
        assert!(matches!(
            ops.result::<u8>("op", "retrying").unwrap(),
            OperationResult::Pending {
                attempt: 1,
                last_error: Some(_),
                ..
            }
        ));
        assert!(matches!(
            ops.result::<u8>("op", "running").unwrap(),
            OperationResult::Pending { attempt: 1, .. }
        ));
        assert_eq!(
            ops.result::<u8>("op", "missing").unwrap(),
            OperationResult::NotFound
        );
        assert!(ops.result::<u8>("other", "done").is_err());
        // A wait with a zero timeout is a read too.
        assert!(matches!(
            ops.wait::<u8>("op", "running", Duration::ZERO)
                .await
                .unwrap(),
            OperationResult::Pending { .. }
        ));
        // A result read as the wrong type is an error, not a repair.
        assert!(ops.result::<String>("op", "done").is_err());

        assert_eq!(table_snapshot(&*ctx, "durability_calls"), rows);
        assert_eq!(physical_alarm(&*ctx).await, alarm);
        assert_eq!(events.all().len(), emitted);
        gate.open();
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn default_retries_reach_max_attempts_then_fail_with_the_handlers_own_error() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let events = Events::default();
        let runs = Rc::new(Cell::new(0_u32));
        let counted = Rc::clone(&runs);
        let ops = Operations::builder(&scheduler)
            .handler("flaky", move |call: DurableCall<()>| {
                counted.set(counted.get() + 1);
                async move {
                    Err::<(), _>(HandlerError::named(
                        "Unavailable",
                        format!("attempt {} failed", call.attempt),
                    ))
                }
            })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        ops.start("flaky", "a", &()).await.unwrap();
        let result = ops.wait::<()>("flaky", "a", LONG_WAIT).await.unwrap();
        assert_eq!(
            result,
            OperationResult::Failed {
                attempt: 5,
                error: SerializedError::new("Unavailable", "attempt 5 failed")
            }
        );
        assert_eq!(runs.get(), 5);
        // The default delay after failed attempt n is jittered exponential
        // backoff: in [500 * 2^(n-1), 1000 * 2^(n-1)) ms.
        let delays: Vec<(u32, i64)> = events
            .all()
            .iter()
            .filter_map(|event| match event {
                LifecycleEvent::AttemptSettled {
                    attempt,
                    timestamp,
                    outcome:
                        Outcome::RetryScheduled {
                            next_attempt_at, ..
                        },
                    ..
                } => Some((*attempt, next_attempt_at - timestamp)),
                _ => None,
            })
            .collect();
        assert_eq!(delays.len(), 4);
        for (attempt, delay) in delays {
            let base = 1_000_i64 << (attempt - 1);
            assert!(
                (base / 2..=base).contains(&delay),
                "delay {delay} after attempt {attempt}"
            );
        }
        assert_eq!(
            events.trace("a").last().map(String::as_str),
            Some("attempt_settled:failed 5")
        );
        tokio::time::sleep(LONG_WAIT).await;
        assert_eq!(runs.get(), 5);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_timeout_aborts_the_signal_and_follows_the_retry_policy() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let events = Events::default();
        let reasons = Rc::new(RefCell::new(Vec::new()));
        let seen = Rc::clone(&reasons);
        let ops = Operations::builder(&scheduler)
            .handler("slow", move |call: DurableCall<()>| {
                let seen = Rc::clone(&seen);
                async move {
                    if call.attempt == 1 {
                        // Stops as soon as the attempt is abandoned.
                        call.signal.aborted().await;
                        seen.borrow_mut().push(call.signal.reason());
                        return Err(HandlerError::new("stopped"));
                    }
                    Ok(call.attempt)
                }
            })
            .attempt_timeout(Duration::from_millis(1_500))
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        ops.start("slow", "a", &()).await.unwrap();
        let result = ops.wait::<u32>("slow", "a", LONG_WAIT).await.unwrap();
        assert_eq!(result, OperationResult::Completed { result: 2 });
        let timeout = SerializedError::new(
            "DurableAttemptTimeoutError",
            "Durable operation \"slow\" timed out after 1500ms",
        );
        assert_eq!(
            reasons
                .borrow()
                .iter()
                .map(|r| r.as_ref().map(HandlerError::serialize))
                .collect::<Vec<_>>(),
            [Some(timeout.clone())]
        );
        // The timeout, not the handler's late "stopped", is the persisted
        // failure, and it was retried like any other failure.
        let retried = events.all().into_iter().find_map(|event| match event {
            LifecycleEvent::AttemptSettled {
                attempt: 1,
                duration_ms,
                outcome: Outcome::RetryScheduled { error, .. },
                ..
            } => Some((duration_ms, error)),
            _ => None,
        });
        assert_eq!(retried, Some((1_500, timeout)));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_non_retryable_error_is_terminal() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let runs = Rc::new(Cell::new(0_u32));
        let counted = Rc::clone(&runs);
        let ops = Operations::builder(&scheduler)
            .handler("op", move |call: DurableCall<u8>| {
                counted.set(counted.get() + 1);
                async move {
                    Err::<(), _>(match call.payload {
                        0 => HandlerError::non_retryable("account closed"),
                        1 => HandlerError::named("Declined", "card expired").into_non_retryable(),
                        // Errors of other libraries are recognised by name (§4.2).
                        _ => HandlerError::named("NonRetryableError", "foreign"),
                    })
                }
            })
            .max_attempts(5)
            .build()
            .unwrap();
        for (id, payload) in [("a", 0_u8), ("b", 1), ("c", 2)] {
            ops.start("op", id, &payload).await.unwrap();
        }
        let mut errors = Vec::new();
        for id in ["a", "b", "c"] {
            match ops.wait::<()>("op", id, LONG_WAIT).await.unwrap() {
                OperationResult::Failed { attempt: 1, error } => errors.push(error),
                other => panic!("{id}: {other:?}"),
            }
        }
        assert_eq!(
            errors,
            [
                SerializedError::new("NonRetryableError", "account closed"),
                SerializedError::new("Declined", "card expired"),
                SerializedError::new("NonRetryableError", "foreign"),
            ]
        );
        tokio::time::sleep(LONG_WAIT).await;
        assert_eq!(runs.get(), 3);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn purge_before_deletes_wakes_waiters_and_a_late_settlement_cannot_overwrite_a_re_registered_id()
 {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let events = Events::default();
        let gate = Gate::default();
        let reasons = Rc::new(RefCell::new(Vec::new()));
        let (held, seen) = (gate.clone(), Rc::clone(&reasons));
        let ops = Operations::builder(&scheduler)
            .handler("op", move |call: DurableCall<String>| {
                let (held, seen) = (held.clone(), Rc::clone(&seen));
                async move {
                    if call.payload == "old" {
                        // Ignores the purge's abort and settles late.
                        call.signal.aborted().await;
                        seen.borrow_mut().push(call.signal.reason());
                        held.wait().await;
                    }
                    Ok::<_, HandlerError>(call.payload)
                }
            })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        ops.start("op", "a", "old").await.unwrap();
        ops.start("op", "kept", "new").await.unwrap();
        settle().await;
        let waiter = {
            let ops = ops.clone();
            tokio::task::spawn_local(async move { ops.wait::<String>("op", "a", LONG_WAIT).await })
        };
        settle().await;
        assert!(!waiter.is_finished());

        tokio::time::sleep(Duration::from_secs(10)).await;
        let cutoff = scheduler.now_ms();
        // "kept" was created before the cutoff too; a row created at the
        // cutoff itself survives.
        ops.start("op", "at-cutoff", "new").await.unwrap();
        settle().await;
        assert_eq!(ops.purge_before(cutoff).await.unwrap(), 2);
        assert_eq!(status_of(&*ctx, "a"), None);
        assert_eq!(status_of(&*ctx, "kept"), None);
        assert_eq!(status_of(&*ctx, "at-cutoff").as_deref(), Some("completed"));
        // The waiter woke at once with the purge, not at its timeout.
        let woke_at = scheduler.now_ms();
        let waited = waiter.await.unwrap().unwrap();
        assert_eq!(waited, OperationResult::NotFound);
        assert_eq!(scheduler.now_ms(), woke_at);
        settle().await;
        assert_eq!(
            reasons
                .borrow()
                .iter()
                .map(|r| r.as_ref().map(|r| r.message().to_owned()))
                .collect::<Vec<_>>(),
            [Some("Durable operation was purged".to_owned())]
        );

        // Registered again at once: a new generation that runs and completes
        // while the old handler still holds on.
        assert_eq!(
            ops.start("op", "a", "new").await.unwrap(),
            Registration::Created
        );
        let result = ops.wait::<String>("op", "a", LONG_WAIT).await.unwrap();
        assert_eq!(
            result,
            OperationResult::Completed {
                result: "new".into()
            }
        );
        let rows = table_snapshot(&*ctx, "durability_calls");
        let emitted = events.all().len();
        // The old handler settles now: its compare-and-set misses.
        gate.open();
        settle().await;
        assert_eq!(table_snapshot(&*ctx, "durability_calls"), rows);
        assert_eq!(events.all().len(), emitted);
        assert_eq!(
            ops.result::<String>("op", "a").unwrap(),
            OperationResult::Completed {
                result: "new".into()
            }
        );
        assert!(events.all().iter().any(|event| matches!(
            event,
            LifecycleEvent::Purged { count: 2, before, .. } if *before == cutoff
        )));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn lifecycle_events_follow_the_reference_sequence() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let events = Events::default();
        let ops = Operations::builder(&scheduler)
            .handler("op", |call: DurableCall<()>| async move {
                if call.attempt == 1 {
                    Err(HandlerError::new("once"))
                } else {
                    Ok(call.attempt)
                }
            })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        ops.start("op", "a", &()).await.unwrap();
        ops.wait::<u32>("op", "a", LONG_WAIT).await.unwrap();
        let now = scheduler.now_ms();
        ops.purge_before(now + 1).await.unwrap();
        assert_eq!(
            events.trace("a"),
            [
                "registered",
                "attempt_started 1",
                "attempt_settled:retry_scheduled 1",
                "attempt_started 2",
                "attempt_settled:completed 2",
                "purged",
            ]
        );
        // Every event of the record names the one generation it is about.
        let generations: std::collections::HashSet<String> = events
            .all()
            .iter()
            .filter_map(|event| event.entity().map(|e| e.generation().to_owned()))
            .collect();
        assert_eq!(generations.len(), 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_crash_exhausted_row_yields_terminal_without_invoking_the_handler() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        // One permit, held by a blocker, so the row is not claimed at
        // registration and the test can play "the process died during the
        // last attempt" before the first claim.
        let scheduler = Scheduler::builder(h.context())
            .alarm_concurrency(1)
            .build()
            .unwrap();
        h.install(&scheduler);
        let events = Events::default();
        let gate = Gate::default();
        let runs = Rc::new(RefCell::new(Vec::new()));
        let (held, log) = (gate.clone(), Rc::clone(&runs));
        let ops = Operations::builder(&scheduler)
            .handler("op", move |call: DurableCall<()>| {
                log.borrow_mut().push(call.id.clone());
                let held = held.clone();
                async move {
                    held.wait().await;
                    Ok::<_, HandlerError>(())
                }
            })
            .max_attempts(3)
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        ops.start("op", "blocker", &()).await.unwrap();
        settle().await;
        ops.start("op", "crashed", &()).await.unwrap();
        ctx.storage()
            .execute(
                "UPDATE durability_calls SET attempt = 3 WHERE id = 'crashed'",
                &[],
            )
            .unwrap();
        gate.open();
        let result = ops.wait::<()>("op", "crashed", LONG_WAIT).await.unwrap();
        let exhausted = SerializedError::new(
            "DurableAttemptsExhaustedError",
            "Durable operation \"op\" exhausted its 3 attempts",
        );
        assert_eq!(
            result,
            OperationResult::Failed {
                attempt: 3,
                error: exhausted.clone()
            }
        );
        assert_eq!(*runs.borrow(), ["blocker"]);
        assert_eq!(events.trace("crashed"), ["registered", "terminal 3"]);
        assert!(events.all().iter().any(|event| matches!(
            event,
            LifecycleEvent::Terminal {
                reason: TerminalReason::AttemptsExhausted,
                error,
                ..
            } if *error == exhausted
        )));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_payload_that_fails_to_serialize_is_a_typed_error_and_stores_nothing() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let events = Events::default();
        let ops = Operations::builder(&scheduler)
            .handler("op", |_: DurableCall<Vec<f64>>| async {
                Ok::<_, HandlerError>(())
            })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        let error = ops
            .start("op", "a", &vec![1.0, f64::NAN])
            .await
            .unwrap_err();
        assert!(
            matches!(
                &error,
                DurabilityError::Codec(CodecError::NonFinite { path, .. }) if path == "$[1]"
            ),
            "{error:?}"
        );
        assert_eq!(calls(&*ctx), 0);
        assert_eq!(physical_alarm(&*ctx).await, None);
        assert!(events.all().is_empty());
        assert_eq!(
            ops.result::<()>("op", "a").unwrap(),
            OperationResult::NotFound
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_stored_row_that_does_not_decode_is_a_decode_error_naming_table_and_key() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let retries = Rc::new(RefCell::new(Vec::new()));
        let seen = Rc::clone(&retries);
        let scheduler = Scheduler::builder(h.context())
            .on_alarm_retry(Rc::new(move |info: &AlarmRetryInfo| {
                seen.borrow_mut().push(info.clone());
                None
            }))
            .build()
            .unwrap();
        h.install(&scheduler);
        let ops = Operations::builder(&scheduler)
            .handler("op", |_: DurableCall<()>| async {
                Ok::<_, HandlerError>(5_u32)
            })
            .build()
            .unwrap();
        ops.start("op", "bad-result", &()).await.unwrap();
        ops.start("op", "bad-column", &()).await.unwrap();
        settle().await;
        let sql = ctx.storage();
        sql.execute(
            "UPDATE durability_calls SET result = 'not json' WHERE id = 'bad-result'",
            &[],
        )
        .unwrap();
        sql.execute(
            "UPDATE durability_calls SET attempt = 'many' WHERE id = 'bad-column'",
            &[],
        )
        .unwrap();
        for id in ["bad-result", "bad-column"] {
            match ops.result::<u32>("op", id) {
                Err(DurabilityError::Decode { table, key, .. }) => {
                    assert_eq!((table, key.as_str()), ("durability_calls", id));
                }
                other => panic!("{id}: expected a decode error, got {other:?}"),
            }
        }
        // A due pending row that does not decode fails each run it is in,
        // never the object: other work of the run still completes, and the
        // run re-arms its own fallback alarm (retried every min delay, not
        // in a tight loop from the in-memory timer).
        sql.execute(
            "UPDATE durability_calls SET status = 'pending', attempt = 'many', \
             next_attempt_at = 0 WHERE id = 'bad-column'",
            &[],
        )
        .unwrap();
        ops.start("op", "fine", &()).await.unwrap();
        scheduler.alarm(None).await.unwrap();
        settle().await;
        assert_eq!(
            ops.result::<u32>("op", "fine").unwrap(),
            OperationResult::Completed { result: 5 }
        );
        let failed_at = scheduler.now_ms();
        assert_eq!(
            physical_alarm(&*ctx).await,
            Some(failed_at + MIN_DELAY_MS - 1)
        );
        let before = retries.borrow().len();
        tokio::time::sleep(Duration::from_millis(61_000)).await;
        let retries = retries.borrow();
        // One failed run per min delay: 60 s / 15 s.
        assert_eq!(retries.len() - before, 4);
        assert_eq!(retries[0].error.name, "DecodeError");
        assert!(retries[0].error.message.contains("bad-column"));
        assert!(retries[0].error.message.contains("durability_calls"));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn invalid_options_are_typed_config_errors() {
    support::on_harness(|h| async move {
        fn config_error(built: Result<Operations, DurabilityError>) -> ConfigError {
            match built {
                Err(DurabilityError::Config(error)) => error,
                Err(other) => panic!("expected a config error, got {other:?}"),
                Ok(_) => panic!("expected a config error, got a helper"),
            }
        }
        let scheduler = scheduler(&h);
        let noop = |_: DurableCall<()>| async { Ok::<_, HandlerError>(()) };
        let error = config_error(
            Operations::builder(&scheduler)
                .handler("op", noop)
                .max_attempts(0)
                .build(),
        );
        assert_eq!(
            error,
            ConfigError::NotPositive {
                field: "max_attempts".into()
            }
        );
        let error = config_error(
            Operations::builder(&scheduler)
                .handler("op", noop)
                .method("op", MethodPolicy::new().max_attempts(0))
                .build(),
        );
        assert_eq!(
            error,
            ConfigError::NotPositive {
                field: "method(\"op\").max_attempts".into()
            }
        );
        let error = config_error(
            Operations::builder(&scheduler)
                .handler("op", noop)
                .attempt_timeout(Duration::from_millis(2_147_483_648))
                .build(),
        );
        assert_eq!(
            error,
            ConfigError::AboveTimerLimit {
                field: "attempt_timeout".into(),
                value_ms: 2_147_483_648
            }
        );
        let error = config_error(
            Operations::builder(&scheduler)
                .handler("op", noop)
                .attempt_timeout(Duration::ZERO)
                .build(),
        );
        assert!(matches!(error, ConfigError::NotPositive { field } if field == "attempt_timeout"));
        let error = config_error(
            Operations::builder(&scheduler)
                .handler("op", noop)
                .retry_delay(Delay::Fixed { ms: f64::NAN })
                .build(),
        );
        assert!(
            matches!(error, ConfigError::InvalidDelay { .. }),
            "{error:?}"
        );
        // The largest timer is accepted.
        Operations::builder(&scheduler)
            .handler("op", noop)
            .attempt_timeout(Duration::from_millis(2_147_483_647))
            .build()
            .unwrap();

        let scheduler_error = |builder: durability::SchedulerBuilder| match builder.build() {
            Err(error) => error,
            Ok(_) => panic!("expected a config error"),
        };
        assert_eq!(
            scheduler_error(Scheduler::builder(h.context()).alarm_concurrency(0)),
            ConfigError::NotPositive {
                field: "alarm_concurrency".into()
            }
        );
        for delay_ms in [0, 999, 15_001, 60_000] {
            let error = scheduler_error(
                Scheduler::builder(h.context()).alarm_min_delay(Duration::from_millis(delay_ms)),
            );
            assert!(
                matches!(
                    error,
                    ConfigError::DurationOutOfRange {
                        min_ms: 1_000,
                        max_ms: 15_000,
                        ..
                    }
                ),
                "{delay_ms}: {error:?}"
            );
        }
        for delay_ms in [1_000, 15_000] {
            Scheduler::builder(h.context())
                .alarm_min_delay(Duration::from_millis(delay_ms))
                .build()
                .unwrap();
        }
        assert!(matches!(
            scheduler_error(
                Scheduler::builder(h.context()).alarm_handoff(Duration::from_millis(2_147_483_648))
            ),
            ConfigError::AboveTimerLimit { .. }
        ));
        // The failed constructions left no pending work behind.
        assert_eq!(physical_alarm(&*h.context()).await, None);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_retry_delay_that_misbehaves_is_a_terminal_retry_policy_error() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let always_fail = |_: DurableCall<()>| async { Err::<(), _>(HandlerError::new("boom")) };
        let ops = Operations::builder(&scheduler)
            .handler("nan", always_fail)
            .handler("negative", always_fail)
            .handler("throws", always_fail)
            .handler("huge", always_fail)
            .method(
                "nan",
                MethodPolicy::new().delay(Delay::custom(|_, _| Ok(f64::NAN))),
            )
            .method(
                "negative",
                MethodPolicy::new().delay(Delay::custom(|_, _| Ok(-1.0))),
            )
            .method(
                "throws",
                MethodPolicy::new().delay(Delay::custom(|_, _| Err(HandlerError::new("no delay")))),
            )
            .method(
                "huge",
                MethodPolicy::new().delay(Delay::custom(|_, _| Ok(1e300))),
            )
            .max_attempts(5)
            .build()
            .unwrap();
        for op in ["nan", "negative", "throws", "huge"] {
            ops.start(op, op, &()).await.unwrap();
        }
        for op in ["nan", "negative", "throws", "huge"] {
            let result = ops.wait::<()>(op, op, LONG_WAIT).await.unwrap();
            assert_eq!(
                result,
                OperationResult::Failed {
                    attempt: 1,
                    error: SerializedError::new(
                        "DurableRetryPolicyError",
                        format!(
                            "Retry policy for operation \"{op}\" must produce a non-negative \
                             safe-integer timestamp"
                        )
                    )
                },
                "{op}"
            );
        }
    })
    .await;
}

// Issue 10, defects 2 and 3: a payload the decoder could not read back is
// refused at start, whatever its depth, without deep recursion.
#[tokio::test(start_paused = true)]
async fn a_payload_nested_deeper_than_the_decoder_reads_is_refused_and_stores_nothing() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let ops = Operations::builder(&scheduler)
            .handler("op", |_: DurableCall<serde_json::Value>| async {
                Ok::<_, HandlerError>(())
            })
            .build()
            .unwrap();
        // 127 levels: serde_json writes it, and could not read it back
        // inside the stored envelope. 10,000 levels used to overflow the
        // stack and abort the process.
        for depth in [127, 10_000] {
            let payload = support::nested_json(depth);
            let error = ops.start("op", "deep", &payload).await.unwrap_err();
            support::dismantle_json(payload);
            assert!(matches!(error, DurabilityError::Codec(_)), "{error:?}");
            assert!(
                error
                    .to_string()
                    .contains("deeper than the limit of 100 levels"),
                "{error}"
            );
        }
        assert_eq!(calls(&*ctx), 0);
        assert_eq!(physical_alarm(&*ctx).await, None);
        // The deepest accepted payload runs its handler.
        let payload = support::nested_json(100);
        ops.start("op", "ok", &payload).await.unwrap();
        support::dismantle_json(payload);
        settle().await;
        assert_eq!(status_of(&*ctx, "ok").as_deref(), Some("completed"));
    })
    .await;
}

// Issue 10, defect 8: the id limits of every capability, and a payload
// limit counted on the payload's own JSON.
#[tokio::test(start_paused = true)]
async fn an_empty_or_overlong_id_and_an_oversized_payload_are_refused_and_store_nothing() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let ops = Operations::builder(&scheduler)
            .handler("op", |_: DurableCall<String>| async {
                Ok::<_, HandlerError>(())
            })
            .build()
            .unwrap();
        let error = ops.start("op", "", &"x").await.unwrap_err();
        assert_eq!(error.to_string(), "id must not be empty");
        let error = ops.start("op", &"i".repeat(1025), &"x").await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "id is 1025 bytes, above the limit of 1024 (MAX_ID_BYTES)"
        );
        // 1 MiB of JSON by default: a string of 2^20 - 2 characters and its
        // two quotes fit; one character more does not.
        let fits = "p".repeat((1 << 20) - 2);
        let over = "p".repeat((1 << 20) - 1);
        let error = ops.start("op", "big", &over).await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "payload is 1048577 bytes, above the limit of 1048576 (max_payload_bytes)"
        );
        assert_eq!(calls(&*ctx), 0);
        ops.start("op", &"i".repeat(1024), &fits).await.unwrap();
        assert_eq!(calls(&*ctx), 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn max_payload_bytes_is_configurable_and_bounded_at_build() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let builder = || {
            Operations::builder(&scheduler).handler("op", |_: DurableCall<String>| async {
                Ok::<_, HandlerError>(())
            })
        };
        for (bytes, expected) in [
            (0, "max_payload_bytes must be a positive integer"),
            (
                (32 << 20) + 1,
                "max_payload_bytes must be between 1 and 33554432",
            ),
        ] {
            let error = builder().max_payload_bytes(bytes).build().err().unwrap();
            assert_eq!(error.to_string(), expected);
        }
        let error = builder()
            .handler(&"h".repeat(1025), |_: DurableCall<()>| async {
                Ok::<_, HandlerError>(())
            })
            .build()
            .err()
            .unwrap();
        assert_eq!(
            error.to_string(),
            "handler name is 1025 bytes, above the limit of 1024 (MAX_ID_BYTES)"
        );
        let ops = builder().max_payload_bytes(7).build().unwrap();
        ops.start("op", "fits", "hello").await.unwrap();
        let error = ops.start("op", "over", "hello!").await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "payload is 8 bytes, above the limit of 7 (max_payload_bytes)"
        );
    })
    .await;
}

// Issue 10, defect 8: results and memo values are bodies too, under the
// same `max_payload_bytes` as payloads; they had no limit at all.
#[tokio::test(start_paused = true)]
async fn results_and_memo_values_obey_max_payload_bytes() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let ops = Operations::builder(&scheduler)
            .handler("big_result", |_: DurableCall<()>| async {
                Ok::<_, HandlerError>("r".repeat(100))
            })
            .handler("small_result", |_: DurableCall<()>| async {
                Ok::<_, HandlerError>("r".repeat(60))
            })
            .handler("big_memo", |call: DurableCall<()>| async move {
                let value = call
                    .memo
                    .memoize("m", async { Ok::<_, HandlerError>("m".repeat(100)) })
                    .await?;
                Ok::<_, HandlerError>(value.len())
            })
            .max_attempts(1)
            .max_payload_bytes(64)
            .build()
            .unwrap();
        for (operation, id) in [("big_result", "a"), ("small_result", "b"), ("big_memo", "c")] {
            ops.start(operation, id, &()).await.unwrap();
        }
        let big = ops
            .wait::<String>("big_result", "a", LONG_WAIT)
            .await
            .unwrap();
        assert!(
            matches!(&big, OperationResult::Failed { error, .. } if error.name == "DurableResultSerializationError"),
            "{big:?}"
        );
        assert_eq!(
            query_i64(
                &*ctx,
                "SELECT COUNT(*) FROM durability_calls WHERE result IS NOT NULL AND id = 'a'",
                &[]
            ),
            0,
            "nothing of the result is stored"
        );
        let small = ops
            .wait::<String>("small_result", "b", LONG_WAIT)
            .await
            .unwrap();
        assert_eq!(small, OperationResult::Completed { result: "r".repeat(60) });
        let memo = ops.wait::<usize>("big_memo", "c", LONG_WAIT).await.unwrap();
        match memo {
            OperationResult::Failed { error, .. } => assert!(
                error
                    .message
                    .contains("memo value is 102 bytes, above the limit of 64 (max_payload_bytes)"),
                "{error:?}"
            ),
            other => panic!("a memo value above the limit must fail the attempt: {other:?}"),
        }
        assert_eq!(
            query_i64(&*ctx, "SELECT COUNT(*) FROM durability_memos", &[]),
            0,
            "nothing of the memo is stored"
        );
    })
    .await;
}

/// The message of a builder's error, or `None` when it built.
fn build_error<T>(built: Result<T, impl std::fmt::Display>) -> Option<String> {
    built.err().map(|error| error.to_string())
}

// Issue 10, defect 6: a duration that is not whole milliseconds is refused
// by every setter that takes one, naming the setter.
#[tokio::test(start_paused = true)]
async fn durations_that_are_not_whole_milliseconds_are_refused_by_every_setter() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let odd = Duration::from_micros(1_500);
        let noop = |_: DurableCall<()>| async { Ok::<_, HandlerError>(()) };
        let rule = "attempt_timeout must be a whole number of milliseconds, got 1.5ms";
        let operations = Operations::builder(&scheduler)
            .handler("op", noop)
            .attempt_timeout(odd)
            .build();
        assert_eq!(build_error(operations).as_deref(), Some(rule));
        let alarms = durability::Alarms::builder(&scheduler)
            .handler("a", |_| async { Ok::<_, HandlerError>(()) })
            .attempt_timeout(odd)
            .build();
        assert_eq!(build_error(alarms).as_deref(), Some(rule));
        let consumer = || {
            durability::fanout::Target::consumer(
                |_: Vec<durability::fanout::FanoutMessage<String>>| async {
                    Ok::<_, HandlerError>(())
                },
            )
        };
        let fanout = durability::Fanout::<String>::builder(&scheduler)
            .target("t", consumer())
            .attempt_timeout(odd)
            .build();
        assert_eq!(build_error(fanout).as_deref(), Some(rule));
        let fanout = durability::Fanout::<String>::builder(&scheduler)
            .target("t", consumer())
            .batch_delay(odd)
            .build();
        assert_eq!(
            build_error(fanout).as_deref(),
            Some("batch_delay must be a whole number of milliseconds, got 1.5ms")
        );
        // Whole milliseconds still build, each on a scheduler of its own.
        Operations::builder(&Scheduler::new(h.context()).unwrap())
            .handler("op", noop)
            .attempt_timeout(Duration::from_micros(2_000))
            .build()
            .unwrap();
    })
    .await;
}

// Issue 10, defect 7: every setting is bounded at build with a typed error,
// never a panic later or a failure of the work at its first retry.
#[tokio::test(start_paused = true)]
async fn every_setting_is_bounded_at_build_with_a_typed_error() {
    support::on_harness(|h| async move {
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Scheduler::builder(h.context())
                .alarm_concurrency(usize::MAX)
                .build()
                .err()
                .map(|error| error.to_string())
        }));
        assert_eq!(
            built.expect("no panic").as_deref(),
            Some("alarm_concurrency must be between 1 and 10000")
        );
        let scheduler = scheduler(&h);
        let noop = |_: DurableCall<()>| async { Ok::<_, HandlerError>(()) };
        let cases = [
            (
                Delay::Fixed { ms: 1e300 },
                "retry_delay.ms must be between 0 and 31536000000",
            ),
            (
                Delay::Exponential {
                    initial_ms: 1_000.0,
                    max_ms: 1e300,
                },
                "retry_delay.max_ms must be between 0 and 31536000000",
            ),
        ];
        for (delay, rule) in cases {
            let built = Operations::builder(&scheduler)
                .handler("op", noop)
                .retry_delay(delay)
                .build();
            assert_eq!(build_error(built).as_deref(), Some(rule));
        }
        let built = Operations::builder(&scheduler)
            .handler("op", noop)
            .method("op", MethodPolicy::new().delay(Delay::Fixed { ms: 1e300 }))
            .build();
        assert_eq!(
            build_error(built).as_deref(),
            Some("method(\"op\").delay.ms must be between 0 and 31536000000")
        );
    })
    .await;
}
