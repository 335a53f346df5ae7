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
//!
//! With group commit (`Synchronous::Batched`) an object's commit is not
//! durable when it returns, so the exact update after it (which may raise
//! or remove the entry) is *deferred*: it is kept here with the commit's
//! sequence number and written only once the flusher made that commit
//! durable. Otherwise a power cut could keep the raised index and lose the
//! object's commit, and the alarm in the file would be missed. A lowering
//! still goes first and synced, and drops the deferred update of its object
//! (the newer commit will defer its own).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

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
    wal: PathBuf,
    /// Held shared around writes while the flusher takes sync images.
    files: Option<std::sync::Arc<RwLock<()>>>,
}

struct IndexConnection {
    conn: Connection,
    /// The `synchronous` setting the connection has now.
    current: Synchronous,
    /// Exact updates waiting for their object's commit to be durable:
    /// (namespace, time or removal, the commit's sequence number).
    deferred: HashMap<ObjectId, (String, Option<EpochMs>, u64)>,
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
    /// `synchronous` is the setting of lowering writes; `files` is the
    /// sync images' lock, when images are taken.
    pub(crate) fn open(
        data_dir: &Path,
        synchronous: Synchronous,
        files: Option<std::sync::Arc<RwLock<()>>>,
    ) -> Result<Self, StorageError> {
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
                deferred: HashMap::new(),
            }),
            synchronous,
            wal: data_dir.join("index.sqlite-wal"),
            files,
        })
    }

    /// The index's WAL file (the flusher syncs it after deferred updates).
    pub(crate) fn wal_path(&self) -> &Path {
        &self.wal
    }

    fn with<T>(
        &self,
        write: Option<IndexWrite>,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StorageError> {
        let _files = match (&self.files, write) {
            (Some(lock), Some(_)) => Some(lock.read().unwrap_or_else(|e| e.into_inner())),
            _ => None,
        };
        let mut guard = self.conn.lock().map_err(|_| StorageError::Unavailable {
            message: "the alarm index lock is poisoned".into(),
        })?;
        match write {
            None => f(&guard.conn).map_err(storage_error),
            Some(IndexWrite::Relaxed) => Self::write(&mut guard, Synchronous::Normal, f),
            Some(IndexWrite::Lowering) => Self::write(&mut guard, self.synchronous, f),
        }
    }

    fn write<T>(
        guard: &mut IndexConnection,
        wanted: Synchronous,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StorageError> {
        if guard.current != wanted {
            guard
                .conn
                .pragma_update(None, "synchronous", wanted.pragma())
                .map_err(storage_error)?;
            guard.current = wanted;
        }
        if wanted == Synchronous::Full {
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
        if write == IndexWrite::Lowering {
            // An older deferred update must not raise it back later; the
            // commit this lowering precedes defers its own.
            self.forget_deferred(id);
        }
        self.with(Some(write), |conn| write_entry(conn, id, namespace, at_ms))
    }
}

impl AlarmIndex {
    fn forget_deferred(&self, id: &ObjectId) {
        if let Ok(mut guard) = self.conn.lock() {
            guard.deferred.remove(id);
        }
    }

    /// Keeps the exact update of object `id` until commit `seq` is durable
    /// (group commit); it replaces an older deferred update of the object.
    pub(crate) fn defer(&self, id: &ObjectId, namespace: &str, at_ms: Option<EpochMs>, seq: u64) {
        match self.conn.lock() {
            Ok(mut guard) => {
                guard
                    .deferred
                    .insert(id.clone(), (namespace.to_owned(), at_ms, seq));
            }
            Err(_) => tracing::warn!(object = %id, "alarm index lock poisoned; update dropped"),
        }
    }

    /// Writes the deferred updates whose commits are durable now (up to
    /// `durable`). Returns whether it wrote anything. A failed write only
    /// leaves the index early or stale, which is allowed.
    pub(crate) fn apply_durable(&self, durable: u64) -> bool {
        let _files = self
            .files
            .as_ref()
            .map(|lock| lock.read().unwrap_or_else(|e| e.into_inner()));
        let Ok(mut guard) = self.conn.lock() else {
            return false;
        };
        let ready: Vec<ObjectId> = guard
            .deferred
            .iter()
            .filter(|(_, (_, _, seq))| *seq <= durable)
            .map(|(id, _)| id.clone())
            .collect();
        if ready.is_empty() {
            return false;
        }
        let updates: Vec<(ObjectId, String, Option<EpochMs>)> = ready
            .into_iter()
            .filter_map(|id| {
                let (namespace, at_ms, _) = guard.deferred.remove(&id)?;
                Some((id, namespace, at_ms))
            })
            .collect();
        let written = Self::write(&mut guard, Synchronous::Normal, |conn| {
            let tx = conn.unchecked_transaction()?;
            for (id, namespace, at_ms) in &updates {
                write_entry(&tx, id, namespace, *at_ms)?;
            }
            tx.commit()
        });
        if let Err(error) = written {
            tracing::warn!(%error, "deferred alarm index updates failed");
        }
        true
    }
}

fn write_entry(
    conn: &Connection,
    id: &ObjectId,
    namespace: &str,
    at_ms: Option<EpochMs>,
) -> rusqlite::Result<()> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(dir: &Path) -> AlarmIndex {
        AlarmIndex::open(dir, Synchronous::Full, None).unwrap()
    }

    #[test]
    fn a_deferred_update_waits_for_its_commit_to_be_durable() {
        let dir = tempfile::tempdir().unwrap();
        let index = index(dir.path());
        let id = ObjectId::new("a".repeat(64));
        index
            .set(&id, "ns", Some(100), IndexWrite::Lowering)
            .unwrap();
        // Raised by commit 7, then cleared by commit 9.
        index.defer(&id, "ns", Some(500), 7);
        assert!(!index.apply_durable(6));
        assert_eq!(index.get(&id).unwrap(), Some(100));
        index.defer(&id, "ns", None, 9);
        // Only the newest update counts, and only once 9 is durable.
        assert!(!index.apply_durable(8));
        assert_eq!(index.get(&id).unwrap(), Some(100));
        assert!(index.apply_durable(9));
        assert_eq!(index.get(&id).unwrap(), None);
        assert!(!index.apply_durable(10));
    }

    #[test]
    fn a_lowering_drops_the_deferred_update_it_overtakes() {
        let dir = tempfile::tempdir().unwrap();
        let index = index(dir.path());
        let id = ObjectId::new("b".repeat(64));
        index.defer(&id, "ns", Some(900), 3);
        index
            .set(&id, "ns", Some(50), IndexWrite::Lowering)
            .unwrap();
        // Commit 3 turning durable must not raise the index above 50.
        assert!(!index.apply_durable(3));
        assert_eq!(index.get(&id).unwrap(), Some(50));
    }
}
