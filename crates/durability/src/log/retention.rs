//! Retention: which hot records a trim removes, and the trim itself.
//!
//! A trim never runs on its own: the log registers no due work, so an
//! application drives it (typically from a named alarm). A call runs passes
//! until nothing more is condemned or, where the platform limits CPU per
//! event, until it has spent the event's share (the scheduler's alarm
//! handoff, at most half the limit); the next call goes on. Each pass takes up
//! to `max_batch_size` of the oldest hot records and removes the longest
//! prefix of them that some limit condemns: beyond `max_records`, over
//! `max_bytes`, or older than `max_age`. With cold storage the prefix is
//! written as one segment, then indexed, then deleted (three steps, in that
//! order, each committed before the next starts), so a crash at any point
//! leaves every record either hot or in an indexed segment:
//!
//! | crash after             | state                         | next trim / read                              |
//! |-------------------------|-------------------------------|-----------------------------------------------|
//! | the cold write          | segment written, unindexed    | records still hot; rewritten (at least once)  |
//! | the index insert        | indexed and still hot        | reads stay hot; rewritten, index upserted      |
//! | the delete              | consistent                    | —                                             |
//!
//! Retention ignores cursors: a consumer slower than everything readable
//! gets [`LogError::Truncated`] rather than a silent skip.

use std::time::Duration;

use durability_platform::{EpochMs, MAX_SAFE_INTEGER};

use super::cold::{Segment, SegmentRecord};
use super::store::{self, SegmentRow, StoredRecord};
use super::{Inner, LogError};
use crate::codec;
use crate::error::ConfigError;

/// The largest `max_bytes` a log accepts: 1 GiB, the reference library's
/// cap (a Durable Object's storage is limited, and a hot log near it leaves
/// no room for anything else).
pub const MAX_LOG_BYTES: u64 = 1_073_741_824;

/// How much of the log stays hot. Every limit is optional; records go oldest
/// first when any limit condemns them.
///
/// ```
/// use std::time::Duration;
/// use durability::log::Retention;
///
/// let week = Retention::new()
///     .max_age(Duration::from_secs(7 * 24 * 3600))
///     .max_records(50_000)
///     .max_bytes(256 * 1024 * 1024);
/// # let _ = week;
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retention {
    max_age: Option<Duration>,
    max_records: Option<u64>,
    max_bytes: Option<u64>,
}

impl Retention {
    /// No limit yet; add some.
    pub fn new() -> Self {
        Retention::default()
    }

    /// Records appended longer ago than this go (whole milliseconds, at
    /// least 1 ms).
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = Some(age);
        self
    }

    /// At most this many records stay hot (at least 1).
    pub fn max_records(mut self, records: u64) -> Self {
        self.max_records = Some(records);
        self
    }

    /// At most this many payload bytes stay hot (1 to [`MAX_LOG_BYTES`]).
    /// A payload's size is the UTF-8 length of its stored JSON.
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = Some(bytes);
        self
    }

    pub(super) fn validate(self) -> Result<Limits, ConfigError> {
        let max_age_ms = match self.max_age {
            None => None,
            Some(age) => {
                let ms = age.as_millis();
                if ms == 0 || !age.subsec_nanos().is_multiple_of(1_000_000) {
                    return Err(ConfigError::DurationOutOfRange {
                        field: "retention.max_age".into(),
                        min_ms: 1,
                        max_ms: MAX_SAFE_INTEGER.unsigned_abs(),
                    });
                }
                let max = u128::try_from(MAX_SAFE_INTEGER).unwrap_or(u128::MAX);
                if ms > max {
                    return Err(ConfigError::DurationOutOfRange {
                        field: "retention.max_age".into(),
                        min_ms: 1,
                        max_ms: MAX_SAFE_INTEGER.unsigned_abs(),
                    });
                }
                Some(i64::try_from(ms).unwrap_or(MAX_SAFE_INTEGER))
            }
        };
        if self.max_records == Some(0) {
            return Err(ConfigError::NotPositive {
                field: "retention.max_records".into(),
            });
        }
        if let Some(bytes) = self.max_bytes
            && !(1..=MAX_LOG_BYTES).contains(&bytes)
        {
            return Err(ConfigError::OutOfRange {
                field: "retention.max_bytes".into(),
                min: 1,
                max: MAX_LOG_BYTES,
            });
        }
        Ok(Limits {
            max_age_ms,
            max_records: self.max_records,
            max_bytes: self.max_bytes,
        })
    }
}

