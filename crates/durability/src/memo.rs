//! Memos (§9): a handler's way to persist the result of a side effect under
//! a key of its choice, so that a retried attempt of the same record reuses
//! the result instead of repeating the side effect.
//!
//! ```ignore
//! // Inside a handler: the charge runs at most once per record generation,
//! // however many attempts the handler needs for the rest of its work.
//! let receipt: Receipt = memo.memoize("charge", payments.charge(&order)).await?;
//! ```
//!
//! Storage: one table, `durability_memos`, capability `memos`
//! ([`MEMO_MIGRATIONS`]), keyed by (record table, record key, memo key).
//!
//! Decisions where the reference is silent:
//! - A memo row stores the generation of the attempt that wrote it, but the
//!   generation is *not* part of the key. A memo of another generation (left
//!   by a named alarm that was rescheduled, or by a record that was purged
//!   and registered again before the purge's cleanup) is ignored, and the
//!   record's memos of other generations are deleted when found, guarded by
//!   the reader still owning the record. So a replacement never sees its
//!   predecessor's results, and rescheduling needs no memo cleanup of its own.
//! - A memo is written only while the attempt still owns its record (same
//!   generation, still pending, same attempt number), checked in the same
//!   statement as the write. An attempt that lost its record (timed out and
//!   retried, purged, replaced) still gets its callback's value back, but
//!   stores nothing that could leak into newer work.
//! - An error of the callback stores nothing; the next attempt runs it again.
//! - Two calls with the same key inside one attempt both run their
//!   callbacks if neither has stored yet; the first stored value stays.
//!
//! The engine deletes a record's memos in the transaction that ends the
//! record (completion, terminal failure, exhaustion, fanout removal), keeps
//! them on a retry, and drops orphans on purge. Every function here expects
//! the `memos` capability to be migrated.

use std::fmt;
use std::future::Future;
use std::rc::Rc;

use durability_platform::{Context, Sql, StorageError};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::codec::{self, CodecError};
use crate::error::HandlerError;
use crate::limits::{self, LimitError};
use crate::migrations::Migration;
use crate::record::{AttemptRef, DurableTable};

/// The memo table.
pub const MEMO_TABLE: &str = "durability_memos";

/// The migrations of the `memos` capability.
pub const MEMO_MIGRATIONS: &[Migration] = &[Migration {
    name: "durability_0008_create_memos",
    // WITHOUT ROWID: rows are looked up and deleted only by a prefix of the
    // primary key, so the key is the only index needed.
    up: "CREATE TABLE durability_memos (
  record_table TEXT NOT NULL,
  record_key TEXT NOT NULL,
  memo_key TEXT NOT NULL,
  generation_id TEXT NOT NULL,
  value TEXT NOT NULL,
  created_at INTEGER NOT NULL,
  PRIMARY KEY (record_table, record_key, memo_key)
) WITHOUT ROWID;",
    down: "DROP TABLE durability_memos;",
}];

/// Why [`Memo::memoize`] failed.
#[derive(Debug)]
pub enum MemoError<E> {
    /// The callback failed; nothing was stored.
    Callback(E),
    /// The callback's value cannot be stored as JSON, or a stored memo does
    /// not decode into the requested type (the callback is then *not* run
    /// again: its side effect already happened once).
    Codec(CodecError),
    /// The memo table could not be read or written.
    Storage(StorageError),
    /// A memo key that is empty or longer than
    /// [`MAX_ID_BYTES`](crate::limits::MAX_ID_BYTES) (`f` was not run), or
    /// a value above the capability's body limit (`f` ran; nothing was
    /// stored).
    Limit(LimitError),
}

impl<E: fmt::Display> fmt::Display for MemoError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoError::Callback(error) => write!(f, "memoized callback failed: {error}"),
            MemoError::Codec(error) => write!(f, "memo value: {error}"),
            MemoError::Storage(error) => write!(f, "memo storage: {error}"),
            MemoError::Limit(error) => write!(f, "memo: {error}"),
        }
    }
}

impl<E> From<StorageError> for MemoError<E> {
    fn from(error: StorageError) -> Self {
        MemoError::Storage(error)
    }
}

