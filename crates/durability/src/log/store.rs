//! Every SQL statement of the retained log, as typed functions.
//!
//! Tables (migrations [`LOG_MIGRATIONS`](crate::migrations::LOG_MIGRATIONS)
//! and [`LOG_LEASES_MIGRATIONS`](crate::migrations::LOG_LEASES_MIGRATIONS)):
//! - `durability_log_records`: the hot records. `"offset"` is the rowid, so
//!   every lookup or range by offset is a B-tree seek on the table itself.
//!   The table always holds one dense run `[hot_offset, next_offset)`:
//!   appends add at the end and trims remove from the front, so its row
//!   count is a subtraction, never a `COUNT(*)`.
//! - `durability_log_seq`: one row with the next offset and the payload
//!   bytes held hot, so an append never scans.
//! - `durability_log_segments`: the cold-segment index, keyed by first offset.
//! - `durability_log_cursors`: committed consumer offsets.
//! - `durability_log_leases` and `durability_log_allocations`: leased ranges
//!   and each consumer's allocation mark.
//!
//! Callers choose the transaction; nothing here opens one. Every function
//! takes `&dyn Sql` so it joins whatever transaction the caller is in.
//! Offsets and byte counts are non-negative; they are stored as SQLite
//! integers and read back through the checked `u64` decoder.

use durability_platform::{EpochMs, MAX_SAFE_INTEGER, Row, Sql, StorageError, Value, params};

/// One hot record as stored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StoredRecord {
    pub offset: u64,
    pub key: String,
    /// The value envelope text (`{"kind":"value","value":...}`).
    pub payload: String,
    /// UTF-8 length of `payload`.
    pub bytes: u64,
    pub appended_at: EpochMs,
}

/// The sequence row: what an append reads and writes once per batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seq {
    pub next_offset: u64,
    pub total_bytes: u64,
}

/// One row of the cold-segment index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SegmentRow {
    pub first_offset: u64,
    pub last_offset: u64,
    pub locator: String,
    pub bytes: u64,
    pub flushed_at: EpochMs,
}

/// Converts an offset, count or limit for binding. Offsets are validated to
/// be at most 2^53 - 1, so saturating there changes no comparison and no
/// limit ("read everything" passes `u64::MAX`), while keeping every bound
/// integer within what all platforms store exactly (JavaScript numbers on
/// Cloudflare stop at 2^53).
pub(crate) fn int(value: u64) -> Value {
    Value::Integer(i64::try_from(value).map_or(MAX_SAFE_INTEGER, |v| v.min(MAX_SAFE_INTEGER)))
}

// ---------------------------------------------------------------- sequence

/// The sequence row (primary-key lookup).
pub(crate) fn seq(sql: &dyn Sql) -> Result<Seq, StorageError> {
    let row = sql
        .query_row(
            "SELECT next_offset, total_bytes FROM durability_log_seq WHERE id = 1",
            &[],
        )?
        .ok_or_else(|| StorageError::Decode {
            column: "durability_log_seq".into(),
            expected: "the row seeded by durability_0006_create_log",
            found: "no row".into(),
        })?;
    Ok(Seq {
        next_offset: row.get(0)?,
        total_bytes: row.get(1)?,
    })
}

/// Writes the sequence row back (primary-key update).
pub(crate) fn set_seq(sql: &dyn Sql, seq: Seq) -> Result<(), StorageError> {
    sql.execute(
        "UPDATE durability_log_seq SET next_offset = ?, total_bytes = ? WHERE id = 1",
        &[int(seq.next_offset), int(seq.total_bytes)],
    )?;
    Ok(())
}

// ----------------------------------------------------------------- records

/// The lowest hot offset, if any record is hot: `MIN` of the rowid is one
/// seek to the first leaf.
pub(crate) fn hot_offset(sql: &dyn Sql) -> Result<Option<u64>, StorageError> {
    match sql.query_row(
        "SELECT \"offset\" FROM durability_log_records ORDER BY \"offset\" ASC LIMIT 1",
        &[],
    )? {
        Some(row) => Ok(Some(row.get(0)?)),
        None => Ok(None),
    }
}

