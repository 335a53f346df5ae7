//! Flow control per target (issue 14): the gate in front of a target's
//! claim. Limits live in memory (the builder's, or the last
//! [`Fanout::set_flow_control`](super::Fanout::set_flow_control)); pause
//! is durable (a column of the target's cursor, see `store`).
//!
//! A gate decides only how many deliveries the next claim may take: a
//! held-back target claims nothing and its cursor stays where it is, so a
//! limit never drops, dead-letters or reorders anything.
//!
//! Must not write SQL (that is `store`) or decide settlement.

use std::time::Duration;

use durability_platform::{EpochMs, MAX_TIMER_MS};

use crate::error::ConfigError;
use crate::limits;
use crate::retry::whole_millis;

/// Flow control of one target: at most `concurrency` deliveries in flight,
/// and at most `deliveries` per `interval` (a token bucket that holds
/// `deliveries` tokens and refills continuously at that rate).
///
/// ```
/// use std::time::Duration;
/// use durability::fanout::FlowControl;
///
/// // At most 4 in flight, at most 50 a second (a burst of 50 at most).
/// let webhook = FlowControl::new()
///     .concurrency(4)
///     .rate_limit(50, Duration::from_secs(1));
/// # let _ = webhook;
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlowControl {
    concurrency: Option<usize>,
    rate: Option<(usize, Duration)>,
}

impl FlowControl {
    /// No limit: the target gets batches of the fanout's `max_batch_size`
    /// as fast as it settles them.
    pub fn new() -> Self {
        FlowControl::default()
    }

    /// Most deliveries of this target in flight at once (handed over and
    /// not yet returned or timed out). From 1 to 100,000. One batch of a
    /// target is in flight at a time, so this caps the batch size; a value
    /// above `max_batch_size` changes nothing.
    pub fn concurrency(mut self, deliveries: usize) -> Self {
        self.concurrency = Some(deliveries);
        self
    }

    /// At most `deliveries` (from 1 to 100,000) handed over per `interval`
    /// (whole milliseconds, from 1 ms to 2^31 - 1 ms). A token bucket:
    /// it starts full, holds at most `deliveries` tokens (the largest
    /// burst), refills continuously, and every delivery handed over takes
    /// one, retries included.
    pub fn rate_limit(mut self, deliveries: usize, interval: Duration) -> Self {
        self.rate = Some((deliveries, interval));
        self
    }

    /// The validated limits; errors name the setter and the rule.
    pub(crate) fn validate(&self) -> Result<Limits, ConfigError> {
        let concurrency = match self.concurrency {
            Some(value) => {
                limits::check_setting("concurrency", value, limits::MAX_ITEMS_PER_CALL_LIMIT)?;
                Some(value)
            }
            None => None,
        };
        let rate = match self.rate {
            Some((deliveries, interval)) => {
                limits::check_setting(
                    "rate_limit.deliveries",
                    deliveries,
                    limits::MAX_ITEMS_PER_CALL_LIMIT,
                )?;
                let interval_ms = whole_millis("rate_limit.interval", interval)?;
                if interval_ms == 0 || interval_ms > MAX_TIMER_MS {
                    return Err(ConfigError::DurationOutOfRange {
                        field: "rate_limit.interval".into(),
                        min_ms: 1,
                        max_ms: MAX_TIMER_MS,
                    });
                }
                Some(Rate {
                    deliveries: u64::try_from(deliveries).unwrap_or(u64::MAX),
                    interval_ms,
                })
            }
            None => None,
        };
        Ok(Limits { concurrency, rate })
    }
}

/// Validated limits of one target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub concurrency: Option<usize>,
    pub rate: Option<Rate>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rate {
    pub deliveries: u64,
    pub interval_ms: u64,
}

/// The in-memory gate of one target: its limits and its token bucket.
///
/// The bucket counts in integer units so that no rate drifts: one token is
/// `interval_ms` units and it refills `deliveries` units per millisecond,
/// so `deliveries` tokens come back per `interval_ms` exactly.
#[derive(Debug, Clone)]
pub(crate) struct Gate {
    limits: Limits,
    /// Units in the bucket at `at`.
    level: u64,
    at: EpochMs,
}

impl Gate {
    /// A gate with a full bucket.
    pub fn new(limits: Limits, now: EpochMs) -> Self {
        let mut gate = Gate {
            limits,
            level: 0,
            at: now,
        };
        gate.level = gate.capacity();
        gate
    }

    /// New limits; the tokens already earned stay, up to the new capacity
    /// (a target that had no rate starts with a full bucket).
    pub fn change(&mut self, limits: Limits, now: EpochMs) {
        let had_rate = self.limits.rate.is_some();
        self.refill(now);
        self.limits = limits;
        self.level = if had_rate {
            self.level.min(self.capacity())
        } else {
            self.capacity()
        };
    }

    /// Whether the gate limits nothing (it need not be kept).
    pub fn is_open(&self) -> bool {
        self.limits.concurrency.is_none() && self.limits.rate.is_none()
    }

    fn capacity(&self) -> u64 {
        self.limits
            .rate
            .map_or(0, |rate| rate.deliveries.saturating_mul(rate.interval_ms))
    }