impl<E> From<CodecError> for MemoError<E> {
    fn from(error: CodecError) -> Self {
        MemoError::Codec(error)
    }
}

/// Lets a handler use `?` on `memoize`: the callback's own error comes out
/// unchanged (a non-retryable error stays non-retryable), anything else
/// becomes a retryable error.
impl<E: Into<HandlerError>> From<MemoError<E>> for HandlerError {
    fn from(error: MemoError<E>) -> Self {
        match error {
            MemoError::Callback(error) => error.into(),
            MemoError::Codec(error) => HandlerError::from(error),
            MemoError::Storage(error) => HandlerError::from(error),
            // The same key fails the same way on every attempt.
            MemoError::Limit(error) => HandlerError::non_retryable(format!("memo: {error}")),
        }
    }
}

/// The memos of one claimed attempt. Cloning is one reference-count
/// increment plus the attempt's key and generation.
#[derive(Clone)]
pub struct Memo {
    ctx: Rc<dyn Context>,
    table: DurableTable,
    attempt: AttemptRef,
    /// The largest value stored, in bytes of its own JSON, and the setting
    /// that sets it.
    max_value_bytes: (usize, &'static str),
}

impl fmt::Debug for Memo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Memo")
            .field("table", &self.table.name)
            .field("attempt", &self.attempt)
            .finish()
    }
}

impl Memo {
    /// Memos for `attempt` of a record in `table`.
    pub fn new(ctx: Rc<dyn Context>, table: DurableTable, attempt: AttemptRef) -> Self {
        Memo {
            ctx,
            table,
            attempt,
            max_value_bytes: (limits::DEFAULT_MAX_BODY_BYTES, "DEFAULT_MAX_BODY_BYTES"),
        }
    }

    /// Stores values of at most `bytes` of their own JSON, the body limit
    /// of the capability (`setting` names it in the error); default
    /// [`DEFAULT_MAX_BODY_BYTES`](crate::limits::DEFAULT_MAX_BODY_BYTES).
    pub fn max_value_bytes(mut self, bytes: usize, setting: &'static str) -> Self {
        self.max_value_bytes = (bytes, setting);
        self
    }

    /// The attempt these memos belong to.
    pub fn attempt(&self) -> &AttemptRef {
        &self.attempt
    }

    /// Returns the value stored under `key` for this record generation, or
    /// runs `f`, stores its value (if the attempt still owns the record) and
    /// returns it. `f` is not polled at all when a memo exists.
    pub async fn memoize<T, E>(
        &self,
        key: &str,
        f: impl Future<Output = Result<T, E>>,
    ) -> Result<T, MemoError<E>>
    where
        T: Serialize + DeserializeOwned,
    {
        limits::check_id("memo key", key).map_err(MemoError::Limit)?;
        if let Some(stored) = self.lookup(key)? {
            return Ok(codec::decode_as(&stored)?);
        }
        let value = f.await.map_err(MemoError::Callback)?;
        let text = codec::encode(&value)?;
        // Like any body (issue 10): a value above the limit is not stored,
        // and the call fails; `f` ran, and runs again on a retry.
        let (max_bytes, setting) = self.max_value_bytes;
        limits::check_body("memo value", codec::body_bytes(&text), max_bytes, setting)
            .map_err(MemoError::Limit)?;
        if !self.store(key, &text)? {
            tracing::debug!(
                table = self.table.name,
                key = %self.attempt.key,
                generation = %self.attempt.generation,
                attempt = self.attempt.attempt,
                memo = key,
                "memo not stored: the attempt no longer owns its record"
            );
        }
        Ok(value)
    }