/// The offset and payload of the hot record with deduplication key `key`
/// (the `dedup_key` UNIQUE index).
pub(crate) fn find_key(sql: &dyn Sql, key: &str) -> Result<Option<(u64, String)>, StorageError> {
    match sql.query_row(
        "SELECT \"offset\", payload FROM durability_log_records WHERE dedup_key = ?",
        &params![key],
    )? {
        Some(row) => Ok(Some((row.get(0)?, row.get(1)?))),
        None => Ok(None),
    }
}

/// Inserts one record (rowid append at the end of the table, plus one entry
/// in the `dedup_key` index).
pub(crate) fn insert_record(
    sql: &dyn Sql,
    offset: u64,
    key: &str,
    payload: &str,
    bytes: u64,
    appended_at: EpochMs,
) -> Result<(), StorageError> {
    sql.execute(
        "INSERT INTO durability_log_records (\"offset\", dedup_key, payload, bytes, appended_at) \
         VALUES (?, ?, ?, ?, ?)",
        &[
            int(offset),
            Value::from(key),
            Value::from(payload),
            int(bytes),
            Value::Integer(appended_at),
        ],
    )?;
    Ok(())
}

/// Up to `limit` hot records from `from` on, ascending (a rowid range).
pub(crate) fn hot_records(
    sql: &dyn Sql,
    from: u64,
    limit: u64,
) -> Result<Vec<StoredRecord>, StorageError> {
    sql.query(
        "SELECT \"offset\", dedup_key, payload, bytes, appended_at FROM durability_log_records \
         WHERE \"offset\" >= ? ORDER BY \"offset\" ASC LIMIT ?",
        &[int(from), int(limit)],
    )?
    .iter()
    .map(stored_record)
    .collect()
}

fn stored_record(row: &Row) -> Result<StoredRecord, StorageError> {
    Ok(StoredRecord {
        offset: row.get(0)?,
        key: row.get(1)?,
        payload: row.get(2)?,
        bytes: row.get(3)?,
        appended_at: row.get(4)?,
    })
}

/// Deletes the hot records `first..=last` (a rowid range) and takes their
/// bytes off the sequence row. Returns how many were deleted.
pub(crate) fn delete_hot_range(sql: &dyn Sql, first: u64, last: u64) -> Result<u64, StorageError> {
    let (count, bytes) = match sql.query_row(
        "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM durability_log_records \
         WHERE \"offset\" >= ? AND \"offset\" <= ?",
        &[int(first), int(last)],
    )? {
        Some(row) => (row.get::<u64>(0)?, row.get::<u64>(1)?),
        None => (0, 0),
    };
    if count == 0 {
        return Ok(0);
    }
    sql.execute(
        "DELETE FROM durability_log_records WHERE \"offset\" >= ? AND \"offset\" <= ?",
        &[int(first), int(last)],
    )?;
    let current = seq(sql)?;
    set_seq(
        sql,
        Seq {
            next_offset: current.next_offset,
            total_bytes: current.total_bytes.saturating_sub(bytes),
        },
    )?;
    Ok(count)
}

// ---------------------------------------------------------------- segments

/// The lowest indexed segment's first offset (primary-key minimum).
pub(crate) fn lowest_segment(sql: &dyn Sql) -> Result<Option<u64>, StorageError> {
    match sql.query_row(
        "SELECT first_offset FROM durability_log_segments ORDER BY first_offset ASC LIMIT 1",
        &[],
    )? {
        Some(row) => Ok(Some(row.get(0)?)),
        None => Ok(None),
    }
}

