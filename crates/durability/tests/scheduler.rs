//! The engine invariants of core.md §6.15, one test each, on paused time
//! against a real inline host (real SQLite files).

mod support;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use durability::lifecycle::{LifecycleEvent, LifecycleHook, Outcome};
use durability::retry::{Delay, MethodPolicy};
use durability::{
    AlarmCall, AlarmRetryInfo, Alarms, ConfigError, DurableCall, HandlerError, OperationResult,
    Operations, Scheduler,
};
use durability_platform::{AlarmInfo, Context};

const MIN_DELAY_MS: i64 = 15_000;

/// (operation id, name of the abort reason when the handler looked).
type AbortSeen = (String, Option<String>);

async fn physical_alarm(ctx: &Rc<dyn Context>) -> Option<i64> {
    ctx.storage().get_alarm().await.expect("read the alarm")
}

fn events_hook(events: &Rc<RefCell<Vec<LifecycleEvent>>>) -> LifecycleHook {
    let events = Rc::clone(events);
    Rc::new(move |event: &LifecycleEvent| {
        events.borrow_mut().push(event.clone());
        None
    })
}

fn sleep_ms(ms: u64) -> tokio::time::Sleep {
    tokio::time::sleep(Duration::from_millis(ms))
}

#[tokio::test(start_paused = true)]
async fn pending_work_commits_in_the_same_transaction_as_the_alarm_reconcile() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        h.install(&scheduler);
        let ops = Operations::builder(&scheduler)
            .handler("a", |_: DurableCall<()>| {
                std::future::pending::<Result<(), HandlerError>>()
            })
            .handler("b", |_: DurableCall<()>| async {
                Ok::<_, HandlerError>(())
            })
            .build()
            .unwrap();
        assert_eq!(physical_alarm(&ctx).await, None);
        let now = scheduler.now_ms();
        ops.start("a", "x", &()).await.unwrap();
        // Registration returned: row and alarm are both there.
        assert_eq!(physical_alarm(&ctx).await, Some(now + MIN_DELAY_MS));
        // A registration that is rejected inside its transaction rolls back
        // the row and the reconcile together: the alarm is untouched.
        ctx.storage().delete_alarm().await.unwrap();
        let rejected = ops.start("b", "x", &()).await;
        assert!(rejected.is_err());
        assert_eq!(physical_alarm(&ctx).await, None);
        let rows = ctx
            .storage()
            .query("SELECT operation FROM durability_calls", &[])
            .unwrap();
        assert_eq!(rows.len(), 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn after_a_reconcile_the_alarm_lies_between_the_earliest_pending_time_and_the_min_delay() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        h.install(&scheduler);
        let alarms = Alarms::builder(&scheduler)
            .handler("far", |_: AlarmCall| async { Ok::<_, HandlerError>(()) })
            .handler("near", |_: AlarmCall| async { Ok::<_, HandlerError>(()) })
            .build()
            .unwrap();
        let now = scheduler.now_ms();
        // Far out: the alarm is exactly the due time.
        alarms.schedule("far", now + 60_000).await.unwrap();
        assert_eq!(physical_alarm(&ctx).await, Some(now + 60_000));
        // Nearer than the min delay: the alarm is pulled forward, but never
        // closer than now + min delay (the timer covers the gap).
        alarms.schedule("near", now + 2_000).await.unwrap();
        let at = physical_alarm(&ctx).await.unwrap();
        assert!(at >= now + 2_000 && at <= now + MIN_DELAY_MS, "alarm {at}");
        // Once no work is pending, no alarm is left.
        sleep_ms(61_000).await;
        let pending = ctx
            .storage()
            .query("SELECT name FROM durability_alarms", &[])
            .unwrap();
        assert!(pending.is_empty(), "both alarms ran");
        assert_eq!(physical_alarm(&ctx).await, None);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_engine_never_sets_the_alarm_closer_than_the_min_delay() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::builder(Rc::clone(&ctx))
            .alarm_min_delay(Duration::from_secs(3))
            .build()
            .unwrap();
        h.install(&scheduler);
        let alarms = Alarms::builder(&scheduler)
            .handler("now", |_: AlarmCall| {
                std::future::pending::<Result<(), HandlerError>>()
            })
            .build()
            .unwrap();
        let now = scheduler.now_ms();
        alarms.schedule("now", now - 10).await.unwrap();
        assert_eq!(physical_alarm(&ctx).await, Some(now + 3_000));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_superseded_timer_never_runs() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        h.install(&scheduler);
        let fired = Rc::new(RefCell::new(Vec::new()));
        let alarms = {
            let fired = Rc::clone(&fired);
            let clock = scheduler.clone();
            Alarms::builder(&scheduler)
                .handler("tick", move |call: AlarmCall| {
                    fired
                        .borrow_mut()
                        .push((clock.now_ms(), call.scheduled_time));
                    async { Ok::<_, HandlerError>(()) }
                })
                .build()
                .unwrap()
        };
        let now = scheduler.now_ms();
        alarms.schedule("tick", now + 5_000).await.unwrap();
        alarms.schedule("tick", now + 8_000).await.unwrap();
        sleep_ms(30_000).await;
        assert_eq!(*fired.borrow(), vec![(now + 8_000, now + 8_000)]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn without_live_timers_no_timer_serves_work_beyond_the_min_delay() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        h.install(&scheduler);
        let runs: Rc<RefCell<Vec<(String, bool)>>> = Rc::default();
        let alarms = {
            let runs = Rc::clone(&runs);
            Alarms::builder(&scheduler)
                .handler("near", {
                    let runs = Rc::clone(&runs);
                    move |call: AlarmCall| {
                        runs.borrow_mut().push((call.name, call.platform.is_some()));
                        async { Ok::<_, HandlerError>(()) }
                    }
                })
                .handler("far", move |call: AlarmCall| {
                    runs.borrow_mut().push((call.name, call.platform.is_some()));
                    async { Ok::<_, HandlerError>(()) }
                })
                .build()
                .unwrap()
        };
        let now = scheduler.now_ms();
        alarms.schedule("near", now + 5_000).await.unwrap();
        sleep_ms(6_000).await;
        alarms
            .schedule("far", scheduler.now_ms() + 20_000)
            .await
            .unwrap();
        sleep_ms(21_000).await;
        // The near one ran from the in-memory timer (no platform info), the
        // far one from the physical alarm.
        assert_eq!(
            *runs.borrow(),
            vec![("near".to_owned(), false), ("far".to_owned(), true)]
        );
        // Without the physical alarm, nothing in memory serves far work.
        alarms
            .schedule("far", scheduler.now_ms() + 20_000)
            .await
            .unwrap();
        ctx.storage().delete_alarm().await.unwrap();
        sleep_ms(25_000).await;
        assert_eq!(
            runs.borrow().len(),
            2,
            "no timer was armed beyond the min delay"
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn with_live_timers_work_beyond_the_min_delay_runs_from_memory_at_its_exact_time() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::builder(Rc::clone(&ctx))
            .live_timers(true)
            .build()
            .unwrap();
        h.install(&scheduler);
        let runs: Rc<RefCell<Vec<(i64, bool)>>> = Rc::default();
        let alarms = {
            let runs = Rc::clone(&runs);
            let clock = scheduler.clone();
            Alarms::builder(&scheduler)
                .handler("far", move |call: AlarmCall| {
                    runs.borrow_mut()
                        .push((clock.now_ms(), call.platform.is_some()));
                    async { Ok::<_, HandlerError>(()) }
                })
                .build()
                .unwrap()
        };
        let at = scheduler.now_ms() + 40_000;
        alarms.schedule("far", at).await.unwrap();
        // Take the physical alarm away: only the in-memory timer is left.
        ctx.storage().delete_alarm().await.unwrap();
        sleep_ms(41_000).await;
        assert_eq!(*runs.borrow(), vec![(at, false)]);
        // Beyond the longest timer only the physical alarm can serve.
        let beyond = scheduler.now_ms() + 2_147_483_648;
        alarms.schedule("far", beyond).await.unwrap();
        assert_eq!(physical_alarm(&ctx).await, Some(beyond));
        ctx.storage().delete_alarm().await.unwrap();
        tokio::time::advance(Duration::from_millis(2_147_483_649)).await;
        sleep_ms(10).await;
        assert_eq!(runs.borrow().len(), 1, "no timer was armed for it");
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn permits_in_use_never_exceed_the_concurrency_and_waiters_are_served_in_order() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::builder(Rc::clone(&ctx))
            .alarm_concurrency(2)
            .build()
            .unwrap();
        h.install(&scheduler);
        let running = Rc::new(Cell::new(0_u32));
        let most = Rc::new(Cell::new(0_u32));
        let order: Rc<RefCell<Vec<String>>> = Rc::default();
        let ops = {
            let (running, most, order) = (running.clone(), most.clone(), order.clone());
            Operations::builder(&scheduler)
                .handler("work", move |call: DurableCall<()>| {
                    let (running, most, order) = (running.clone(), most.clone(), order.clone());
                    async move {
                        order.borrow_mut().push(call.id.clone());
                        running.set(running.get() + 1);
                        most.set(most.get().max(running.get()));
                        sleep_ms(1_000).await;
                        running.set(running.get() - 1);
                        Ok::<_, HandlerError>(())
                    }
                })
                .build()
                .unwrap()
        };
        for id in ["1", "2", "3", "4", "5", "6"] {
            ops.start("work", id, &()).await.unwrap();
        }
        sleep_ms(10_000).await;
        assert_eq!(most.get(), 2);
        assert_eq!(*order.borrow(), vec!["1", "2", "3", "4", "5", "6"]);
        for id in ["1", "2", "3", "4", "5", "6"] {
            let result: OperationResult<()> = ops.result("work", id).unwrap();
            assert_eq!(result, OperationResult::Completed { result: () });
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_claimed_attempt_is_persisted_before_the_handler_runs() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        h.install(&scheduler);
        let seen: Rc<RefCell<Vec<(u32, u32)>>> = Rc::default();
        let ops = {
            let seen = Rc::clone(&seen);
            let ctx = Rc::clone(&ctx);
            Operations::builder(&scheduler)
                .max_attempts(3)
                .retry_delay(Delay::Fixed { ms: 100.0 })
                .handler("count", move |call: DurableCall<()>| {
                    let stored: u32 = ctx
                        .storage()
                        .query_row(
                            "SELECT attempt FROM durability_calls WHERE id = ?",
                            &[call.id.as_str().into()],
                        )
                        .unwrap()
                        .unwrap()
                        .get(0)
                        .unwrap();
                    seen.borrow_mut().push((call.attempt, stored));
                    async { Err::<(), _>(HandlerError::new("again")) }
                })
                .build()
                .unwrap()
        };
        ops.start("count", "c", &()).await.unwrap();
        sleep_ms(5_000).await;
        assert_eq!(*seen.borrow(), vec![(1, 1), (2, 2), (3, 3)]);
        let result: OperationResult<()> = ops.result("count", "c").unwrap();
        assert!(matches!(result, OperationResult::Failed { attempt: 3, .. }));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_stale_execution_never_changes_a_newer_record_and_emits_no_settlement() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        h.install(&scheduler);
        let events: Rc<RefCell<Vec<LifecycleEvent>>> = Rc::default();
        let ops = Operations::builder(&scheduler)
            .on_lifecycle_event(events_hook(&events))
            .handler("slow", |call: DurableCall<u32>| async move {
                // Ignores its abort signal on purpose.
                sleep_ms(5_000).await;
                Ok::<_, HandlerError>(call.payload)
            })
            .build()
            .unwrap();
        ops.start("slow", "x", &1_u32).await.unwrap();
        sleep_ms(100).await;
        // Purge the running generation and register the id again.
        let purged = ops.purge_before(scheduler.now_ms() + 1).await.unwrap();
        assert_eq!(purged, 1);
        sleep_ms(1).await;
        ops.start("slow", "x", &2_u32).await.unwrap();
        sleep_ms(20_000).await;
        let result: OperationResult<u32> = ops.result("slow", "x").unwrap();
        assert_eq!(result, OperationResult::Completed { result: 2 });
        let settled: Vec<String> = events
            .borrow()
            .iter()
            .filter_map(|event| match event {
                LifecycleEvent::AttemptSettled { entity, .. } => {
                    Some(entity.generation().to_owned())
                }
                _ => None,
            })
            .collect();
        // Only the new generation settled.
        assert_eq!(settled.len(), 1, "{settled:?}");
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_permit_is_held_until_the_outcome_is_persisted_and_the_handler_really_ended() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::builder(Rc::clone(&ctx))
            .alarm_concurrency(1)
            .build()
            .unwrap();
        h.install(&scheduler);
        let started: Rc<RefCell<Vec<(String, i64)>>> = Rc::default();
        let ops = {
            let started = Rc::clone(&started);
            let clock = scheduler.clone();
            Operations::builder(&scheduler)
                .attempt_timeout(Duration::from_secs(1))
                .handler("stubborn", move |call: DurableCall<()>| {
                    started.borrow_mut().push((call.id.clone(), clock.now_ms()));
                    async move {
                        if call.id == "a" && call.attempt == 1 {
                            // Ignores the abort and runs long past its timeout.
                            sleep_ms(10_000).await;
                        }
                        Ok::<_, HandlerError>(())
                    }
                })
                .build()
                .unwrap()
        };
        let t0 = scheduler.now_ms();
        ops.start("stubborn", "a", &()).await.unwrap();
        ops.start("stubborn", "b", &()).await.unwrap();
        sleep_ms(2_000).await;
        // The timeout is persisted (a retry is pending) while the handler runs.
        let a: OperationResult<()> = ops.result("stubborn", "a").unwrap();
        assert!(
            matches!(a, OperationResult::Pending { attempt: 1, .. }),
            "{a:?}"
        );
        assert_eq!(started.borrow().len(), 1, "b waits for the permit");
        sleep_ms(30_000).await;
        let starts = started.borrow().clone();
        let b_start = starts.iter().find(|(id, _)| id == "b").map(|(_, at)| *at);
        assert!(b_start >= Some(t0 + 10_000), "b started at {b_start:?}");
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_signal_aborts_at_timeout_or_purge_and_never_otherwise() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        h.install(&scheduler);
        let reasons: Rc<RefCell<Vec<AbortSeen>>> = Rc::default();
        let ops = {
            let reasons = Rc::clone(&reasons);
            Operations::builder(&scheduler)
                .max_attempts(1)
                .attempt_timeout(Duration::from_secs(2))
                .handler("watch", move |call: DurableCall<u64>| {
                    let reasons = Rc::clone(&reasons);
                    async move {
                        sleep_ms(call.payload).await;
                        let reason = call.signal.reason().map(|r| r.name().to_owned());
                        reasons.borrow_mut().push((call.id.clone(), reason));
                        Ok::<_, HandlerError>(())
                    }
                })
                .build()
                .unwrap()
        };
        ops.start("watch", "quick", &100_u64).await.unwrap();
        ops.start("watch", "late", &3_000_u64).await.unwrap();
        sleep_ms(5_000).await;
        ops.start("watch", "purged", &1_000_u64).await.unwrap();
        sleep_ms(10).await;
        ops.purge_before(scheduler.now_ms()).await.unwrap();
        sleep_ms(5_000).await;
        let mut reasons = reasons.borrow().clone();
        reasons.sort();
        assert_eq!(
            reasons,
            vec![
                (
                    "late".to_owned(),
                    Some("DurableAttemptTimeoutError".to_owned())
                ),
                ("purged".to_owned(), Some("Error".to_owned())),
                ("quick".to_owned(), None),
            ]
        );
    })
    .await;
}

fn retry_hook(calls: &Rc<RefCell<Vec<AlarmRetryInfo>>>) -> durability::scheduler::AlarmRetryHook {
    let calls = Rc::clone(calls);
    Rc::new(move |info: &AlarmRetryInfo| {
        calls.borrow_mut().push(info.clone());
        None
    })
}

#[tokio::test(start_paused = true)]
async fn a_failed_run_arms_its_own_fallback_and_calls_on_alarm_retry_once() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let calls: Rc<RefCell<Vec<AlarmRetryInfo>>> = Rc::default();
        let scheduler = Scheduler::builder(Rc::clone(&ctx))
            .on_alarm_retry(retry_hook(&calls))
            .build()
            .unwrap();
        let alarms = Alarms::builder(&scheduler)
            .handler("x", |_: AlarmCall| async { Ok::<_, HandlerError>(()) })
            .build()
            .unwrap();
        h.keep(alarms);
        // Break the participant's table: its due query fails.
        ctx.storage()
            .execute_script("DROP TABLE durability_alarms")
            .unwrap();
        let now = scheduler.now_ms();
        let info = AlarmInfo {
            retry_count: 2,
            is_retry: true,
        };
        scheduler.alarm(Some(info)).await.unwrap();
        assert_eq!(physical_alarm(&ctx).await, Some(now + MIN_DELAY_MS));
        let calls = calls.borrow();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].retry_in_ms, 15_000);
        assert_eq!(calls[0].retry_count, Some(2));
        assert_eq!(calls[0].is_retry, Some(true));
        assert_eq!(calls[0].object_id.as_deref(), Some(ctx.id().as_str()));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn alarm_rejects_only_when_the_run_and_the_fallback_both_failed() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let calls: Rc<RefCell<Vec<AlarmRetryInfo>>> = Rc::default();
        let scheduler = Scheduler::builder(Rc::clone(&ctx))
            .on_alarm_retry(retry_hook(&calls))
            .build()
            .unwrap();
        let alarms = Alarms::builder(&scheduler)
            .handler("x", |_: AlarmCall| async { Ok::<_, HandlerError>(()) })
            .build()
            .unwrap();
        h.keep(alarms);
        ctx.storage()
            .execute_script("DROP TABLE durability_alarms; PRAGMA query_only = ON;")
            .unwrap();
        let result = scheduler.alarm(None).await;
        assert!(result.is_err(), "both the run and the fallback failed");
        assert!(
            calls.borrow().is_empty(),
            "the hook runs only after a fallback is armed"
        );
        ctx.storage()
            .execute_script("PRAGMA query_only = OFF;")
            .unwrap();
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn memos_survive_a_retry_and_are_deleted_with_the_completion() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        h.install(&scheduler);
        let side_effects = Rc::new(Cell::new(0_u32));
        let ops = {
            let side_effects = Rc::clone(&side_effects);
            Operations::builder(&scheduler)
                .retry_delay(Delay::Fixed { ms: 10.0 })
                .handler("pay", move |call: DurableCall<()>| {
                    let side_effects = Rc::clone(&side_effects);
                    async move {
                        let receipt: u32 = call
                            .memo
                            .memoize("charge", async {
                                side_effects.set(side_effects.get() + 1);
                                Ok::<_, HandlerError>(7)
                            })
                            .await
                            .map_err(HandlerError::from)?;
                        if call.attempt == 1 {
                            return Err(HandlerError::new("crash after the charge"));
                        }
                        Ok::<_, HandlerError>(receipt)
                    }
                })
                .build()
                .unwrap()
        };
        ops.start("pay", "order", &()).await.unwrap();
        sleep_ms(1_000).await;
        let result: OperationResult<u32> = ops.result("pay", "order").unwrap();
        assert_eq!(result, OperationResult::Completed { result: 7 });
        assert_eq!(side_effects.get(), 1, "the retry reused the memo");
        let memos = ctx
            .storage()
            .query("SELECT memo_key FROM durability_memos", &[])
            .unwrap();
        assert!(memos.is_empty(), "the completion deleted the memos");
    })
    .await;
}

