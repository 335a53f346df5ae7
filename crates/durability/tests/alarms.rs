//! Named alarms (core.md §8) on a real inline host: one test per invariant
//! of §8.7, then idempotency keys, replacements, timeouts, the in-memory
//! timer and bad input. Everything runs on paused tokio time on one object.

mod support;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use durability::alarms::IDEMPOTENCY_KEY_PREFIX;
use durability::error::{DurabilityError, HandlerError};
use durability::lifecycle::LifecycleEvent;
use durability::platform::{AlarmInfo, Context, MAX_SAFE_INTEGER, params};
use durability::retry::{Delay, MethodPolicy};
use durability::{
    AlarmCall, AlarmRetryInfo, Alarms, DurableCall, Operations, Scheduler, SerializedError,
};
use support::{Events, Gate, Harness, physical_alarm, query_i64};

/// The scheduler's default minimum distance of the physical alarm.
const MIN_DELAY_MS: i64 = 15_000;
const HOUR_MS: i64 = 3_600_000;

/// A scheduler with default options whose alarm the object delegates to.
fn scheduler(h: &Harness) -> Scheduler {
    let scheduler = Scheduler::new(h.context()).unwrap();
    h.install(&scheduler);
    scheduler
}

/// One `durability_alarms` row as stored.
#[derive(Debug, Clone, PartialEq)]
struct AlarmRow {
    generation: String,
    status: String,
    scheduled_at: i64,
    next_attempt_at: i64,
    attempt: i64,
    last_error: Option<String>,
    last_error_name: Option<String>,
    created_at: i64,
}

fn alarm_row(ctx: &dyn Context, name: &str) -> Option<AlarmRow> {
    ctx.storage()
        .query_row(
            "SELECT generation_id, status, scheduled_at, next_attempt_at, attempt, last_error, \
             last_error_name, created_at FROM durability_alarms WHERE name = ?",
            &params![name],
        )
        .unwrap()
        .map(|row| AlarmRow {
            generation: row.get(0).unwrap(),
            status: row.get(1).unwrap(),
            scheduled_at: row.get(2).unwrap(),
            next_attempt_at: row.get(3).unwrap(),
            attempt: row.get(4).unwrap(),
            last_error: row.get(5).unwrap(),
            last_error_name: row.get(6).unwrap(),
            created_at: row.get(7).unwrap(),
        })
}

fn rows_named(ctx: &dyn Context, name: &str) -> i64 {
    query_i64(
        ctx,
        "SELECT COUNT(*) FROM durability_alarms WHERE name = ?",
        &params![name],
    )
}

/// What a handler saw of one attempt.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    name: String,
    attempt: u32,
    is_retry: bool,
    retry_count: u32,
    key: String,
    at: i64,
    platform: Option<AlarmInfo>,
}

/// Invocations recorded by handlers. Cloning shares the list.
#[derive(Clone, Default)]
struct Calls(Rc<RefCell<Vec<Seen>>>);

impl Calls {
    fn record(&self, call: &AlarmCall, at: i64) {
        self.0.borrow_mut().push(Seen {
            name: call.name.clone(),
            attempt: call.attempt,
            is_retry: call.is_retry,
            retry_count: call.retry_count,
            key: call.idempotency_key.clone(),
            at,
            platform: call.platform,
        });
    }

    fn all(&self) -> Vec<Seen> {
        self.0.borrow().clone()
    }

    fn len(&self) -> usize {
        self.0.borrow().len()
    }
}

// §8.7 (1)
#[tokio::test(start_paused = true)]
async fn at_most_one_row_per_name_and_each_scheduling_is_a_new_clean_generation() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let alarms = Alarms::builder(&scheduler)
            .handler("report", |_: AlarmCall| async {
                Err(HandlerError::non_retryable("no data"))
            })
            .build()
            .unwrap();
        let now = scheduler.now_ms();
        alarms.schedule("report", now).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let failed = alarm_row(&*ctx, "report").unwrap();
        assert_eq!(
            (failed.status.as_str(), failed.attempt),
            ("failed", 1),
            "{failed:?}"
        );
        assert!(failed.last_error.is_some());

        let mut generations = vec![failed.generation.clone()];
        for later in [HOUR_MS, 2 * HOUR_MS, HOUR_MS / 2] {
            let created_at = scheduler.now_ms();
            alarms.schedule("report", created_at + later).await.unwrap();
            assert_eq!(rows_named(&*ctx, "report"), 1);
            let row = alarm_row(&*ctx, "report").unwrap();
            assert_eq!(
                row,
                AlarmRow {
                    generation: row.generation.clone(),
                    status: "pending".into(),
                    scheduled_at: created_at + later,
                    next_attempt_at: created_at + later,
                    attempt: 0,
                    last_error: None,
                    last_error_name: None,
                    created_at,
                }
            );
            assert!(!generations.contains(&row.generation));
            generations.push(row.generation);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
    .await;
}