/// The indexed segment with the greatest first offset at or below `offset`
/// (a descending primary-key seek). The caller checks that it reaches
/// `offset`.
pub(crate) fn segment_at_or_below(
    sql: &dyn Sql,
    offset: u64,
) -> Result<Option<SegmentRow>, StorageError> {
    match sql.query_row(
        "SELECT first_offset, last_offset, locator, bytes, flushed_at \
         FROM durability_log_segments WHERE first_offset <= ? \
         ORDER BY first_offset DESC LIMIT 1",
        &[int(offset)],
    )? {
        Some(row) => Ok(Some(segment_row(&row)?)),
        None => Ok(None),
    }
}

/// The first offset of the lowest segment that starts above `offset`
/// (an ascending primary-key seek).
pub(crate) fn segment_above(sql: &dyn Sql, offset: u64) -> Result<Option<u64>, StorageError> {
    match sql.query_row(
        "SELECT first_offset FROM durability_log_segments WHERE first_offset > ? \
         ORDER BY first_offset ASC LIMIT 1",
        &[int(offset)],
    )? {
        Some(row) => Ok(Some(row.get(0)?)),
        None => Ok(None),
    }
}

/// Indexes a written segment. An upsert on the first offset: after a crash
/// between this insert and the delete of its records, the next trim writes
/// the same first offset again (perhaps with another last offset, if the
/// retention changed) and this row must follow it.
pub(crate) fn upsert_segment(sql: &dyn Sql, segment: &SegmentRow) -> Result<(), StorageError> {
    sql.execute(
        "INSERT INTO durability_log_segments (first_offset, last_offset, locator, bytes, flushed_at) \
         VALUES (?, ?, ?, ?, ?) \
         ON CONFLICT(first_offset) DO UPDATE SET last_offset = excluded.last_offset, \
         locator = excluded.locator, bytes = excluded.bytes, flushed_at = excluded.flushed_at",
        &[
            int(segment.first_offset),
            int(segment.last_offset),
            Value::from(segment.locator.as_str()),
            int(segment.bytes),
            Value::Integer(segment.flushed_at),
        ],
    )?;
    Ok(())
}

/// Deletes the index rows of segments that end below `offset` and returns
/// them. Segments are few (one per up to `max_batch_size` records) and the
/// range is read through the primary key: segments ending below `offset`
/// also start below it.
pub(crate) fn forget_segments_before(
    sql: &dyn Sql,
    offset: u64,
) -> Result<Vec<SegmentRow>, StorageError> {
    let rows = sql
        .query(
            "SELECT first_offset, last_offset, locator, bytes, flushed_at \
             FROM durability_log_segments WHERE first_offset < ? AND last_offset < ? \
             ORDER BY first_offset ASC",
            &[int(offset), int(offset)],
        )?
        .iter()
        .map(segment_row)
        .collect::<Result<Vec<_>, _>>()?;
    if !rows.is_empty() {
        sql.execute(
            "DELETE FROM durability_log_segments WHERE first_offset < ? AND last_offset < ?",
            &[int(offset), int(offset)],
        )?;
    }
    Ok(rows)
}

fn segment_row(row: &Row) -> Result<SegmentRow, StorageError> {
    Ok(SegmentRow {
        first_offset: row.get(0)?,
        last_offset: row.get(1)?,
        locator: row.get(2)?,
        bytes: row.get(3)?,
        flushed_at: row.get(4)?,
    })
}

// ----------------------------------------------------------------- cursors

/// A consumer's committed offset (primary-key lookup).
pub(crate) fn cursor(sql: &dyn Sql, consumer: &str) -> Result<Option<u64>, StorageError> {
    match sql.query_row(
        "SELECT \"offset\" FROM durability_log_cursors WHERE consumer = ?",
        &params![consumer],
    )? {
        Some(row) => Ok(Some(row.get(0)?)),
        None => Ok(None),
    }
}

