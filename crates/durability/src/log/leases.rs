//! Consumer leases (queues.md §5.10): several workers share one consumer
//! name without processing the same records at once.
//!
//! A worker leases a *range* of consecutive records under a fresh batch id,
//! for `lease` time. Ranges of one consumer are handed out in parallel (up
//! to `max_parallelism` live ones) from the consumer's allocation mark,
//! which runs ahead of its committed cursor. The worker acks (processed) or
//! nacks (give it back now); a range whose lease expires goes back to the
//! pool too. Handing a range out again rewrites its batch id, which fences
//! the previous holder: its late ack fails instead of settling work someone
//! else now holds. The cursor advances only over an unbroken run of settled
//! ranges starting at the cursor, so it never passes a range still owed.
//!
//! Everything is stored before it is returned: a lease row commits before
//! its records reach the worker, and leases survive eviction (nothing is
//! released early by a restart; an abandoned range waits for its expiry).
//!
//! Poison: with `max_attempts` *and* an `on_poison` hook, a range about to
//! be handed out beyond `max_attempts` is marked skipped (durably, before
//! the hook runs, so a crash cannot hand it out again) and the hook is told
//! in the background. Without a hook, `max_attempts` skips nothing: the
//! consumer keeps retrying rather than silently dropping records.
//!
//! Decisions where the reference is silent:
//! - A lease is live while `now < expires_at`; at `expires_at` it is
//!   reclaimable.
//! - An ack after the lease expired still succeeds if nobody reclaimed the
//!   range meanwhile (the work was done; nothing else holds it).
//! - After a poison skip the same `lease` call goes on to the next range
//!   instead of returning `None`: `None` always means "nothing to hand out".
//! - A consumer's first range starts at its committed cursor, or at the
//!   oldest readable offset when it has none. A range whose records were
//!   trimmed away fails with [`LogError::Truncated`]; commit past it with
//!   [`Log::commit`](super::Log::commit) to move on (ranges wholly below the
//!   cursor are dropped on the next lease).
//!
//! Owns the lease logic; its SQL is in [`super::store`].

use std::future::Future;
use std::rc::Rc;
use std::time::Duration;

use durability_platform::{EpochMs, LocalBoxFuture, MAX_SAFE_INTEGER, MAX_TIMER_MS};
use serde::de::DeserializeOwned;

use super::store::{self, RangeRow, RangeState};
use super::{Inner, LogError, LogRecord, require_consumer};
use crate::error::{ConfigError, HandlerError};

/// Default time a worker holds a leased range before it goes back to the pool.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// Default number of ranges of one consumer held at once.
pub const DEFAULT_MAX_PARALLELISM: u32 = 1;
/// The most ranges one consumer may hold at once: every lease reads the
/// consumer's live ranges, so far more would only make each lease slower.
pub const MAX_PARALLELISM: u32 = 10_000;

/// Called, in the background, when a range is skipped as poison.
pub type PoisonHook =
    Rc<dyn Fn(PoisonedRange) -> LocalBoxFuture<'static, Result<(), HandlerError>>>;

/// A range given up on after too many attempts. Its records are still in
/// the log (read them with [`Log::read`](super::Log::read) from
/// `first_offset`) until retention removes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoisonedRange {
    /// The consumer that gave up.
    pub consumer: String,
    /// The range's first offset.
    pub first_offset: u64,
    /// The range's last offset.
    pub last_offset: u64,
    /// Attempts made before it was skipped.
    pub attempts: u32,
}

/// Consumer-lease options for [`LogBuilder::leases`](super::LogBuilder::leases).
///
/// ```
/// use std::time::Duration;
/// use durability::log::Leases;
///
/// let leases = Leases::new()
///     .lease_for(Duration::from_secs(60))
///     .max_parallelism(4)
///     .max_attempts(5)
///     .on_poison(|range| async move {
///         tracing::warn!(?range, "skipped a poison range");
///         Ok(())
///     });
/// # let _ = leases;
/// ```
#[derive(Clone)]
pub struct Leases {
    lease: Duration,
    max_parallelism: u32,
    max_attempts: Option<u32>,
    on_poison: Option<PoisonHook>,
}

impl Default for Leases {
    fn default() -> Self {
        Leases::new()
    }
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("lease", &self.lease)
            .field("max_parallelism", &self.max_parallelism)
            .field("max_attempts", &self.max_attempts)
            .field("on_poison", &self.on_poison.is_some())
            .finish()
    }
}

