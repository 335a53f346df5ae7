//! Recurring named alarms: cron patterns in a time zone, fixed intervals
//! with an anchor and a payload, idempotent registration, pause and
//! resume, and each missed-tick policy across a restart with downtime.

use std::time::Duration;

use durability::alarms::MissedTicks;
use serde_json::{Value, json};

use super::{Driver, ask, check, events, events_until, phase};
use crate::fixture::alarms::ALARM_EVENT;
use crate::{AlarmsCommand, PlatformCommand, RecurrenceSpec};

const DAY_MS: i64 = 86_400_000;
const HOUR_MS: i64 = 3_600_000;

fn recurring(name: &str, recurrence: RecurrenceSpec) -> AlarmsCommand {
    AlarmsCommand::Recurring {
        name: name.into(),
        recurrence,
        missed: MissedTicks::Skip,
        misfire_grace_ms: None,
        payload: Value::Null,
    }
}

fn cron(expression: &str, time_zone: &str) -> RecurrenceSpec {
    RecurrenceSpec::Cron {
        expression: expression.into(),
        time_zone: time_zone.into(),
    }
}

fn cancel(name: &str) -> AlarmsCommand {
    AlarmsCommand::Cancel { name: name.into() }
}

/// The started runs of `name`: (scheduled time, missed, at).
fn runs(events: &[Value], name: &str) -> Vec<(i64, u64, i64)> {
    phase(events, name, "start")
        .iter()
        .filter_map(|e| {
            Some((
                e["detail"]["scheduled_time"].as_i64()?,
                e["detail"]["missed"].as_u64()?,
                e["at_ms"].as_i64()?,
            ))
        })
        .collect()
}

pub(crate) async fn a_cron_schedule_is_computed_in_its_time_zone(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-zones");
    let next_in = |zone: &str| recurring("tick-zone", cron("0 8 * * *", zone));
    let utc = ask(driver, &object, next_in("UTC")).await?;
    let kolkata = ask(driver, &object, next_in("Asia/Kolkata")).await?;
    let new_york = ask(driver, &object, next_in("America/New_York")).await?;
    let offset = |zoned: &Value| {
        utc.as_i64()
            .zip(zoned.as_i64())
            .map(|(utc, zoned)| (zoned - utc).rem_euclid(DAY_MS))
    };
    // 08:00 in Kolkata is 02:30 UTC (5 h 30 before); in New York 12:00 or
    // 13:00 UTC (4 h or 5 h after 08:00 UTC, with or without DST).
    check(
        offset(&kolkata) == Some(DAY_MS - 5 * HOUR_MS - HOUR_MS / 2),
        || format!("08:00 UTC {utc}, 08:00 Asia/Kolkata {kolkata}"),
    )?;
    check(
        matches!(offset(&new_york), Some(o) if o == 4 * HOUR_MS || o == 5 * HOUR_MS),
        || format!("08:00 UTC {utc}, 08:00 America/New_York {new_york}"),
    )?;
    let entry = ask(
        driver,
        &object,
        AlarmsCommand::Get {
            name: "tick-zone".into(),
        },
    )
    .await?;
    check(
        entry["next_run_at"] == new_york && entry["recurring"] == true,
        || format!("the last registration did not replace the schedule: {entry}"),
    )?;
    let bad = ask(driver, &object, next_in("Mars/Olympus_Mons")).await;
    check(
        bad.as_ref().is_err_and(|e| e.contains("Mars/Olympus_Mons")),
        || format!("an unknown time zone: {bad:?}"),
    )?;
    ask(driver, &object, cancel("tick-zone")).await.map(drop)
}