// §8.7 (2)
#[tokio::test(start_paused = true)]
async fn at_most_one_handler_per_name_runs_in_one_instance_across_generations() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let gate = Gate::default();
        let calls = Calls::default();
        let running = Rc::new(RefCell::new(std::collections::HashMap::<String, u32>::new()));
        let most = Rc::new(Cell::new(0_u32));
        let most_overall = Rc::new(Cell::new(0_u32));
        let handler = {
            let (gate, calls, running) = (gate.clone(), calls.clone(), Rc::clone(&running));
            let (most, most_overall) = (Rc::clone(&most), Rc::clone(&most_overall));
            let ctx = Rc::clone(&ctx);
            move |call: AlarmCall| {
                let first = !calls.all().iter().any(|seen| seen.name == call.name);
                calls.record(&call, ctx.now_ms());
                let (gate, running) = (gate.clone(), Rc::clone(&running));
                let (most, most_overall) = (Rc::clone(&most), Rc::clone(&most_overall));
                async move {
                    {
                        let mut running = running.borrow_mut();
                        let count = running.entry(call.name.clone()).or_default();
                        *count += 1;
                        most.set(most.get().max(*count));
                    }
                    most_overall.set(most_overall.get().max(running.borrow().values().sum()));
                    // The first occurrence of each name ignores its signal and
                    // holds on until the test opens the gate.
                    if first {
                        gate.wait().await;
                    }
                    *running.borrow_mut().entry(call.name.clone()).or_default() -= 1;
                    Ok(())
                }
            }
        };
        let alarms = Alarms::builder(&scheduler)
            .handler("a", handler.clone())
            .handler("b", handler)
            .attempt_timeout(Duration::from_secs(1))
            .method("a", MethodPolicy::new().retry_timeouts(true))
            .build()
            .unwrap();
        let now = scheduler.now_ms();
        alarms.schedule("a", now).await.unwrap();
        alarms.schedule("b", now).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        // Different names run side by side.
        assert_eq!(most_overall.get(), 2);

        // A new occurrence of "a", due at once, and retries of the timed-out
        // first one: none may start while the first handler still runs,
        // whatever the timer and the physical alarm do meanwhile.
        alarms.schedule("a", scheduler.now_ms()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(
            calls.all().iter().filter(|seen| seen.name == "a").count(),
            1
        );
        assert_eq!(alarm_row(&*ctx, "a").unwrap().attempt, 0);

        gate.open();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let a_calls: Vec<Seen> = calls
            .all()
            .into_iter()
            .filter(|seen| seen.name == "a")
            .collect();
        assert_eq!(a_calls.len(), 2);
        assert_ne!(a_calls[0].key, a_calls[1].key);
        assert_eq!(most.get(), 1, "two handlers of one name overlapped");
        assert_eq!(rows_named(&*ctx, "a"), 0);
    })
    .await;
}