    /// The stored text of this generation's memo under `key`. A memo of
    /// another generation is stale: it is ignored, and the record's stale
    /// memos are deleted while this attempt still owns the record.
    fn lookup(&self, key: &str) -> Result<Option<String>, StorageError> {
        let sql = self.ctx.storage();
        let Some(row) = sql.query_row(
            "SELECT generation_id, value FROM durability_memos \
             WHERE record_table = ? AND record_key = ? AND memo_key = ?",
            &[
                self.table.name.into(),
                self.attempt.key.as_str().into(),
                key.into(),
            ],
        )?
        else {
            return Ok(None);
        };
        if row.get::<String>(0)? == self.attempt.generation {
            return Ok(Some(row.get::<String>(1)?));
        }
        let DurableTable {
            name,
            key: key_column,
        } = self.table;
        sql.execute(
            &format!(
                "DELETE FROM durability_memos \
                 WHERE record_table = ? AND record_key = ? AND generation_id <> ? \
                 AND EXISTS (SELECT 1 FROM {name} WHERE {key_column} = ? AND generation_id = ? \
                 AND status = 'pending' AND attempt = ?)"
            ),
            &[
                name.into(),
                self.attempt.key.as_str().into(),
                self.attempt.generation.as_str().into(),
                self.attempt.key.as_str().into(),
                self.attempt.generation.as_str().into(),
                self.attempt.attempt.into(),
            ],
        )?;
        Ok(None)
    }

    /// Stores `text` under `key` in one statement that also checks the
    /// attempt still owns its record. Returns whether a row was written.
    fn store(&self, key: &str, text: &str) -> Result<bool, StorageError> {
        let DurableTable {
            name,
            key: key_column,
        } = self.table;
        let written = self.ctx.storage().execute(
            &format!(
                "INSERT INTO durability_memos \
                 (record_table, record_key, memo_key, generation_id, value, created_at) \
                 SELECT ?, ?, ?, ?, ?, ? \
                 WHERE EXISTS (SELECT 1 FROM {name} WHERE {key_column} = ? AND generation_id = ? \
                 AND status = 'pending' AND attempt = ?) \
                 ON CONFLICT (record_table, record_key, memo_key) DO UPDATE SET \
                 generation_id = excluded.generation_id, value = excluded.value, \
                 created_at = excluded.created_at \
                 WHERE durability_memos.generation_id <> excluded.generation_id"
            ),
            &[
                name.into(),
                self.attempt.key.as_str().into(),
                key.into(),
                self.attempt.generation.as_str().into(),
                text.into(),
                self.ctx.now_ms().into(),
                self.attempt.key.as_str().into(),
                self.attempt.generation.as_str().into(),
                self.attempt.attempt.into(),
            ],
        )?;
        Ok(written > 0)
    }
}

/// Deletes every memo of the record `key` in `table`. Call it inside the
/// transaction that ends the record, so that a rolled-back ending keeps them.
pub fn delete_memos(sql: &dyn Sql, table: DurableTable, key: &str) -> Result<usize, StorageError> {
    sql.execute(
        "DELETE FROM durability_memos WHERE record_table = ? AND record_key = ?",
        &[table.name.into(), key.into()],
    )
}

/// Deletes the memos of `table` whose record generation no longer exists
/// (purged, or replaced by a newer generation). Runs inside the purge
/// transaction; costs one primary-key lookup per memo of the table.
pub fn delete_stale_memos(sql: &dyn Sql, table: DurableTable) -> Result<usize, StorageError> {
    let DurableTable { name, key } = table;
    sql.execute(
        &format!(
            "DELETE FROM durability_memos WHERE record_table = ? AND NOT EXISTS \
             (SELECT 1 FROM {name} WHERE {name}.{key} = durability_memos.record_key \
             AND {name}.generation_id = durability_memos.generation_id)"
        ),
        &[name.into()],
    )
}

/// After a capability's `migrate` call: if `table` no longer exists, deletes
/// all of its memos. Does nothing when the table exists or the memo table
/// does not.
pub fn delete_memos_of_dropped_table(
    sql: &dyn Sql,
    table: DurableTable,
) -> Result<usize, StorageError> {
    let exists = |name: &str| -> Result<bool, StorageError> {
        Ok(sql
            .query_row(
                "SELECT 1 FROM sqlite_master WHERE type IN ('table', 'view') AND name = ?",
                &[name.into()],
            )?
            .is_some())
    };
    if !exists(MEMO_TABLE)? || exists(table.name)? {
        return Ok(0);
    }
    sql.execute(
        "DELETE FROM durability_memos WHERE record_table = ?",
        &[table.name.into()],
    )
}
