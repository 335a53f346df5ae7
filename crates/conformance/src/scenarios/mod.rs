//! The scenarios, written once against a [`Driver`], one module per
//! capability.
//!
//! A scenario sends [`Command`]s to objects by name, sleeps in real time and
//! may restart the platform; it returns `Err` with what it saw when an
//! expectation fails. Nothing here knows which platform runs the objects.
//! Waits poll with [`eventually`] up to [`SETTLE_TIMEOUT`] instead of
//! sleeping for a guessed time, and expectations are about order and
//! counts, not about milliseconds, because CI shares two cores with builds.

mod alarms;
mod fanout;
mod limits;
mod log;
mod migrations;
mod operations;
mod platform;
mod recurring;
mod routing;
mod scheduler;

use std::time::Duration;

use durability_platform::LocalBoxFuture;
use serde_json::Value;

use crate::{Command, SETTLE_TIMEOUT};

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
    /// Stops the platform abruptly (a process kill where there is a
    /// process), keeps it down for `downtime`, and starts it again on the
    /// same storage.
    fn restart_after(&self, downtime: Duration) -> LocalBoxFuture<'_, Result<(), String>>;
    /// [`Driver::restart_after`] without downtime.
    fn restart(&self) -> LocalBoxFuture<'_, Result<(), String>> {
        self.restart_after(Duration::ZERO)
    }
}

/// A scenario's body: the driver, and the scenario's name to prefix its
/// objects' names with.
pub type Body = for<'a> fn(&'a dyn Driver, &'a str) -> LocalBoxFuture<'a, Result<(), String>>;

/// A scenario: its name and its body.
pub type Scenario = (&'static str, Body);

macro_rules! scenarios {
    ($($module:ident::$name:ident),* $(,)?) => {
        &[$((stringify!($name), |driver, prefix| Box::pin($module::$name(driver, prefix)))),*]
    };
}

/// Every scenario, in the order they run.
pub const ALL: &[Scenario] = scenarios![
    migrations::migrations_on_a_fresh_object,
    migrations::migrating_a_built_object_again_applies_nothing,
    migrations::a_capability_applies_its_whole_list_once,
    migrations::down_scripts_revert_to_a_named_target_and_to_none,
    migrations::an_older_version_reverts_what_it_does_not_know_from_the_stored_down,
    migrations::a_failing_up_script_rolls_back_its_whole_batch,
    migrations::an_unknown_target_is_refused_and_changes_nothing,
    platform::rolled_back_transaction_leaves_neither_rows_nor_alarm,
    platform::integers_are_stored_exactly_or_refused,
    platform::real_two_reads_back_as_f64,
    platform::pending_work_survives_a_restart_and_finishes_from_the_alarm,
    limits::a_statement_binds_at_most_100_parameters,
    limits::a_value_over_2_mb_is_refused_and_nothing_is_written,
    limits::a_statement_text_over_100_kb_is_refused,
    limits::body_limits_the_platform_cannot_store_are_refused_naming_the_setter,
    limits::an_alarm_handoff_stays_below_the_platforms_cpu_limit,
    limits::a_backlog_of_100000_deliveries_drains_over_several_invocations,
    limits::a_trim_of_20000_records_stops_at_its_share_of_the_cpu_limit,
    scheduler::one_physical_alarm_follows_the_earliest_work_of_every_capability,
    scheduler::the_pool_runs_at_most_its_concurrency_in_fifo_order,
    scheduler::work_inside_the_min_delay_runs_from_memory_and_the_alarm_stays_beyond_it,
    scheduler::work_beyond_the_min_delay_runs_from_the_physical_alarm,
    scheduler::alarm_info_reaches_a_retried_alarm,
    scheduler::a_failed_run_arms_its_own_fallback_and_the_platform_sees_no_failure,
    operations::operation_start_dedup_retry_result,
    operations::an_id_names_one_operation_and_unknown_operations_are_refused,
    operations::an_operation_starts_eagerly_without_the_alarm,
    operations::wait_returns_when_the_operation_settles_or_at_its_timeout,
    operations::a_timed_out_attempt_is_aborted_and_retried,
    operations::timeouts_on_every_attempt_use_up_the_attempts,
    operations::a_non_retryable_error_fails_at_once,
    operations::attempts_used_up_fail_with_the_last_error,
    operations::purge_deletes_operations_and_aborts_running_attempts,
    alarms::named_alarm_replace_and_fire,
    alarms::one_handler_runs_per_name_at_a_time,
    alarms::the_idempotency_key_is_stable_across_retries_and_new_per_occurrence,
    alarms::a_timed_out_alarm_fails_without_retry_timeouts,
    alarms::with_retry_timeouts_a_timed_out_alarm_is_retried,
    alarms::attempts_used_up_fail_a_named_alarm,
    alarms::cancel_deletes_a_pending_alarm,
    alarms::list_shows_every_alarm_and_purge_deletes_them,
    alarms::an_alarm_without_a_handler_is_refused,
    recurring::a_cron_schedule_is_computed_in_its_time_zone,
    recurring::a_seconds_cron_fires_each_tick_on_whole_seconds,
    recurring::an_interval_ticks_at_its_anchor_plus_multiples_with_its_payload,
    recurring::registering_the_same_schedule_again_changes_nothing,
    recurring::a_paused_schedule_does_not_tick_until_resumed,
    recurring::skip_runs_the_next_future_tick_after_a_restart_and_counts_the_missed,
    recurring::run_once_runs_the_latest_missed_tick_once_after_a_restart,
    recurring::catch_up_runs_each_of_the_latest_missed_ticks_after_a_restart,
    fanout::fanout_batch_two_targets_retry_dead_letter_parked,
    fanout::a_batch_with_a_conflicting_key_is_rejected_whole,
    fanout::the_same_message_again_is_accepted_without_new_work,
    fanout::a_paused_target_never_holds_back_another,
    fanout::deliveries_come_in_batches_of_at_most_max_batch_size,
    fanout::ack_on_return_acks_what_the_consumer_left_unsettled,
    fanout::a_failing_consumer_retries_only_what_it_left_unsettled,
    fanout::a_non_retryable_consumer_error_parks_at_once,
    fanout::attempts_used_up_park_the_delivery_as_exhausted,
    fanout::a_parked_delivery_is_redriven_as_new_work,
    fanout::purge_parked_removes_only_the_named_entries,
    fanout::a_rate_limited_target_gets_no_more_than_its_rate,
    fanout::a_concurrency_limited_target_gets_one_delivery_at_a_time,
    log::log_append_read_commit,
    log::a_key_with_another_body_is_a_conflict_and_writes_nothing,
    log::reads_page_by_limit_and_report_the_lag,
    log::a_cursor_only_moves_forward_and_never_past_the_end,
    log::leases_hand_out_ranges_and_acks_move_the_cursor_in_order,
    log::an_expired_lease_is_handed_out_again_and_the_old_holder_is_fenced,
    log::a_nacked_range_is_handed_out_again_at_once,
    log::retention_moves_the_oldest_records_to_readable_cold_segments,
    log::a_forgotten_or_lost_segment_is_truncation,
    routing::a_load_snapshot_counts_backlog_and_work_done,
    routing::the_routing_client_widens_over_four_objects_under_backlog,
    routing::sharding_by_lane_reaches_exactly_the_named_objects,
];

/// `Ok` when `ok`, else `Err` with what was seen.
pub(crate) fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok { Ok(()) } else { Err(what()) }
}