// §8.7 (3)
#[tokio::test(start_paused = true)]
async fn the_idempotency_key_is_identical_for_all_attempts_of_one_occurrence_and_different_across_occurrences()
 {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let calls = Calls::default();
        let handler_calls = calls.clone();
        let clock = Rc::clone(&ctx);
        let alarms = Alarms::builder(&scheduler)
            .handler("sync", move |call: AlarmCall| {
                handler_calls.record(&call, clock.now_ms());
                async move {
                    if call.attempt < 3 {
                        Err(HandlerError::new("flaky"))
                    } else {
                        Ok(())
                    }
                }
            })
            .build()
            .unwrap();
        let due = scheduler.now_ms() + 5_000;
        alarms.schedule("sync", due).await.unwrap();
        let generation = alarm_row(&*ctx, "sync").unwrap().generation;
        tokio::time::sleep(Duration::from_secs(60)).await;
        let first: Vec<Seen> = calls.all();
        assert_eq!(
            first
                .iter()
                .map(|s| (s.attempt, s.is_retry, s.retry_count))
                .collect::<Vec<_>>(),
            [(1, false, 0), (2, true, 1), (3, true, 2)]
        );
        let expected_key = format!("{IDEMPOTENCY_KEY_PREFIX}{generation}");
        assert!(
            first.iter().all(|seen| seen.key == expected_key),
            "{first:?}"
        );
        assert_eq!(rows_named(&*ctx, "sync"), 0);

        // The next occurrence (same name, same time) gets a key of its own.
        alarms.schedule("sync", due).await.unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
        let second: Vec<Seen> = calls.all().split_off(3);
        assert_eq!(second.len(), 3);
        assert!(second.iter().all(|seen| seen.key == second[0].key));
        assert_ne!(second[0].key, expected_key);
        assert!(second[0].key.starts_with(IDEMPOTENCY_KEY_PREFIX));
    })
    .await;
}

// §8.7 (4)
#[tokio::test(start_paused = true)]
async fn success_deletes_only_the_row_of_the_executed_generation_and_attempt() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let gate = Gate::default();
        let calls = Calls::default();
        let (held, handler_calls, clock) = (gate.clone(), calls.clone(), Rc::clone(&ctx));
        let alarms = Alarms::builder(&scheduler)
            .handler("digest", move |call: AlarmCall| {
                handler_calls.record(&call, clock.now_ms());
                let held = held.clone();
                async move {
                    held.wait().await;
                    Ok(())
                }
            })
            .build()
            .unwrap();
        alarms.schedule("digest", scheduler.now_ms()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(calls.len(), 1);

        // Rescheduled for later while the first occurrence runs.
        let later = scheduler.now_ms() + HOUR_MS;
        alarms.schedule("digest", later).await.unwrap();
        let replacement = alarm_row(&*ctx, "digest").unwrap();
        gate.open();
        tokio::time::sleep(Duration::from_secs(1)).await;
        // The old success missed: the replacement is untouched.
        assert_eq!(alarm_row(&*ctx, "digest"), Some(replacement.clone()));
        assert_eq!(physical_alarm(&*ctx).await, Some(later));

        tokio::time::sleep(Duration::from_millis(u64::try_from(HOUR_MS).unwrap())).await;
        let all = calls.all();
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].at, later);
        assert_eq!(
            all[1].key,
            format!("{IDEMPOTENCY_KEY_PREFIX}{}", replacement.generation)
        );
        assert_eq!(alarm_row(&*ctx, "digest"), None);
        assert_eq!(physical_alarm(&*ctx).await, None);
    })
    .await;
}

// §8.7 (5)
#[tokio::test(start_paused = true)]
async fn a_timed_out_attempt_is_terminal_unless_retry_timeouts() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let events = Events::default();
        let reasons = Rc::new(RefCell::new(Vec::new()));
        let seen = Rc::clone(&reasons);
        let handler = move |call: AlarmCall| {
            let seen = Rc::clone(&seen);
            async move {
                if call.attempt == 1 {
                    call.signal.aborted().await;
                    seen.borrow_mut().push((
                        call.name.clone(),
                        call.signal.reason().map(|r| r.serialize()),
                    ));
                    return Err(HandlerError::new("gave up"));
                }
                Ok(())
            }
        };
        let alarms = Alarms::builder(&scheduler)
            .handler("strict", handler.clone())
            .handler("lenient", handler)
            .attempt_timeout(Duration::from_millis(2_000))
            .method("lenient", MethodPolicy::new().retry_timeouts(true))
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        let now = scheduler.now_ms();
        alarms.schedule("strict", now).await.unwrap();
        alarms.schedule("lenient", now).await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;

        let strict = alarm_row(&*ctx, "strict").unwrap();
        assert_eq!(
            (
                strict.status.as_str(),
                strict.attempt,
                strict.last_error_name.as_deref(),
                strict.last_error.as_deref()
            ),
            (
                "failed",
                1,
                Some("DurableAlarmTimeoutError"),
                Some("Durable alarm \"strict\" timed out after 2000ms")
            )
        );
        assert_eq!(alarm_row(&*ctx, "lenient"), None);
        assert_eq!(
            events.trace("lenient"),
            [
                "scheduled",
                "attempt_started 1",
                "attempt_settled:retry_scheduled 1",
                "attempt_started 2",
                "attempt_settled:completed 2",
            ]
        );
        assert_eq!(
            events.trace("strict"),
            ["scheduled", "attempt_started 1", "attempt_settled:failed 1"]
        );
        // Each timed-out attempt's signal aborted with its timeout error.
        let mut reasons = reasons.borrow().clone();
        reasons.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            reasons,
            [
                (
                    "lenient".to_owned(),
                    Some(SerializedError::new(
                        "DurableAlarmTimeoutError",
                        "Durable alarm \"lenient\" timed out after 2000ms"
                    ))
                ),
                (
                    "strict".to_owned(),
                    Some(SerializedError::new(
                        "DurableAlarmTimeoutError",
                        "Durable alarm \"strict\" timed out after 2000ms"
                    ))
                ),
            ]
        );
    })
    .await;
}

