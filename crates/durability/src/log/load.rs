//! The log's load snapshot (queues.md §2.3 shape, §5.9 backlog).
//!
//! In memory and advisory: appends in flight and those finished within the
//! last minute, plus the durable backlog, which for a log is the lag of the
//! furthest-behind consumer. The log records no outbound work (consumers
//! pull). Counters reset when the object is evicted; the backlog is read
//! from storage every time.
//!
//! Memory is bounded: one bucket per second of the window, whatever the
//! traffic.

use std::cell::{Cell, RefCell};

use durability_platform::EpochMs;
use serde::Serialize;

/// The window the counters cover.
pub const LOAD_WINDOW_MS: u64 = 60_000;

const BUCKETS: usize = 60;

/// How busy one direction of an object is.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessingStats {
    /// Calls running now.
    pub in_flight: u64,
    /// Calls that finished within the window.
    pub completed: u64,
    /// Their mean duration; `None` when none finished (never 0 for "no
    /// samples").
    pub average_processing_ms: Option<f64>,
}

/// The outbound side: work the object owes others.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OutboundStats {
    /// Calls running now (always 0 for a log).
    pub in_flight: u64,
    /// Calls that finished within the window (always 0 for a log).
    pub completed: u64,
    /// Their mean duration (always `None` for a log).
    pub average_processing_ms: Option<f64>,
    /// The durable backlog: for a log, the lag of the slowest consumer.
    pub pending_deliveries: u64,
}

/// A point-in-time view of an object's load, for producers and routers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadSnapshot {
    /// When it was taken (epoch ms).
    pub observed_at: EpochMs,
    /// The window of the `completed` counters (60 000 ms).
    pub window_ms: u64,
    /// Appends.
    pub inbound: ProcessingStats,
    /// Owed work.
    pub outbound: OutboundStats,
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    second: i64,
    count: u64,
    duration_ms: u64,
}

/// Append counters: in flight now, and a ring of per-second buckets.
#[derive(Debug)]
pub(super) struct AppendCounters {
    in_flight: Cell<u64>,
    buckets: RefCell<[Bucket; BUCKETS]>,
}

impl Default for AppendCounters {
    fn default() -> Self {
        AppendCounters {
            in_flight: Cell::new(0),
            buckets: RefCell::new([Bucket::default(); BUCKETS]),
        }
    }
}

impl AppendCounters {
    /// An append starts; returns its start time for [`Self::finish`].
    pub fn begin(&self, now: EpochMs) -> EpochMs {
        self.in_flight.set(self.in_flight.get() + 1);
        now
    }

    /// An append that began at `started` ends. A sample counts in the second
    /// it finished in.
    pub fn finish(&self, started: EpochMs, now: EpochMs) {
        self.in_flight.set(self.in_flight.get().saturating_sub(1));
        let second = now.div_euclid(1_000);
        let slot = usize::try_from(second.rem_euclid(60)).unwrap_or(0);
        let mut buckets = self.buckets.borrow_mut();
        if let Some(bucket) = buckets.get_mut(slot) {
            if bucket.second != second || bucket.count == 0 {
                *bucket = Bucket {
                    second,
                    count: 0,
                    duration_ms: 0,
                };
            }
            bucket.count += 1;
            bucket.duration_ms += u64::try_from(now.saturating_sub(started)).unwrap_or(0);
        }
    }

    /// The snapshot at `now` with `pending` as the backlog.
    pub fn snapshot(&self, now: EpochMs, pending: u64) -> LoadSnapshot {
        let current = now.div_euclid(1_000);
        let (completed, duration_ms) = self
            .buckets
            .borrow()
            .iter()
            .filter(|b| b.count > 0 && b.second > current - 60 && b.second <= current)
            .fold((0u64, 0u64), |(c, d), b| (c + b.count, d + b.duration_ms));
        #[allow(clippy::cast_precision_loss)] // counts in one minute are far below 2^53
        let average_processing_ms = (completed > 0).then(|| duration_ms as f64 / completed as f64);
        LoadSnapshot {
            observed_at: now,
            window_ms: LOAD_WINDOW_MS,
            inbound: ProcessingStats {
                in_flight: self.in_flight.get(),
                completed,
                average_processing_ms,
            },
            outbound: OutboundStats {
                in_flight: 0,
                completed: 0,
                average_processing_ms: None,
                pending_deliveries: pending,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_samples_is_none_never_zero_and_old_samples_drop_out() {
        let counters = AppendCounters::default();
        assert_eq!(counters.snapshot(0, 0).inbound.average_processing_ms, None);
        let started = counters.begin(1_000);
        assert_eq!(counters.snapshot(1_000, 0).inbound.in_flight, 1);
        counters.finish(started, 1_004);
        let snapshot = counters.snapshot(1_500, 7);
        assert_eq!(snapshot.inbound.in_flight, 0);
        assert_eq!(snapshot.inbound.completed, 1);
        assert_eq!(snapshot.inbound.average_processing_ms, Some(4.0));
        assert_eq!(snapshot.outbound.pending_deliveries, 7);
        assert_eq!(counters.snapshot(61_000, 0).inbound.completed, 0);
    }
}
