//! The default sharding (§4.5): shards `shard-0 .. shard-<width-1>`, two
//! random candidates per push, the less loaded one wins; the width grows
//! under backlog and shrinks when every recent reply says the shard is
//! shallow and idle.
//!
//! Backlog (message × target pairs still owed) and pressure (work in
//! flight times its average duration, per batch) are compared separately
//! on purpose: they count different things, and folding them into one
//! "drain time" would compare batches with messages.
//!
//! This is a best-effort local router, not a global autoscaler: each client
//! widens from what its own pushes see. Shards outside the current width
//! keep their backlog and drain through their own alarms; random choice
//! gives no order between pushes (a stable key gives affinity, through
//! custom sharding).

use durability_platform::EpochMs;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::observations::{ObservationTable, is_stale};
use crate::load::LoadSnapshot;

/// Default backlog above which a reply widens the client.
pub const DEFAULT_SOFT_BACKLOG_LIMIT: u64 = 1_000;

/// The width grows by at most one per this interval.
pub const WIDEN_INTERVAL_MS: EpochMs = 1_000;

/// The width shrinks by at most one per this interval, and only this long
/// after the last change: the load window, so a shard is only given up
/// after a whole window of evidence that it is not needed.
pub const NARROW_INTERVAL_MS: EpochMs = super::observations::OBSERVATION_TTL_MS;

/// The prefix of the default shard keys: `shard-0`, `shard-1`, ...
pub const SHARD_KEY_PREFIX: &str = "shard-";

/// The default shard key of index `n`.
pub fn shard_key(n: u64) -> String {
    format!("{SHARD_KEY_PREFIX}{n}")
}

/// How the width changed after a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resize {
    Widened,
    Narrowed,
}

/// The state of the default algorithm of one client.
pub(crate) struct Adaptive {
    width: u64,
    /// `None` is the reference's `-Infinity`: the first widening is not
    /// held back.
    last_resize: Option<EpochMs>,
    soft_backlog_limit: u64,
    max_width: Option<u64>,
    rng: SmallRng,
}