// §8.7 (6)
#[tokio::test(start_paused = true)]
async fn a_terminal_failure_keeps_the_row_as_failed_until_rescheduled_or_purged() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let runs = Rc::new(Cell::new(0_u32));
        let counted = Rc::clone(&runs);
        let alarms = Alarms::builder(&scheduler)
            .handler("bill", move |_: AlarmCall| {
                counted.set(counted.get() + 1);
                async { Err(HandlerError::non_retryable("card declined")) }
            })
            .build()
            .unwrap();
        alarms.schedule("bill", scheduler.now_ms()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let failed = alarm_row(&*ctx, "bill").unwrap();
        assert_eq!(failed.status, "failed");
        assert_eq!(
            (
                failed.last_error_name.as_deref(),
                failed.last_error.as_deref()
            ),
            (Some("NonRetryableError"), Some("card declined"))
        );
        // A failed row is not pending work: no alarm keeps firing for it.
        assert_eq!(physical_alarm(&*ctx).await, None);

        // A week later it is still there, unchanged, and never re-ran.
        tokio::time::sleep(Duration::from_secs(7 * 86_400)).await;
        assert_eq!(alarm_row(&*ctx, "bill"), Some(failed.clone()));
        assert_eq!(runs.get(), 1);

        // Rescheduling replaces it with a clean pending occurrence.
        alarms.schedule("bill", scheduler.now_ms()).await.unwrap();
        assert_eq!(alarm_row(&*ctx, "bill").unwrap().status, "pending");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(runs.get(), 2);
        assert_eq!(alarm_row(&*ctx, "bill").unwrap().status, "failed");

        // Purging removes it.
        assert_eq!(alarms.purge_before(scheduler.now_ms()).await.unwrap(), 1);
        assert_eq!(alarm_row(&*ctx, "bill"), None);
    })
    .await;
}

