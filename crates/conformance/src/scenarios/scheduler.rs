//! The scheduler: one physical alarm for every capability, one FIFO pool,
//! the minimum alarm delay (nearer work runs from memory), the platform's
//! alarm info on a retried delivery, and the fallback alarm a failed run
//! arms for itself.

use serde_json::json;

use super::{Driver, ask, check, events_until, eventually, phase};
use crate::fixture::alarms::ALARM_EVENT;
use crate::fixture::operations::OP_EVENT;
use crate::fixture::scheduler::ALARM_RETRY_EVENT;
use crate::{
    ALARM_CONCURRENCY, ALARM_MIN_DELAY, AlarmsCommand, OpSpec, OperationsCommand, SchedulerCommand,
};

fn schedule(name: &str, in_ms: i64) -> AlarmsCommand {
    AlarmsCommand::Schedule {
        name: name.into(),
        in_ms,
    }
}

fn min_delay_ms() -> i64 {
    i64::try_from(ALARM_MIN_DELAY.as_millis()).unwrap_or(i64::MAX)
}

pub(crate) async fn one_physical_alarm_follows_the_earliest_work_of_every_capability(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-shared");
    let reminder_at = ask(driver, &object, schedule("reminder", 6_000)).await?;
    let alarm = ask(driver, &object, SchedulerCommand::PhysicalAlarm).await?;
    check(alarm["alarm"] == reminder_at, || {
        format!("alarm {alarm} is not the named alarm's time {reminder_at}")
    })?;
    // An operation whose retries come sooner pulls the one alarm forward.
    let start = OperationsCommand::Start {
        operation: "flaky".into(),
        id: "early".into(),
        spec: OpSpec {
            fail_times: 2,
            ..OpSpec::default()
        },
    };
    ask(driver, &object, start).await?;
    let earlier = eventually(driver, &object, SchedulerCommand::PhysicalAlarm, |v| {
        v["alarm"]
            .as_i64()
            .zip(reminder_at.as_i64())
            .is_some_and(|(a, r)| a < r)
    })
    .await?;
    check(
        earlier["alarm"]
            .as_i64()
            .zip(earlier["now"].as_i64())
            .is_some_and(|(a, now)| a - now <= min_delay_ms()),
        || format!("the operation's retry did not bring the alarm within the min delay: {earlier}"),
    )?;
    let result = OperationsCommand::Result {
        operation: "flaky".into(),
        id: "early".into(),
    };
    eventually(driver, &object, result, |v| v["state"] == "completed").await?;
    // Back to the named alarm, then nothing once it fired.
    eventually(driver, &object, SchedulerCommand::PhysicalAlarm, |v| {
        v["alarm"] == reminder_at
    })
    .await?;
    events_until(driver, &object, ALARM_EVENT, |e| {
        !phase(e, "reminder", "end").is_empty()
    })
    .await?;
    eventually(driver, &object, SchedulerCommand::PhysicalAlarm, |v| {
        v["alarm"].is_null()
    })
    .await
    .map(drop)
}

pub(crate) async fn the_pool_runs_at_most_its_concurrency_in_fifo_order(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-pool");
    let ids: Vec<String> = (1..=6).map(|i| format!("p{i}")).collect();
    for id in &ids {
        let start = OperationsCommand::Start {
            operation: "work".into(),
            id: id.clone(),
            spec: OpSpec {
                sleep_ms: 300,
                sleep_attempts: 1,
                ..OpSpec::default()
            },
        };
        ask(driver, &object, start).await?;
    }
    let all = events_until(driver, &object, OP_EVENT, |e| {
        e.iter().filter(|e| e["detail"]["phase"] == "end").count() == ids.len()
    })
    .await?;
    let started: Vec<String> = all
        .iter()
        .filter(|e| e["detail"]["phase"] == "start")
        .filter_map(|e| e["name"].as_str().map(str::to_owned))
        .collect();
    check(started == ids, || {
        format!("start order {started:?}, expected {ids:?}")
    })?;
    // Walk the record in order: +1 at a start, -1 at an end.
    let (mut running, mut most) = (0_i64, 0_i64);
    for event in &all {
        match event["detail"]["phase"].as_str() {
            Some("start") => running += 1,
            Some("end") => running -= 1,
            _ => {}
        }
        most = most.max(running);
    }
    check(most == ALARM_CONCURRENCY as i64, || {
        format!("at most {most} ran at once, the pool holds {ALARM_CONCURRENCY}: {all:?}")
    })
}

