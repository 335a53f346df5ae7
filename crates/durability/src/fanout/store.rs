//! All SQL of fanout, as typed functions over its tables. This is the
//! bottom layer: it knows the layout and nothing of retry policies, targets
//! or settlement rules; `dispatch` and `settle` decide, this module writes
//! what they decided. The schema is [`crate::migrations::FANOUT_MIGRATIONS`]
//! (0013 gives the layout below).
//!
//! The layout (per-target cursors, rows only for exceptions):
//! - `durability_fanout_messages`: each accepted message once, keyed by its
//!   sequence (`seq`, the rowid) with its deduplication `key` unique, its
//!   body and its frozen target set.
//! - `durability_fanout_spans`: for each enqueue call and each target it
//!   names, the sequence range `[first_seq, last_seq]` the call took and
//!   when its first deliveries are due. A target's spans are exactly the
//!   messages it may still owe, so a pass never walks messages of other
//!   targets (a paused target's backlog costs the others nothing).
//! - `durability_fanout_cursors`: per target, `next_seq`: every message of
//!   the target below it was delivered or became an exception; and the
//!   in-flight claim `[next_seq, claim_end)` with its attempt and deadline,
//!   one small write per batch.
//! - `durability_fanout_exceptions`: a row only for a delivery that left
//!   the common path: waiting for a retry, dead-letter intent, or, while the
//!   cursor has not passed it yet, a delivery settled on its own (a
//!   `settled` tombstone, so a crash before the cursor moves cannot deliver
//!   it again). Rows of the pre-0013 layout were carried over as exceptions.
//! - `durability_fanout_deliveries`: a view of every owed delivery in the
//!   reference's columns, for readers and for memo ownership checks.
//!
//! A message row goes when no span covers it and it has no exception: a
//! range delete when a span's last target passes it, a single delete when
//! its last exception goes.
//!
//! Cost rules, because fanout runs per message and per pass on the object's
//! one thread:
//! - the common path writes per message only its row (insert, then the
//!   range delete) and per batch and target two cursor updates and a span;
//! - every statement that runs per pass is a bounded range of an index
//!   (named in its comment), so its cost does not grow with the backlog;
//! - nothing counts the backlog except [`count_owed`], once per instance.
//!
//! Writes to an exception row are compare-and-sets on the attempt that owns
//! it ([`crate::record`]); writes for a delivery still on its cursor are
//! compare-and-sets on the cursor's claim (its attempt and range).

use durability_platform::{EpochMs, Row, Sql, StorageError, Value, params};

use super::error::FanoutError;
use super::outcome::DeadLetterReason;
use crate::error::{DurabilityError, SerializedError};
use crate::memo::delete_memos;
use crate::record::{AttemptRef, DurableTable, claim_attempt, update_attempt};

/// The owed deliveries (a view), as the scheduler, memos and lifecycle name
/// them: memos of a delivery are keyed by this table and the delivery's id.
pub(crate) const DELIVERIES: DurableTable = DurableTable::FANOUT_DELIVERIES;

/// The exception rows, the only delivery rows that are written.
const EXCEPTIONS: DurableTable = DurableTable {
    name: "durability_fanout_exceptions",
    key: "id",
};

const MESSAGES_TABLE: &str = "durability_fanout_messages";
const CURSORS_TABLE: &str = "durability_fanout_cursors";
const PARKED_TABLE: &str = "durability_fanout_parked";

/// Whether a delivery is still being delivered or is on its way to the DLQ
/// (dead-letter intent persisted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Delivery,
    DeadLetter,
}

/// Where a claimed delivery lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// On its target's cursor (first delivery, or a redelivery of a claim
    /// that came back): no row of its own until it leaves the common path.
    Cursor,
    /// An exception row.
    Exception,
}

/// One owed (message registration, target) delivery as a pass sees it.
#[derive(Debug, Clone)]
pub(crate) struct DeliveryRow {
    /// `["<key>","<target>"]`.
    pub id: String,
    pub message_key: String,
    pub target_id: String,
    pub seq: i64,
    pub lane: Lane,
    pub phase: Phase,
    /// Claims so far; after a claim, the attempt this delivery runs as.
    pub attempt: u32,
    pub next_attempt_at: EpochMs,
    pub last_error: Option<String>,
    pub last_error_name: Option<String>,
    pub generation: String,
    pub dead_lettered_at: Option<EpochMs>,
    pub dead_letter_reason: Option<DeadLetterReason>,
}

impl DeliveryRow {
    /// The attempt that owns the delivery as read (or as claimed).
    pub(crate) fn attempt_ref(&self) -> AttemptRef {
        AttemptRef {
            key: self.id.clone(),
            generation: self.generation.clone(),
            attempt: self.attempt,
        }
    }

    /// The delivery identity `["<generation>","<target>"]`.
    pub(crate) fn identity(&self) -> String {
        json_pair(&self.generation, &self.target_id)
    }

    /// The stored last failure, if any.
    pub(crate) fn last_failure(&self) -> Option<SerializedError> {
        self.last_error.as_ref().map(|message| {
            SerializedError::new(
                self.last_error_name.as_deref().unwrap_or("Error"),
                message.as_str(),
            )
        })
    }
}

/// One `durability_fanout_messages` row: an accepted registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Manifest {
    /// The deduplication key (unique).
    pub key: String,
    pub id: String,
    /// The body in the stored encoding.
    pub payload: String,
    /// JSON array of the sorted frozen target ids.
    pub targets: String,
    pub seq: i64,
    pub created_at: EpochMs,
    pub generation: String,
}