/// Moves a consumer's cursor to `offset` if that is strictly further than
/// where it is (or it has none). Returns whether it moved. One upsert on
/// the primary key; the `WHERE` of the update is what keeps a cursor from
/// ever going back.
pub(crate) fn advance_cursor(
    sql: &dyn Sql,
    consumer: &str,
    offset: u64,
    now: EpochMs,
) -> Result<bool, StorageError> {
    let changed = sql.execute(
        "INSERT INTO durability_log_cursors (consumer, \"offset\", committed_at) VALUES (?, ?, ?) \
         ON CONFLICT(consumer) DO UPDATE SET \"offset\" = excluded.\"offset\", \
         committed_at = excluded.committed_at \
         WHERE excluded.\"offset\" > durability_log_cursors.\"offset\"",
        &[Value::from(consumer), int(offset), Value::Integer(now)],
    )?;
    Ok(changed > 0)
}

/// Every consumer and its offset, by consumer name (the primary key).
pub(crate) fn cursors(sql: &dyn Sql) -> Result<Vec<(String, u64)>, StorageError> {
    sql.query(
        "SELECT consumer, \"offset\" FROM durability_log_cursors ORDER BY consumer ASC",
        &[],
    )?
    .iter()
    .map(|row| Ok((row.get(0)?, row.get(1)?)))
    .collect()
}

/// The furthest-behind committed offset (`durability_log_cursors_offset_idx`).
pub(crate) fn slowest_cursor(sql: &dyn Sql) -> Result<Option<u64>, StorageError> {
    match sql.query_row(
        "SELECT \"offset\" FROM durability_log_cursors ORDER BY \"offset\" ASC LIMIT 1",
        &[],
    )? {
        Some(row) => Ok(Some(row.get(0)?)),
        None => Ok(None),
    }
}

// ------------------------------------------------------------------ leases

/// The stored state of a leased range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RangeState {
    /// Handed out; held until `expires_at`.
    Active,
    /// Nacked: owed redelivery now.
    Pending,
    /// Processed.
    Acked,
    /// Given up on after too many attempts (poison).
    Skipped,
}

impl RangeState {
    fn as_str(self) -> &'static str {
        match self {
            RangeState::Active => "active",
            RangeState::Pending => "pending",
            RangeState::Acked => "acked",
            RangeState::Skipped => "skipped",
        }
    }

    fn parse(text: &str) -> Result<Self, StorageError> {
        match text {
            "active" => Ok(RangeState::Active),
            "pending" => Ok(RangeState::Pending),
            "acked" => Ok(RangeState::Acked),
            "skipped" => Ok(RangeState::Skipped),
            other => Err(StorageError::Decode {
                column: "durability_log_leases.state".into(),
                expected: "active, pending, acked or skipped",
                found: other.to_owned(),
            }),
        }
    }

    /// Acked and skipped ranges let the cursor pass.
    pub fn is_settled(self) -> bool {
        matches!(self, RangeState::Acked | RangeState::Skipped)
    }
}

/// One row of `durability_log_leases`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RangeRow {
    pub batch_id: String,
    pub consumer: String,
    pub first_offset: u64,
    pub last_offset: u64,
    pub state: RangeState,
    pub attempt: u32,
    pub expires_at: EpochMs,
}

const RANGE_COLUMNS: &str =
    "batch_id, consumer, first_offset, last_offset, state, attempt, expires_at";

fn range_row(row: &Row) -> Result<RangeRow, StorageError> {
    Ok(RangeRow {
        batch_id: row.get(0)?,
        consumer: row.get(1)?,
        first_offset: row.get(2)?,
        last_offset: row.get(3)?,
        state: RangeState::parse(&row.get::<String>(4)?)?,
        attempt: row.get(5)?,
        expires_at: row.get(6)?,
    })
}

/// How many of the consumer's ranges are held and unexpired, counting at
/// most `cap` (`durability_log_leases_claim_idx`: consumer, state, then a
/// range on expires_at; the `LIMIT` bounds the count by the parallelism).
pub(crate) fn held_ranges(
    sql: &dyn Sql,
    consumer: &str,
    now: EpochMs,
    cap: u32,
) -> Result<u32, StorageError> {
    match sql.query_row(
        "SELECT COUNT(*) FROM (SELECT 1 FROM durability_log_leases \
         WHERE consumer = ? AND state = 'active' AND expires_at > ? LIMIT ?)",
        &[Value::from(consumer), Value::Integer(now), Value::from(cap)],
    )? {
        Some(row) => row.get(0),
        None => Ok(0),
    }
}

