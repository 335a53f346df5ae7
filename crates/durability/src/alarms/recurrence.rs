//! When a recurring named alarm is due: its rule (a cron pattern in an IANA
//! time zone, or a fixed interval), and what happens to ticks nobody ran.
//!
//! Pure computation: no storage, no clock. `alarms` stores a
//! [`Recurrence`] with its schedule row and asks it two questions: "the
//! first tick after this time" (after each run commits) and "this stored
//! tick was picked up late, what runs now" (`Recurrence::place`).
//!
//! # Ticks and time zones
//!
//! A cron pattern has five fields (minute granularity) or six (seconds
//! first), parsed by `croner` (POSIX/Vixie fields plus `L`, `#`, `W`, and
//! `@daily`-style aliases; day-of-month and day-of-week match when either
//! does, as in Vixie cron). It is evaluated on the wall clock of its IANA
//! time zone; the zone database is the one `jiff` bundles, so every
//! platform (wasm32 included) resolves zones identically and the result
//! does not depend on the machine's `/usr/share/zoneinfo`.
//!
//! Daylight-saving transitions (decided by `croner`, pinned by this
//! crate's tests):
//! - a wall-clock time the clocks skip (02:30 on a spring-forward night in
//!   Europe) runs once, at the first instant after the gap (03:00), never
//!   twice and never not at all;
//! - a wall-clock time that happens twice (02:30 on a fall-back night) runs
//!   once, at its first instant, when the pattern names a fixed hour;
//! - a pattern with a wildcard or stepped hour (`0 * * * *`) is an
//!   interval: it follows real time, so it skips the hour that does not
//!   exist and runs in both copies of the repeated hour. An hourly pattern
//!   therefore runs exactly once per real hour, 8,760 times a year.
//!
//! A fixed interval ignores time zones: its ticks are
//! `anchor + n × interval` on the absolute time line (default anchor: the
//! Unix epoch, so every hour ticks on the full UTC hour).
//!
//! # Missed ticks
//!
//! A tick is *missed* when, at the moment its occurrence is picked up for
//! a first attempt, it is overdue by more than the misfire grace (default
//! 60 s) or the following tick is already due. That happens when the host
//! was down or the object evicted across ticks, or when an occurrence's
//! retries ran past later ticks (a retry never shifts later ticks; they
//! become missed instead). [`MissedTicks`] says what runs then; whatever
//! runs is told its own tick (`scheduled_time`) and how many ticks before
//! it did not run (`missed`).

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use croner::Cron;
use croner::parser::{CronParser, Seconds};
use durability_platform::{EpochMs, MAX_SAFE_INTEGER};
use jiff::Timestamp;
use jiff::tz::TimeZone;
use serde::{Deserialize, Serialize};

/// Default time a tick may be overdue and still count as on time.
pub const DEFAULT_MISFIRE_GRACE: Duration = Duration::from_secs(60);
/// Largest `max` of [`MissedTicks::CatchUp`]: the ticks to run are held in
/// memory while they are computed.
pub const MAX_CATCH_UP_TICKS: u32 = 10_000;
/// A cron schedule counts missed ticks one by one up to this many; past it
/// the count stops there (reported as this value) and the remaining ticks
/// are found by searching back from now, so a month-long outage of an
/// every-second schedule costs a bounded amount of work.
pub const MAX_COUNTED_MISSED_TICKS: u64 = 100_000;

/// What runs when ticks were missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case")]
pub enum MissedTicks {
    /// Run none of the missed ticks; the next run is the next tick that is
    /// not missed (a tick still inside its grace runs now), and it is told
    /// how many were skipped. The default, as in cron.
    #[default]
    Skip,
    /// Run once, now, for the latest missed tick, told how many earlier
    /// ticks it stands for; then go on with the next future tick.
    RunOnce,
    /// Run each of the latest `max` missed ticks, one at a time in tick
    /// order, then go on; the first is told how many older ticks were
    /// dropped beyond `max`. 1 to [`MAX_CATCH_UP_TICKS`].
    CatchUp {
        /// How many missed ticks run at most.
        max: u32,
    },
}

