//! All SQL of fanout, as typed functions over the three reference tables
//! (`durability_fanout_messages`, `_deliveries`, `_seq`) and the parked
//! dead-letter table of this port (`durability_fanout_parked`). The schema
//! is [`crate::migrations::FANOUT_MIGRATIONS`].
//!
//! Cost rules, because fanout runs per message and per pass on the object's
//! one thread (a slow query delays every target):
//! - every statement that runs per message looks a row up by its primary
//!   key;
//! - every statement that runs per pass is a bounded range of an index and
//!   never touches rows that are not due, so its cost does not grow with the
//!   backlog (the query comments name the index);
//! - nothing counts the backlog except [`count_deliveries`], which runs
//!   once per fanout instance (the count is then kept exactly in memory).
//!
//! This module decides nothing: it reads and writes what the capability
//! tells it to. Every write to a delivery row is a compare-and-set on the
//! attempt that owns it ([`crate::record`]).

use durability_platform::{EpochMs, Row, Sql, StorageError, Value, params};

use super::error::FanoutError;
use super::message::DeadLetterReason;
use crate::error::{DurabilityError, SerializedError};
use crate::memo::delete_memos;
use crate::record::{AttemptRef, DurableTable, claim_attempt, delete_attempt, update_attempt};

/// The delivery table, as the scheduler and the record helpers name it.
pub(crate) const DELIVERIES: DurableTable = DurableTable::FANOUT_DELIVERIES;

const MESSAGES_TABLE: &str = "durability_fanout_messages";
const PARKED_TABLE: &str = "durability_fanout_parked";

/// Whether a delivery row is still being delivered or is on its way to the
/// DLQ (dead-letter intent persisted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Delivery,
    DeadLetter,
}

