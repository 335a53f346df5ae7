//! Named alarms: replace, one active handler per name, a stable
//! idempotency key per occurrence, timeouts with and without
//! `retry_timeouts`, attempts used up, cancel, list and purge.

use std::time::Duration;

use serde_json::Value;

use super::{Driver, ask, check, events, events_until, eventually, phase};
use crate::AlarmsCommand;
use crate::fixture::alarms::{ALARM_EVENT, ALARM_MAX_ATTEMPTS};

fn schedule(name: &str, in_ms: i64) -> AlarmsCommand {
    AlarmsCommand::Schedule {
        name: name.into(),
        in_ms,
    }
}

fn get(name: &str) -> AlarmsCommand {
    AlarmsCommand::Get { name: name.into() }
}

/// The attempts of alarm `name` that reached `phase`.
async fn wait_for(
    driver: &dyn Driver,
    object: &str,
    name: &str,
    phase_name: &str,
    count: usize,
) -> Result<Vec<Value>, String> {
    events_until(driver, object, ALARM_EVENT, |e| {
        phase(e, name, phase_name).len() >= count
    })
    .await
}

pub(crate) async fn named_alarm_replace_and_fire(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-alarms");
    ask(driver, &object, schedule("reminder", 3_600_000)).await?;
    // Replaces the occurrence an hour out: only this one fires.
    ask(driver, &object, schedule("reminder", 300)).await?;
    wait_for(driver, &object, "reminder", "end", 1).await?;
    let gone = ask(driver, &object, get("reminder")).await?;
    check(gone.is_null(), || {
        format!("a fired one-shot alarm is still listed: {gone}")
    })?;
    driver.sleep(Duration::from_millis(1_200)).await;
    let all = events(driver, &object, ALARM_EVENT).await?;
    check(phase(&all, "reminder", "start").len() == 1, || {
        format!("fired: {all:?}")
    })
}

pub(crate) async fn one_handler_runs_per_name_at_a_time(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-exclusive");
    ask(driver, &object, schedule("slow", 0)).await?;
    wait_for(driver, &object, "slow", "start", 1).await?;
    // A replacement while the first occurrence runs waits for it to end.
    ask(driver, &object, schedule("slow", 0)).await?;
    let all = wait_for(driver, &object, "slow", "end", 2).await?;
    let phases: Vec<&str> = all
        .iter()
        .filter(|e| e["name"] == "slow")
        .filter_map(|e| e["detail"]["phase"].as_str())
        .collect();
    check(phases == ["start", "end", "start", "end"], || {
        format!("two handlers of one name overlapped: {phases:?}")
    })
}

pub(crate) async fn the_idempotency_key_is_stable_across_retries_and_new_per_occurrence(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-keys");
    ask(driver, &object, schedule("flaky", 0)).await?;
    let first = wait_for(driver, &object, "flaky", "end", 1).await?;
    let keys = |events: &[Value]| -> Vec<String> {
        events
            .iter()
            .filter(|e| e["name"] == "flaky" && e["detail"]["phase"] == "start")
            .filter_map(|e| e["detail"]["idempotency_key"].as_str().map(str::to_owned))
            .collect()
    };
    let occurrence = keys(&first);
    check(
        occurrence.len() == 2
            && occurrence[0] == occurrence[1]
            && occurrence[0].starts_with(durability::alarms::IDEMPOTENCY_KEY_PREFIX),
        || format!("the retry of one occurrence changed its key: {occurrence:?}"),
    )?;
    ask(driver, &object, schedule("flaky", 0)).await?;
    let second = wait_for(driver, &object, "flaky", "end", 2).await?;
    let all = keys(&second);
    check(
        all.len() == 4 && all[2] == all[3] && all[2] != all[0],
        || format!("a new occurrence kept the old key: {all:?}"),
    )
}

pub(crate) async fn a_timed_out_alarm_fails_without_retry_timeouts(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-hang");
    ask(driver, &object, schedule("hang", 0)).await?;
    let failed = eventually(driver, &object, get("hang"), |v| v["state"] == "failed").await?;
    check(failed["attempt"] == 1, || {
        format!("a timeout was retried: {failed}")
    })?;
    let all = events(driver, &object, ALARM_EVENT).await?;
    check(
        phase(&all, "hang", "aborted").len() == 1 && phase(&all, "hang", "start").len() == 1,
        || format!("the timed-out attempt: {all:?}"),
    )
}

