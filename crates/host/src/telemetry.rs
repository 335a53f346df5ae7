//! The host's metrics: their names (one place, so the docs table and the
//! tests agree with the code) and the few helpers that record them through
//! the `metrics` facade.
//!
//! The host never installs a recorder: an application that installs one
//! (for example `metrics-exporter-prometheus`, which `durability-axum`
//! serves at `GET /metrics`) sees these series; without one every call is a
//! no-op costing an atomic load. Labels are bounded: a namespace is a name
//! in the application's code, never an object id or name.

use std::time::Duration;

use metrics::{counter, gauge, histogram};

/// Gauge: objects in memory on this host (constructed, not yet evicted).
pub const LIVE_OBJECTS: &str = "durability_host_live_objects";
/// Counter: objects constructed, by `namespace`.
pub const OBJECTS_CONSTRUCTED: &str = "durability_host_objects_constructed_total";
/// Counter: objects evicted (idle, to make room under the cap, explicitly,
/// or at shutdown).
pub const EVICTIONS: &str = "durability_host_evictions_total";
/// Counter: transactions committed to object files.
pub const COMMITS: &str = "durability_host_commits_total";
/// Counter: syncs to disk the host asked for: one per object commit with
/// `synchronous=FULL`, one per alarm-index write that must be durable, and
/// with group commit one per journal sync (a flush, a checkpoint), or one
/// per WAL file (and new directory) a flush or the journal syncs.
pub const FSYNCS: &str = "durability_host_fsyncs_total";
/// Counter: deliveries of an object's alarm, by `namespace` (retries too).
pub const ALARM_FIRES: &str = "durability_host_alarm_fires_total";
/// Histogram, seconds: how late a first delivery of an alarm started after
/// its time, by `namespace`.
pub const ALARM_LATENESS: &str = "durability_host_alarm_lateness_seconds";
/// Histogram, seconds: a stub call from send to reply, by `namespace`.
pub const CALL_DURATION: &str = "durability_host_call_duration_seconds";

/// Gauge, seconds: how long the oldest journal pass not yet shipped to the
/// archive has waited (0 when the archive is caught up; see
/// [`crate::archive`]).
pub const ARCHIVE_LAG: &str = "durability_host_archive_lag_seconds";

/// Every metric name of the host, for docs and tests.
pub const ALL: &[&str] = &[
    LIVE_OBJECTS,
    OBJECTS_CONSTRUCTED,
    EVICTIONS,
    COMMITS,
    FSYNCS,
    ALARM_FIRES,
    ALARM_LATENESS,
    CALL_DURATION,
    ARCHIVE_LAG,
];

pub(crate) fn live_objects(count: usize) {
    gauge!(LIVE_OBJECTS).set(count as f64);
}

pub(crate) fn constructed(namespace: &str) {
    counter!(OBJECTS_CONSTRUCTED, "namespace" => namespace.to_owned()).increment(1);
}

pub(crate) fn evicted() {
    counter!(EVICTIONS).increment(1);
}

pub(crate) fn committed(synced: bool) {
    counter!(COMMITS).increment(1);
    if synced {
        fsynced();
    }
}

pub(crate) fn fsynced() {
    counter!(FSYNCS).increment(1);
}

pub(crate) fn alarm_fired(namespace: &str, lateness_ms: Option<i64>) {
    counter!(ALARM_FIRES, "namespace" => namespace.to_owned()).increment(1);
    if let Some(ms) = lateness_ms {
        histogram!(ALARM_LATENESS, "namespace" => namespace.to_owned())
            .record(ms.max(0) as f64 / 1_000.0);
    }
}

pub(crate) fn call_finished(namespace: &str, elapsed: Duration) {
    histogram!(CALL_DURATION, "namespace" => namespace.to_owned()).record(elapsed.as_secs_f64());
}

pub(crate) fn archive_lag(lag_ms: i64) {
    gauge!(ARCHIVE_LAG).set(lag_ms.max(0) as f64 / 1_000.0);
}
