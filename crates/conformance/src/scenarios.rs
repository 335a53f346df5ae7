//! The scenarios, written once against a [`Driver`].
//!
//! A scenario sends [`Command`]s to objects by name, sleeps in real time and
//! may restart the platform; it returns `Err` with what it saw when an
//! expectation fails. Nothing here knows which platform runs the objects.

use std::time::Duration;

use durability_platform::LocalBoxFuture;
use serde_json::{Value, json};

use crate::{Command, FanoutSpec, RETRY_DELAY_MS, SETTLE_TIMEOUT};

/// How a platform is driven.
pub trait Driver {
    /// Sends `command` to the object named `object` and returns its answer.
    fn call<'a>(
        &'a self,
        object: &'a str,
        command: Command,
    ) -> LocalBoxFuture<'a, Result<Value, String>>;
    /// Sleeps in real time.
    fn sleep(&self, duration: Duration) -> LocalBoxFuture<'_, ()>;
    /// Stops the platform abruptly (a process kill where there is a process)
    /// and starts it again on the same storage.
    fn restart(&self) -> LocalBoxFuture<'_, Result<(), String>>;
}

/// A scenario: its name and its body.
pub type Scenario = (
    &'static str,
    for<'a> fn(&'a dyn Driver, &'a str) -> LocalBoxFuture<'a, Result<(), String>>,
);

/// Every scenario, in the order they run. Each gets a prefix for its object
/// names, unique per run.
pub const ALL: &[Scenario] = &[
    ("migrations_on_a_fresh_object", |d, p| {
        Box::pin(migrations_on_a_fresh_object(d, p))
    }),
    ("operation_start_dedup_retry_result", |d, p| {
        Box::pin(operation_start_dedup_retry_result(d, p))
    }),
    ("named_alarm_replace_and_fire", |d, p| {
        Box::pin(named_alarm_replace_and_fire(d, p))
    }),
    ("alarm_info_reaches_a_retried_alarm", |d, p| {
        Box::pin(alarm_info_reaches_a_retried_alarm(d, p))
    }),
    ("log_append_read_commit", |d, p| {
        Box::pin(log_append_read_commit(d, p))
    }),
    (
        "fanout_batch_two_targets_retry_dead_letter_parked",
        |d, p| Box::pin(fanout_batch_two_targets_retry_dead_letter_parked(d, p)),
    ),
    (
        "rolled_back_transaction_leaves_neither_rows_nor_alarm",
        |d, p| Box::pin(rolled_back_transaction_leaves_neither_rows_nor_alarm(d, p)),
    ),
    ("integers_are_stored_exactly_or_refused", |d, p| {
        Box::pin(integers_are_stored_exactly_or_refused(d, p))
    }),
    ("real_two_reads_back_as_f64", |d, p| {
        Box::pin(real_two_reads_back_as_f64(d, p))
    }),
    (
        "pending_work_survives_a_restart_and_finishes_from_the_alarm",
        |d, p| {
            Box::pin(pending_work_survives_a_restart_and_finishes_from_the_alarm(
                d, p,
            ))
        },
    ),
];

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok { Ok(()) } else { Err(what()) }
}

/// Calls `command` until `done` accepts the answer or the settle timeout passes.
async fn eventually(
    driver: &dyn Driver,
    object: &str,
    command: Command,
    done: impl Fn(&Value) -> bool,
) -> Result<Value, String> {
    let step = Duration::from_millis(250);
    let mut waited = Duration::ZERO;
    loop {
        let answer = driver.call(object, command.clone()).await?;
        if done(&answer) {
            return Ok(answer);
        }
        if waited >= SETTLE_TIMEOUT {
            return Err(format!("{command:?} never settled; last answer {answer}"));
        }
        driver.sleep(step).await;
        waited += step;
    }
}

async fn migrations_on_a_fresh_object(driver: &dyn Driver, prefix: &str) -> Result<(), String> {
    let tables = driver
        .call(&format!("{prefix}-fresh"), Command::Tables)
        .await?;
    for table in ["durability_alarms", "conformance_fired"] {
        check(
            tables.as_array().is_some_and(|t| t.contains(&json!(table))),
            || format!("table {table} missing after migrations: {tables}"),
        )?;
    }
    check(tables.as_array().is_some_and(|t| t.len() > 4), || {
        format!("too few tables: {tables}")
    })
}

