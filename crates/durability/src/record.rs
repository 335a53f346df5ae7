//! Generation-guarded compare-and-set on record tables (§2.4).
//!
//! Every record table (operations, named alarms, fanout deliveries) has a
//! key column and `generation_id`, `status`, `attempt`, `next_attempt_at`,
//! `last_error` and `last_error_name` columns. An attempt is identified by
//! an [`AttemptRef`]: the record's key, the generation it claimed and the
//! attempt number it claimed. Each function here is one statement whose
//! `WHERE` clause re-checks that identity, so a late or duplicated settlement
//! of an old attempt (after a purge, a replacement or a retry moved on)
//! changes nothing and reports that it did nothing.
//!
//! Table and column names are `&'static str` constants of this crate and
//! are formatted into the SQL; values are always bound parameters. The
//! generated text is identical on every call, so the platform's statement
//! cache still hits. Every statement looks the row up by its primary key.

use durability_platform::{EpochMs, Sql, StorageError, Value};

use crate::error::SerializedError;

/// A record table: its name and its primary-key column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DurableTable {
    /// The table name.
    pub name: &'static str,
    /// The primary-key column.
    pub key: &'static str,
}

impl DurableTable {
    /// Durable operations: `durability_calls`, keyed by `id`.
    pub const OPERATIONS: DurableTable = DurableTable {
        name: "durability_calls",
        key: "id",
    };
    /// Named alarms: `durability_alarms`, keyed by `name`.
    pub const NAMED_ALARMS: DurableTable = DurableTable {
        name: "durability_alarms",
        key: "name",
    };
    /// Fanout deliveries: `durability_fanout_deliveries`, keyed by `id`.
    pub const FANOUT_DELIVERIES: DurableTable = DurableTable {
        name: "durability_fanout_deliveries",
        key: "id",
    };
}

/// One claimed attempt of one generation of one record.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AttemptRef {
    /// The record's key.
    pub key: String,
    /// The generation the attempt belongs to.
    pub generation: String,
    /// The attempt number it claimed (1-based).
    pub attempt: u32,
}

/// Claims the next attempt of a pending record: `attempt = attempt + 1`
/// (and `next_attempt_at = deadline` when given, used by fanout) if the row
/// has this generation, is pending and has attempts left. Returns the new
/// attempt number, or `None` when the claim missed.
///
/// One statement, so the attempt is counted before any handler runs: a
/// crash during the handler still uses up the attempt.
pub fn claim_attempt(
    sql: &dyn Sql,
    table: DurableTable,
    key: &str,
    generation: &str,
    max_attempts: u32,
    deadline: Option<EpochMs>,
) -> Result<Option<u32>, StorageError> {
    let DurableTable {
        name,
        key: key_column,
    } = table;
    let row = match deadline {
        None => sql.query_row(
            &format!(
                "UPDATE {name} SET attempt = attempt + 1 \
                 WHERE {key_column} = ? AND generation_id = ? AND status = 'pending' AND attempt < ? \
                 RETURNING attempt"
            ),
            &[key.into(), generation.into(), max_attempts.into()],
        )?,
        Some(deadline) => sql.query_row(
            &format!(
                "UPDATE {name} SET attempt = attempt + 1, next_attempt_at = ? \
                 WHERE {key_column} = ? AND generation_id = ? AND status = 'pending' AND attempt < ? \
                 RETURNING attempt"
            ),
            &[deadline.into(), key.into(), generation.into(), max_attempts.into()],
        )?,
    };
    row.map(|row| row.get::<u32>(0)).transpose()
}

/// Updates the record only while `attempt` still owns it (same key,
/// generation and attempt number, still pending). `set_clause` is a constant
/// such as `"status = ?, next_attempt_at = ?"`; `values` bind its
/// placeholders in order. Returns whether the row changed.
pub fn update_attempt(
    sql: &dyn Sql,
    table: DurableTable,
    attempt: &AttemptRef,
    set_clause: &'static str,
    values: &[Value],
) -> Result<bool, StorageError> {
    let DurableTable { name, key } = table;
    let mut params = Vec::with_capacity(values.len() + 3);
    params.extend_from_slice(values);
    params.extend([
        Value::from(attempt.key.as_str()),
        Value::from(attempt.generation.as_str()),
        Value::from(attempt.attempt),
    ]);
    let changed = sql.execute(
        &format!(
            "UPDATE {name} SET {set_clause} \
             WHERE {key} = ? AND generation_id = ? AND status = 'pending' AND attempt = ?"
        ),
        &params,
    )?;
    Ok(changed > 0)
}

/// Deletes the record only while `attempt` still owns it. Returns whether a
/// row was deleted.
pub fn delete_attempt(
    sql: &dyn Sql,
    table: DurableTable,
    attempt: &AttemptRef,
) -> Result<bool, StorageError> {
    let DurableTable { name, key } = table;
    let deleted = sql.execute(
        &format!(
            "DELETE FROM {name} \
             WHERE {key} = ? AND generation_id = ? AND status = 'pending' AND attempt = ?"
        ),
        &[
            attempt.key.as_str().into(),
            attempt.generation.as_str().into(),
            attempt.attempt.into(),
        ],
    )?;
    Ok(deleted > 0)
}

/// Fails a pending record of this generation that has no attempts left
/// (`attempt >= max_attempts`), storing `error`. Returns the row's attempt
/// count, or `None` when nothing matched (row gone, replaced, settled, or
/// attempts remain).
pub fn exhaust_attempts(
    sql: &dyn Sql,
    table: DurableTable,
    key: &str,
    generation: &str,
    max_attempts: u32,
    error: &SerializedError,
) -> Result<Option<u32>, StorageError> {
    let DurableTable {
        name,
        key: key_column,
    } = table;
    let row = sql.query_row(
        &format!(
            "UPDATE {name} SET status = 'failed', last_error = ?, last_error_name = ? \
             WHERE {key_column} = ? AND generation_id = ? AND status = 'pending' AND attempt >= ? \
             RETURNING attempt"
        ),
        &[
            error.message.as_str().into(),
            error.name.as_str().into(),
            key.into(),
            generation.into(),
            max_attempts.into(),
        ],
    )?;
    row.map(|row| row.get::<u32>(0)).transpose()
}