// §8.7 (7)
#[tokio::test(start_paused = true)]
async fn after_a_scheduling_call_commits_the_physical_alarm_covers_the_new_earliest_due_time() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let alarms = Alarms::builder(&scheduler)
            .handler("x", |_: AlarmCall| async { Ok(()) })
            .handler("late", |_: AlarmCall| async { Ok(()) })
            .handler("earlier", |_: AlarmCall| async { Ok(()) })
            .handler("later-still", |_: AlarmCall| async { Ok(()) })
            .handler("soon", |_: AlarmCall| async { Ok(()) })
            .handler("past", |_: AlarmCall| async { Ok(()) })
            .build()
            .unwrap();
        // An operation of the same scheduler waiting 30 min for its retry.
        let ops = Operations::builder(&scheduler)
            .handler("op", |_: DurableCall<()>| async {
                Err::<(), _>(HandlerError::new("later"))
            })
            .retry_delay(Delay::Fixed {
                ms: 30.0 * 60_000.0,
            })
            .build()
            .unwrap();

        let t0 = scheduler.now_ms();
        alarms.schedule("late", t0 + 2 * HOUR_MS).await.unwrap();
        assert_eq!(physical_alarm(&*ctx).await, Some(t0 + 2 * HOUR_MS));
        // An earlier occurrence pulls the alarm forward.
        alarms.schedule("earlier", t0 + HOUR_MS).await.unwrap();
        assert_eq!(physical_alarm(&*ctx).await, Some(t0 + HOUR_MS));

        ops.start("op", "retrying", &()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let t1 = scheduler.now_ms();
        let retry_at = query_i64(
            &*ctx,
            "SELECT next_attempt_at FROM durability_calls WHERE id = 'retrying'",
            &[],
        );
        assert_eq!(retry_at, t0 + 30 * 60_000);
        assert_eq!(physical_alarm(&*ctx).await, Some(retry_at));
        // A later occurrence does not push the other participant's time back.
        alarms
            .schedule("later-still", t1 + 3 * HOUR_MS)
            .await
            .unwrap();
        assert_eq!(physical_alarm(&*ctx).await, Some(retry_at));

        // Due within the minimum delay: the physical alarm is never set
        // closer than now + min delay ...
        alarms.schedule("soon", t1 + 2_000).await.unwrap();
        assert_eq!(physical_alarm(&*ctx).await, Some(t1 + MIN_DELAY_MS));
        // ... and a time in the past is clamped the same way.
        alarms.schedule("past", 0).await.unwrap();
        let at = physical_alarm(&*ctx).await.unwrap();
        let pending_min = query_i64(
            &*ctx,
            "SELECT MIN(next_attempt_at) FROM durability_alarms WHERE status = 'pending'",
            &[],
        );
        // §6.15 (2): P <= T <= max(P, now + min delay).
        assert!(pending_min <= at && at <= pending_min.max(t1 + MIN_DELAY_MS));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_replacement_scheduled_while_the_old_handler_runs_waits_for_it_and_is_not_deleted_by_the_old_success()
 {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let events = Events::default();
        let gate = Gate::default();
        let calls = Calls::default();
        let (held, handler_calls, clock) = (gate.clone(), calls.clone(), Rc::clone(&ctx));
        let alarms = Alarms::builder(&scheduler)
            .handler("refresh", move |call: AlarmCall| {
                let first = handler_calls.len() == 0;
                handler_calls.record(&call, clock.now_ms());
                let held = held.clone();
                async move {
                    if first {
                        held.wait().await;
                    }
                    Ok(())
                }
            })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        alarms
            .schedule("refresh", scheduler.now_ms())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let old = calls.all()[0].key.clone();

        // Due at once, but the old handler of the name still runs.
        alarms
            .schedule("refresh", scheduler.now_ms())
            .await
            .unwrap();
        let replacement = alarm_row(&*ctx, "refresh").unwrap();
        tokio::time::sleep(Duration::from_secs(40)).await;
        assert_eq!(calls.len(), 1);
        assert_eq!(alarm_row(&*ctx, "refresh"), Some(replacement.clone()));

        let released_at = scheduler.now_ms();
        gate.open();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let all = calls.all();
        assert_eq!(all.len(), 2);
        assert_eq!(
            all[1].key,
            format!("{IDEMPOTENCY_KEY_PREFIX}{}", replacement.generation)
        );
        assert_ne!(all[1].key, old);
        assert_eq!(all[1].attempt, 1);
        // It ran right after the old handler ended, not at the next alarm.
        assert_eq!(all[1].at, released_at);
        assert_eq!(alarm_row(&*ctx, "refresh"), None);
        // The old success emitted nothing: its compare-and-set missed.
        let completed: Vec<String> = events
            .all()
            .iter()
            .filter_map(|event| match event {
                LifecycleEvent::AttemptSettled { entity, .. } => {
                    Some(entity.generation().to_owned())
                }
                _ => None,
            })
            .collect();
        assert_eq!(completed, [replacement.generation]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_in_memory_timer_serves_work_inside_the_min_delay_window_at_its_exact_time() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let calls = Calls::default();
        let (handler_calls, clock) = (calls.clone(), Rc::clone(&ctx));
        let alarms = Alarms::builder(&scheduler)
            .handler("tick", move |call: AlarmCall| {
                handler_calls.record(&call, clock.now_ms());
                async { Ok(()) }
            })
            .build()
            .unwrap();
        let t0 = scheduler.now_ms();
        alarms.schedule("tick", t0 + 3_000).await.unwrap();
        assert_eq!(physical_alarm(&*ctx).await, Some(t0 + MIN_DELAY_MS));
        tokio::time::sleep(Duration::from_secs(20)).await;
        let all = calls.all();
        assert_eq!(all.len(), 1);
        // Fired from memory at its time, not by the physical alarm 12 s later.
        assert_eq!(all[0].at, t0 + 3_000);
        assert_eq!(all[0].platform, None);
        assert_eq!(physical_alarm(&*ctx).await, None);

        // Beyond the window, the physical alarm serves it, and the handler
        // learns about the platform's invocation.
        let t1 = scheduler.now_ms();
        alarms.schedule("tick", t1 + 60_000).await.unwrap();
        assert_eq!(physical_alarm(&*ctx).await, Some(t1 + 60_000));
        tokio::time::sleep(Duration::from_secs(61)).await;
        let all = calls.all();
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].at, t1 + 60_000);
        assert_eq!(
            all[1].platform,
            Some(AlarmInfo {
                retry_count: 0,
                is_retry: false
            })
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_bad_scheduled_time_is_a_typed_error_and_stores_nothing() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let events = Events::default();
        let alarms = Alarms::builder(&scheduler)
            .handler("x", |_: AlarmCall| async { Ok(()) })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        for bad in [-1, i64::MIN, MAX_SAFE_INTEGER + 1, i64::MAX] {
            match alarms.schedule("x", bad).await {
                Err(DurabilityError::InvalidTimestamp { field, value }) => {
                    assert_eq!((field, value), ("scheduled_time", bad));
                }
                other => panic!("{bad}: expected InvalidTimestamp, got {other:?}"),
            }
        }
        assert_eq!(rows_named(&*ctx, "x"), 0);
        assert_eq!(physical_alarm(&*ctx).await, None);
        assert!(events.all().is_empty());
        // The largest safe integer is a valid (far) time.
        alarms.schedule("x", MAX_SAFE_INTEGER).await.unwrap();
        assert_eq!(physical_alarm(&*ctx).await, Some(MAX_SAFE_INTEGER));
        // A bad purge cutoff is rejected the same way.
        assert!(matches!(
            alarms.purge_before(-1).await,
            Err(DurabilityError::InvalidTimestamp { .. })
        ));
        assert_eq!(rows_named(&*ctx, "x"), 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_purged_alarm_that_keeps_running_holds_its_name_until_it_ends() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = scheduler(&h);
        let events = Events::default();
        let gate = Gate::default();
        let calls = Calls::default();
        let reasons = Rc::new(RefCell::new(Vec::new()));
        let (held, handler_calls, clock, seen) = (
            gate.clone(),
            calls.clone(),
            Rc::clone(&ctx),
            Rc::clone(&reasons),
        );
        let alarms = Alarms::builder(&scheduler)
            .handler("job", move |call: AlarmCall| {
                let first = handler_calls.len() == 0;
                handler_calls.record(&call, clock.now_ms());
                let (held, seen) = (held.clone(), Rc::clone(&seen));
                async move {
                    if first {
                        call.signal.aborted().await;
                        seen.borrow_mut()
                            .push(call.signal.reason().map(|r| r.serialize()));
                        held.wait().await;
                    }
                    Ok(())
                }
            })
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        alarms.schedule("job", scheduler.now_ms()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(alarms.purge_before(scheduler.now_ms()).await.unwrap(), 1);
        assert_eq!(alarm_row(&*ctx, "job"), None);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(
            *reasons.borrow(),
            [Some(SerializedError::new(
                "Error",
                "Durable alarm was purged"
            ))]
        );

        alarms.schedule("job", scheduler.now_ms()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(
            calls.len(),
            1,
            "the replacement overlapped the purged handler"
        );
        let released_at = scheduler.now_ms();
        gate.open();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(calls.len(), 2);
        assert_eq!(calls.all()[1].at, released_at);
        assert_eq!(alarm_row(&*ctx, "job"), None);
        assert!(
            events
                .all()
                .iter()
                .any(|event| matches!(event, LifecycleEvent::Purged { count: 1, .. }))
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_stored_alarm_without_handler_fails_on_first_claim_and_crash_exhaustion_is_terminal() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let scheduler = Scheduler::builder(h.context())
            .alarm_concurrency(1)
            .build()
            .unwrap();
        h.install(&scheduler);
        let events = Events::default();
        let gate = Gate::default();
        let calls = Calls::default();
        let (held, handler_calls, clock) = (gate.clone(), calls.clone(), Rc::clone(&ctx));
        let alarms = Alarms::builder(&scheduler)
            .handler("blocker", move |call: AlarmCall| {
                handler_calls.record(&call, clock.now_ms());
                let held = held.clone();
                async move {
                    held.wait().await;
                    Ok(())
                }
            })
            .handler("crashed", |_: AlarmCall| async { Ok(()) })
            .max_attempts(2)
            .on_lifecycle_event(events.hook())
            .build()
            .unwrap();
        alarms
            .schedule("blocker", scheduler.now_ms())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        // While the one permit is held, play "the process died during the
        // last attempt" for "crashed", and store an alarm nobody handles.
        alarms
            .schedule("crashed", scheduler.now_ms())
            .await
            .unwrap();
        // Scheduling a name without a handler is refused and stores nothing...
        let refused = alarms.schedule("unknown", scheduler.now_ms()).await;
        assert!(matches!(
            refused,
            Err(durability::DurabilityError::UnknownHandler { .. })
        ));
        assert!(alarm_row(&*ctx, "unknown").is_none());
        // ...but a row stored by a deployment that still had the handler is
        // failed on its first claim.
        ctx.storage()
            .execute(
                "INSERT INTO durability_alarms (name, generation_id, status, scheduled_at, \
                 next_attempt_at, attempt, created_at) VALUES ('unknown', 'g1', 'pending', ?, ?, 0, ?)",
                &durability_platform::params![
                    scheduler.now_ms(),
                    scheduler.now_ms(),
                    scheduler.now_ms()
                ],
            )
            .unwrap();
        ctx.storage()
            .execute(
                "UPDATE durability_alarms SET attempt = 2 WHERE name = 'crashed'",
                &[],
            )
            .unwrap();
        gate.open();
        tokio::time::sleep(Duration::from_secs(1)).await;

        let crashed = alarm_row(&*ctx, "crashed").unwrap();
        assert_eq!(
            (
                crashed.status.as_str(),
                crashed.attempt,
                crashed.last_error_name.as_deref(),
                crashed.last_error.as_deref()
            ),
            (
                "failed",
                2,
                Some("DurableAttemptsExhaustedError"),
                Some("Durable named alarm \"crashed\" exhausted its 2 attempts")
            )
        );
        assert_eq!(events.trace("crashed"), ["scheduled", "terminal 2"]);
        let unknown = alarm_row(&*ctx, "unknown").unwrap();
        assert_eq!(
            (
                unknown.status.as_str(),
                unknown.attempt,
                unknown.last_error_name.as_deref(),
                unknown.last_error.as_deref()
            ),
            (
                "failed",
                1,
                Some("NonRetryableError"),
                Some("No named alarm handler registered for \"unknown\"")
            )
        );
        assert_eq!(calls.len(), 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_stored_alarm_row_that_does_not_decode_fails_the_run_and_arms_the_fallback() {
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
        let runs = Rc::new(Cell::new(0_u32));
        let counted = Rc::clone(&runs);
        let alarms = Alarms::builder(&scheduler)
            .handler("x", move |_: AlarmCall| {
                counted.set(counted.get() + 1);
                async { Ok(()) }
            })
            .build()
            .unwrap();
        alarms
            .schedule("x", scheduler.now_ms() + HOUR_MS)
            .await
            .unwrap();
        ctx.storage()
            .execute(
                "UPDATE durability_alarms SET scheduled_at = 'soon', next_attempt_at = 0 \
                 WHERE name = 'x'",
                &[],
            )
            .unwrap();
        let before = scheduler.now_ms();
        scheduler.alarm(None).await.unwrap();
        assert_eq!(physical_alarm(&*ctx).await, Some(before + MIN_DELAY_MS));
        let first = retries.borrow().len();
        assert_eq!(first, 1);
        {
            let error = &retries.borrow()[0].error;
            assert_eq!(error.name, "DecodeError");
            for part in ["durability_alarms", "\"x\"", "scheduled_at"] {
                assert!(error.message.contains(part), "{part} in {error:?}");
            }
        }
        // Retried every min delay, never in a tight loop.
        tokio::time::sleep(Duration::from_secs(61)).await;
        assert_eq!(retries.borrow().len() - first, 4);
        assert_eq!(runs.get(), 0);
        // Rescheduling repairs the row.
        alarms.schedule("x", scheduler.now_ms()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(runs.get(), 1);
    })
    .await;
}