async fn operation_start_dedup_retry_result(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-ops");
    let start = || Command::OpStart {
        id: "order-1".into(),
        fail_times: 1,
    };
    let first = driver.call(&object, start()).await?;
    check(first == json!("created"), || {
        format!("first start: {first}")
    })?;
    let second = driver.call(&object, start()).await?;
    check(second == json!("existing"), || {
        format!("second start: {second}")
    })?;
    let done = eventually(
        driver,
        &object,
        Command::OpResult {
            id: "order-1".into(),
        },
        |v| v["state"] == "completed",
    )
    .await?;
    // Attempt 1 failed; attempt 2 ran after the retry delay and succeeded.
    check(done["result"]["attempt"] == 2, || format!("result: {done}"))?;
    let missing = driver
        .call(&object, Command::OpResult { id: "nope".into() })
        .await?;
    check(missing["state"] == "not_found", || {
        format!("unknown id: {missing}")
    })
}

async fn named_alarm_replace_and_fire(driver: &dyn Driver, prefix: &str) -> Result<(), String> {
    let object = format!("{prefix}-alarms");
    driver
        .call(&object, Command::AlarmSchedule { in_ms: 3_600_000 })
        .await?;
    // Replaces the occurrence an hour out: only this one fires.
    driver
        .call(&object, Command::AlarmSchedule { in_ms: 300 })
        .await?;
    eventually(driver, &object, Command::Fired, |v| {
        v.as_array().is_some_and(|a| !a.is_empty())
    })
    .await?;
    driver.sleep(Duration::from_millis(1_500)).await;
    let fired = driver.call(&object, Command::Fired).await?;
    check(fired.as_array().is_some_and(|a| a.len() == 1), || {
        format!("fired: {fired}")
    })
}

async fn alarm_info_reaches_a_retried_alarm(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-retry");
    driver
        .call(&object, Command::FailNextAlarms { count: 1 })
        .await?;
    // Beyond the scheduler's minimum alarm delay: the physical alarm runs it.
    driver
        .call(&object, Command::AlarmSchedule { in_ms: 2_000 })
        .await?;
    // The platform retries the failed delivery (after about 2 s) and says so.
    let runs = eventually(driver, &object, Command::AlarmRuns, |v| {
        v.as_array().is_some_and(|runs| {
            runs.iter()
                .any(|r| r["is_retry"] == true && r["retry_count"] == 1)
        })
    })
    .await?;
    check(
        runs[0]["is_retry"] == false && runs[0]["failed"] == true,
        || format!("runs: {runs}"),
    )?;
    eventually(driver, &object, Command::Fired, |v| {
        v.as_array().is_some_and(|a| a.len() == 1)
    })
    .await
    .map(drop)
}

async fn log_append_read_commit(driver: &dyn Driver, prefix: &str) -> Result<(), String> {
    let object = format!("{prefix}-log");
    let appended = driver
        .call(
            &object,
            Command::LogAppend {
                bodies: vec![json!("a"), json!("b"), json!("c")],
                keys: vec![Some("k-a".into()), None, None],
            },
        )
        .await?;
    check(appended["offsets"] == json!([0, 1, 2]), || {
        format!("append: {appended}")
    })?;
    // The same key again returns the original offset and writes nothing.
    let again = driver
        .call(
            &object,
            Command::LogAppend {
                bodies: vec![json!("a")],
                keys: vec![Some("k-a".into())],
            },
        )
        .await?;
    check(again["offsets"] == json!([0]), || {
        format!("keyed re-append: {again}")
    })?;
    let page = driver.call(&object, Command::LogRead { from: 0 }).await?;
    check(
        page["bodies"] == json!(["a", "b", "c"]) && page["next_offset"] == 3,
        || format!("read: {page}"),
    )?;
    let none = driver
        .call(
            &object,
            Command::LogCursor {
                consumer: "c1".into(),
            },
        )
        .await?;
    check(none.is_null(), || format!("cursor before commit: {none}"))?;
    driver
        .call(
            &object,
            Command::LogCommit {
                consumer: "c1".into(),
                offset: 3,
            },
        )
        .await?;
    let cursor = driver
        .call(
            &object,
            Command::LogCursor {
                consumer: "c1".into(),
            },
        )
        .await?;
    check(cursor == 3, || format!("cursor after commit: {cursor}"))
}