pub(crate) async fn with_retry_timeouts_a_timed_out_alarm_is_retried(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-hang-retried");
    ask(driver, &object, schedule("hang_retried", 0)).await?;
    let all = wait_for(driver, &object, "hang_retried", "end", 1).await?;
    let end = phase(&all, "hang_retried", "end");
    check(
        end[0]["attempt"] == 2 && phase(&all, "hang_retried", "aborted").len() == 1,
        || format!("the timeout was not retried: {all:?}"),
    )?;
    let gone = ask(driver, &object, get("hang_retried")).await?;
    check(gone.is_null(), || {
        format!("a succeeded alarm is still listed: {gone}")
    })
}

pub(crate) async fn attempts_used_up_fail_a_named_alarm(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-broken");
    ask(driver, &object, schedule("broken", 0)).await?;
    let failed = eventually(driver, &object, get("broken"), |v| v["state"] == "failed").await?;
    let last = format!("attempt {ALARM_MAX_ATTEMPTS} fails");
    check(
        failed["attempt"] == ALARM_MAX_ATTEMPTS && failed["last_error"] == last,
        || format!("attempts used up: {failed}"),
    )?;
    let all = events(driver, &object, ALARM_EVENT).await?;
    check(
        phase(&all, "broken", "start").len() == ALARM_MAX_ATTEMPTS as usize,
        || format!("attempts beyond the limit: {all:?}"),
    )
}

pub(crate) async fn cancel_deletes_a_pending_alarm(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-cancel");
    ask(driver, &object, schedule("reminder", 1_200)).await?;
    let cancel = AlarmsCommand::Cancel {
        name: "reminder".into(),
    };
    let first = ask(driver, &object, cancel.clone()).await?;
    let second = ask(driver, &object, cancel).await?;
    check(first == true && second == false, || {
        format!("cancel answered {first}, then {second}")
    })?;
    let gone = ask(driver, &object, get("reminder")).await?;
    check(gone.is_null(), || {
        format!("a cancelled alarm is listed: {gone}")
    })?;
    driver.sleep(Duration::from_millis(2_200)).await;
    let all = events(driver, &object, ALARM_EVENT).await?;
    check(all.is_empty(), || format!("a cancelled alarm ran: {all:?}"))
}

pub(crate) async fn list_shows_every_alarm_and_purge_deletes_them(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-list");
    let reminder_at = ask(driver, &object, schedule("reminder", 600_000)).await?;
    let broken_at = ask(driver, &object, schedule("broken", 1_200_000)).await?;
    let listed = ask(driver, &object, AlarmsCommand::List).await?;
    let entries = listed.as_array().cloned().unwrap_or_default();
    check(
        entries.len() == 2
            && entries[0]["name"] == "broken"
            && entries[0]["next_run_at"] == broken_at
            && entries[1]["name"] == "reminder"
            && entries[1]["next_run_at"] == reminder_at
            && entries
                .iter()
                .all(|e| e["state"] == "pending" && e["attempt"] == 0),
        || format!("list: {listed}"),
    )?;
    let purged = ask(driver, &object, AlarmsCommand::PurgeAll).await?;
    check(purged == 2, || format!("purged {purged}"))?;
    let after = ask(driver, &object, AlarmsCommand::List).await?;
    check(after.as_array().is_some_and(Vec::is_empty), || {
        format!("after purge: {after}")
    })
}

pub(crate) async fn an_alarm_without_a_handler_is_refused(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-unknown");
    let refused = ask(driver, &object, schedule("nope", 100)).await;
    check(refused.as_ref().is_err_and(|e| e.contains("nope")), || {
        format!("an alarm without a handler: {refused:?}")
    })?;
    let listed = ask(driver, &object, AlarmsCommand::List).await?;
    check(listed.as_array().is_some_and(Vec::is_empty), || {
        format!("a refused alarm was written: {listed}")
    })
}
