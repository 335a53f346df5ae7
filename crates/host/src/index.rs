//! The host's alarm index: `<data>/index.sqlite`, one row per object whose
//! alarm may be set, so a new process wakes every due object without opening
//! every object file.
//!
//! The index and an object's file are two databases, so no commit covers
//! both. The index is kept *conservative*: it never says an alarm is later
//! than the object's own row. Before an object commits an alarm earlier than
//! the indexed time (or where none is indexed) the index is lowered first;
//! after the commit it is set exactly. A crash in between leaves an early or
//! stale entry, which only causes a wake that finds the object's own row (the
//! truth) and corrects the index. A crash can therefore cost a spurious wake,
//! never a missed alarm.

use std::path::Path;
use std::sync::Mutex;

use durability_platform::{EpochMs, ObjectId, StorageError};
use rusqlite::{Connection, OptionalExtension, params};

use crate::Synchronous;
use crate::error::storage_error;

/// One indexed alarm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IndexedAlarm {
    pub(crate) id: ObjectId,
    pub(crate) namespace: String,
    pub(crate) at_ms: EpochMs,
}

/// The index database. A std `Mutex` because no await happens while it is
/// held: each use is one short statement.
pub(crate) struct AlarmIndex {
    conn: Mutex<IndexConnection>,
    synchronous: Synchronous,
}

struct IndexConnection {
    conn: Connection,
    /// The `synchronous` setting the connection has now.
    current: Synchronous,
}

/// How durable an index write must be before it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IndexWrite {
    /// The index is lowered before an object commits an earlier alarm: it
    /// must reach the disk first, with the host's `synchronous` setting.
    Lowering,
    /// Any other write (exact update after a commit, cleanup). Losing it in
    /// a power cut leaves the index early or stale, which is allowed, so it
    /// skips the fsync (`synchronous=NORMAL`); a later durable commit of
    /// the same WAL makes it durable too.
    Relaxed,
}

impl AlarmIndex {
    /// Opens (or creates) the index of `data_dir`.
    pub(crate) fn open(data_dir: &Path, synchronous: Synchronous) -> Result<Self, StorageError> {
        let conn = Connection::open(data_dir.join("index.sqlite")).map_err(storage_error)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(storage_error)?;
        conn.pragma_update(None, "synchronous", synchronous.pragma())
            .map_err(storage_error)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(storage_error)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS alarms (
                 id TEXT PRIMARY KEY,
                 namespace TEXT NOT NULL,
                 at_ms INTEGER NOT NULL
             ) WITHOUT ROWID;",
        )
        .map_err(storage_error)?;
        Ok(AlarmIndex {
            conn: Mutex::new(IndexConnection {
                conn,
                current: synchronous,
            }),
            synchronous,
        })
    }

    fn with<T>(
        &self,
        write: Option<IndexWrite>,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StorageError> {
        let mut guard = self.conn.lock().map_err(|_| StorageError::Unavailable {
            message: "the alarm index lock is poisoned".into(),
        })?;
        let wanted = match write {
            Some(IndexWrite::Relaxed) => Synchronous::Normal,
            Some(IndexWrite::Lowering) | None => self.synchronous,
        };
        if write.is_some() && guard.current != wanted {
            guard
                .conn
                .pragma_update(None, "synchronous", wanted.pragma())
                .map_err(storage_error)?;
            guard.current = wanted;
        }
        if write.is_some() && wanted == Synchronous::Full {
            crate::telemetry::fsynced();
        }
        f(&guard.conn).map_err(storage_error)
    }

    /// Every indexed alarm (read once when the host starts).
    pub(crate) fn all(&self) -> Result<Vec<IndexedAlarm>, StorageError> {
        self.with(None, |conn| {
            let mut stmt = conn.prepare("SELECT id, namespace, at_ms FROM alarms")?;
            let rows = stmt.query_map([], |row| {
                Ok(IndexedAlarm {
                    id: ObjectId::new(row.get::<_, String>(0)?),
                    namespace: row.get(1)?,
                    at_ms: row.get(2)?,
                })
            })?;
            rows.collect()
        })
    }

    /// The indexed time of one object.
    pub(crate) fn get(&self, id: &ObjectId) -> Result<Option<EpochMs>, StorageError> {
        self.with(None, |conn| {
            conn.prepare_cached("SELECT at_ms FROM alarms WHERE id = ?1")?
                .query_row(params![id.as_str()], |row| row.get(0))
                .optional()
        })
    }

    /// Sets the indexed time exactly, or removes the entry.
    pub(crate) fn set(
        &self,
        id: &ObjectId,
        namespace: &str,
        at_ms: Option<EpochMs>,
        write: IndexWrite,
    ) -> Result<(), StorageError> {
        self.with(Some(write), |conn| {
            match at_ms {
                Some(at_ms) => conn
                    .prepare_cached(
                        "INSERT INTO alarms (id, namespace, at_ms) VALUES (?1, ?2, ?3)
                         ON CONFLICT (id) DO UPDATE SET at_ms = excluded.at_ms",
                    )?
                    .execute(params![id.as_str(), namespace, at_ms])?,
                None => conn
                    .prepare_cached("DELETE FROM alarms WHERE id = ?1")?
                    .execute(params![id.as_str()])?,
            };
            Ok(())
        })
    }
}