/// Sends one command.
pub(crate) async fn ask(
    driver: &dyn Driver,
    object: &str,
    command: impl Into<Command>,
) -> Result<Value, String> {
    driver.call(object, command.into()).await
}

/// Sends `command` until `done` accepts the answer or the settle timeout
/// passes.
pub(crate) async fn eventually(
    driver: &dyn Driver,
    object: &str,
    command: impl Into<Command>,
    done: impl Fn(&Value) -> bool,
) -> Result<Value, String> {
    let command = command.into();
    let step = Duration::from_millis(200);
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

/// What the object's handlers recorded under `kind`.
pub(crate) async fn events(
    driver: &dyn Driver,
    object: &str,
    kind: &str,
) -> Result<Vec<Value>, String> {
    let all = driver
        .call(object, Command::Events { kind: kind.into() })
        .await?;
    Ok(all.as_array().cloned().unwrap_or_default())
}

/// Waits until the events of `kind` satisfy `done`, and returns them.
pub(crate) async fn events_until(
    driver: &dyn Driver,
    object: &str,
    kind: &str,
    done: impl Fn(&[Value]) -> bool,
) -> Result<Vec<Value>, String> {
    let answer = eventually(driver, object, Command::Events { kind: kind.into() }, |v| {
        v.as_array().is_some_and(|events| done(events))
    })
    .await?;
    Ok(answer.as_array().cloned().unwrap_or_default())
}

/// The events about `name` in `phase` (the `detail.phase` of operation and
/// alarm events).
pub(crate) fn phase<'a>(events: &'a [Value], name: &str, phase: &str) -> Vec<&'a Value> {
    events
        .iter()
        .filter(|e| e["name"] == name && e["detail"]["phase"] == phase)
        .collect()
}
