//! The capabilities' metrics: their names (one place, so that the table of
//! docs/observability.md and the tests agree with the code) and the
//! function that turns a lifecycle event into them.
//!
//! Every capability reports through the `metrics` facade and never chooses
//! an exporter: without a recorder installed by the application each call
//! is a no-op. Labels are bounded by the application's code: an operation's
//! name, a named alarm's name, a fanout target, a log consumer, never an
//! object, message or operation id. (The host's own metrics are in
//! `durability_host::telemetry`.)
//!
//! Most series come from the lifecycle events the capabilities already emit
//! after each commit ([`record_event`] runs for every event, hooks or not),
//! so a counter moves exactly when the state it counts committed. The rest
//! (parked deliveries, alarm lateness, the log's records) are one call at
//! the place where the state changed.

use metrics::{counter, histogram};

use crate::lifecycle::{Entity, LifecycleEvent, Outcome, TerminalReason};

/// Counter: deliveries registered by an accepted enqueue, by `target`.
pub const FANOUT_ENQUEUED: &str = "durability_fanout_enqueued_total";
/// Counter: deliveries acknowledged, by `target`.
pub const FANOUT_DELIVERED: &str = "durability_fanout_delivered_total";
/// Counter: failed delivery attempts with a retry scheduled, by `target`.
pub const FANOUT_RETRIED: &str = "durability_fanout_retried_total";
/// Counter: deliveries that ended without an ack (to the DLQ or parked), by
/// `target` and `reason` (`dead_lettered`: the consumer said so;
/// `attempts_exhausted`).
pub const FANOUT_DEAD_LETTERED: &str = "durability_fanout_dead_lettered_total";
/// Counter: dead-lettered deliveries parked in the object (no DLQ), by
/// `target`; a subset of [`FANOUT_DEAD_LETTERED`].
pub const FANOUT_PARKED: &str = "durability_fanout_parked_total";
/// Histogram, seconds: a delivery attempt from claim to its settlement, by
/// `target`.
pub const FANOUT_DELIVERY_DURATION: &str = "durability_fanout_delivery_duration_seconds";

/// Counter: operations registered (not deduplicated ones), by `operation`.
pub const OPERATIONS_REGISTERED: &str = "durability_operations_registered_total";
/// Counter: attempts started, by `operation`.
pub const OPERATIONS_STARTED: &str = "durability_operations_started_total";
/// Counter: operations completed, by `operation`.
pub const OPERATIONS_COMPLETED: &str = "durability_operations_completed_total";
/// Counter: failed attempts, by `operation` and `retry` (`true`: another
/// attempt is scheduled; `false`: the operation failed for good).
pub const OPERATIONS_FAILED: &str = "durability_operations_failed_total";
/// Counter: operations that ended because their attempts were used up
/// before one could run (after crashes), by `operation`.
pub const OPERATIONS_EXHAUSTED: &str = "durability_operations_exhausted_total";
/// Histogram, seconds: an attempt from claim to its settlement, by
/// `operation`.
pub const OPERATIONS_HANDLER_DURATION: &str = "durability_operations_handler_duration_seconds";

/// Counter: named alarms scheduled or rescheduled, by `alarm`.
pub const ALARMS_SCHEDULED: &str = "durability_alarms_scheduled_total";
/// Counter: named alarm attempts started, by `alarm`.
pub const ALARMS_FIRED: &str = "durability_alarms_fired_total";
/// Counter: named alarm occurrences completed, by `alarm`.
pub const ALARMS_COMPLETED: &str = "durability_alarms_completed_total";
/// Counter: failed named alarm attempts, by `alarm` and `retry`.
pub const ALARMS_FAILED: &str = "durability_alarms_failed_total";
/// Counter: named alarm occurrences whose attempts were used up before one
/// could run, by `alarm`.
pub const ALARMS_EXHAUSTED: &str = "durability_alarms_exhausted_total";
/// Histogram, seconds: a named alarm's first attempt, from its scheduled
/// time to its start, by `alarm`.
pub const ALARMS_LATENESS: &str = "durability_alarms_lateness_seconds";
/// Histogram, seconds: a named alarm attempt from claim to settlement, by
/// `alarm`.
pub const ALARMS_HANDLER_DURATION: &str = "durability_alarms_handler_duration_seconds";

/// Counter: records appended to a log.
pub const LOG_APPENDED: &str = "durability_log_appended_records_total";
/// Counter: records returned by log reads.
pub const LOG_READ: &str = "durability_log_read_records_total";
/// Counter: records trimmed from a log's hot table (moved to cold storage
/// or deleted).
pub const LOG_TRIMMED: &str = "durability_log_trimmed_records_total";
/// Histogram, records: how far a consumer's cursor is behind the log's end
/// after each commit of that cursor, by `consumer`.
pub const LOG_CONSUMER_LAG: &str = "durability_log_consumer_lag_records";