/// A target's cursor and its in-flight claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cursor {
    pub next_seq: i64,
    pub claim: Option<CursorClaim>,
    /// First deliveries of a target that is not configured wait until then.
    pub paused_until: EpochMs,
    /// Paused by the application (flow control): nothing of the target is
    /// claimed until it is resumed.
    pub paused: bool,
}

/// The messages `[next_seq, end)` of a cursor handed to its target as
/// `attempt`, back at `deadline` if the batch never finishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CursorClaim {
    pub end: i64,
    pub attempt: u32,
    pub deadline: EpochMs,
}

/// A range of one enqueue call owed to one target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub first_seq: i64,
    pub last_seq: i64,
    pub due_at: EpochMs,
}

/// A message read on a cursor.
#[derive(Debug, Clone)]
pub(crate) struct CursorMessage {
    pub manifest: Manifest,
    /// The target already has an exception row (or tombstone) for it: it is
    /// not the cursor's to deliver.
    pub excepted: bool,
}

/// One parked dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParkedRow {
    /// The delivery identity.
    pub id: String,
    pub message_id: String,
    pub message_key: String,
    pub target_id: String,
    pub payload: String,
    pub enqueued_at: EpochMs,
    pub parked_at: EpochMs,
    pub attempts: u32,
    pub reason: DeadLetterReason,
    pub error: Option<SerializedError>,
}

/// `JSON.stringify([a, b])` for two strings; serde_json writes strings the
/// way JavaScript does, so the text is interchangeable with the reference.
pub(crate) fn json_pair(a: &str, b: &str) -> String {
    serde_json::to_string(&[a, b]).unwrap_or_else(|_| format!("[{a:?},{b:?}]"))
}

/// A LIMIT parameter; -1 is SQLite's "no limit" (a larger integer would not
/// bind on every platform: JavaScript numbers stop at 2^53).
fn limit_param(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(-1)
}

/// The error of a cursor that stands past a span its target still owes
/// (only a damaged row does): it names the cursor, so it can be found.
pub(crate) fn cursor_past_span(target: &str, next_seq: i64, span: &Span) -> FanoutError {
    damaged_cursor(
        target,
        format!(
            "next_seq {next_seq} is past the span {}..={} the target still owes",
            span.first_seq, span.last_seq
        ),
    )
}

/// The error of a target's cursor (or the spans it owes) that no pass can
/// advance: it names the cursor, so it can be found.
pub(crate) fn damaged_cursor(target: &str, detail: String) -> FanoutError {
    decode_error(CURSORS_TABLE, target, detail)
}

fn decode_error(table: &'static str, key: &str, detail: impl ToString) -> FanoutError {
    FanoutError::Durability(DurabilityError::Decode {
        table,
        key: key.to_owned(),
        detail: detail.to_string(),
    })
}

// ---------------------------------------------------------------------------
// Messages

macro_rules! manifest_columns {
    () => {
        "key, id, payload, targets, seq, created_at, generation_id"
    };
}

fn decode_manifest_at(row: &Row, at: usize) -> Result<Manifest, StorageError> {
    Ok(Manifest {
        key: row.get(at)?,
        id: row.get(at + 1)?,
        payload: row.get(at + 2)?,
        targets: row.get(at + 3)?,
        seq: row.get(at + 4)?,
        created_at: row.get(at + 5)?,
        generation: row.get(at + 6)?,
    })
}

/// The message of `key` (its unique index).
pub(crate) fn read_manifest(sql: &dyn Sql, key: &str) -> Result<Option<Manifest>, FanoutError> {
    let Some(row) = sql.query_row(
        concat!(
            "SELECT ",
            manifest_columns!(),
            " FROM durability_fanout_messages WHERE key = ?"
        ),
        &params![key],
    )?
    else {
        return Ok(None);
    };
    decode_manifest_at(&row, 0)
        .map(Some)
        .map_err(|error| decode_error(MESSAGES_TABLE, key, error))
}

/// The next sequence number to allocate (the first is 0). Read once per
/// enqueue; [`store_next_seq`] writes it back once, so a call of any size
/// costs one write for its sequence numbers.
pub(crate) fn read_next_seq(sql: &dyn Sql) -> Result<i64, FanoutError> {
    match sql.query_row(
        "SELECT next_seq FROM durability_fanout_seq WHERE id = 1",
        &[],
    )? {
        Some(row) => Ok(row.get::<i64>(0)?),
        None => Err(decode_error(
            "durability_fanout_seq",
            "1",
            "the row seeded by durability_0005_create_fanout is missing",
        )),
    }
}

/// Stores the next sequence number (primary key of the one-row table).
pub(crate) fn store_next_seq(sql: &dyn Sql, next: i64) -> Result<(), StorageError> {
    sql.execute(
        "UPDATE durability_fanout_seq SET next_seq = ? WHERE id = 1",
        &params![next],
    )?;
    Ok(())
}

/// Inserts a message; its key and sequence must be free.
pub(crate) fn insert_manifest(sql: &dyn Sql, manifest: &Manifest) -> Result<(), StorageError> {
    sql.execute(
        "INSERT INTO durability_fanout_messages \
         (seq, key, id, payload, targets, created_at, generation_id) \
         VALUES (?, ?, ?, ?, ?, ?, ?)",
        &params![
            manifest.seq,
            manifest.key.as_str(),
            manifest.id.as_str(),
            manifest.payload.as_str(),
            manifest.targets.as_str(),
            manifest.created_at,
            manifest.generation.as_str()
        ],
    )?;
    Ok(())
}