/// Bad recurring-schedule input: names the field and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecurrenceError {
    /// The cron pattern does not parse.
    #[error("cron expression {expression:?} is invalid: {detail}")]
    InvalidCron {
        /// The pattern as given.
        expression: String,
        /// Why `croner` rejected it.
        detail: String,
    },
    /// The time zone is not in the bundled IANA database.
    #[error("time zone {name:?} is not an IANA time zone name (such as \"Europe/Paris\")")]
    UnknownTimeZone {
        /// The name as given.
        name: String,
    },
    /// A numeric option is outside its range.
    #[error("{field} must be between {min} and {max}, got {value}")]
    OutOfRange {
        /// The option.
        field: &'static str,
        /// Smallest allowed value.
        min: u64,
        /// Largest allowed value.
        max: u64,
        /// The value given.
        value: u64,
    },
    /// The anchor applies to fixed intervals only.
    #[error("anchored_at applies to a fixed interval, not to cron {expression:?}")]
    AnchorOnCron {
        /// The cron pattern.
        expression: String,
    },
    /// The schedule has no tick after the given time (a pattern that never
    /// matches, such as February 30, or a tick beyond the safe range).
    #[error("schedule {schedule} has no tick after {after_ms} ms")]
    NoNextTick {
        /// The schedule, described.
        schedule: String,
        /// The time searched from (epoch ms).
        after_ms: EpochMs,
    },
}

/// A recurring schedule: a rule, a missed-tick policy and a misfire grace.
///
/// ```
/// use std::time::Duration;
/// use durability::alarms::{MissedTicks, Recurrence};
///
/// let digest = Recurrence::cron("0 8 * * *", "Europe/Paris")?;
/// // 2025-06-01T00:00:00Z: the next 08:00 in Paris is 06:00 UTC (CEST).
/// assert_eq!(digest.next_after(1_748_736_000_000), Some(1_748_757_600_000));
///
/// let heartbeat = Recurrence::every(Duration::from_secs(30))?
///     .missed_ticks(MissedTicks::CatchUp { max: 10 });
/// assert_eq!(heartbeat.next_after(45_000), Some(60_000));
/// # Ok::<(), durability::alarms::RecurrenceError>(())
/// ```
#[derive(Clone)]
pub struct Recurrence {
    spec: Spec,
    compiled: Compiled,
}

/// The stored form: what a schedule row keeps and what "the same
/// schedule" means when it is registered again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Spec {
    rule: Rule,
    missed: MissedTicks,
    misfire_grace_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Rule {
    Cron {
        expression: String,
        time_zone: String,
    },
    Interval {
        every_ms: u64,
        anchor_ms: EpochMs,
    },
}

#[derive(Clone)]
enum Compiled {
    Cron { cron: Box<Cron>, zone: TimeZone },
    Interval { every: i64, anchor: i64 },
}

/// What runs now for an occurrence that was picked up late.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Run the occurrence of `tick` now, telling it `missed`.
    Run { tick: EpochMs, missed: u64 },
    /// Run nothing now; the next occurrence is `tick`, still ahead, and it
    /// will be told `missed`.
    Wait { tick: EpochMs, missed: u64 },
    /// The schedule has no tick left.
    Finished,
}

impl Recurrence {
    /// A cron pattern (5 fields, or 6 with seconds first) evaluated in the
    /// IANA time zone `time_zone` (`"UTC"` for none).
    pub fn cron(expression: &str, time_zone: &str) -> Result<Recurrence, RecurrenceError> {
        let spec = Spec {
            rule: Rule::Cron {
                expression: expression.to_owned(),
                time_zone: time_zone.to_owned(),
            },
            missed: MissedTicks::default(),
            misfire_grace_ms: duration_ms(DEFAULT_MISFIRE_GRACE),
        };
        Recurrence::compile(spec)
    }

    /// A fixed interval on the absolute time line, from 1 ms up to
    /// 2^53 - 1 ms, ticking at whole multiples of it since the Unix epoch
    /// (see [`Recurrence::anchored_at`]).
    pub fn every(interval: Duration) -> Result<Recurrence, RecurrenceError> {
        let spec = Spec {
            rule: Rule::Interval {
                every_ms: duration_ms(interval),
                anchor_ms: 0,
            },
            missed: MissedTicks::default(),
            misfire_grace_ms: duration_ms(DEFAULT_MISFIRE_GRACE),
        };
        Recurrence::compile(spec)
    }