impl Leases {
    /// Leases with every option at its default.
    pub fn new() -> Self {
        Leases {
            lease: DEFAULT_LEASE,
            max_parallelism: DEFAULT_MAX_PARALLELISM,
            max_attempts: None,
            on_poison: None,
        }
    }

    /// How long a worker holds a range. Default 30 s; whole milliseconds,
    /// 1 ms to 2^31 - 1 ms.
    pub fn lease_for(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Ranges of one consumer held at once. Default 1; 1 to
    /// [`MAX_PARALLELISM`].
    pub fn max_parallelism(mut self, ranges: u32) -> Self {
        self.max_parallelism = ranges;
        self
    }

    /// Deliveries of one range before it is skipped as poison; only with
    /// [`Leases::on_poison`]. Default: never skip.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// Told about each skipped range, in the background; its failure is
    /// only logged (`durability.log.poison_hook_failed`).
    pub fn on_poison<F, Fut>(mut self, hook: F) -> Self
    where
        F: Fn(PoisonedRange) -> Fut + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + 'static,
    {
        self.on_poison = Some(Rc::new(move |range| Box::pin(hook(range))));
        self
    }

    pub(super) fn validate(self) -> Result<LeaseConfig, ConfigError> {
        let ms = self.lease.as_millis();
        if ms == 0 || !self.lease.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(ConfigError::DurationOutOfRange {
                field: "leases.lease_for".into(),
                min_ms: 1,
                max_ms: MAX_TIMER_MS,
            });
        }
        if ms > u128::from(MAX_TIMER_MS) {
            return Err(ConfigError::AboveTimerLimit {
                field: "leases.lease_for".into(),
                value_ms: u64::try_from(ms).unwrap_or(u64::MAX),
            });
        }
        if self.max_parallelism == 0 {
            return Err(ConfigError::NotPositive {
                field: "leases.max_parallelism".into(),
            });
        }
        if self.max_parallelism > MAX_PARALLELISM {
            return Err(ConfigError::OutOfRange {
                field: "leases.max_parallelism".into(),
                min: 1,
                max: u64::from(MAX_PARALLELISM),
            });
        }
        if self.max_attempts == Some(0) {
            return Err(ConfigError::NotPositive {
                field: "leases.max_attempts".into(),
            });
        }
        Ok(LeaseConfig {
            lease_ms: i64::try_from(ms).unwrap_or(MAX_SAFE_INTEGER),
            max_parallelism: self.max_parallelism,
            // Skipping needs somewhere to report to; without a hook the
            // consumer blocks on the range rather than losing it silently.
            poison: match (self.max_attempts, self.on_poison) {
                (Some(max_attempts), Some(hook)) => Some((max_attempts, hook)),
                _ => None,
            },
        })
    }
}

/// Validated lease options.
pub(super) struct LeaseConfig {
    lease_ms: i64,
    max_parallelism: u32,
    poison: Option<(u32, PoisonHook)>,
}

impl std::fmt::Debug for LeaseConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseConfig")
            .field("lease_ms", &self.lease_ms)
            .field("max_parallelism", &self.max_parallelism)
            .field("max_attempts", &self.poison.as_ref().map(|(max, _)| *max))
            .finish()
    }
}

/// A range of records leased to one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease<B> {
    /// Identifies this hand-out of the range; ack or nack with it.
    pub batch_id: String,
    /// The consumer the range belongs to.
    pub consumer: String,
    /// The range's first offset.
    pub first_offset: u64,
    /// The range's last offset.
    pub last_offset: u64,
    /// This hand-out's number, from 1 (a redelivery has a higher one).
    pub attempt: u32,
    /// When the lease lapses and the range goes back to the pool (epoch ms).
    pub expires_at: EpochMs,
    /// The records `first_offset..=last_offset`.
    pub records: Vec<LogRecord<B>>,
}

fn config(inner: &Inner) -> Result<&LeaseConfig, LogError> {
    inner.leases.as_ref().ok_or(LogError::LeasesDisabled)
}