/// Validated retention limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limits {
    max_age_ms: Option<i64>,
    max_records: Option<u64>,
    max_bytes: Option<u64>,
}

/// What one trim pass sees of a hot record.
#[derive(Debug, Clone, Copy)]
pub(super) struct Candidate {
    pub bytes: u64,
    pub appended_at: EpochMs,
}

/// How many of `oldest` (the oldest hot records, ascending) a pass removes:
/// the longest prefix in which each record is beyond `max_records`, or the
/// log is still over `max_bytes` before it goes, or it is older than the
/// cutoff. Stops at the first record no limit condemns, so records leave
/// strictly oldest first and the hot table stays one dense run.
pub(super) fn condemned_prefix(
    limits: &Limits,
    oldest: &[Candidate],
    hot_count: u64,
    hot_bytes: u64,
    cutoff: Option<EpochMs>,
) -> usize {
    let excess = limits
        .max_records
        .map_or(0, |max| hot_count.saturating_sub(max));
    let mut over = limits
        .max_bytes
        .map_or(0, |max| hot_bytes.saturating_sub(max));
    let mut taken = 0;
    for (index, record) in oldest.iter().enumerate() {
        let by_count = u64::try_from(index).unwrap_or(u64::MAX) < excess;
        let by_bytes = over > 0;
        let by_age = cutoff.is_some_and(|cutoff| record.appended_at < cutoff);
        if !(by_count || by_bytes || by_age) {
            break;
        }
        over = over.saturating_sub(record.bytes);
        taken += 1;
    }
    taken
}

/// Runs trim passes until no limit condemns the oldest hot record. Returns
/// how many records left the hot table (deleted or flushed).
pub(super) async fn trim(inner: &Inner) -> Result<u64, LogError> {
    let Some(limits) = inner.retention else {
        return Ok(0);
    };
    // One trim at a time: a second one would write the same segment again.
    let _one_at_a_time = inner.trim_lock.lock().await;
    let engine = &inner.engine;
    let cutoff = limits
        .max_age_ms
        .map(|age| engine.now().saturating_sub(age));
    let batch = u64::from(inner.max_batch_size);
    let mut removed = 0;
    loop {
        let (oldest, seq) = engine.transaction_sync(|sql| {
            let oldest = store::hot_records(sql, 0, batch)?;
            let seq = store::seq(sql)?;
            Ok::<_, LogError>((oldest, seq))
        })?;
        let Some(first) = oldest.first() else {
            break;
        };
        let hot_count = seq.next_offset.saturating_sub(first.offset);
        let candidates: Vec<Candidate> = oldest
            .iter()
            .map(|record| Candidate {
                bytes: record.bytes,
                appended_at: record.appended_at,
            })
            .collect();
        let mut taken = condemned_prefix(&limits, &candidates, hot_count, seq.total_bytes, cutoff);
        if inner.cold.is_some() {
            // A stored record that does not decode cannot go into a
            // segment. The readable records before it still go; the pass
            // then stops at it with its offset (as a read that starts at
            // it does), instead of moving nothing at all.
            if let Some(bad) = oldest[..taken]
                .iter()
                .position(|record| codec::decode(&record.payload).is_err())
            {
                if bad == 0 {
                    let record = &oldest[0];
                    let detail = codec::decode(&record.payload)
                        .err()
                        .map(|error| error.to_string())
                        .unwrap_or_default();
                    tracing::error!(
                        event = "durability.log.trim_blocked",
                        offset = record.offset,
                        %detail,
                        "a hot record that does not decode cannot move to cold storage"
                    );
                    return Err(LogError::Decode {
                        offset: record.offset,
                        detail,
                    });
                }
                taken = bad;
            }
        }
        let prefix = &oldest[..taken];
        let (Some(first), Some(last)) = (prefix.first(), prefix.last()) else {
            break;
        };
        let (first, last) = (first.offset, last.offset);
        if let Some(cold) = &inner.cold {
            let segment = segment_of(prefix)?;
            // Intent before external I/O is not needed here: until the
            // index row commits, the records are still hot, so a crash at
            // any point of the write only means writing it again.
            let locator = cold.write(&segment).await.map_err(LogError::Cold)?;
            if locator.is_empty() {
                return Err(LogError::EmptyLocator { first, last });
            }
            tracing::debug!(
                event = "durability.log.segment_written",
                first_offset = first,
                last_offset = last,
                %locator,
                "cold segment written"
            );
            let row = SegmentRow {
                first_offset: first,
                last_offset: last,
                locator,
                bytes: prefix.iter().map(|r| r.bytes).sum(),
                flushed_at: engine.now(),
            };
            engine.transaction_sync(|sql| store::upsert_segment(sql, &row))?;
            tracing::debug!(
                event = "durability.log.segment_indexed",
                first_offset = first,
                last_offset = last,
                "cold segment indexed"
            );
        }
        let deleted = engine.transaction_sync(|sql| store::delete_hot_range(sql, first, last))?;
        tracing::debug!(
            event = "durability.log.trimmed",
            first_offset = first,
            last_offset = last,
            deleted,
            cold = inner.cold.is_some(),
            "hot records trimmed"
        );
        removed += deleted;
        // Fewer than expected means another writer got there first; stop so
        // the next call does not flush the remainder twice.
        if deleted < u64::try_from(prefix.len()).unwrap_or(u64::MAX) {
            break;
        }
        // Where the platform limits CPU per event, one call stops once it
        // has spent the event's share; the next call goes on from here.
        if engine.invocation_budget_spent() {
            break;
        }
    }
    Ok(removed)
}

