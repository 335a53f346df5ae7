//! The storage contract below every capability: a rolled-back transaction
//! takes its alarm with it, integers travel exactly or are refused, and
//! pending work survives a kill.

use std::time::Duration;

use serde_json::json;

use super::{Driver, ask, check, eventually};
use crate::{OpSpec, OperationsCommand, PlatformCommand, RETRY_DELAY_MS, SchedulerCommand};

pub(crate) async fn rolled_back_transaction_leaves_neither_rows_nor_alarm(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-rollback");
    let outcome = ask(
        driver,
        &object,
        PlatformCommand::RolledBackWrite { alarm_in_ms: 500 },
    )
    .await?;
    check(outcome["error"] == "the body fails after writing", || {
        format!("outcome: {outcome}")
    })?;
    let rows = ask(driver, &object, PlatformCommand::Rows).await?;
    check(rows == 0, || format!("rows after rollback: {rows}"))?;
    let alarm = ask(driver, &object, SchedulerCommand::PhysicalAlarm).await?;
    check(alarm["alarm"].is_null(), || {
        format!("alarm after rollback: {alarm}")
    })?;
    // Had the alarm survived the rollback it would fire within this wait.
    driver.sleep(Duration::from_millis(2_000)).await;
    let runs = ask(driver, &object, SchedulerCommand::AlarmRuns).await?;
    check(runs.as_array().is_some_and(Vec::is_empty), || {
        format!("alarm ran after rollback: {runs}")
    })
}

pub(crate) async fn integers_are_stored_exactly_or_refused(
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
        let answer = ask(driver, &object, PlatformCommand::IntegerRoundTrip { value }).await?;
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

pub(crate) async fn real_two_reads_back_as_f64(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-reals");
    for value in [2.0, 2.5, -0.5, 1e300] {
        let back = ask(driver, &object, PlatformCommand::RealRoundTrip { value }).await?;
        check(back.as_f64() == Some(value), || {
            format!("{value} read back as {back}")
        })?;
    }
    Ok(())
}

pub(crate) async fn pending_work_survives_a_restart_and_finishes_from_the_alarm(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-restart");
    let start = OperationsCommand::Start {
        operation: "flaky".into(),
        id: "survivor".into(),
        spec: OpSpec {
            fail_times: 1,
            ..OpSpec::default()
        },
    };
    let started = ask(driver, &object, start).await?;
    check(started == json!("created"), || format!("start: {started}"))?;
    // Killed before the retry is due: only the persisted alarm knows of it.
    driver.restart().await?;
    // No request reaches the object until the work had time to finish.
    driver
        .sleep(Duration::from_millis(RETRY_DELAY_MS * 2 + 3_000))
        .await;
    let first_request_at = ask(driver, &format!("{prefix}-clock"), PlatformCommand::Now).await?;
    let result = eventually(
        driver,
        &object,
        OperationsCommand::Result {
            operation: "flaky".into(),
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
    let runs = ask(driver, &object, SchedulerCommand::AlarmRuns).await?;
    check(runs.as_array().is_some_and(|r| !r.is_empty()), || {
        format!("no alarm delivery recorded: {runs}")
    })
}