/// See [`Log::lease`](super::Log::lease).
pub(super) async fn lease<B: DeserializeOwned>(
    inner: &Inner,
    consumer: &str,
    limit: Option<u32>,
) -> Result<Option<Lease<B>>, LogError> {
    let config = config(inner)?;
    require_consumer(consumer)?;
    let limit = match limit {
        Some(0) => {
            return Err(LogError::InvalidArgument {
                field: "limit",
                rule: "must be a positive integer",
            });
        }
        Some(limit) => limit.min(inner.max_batch_size),
        None => inner.max_batch_size,
    };
    let _one_at_a_time = inner.lease_lock.lock().await;
    let engine = &inner.engine;
    loop {
        let now = engine.now();
        let (held, owed, cursor) = engine.transaction_sync(|sql| {
            let cursor = store::cursor(sql, consumer)?;
            // Ranges a commit already passed can never settle the cursor.
            if let Some(cursor) = cursor {
                store::delete_ranges_below(sql, consumer, cursor)?;
            }
            let held = store::held_ranges(sql, consumer, now, config.max_parallelism)?;
            let owed = store::oldest_owed_range(sql, consumer, now)?;
            Ok::<_, LogError>((held, owed, cursor))
        })?;
        if held >= config.max_parallelism {
            return Ok(None);
        }
        if let Some(owed) = owed {
            let attempt = owed.attempt.saturating_add(1);
            if let Some((max_attempts, hook)) = &config.poison
                && attempt > *max_attempts
            {
                skip_poison(inner, &owed, hook)?;
                continue;
            }
            // Read before reclaiming: a range whose records are gone fails
            // without being handed out to nobody.
            let records = match read_range::<B>(inner, owed.first_offset, owed.last_offset).await {
                Ok(records) => records,
                // A record of the range stopped decoding after it was
                // allocated (damage): the range can never be handed out
                // whole again. With a poison hook it is skipped as poison
                // now rather than failing every lease of the consumer;
                // without one, the error names the record (commit past the
                // range to go on).
                Err(LogError::Decode { offset, .. }) if config.poison.is_some() => {
                    tracing::warn!(
                        event = "durability.log.range_undecodable",
                        consumer,
                        first_offset = owed.first_offset,
                        last_offset = owed.last_offset,
                        offset,
                        "a leased range holds a record that no longer decodes"
                    );
                    if let Some((_, hook)) = &config.poison {
                        skip_poison(inner, &owed, hook)?;
                    }
                    continue;
                }
                Err(error) => return Err(error),
            };
            let batch_id = engine.new_generation();
            let expires_at = engine.now().saturating_add(config.lease_ms);
            let reclaimed = engine.transaction_sync(|sql| {
                store::reclaim_range(sql, &owed.batch_id, &batch_id, attempt, expires_at)
            })?;
            if !reclaimed {
                // Settled by a late ack meanwhile; look again.
                continue;
            }
            tracing::debug!(
                event = "durability.log.range_redelivered",
                consumer,
                first_offset = owed.first_offset,
                last_offset = owed.last_offset,
                attempt,
                "leased range handed out again"
            );
            return Ok(Some(Lease {
                batch_id,
                consumer: consumer.to_owned(),
                first_offset: owed.first_offset,
                last_offset: owed.last_offset,
                attempt,
                expires_at,
                records,
            }));
        }
        return allocate(inner, config, consumer, cursor, limit).await;
    }
}

/// Hands out the next unallocated records of `consumer`.
async fn allocate<B: DeserializeOwned>(
    inner: &Inner,
    config: &LeaseConfig,
    consumer: &str,
    cursor: Option<u64>,
    limit: u32,
) -> Result<Option<Lease<B>>, LogError> {
    let engine = &inner.engine;
    let start = {
        let sql = engine.sql();
        let mark = store::allocation_mark(sql, consumer)?;
        match (mark, cursor) {
            (Some(mark), Some(cursor)) => mark.max(cursor),
            (Some(mark), None) => mark,
            (None, Some(cursor)) => cursor,
            (None, None) => super::bounds(sql)?.oldest_offset,
        }
    };
    let page = inner.read_raw(start, u64::from(limit), u64::MAX).await?;
    if page.records.is_empty() {
        return Ok(None);
    }
    // Decoded before the range is allocated, and cut before a record that
    // does not decode: a range is only ever what its holder could read, and
    // an undecodable record at `start` is an error naming it, skipped by
    // committing past it.
    let records = super::decode_prefix::<B>(page.records)?;
    let (Some(first), Some(last)) = (records.first(), records.last()) else {
        return Ok(None);
    };
    let range = RangeRow {
        batch_id: engine.new_generation(),
        consumer: consumer.to_owned(),
        first_offset: first.offset,
        last_offset: last.offset,
        state: RangeState::Active,
        attempt: 1,
        expires_at: engine.now().saturating_add(config.lease_ms),
    };
    let now = engine.now();
    engine.transaction_sync(|sql| store::insert_range(sql, &range, now))?;
    Ok(Some(Lease {
        batch_id: range.batch_id,
        consumer: range.consumer,
        first_offset: range.first_offset,
        last_offset: range.last_offset,
        attempt: 1,
        expires_at: range.expires_at,
        records,
    }))
}