pub(crate) async fn a_seconds_cron_fires_each_tick_on_whole_seconds(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-cron");
    let next = ask(
        driver,
        &object,
        recurring("tick-cron", cron("* * * * * *", "Europe/Paris")),
    )
    .await?;
    check(next.as_i64().is_some_and(|n| n % 1_000 == 0), || {
        format!("next tick {next}")
    })?;
    let all = events_until(driver, &object, ALARM_EVENT, |e| {
        runs(e, "tick-cron").len() >= 3
    })
    .await?;
    ask(driver, &object, cancel("tick-cron")).await?;
    let ticks: Vec<i64> = runs(&all, "tick-cron").iter().map(|r| r.0).collect();
    check(
        ticks.iter().all(|t| t % 1_000 == 0) && ticks.windows(2).all(|w| w[1] > w[0]),
        || format!("ticks not on ascending whole seconds: {ticks:?}"),
    )?;
    // Cancelled: at most the run already under way finishes.
    driver.sleep(Duration::from_millis(1_500)).await;
    let settled = runs(&events(driver, &object, ALARM_EVENT).await?, "tick-cron").len();
    driver.sleep(Duration::from_millis(1_500)).await;
    let later = runs(&events(driver, &object, ALARM_EVENT).await?, "tick-cron").len();
    check(later == settled, || {
        format!("a cancelled schedule kept ticking: {settled} then {later}")
    })
}

pub(crate) async fn an_interval_ticks_at_its_anchor_plus_multiples_with_its_payload(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-every");
    let (every, anchor) = (700_i64, 123_i64);
    let command = AlarmsCommand::Recurring {
        name: "tick-every".into(),
        recurrence: RecurrenceSpec::Every {
            ms: every.unsigned_abs(),
            anchor_ms: Some(anchor),
        },
        missed: MissedTicks::Skip,
        misfire_grace_ms: None,
        payload: json!({ "job": "digest" }),
    };
    ask(driver, &object, command).await?;
    let all = events_until(driver, &object, ALARM_EVENT, |e| {
        runs(e, "tick-every").len() >= 3
    })
    .await?;
    ask(driver, &object, cancel("tick-every")).await?;
    let started = phase(&all, "tick-every", "start");
    check(
        started.iter().all(|e| {
            e["detail"]["payload"] == json!({ "job": "digest" })
                && e["detail"]["scheduled_time"]
                    .as_i64()
                    .is_some_and(|t| (t - anchor).rem_euclid(every) == 0)
        }),
        || format!("ticks off the anchor's grid or without the payload: {started:?}"),
    )
}

pub(crate) async fn registering_the_same_schedule_again_changes_nothing(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-same");
    let every = |ms: u64| {
        recurring(
            "tick-every",
            RecurrenceSpec::Every {
                ms,
                anchor_ms: None,
            },
        )
    };
    let first = ask(driver, &object, every(60_000)).await?;
    driver.sleep(Duration::from_millis(50)).await;
    let again = ask(driver, &object, every(60_000)).await?;
    check(first == again, || {
        format!("registering again moved the next run: {first} then {again}")
    })?;
    let other = ask(driver, &object, every(3_600_000)).await?;
    let entry = ask(
        driver,
        &object,
        AlarmsCommand::Get {
            name: "tick-every".into(),
        },
    )
    .await?;
    check(entry["next_run_at"] == other && entry["runs"] == 0, || {
        format!("a different schedule did not replace it: {entry}")
    })?;
    ask(driver, &object, cancel("tick-every")).await.map(drop)
}

pub(crate) async fn a_paused_schedule_does_not_tick_until_resumed(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-pause");
    let name = "tick-every";
    ask(
        driver,
        &object,
        recurring(
            name,
            RecurrenceSpec::Every {
                ms: 500,
                anchor_ms: None,
            },
        ),
    )
    .await?;
    events_until(driver, &object, ALARM_EVENT, |e| !runs(e, name).is_empty()).await?;
    let paused = ask(driver, &object, AlarmsCommand::Pause { name: name.into() }).await?;
    check(paused == true, || format!("pause answered {paused}"))?;
    let entry = ask(driver, &object, AlarmsCommand::Get { name: name.into() }).await?;
    check(
        entry["state"] == "paused" && entry["next_run_at"].is_null(),
        || format!("paused entry: {entry}"),
    )?;
    // A run under way when the pause came may still finish.
    driver.sleep(Duration::from_millis(600)).await;
    let before = runs(&events(driver, &object, ALARM_EVENT).await?, name).len();
    driver.sleep(Duration::from_millis(1_500)).await;
    let during = runs(&events(driver, &object, ALARM_EVENT).await?, name).len();
    check(during == before, || {
        format!("a paused schedule ticked: {before} then {during}")
    })?;
    let next = ask(driver, &object, AlarmsCommand::Resume { name: name.into() }).await?;
    check(next.is_i64(), || format!("resume answered {next}"))?;
    events_until(driver, &object, ALARM_EVENT, |e| {
        runs(e, name).len() > during
    })
    .await?;
    ask(driver, &object, cancel(name)).await.map(drop)
}