/// Deletes the messages in `[first, last]` that no span covers any more
/// and that have no exception row: the range delete that ends a span's
/// last target. Primary-key range; the exception probe is
/// `durability_fanout_exceptions_seq_idx`.
pub(crate) fn release_messages(
    sql: &dyn Sql,
    first: i64,
    last: i64,
) -> Result<usize, StorageError> {
    if sql
        .query_row(
            "SELECT 1 FROM durability_fanout_spans WHERE first_seq = ? LIMIT 1",
            &params![first],
        )?
        .is_some()
    {
        return Ok(0);
    }
    sql.execute(
        "DELETE FROM durability_fanout_messages WHERE seq >= ? AND seq <= ? \
         AND NOT EXISTS (SELECT 1 FROM durability_fanout_exceptions e \
         WHERE e.seq = durability_fanout_messages.seq)",
        &params![first, last],
    )
}

/// Deletes message `seq` if nothing owes it any more: no span covers it
/// (the span with the greatest `first_seq` at or below it, by
/// `durability_fanout_spans_seq_idx`) and it has no exception row left.
fn release_message(sql: &dyn Sql, seq: i64) -> Result<(), StorageError> {
    let covered = sql.query_row(
        "SELECT last_seq FROM durability_fanout_spans WHERE first_seq <= ? \
         ORDER BY first_seq DESC LIMIT 1",
        &params![seq],
    )?;
    if let Some(row) = covered
        && row.get::<i64>(0)? >= seq
    {
        return Ok(());
    }
    sql.execute(
        "DELETE FROM durability_fanout_messages WHERE seq = ? AND NOT EXISTS \
         (SELECT 1 FROM durability_fanout_exceptions WHERE seq = ?)",
        &params![seq, seq],
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Cursors and spans

/// Gives `target` a cursor at 0 if it has none (primary key; writes only
/// the first time).
pub(crate) fn ensure_cursor(sql: &dyn Sql, target: &str) -> Result<(), StorageError> {
    sql.execute(
        "INSERT INTO durability_fanout_cursors (target_id, next_seq) VALUES (?, 0) \
         ON CONFLICT(target_id) DO NOTHING",
        &params![target],
    )?;
    Ok(())
}

/// Records that `target` owes `[first, last]`, due at `due_at`.
pub(crate) fn insert_span(
    sql: &dyn Sql,
    target: &str,
    first: i64,
    last: i64,
    due_at: EpochMs,
) -> Result<(), StorageError> {
    sql.execute(
        "INSERT INTO durability_fanout_spans (target_id, first_seq, last_seq, due_at) \
         VALUES (?, ?, ?, ?)",
        &params![target, first, last, due_at],
    )?;
    Ok(())
}

/// Every target that has a cursor and is not paused, in order (a small
/// table: one row per target ever named). A paused target gets no pass.
pub(crate) fn list_targets(sql: &dyn Sql) -> Result<Vec<String>, StorageError> {
    sql.query(
        "SELECT target_id FROM durability_fanout_cursors WHERE paused = 0 ORDER BY target_id",
        &[],
    )?
    .iter()
    .map(|row| row.get(0))
    .collect()
}

/// The cursor of `target` (primary key).
pub(crate) fn read_cursor(sql: &dyn Sql, target: &str) -> Result<Option<Cursor>, FanoutError> {
    let Some(row) = sql.query_row(
        "SELECT next_seq, claim_end, claim_attempt, claim_deadline, paused_until, paused \
         FROM durability_fanout_cursors WHERE target_id = ?",
        &params![target],
    )?
    else {
        return Ok(None);
    };
    let decoded = (|| -> Result<Cursor, StorageError> {
        let end: Option<i64> = row.get(1)?;
        let deadline: Option<EpochMs> = row.get(3)?;
        // Decoded with or without a claim: the claim's compare-and-set
        // matches on it, so a damaged value would never match (a pass that
        // changes nothing, again and again) instead of failing here.
        let attempt: u32 = row.get(2)?;
        Ok(Cursor {
            next_seq: row.get(0)?,
            claim: match end {
                Some(end) => Some(CursorClaim {
                    end,
                    attempt,
                    deadline: deadline.unwrap_or(0),
                }),
                None if attempt != 0 => {
                    return Err(StorageError::Decode {
                        column: "claim_attempt".into(),
                        expected: "0 when the cursor has no claim",
                        found: attempt.to_string(),
                    });
                }
                None => None,
            },
            paused_until: row.get(4)?,
            paused: row.get::<i64>(5)? != 0,
        })
    })();
    decoded
        .map(Some)
        .map_err(|error| decode_error(CURSORS_TABLE, target, error))
}

/// The first `limit` spans of `target`, in sequence order (a range of the
/// spans' primary key). Passed spans are deleted, so these are the ones it
/// still owes from.
const FIRST_SPANS_SQL: &str = "SELECT first_seq, last_seq, due_at FROM durability_fanout_spans \
     WHERE target_id = ? ORDER BY first_seq LIMIT ?";

pub(crate) fn first_spans(
    sql: &dyn Sql,
    target: &str,
    limit: usize,
) -> Result<Vec<Span>, StorageError> {
    sql.query(FIRST_SPANS_SQL, &params![target, limit_param(limit)])?
        .iter()
        .map(|row| {
            Ok(Span {
                first_seq: row.get(0)?,
                last_seq: row.get(1)?,
                due_at: row.get(2)?,
            })
        })
        .collect()
}

const CURSOR_MESSAGES_SQL: &str = "SELECT m.key, m.id, m.payload, m.targets, m.seq, m.created_at, \
     m.generation_id, e.seq IS NOT NULL \
     FROM durability_fanout_messages m LEFT JOIN durability_fanout_exceptions e \
     ON e.seq = m.seq AND e.target_id = ? \
     WHERE m.seq >= ? AND m.seq <= ? \
     AND (SELECT s.last_seq FROM durability_fanout_spans s WHERE s.target_id = ? \
          AND s.first_seq <= m.seq ORDER BY s.first_seq DESC LIMIT 1) >= m.seq \
     ORDER BY m.seq LIMIT ?";

/// Up to `limit` messages of `target` in `[from, to]` (those inside one of
/// its spans: a range may cross messages of other targets), each marked
/// when the target has an exception row for it. A primary-key range of the
/// messages; per message one probe of the spans' primary key and one of
/// `durability_fanout_exceptions_seq_idx`.
pub(crate) fn cursor_messages(
    sql: &dyn Sql,
    target: &str,
    from: i64,
    to: i64,
    limit: usize,
) -> Result<Vec<CursorMessage>, FanoutError> {
    let rows = sql.query(
        CURSOR_MESSAGES_SQL,
        &params![target, from, to, target, limit_param(limit)],
    )?;
    rows.iter()
        .map(|row| {
            let decoded = (|| -> Result<CursorMessage, StorageError> {
                Ok(CursorMessage {
                    manifest: decode_manifest_at(row, 0)?,
                    excepted: row.get::<i64>(7)? != 0,
                })
            })();
            decoded.map_err(|error| decode_error(MESSAGES_TABLE, "?", error))
        })
        .collect()
}

/// Moves the cursor of `target` to `next_seq` and claims `[next_seq, end)`
/// as `attempt` until `deadline`, if the cursor is still at `expected_seq`
/// with the claim attempt `expected_attempt` (0: none). Returns whether it
/// did.
pub(crate) fn write_claim(
    sql: &dyn Sql,
    target: &str,
    expected_seq: i64,
    expected_attempt: u32,
    next_seq: i64,
    claim: CursorClaim,
) -> Result<bool, StorageError> {
    Ok(sql.execute(
        "UPDATE durability_fanout_cursors SET next_seq = ?, claim_end = ?, claim_attempt = ?, \
         claim_deadline = ? WHERE target_id = ? AND next_seq = ? AND claim_attempt = ?",
        &params![
            next_seq,
            claim.end,
            claim.attempt,
            claim.deadline,
            target,
            expected_seq,
            expected_attempt
        ],
    )? > 0)
}

/// What an advance of a cursor changed.
#[derive(Debug, Default)]
pub(crate) struct Advance {
    /// The cursor was where the caller expected it.
    pub moved: bool,
}

/// Moves the cursor of `target` from `from` to `to` if it is still there
/// with claim attempt `attempt` (0: none). With `keep_claim`, the claim's
/// end, attempt and deadline stay (the rest of the claim is still out);
/// otherwise the claim is cleared. Then the target's tombstones below `to`
/// go, its spans that end below `to` go, and each message range that no
/// target owes any more is deleted.
pub(crate) fn advance_cursor(
    sql: &dyn Sql,
    target: &str,
    attempt: u32,
    from: i64,
    to: i64,
    keep_claim: bool,
) -> Result<Advance, StorageError> {
    let moved = if keep_claim {
        sql.execute(
            "UPDATE durability_fanout_cursors SET next_seq = ? \
             WHERE target_id = ? AND next_seq = ? AND claim_attempt = ?",
            &params![to, target, from, attempt],
        )?
    } else {
        sql.execute(
            "UPDATE durability_fanout_cursors SET next_seq = ?, claim_end = NULL, \
             claim_attempt = 0, claim_deadline = NULL \
             WHERE target_id = ? AND next_seq = ? AND claim_attempt = ?",
            &params![to, target, from, attempt],
        )?
    } > 0;
    if !moved {
        return Ok(Advance { moved });
    }
    if to > from {
        // Tombstones of deliveries the cursor now covers: a range of
        // durability_fanout_exceptions_seq_idx.
        sql.execute(
            "DELETE FROM durability_fanout_exceptions WHERE seq >= ? AND seq < ? \
             AND target_id = ? AND status = 'settled'",
            &params![from, to, target],
        )?;
        let passed = sql.query(
            "DELETE FROM durability_fanout_spans WHERE target_id = ? AND last_seq < ? \
             AND first_seq < ? RETURNING first_seq, last_seq",
            &params![target, to, to],
        )?;
        for row in &passed {
            release_messages(sql, row.get(0)?, row.get(1)?)?;
        }
    }
    Ok(Advance { moved })
}

/// Holds back the first deliveries of `target` until `until` (a target
/// that is not configured); primary key.
pub(crate) fn pause_cursor(
    sql: &dyn Sql,
    target: &str,
    until: EpochMs,
) -> Result<(), StorageError> {
    sql.execute(
        "UPDATE durability_fanout_cursors SET paused_until = ? WHERE target_id = ?",
        &params![until, target],
    )?;
    Ok(())
}

/// Pauses (or resumes) `target` for good, giving it a cursor if it has
/// none; primary key. Returns whether it changed anything.
pub(crate) fn set_paused(sql: &dyn Sql, target: &str, paused: bool) -> Result<bool, StorageError> {
    ensure_cursor(sql, target)?;
    let changed = sql.execute(
        "UPDATE durability_fanout_cursors SET paused = ? WHERE target_id = ? AND paused <> ?",
        &params![i64::from(paused), target, i64::from(paused)],
    )?;
    Ok(changed > 0)
}

/// The targets paused by the application, in order.
pub(crate) fn paused_targets(sql: &dyn Sql) -> Result<Vec<String>, StorageError> {
    sql.query(
        "SELECT target_id FROM durability_fanout_cursors WHERE paused <> 0 ORDER BY target_id",
        &[],
    )?
    .iter()
    .map(|row| row.get(0))
    .collect()
}

/// When each target that is not paused next has something due: its
/// cursor's claim deadline or the due time of its first span (one probe of
/// the spans' primary key), and its earliest pending exception (one probe
/// of `durability_fanout_exceptions_due_idx`). One row per target (a small
/// table: one row per target ever named); a paused target arms nothing.
const NEXT_DUE_SQL: &str = "SELECT c.target_id, \
       CASE WHEN c.claim_end IS NOT NULL THEN c.claim_deadline ELSE max( \
          (SELECT s.due_at FROM durability_fanout_spans s WHERE s.target_id = c.target_id \
           ORDER BY s.first_seq LIMIT 1), c.paused_until) END, \
       (SELECT min(e.next_attempt_at) FROM durability_fanout_exceptions e \
        WHERE e.target_id = c.target_id AND e.status = 'pending') \
     FROM durability_fanout_cursors c WHERE c.paused = 0";

/// When each target that is not paused has something due: (target, its
/// cursor's time, its earliest exception's), a target with neither left out.
pub(crate) fn next_due_by_target(sql: &dyn Sql) -> Result<Vec<TargetDue>, StorageError> {
    let mut due = Vec::new();
    for row in sql.query(NEXT_DUE_SQL, &[])?.iter() {
        let cursor: Option<EpochMs> = row.get(1)?;
        let exceptions: Option<EpochMs> = row.get(2)?;
        if cursor.is_some() || exceptions.is_some() {
            due.push(TargetDue {
                target: row.get(0)?,
                cursor,
                exceptions,
            });
        }
    }
    Ok(due)
}

/// One row of [`next_due_by_target`].
pub(crate) struct TargetDue {
    pub target: String,
    /// Its claim's deadline, or when its first span is due.
    pub cursor: Option<EpochMs>,
    /// Its earliest pending exception.
    pub exceptions: Option<EpochMs>,
}

/// Counts the owed deliveries of `target` (the view): walks its backlog.
pub(crate) fn count_owed_of(sql: &dyn Sql, target: &str) -> Result<u64, StorageError> {
    match sql.query_row(
        "SELECT COUNT(*) FROM durability_fanout_deliveries WHERE target_id = ?",
        &params![target],
    )? {
        Some(row) => row.get(0),
        None => Ok(0),
    }
}

/// Counts every owed delivery (the view). Walks the backlog: run it once
/// per instance, never per message.
pub(crate) fn count_owed(sql: &dyn Sql) -> Result<u64, StorageError> {
    match sql.query_row("SELECT COUNT(*) FROM durability_fanout_deliveries", &[])? {
        Some(row) => row.get(0),
        None => Ok(0),
    }
}

// ---------------------------------------------------------------------------
// Exceptions

/// The columns every exception read selects, in [`decode_delivery`]'s order.
macro_rules! delivery_columns {
    () => {
        "id, message_key, target_id, phase, attempt, next_attempt_at, last_error, \
         last_error_name, generation_id, dead_lettered_at, dead_letter_reason, seq"
    };
}

fn decode_delivery(row: &Row) -> Result<DeliveryRow, FanoutError> {
    let id: String = row
        .get(0)
        .map_err(|error| decode_error(EXCEPTIONS.name, "?", error))?;
    let decoded =
        (|| -> Result<DeliveryRow, StorageError> {
            let phase: String = row.get(3)?;
            let reason: Option<String> = row.get(10)?;
            Ok(DeliveryRow {
                id: id.clone(),
                message_key: row.get(1)?,
                target_id: row.get(2)?,
                seq: row.get(11)?,
                lane: Lane::Exception,
                phase: match phase.as_str() {
                    "delivery" => Phase::Delivery,
                    "dead_letter" => Phase::DeadLetter,
                    other => {
                        return Err(StorageError::Decode {
                            column: "phase".into(),
                            expected: "'delivery' or 'dead_letter'",
                            found: other.to_owned(),
                        });
                    }
                },
                attempt: row.get(4)?,
                next_attempt_at: row.get(5)?,
                last_error: row.get(6)?,
                last_error_name: row.get(7)?,
                generation: row.get(8)?,
                dead_lettered_at: row.get(9)?,
                dead_letter_reason: match reason {
                    None => None,
                    Some(text) => Some(DeadLetterReason::parse(&text).ok_or_else(|| {
                        StorageError::Decode {
                            column: "dead_letter_reason".into(),
                            expected: "'explicit' or 'exhausted'",
                            found: text.clone(),
                        }
                    })?),
                },
            })
        })();
    decoded.map_err(|error| decode_error(EXCEPTIONS.name, &id, error))
}

/// The delivery of `manifest` to `target` as its cursor hands it over.
pub(crate) fn cursor_delivery(
    manifest: &Manifest,
    target: &str,
    claim: CursorClaim,
) -> DeliveryRow {
    DeliveryRow {
        id: json_pair(&manifest.key, target),
        message_key: manifest.key.clone(),
        target_id: target.to_owned(),
        seq: manifest.seq,
        lane: Lane::Cursor,
        phase: Phase::Delivery,
        attempt: claim.attempt,
        next_attempt_at: claim.deadline,
        last_error: None,
        last_error_name: None,
        generation: manifest.generation.clone(),
        dead_lettered_at: None,
        dead_letter_reason: None,
    }
}

const RETRIES_DUE_SQL: &str = concat!(
    "SELECT ",
    delivery_columns!(),
    " FROM durability_fanout_exceptions \
     WHERE target_id = ? AND status = 'pending' AND next_attempt_at <= ? \
     ORDER BY seq LIMIT ?"
);

/// Up to `limit` due exception rows of `target` (retries, and dead-letter
/// intent waiting for its DLQ write), by sequence.
///
/// `durability_fanout_exceptions_due_idx (target_id, next_attempt_at)
/// WHERE status = 'pending'`: a range over the due ones only, then a
/// top-`limit` sort of those by `seq`.
pub(crate) fn retries_due(
    sql: &dyn Sql,
    target: &str,
    now: EpochMs,
    limit: usize,
) -> Result<Vec<DeliveryRow>, FanoutError> {
    let rows = sql.query(RETRIES_DUE_SQL, &params![target, now, limit_param(limit)])?;
    rows.iter().map(decode_delivery).collect()
}

/// The pending exception row `id` (primary key).
pub(crate) fn read_delivery(sql: &dyn Sql, id: &str) -> Result<Option<DeliveryRow>, FanoutError> {
    let row = sql.query_row(
        concat!(
            "SELECT ",
            delivery_columns!(),
            " FROM durability_fanout_exceptions WHERE id = ? AND status = 'pending'"
        ),
        &params![id],
    )?;
    row.as_ref().map(decode_delivery).transpose()
}

/// Whether `id` has a row at all (pending or settled): a delivery off its
/// cursor (primary key).
pub(crate) fn has_row(sql: &dyn Sql, id: &str) -> Result<bool, StorageError> {
    Ok(sql
        .query_row(
            "SELECT 1 FROM durability_fanout_exceptions WHERE id = ?",
            &params![id],
        )?
        .is_some())
}

/// Claims an exception row's next attempt with the batch deadline as its
/// due time (primary key). Returns the claimed attempt, or `None` when the
/// row moved on.
pub(crate) fn claim(
    sql: &dyn Sql,
    row: &DeliveryRow,
    max_attempts: u32,
    deadline: EpochMs,
) -> Result<Option<u32>, StorageError> {
    claim_attempt(
        sql,
        EXCEPTIONS,
        &row.id,
        &row.generation,
        max_attempts,
        Some(deadline),
    )
}

/// For a delivery on its cursor: gives it a row of its own, as claimed
/// (`pending`) or already done (`settled`, a tombstone), if the cursor's
/// claim is still the one that handed it over (same attempt, the message
/// inside `[next_seq, claim_end)`). An exception row is left as it is.
/// Returns whether the delivery is (still) owned by this attempt.
fn materialize(sql: &dyn Sql, row: &DeliveryRow, settled: bool) -> Result<bool, StorageError> {
    if row.lane == Lane::Exception {
        return Ok(true);
    }
    let inserted = sql.execute(
        "INSERT INTO durability_fanout_exceptions \
         (id, message_key, target_id, seq, status, phase, attempt, next_attempt_at, \
          created_at, generation_id) \
         SELECT ?, ?, ?, ?, ?, 'delivery', ?, ?, m.created_at, m.generation_id \
         FROM durability_fanout_messages m WHERE m.seq = ? AND m.generation_id = ? \
         AND EXISTS (SELECT 1 FROM durability_fanout_cursors c WHERE c.target_id = ? \
           AND c.claim_attempt = ? AND c.next_seq <= ? AND c.claim_end > ?) \
         ON CONFLICT(id) DO NOTHING",
        &params![
            row.id.as_str(),
            row.message_key.as_str(),
            row.target_id.as_str(),
            row.seq,
            if settled { "settled" } else { "pending" },
            row.attempt,
            row.next_attempt_at,
            row.seq,
            row.generation.as_str(),
            row.target_id.as_str(),
            row.attempt,
            row.seq,
            row.seq
        ],
    )?;
    if inserted > 0 {
        return Ok(true);
    }
    // Already materialized by an earlier step of this attempt (dead-letter
    // intent before its DLQ write): the compare-and-set on the row decides.
    Ok(!settled
        && sql
            .query_row(
                "SELECT 1 FROM durability_fanout_exceptions WHERE id = ? AND generation_id = ? \
                 AND status = 'pending' AND attempt = ?",
                &params![row.id.as_str(), row.generation.as_str(), row.attempt],
            )?
            .is_some())
}

/// Ends a delivery that `row`'s attempt still owns (acked, dead-lettered,
/// parked), with its memos. While its target's cursor has not passed it,
/// it leaves a `settled` tombstone (a crash before the cursor moves must
/// not deliver it again); otherwise its row goes, and its message with it
/// when nothing else owes it. Returns whether it was this attempt's to end.
pub(crate) fn remove_delivery(sql: &dyn Sql, row: &DeliveryRow) -> Result<bool, StorageError> {
    if row.lane == Lane::Cursor && !has_row(sql, &row.id)? {
        if !materialize(sql, row, true)? {
            return Ok(false);
        }
        delete_memos(sql, DELIVERIES, &row.id)?;
        return Ok(true);
    }
    let attempt = row.attempt_ref();
    let tombstoned = update_attempt(sql, EXCEPTIONS, &attempt, "status = 'settled'", &[])?;
    if !tombstoned {
        return Ok(false);
    }
    delete_memos(sql, DELIVERIES, &row.id)?;
    // The tombstone only matters while the cursor has not passed the
    // message; behind the cursor the row goes at once.
    let behind = sql.execute(
        "DELETE FROM durability_fanout_exceptions WHERE id = ? AND status = 'settled' \
         AND seq < (SELECT next_seq FROM durability_fanout_cursors WHERE target_id = ?)",
        &params![row.id.as_str(), row.target_id.as_str()],
    )?;
    if behind > 0 {
        release_message(sql, row.seq)?;
    }
    Ok(true)
}

/// Moves an exception row's due time to `at` without touching its attempt
/// or errors.
pub(crate) fn postpone(
    sql: &dyn Sql,
    attempt: &AttemptRef,
    at: EpochMs,
) -> Result<bool, StorageError> {
    update_attempt(
        sql,
        EXCEPTIONS,
        attempt,
        "next_attempt_at = ?",
        &params![at],
    )
}

/// Schedules the next attempt at `at` and records the failure.
pub(crate) fn schedule_retry(
    sql: &dyn Sql,
    row: &DeliveryRow,
    at: EpochMs,
    error: &SerializedError,
) -> Result<bool, StorageError> {
    if !materialize(sql, row, false)? {
        return Ok(false);
    }
    update_attempt(
        sql,
        EXCEPTIONS,
        &row.attempt_ref(),
        "next_attempt_at = ?, last_error = ?, last_error_name = ?",
        &params![at, error.message.as_str(), error.name.as_str()],
    )
}

/// Persists dead-letter intent: from now on the delivery only ever goes to
/// the DLQ, retried at `retry_at`.
pub(crate) fn persist_dead_letter_intent(
    sql: &dyn Sql,
    row: &DeliveryRow,
    dead_lettered_at: EpochMs,
    reason: DeadLetterReason,
    retry_at: EpochMs,
    error: Option<&SerializedError>,
) -> Result<bool, StorageError> {
    if !materialize(sql, row, false)? {
        return Ok(false);
    }
    update_attempt(
        sql,
        EXCEPTIONS,
        &row.attempt_ref(),
        "phase = 'dead_letter', dead_lettered_at = ?, dead_letter_reason = ?, \
         next_attempt_at = ?, last_error = ?, last_error_name = ?",
        &params![
            dead_lettered_at,
            reason.as_str(),
            retry_at,
            error.map(|e| e.message.as_str()),
            error.map(|e| e.name.as_str())
        ],
    )
}

// ---------------------------------------------------------------------------
// Parked dead letters

/// Parks a dead letter.
pub(crate) fn park(sql: &dyn Sql, parked: &ParkedRow) -> Result<(), StorageError> {
    sql.execute(
        "INSERT INTO durability_fanout_parked \
         (id, message_id, message_key, target_id, payload, enqueued_at, parked_at, attempts, \
          reason, error_name, error_message) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        &params![
            parked.id.as_str(),
            parked.message_id.as_str(),
            parked.message_key.as_str(),
            parked.target_id.as_str(),
            parked.payload.as_str(),
            parked.enqueued_at,
            parked.parked_at,
            parked.attempts,
            parked.reason.as_str(),
            parked.error.as_ref().map(|e| e.name.as_str()),
            parked.error.as_ref().map(|e| e.message.as_str())
        ],
    )?;
    Ok(())
}

macro_rules! parked_columns {
    () => {
        "id, message_id, message_key, target_id, payload, enqueued_at, parked_at, attempts, \
         reason, error_name, error_message"
    };
}

fn decode_parked(row: &Row) -> Result<ParkedRow, FanoutError> {
    let id: String = row
        .get(0)
        .map_err(|error| decode_error(PARKED_TABLE, "?", error))?;
    let decoded = (|| -> Result<ParkedRow, StorageError> {
        let reason: String = row.get(8)?;
        let error_name: Option<String> = row.get(9)?;
        let error_message: Option<String> = row.get(10)?;
        Ok(ParkedRow {
            id: id.clone(),
            message_id: row.get(1)?,
            message_key: row.get(2)?,
            target_id: row.get(3)?,
            payload: row.get(4)?,
            enqueued_at: row.get(5)?,
            parked_at: row.get(6)?,
            attempts: row.get(7)?,
            reason: DeadLetterReason::parse(&reason).ok_or_else(|| StorageError::Decode {
                column: "reason".into(),
                expected: "'explicit' or 'exhausted'",
                found: reason.clone(),
            })?,
            error: error_message.map(|message| {
                SerializedError::new(error_name.unwrap_or_else(|| "Error".into()), message)
            }),
        })
    })();
    decoded.map_err(|error| decode_error(PARKED_TABLE, &id, error))
}

/// The parked dead letter `id` (primary key).
pub(crate) fn read_parked(sql: &dyn Sql, id: &str) -> Result<Option<ParkedRow>, FanoutError> {
    let row = sql.query_row(
        concat!(
            "SELECT ",
            parked_columns!(),
            " FROM durability_fanout_parked WHERE id = ?"
        ),
        &params![id],
    )?;
    row.as_ref().map(decode_parked).transpose()
}

const PARKED_PAGE_SQL: &str = concat!(
    "SELECT ",
    parked_columns!(),
    " FROM durability_fanout_parked WHERE (parked_at, id) > (?, ?) \
     ORDER BY parked_at, id LIMIT ?"
);

/// Up to `limit` parked dead letters after `after` (parked time, id), oldest
/// first: one range of `durability_fanout_parked_at_idx (parked_at, id)`.
pub(crate) fn list_parked(
    sql: &dyn Sql,
    after: Option<(EpochMs, &str)>,
    limit: usize,
) -> Result<Vec<ParkedRow>, FanoutError> {
    let rows = match after {
        None => sql.query(
            concat!(
                "SELECT ",
                parked_columns!(),
                " FROM durability_fanout_parked ORDER BY parked_at, id LIMIT ?"
            ),
            &params![limit_param(limit)],
        )?,
        Some((parked_at, id)) => {
            sql.query(PARKED_PAGE_SQL, &params![parked_at, id, limit_param(limit)])?
        }
    };
    rows.iter().map(decode_parked).collect()
}

/// Deletes the parked dead letter `id` (primary key). Returns whether it
/// existed.
pub(crate) fn delete_parked(sql: &dyn Sql, id: &str) -> Result<bool, StorageError> {
    Ok(sql.execute(
        "DELETE FROM durability_fanout_parked WHERE id = ?",
        &params![id],
    )? > 0)
}

/// Deletes every parked dead letter parked before `before`: one range of
/// `durability_fanout_parked_at_idx`. Returns how many.
pub(crate) fn purge_parked_before(sql: &dyn Sql, before: EpochMs) -> Result<u64, StorageError> {
    let deleted = sql.execute(
        "DELETE FROM durability_fanout_parked WHERE parked_at < ?",
        &[Value::from(before)],
    )?;
    Ok(u64::try_from(deleted).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use durability_host::{DurableObject, Host, ObjectContext};

    use super::*;
    use crate::migrations::{FANOUT_CAPABILITY, FANOUT_MIGRATIONS, MigrationTarget, migrate};

    #[test]
    fn json_pair_matches_json_stringify() {
        assert_eq!(json_pair("k", "t"), r#"["k","t"]"#);
        assert_eq!(json_pair("a\"b", "é/\n"), r#"["a\"b","é/\n"]"#);
    }

    struct Plain {
        ctx: ObjectContext,
    }

    impl DurableObject for Plain {}

    /// SQLite's plan for `query`, one step per line.
    fn plan(sql: &dyn Sql, query: &str, params: &[Value]) -> String {
        sql.query(&format!("EXPLAIN QUERY PLAN {query}"), params)
            .unwrap()
            .iter()
            .map(|row| row.get::<String>(3).unwrap())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The queries a pass and the scheduler run, on a real SQLite with the
    /// real schema: every step is a search of the index its comment names
    /// (never a scan of a table that grows with the backlog), and only the
    /// due retries are sorted.
    #[tokio::test]
    async fn every_per_pass_query_reads_a_range_of_its_index() {
        let plans = tokio::task::LocalSet::new()
            .run_until(async {
                let dir = tempfile::tempdir().unwrap();
                let host = Host::builder(dir.path()).threads(0).build().unwrap();
                let objects = host.namespace("plans", |ctx| Ok(Plain { ctx })).unwrap();
                let plans = objects
                    .stub("o")
                    .unwrap()
                    .call(|object: Rc<Plain>| async move {
                        let ctx = object.ctx.clone().into_dyn();
                        let sql = ctx.storage();
                        migrate(
                            sql,
                            FANOUT_CAPABILITY,
                            FANOUT_MIGRATIONS,
                            MigrationTarget::Latest,
                        )
                        .unwrap();
                        vec![
                            (
                                "cursor messages",
                                plan(
                                    sql,
                                    CURSOR_MESSAGES_SQL,
                                    &params!["t", 0_i64, 9_i64, "t", 10_i64],
                                ),
                                vec![
                                    "SEARCH m USING INTEGER PRIMARY KEY",
                                    "durability_fanout_exceptions_seq_idx",
                                    "SEARCH s USING PRIMARY KEY",
                                ],
                                false,
                            ),
                            (
                                "first spans",
                                plan(sql, FIRST_SPANS_SQL, &params!["t", 10_i64]),
                                vec!["SEARCH durability_fanout_spans USING PRIMARY KEY"],
                                false,
                            ),
                            (
                                "retries due",
                                plan(sql, RETRIES_DUE_SQL, &params!["t", 0_i64, 10_i64]),
                                vec!["durability_fanout_exceptions_due_idx"],
                                true,
                            ),
                            (
                                "next due",
                                // One row per target (cursors), each a
                                // probe of its spans and its exceptions.
                                plan(sql, NEXT_DUE_SQL, &[]),
                                vec![
                                    "SEARCH e USING COVERING INDEX durability_fanout_exceptions_due_idx",
                                    "SEARCH s USING PRIMARY KEY",
                                ],
                                false,
                            ),
                            (
                                "parked page",
                                plan(sql, PARKED_PAGE_SQL, &params![0_i64, "", 10_i64]),
                                vec!["durability_fanout_parked_at_idx"],
                                false,
                            ),
                        ]
                    })
                    .await
                    .unwrap();
                host.shutdown().await;
                plans
            })
            .await;
        for (name, plan, indexes, may_sort) in plans {
            for index in indexes {
                assert!(plan.contains(index), "{name} does not use {index}: {plan}");
            }
            for big in ["messages", "exceptions", "spans", "parked"] {
                assert!(
                    !plan.contains(&format!("SCAN durability_fanout_{big}"))
                        && !plan.contains(&format!("SCAN {}", &big[..1])),
                    "{name} scans {big}: {plan}"
                );
            }
            assert_eq!(plan.contains("TEMP B-TREE"), may_sort, "{name}: {plan}");
        }
    }
}