fn memo_keys(ctx: &Rc<dyn Context>) -> Vec<String> {
    let mut keys: Vec<String> = ctx
        .storage()
        .query("SELECT record_key FROM durability_memos", &[])
        .unwrap()
        .iter()
        .map(|row| row.get(0).unwrap())
        .collect();
    keys.sort();
    keys
}

#[tokio::test(start_paused = true)]
async fn memos_are_deleted_with_a_terminal_failure_an_exhaustion_and_a_purge() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        h.install(&scheduler);
        let runs: Rc<RefCell<Vec<(String, u32)>>> = Rc::default();
        let ops = {
            let runs = Rc::clone(&runs);
            Operations::builder(&scheduler)
                .max_attempts(2)
                .retry_delay(Delay::Fixed { ms: 10_000.0 })
                .handler("charge", move |call: DurableCall<()>| {
                    runs.borrow_mut().push((call.id.clone(), call.attempt));
                    async move {
                        call.memo
                            .memoize("charge", async { Ok::<_, HandlerError>(1_u32) })
                            .await
                            .map_err(HandlerError::from)?;
                        Err::<(), _>(HandlerError::new("declined"))
                    }
                })
                .build()
                .unwrap()
        };
        let t0 = scheduler.now_ms();
        ops.start("charge", "purged", &()).await.unwrap();
        sleep_ms(1).await;
        ops.start("charge", "failed", &()).await.unwrap();
        ops.start("charge", "exhausted", &()).await.unwrap();
        sleep_ms(1_000).await;
        // A retry keeps the memos.
        assert_eq!(memo_keys(&ctx), ["exhausted", "failed", "purged"]);

        assert_eq!(ops.purge_before(t0 + 1).await.unwrap(), 1);
        assert_eq!(memo_keys(&ctx), ["exhausted", "failed"], "purge");

        // "The process died during the last attempt".
        ctx.storage()
            .execute(
                "UPDATE durability_calls SET attempt = 2 WHERE id = 'exhausted'",
                &[],
            )
            .unwrap();
        sleep_ms(11_000).await;
        let failed: OperationResult<()> = ops.result("charge", "failed").unwrap();
        assert!(matches!(failed, OperationResult::Failed { attempt: 2, .. }));
        let exhausted: OperationResult<()> = ops.result("charge", "exhausted").unwrap();
        match exhausted {
            OperationResult::Failed { error, .. } => {
                assert_eq!(error.name, "DurableAttemptsExhaustedError");
            }
            other => panic!("expected exhaustion, got {other:?}"),
        }
        let exhausted_runs = runs
            .borrow()
            .iter()
            .filter(|(id, _)| id == "exhausted")
            .count();
        assert_eq!(
            exhausted_runs, 1,
            "an exhausted record is not invoked again"
        );
        assert!(
            memo_keys(&ctx).is_empty(),
            "terminal failure and exhaustion"
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn watchers_are_notified_only_after_the_commit() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        h.install(&scheduler);
        let ops = Operations::builder(&scheduler)
            .handler("later", |_: DurableCall<()>| async {
                sleep_ms(3_000).await;
                Ok::<_, HandlerError>("done".to_owned())
            })
            .build()
            .unwrap();
        ops.start("later", "w", &()).await.unwrap();
        let waited: OperationResult<String> = ops
            .wait("later", "w", Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(
            waited,
            OperationResult::Completed {
                result: "done".into()
            }
        );
        // The waiter woke at the completion, not at its timeout, and what it
        // saw had already committed.
        let status: String = ctx
            .storage()
            .query_row("SELECT status FROM durability_calls WHERE id = 'w'", &[])
            .unwrap()
            .unwrap()
            .get(0)
            .unwrap();
        assert_eq!(status, "completed");
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_run_near_the_wall_time_limit_hands_off_to_a_new_alarm() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::builder(Rc::clone(&ctx))
            .alarm_handoff(Duration::from_secs(2))
            .build()
            .unwrap();
        let alarms = Alarms::builder(&scheduler)
            .handler("long", |_: AlarmCall| async {
                sleep_ms(10_000).await;
                Ok::<_, HandlerError>(())
            })
            .build()
            .unwrap();
        h.keep(alarms.clone());
        alarms.schedule("long", scheduler.now_ms()).await.unwrap();
        ctx.storage().delete_alarm().await.unwrap();
        let started = scheduler.now_ms();
        scheduler.alarm(None).await.unwrap();
        let returned = scheduler.now_ms();
        assert_eq!(returned - started, 2_000, "returned at the handoff");
        assert_eq!(physical_alarm(&ctx).await, Some(returned + MIN_DELAY_MS));
        // The work continues in memory and finishes.
        sleep_ms(9_000).await;
        let left = ctx
            .storage()
            .query("SELECT name FROM durability_alarms", &[])
            .unwrap();
        assert!(left.is_empty());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn invalid_scheduler_options_are_typed_errors() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let zero = Scheduler::builder(Rc::clone(&ctx))
            .alarm_concurrency(0)
            .build();
        assert!(matches!(zero, Err(ConfigError::NotPositive { .. })));
        for delay in [Duration::from_millis(999), Duration::from_millis(15_001)] {
            let out = Scheduler::builder(Rc::clone(&ctx))
                .alarm_min_delay(delay)
                .build();
            // Named by the setter; the rule and its units in the message.
            let Err(error) = out else {
                panic!("{delay:?} was accepted");
            };
            assert!(
                matches!(&error, ConfigError::DurationOutOfRange { field, .. } if field == "alarm_min_delay"),
                "{delay:?}"
            );
            assert_eq!(
                error.to_string(),
                "alarm_min_delay must be a whole number of milliseconds from 1000 ms to 15000 ms"
            );
        }
        let handoff = Scheduler::builder(Rc::clone(&ctx))
            .alarm_handoff(Duration::from_millis(2_147_483_648))
            .build();
        assert!(matches!(handoff, Err(ConfigError::AboveTimerLimit { .. })));
        let zero_handoff = Scheduler::builder(Rc::clone(&ctx))
            .alarm_handoff(Duration::ZERO)
            .build();
        assert!(matches!(zero_handoff, Err(ConfigError::NotPositive { .. })));
        // Issue 10 defect 6: 1.5 ms used to build as 1 ms (fuzz seed 11,
        // cases 590819 and 19113).
        let fractional_handoff = Scheduler::builder(Rc::clone(&ctx))
            .alarm_handoff(Duration::from_micros(1_500))
            .build();
        assert!(
            matches!(&fractional_handoff, Err(ConfigError::NotWholeMilliseconds { field, .. }) if field == "alarm_handoff"),
            "{fractional_handoff:?}"
        );
        // Two helpers of one kind on one scheduler would share a table.
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        let first = Alarms::builder(&scheduler).build().unwrap();
        let second = Alarms::builder(&scheduler).build();
        assert!(second.is_err());
        drop(first);
        let _ = MethodPolicy::new();
        let _ = Outcome::Completed { result: None };
    })
    .await;
}