async fn fanout_batch_two_targets_retry_dead_letter_parked(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-fanout");
    let spec = |id: &str, fail_b: u32, poison: bool| FanoutSpec {
        id: id.into(),
        fail_b,
        poison,
    };
    let batch = vec![
        spec("m1", 0, false),
        spec("m2", 1, false),
        spec("m3", 0, true),
    ];
    let accepted = driver
        .call(
            &object,
            Command::FanoutEnqueue {
                messages: batch.clone(),
            },
        )
        .await?;
    check(accepted["accepted"] == json!(["m1", "m2", "m3"]), || {
        format!("enqueue: {accepted}")
    })?;
    eventually(driver, &object, Command::Owed, |v| *v == 0).await?;
    let deliveries = driver.call(&object, Command::Deliveries).await?;
    // Target a got all three at once; b got m1 at once, m2 on its retry,
    // and dead-lettered m3.
    check(
        deliveries == json!(["a:m1@1", "a:m2@1", "a:m3@1", "b:m1@1", "b:m2@2"]),
        || format!("deliveries: {deliveries}"),
    )?;
    let parked = driver.call(&object, Command::Parked).await?;
    check(parked == json!(["b:m3"]), || format!("parked: {parked}"))
}

async fn rolled_back_transaction_leaves_neither_rows_nor_alarm(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-rollback");
    let outcome = driver
        .call(&object, Command::RolledBackWrite { alarm_in_ms: 500 })
        .await?;
    check(outcome["error"] == "the body fails after writing", || {
        format!("outcome: {outcome}")
    })?;
    let rows = driver.call(&object, Command::Rows).await?;
    check(rows == 0, || format!("rows after rollback: {rows}"))?;
    // Had the alarm survived the rollback it would fire within this wait.
    driver.sleep(Duration::from_millis(3_000)).await;
    let runs = driver.call(&object, Command::AlarmRuns).await?;
    check(runs.as_array().is_some_and(Vec::is_empty), || {
        format!("alarm ran after rollback: {runs}")
    })
}

async fn integers_are_stored_exactly_or_refused(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-integers");
    let safe = crate::is_safe_integer;
    for value in [
        0,
        -1,
        9_007_199_254_740_991,
        -9_007_199_254_740_991,
        9_007_199_254_740_992,
        i64::MAX,
        i64::MIN,
    ] {
        let answer = driver
            .call(&object, Command::IntegerRoundTrip { value })
            .await?;
        let exact = answer["stored"] == json!(format!("Integer({value})"))
            && answer["sqlite_type"] == "integer";
        let refused = answer["refused"] == value;
        // Never a rounded REAL; a safe integer is always stored.
        check(exact || (refused && !safe(value)), || {
            format!("{value}: {answer}")
        })?;
    }
    Ok(())
}

async fn real_two_reads_back_as_f64(driver: &dyn Driver, prefix: &str) -> Result<(), String> {
    let object = format!("{prefix}-reals");
    for value in [2.0, 2.5, -0.5, 1e300] {
        let back = driver
            .call(&object, Command::RealRoundTrip { value })
            .await?;
        check(back.as_f64() == Some(value), || {
            format!("{value} read back as {back}")
        })?;
    }
    Ok(())
}

async fn pending_work_survives_a_restart_and_finishes_from_the_alarm(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-restart");
    let started = driver
        .call(
            &object,
            Command::OpStart {
                id: "survivor".into(),
                fail_times: 1,
            },
        )
        .await?;
    check(started == json!("created"), || format!("start: {started}"))?;
    // Killed before the retry is due: only the persisted alarm knows of it.
    driver.restart().await?;
    // No request reaches the object until the work had time to finish.
    driver
        .sleep(Duration::from_millis(RETRY_DELAY_MS * 2 + 4_000))
        .await;
    let first_request_at = driver
        .call(&format!("{prefix}-clock"), Command::Now)
        .await?;
    let result = eventually(
        driver,
        &object,
        Command::OpResult {
            id: "survivor".into(),
        },
        |v| v["state"] != "pending",
    )
    .await?;
    check(result["state"] == "completed", || {
        format!("after restart: {result}")
    })?;
    let finished_at = &result["result"]["at_ms"];
    check(
        finished_at
            .as_i64()
            .zip(first_request_at.as_i64())
            .is_some_and(|(f, r)| f < r),
        || {
            format!(
                "finished at {finished_at}, not before the first request after the restart ({first_request_at})"
            )
        },
    )?;
    let runs = driver.call(&object, Command::AlarmRuns).await?;
    check(runs.as_array().is_some_and(|r| !r.is_empty()), || {
        format!("no alarm delivery recorded: {runs}")
    })
}