/// The cold form of a run of hot records.
fn segment_of(records: &[StoredRecord]) -> Result<Segment, LogError> {
    let mut out = Vec::with_capacity(records.len());
    for record in records {
        let body = codec::decode(&record.payload)
            .map_err(|error| LogError::Decode {
                offset: record.offset,
                detail: error.to_string(),
            })?
            // `undefined` (only the reference library writes it) has no JSON
            // form; a segment keeps it as null.
            .unwrap_or(serde_json::Value::Null);
        out.push(SegmentRecord {
            offset: record.offset,
            deduplication_key: record.key.clone(),
            body,
            appended_at: record.appended_at,
        });
    }
    let first_offset = records.first().map_or(0, |r| r.offset);
    let last_offset = records.last().map_or(0, |r| r.offset);
    Ok(Segment {
        first_offset,
        last_offset,
        records: out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(retention: Retention) -> Limits {
        retention.validate().unwrap()
    }

    fn records(bytes: &[u64], appended_at: &[EpochMs]) -> Vec<Candidate> {
        bytes
            .iter()
            .zip(appended_at)
            .map(|(&bytes, &appended_at)| Candidate { bytes, appended_at })
            .collect()
    }

    #[test]
    fn max_records_condemns_exactly_the_excess() {
        let l = limits(Retention::new().max_records(3));
        let oldest = records(&[10; 5], &[0; 5]);
        assert_eq!(condemned_prefix(&l, &oldest, 5, 50, None), 2);
        assert_eq!(condemned_prefix(&l, &oldest, 3, 30, None), 0);
    }

    #[test]
    fn max_bytes_stops_once_the_rest_fits() {
        let l = limits(Retention::new().max_bytes(25));
        let oldest = records(&[10, 10, 10, 10], &[0; 4]);
        // 40 held, 15 over: the first two go (20 >= 15), 20 stay.
        assert_eq!(condemned_prefix(&l, &oldest, 4, 40, None), 2);
    }

    #[test]
    fn max_age_stops_at_the_first_young_record() {
        let l = limits(Retention::new().max_age(Duration::from_millis(100)));
        let oldest = records(&[1, 1, 1, 1], &[10, 20, 500, 30]);
        assert_eq!(condemned_prefix(&l, &oldest, 4, 4, Some(100)), 2);
    }

    #[test]
    fn limits_are_validated_with_the_field_named() {
        let error = Retention::new().max_bytes(MAX_LOG_BYTES + 1).validate();
        assert!(
            matches!(error, Err(ConfigError::OutOfRange { field, .. }) if field == "retention.max_bytes")
        );
        assert!(Retention::new().max_records(0).validate().is_err());
        assert!(Retention::new().max_age(Duration::ZERO).validate().is_err());
        assert!(Retention::new().max_bytes(MAX_LOG_BYTES).validate().is_ok());
    }
}