    /// Moves a fixed interval's ticks to `anchor + n × interval` (epoch ms,
    /// 0 to 2^53 - 1). Not for cron patterns.
    pub fn anchored_at(self, anchor_ms: EpochMs) -> Result<Recurrence, RecurrenceError> {
        let Spec {
            rule,
            missed,
            misfire_grace_ms,
        } = self.spec;
        let rule = match rule {
            Rule::Interval { every_ms, .. } => Rule::Interval {
                every_ms,
                anchor_ms,
            },
            Rule::Cron { expression, .. } => {
                return Err(RecurrenceError::AnchorOnCron { expression });
            }
        };
        Recurrence::compile(Spec {
            rule,
            missed,
            misfire_grace_ms,
        })
    }

    /// The missed-tick policy. Default [`MissedTicks::Skip`].
    pub fn missed_ticks(mut self, policy: MissedTicks) -> Recurrence {
        self.spec.missed = policy;
        self
    }

    /// How long a tick may be overdue and still run as on time. Default
    /// 60 s; whole milliseconds up to 2^53 - 1.
    pub fn misfire_grace(mut self, grace: Duration) -> Recurrence {
        self.spec.misfire_grace_ms = duration_ms(grace);
        self
    }

    /// The missed-tick policy.
    pub fn missed_policy(&self) -> MissedTicks {
        self.spec.missed
    }

    /// The first tick strictly after `after` (epoch ms), or `None` when the
    /// schedule has none within the safe integer range.
    pub fn next_after(&self, after: EpochMs) -> Option<EpochMs> {
        let next = match &self.compiled {
            Compiled::Interval { every, anchor } => {
                let steps = after.checked_sub(*anchor)?.div_euclid(*every);
                anchor.checked_add(steps.checked_add(1)?.checked_mul(*every)?)?
            }
            Compiled::Cron { cron, zone } => {
                // Ticks are whole seconds: searching after the second that
                // holds `after` finds the first tick after `after` itself.
                let start = Timestamp::from_second(after.div_euclid(1_000))
                    .ok()?
                    .to_zoned(zone.clone());
                let next = cron.find_next_occurrence(&start, false).ok()?;
                next.timestamp().as_millisecond()
            }
        };
        (0..=MAX_SAFE_INTEGER).contains(&next).then_some(next)
    }

    /// The last tick at or before `at`, if any in the safe range.
    fn last_at_or_before(&self, at: EpochMs) -> Option<EpochMs> {
        let last = match &self.compiled {
            Compiled::Interval { every, anchor } => {
                let steps = at.checked_sub(*anchor)?.div_euclid(*every);
                anchor.checked_add(steps.checked_mul(*every)?)?
            }
            Compiled::Cron { cron, zone } => {
                let start = Timestamp::from_second(at.div_euclid(1_000))
                    .ok()?
                    .to_zoned(zone.clone());
                let last = cron.find_previous_occurrence(&start, true).ok()?;
                last.timestamp().as_millisecond()
            }
        };
        (0..=MAX_SAFE_INTEGER).contains(&last).then_some(last)
    }

    /// Whether `tick`, picked up at `now`, is missed: overdue by more than
    /// the grace, or already followed by a due tick.
    pub(crate) fn is_missed(&self, tick: EpochMs, now: EpochMs) -> bool {
        let grace = i64::try_from(self.spec.misfire_grace_ms).unwrap_or(i64::MAX);
        now.saturating_sub(tick) > grace || self.next_after(tick).is_some_and(|next| next <= now)
    }