/// Every metric name of the capabilities, for docs and tests.
pub const ALL: &[&str] = &[
    FANOUT_ENQUEUED,
    FANOUT_DELIVERED,
    FANOUT_RETRIED,
    FANOUT_DEAD_LETTERED,
    FANOUT_PARKED,
    FANOUT_DELIVERY_DURATION,
    OPERATIONS_REGISTERED,
    OPERATIONS_STARTED,
    OPERATIONS_COMPLETED,
    OPERATIONS_FAILED,
    OPERATIONS_EXHAUSTED,
    OPERATIONS_HANDLER_DURATION,
    ALARMS_SCHEDULED,
    ALARMS_FIRED,
    ALARMS_COMPLETED,
    ALARMS_FAILED,
    ALARMS_EXHAUSTED,
    ALARMS_LATENESS,
    ALARMS_HANDLER_DURATION,
    LOG_APPENDED,
    LOG_READ,
    LOG_TRIMMED,
    LOG_CONSUMER_LAG,
];

/// The per-entity series an event moves: which counter family and label.
struct Family {
    label: &'static str,
    value: String,
    registered: &'static str,
    started: &'static str,
    completed: &'static str,
    failed: &'static str,
    exhausted: &'static str,
    duration: &'static str,
}

fn family(entity: &Entity) -> Family {
    match entity {
        Entity::Operation { operation, .. } => Family {
            label: "operation",
            value: operation.clone(),
            registered: OPERATIONS_REGISTERED,
            started: OPERATIONS_STARTED,
            completed: OPERATIONS_COMPLETED,
            failed: OPERATIONS_FAILED,
            exhausted: OPERATIONS_EXHAUSTED,
            duration: OPERATIONS_HANDLER_DURATION,
        },
        Entity::NamedAlarm { alarm, .. } => Family {
            label: "alarm",
            value: alarm.clone(),
            registered: ALARMS_SCHEDULED,
            started: ALARMS_FIRED,
            completed: ALARMS_COMPLETED,
            failed: ALARMS_FAILED,
            exhausted: ALARMS_EXHAUSTED,
            duration: ALARMS_HANDLER_DURATION,
        },
        Entity::FanoutDelivery { target, .. } => Family {
            label: "target",
            value: target.clone(),
            registered: FANOUT_ENQUEUED,
            // A delivery attempt's start is not a series of its own: the
            // outcomes are what an operator watches.
            started: "",
            completed: FANOUT_DELIVERED,
            failed: FANOUT_RETRIED,
            exhausted: FANOUT_DEAD_LETTERED,
            duration: FANOUT_DELIVERY_DURATION,
        },
    }
}

/// Moves the series `event` concerns. Called by the emitter for every
/// event, after its state committed.
pub(crate) fn record_event(event: &LifecycleEvent) {
    let Some(entity) = event.entity() else {
        return;
    };
    let f = family(entity);
    let label = f.label;
    match event {
        LifecycleEvent::Registered { .. } | LifecycleEvent::Scheduled { .. } => {
            counter!(f.registered, label => f.value).increment(1);
        }
        LifecycleEvent::AttemptStarted { .. } => {
            if !f.started.is_empty() {
                counter!(f.started, label => f.value).increment(1);
            }
        }
        LifecycleEvent::AttemptSettled {
            duration_ms,
            outcome,
            ..
        } => {
            histogram!(f.duration, label => f.value.clone()).record(*duration_ms as f64 / 1_000.0);
            match outcome {
                Outcome::Completed { .. } => {
                    counter!(f.completed, label => f.value).increment(1);
                }
                Outcome::RetryScheduled { .. }
                    if matches!(entity, Entity::FanoutDelivery { .. }) =>
                {
                    counter!(f.failed, label => f.value).increment(1);
                }
                Outcome::RetryScheduled { .. } => {
                    counter!(f.failed, label => f.value, "retry" => "true").increment(1);
                }
                Outcome::Failed { .. } => {
                    counter!(f.failed, label => f.value, "retry" => "false").increment(1);
                }
            }
        }
        LifecycleEvent::Terminal { reason, .. } => {
            if matches!(entity, Entity::FanoutDelivery { .. }) {
                let reason = match reason {
                    TerminalReason::DeadLettered => "dead_lettered",
                    TerminalReason::AttemptsExhausted => "attempts_exhausted",
                };
                counter!(f.exhausted, label => f.value, "reason" => reason).increment(1);
            } else {
                counter!(f.exhausted, label => f.value).increment(1);
            }
        }
        LifecycleEvent::Purged { .. } => {}
    }
}

/// A dead-lettered delivery was parked in its object.
pub(crate) fn fanout_parked(target: &str) {
    counter!(FANOUT_PARKED, "target" => target.to_owned()).increment(1);
}

/// A named alarm's first attempt started `lateness_ms` after its time.
pub(crate) fn alarm_lateness(alarm: &str, lateness_ms: i64) {
    histogram!(ALARMS_LATENESS, "alarm" => alarm.to_owned())
        .record(lateness_ms.max(0) as f64 / 1_000.0);
}

/// `records` were appended to a log.
pub(crate) fn log_appended(records: usize) {
    counter!(LOG_APPENDED).increment(records as u64);
}

/// A read returned `records`.
pub(crate) fn log_read(records: usize) {
    counter!(LOG_READ).increment(records as u64);
}

/// A trim removed `records` from the hot table.
pub(crate) fn log_trimmed(records: u64) {
    counter!(LOG_TRIMMED).increment(records);
}

/// Consumer `consumer` committed a cursor `lag` records behind the end.
pub(crate) fn log_consumer_lag(consumer: &str, lag: u64) {
    histogram!(LOG_CONSUMER_LAG, "consumer" => consumer.to_owned()).record(lag as f64);
}