/// Registers `name` every second with `missed`, lets it tick, kills the
/// platform for a few ticks, and returns (the runs before the kill, the
/// runs after the restart) once two ran after it.
async fn across_a_restart(
    driver: &dyn Driver,
    object: &str,
    name: &str,
    missed: MissedTicks,
) -> Result<(Vec<(i64, u64, i64)>, Vec<(i64, u64, i64)>), String> {
    let every = 1_000;
    let downtime = 3_500;
    let command = AlarmsCommand::Recurring {
        name: name.into(),
        recurrence: RecurrenceSpec::Every {
            ms: every,
            anchor_ms: None,
        },
        missed,
        misfire_grace_ms: Some(100),
        payload: Value::Null,
    };
    ask(driver, object, command).await?;
    events_until(driver, object, ALARM_EVENT, |e| !runs(e, name).is_empty()).await?;
    let killed_at = ask(driver, object, PlatformCommand::Now).await?;
    let killed_at = killed_at.as_i64().ok_or("no clock")?;
    driver
        .restart_after(Duration::from_millis(downtime))
        .await?;
    let back = killed_at + i64::try_from(downtime).unwrap_or(0);
    let all = events_until(driver, object, ALARM_EVENT, |e| {
        runs(e, name).iter().filter(|r| r.2 >= back).count() >= 2
    })
    .await?;
    ask(driver, object, cancel(name)).await?;
    let (before, after) = runs(&all, name).into_iter().partition(|r| r.2 < back);
    Ok((before, after))
}

pub(crate) async fn skip_runs_the_next_future_tick_after_a_restart_and_counts_the_missed(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-skip");
    let (before, after) = across_a_restart(driver, &object, "tick-skip", MissedTicks::Skip).await?;
    let last = before.last().map(|r| r.0).ok_or("no run before the kill")?;
    let first = after[0];
    // The ticks of the downtime did not run; the first run after it is a
    // tick still ahead when it was placed, told how many it skipped.
    check(first.1 >= 2 && first.0 >= last + 3_000, || {
        format!("before {before:?}, after {after:?}")
    })?;
    check(after[1].0 == first.0 + 1_000 && after[1].1 == 0, || {
        format!("the schedule did not go on after the skip: {after:?}")
    })
}

pub(crate) async fn run_once_runs_the_latest_missed_tick_once_after_a_restart(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-run-once");
    let (before, after) =
        across_a_restart(driver, &object, "tick-once", MissedTicks::RunOnce).await?;
    let last = before.last().map(|r| r.0).ok_or("no run before the kill")?;
    let first = after[0];
    // One run for the latest missed tick (already past when it ran),
    // standing for the earlier ones.
    check(
        first.1 >= 2 && first.0 >= last + 3_000 && first.0 < first.2,
        || format!("before {before:?}, after {after:?}"),
    )?;
    check(after[1].0 == first.0 + 1_000 && after[1].1 == 0, || {
        format!("the missed ticks ran more than once: {after:?}")
    })
}

pub(crate) async fn catch_up_runs_each_of_the_latest_missed_ticks_after_a_restart(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-catch-up");
    let (before, after) = across_a_restart(
        driver,
        &object,
        "tick-catchup",
        MissedTicks::CatchUp { max: 2 },
    )
    .await?;
    let last = before.last().map(|r| r.0).ok_or("no run before the kill")?;
    let (first, second) = (after[0], after[1]);
    // The latest two missed ticks run one after the other (both past when
    // they ran); the first is told how many older ones were dropped.
    check(
        first.1 >= 1
            && first.0 >= last + 2_000
            && second.0 == first.0 + 1_000
            && second.1 == 0
            && second.0 < second.2,
        || format!("before {before:?}, after {after:?}"),
    )
}