/// The consumer's oldest range owed redelivery: the lowest-offset nacked
/// range or expired active range, whichever starts first.
///
/// Nacked ranges carry `expires_at = 0`, so the claim index returns them in
/// `first_offset` order. Expired active ranges are a range scan on
/// `expires_at` inside the same index, then a sort of those few rows: a
/// consumer has at most about `max_parallelism` of them, since every lease
/// call reclaims one before it allocates anything new.
pub(crate) fn oldest_owed_range(
    sql: &dyn Sql,
    consumer: &str,
    now: EpochMs,
) -> Result<Option<RangeRow>, StorageError> {
    let nacked = sql.query_row(
        &format!(
            "SELECT {RANGE_COLUMNS} FROM durability_log_leases \
             WHERE consumer = ? AND state = 'pending' AND expires_at = 0 \
             ORDER BY first_offset ASC LIMIT 1"
        ),
        &params![consumer],
    )?;
    let expired = sql.query_row(
        &format!(
            "SELECT {RANGE_COLUMNS} FROM durability_log_leases \
             WHERE consumer = ? AND state = 'active' AND expires_at <= ? \
             ORDER BY first_offset ASC LIMIT 1"
        ),
        &[Value::from(consumer), Value::Integer(now)],
    )?;
    let nacked = nacked.as_ref().map(range_row).transpose()?;
    let expired = expired.as_ref().map(range_row).transpose()?;
    Ok(match (nacked, expired) {
        (Some(a), Some(b)) => Some(if a.first_offset <= b.first_offset {
            a
        } else {
            b
        }),
        (a, b) => a.or(b),
    })
}

/// A range by its batch id (primary-key lookup).
pub(crate) fn range(sql: &dyn Sql, batch_id: &str) -> Result<Option<RangeRow>, StorageError> {
    sql.query_row(
        &format!("SELECT {RANGE_COLUMNS} FROM durability_log_leases WHERE batch_id = ?"),
        &params![batch_id],
    )?
    .as_ref()
    .map(range_row)
    .transpose()
}

/// The consumer's range starting exactly at `first_offset`
/// (`durability_log_leases_order_idx`).
pub(crate) fn range_starting_at(
    sql: &dyn Sql,
    consumer: &str,
    first_offset: u64,
) -> Result<Option<RangeRow>, StorageError> {
    sql.query_row(
        &format!(
            "SELECT {RANGE_COLUMNS} FROM durability_log_leases \
             WHERE consumer = ? AND first_offset = ? LIMIT 1"
        ),
        &[Value::from(consumer), int(first_offset)],
    )?
    .as_ref()
    .map(range_row)
    .transpose()
}

/// The consumer's lowest range's first offset (`durability_log_leases_order_idx`).
pub(crate) fn lowest_range(sql: &dyn Sql, consumer: &str) -> Result<Option<u64>, StorageError> {
    match sql.query_row(
        "SELECT first_offset FROM durability_log_leases WHERE consumer = ? \
         ORDER BY first_offset ASC LIMIT 1",
        &params![consumer],
    )? {
        Some(row) => Ok(Some(row.get(0)?)),
        None => Ok(None),
    }
}

/// Inserts a newly allocated range and moves the consumer's allocation mark
/// past it, in the caller's transaction.
pub(crate) fn insert_range(
    sql: &dyn Sql,
    range: &RangeRow,
    created_at: EpochMs,
) -> Result<(), StorageError> {
    sql.execute(
        "INSERT INTO durability_log_leases \
         (batch_id, consumer, first_offset, last_offset, state, attempt, expires_at, created_at) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        &[
            Value::from(range.batch_id.as_str()),
            Value::from(range.consumer.as_str()),
            int(range.first_offset),
            int(range.last_offset),
            Value::from(range.state.as_str()),
            Value::from(range.attempt),
            Value::Integer(range.expires_at),
            Value::Integer(created_at),
        ],
    )?;
    sql.execute(
        "INSERT INTO durability_log_allocations (consumer, allocated_offset) VALUES (?, ?) \
         ON CONFLICT(consumer) DO UPDATE SET allocated_offset = excluded.allocated_offset",
        &[
            Value::from(range.consumer.as_str()),
            int(range.last_offset.saturating_add(1)),
        ],
    )?;
    Ok(())
}