    fn refill(&mut self, now: EpochMs) {
        let Some(rate) = self.limits.rate else {
            return;
        };
        let elapsed = u64::try_from(now.saturating_sub(self.at))
            .unwrap_or(0)
            .min(rate.interval_ms);
        self.level = self
            .level
            .saturating_add(elapsed.saturating_mul(rate.deliveries))
            .min(self.capacity());
        self.at = self.at.max(now);
    }

    /// The most one claim takes: the batch size, cut by the concurrency.
    fn batch(&self, batch: usize) -> usize {
        match self.limits.concurrency {
            Some(concurrency) => batch.min(concurrency),
            None => batch,
        }
    }

    /// How many tokens a rate-limited target waits for before it claims:
    /// a whole batch (at most the bucket's size), so that a limited target
    /// with a backlog costs one claim per batch, not one per token.
    fn threshold(&self, batch: usize) -> u64 {
        let batch = u64::try_from(self.batch(batch)).unwrap_or(u64::MAX);
        self.limits
            .rate
            .map_or(1, |rate| batch.min(rate.deliveries).max(1))
    }

    /// How many deliveries the next claim may take now (0: none).
    pub fn allowance(&mut self, now: EpochMs, batch: usize) -> usize {
        let allowed = self.batch(batch);
        let threshold = self.threshold(batch);
        match self.limits.rate {
            Some(rate) => {
                self.refill(now);
                let tokens = self.level / rate.interval_ms;
                if tokens < threshold {
                    return 0;
                }
                allowed.min(usize::try_from(tokens).unwrap_or(usize::MAX))
            }
            None => allowed,
        }
    }

    /// Takes one token per delivery handed over (a range claimed before a
    /// crash may take more than the bucket holds: it empties it).
    pub fn take(&mut self, deliveries: usize, now: EpochMs) {
        if let Some(rate) = self.limits.rate {
            self.refill(now);
            let units = u64::try_from(deliveries)
                .unwrap_or(u64::MAX)
                .saturating_mul(rate.interval_ms);
            self.level = self.level.saturating_sub(units);
        }
    }

    /// When the target may claim again: `now` when it may already, later
    /// when it is rate limited and short of a batch's tokens.
    pub fn next_token_at(&self, now: EpochMs, batch: usize) -> EpochMs {
        let Some(rate) = self.limits.rate else {
            return now;
        };
        let mut gate = self.clone();
        gate.refill(now);
        let wanted = gate.threshold(batch).saturating_mul(rate.interval_ms);
        if gate.level >= wanted {
            return now;
        }
        let missing = wanted - gate.level;
        let wait = missing.div_ceil(rate.deliveries.max(1));
        now.saturating_add(EpochMs::try_from(wait).unwrap_or(EpochMs::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(deliveries: usize, interval_ms: u64) -> Gate {
        let limits = FlowControl::new()
            .rate_limit(deliveries, Duration::from_millis(interval_ms))
            .validate()
            .unwrap();
        Gate::new(limits, 0)
    }

    #[test]
    fn a_bucket_starts_full_and_refills_at_its_rate_without_drift() {
        let mut gate = gate(3, 1_000);
        assert_eq!(gate.allowance(0, 10), 3);
        gate.take(3, 0);
        assert_eq!(gate.allowance(0, 10), 0);
        // One token per 333.33 ms, and a claim waits for a batch's worth
        // (here the bucket's 3, or 1 with batches of 1).
        assert_eq!(gate.next_token_at(0, 1), 334);
        assert_eq!(gate.next_token_at(0, 10), 1_000);
        assert_eq!(gate.allowance(333, 1), 0);
        assert_eq!(gate.allowance(334, 10), 0);
        assert_eq!(gate.allowance(334, 1), 1);
        gate.take(1, 334);
        assert_eq!(gate.next_token_at(334, 1), 667);
        // Over 3,000 intervals exactly 9,000 tokens come back.
        let mut taken = 0;
        for now in 1..=3_000_000 {
            let n = gate.allowance(334 + now, 2);
            gate.take(n, 334 + now);
            taken += n;
        }
        assert!((8_999..=9_001).contains(&taken), "{taken}");
    }

    #[test]
    fn bad_settings_name_their_setter_and_rule() {
        let error = FlowControl::new().concurrency(0).validate().unwrap_err();
        assert!(error.to_string().starts_with("concurrency"), "{error}");
        let error = FlowControl::new()
            .rate_limit(0, Duration::from_secs(1))
            .validate()
            .unwrap_err();
        assert!(
            error.to_string().starts_with("rate_limit.deliveries"),
            "{error}"
        );
        let error = FlowControl::new()
            .rate_limit(1, Duration::from_micros(1_500))
            .validate()
            .unwrap_err();
        assert!(
            matches!(error, ConfigError::NotWholeMilliseconds { ref field, .. } if field == "rate_limit.interval")
        );
        let error = FlowControl::new()
            .rate_limit(1, Duration::ZERO)
            .validate()
            .unwrap_err();
        assert!(
            matches!(error, ConfigError::DurationOutOfRange { ref field, min_ms: 1, .. } if field == "rate_limit.interval")
        );
    }
}