    /// Decides what runs for the occurrence of `tick` (which already carries
    /// `carried` missed ticks) when it is picked up missed at `now`.
    pub(crate) fn place(&self, tick: EpochMs, carried: u64, now: EpochMs) -> Placement {
        let keep = match self.spec.missed {
            MissedTicks::CatchUp { max } => usize::try_from(max).unwrap_or(usize::MAX) + 1,
            MissedTicks::Skip | MissedTicks::RunOnce => 1,
        };
        let scan = self.scan(tick, now, keep);
        let Some(&latest) = scan.tail.back() else {
            // `tick` itself is after `now`: nothing is missed yet.
            return Placement::Wait {
                tick,
                missed: carried,
            };
        };
        let grace = i64::try_from(self.spec.misfire_grace_ms).unwrap_or(i64::MAX);
        // The latest due tick is followed by a future one by construction,
        // so only its own lateness decides.
        let latest_on_time = now.saturating_sub(latest) <= grace;
        let missed_ticks = scan.count - u64::from(latest_on_time);
        match self.spec.missed {
            MissedTicks::Skip if latest_on_time => Placement::Run {
                tick: latest,
                missed: carried.saturating_add(missed_ticks),
            },
            MissedTicks::Skip => match scan.next {
                Some(next) => Placement::Wait {
                    tick: next,
                    missed: carried.saturating_add(missed_ticks),
                },
                None => Placement::Finished,
            },
            MissedTicks::RunOnce => Placement::Run {
                tick: latest,
                missed: carried.saturating_add(scan.count - 1),
            },
            MissedTicks::CatchUp { max } => {
                let runs = missed_ticks.min(u64::from(max)) + u64::from(latest_on_time);
                // `tail` holds the last min(max + 1, count) ticks and
                // `runs <= min(max + 1, count)`, so the index is in range.
                let from_end = usize::try_from(runs).unwrap_or(usize::MAX);
                let first = scan.tail.len().saturating_sub(from_end);
                Placement::Run {
                    tick: scan.tail.get(first).copied().unwrap_or(latest),
                    missed: carried.saturating_add(scan.count - runs),
                }
            }
        }
    }

    /// The ticks from `tick` through `now`: how many, the last `keep` of
    /// them, and the first one after `now`.
    fn scan(&self, tick: EpochMs, now: EpochMs, keep: usize) -> Scan {
        let mut scan = Scan {
            count: 0,
            tail: VecDeque::with_capacity(keep.min(1_024)),
            next: None,
        };
        if tick > now {
            scan.next = Some(tick);
            return scan;
        }
        if let Compiled::Interval { every, .. } = &self.compiled {
            // Arithmetic: `tick` lies on the grid, so the due ticks are
            // tick, tick + every, ..., last.
            let last = self.last_at_or_before(now).unwrap_or(tick).max(tick);
            let count = u64::try_from((last - tick) / every).unwrap_or(0) + 1;
            scan.count = count;
            let kept = count.min(u64::try_from(keep).unwrap_or(u64::MAX));
            for back in (0..kept).rev() {
                let back = i64::try_from(back).unwrap_or(0);
                scan.tail.push_back(last - back * every);
            }
            scan.next = last.checked_add(*every);
            return scan;
        }
        let mut cursor = Some(tick);
        while let Some(at) = cursor {
            if at > now {
                scan.next = Some(at);
                return scan;
            }
            scan.count += 1;
            if scan.tail.len() == keep {
                scan.tail.pop_front();
            }
            scan.tail.push_back(at);
            if scan.count >= MAX_COUNTED_MISSED_TICKS {
                break;
            }
            cursor = self.next_after(at);
        }
        if cursor.is_none() {
            return scan;
        }
        // Too many to count one by one: the tail is found backwards from now.
        let mut tail = VecDeque::new();
        let mut at = self.last_at_or_before(now);
        while let Some(t) = at {
            if tail.len() == keep || t <= scan.tail.back().copied().unwrap_or(tick) {
                break;
            }
            tail.push_front(t);
            at = self.last_at_or_before(t - 1);
        }
        if !tail.is_empty() {
            scan.tail = tail;
        }
        scan.next = self.next_after(now);
        scan
    }

    /// Validates the options that builders cannot reject on the spot.
    pub(crate) fn validate(&self) -> Result<(), RecurrenceError> {
        if let MissedTicks::CatchUp { max } = self.spec.missed
            && !(1..=MAX_CATCH_UP_TICKS).contains(&max)
        {
            return Err(RecurrenceError::OutOfRange {
                field: "missed_ticks.catch_up.max",
                min: 1,
                max: u64::from(MAX_CATCH_UP_TICKS),
                value: u64::from(max),
            });
        }
        check_safe("misfire_grace (ms)", self.spec.misfire_grace_ms, 0)
    }

    /// The stored form, as JSON.
    pub(crate) fn to_stored(&self) -> String {
        // A struct of strings and integers always serializes.
        serde_json::to_string(&self.spec).unwrap_or_default()
    }

    /// Rebuilds a schedule from its stored form.
    pub(crate) fn from_stored(text: &str) -> Result<Recurrence, String> {
        let spec: Spec = serde_json::from_str(text).map_err(|e| e.to_string())?;
        Recurrence::compile(spec).map_err(|e| e.to_string())
    }