/// Hands an owed range out again under a new batch id, which fences the
/// previous holder. A compare-and-set on the old batch id: returns false if
/// the range was settled or reclaimed meanwhile.
pub(crate) fn reclaim_range(
    sql: &dyn Sql,
    old_batch_id: &str,
    new_batch_id: &str,
    attempt: u32,
    expires_at: EpochMs,
) -> Result<bool, StorageError> {
    let changed = sql.execute(
        "UPDATE durability_log_leases SET batch_id = ?, state = 'active', attempt = ?, \
         expires_at = ? WHERE batch_id = ? AND state IN ('active', 'pending')",
        &[
            Value::from(new_batch_id),
            Value::from(attempt),
            Value::Integer(expires_at),
            Value::from(old_batch_id),
        ],
    )?;
    Ok(changed > 0)
}

/// Settles a held range (primary-key compare-and-set on an active batch).
/// A nack stores `expires_at = 0` so that owed ranges sort by offset in the
/// claim index. Returns false if the batch is not held.
pub(crate) fn settle_range(
    sql: &dyn Sql,
    batch_id: &str,
    state: RangeState,
) -> Result<bool, StorageError> {
    let changed = sql.execute(
        "UPDATE durability_log_leases SET state = ?, \
         expires_at = CASE WHEN ? = 'pending' THEN 0 ELSE expires_at END \
         WHERE batch_id = ? AND state = 'active'",
        &[
            Value::from(state.as_str()),
            Value::from(state.as_str()),
            Value::from(batch_id),
        ],
    )?;
    Ok(changed > 0)
}

/// Marks an owed range skipped (poison). A compare-and-set on the batch id.
pub(crate) fn skip_range(
    sql: &dyn Sql,
    batch_id: &str,
    attempt: u32,
) -> Result<bool, StorageError> {
    let changed = sql.execute(
        "UPDATE durability_log_leases SET state = 'skipped', attempt = ? \
         WHERE batch_id = ? AND state IN ('active', 'pending')",
        &[Value::from(attempt), Value::from(batch_id)],
    )?;
    Ok(changed > 0)
}

/// Deletes one range row (primary key).
pub(crate) fn delete_range(sql: &dyn Sql, batch_id: &str) -> Result<(), StorageError> {
    sql.execute(
        "DELETE FROM durability_log_leases WHERE batch_id = ?",
        &params![batch_id],
    )?;
    Ok(())
}

/// Deletes the consumer's ranges that lie wholly below `offset`: ranges a
/// commit has already passed (`durability_log_leases_order_idx`, a range on
/// first_offset).
pub(crate) fn delete_ranges_below(
    sql: &dyn Sql,
    consumer: &str,
    offset: u64,
) -> Result<u64, StorageError> {
    let changed = sql.execute(
        "DELETE FROM durability_log_leases WHERE consumer = ? AND first_offset < ? \
         AND last_offset < ?",
        &[Value::from(consumer), int(offset), int(offset)],
    )?;
    Ok(u64::try_from(changed).unwrap_or(u64::MAX))
}

/// The consumer's allocation mark: where its next new range starts
/// (primary-key lookup).
pub(crate) fn allocation_mark(sql: &dyn Sql, consumer: &str) -> Result<Option<u64>, StorageError> {
    match sql.query_row(
        "SELECT allocated_offset FROM durability_log_allocations WHERE consumer = ?",
        &params![consumer],
    )? {
        Some(row) => Ok(Some(row.get(0)?)),
        None => Ok(None),
    }
}