impl Adaptive {
    pub(crate) fn new(soft_backlog_limit: u64, max_width: Option<u64>, seed: u64) -> Self {
        Adaptive {
            width: 1,
            last_resize: None,
            soft_backlog_limit,
            max_width,
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    pub(crate) fn width(&self) -> u64 {
        self.width
    }

    /// Two independent candidates in `0..width` (they may be equal).
    pub(crate) fn candidates(&mut self) -> (u64, u64) {
        let a = self.rng.random_range(0..self.width);
        let b = self.rng.random_range(0..self.width);
        (a, b)
    }

    /// Whether a reply with this snapshot, received at `now`, changes the
    /// width, and the change. A stale snapshot changes nothing.
    pub(crate) fn resize(&mut self, load: &LoadSnapshot, now: EpochMs) -> Option<Resize> {
        if is_stale(load.observed_at, now) {
            return None;
        }
        let since_last = |interval: EpochMs| {
            self.last_resize
                .is_none_or(|last| now.saturating_sub(last) >= interval)
        };
        let pending = load.outbound.pending_deliveries;
        if pending > self.soft_backlog_limit {
            let below_max = self.max_width.is_none_or(|max| self.width < max);
            if below_max && since_last(WIDEN_INTERVAL_MS) {
                self.width += 1;
                self.last_resize = Some(now);
                return Some(Resize::Widened);
            }
            return None;
        }
        // `pending < limit / 4` in exact integers (the reference divides
        // floats).
        let shallow = u128::from(pending) * 4 < u128::from(self.soft_backlog_limit);
        let idle = load.inbound.in_flight == 0 && load.outbound.in_flight == 0;
        if self.width > 1 && shallow && idle && since_last(NARROW_INTERVAL_MS) {
            self.width -= 1;
            self.last_resize = Some(now);
            return Some(Resize::Narrowed);
        }
        None
    }
}

/// The two-choice comparison: an unobserved candidate first (exploring
/// beats guessing), then the smaller backlog, then the smaller pressure,
/// then `a`.
pub(crate) fn choose(table: &ObservationTable, a: u64, b: u64) -> u64 {
    let key_a = shard_key(a);
    let Some(load_a) = table.get(&key_a) else {
        return a;
    };
    if a == b {
        return a;
    }
    let key_b = shard_key(b);
    let Some(load_b) = table.get(&key_b) else {
        return b;
    };
    let (backlog_a, backlog_b) = (
        load_a.outbound.pending_deliveries,
        load_b.outbound.pending_deliveries,
    );
    if backlog_a != backlog_b {
        return if backlog_b < backlog_a { b } else { a };
    }
    if pressure(load_b) < pressure(load_a) {
        b
    } else {
        a
    }
}

/// Work in flight weighted by how long such work takes: `in_flight ×
/// average` per direction, an absent average counting as zero.
#[allow(clippy::cast_precision_loss)] // in-flight counts stay far below 2^53
fn pressure(load: &LoadSnapshot) -> f64 {
    load.inbound.in_flight as f64 * load.inbound.average_processing_ms.unwrap_or(0.0)
        + load.outbound.in_flight as f64 * load.outbound.average_processing_ms.unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{LOAD_WINDOW_MS, OutboundProcessing, Processing};

    fn snapshot(at: EpochMs, pending: u64, in_flight: u64, average: Option<f64>) -> LoadSnapshot {
        LoadSnapshot {
            observed_at: at,
            window_ms: LOAD_WINDOW_MS,
            inbound: Processing {
                in_flight,
                completed: 0,
                average_processing_ms: average,
            },
            outbound: OutboundProcessing {
                in_flight: 0,
                completed: 0,
                average_processing_ms: None,
                pending_deliveries: pending,
            },
        }
    }

    #[test]
    fn an_unobserved_candidate_is_explored_first() {
        let mut table = ObservationTable::default();
        table.record("shard-0", snapshot(0, 0, 0, None), 0);
        assert_eq!(choose(&table, 0, 1), 1);
        assert_eq!(choose(&table, 1, 0), 1);
    }

    #[test]
    fn lower_backlog_wins_before_pressure_is_looked_at() {
        let mut table = ObservationTable::default();
        table.record("shard-0", snapshot(0, 5, 0, None), 0);
        table.record("shard-1", snapshot(0, 4, 9, Some(1_000.0)), 0);
        assert_eq!(choose(&table, 0, 1), 1);
    }

    #[test]
    fn equal_backlog_compares_pressure_then_keeps_the_first() {
        let mut table = ObservationTable::default();
        table.record("shard-0", snapshot(0, 5, 2, Some(10.0)), 0);
        table.record("shard-1", snapshot(0, 5, 1, Some(10.0)), 0);
        table.record("shard-2", snapshot(0, 5, 1, Some(10.0)), 0);
        assert_eq!(choose(&table, 0, 1), 1);
        assert_eq!(choose(&table, 1, 2), 1);
        assert_eq!(choose(&table, 2, 1), 2);
    }

    #[test]
    fn narrowing_needs_a_shallow_idle_shard_a_window_after_the_last_change() {
        let mut adaptive = Adaptive::new(1_000, None, 1);
        assert_eq!(
            adaptive.resize(&snapshot(0, 1_001, 0, None), 0),
            Some(Resize::Widened)
        );
        let idle = snapshot(59_999, 249, 0, None);
        assert_eq!(adaptive.resize(&idle, 59_999), None);
        let busy = snapshot(60_000, 249, 1, None);
        assert_eq!(adaptive.resize(&busy, 60_000), None);
        let not_shallow = snapshot(60_000, 250, 0, None);
        assert_eq!(adaptive.resize(&not_shallow, 60_000), None);
        let idle = snapshot(60_000, 249, 0, None);
        assert_eq!(adaptive.resize(&idle, 60_000), Some(Resize::Narrowed));
        assert_eq!(adaptive.width(), 1);
        assert_eq!(
            adaptive.resize(&snapshot(200_000, 0, 0, None), 200_000),
            None
        );
    }

    #[test]
    fn max_width_caps_widening() {
        let mut adaptive = Adaptive::new(10, Some(2), 1);
        for second in 0..5 {
            let now = second * 1_000;
            adaptive.resize(&snapshot(now, 11, 0, None), now);
        }
        assert_eq!(adaptive.width(), 2);
    }
}