    fn compile(spec: Spec) -> Result<Recurrence, RecurrenceError> {
        let compiled = match &spec.rule {
            Rule::Cron {
                expression,
                time_zone,
            } => {
                let cron = CronParser::builder()
                    .seconds(Seconds::Optional)
                    .build()
                    .parse(expression)
                    .map_err(|error| RecurrenceError::InvalidCron {
                        expression: expression.clone(),
                        detail: error.to_string(),
                    })?;
                let zone = jiff::tz::db().get(time_zone).map_err(|_| {
                    RecurrenceError::UnknownTimeZone {
                        name: time_zone.clone(),
                    }
                })?;
                Compiled::Cron {
                    cron: Box::new(cron),
                    zone,
                }
            }
            Rule::Interval {
                every_ms,
                anchor_ms,
            } => {
                check_safe("interval (ms)", *every_ms, 1)?;
                check_safe(
                    "anchored_at (epoch ms)",
                    u64::try_from(*anchor_ms).unwrap_or(u64::MAX),
                    0,
                )?;
                // Both were range-checked against 2^53 - 1 just above.
                Compiled::Interval {
                    every: i64::try_from(*every_ms).unwrap_or(i64::MAX),
                    anchor: *anchor_ms,
                }
            }
        };
        Ok(Recurrence { spec, compiled })
    }
}

impl PartialEq for Recurrence {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
    }
}

impl Eq for Recurrence {}

impl fmt::Debug for Recurrence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recurrence")
            .field("rule", &self.spec.rule)
            .field("missed", &self.spec.missed)
            .field("misfire_grace_ms", &self.spec.misfire_grace_ms)
            .finish()
    }
}

impl fmt::Display for Recurrence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.spec.rule {
            Rule::Cron {
                expression,
                time_zone,
            } => write!(f, "cron {expression:?} in {time_zone}"),
            Rule::Interval {
                every_ms,
                anchor_ms: 0,
            } => write!(f, "every {every_ms} ms"),
            Rule::Interval {
                every_ms,
                anchor_ms,
            } => write!(f, "every {every_ms} ms from {anchor_ms}"),
        }
    }
}

struct Scan {
    /// Ticks in [tick, now]; at most [`MAX_COUNTED_MISSED_TICKS`] for cron.
    count: u64,
    /// The last ticks at or before now, ascending.
    tail: VecDeque<EpochMs>,
    /// The first tick after now.
    next: Option<EpochMs>,
}

fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn check_safe(field: &'static str, value: u64, min: u64) -> Result<(), RecurrenceError> {
    let max = u64::try_from(MAX_SAFE_INTEGER).unwrap_or(u64::MAX);
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(RecurrenceError::OutOfRange {
            field,
            min,
            max,
            value,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR_MS: i64 = 3_600_000;
    /// 2025-03-30T00:00:00Z: the night Europe springs forward (02:00 -> 03:00 local).
    const SPRING_2025_MS: i64 = 1_743_292_800_000;
    /// 2025-10-26T00:00:00Z: the night Europe falls back (03:00 -> 02:00 local).
    const AUTUMN_2025_MS: i64 = 1_761_436_800_000;

    fn ticks(recurrence: &Recurrence, from: EpochMs, count: usize) -> Vec<EpochMs> {
        let mut ticks = Vec::with_capacity(count);
        let mut at = from;
        for _ in 0..count {
            at = recurrence.next_after(at).unwrap();
            ticks.push(at);
        }
        ticks
    }

    #[test]
    fn a_skipped_local_time_runs_once_right_after_the_gap() {
        let nightly = Recurrence::cron("30 2 * * *", "Europe/Paris").unwrap();
        // 02:30 does not exist on 30 March: 03:00 CEST = 01:00Z.
        let spring = ticks(&nightly, SPRING_2025_MS - 12 * HOUR_MS, 2);
        assert_eq!(
            spring,
            [
                SPRING_2025_MS + HOUR_MS,
                SPRING_2025_MS + 24 * HOUR_MS + 30 * 60_000
            ]
        );
    }

    #[test]
    fn a_repeated_local_time_runs_once_at_its_first_instant() {
        let nightly = Recurrence::cron("30 2 * * *", "Europe/Paris").unwrap();
        // 02:30 CEST = 00:30Z; the second 02:30 (CET, 01:30Z) does not run.
        let autumn = ticks(&nightly, AUTUMN_2025_MS - 12 * HOUR_MS, 2);
        assert_eq!(
            autumn,
            [
                AUTUMN_2025_MS + 30 * 60_000,
                AUTUMN_2025_MS + 25 * HOUR_MS + 30 * 60_000
            ]
        );
    }

    #[test]
    fn an_hourly_pattern_follows_real_hours_through_both_changes() {
        let hourly = Recurrence::cron("0 * * * *", "Europe/Paris").unwrap();
        for night in [SPRING_2025_MS, AUTUMN_2025_MS] {
            let run = ticks(&hourly, night - 1, 6);
            let expected: Vec<EpochMs> = (0..6).map(|h| night + h * HOUR_MS).collect();
            assert_eq!(run, expected);
        }
    }

    #[test]
    fn intervals_tick_on_their_anchor_grid() {
        let every = Recurrence::every(Duration::from_millis(300))
            .unwrap()
            .anchored_at(100)
            .unwrap();
        assert_eq!(every.next_after(0), Some(100));
        assert_eq!(every.next_after(100), Some(400));
        assert_eq!(every.next_after(399), Some(400));
        assert_eq!(every.last_at_or_before(399), Some(100));
    }

    fn per_second(policy: MissedTicks) -> Recurrence {
        Recurrence::every(Duration::from_millis(1_000))
            .unwrap()
            .missed_ticks(policy)
    }

    #[test]
    fn a_late_tick_inside_the_grace_is_not_missed() {
        let every_second = per_second(MissedTicks::Skip).misfire_grace(Duration::from_millis(300));
        assert!(!every_second.is_missed(5_000, 5_300));
        assert!(every_second.is_missed(5_000, 5_301));
        // The next tick is due: missed whatever the grace.
        let lenient = per_second(MissedTicks::Skip);
        assert!(lenient.is_missed(5_000, 6_000));
    }

    #[test]
    fn each_policy_places_a_late_tick_as_documented() {
        // Ticks 5_000 .. 9_000 are due at 9_500; the grace (60 s) keeps
        // 9_000 on time, so catch-up runs it after the two missed ones.
        let now = 9_500;
        assert_eq!(
            per_second(MissedTicks::Skip).place(5_000, 2, now),
            Placement::Run {
                tick: 9_000,
                missed: 6
            }
        );
        assert_eq!(
            per_second(MissedTicks::RunOnce).place(5_000, 0, now),
            Placement::Run {
                tick: 9_000,
                missed: 4
            }
        );
        assert_eq!(
            per_second(MissedTicks::CatchUp { max: 2 }).place(5_000, 0, now),
            Placement::Run {
                tick: 7_000,
                missed: 2
            }
        );
        // Without grace, 9_000 is missed too: skip waits for 10_000.
        let strict = |policy| per_second(policy).misfire_grace(Duration::ZERO);
        assert_eq!(
            strict(MissedTicks::Skip).place(5_000, 0, now),
            Placement::Wait {
                tick: 10_000,
                missed: 5
            }
        );
        assert_eq!(
            strict(MissedTicks::CatchUp { max: 2 }).place(5_000, 0, now),
            Placement::Run {
                tick: 8_000,
                missed: 3
            }
        );
    }

    #[test]
    fn a_cron_outage_beyond_the_count_limit_still_finds_the_latest_ticks() {
        let every_second = Recurrence::cron("* * * * * *", "UTC")
            .unwrap()
            .missed_ticks(MissedTicks::CatchUp { max: 2 })
            .misfire_grace(Duration::ZERO);
        let start = 1_000_000_000;
        let seconds = i64::try_from(MAX_COUNTED_MISSED_TICKS).unwrap() + 50;
        let now = start + seconds * 1_000 + 500;
        let placed = every_second.place(start, 0, now);
        assert_eq!(
            placed,
            Placement::Run {
                tick: start + (seconds - 1) * 1_000,
                missed: MAX_COUNTED_MISSED_TICKS - 2,
            }
        );
    }

    #[test]
    fn the_stored_form_round_trips() {
        let digest = Recurrence::cron("0 8 * * 1-5", "Europe/Paris")
            .unwrap()
            .missed_ticks(MissedTicks::CatchUp { max: 3 })
            .misfire_grace(Duration::from_secs(5));
        let stored = digest.to_stored();
        assert_eq!(Recurrence::from_stored(&stored).unwrap(), digest);
        assert_eq!(digest.to_string(), "cron \"0 8 * * 1-5\" in Europe/Paris");
    }
}
