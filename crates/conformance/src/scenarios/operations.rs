//! Durable operations: dedup by id, eager start, results and waits,
//! timeouts that abort and retry, non-retryable errors, attempts used up,
//! and purge.

use serde_json::{Value, json};

use super::{Driver, ask, check, events, events_until, eventually, phase};
use crate::fixture::operations::{OP_EVENT, WORK_MAX_ATTEMPTS};
use crate::{OpSpec, OperationsCommand, SchedulerCommand};

fn start(operation: &str, id: &str, spec: OpSpec) -> OperationsCommand {
    OperationsCommand::Start {
        operation: operation.into(),
        id: id.into(),
        spec,
    }
}

fn result(operation: &str, id: &str) -> OperationsCommand {
    OperationsCommand::Result {
        operation: operation.into(),
        id: id.into(),
    }
}

/// Waits until `work` under `id` is no longer pending.
async fn settled(driver: &dyn Driver, object: &str, id: &str) -> Result<Value, String> {
    eventually(driver, object, result("work", id), |v| {
        v["state"] != "pending"
    })
    .await
}

pub(crate) async fn operation_start_dedup_retry_result(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-ops");
    let spec = OpSpec {
        fail_times: 1,
        ..OpSpec::default()
    };
    let first = ask(driver, &object, start("flaky", "order-1", spec.clone())).await?;
    check(first == json!("created"), || {
        format!("first start: {first}")
    })?;
    let second = ask(driver, &object, start("flaky", "order-1", spec)).await?;
    check(second == json!("existing"), || {
        format!("second start: {second}")
    })?;
    let done = eventually(driver, &object, result("flaky", "order-1"), |v| {
        v["state"] == "completed"
    })
    .await?;
    // Attempt 1 failed; attempt 2 ran after the retry delay and succeeded.
    check(done["result"]["attempt"] == 2, || format!("result: {done}"))?;
    let missing = ask(driver, &object, result("flaky", "nope")).await?;
    check(missing["state"] == "not_found", || {
        format!("unknown id: {missing}")
    })
}

pub(crate) async fn an_id_names_one_operation_and_unknown_operations_are_refused(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-ids");
    let created = ask(driver, &object, start("work", "x", OpSpec::default())).await?;
    check(created == json!("created"), || format!("start: {created}"))?;
    let other = ask(driver, &object, start("flaky", "x", OpSpec::default())).await?;
    check(
        other["refused"]
            .as_str()
            .is_some_and(|e| e.contains("work") && e.contains("flaky")),
        || format!("the id of `work` registered under `flaky`: {other}"),
    )?;
    let unknown = ask(driver, &object, start("nope", "y", OpSpec::default())).await?;
    check(
        unknown["refused"]
            .as_str()
            .is_some_and(|e| e.contains("nope")),
        || format!("an operation without a handler: {unknown}"),
    )?;
    let nothing = ask(driver, &object, result("work", "y")).await?;
    check(nothing["state"] == "not_found", || {
        format!("a refused start wrote {nothing}")
    })?;
    let done = settled(driver, &object, "x").await?;
    check(done["state"] == "completed", || format!("x: {done}"))
}

pub(crate) async fn an_operation_starts_eagerly_without_the_alarm(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-eager");
    ask(driver, &object, start("work", "e", OpSpec::default())).await?;
    let done = settled(driver, &object, "e").await?;
    check(
        done["state"] == "completed" && done["result"]["attempt"] == 1,
        || format!("eager operation: {done}"),
    )?;
    let all = events(driver, &object, OP_EVENT).await?;
    let started = phase(&all, "e", "start");
    check(
        started.len() == 1 && started[0]["detail"]["platform"].is_null(),
        || format!("the first attempt did not start at registration: {all:?}"),
    )?;
    let runs = ask(driver, &object, SchedulerCommand::AlarmRuns).await?;
    check(runs.as_array().is_some_and(Vec::is_empty), || {
        format!("the physical alarm ran for an eager start: {runs}")
    })
}

pub(crate) async fn wait_returns_when_the_operation_settles_or_at_its_timeout(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-wait");
    let spec = OpSpec {
        sleep_ms: 800,
        sleep_attempts: 1,
        ..OpSpec::default()
    };
    ask(driver, &object, start("work", "w", spec)).await?;
    let wait = |timeout_ms| OperationsCommand::Wait {
        operation: "work".into(),
        id: "w".into(),
        timeout_ms,
    };
    let early = ask(driver, &object, wait(50)).await?;
    check(early["state"] == "pending" && early["attempt"] == 1, || {
        format!("a short wait: {early}")
    })?;
    let done = ask(driver, &object, wait(20_000)).await?;
    check(
        done["state"] == "completed" && done["result"]["attempt"] == 1,
        || format!("a long wait: {done}"),
    )?;
    let read = ask(driver, &object, result("work", "w")).await?;
    check(read == done, || {
        format!("result {read} differs from the wait's {done}")
    })
}