pub(crate) async fn work_inside_the_min_delay_runs_from_memory_and_the_alarm_stays_beyond_it(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-near");
    let in_ms = 300;
    let at = ask(driver, &object, schedule("reminder", in_ms)).await?;
    let alarm = ask(driver, &object, SchedulerCommand::PhysicalAlarm).await?;
    let scheduled_from = at.as_i64().map(|at| at - in_ms);
    check(
        alarm["alarm"]
            .as_i64()
            .zip(scheduled_from)
            .is_some_and(|(alarm, from)| alarm >= from + min_delay_ms()),
        || format!("the physical alarm {alarm} is closer than the min delay to {scheduled_from:?}"),
    )?;
    let fired = events_until(driver, &object, ALARM_EVENT, |e| {
        !phase(e, "reminder", "end").is_empty()
    })
    .await?;
    let end = phase(&fired, "reminder", "end");
    check(
        end.len() == 1 && end[0]["detail"]["platform"].is_null(),
        || format!("the near alarm did not run from the in-memory timer: {fired:?}"),
    )?;
    let runs = ask(driver, &object, SchedulerCommand::AlarmRuns).await?;
    check(runs.as_array().is_some_and(Vec::is_empty), || {
        format!("the physical alarm was delivered for work the timer ran: {runs}")
    })
}

pub(crate) async fn work_beyond_the_min_delay_runs_from_the_physical_alarm(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-far");
    let at = ask(driver, &object, schedule("reminder", 2_500)).await?;
    let alarm = ask(driver, &object, SchedulerCommand::PhysicalAlarm).await?;
    check(alarm["alarm"] == at, || {
        format!("the physical alarm {alarm} is not the work's time {at}")
    })?;
    let fired = events_until(driver, &object, ALARM_EVENT, |e| {
        !phase(e, "reminder", "end").is_empty()
    })
    .await?;
    let end = phase(&fired, "reminder", "end")[0];
    check(end["detail"]["platform"]["is_retry"] == false, || {
        format!("the far alarm did not run from the physical alarm: {end}")
    })?;
    check(
        end["at_ms"]
            .as_i64()
            .zip(at.as_i64())
            .is_some_and(|(ran, at)| ran >= at),
        || format!("the far alarm ran before its time {at}: {end}"),
    )
}

pub(crate) async fn alarm_info_reaches_a_retried_alarm(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-retry");
    ask(
        driver,
        &object,
        SchedulerCommand::FailNextAlarms { count: 1 },
    )
    .await?;
    // Beyond the scheduler's minimum alarm delay: the physical alarm runs it.
    ask(driver, &object, schedule("reminder", 2_000)).await?;
    // The platform retries the failed delivery (after about 2 s) and says so.
    let runs = eventually(driver, &object, SchedulerCommand::AlarmRuns, |v| {
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
    let fired = events_until(driver, &object, ALARM_EVENT, |e| {
        !phase(e, "reminder", "end").is_empty()
    })
    .await?;
    // The handler sees the retried delivery's info too.
    let end = phase(&fired, "reminder", "end");
    check(
        end.len() == 1
            && end[0]["detail"]["platform"] == json!({ "retry_count": 1, "is_retry": true }),
        || format!("the handler saw {fired:?}"),
    )
}

pub(crate) async fn a_failed_run_arms_its_own_fallback_and_the_platform_sees_no_failure(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-fallback");
    ask(driver, &object, schedule("reminder", 1_500)).await?;
    ask(driver, &object, SchedulerCommand::BreakNamedAlarms).await?;
    let retries = events_until(driver, &object, ALARM_RETRY_EVENT, |e| !e.is_empty()).await?;
    check(
        retries[0]["detail"]["retry_in_ms"] == min_delay_ms(),
        || format!("the fallback is not one min delay out: {retries:?}"),
    )?;
    ask(driver, &object, SchedulerCommand::RepairNamedAlarms).await?;
    // The fallback alarm, not a platform retry, runs the work.
    events_until(driver, &object, ALARM_EVENT, |e| {
        !phase(e, "reminder", "end").is_empty()
    })
    .await?;
    let runs = ask(driver, &object, SchedulerCommand::AlarmRuns).await?;
    let runs = runs.as_array().cloned().unwrap_or_default();
    check(
        runs.len() >= 2
            && runs
                .iter()
                .all(|r| r["is_retry"] == false && r["failed"] == false),
        || format!("the platform saw a failure or no fallback delivery: {runs:?}"),
    )?;
    eventually(driver, &object, SchedulerCommand::PhysicalAlarm, |v| {
        v["alarm"].is_null()
    })
    .await
    .map(drop)
}