/// The records `first..=last`, across segment and hot-table boundaries (a
/// range may have been partly flushed since it was allocated).
async fn read_range<B: DeserializeOwned>(
    inner: &Inner,
    first: u64,
    last: u64,
) -> Result<Vec<LogRecord<B>>, LogError> {
    let mut records = Vec::new();
    let mut from = first;
    while from <= last {
        let page = inner.read_raw(from, last - from + 1, u64::MAX).await?;
        if page.records.is_empty() {
            return Err(LogError::Truncated {
                requested: from,
                oldest: page.next_offset,
            });
        }
        from = page.next_offset;
        for record in page.records {
            records.push(record.decode()?);
        }
    }
    Ok(records)
}

/// Marks `range` skipped, moves the cursor over what that settles, and
/// tells the hook in the background. The skip commits first: a crash after
/// it can lose the notification, never hand the range out again.
fn skip_poison(inner: &Inner, range: &RangeRow, hook: &PoisonHook) -> Result<(), LogError> {
    let engine = &inner.engine;
    let now = engine.now();
    let skipped = engine.transaction_sync(|sql| {
        let skipped = store::skip_range(sql, &range.batch_id, range.attempt)?;
        if skipped {
            advance(sql, &range.consumer, now)?;
        }
        Ok::<_, LogError>(skipped)
    })?;
    if !skipped {
        return Ok(());
    }
    tracing::warn!(
        event = "durability.log.range_skipped",
        consumer = %range.consumer,
        first_offset = range.first_offset,
        last_offset = range.last_offset,
        attempts = range.attempt,
        "leased range skipped as poison"
    );
    let notified = hook(PoisonedRange {
        consumer: range.consumer.clone(),
        first_offset: range.first_offset,
        last_offset: range.last_offset,
        attempts: range.attempt,
    });
    let consumer = range.consumer.clone();
    let first_offset = range.first_offset;
    engine.ctx.wait_until(Box::pin(async move {
        if let Err(error) = notified.await {
            tracing::error!(
                event = "durability.log.poison_hook_failed",
                consumer,
                first_offset,
                %error,
                "on_poison hook failed"
            );
        }
    }));
    Ok(())
}

/// See [`Log::ack`](super::Log::ack) and [`Log::nack`](super::Log::nack).
pub(super) async fn settle(
    inner: &Inner,
    consumer: &str,
    batch_id: &str,
    acked: bool,
) -> Result<(), LogError> {
    config(inner)?;
    require_consumer(consumer)?;
    let engine = &inner.engine;
    let now = engine.now();
    let state = if acked {
        RangeState::Acked
    } else {
        RangeState::Pending
    };
    engine.transaction_sync(|sql| {
        let held = store::range(sql, batch_id)?
            .filter(|range| range.consumer == consumer && range.state == RangeState::Active);
        if held.is_none() || !store::settle_range(sql, batch_id, state)? {
            return Err(LogError::LeaseNotHeld {
                consumer: consumer.to_owned(),
                batch_id: batch_id.to_owned(),
            });
        }
        if acked {
            advance(sql, consumer, now)?;
        }
        Ok(())
    })
}

/// Commits the cursor over the unbroken run of settled ranges that starts
/// at it (at the lowest range when the consumer never committed) and
/// deletes those ranges. One primary-key seek per settled range.
fn advance(
    sql: &dyn durability_platform::Sql,
    consumer: &str,
    now: EpochMs,
) -> Result<(), LogError> {
    let start = match store::cursor(sql, consumer)? {
        Some(cursor) => Some(cursor),
        None => store::lowest_range(sql, consumer)?,
    };
    let Some(start) = start else {
        return Ok(());
    };
    let mut at = start;
    while let Some(range) = store::range_starting_at(sql, consumer, at)? {
        if !range.state.is_settled() {
            break;
        }
        store::delete_range(sql, &range.batch_id)?;
        at = range.last_offset.saturating_add(1);
    }
    if at != start {
        store::advance_cursor(sql, consumer, at, now)?;
    }
    Ok(())
}