pub(crate) async fn a_timed_out_attempt_is_aborted_and_retried(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-timeout");
    let spec = OpSpec {
        sleep_ms: 20_000,
        sleep_attempts: 1,
        ..OpSpec::default()
    };
    ask(driver, &object, start("work", "t", spec)).await?;
    let done = settled(driver, &object, "t").await?;
    check(
        done["state"] == "completed" && done["result"]["attempt"] == 2,
        || format!("after a timeout: {done}"),
    )?;
    let all = events(driver, &object, OP_EVENT).await?;
    let aborted = phase(&all, "t", "aborted");
    check(
        aborted.len() == 1
            && aborted[0]["attempt"] == 1
            && !aborted[0]["detail"]["extra"].is_null(),
        || format!("attempt 1 was not aborted with a reason: {all:?}"),
    )
}

pub(crate) async fn timeouts_on_every_attempt_use_up_the_attempts(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-timeouts");
    let spec = OpSpec {
        sleep_ms: 20_000,
        sleep_attempts: 99,
        ..OpSpec::default()
    };
    ask(driver, &object, start("work", "t", spec)).await?;
    let done = settled(driver, &object, "t").await?;
    check(
        done["state"] == "failed" && done["attempt"] == WORK_MAX_ATTEMPTS,
        || format!("after timeouts: {done}"),
    )?;
    let all = events(driver, &object, OP_EVENT).await?;
    check(
        phase(&all, "t", "aborted").len() == WORK_MAX_ATTEMPTS as usize,
        || format!("not every attempt was aborted: {all:?}"),
    )
}

pub(crate) async fn a_non_retryable_error_fails_at_once(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-fatal");
    let spec = OpSpec {
        fail_times: 99,
        non_retryable: true,
        ..OpSpec::default()
    };
    ask(driver, &object, start("work", "n", spec)).await?;
    let done = settled(driver, &object, "n").await?;
    check(
        done["state"] == "failed" && done["attempt"] == 1 && done["error"] == "attempt 1 fails",
        || format!("a non-retryable failure: {done}"),
    )?;
    let all = events(driver, &object, OP_EVENT).await?;
    check(phase(&all, "n", "start").len() == 1, || {
        format!("a non-retryable failure was retried: {all:?}")
    })
}

pub(crate) async fn attempts_used_up_fail_with_the_last_error(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-exhausted");
    let spec = OpSpec {
        fail_times: 99,
        ..OpSpec::default()
    };
    ask(driver, &object, start("work", "x", spec)).await?;
    let done = settled(driver, &object, "x").await?;
    let last = format!("attempt {WORK_MAX_ATTEMPTS} fails");
    check(
        done["state"] == "failed" && done["attempt"] == WORK_MAX_ATTEMPTS && done["error"] == last,
        || format!("attempts used up: {done}"),
    )?;
    let all = events(driver, &object, OP_EVENT).await?;
    check(
        phase(&all, "x", "start").len() == WORK_MAX_ATTEMPTS as usize,
        || format!("attempts beyond the limit: {all:?}"),
    )
}

pub(crate) async fn purge_deletes_operations_and_aborts_running_attempts(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-purge");
    ask(driver, &object, start("work", "done", OpSpec::default())).await?;
    settled(driver, &object, "done").await?;
    let long = OpSpec {
        sleep_ms: 20_000,
        sleep_attempts: 1,
        ..OpSpec::default()
    };
    ask(driver, &object, start("work", "long", long)).await?;
    events_until(driver, &object, OP_EVENT, |e| {
        !phase(e, "long", "start").is_empty()
    })
    .await?;
    let purged = ask(driver, &object, OperationsCommand::PurgeAll).await?;
    check(purged == 2, || format!("purged {purged}, expected both"))?;
    for id in ["done", "long"] {
        let gone = ask(driver, &object, result("work", id)).await?;
        check(gone["state"] == "not_found", || {
            format!("{id} after purge: {gone}")
        })?;
    }
    let all = events_until(driver, &object, OP_EVENT, |e| {
        !phase(e, "long", "aborted").is_empty()
    })
    .await?;
    let aborted = phase(&all, "long", "aborted");
    check(
        aborted[0]["detail"]["extra"]
            .as_str()
            .is_some_and(|r| r.contains("purged")),
        || format!("the running attempt was not aborted by the purge: {all:?}"),
    )?;
    // A purged id is free again.
    let again = ask(driver, &object, start("work", "long", OpSpec::default())).await?;
    check(again == json!("created"), || {
        format!("a purged id registered again: {again}")
    })
}