/// One `durability_fanout_deliveries` row: a (message registration,
/// target) pair still owed.
#[derive(Debug, Clone)]
pub(crate) struct DeliveryRow {
    /// `["<key>","<target>"]`.
    pub id: String,
    pub message_key: String,
    pub target_id: String,
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
    /// The attempt that owns the row as read (or as claimed).
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

/// One `durability_fanout_messages` row: the manifest of an accepted
/// registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Manifest {
    /// The deduplication key (primary key).
    pub key: String,
    pub id: String,
    /// The body in the stored encoding.
    pub payload: String,
    /// JSON array of the sorted frozen target ids.
    pub targets: String,
    /// Delivery rows not yet settled.
    pub remaining: i64,
    pub seq: i64,
    pub created_at: EpochMs,
    pub generation: String,
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

/// The columns every delivery read selects, in [`decode_delivery`]'s order.
macro_rules! delivery_columns {
    () => {
        "id, message_key, target_id, phase, attempt, next_attempt_at, last_error, \
         last_error_name, generation_id, dead_lettered_at, dead_letter_reason"
    };
}

fn decode_error(table: &'static str, key: &str, detail: impl ToString) -> FanoutError {
    FanoutError::Durability(DurabilityError::Decode {
        table,
        key: key.to_owned(),
        detail: detail.to_string(),
    })
}

fn decode_delivery(row: &Row) -> Result<DeliveryRow, FanoutError> {
    let id: String = row
        .get(0)
        .map_err(|error| decode_error(DELIVERIES.name, "?", error))?;
    let decoded =
        (|| -> Result<DeliveryRow, StorageError> {
            let phase: String = row.get(3)?;
            let reason: Option<String> = row.get(10)?;
            Ok(DeliveryRow {
                id: id.clone(),
                message_key: row.get(1)?,
                target_id: row.get(2)?,
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
    decoded.map_err(|error| decode_error(DELIVERIES.name, &id, error))
}

fn decode_deliveries(rows: &[Row]) -> Result<Vec<DeliveryRow>, FanoutError> {
    rows.iter().map(decode_delivery).collect()
}

/// The manifest of `key` (primary key).
pub(crate) fn read_manifest(sql: &dyn Sql, key: &str) -> Result<Option<Manifest>, FanoutError> {
    let Some(row) = sql.query_row(
        "SELECT key, id, payload, targets, remaining, seq, created_at, generation_id \
         FROM durability_fanout_messages WHERE key = ?",
        &params![key],
    )?
    else {
        return Ok(None);
    };
    let decoded = (|| -> Result<Manifest, StorageError> {
        Ok(Manifest {
            key: row.get(0)?,
            id: row.get(1)?,
            payload: row.get(2)?,
            targets: row.get(3)?,
            remaining: row.get(4)?,
            seq: row.get(5)?,
            created_at: row.get(6)?,
            generation: row.get(7)?,
        })
    })();
    decoded
        .map(Some)
        .map_err(|error| decode_error(MESSAGES_TABLE, key, error))
}

/// Allocates the next enqueue sequence number (the first is 0). Primary
/// key of the one-row table.
pub(crate) fn next_seq(sql: &dyn Sql) -> Result<i64, FanoutError> {
    let row = sql.query_row(
        "UPDATE durability_fanout_seq SET next_seq = next_seq + 1 WHERE id = 1 \
         RETURNING next_seq - 1",
        &[],
    )?;
    match row {
        Some(row) => Ok(row.get::<i64>(0)?),
        None => Err(decode_error(
            "durability_fanout_seq",
            "1",
            "the row seeded by durability_0005_create_fanout is missing",
        )),
    }
}

/// Inserts a manifest; its key must be free.
pub(crate) fn insert_manifest(sql: &dyn Sql, manifest: &Manifest) -> Result<(), StorageError> {
    sql.execute(
        "INSERT INTO durability_fanout_messages \
         (key, id, payload, targets, remaining, seq, created_at, generation_id) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        &params![
            manifest.key.as_str(),
            manifest.id.as_str(),
            manifest.payload.as_str(),
            manifest.targets.as_str(),
            manifest.remaining,
            manifest.seq,
            manifest.created_at,
            manifest.generation.as_str()
        ],
    )?;
    Ok(())
}

/// Inserts the delivery of `manifest` to `target` at attempt 0. Returns
/// `false` (and writes nothing) when the row already exists.
pub(crate) fn insert_delivery(
    sql: &dyn Sql,
    manifest: &Manifest,
    target: &str,
    next_attempt_at: EpochMs,
) -> Result<bool, StorageError> {
    let inserted = sql.execute(
        "INSERT INTO durability_fanout_deliveries \
         (id, message_key, target_id, seq, status, phase, attempt, next_attempt_at, \
          created_at, generation_id) \
         VALUES (?, ?, ?, ?, 'pending', 'delivery', 0, ?, ?, ?) \
         ON CONFLICT(id) DO NOTHING",
        &params![
            json_pair(&manifest.key, target),
            manifest.key.as_str(),
            target,
            manifest.seq,
            next_attempt_at,
            manifest.created_at,
            manifest.generation.as_str()
        ],
    )?;
    Ok(inserted == 1)
}

/// `durability_fanout_deliveries_due_idx (target_id, ...) WHERE phase =
/// 'delivery' AND attempt = 0`: one probe.
const NEXT_FIRST_TARGET_SQL: &str = "SELECT target_id FROM durability_fanout_deliveries \
     WHERE phase = 'delivery' AND attempt = 0 AND target_id > ? \
     ORDER BY target_id LIMIT 1";

/// `durability_fanout_deliveries_retry_idx (target_id, ...) WHERE attempt >
/// 0`: one probe.
const NEXT_CLAIMED_TARGET_SQL: &str = "SELECT target_id FROM durability_fanout_deliveries \
     WHERE attempt > 0 AND target_id > ? \
     ORDER BY target_id LIMIT 1";

/// The smallest target id above `after` that has delivery rows: one step of
/// a loose index scan (two index probes), so listing the targets costs
/// O(targets · log rows) instead of a `DISTINCT` over every row. The two
/// partial indexes together hold every row (a row leaves the first when its
/// first claim makes `attempt > 0`, which puts it in the second; dead-letter
/// intent is only ever persisted by a claimed attempt). Target ids are never
/// empty, so `after = ""` starts at the first one.
pub(crate) fn next_target(sql: &dyn Sql, after: &str) -> Result<Option<String>, StorageError> {
    let first = sql.query_row(NEXT_FIRST_TARGET_SQL, &params![after])?;
    let claimed = sql.query_row(NEXT_CLAIMED_TARGET_SQL, &params![after])?;
    let first: Option<String> = first.map(|row| row.get(0)).transpose()?;
    let claimed: Option<String> = claimed.map(|row| row.get(0)).transpose()?;
    Ok(match (first, claimed) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    })
}

const FIRST_DUE_SQL: &str = concat!(
    "SELECT ",
    delivery_columns!(),
    " FROM durability_fanout_deliveries \
     WHERE target_id = ? AND phase = 'delivery' AND attempt = 0 AND next_attempt_at <= ? \
     ORDER BY next_attempt_at, seq LIMIT ?"
);

const RETRIES_DUE_SQL: &str = concat!(
    "SELECT ",
    delivery_columns!(),
    " FROM durability_fanout_deliveries \
     WHERE target_id = ? AND attempt > 0 AND next_attempt_at <= ? \
     ORDER BY seq LIMIT ?"
);

/// Up to `limit` first deliveries of `target` due at `now`: by due time,
/// then sequence. A first delivery is due at `first_attempt_at(created_at)`,
/// which grows with the sequence (both are taken in the enqueue
/// transaction), so this is sequence order; ordering by the index instead
/// of by `seq` alone means the query stops after `limit` rows and never
/// walks first deliveries that are not due yet (a batch-delay window, or a
/// target's postponed backlog).
///
/// `durability_fanout_deliveries_due_idx (target_id, next_attempt_at, seq)
/// WHERE phase = 'delivery' AND attempt = 0`: one range, no sort.
pub(crate) fn first_deliveries_due(
    sql: &dyn Sql,
    target: &str,
    now: EpochMs,
    limit: usize,
) -> Result<Vec<DeliveryRow>, FanoutError> {
    let rows = sql.query(FIRST_DUE_SQL, &params![target, now, limit_param(limit)])?;
    decode_deliveries(&rows)
}

/// Up to `limit` due rows of `target` that were claimed before (retries, and
/// dead-letter intent waiting for its DLQ write), by sequence.
///
/// `durability_fanout_deliveries_retry_idx (target_id, next_attempt_at)
/// WHERE attempt > 0`: a range over the due ones only, then a top-`limit`
/// sort of those by `seq`. Rows in flight or waiting for their backoff are
/// never read.
pub(crate) fn retries_due(
    sql: &dyn Sql,
    target: &str,
    now: EpochMs,
    limit: usize,
) -> Result<Vec<DeliveryRow>, FanoutError> {
    let rows = sql.query(RETRIES_DUE_SQL, &params![target, now, limit_param(limit)])?;
    decode_deliveries(&rows)
}

/// Up to `limit` due rows of `target`: first deliveries, then retries.
pub(crate) fn list_due(
    sql: &dyn Sql,
    target: &str,
    now: EpochMs,
    limit: usize,
) -> Result<Vec<DeliveryRow>, FanoutError> {
    let mut due = first_deliveries_due(sql, target, now, limit)?;
    if due.len() < limit {
        due.extend(retries_due(sql, target, now, limit - due.len())?);
    }
    Ok(due)
}

/// A LIMIT parameter; -1 is SQLite's "no limit" (a larger integer would not
/// bind on every platform: JavaScript numbers stop at 2^53).
fn limit_param(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(-1)
}

/// The delivery row `id` (primary key).
pub(crate) fn read_delivery(sql: &dyn Sql, id: &str) -> Result<Option<DeliveryRow>, FanoutError> {
    let row = sql.query_row(
        concat!(
            "SELECT ",
            delivery_columns!(),
            " FROM durability_fanout_deliveries WHERE id = ?"
        ),
        &params![id],
    )?;
    row.as_ref().map(decode_delivery).transpose()
}

/// Claims the row's next attempt with the batch deadline as its due time
/// (primary key): the deadline is when the row comes back if this process
/// dies mid-batch. Returns the claimed attempt, or `None` when the row moved
/// on (another generation, or no attempts left).
pub(crate) fn claim(
    sql: &dyn Sql,
    row: &DeliveryRow,
    max_attempts: u32,
    deadline: EpochMs,
) -> Result<Option<u32>, StorageError> {
    claim_attempt(
        sql,
        DELIVERIES,
        &row.id,
        &row.generation,
        max_attempts,
        Some(deadline),
    )
}

/// Removes a delivery that `attempt` still owns, with its memos, and
/// releases its share of the manifest (deleting the manifest with its last
/// delivery). Returns whether the row was removed. Primary keys only.
pub(crate) fn remove_delivery(
    sql: &dyn Sql,
    attempt: &AttemptRef,
    message_key: &str,
) -> Result<bool, StorageError> {
    if !delete_attempt(sql, DELIVERIES, attempt)? {
        return Ok(false);
    }
    delete_memos(sql, DELIVERIES, &attempt.key)?;
    let remaining = sql.query_row(
        "UPDATE durability_fanout_messages SET remaining = remaining - 1 WHERE key = ? \
         RETURNING remaining",
        &params![message_key],
    )?;
    if let Some(row) = remaining
        && row.get::<i64>(0)? <= 0
    {
        sql.execute(
            "DELETE FROM durability_fanout_messages WHERE key = ?",
            &params![message_key],
        )?;
    }
    Ok(true)
}

/// Moves a row's due time to `at` without touching its attempt or errors.
pub(crate) fn postpone(
    sql: &dyn Sql,
    attempt: &AttemptRef,
    at: EpochMs,
) -> Result<bool, StorageError> {
    update_attempt(
        sql,
        DELIVERIES,
        attempt,
        "next_attempt_at = ?",
        &params![at],
    )
}

/// Schedules the next attempt at `at` and records the failure.
pub(crate) fn schedule_retry(
    sql: &dyn Sql,
    attempt: &AttemptRef,
    at: EpochMs,
    error: &SerializedError,
) -> Result<bool, StorageError> {
    update_attempt(
        sql,
        DELIVERIES,
        attempt,
        "next_attempt_at = ?, last_error = ?, last_error_name = ?",
        &params![at, error.message.as_str(), error.name.as_str()],
    )
}

/// Persists dead-letter intent: from now on the row only ever goes to the
/// DLQ, retried at `retry_at`.
pub(crate) fn persist_dead_letter_intent(
    sql: &dyn Sql,
    attempt: &AttemptRef,
    dead_lettered_at: EpochMs,
    reason: DeadLetterReason,
    retry_at: EpochMs,
    error: Option<&SerializedError>,
) -> Result<bool, StorageError> {
    update_attempt(
        sql,
        DELIVERIES,
        attempt,
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

/// Counts every delivery row. Scans an index: run it once per instance,
/// never per message.
pub(crate) fn count_deliveries(sql: &dyn Sql) -> Result<u64, StorageError> {
    match sql.query_row("SELECT COUNT(*) FROM durability_fanout_deliveries", &[])? {
        Some(row) => row.get(0),
        None => Ok(0),
    }
}

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
        Some((parked_at, id)) => sql.query(
            concat!(
                "SELECT ",
                parked_columns!(),
                " FROM durability_fanout_parked WHERE (parked_at, id) > (?, ?) \
                 ORDER BY parked_at, id LIMIT ?"
            ),
            &params![parked_at, id, limit_param(limit)],
        )?,
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

    /// The queries a pass runs, on a real SQLite with the real schema: each
    /// is a range of the index its comment names, and only the retries
    /// query sorts (the due retries, never the backlog).
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
                        migrate(sql, FANOUT_CAPABILITY, FANOUT_MIGRATIONS, MigrationTarget::Latest)
                            .unwrap();
                        let due = params!["t", 0_i64, 10_i64];
                        vec![
                            ("first due", plan(sql, FIRST_DUE_SQL, &due)),
                            ("retries due", plan(sql, RETRIES_DUE_SQL, &due)),
                            ("next first target", plan(sql, NEXT_FIRST_TARGET_SQL, &params![""])),
                            ("next claimed target", plan(sql, NEXT_CLAIMED_TARGET_SQL, &params![""])),
                            (
                                "earliest pending (the scheduler's)",
                                plan(
                                    sql,
                                    "SELECT id AS pk, next_attempt_at FROM durability_fanout_deliveries \
                                     WHERE status = 'pending' ORDER BY next_attempt_at ASC LIMIT ?",
                                    &params![1_i64],
                                ),
                            ),
                            (
                                "parked page",
                                plan(
                                    sql,
                                    concat!(
                                        "SELECT ",
                                        parked_columns!(),
                                        " FROM durability_fanout_parked WHERE (parked_at, id) > (?, ?) \
                                         ORDER BY parked_at, id LIMIT ?"
                                    ),
                                    &params![0_i64, "", 10_i64],
                                ),
                            ),
                        ]
                    })
                    .await
                    .unwrap();
                host.shutdown().await;
                plans
            })
            .await;
        let expected = [
            ("first due", "durability_fanout_deliveries_due_idx", false),
            (
                "retries due",
                "durability_fanout_deliveries_retry_idx",
                true,
            ),
            (
                "next first target",
                "durability_fanout_deliveries_due_idx",
                false,
            ),
            (
                "next claimed target",
                "durability_fanout_deliveries_retry_idx",
                false,
            ),
            (
                "earliest pending (the scheduler's)",
                "durability_fanout_deliveries_pending_idx",
                false,
            ),
            ("parked page", "durability_fanout_parked_at_idx", false),
        ];
        for ((name, plan), (expected_name, index, may_sort)) in plans.iter().zip(expected) {
            assert_eq!(*name, expected_name);
            assert!(
                plan.contains(&format!(
                    "SEARCH durability_fanout_{}",
                    if name.starts_with("parked") {
                        "parked"
                    } else {
                        "deliveries"
                    }
                )) && plan.contains(index),
                "{name}: {plan}"
            );
            assert_eq!(plan.contains("TEMP B-TREE"), may_sort, "{name}: {plan}");
        }
    }
}
