//! The host's alarm index: `<data>/index.sqlite`, one row per object whose
//! alarm may be set, so a new process wakes every due object without opening
//! every object file.
//!
//! The index and an object's file are two databases, so no commit covers
//! both. The index is kept *conservative*: it never says an alarm is later
//! than the object's own row. Before an object commits an alarm earlier than
//! the indexed time (or where none is indexed) the index is lowered first.
//! A later or cleared alarm is not written to the index while the object is
//! live (the index is read only when a host starts; a live object's alarm
//! is in its executor's schedule): the index follows when the object closes
//! (eviction or shutdown), after the close checkpointed the file. Until
//! then the entry is early or stale, which after a crash costs one wake
//! that finds the object's own row (the truth) and corrects the entry. A
//! crash can therefore cost a spurious wake, never a missed alarm. Writing
//! every raise and clear as it committed cost an index write per operation
//! under the lock all executors share: about 15% of the CPU of `bench
//! operations`, measured in interleaved runs.
//!
//! When an object opens and its file holds a later alarm than the index
//! (or none), the exact entry is written after the file's next sync: with
//! group commit (`Synchronous::Batched`) it is *deferred*, kept here with a
//! commit sequence number and written only once the flusher made that
//! commit durable. A lowering goes first, and drops the deferred update of
//! its object.
//!
//! How a lowering reaches the disk depends on the mode. With
//! `Synchronous::Full` it is synced before the object's commit starts.
//! With group commit it is only written (no sync of its own): a sync per
//! lowering, on the executor thread and under the index's lock, halved the
//! default mode's throughput in `bench operations` (one per operation on an
//! object that was idle). Written before the object's commit, it survives
//! every process crash with it: the kernel keeps what a dead process
//! wrote. Only a power loss (or a kernel crash) can keep the object's
//! commit and lose the lowering, since the kernel may write the object's
//! WAL back before the index's. So a group-commit host records in the
//! index that it runs, with the machine's boot id (Linux's
//! `/proc/sys/kernel/random/boot_id`), synced before any object opens, and
//! records a clean stop at the end of [`crate::Host::shutdown`]. A host
//! that starts after a run that did not stop cleanly, on a machine that has
//! rebooted since (or whose boot id cannot be read), rebuilds the index
//! from the object files as below ([`RebuildReason::UncleanReboot`]): the
//! price of a power loss is one rebuild at the next start.
//!
//! The index is derived data: the object files are the truth. When the
//! host starts and `index.sqlite` is missing, is not a database, fails
//! SQLite's `quick_check`, has another shape, or was never completely built
//! (its `user_version` is not [`BUILT_VERSION`], which also covers a crash
//! in the middle of a rebuild and an index written by an older release),
//! the host rebuilds it from the object files before it loads any alarm: a
//! damaged file is moved aside to `index.sqlite.corrupt` (with its `-wal`),
//! every object file is read (read-only, no object constructed) and one
//! transaction writes every armed alarm and the `user_version`. A `tracing`
//! warning gives the reason and the counts, and [`IndexRebuild`] reports
//! them to the caller. Any other failure to open the index (permissions,
//! I/O, a directory in its place) fails the start, naming the file.
//!
//! Not detected: an index that is a valid, complete database but lost
//! entries because someone deleted its `-wal` file by hand. Such an alarm
//! still fires, but only once its object is next constructed (the object's
//! open makes the index exact again).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use durability_platform::{EpochMs, ObjectId, StorageError};
use rusqlite::{Connection, ErrorCode, OpenFlags, OptionalExtension, params};

use crate::error::storage_error;
use crate::flush::CommitMark;
use crate::id::{is_object_id, objects_dir};
use crate::storage::{ALARM_TABLE, META_TABLE};
use crate::{HostError, Synchronous};

/// The index file's name inside a data directory.
pub const INDEX_FILE: &str = "index.sqlite";
const INDEX_FILE_WAL: &str = "index.sqlite-wal";

/// The `user_version` a completely built index carries. It is written in
/// the same transaction as the rebuilt rows, so an index without it was
/// never completely built.
pub const BUILT_VERSION: i64 = 1;

const SCHEMA_SQL: &str = "CREATE TABLE IF NOT EXISTS alarms (
     id TEXT PRIMARY KEY,
     namespace TEXT NOT NULL,
     at_ms INTEGER NOT NULL
 ) WITHOUT ROWID;
 CREATE TABLE IF NOT EXISTS host_run (
     key TEXT PRIMARY KEY,
     value TEXT NOT NULL
 ) WITHOUT ROWID;";

/// Where Linux tells the boot the machine is in; it changes on every boot.
pub(crate) const BOOT_ID_FILE: &str = "/proc/sys/kernel/random/boot_id";

/// Why the host rebuilt its alarm index at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RebuildReason {
    /// There was no `index.sqlite` (deleted, or a data directory that
    /// holds object files but never had an index).
    Missing,
    /// `index.sqlite` was not a readable index (garbage, corruption, wrong
    /// shape); it was moved aside to `index.sqlite.corrupt`.
    Corrupt,
    /// The index was never completely built: a rebuild was interrupted, or
    /// an older release wrote it.
    Incomplete,
    /// A group-commit host did not stop cleanly and the machine rebooted
    /// since (a power loss, a kernel crash), or its boot id cannot be
    /// read: lowerings written without a sync of their own may be lost.
    UncleanReboot,
}

impl RebuildReason {
    fn describe(self) -> &'static str {
        match self {
            RebuildReason::Missing => "the alarm index is missing",
            RebuildReason::Corrupt => {
                "the alarm index is corrupt (moved aside to index.sqlite.corrupt)"
            }
            RebuildReason::Incomplete => "the alarm index was never completely built",
            RebuildReason::UncleanReboot => {
                "the last group-commit run did not stop cleanly and the machine rebooted since"
            }
        }
    }
}

/// What a rebuild of the alarm index found; see [`crate::Host::index_rebuild`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct IndexRebuild {
    /// Why the index was rebuilt.
    pub reason: RebuildReason,
    /// Object files read.
    pub objects: u64,
    /// Armed alarms found in them (now in the index).
    pub alarms: u64,
    /// Object files that could not be read; their alarm, if any, is indexed
    /// again when the object is next constructed (which reports the error).
    pub unreadable: u64,
    /// How long the rebuild took.
    pub elapsed: Duration,
}

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
    /// The setting of lowering writes (see the module docs).
    synchronous: Synchronous,
    /// Whether this run records itself (group commit: lowerings unsynced).
    recorded_run: bool,
    wal: PathBuf,
    /// Held shared around writes while the flusher takes sync images.
    files: Option<std::sync::Arc<RwLock<()>>>,
}

struct IndexConnection {
    conn: Connection,
    /// The `synchronous` setting the connection has now.
    current: Synchronous,
    /// Exact updates waiting for their object's commit to be durable:
    /// (namespace, time or removal, the commit).
    deferred: HashMap<ObjectId, (String, Option<EpochMs>, CommitMark)>,
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
    /// Opens the index of `data_dir`, rebuilding it from the object files
    /// when it is missing, corrupt or incomplete, or after an unclean stop
    /// and a reboot (see the module docs). `mode` is the host's durability
    /// mode; `files` is the sync images' lock, when images are taken;
    /// `boot_id_file` names the machine's boot id.
    pub(crate) fn open(
        data_dir: &Path,
        boot_id_file: &Path,
        mode: Synchronous,
        files: Option<std::sync::Arc<RwLock<()>>>,
    ) -> Result<(Self, Option<IndexRebuild>), HostError> {
        let synchronous = match mode {
            Synchronous::Full => Synchronous::Full,
            Synchronous::Batched | Synchronous::Normal => Synchronous::Normal,
        };
        let recorded_run = mode == Synchronous::Batched;
        let path = data_dir.join(INDEX_FILE);
        let index_error = |source: StorageError| HostError::Index {
            path: path.clone(),
            source,
        };
        let existed = path.exists();
        let (conn, reason) = match open_checked(&path, synchronous) {
            Ok((conn, true)) => (conn, None),
            Ok((conn, false)) => (
                conn,
                Some(if existed {
                    RebuildReason::Incomplete
                } else {
                    RebuildReason::Missing
                }),
            ),
            Err(error) if is_corruption(&error) => {
                move_aside(&path).map_err(|e| HostError::Io {
                    path: path.clone(),
                    message: format!("cannot move the corrupt alarm index aside: {e}"),
                })?;
                let (conn, _) =
                    open_checked(&path, synchronous).map_err(|e| index_error(storage_error(e)))?;
                (conn, Some(RebuildReason::Corrupt))
            }
            Err(error) => return Err(index_error(storage_error(error))),
        };
        let boot_id = std::fs::read_to_string(boot_id_file)
            .ok()
            .map(|id| id.trim().to_owned());
        let reason = match reason {
            Some(reason) => Some(reason),
            None => unclean_reboot(&conn, boot_id.as_deref())
                .map_err(|e| index_error(storage_error(e)))?,
        };
        let rebuild = match reason {
            Some(reason) => Some(rebuild(&conn, data_dir, reason).map_err(index_error)?),
            None => None,
        };
        // Synced before any object opens: from here on, a stop that is not
        // clean is known to the next start.
        record_run(&conn, recorded_run, boot_id.as_deref())
            .map_err(|e| index_error(storage_error(e)))?;
        if let Some(done) = &rebuild
            && (done.reason != RebuildReason::Missing || done.objects > 0)
        {
            tracing::warn!(
                index = %path.display(),
                objects = done.objects,
                alarms = done.alarms,
                unreadable = done.unreadable,
                elapsed_ms = done.elapsed.as_millis(),
                "{}; rebuilt it from the object files",
                done.reason.describe()
            );
        }
        let index = AlarmIndex {
            conn: Mutex::new(IndexConnection {
                conn,
                current: Synchronous::Full,
                deferred: HashMap::new(),
            }),
            synchronous,
            recorded_run,
            wal: data_dir.join(INDEX_FILE_WAL),
            files,
        };
        Ok((index, rebuild))
    }

    /// Builds the index of a data directory that has none yet, from its
    /// object files, and closes it: what [`crate::backup::restore`] leaves
    /// beside the objects it wrote, so that a host started on them finds a
    /// complete index and wakes every due alarm at once. Unlike
    /// [`AlarmIndex::open`] it logs nothing (nothing is wrong) and records
    /// a clean stop, so the first start trusts it.
    pub(crate) fn build_new(data_dir: &Path) -> Result<IndexRebuild, HostError> {
        let path = data_dir.join(INDEX_FILE);
        let index_error = |source: StorageError| HostError::Index {
            path: path.clone(),
            source,
        };
        let (conn, _) =
            open_checked(&path, Synchronous::Full).map_err(|e| index_error(storage_error(e)))?;
        let built = rebuild(&conn, data_dir, RebuildReason::Missing).map_err(index_error)?;
        record_run(&conn, false, None).map_err(|e| index_error(storage_error(e)))?;
        // Closing checkpoints the WAL into index.sqlite (synced, FULL).
        conn.close()
            .map_err(|(_, e)| index_error(storage_error(e)))?;
        Ok(built)
    }

    /// Records that this run stopped cleanly (synced): every object closed
    /// and every commit is durable, so the next start needs no rebuild.
    /// Only group-commit hosts record their runs.
    pub(crate) fn mark_clean_stop(&self) -> Result<(), StorageError> {
        if !self.recorded_run {
            return Ok(());
        }
        let mut guard = self.conn.lock().map_err(|_| StorageError::Unavailable {
            message: "the alarm index lock is poisoned".into(),
        })?;
        Self::write(&mut guard, Synchronous::Full, |conn| {
            conn.execute(
                "INSERT OR REPLACE INTO host_run (key, value) VALUES ('clean', '1')",
                [],
            )
            .map(|_| ())
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
        // An older deferred update must not overwrite this one later.
        self.forget_deferred(id);
        self.with(Some(write), |conn| write_entry(conn, id, namespace, at_ms))
    }
}

impl AlarmIndex {
    fn forget_deferred(&self, id: &ObjectId) {
        if let Ok(mut guard) = self.conn.lock() {
            guard.deferred.remove(id);
        }
    }

    /// Keeps the exact update of object `id` until its commit `after` is
    /// durable (group commit); it replaces an older deferred update of the
    /// object.
    pub(crate) fn defer(
        &self,
        id: &ObjectId,
        namespace: &str,
        at_ms: Option<EpochMs>,
        after: CommitMark,
    ) {
        match self.conn.lock() {
            Ok(mut guard) => {
                guard
                    .deferred
                    .insert(id.clone(), (namespace.to_owned(), at_ms, after));
            }
            Err(_) => tracing::warn!(object = %id, "alarm index lock poisoned; update dropped"),
        }
    }

    /// Writes the deferred updates whose commits are durable now. Returns
    /// whether it wrote anything. A failed write only leaves the index
    /// early or stale, which is allowed.
    pub(crate) fn apply_durable(&self) -> bool {
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
            .filter(|(_, (_, _, after))| after.is_durable())
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

/// Whether the last run was a group-commit run that did not stop cleanly,
/// on a boot other than this one (or on a boot that cannot be told).
fn unclean_reboot(
    conn: &Connection,
    boot_id: Option<&str>,
) -> rusqlite::Result<Option<RebuildReason>> {
    let read = |key: &str| {
        conn.query_row(
            "SELECT value FROM host_run WHERE key = ?1",
            params![key],
            |row| row.get::<_, String>(0),
        )
        .optional()
    };
    if read("clean")?.as_deref() != Some("0") {
        return Ok(None);
    }
    let same_boot = matches!((read("boot_id")?, boot_id), (Some(then), Some(now)) if then == now);
    Ok((!same_boot).then_some(RebuildReason::UncleanReboot))
}

/// Records (synced) whether this run may end uncleanly with lowerings lost:
/// a group-commit run is clean only once it says so at shutdown.
fn record_run(conn: &Connection, recorded: bool, boot_id: Option<&str>) -> rusqlite::Result<()> {
    conn.pragma_update(None, "synchronous", Synchronous::Full.pragma())?;
    let txn = conn.unchecked_transaction()?;
    txn.execute(
        "INSERT OR REPLACE INTO host_run (key, value) VALUES ('clean', ?1)",
        params![if recorded { "0" } else { "1" }],
    )?;
    match boot_id {
        Some(id) => txn.execute(
            "INSERT OR REPLACE INTO host_run (key, value) VALUES ('boot_id', ?1)",
            params![id],
        )?,
        None => txn.execute("DELETE FROM host_run WHERE key = 'boot_id'", [])?,
    };
    txn.commit()
}

/// Opens the index file, checks it is a sound index, and says whether it
/// was completely built. Errors are SQLite's (corruption shows as
/// `NotADatabase`/`DatabaseCorrupt`, or as [`shape_error`]).
fn open_checked(path: &Path, synchronous: Synchronous) -> rusqlite::Result<(Connection, bool)> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", synchronous.pragma())?;
    let check: String = conn.query_row("PRAGMA quick_check", [], |row| row.get(0))?;
    if check != "ok" {
        return Err(shape_error(format!("quick_check: {check}")));
    }
    conn.execute_batch(SCHEMA_SQL)?;
    // The columns the host reads, with the types it reads: a table of
    // another shape is a damaged index, not a start-up failure.
    let bad_rows: i64 = conn
        .query_row(
            "SELECT count(*) FROM alarms WHERE typeof(id) != 'text' OR length(id) != 64 \
             OR typeof(namespace) != 'text' OR typeof(at_ms) != 'integer'",
            [],
            |row| row.get(0),
        )
        .map_err(|e| shape_error(format!("the alarms table cannot be read: {e}")))?;
    if bad_rows > 0 {
        return Err(shape_error(format!("{bad_rows} rows of the wrong types")));
    }
    let version: i64 = conn.query_row("PRAGMA user_version", [], |row| row.get(0))?;
    Ok((conn, version == BUILT_VERSION))
}

/// An index that opens but is not one the host wrote.
fn shape_error(message: String) -> rusqlite::Error {
    rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CORRUPT),
        Some(format!("not a durability alarm index: {message}")),
    )
}

fn is_corruption(error: &rusqlite::Error) -> bool {
    matches!(
        error.sqlite_error_code(),
        Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt)
    )
}

/// Moves a corrupt index (and its WAL) to `index.sqlite.corrupt`, replacing
/// an earlier one, and drops its shared-memory file.
fn move_aside(path: &Path) -> std::io::Result<()> {
    let with = |suffix: &str| {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    };
    for (from, to) in [("", ".corrupt"), ("-wal", ".corrupt-wal")] {
        match std::fs::rename(with(from), with(to)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // No WAL: make sure an older one cannot pair with the new copy.
                if !from.is_empty() {
                    remove_if_present(&with(to))?;
                }
            }
            Err(e) => return Err(e),
        }
    }
    remove_if_present(&with("-shm"))
}

fn remove_if_present(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Reads every object file and writes the index again in one transaction.
fn rebuild(
    conn: &Connection,
    data_dir: &Path,
    reason: RebuildReason,
) -> Result<IndexRebuild, StorageError> {
    let started = Instant::now();
    let files = object_files(data_dir)?;
    let found = read_alarms(&files);
    let mut done = IndexRebuild {
        reason,
        objects: files.len() as u64,
        alarms: 0,
        unreadable: 0,
        elapsed: Duration::ZERO,
    };
    let txn = conn.unchecked_transaction().map_err(storage_error)?;
    txn.execute("DELETE FROM alarms", [])
        .map_err(storage_error)?;
    {
        let mut insert = txn
            .prepare("INSERT OR REPLACE INTO alarms (id, namespace, at_ms) VALUES (?1, ?2, ?3)")
            .map_err(storage_error)?;
        for (file, result) in files.iter().zip(found) {
            match result {
                Ok(Some(alarm)) => {
                    insert
                        .execute(params![alarm.id.as_str(), alarm.namespace, alarm.at_ms])
                        .map_err(storage_error)?;
                    done.alarms += 1;
                }
                Ok(None) => {}
                Err(error) => {
                    done.unreadable += 1;
                    tracing::warn!(
                        file = %file.path.display(),
                        %error,
                        "rebuilding the alarm index: cannot read this object file; \
                         its alarm is indexed when the object is next constructed"
                    );
                }
            }
        }
    }
    txn.pragma_update(None, "user_version", BUILT_VERSION)
        .map_err(storage_error)?;
    txn.commit().map_err(storage_error)?;
    done.elapsed = started.elapsed();
    Ok(done)
}

/// One object file found under `objects/`.
pub(crate) struct ObjectFile {
    pub(crate) id: String,
    pub(crate) path: PathBuf,
}

/// Every object file of `data_dir` (names that are not object ids are
/// skipped, as the host never makes them).
pub(crate) fn object_files(data_dir: &Path) -> Result<Vec<ObjectFile>, StorageError> {
    let io = |path: &Path, e: std::io::Error| StorageError::Unavailable {
        message: format!("cannot list {}: {e}", path.display()),
    };
    let objects = objects_dir(data_dir);
    let shards = match std::fs::read_dir(&objects) {
        Ok(shards) => shards,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(&objects, e)),
    };
    let mut files = Vec::new();
    for shard in shards {
        let shard = shard.map_err(|e| io(&objects, e))?.path();
        if !shard.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&shard).map_err(|e| io(&shard, e))? {
            let path = file.map_err(|e| io(&shard, e))?.path();
            let id = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".sqlite"))
                .filter(|id| is_object_id(id))
                .map(str::to_owned);
            if let Some(id) = id {
                files.push(ObjectFile { id, path });
            }
        }
    }
    Ok(files)
}

/// Reads the alarm of every file, on as many threads as the machine has
/// cores (each read is an open, two point queries and a close).
fn read_alarms(files: &[ObjectFile]) -> Vec<Result<Option<IndexedAlarm>, StorageError>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .clamp(1, 8);
    let chunk = files.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let workers: Vec<_> = files
            .chunks(chunk)
            .map(|part| scope.spawn(move || part.iter().map(read_alarm).collect::<Vec<_>>()))
            .collect();
        workers
            .into_iter()
            .zip(files.chunks(chunk))
            .flat_map(|(worker, part)| {
                worker.join().unwrap_or_else(|_| {
                    part.iter()
                        .map(|_| {
                            Err(StorageError::Unavailable {
                                message: "the thread reading this object file panicked".into(),
                            })
                        })
                        .collect()
                })
            })
            .collect()
    })
}

/// The alarm recorded in one object file, with the namespace it belongs to.
fn read_alarm(file: &ObjectFile) -> Result<Option<IndexedAlarm>, StorageError> {
    let conn = Connection::open_with_flags(
        &file.path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(storage_error)?;
    // A file created but never set up (a crash between the two) has no
    // host tables and no alarm.
    let has_alarm_table: bool = conn
        .query_row(
            "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?1",
            params![ALARM_TABLE],
            |row| row.get(0),
        )
        .map_err(storage_error)?;
    if !has_alarm_table {
        return Ok(None);
    }
    let at_ms: Option<i64> = conn
        .query_row(
            &format!("SELECT at_ms FROM {ALARM_TABLE} WHERE slot = 0"),
            [],
            |row| row.get(0),
        )
        .optional()
        .map_err(storage_error)?;
    let Some(at_ms) = at_ms else {
        return Ok(None);
    };
    let namespace: Option<String> = conn
        .query_row(
            &format!("SELECT value FROM {META_TABLE} WHERE key = 'namespace'"),
            [],
            |row| row.get(0),
        )
        .optional()
        .map_err(storage_error)?;
    let namespace = namespace.ok_or_else(|| StorageError::Corrupt {
        message: "the file has an alarm but records no namespace".into(),
    })?;
    Ok(Some(IndexedAlarm {
        id: ObjectId::new(file.id.clone()),
        namespace,
        at_ms,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flush::WalFile;

    fn index(dir: &Path) -> AlarmIndex {
        AlarmIndex::open(dir, Path::new(BOOT_ID_FILE), Synchronous::Full, None)
            .unwrap()
            .0
    }

    #[test]
    fn a_deferred_update_waits_for_its_commit_to_be_durable() {
        let dir = tempfile::tempdir().unwrap();
        let index = index(dir.path());
        let id = ObjectId::new("a".repeat(64));
        index
            .set(&id, "ns", Some(100), IndexWrite::Lowering)
            .unwrap();
        let wal = WalFile::new(&dir.path().join("object.sqlite-wal"));
        // Raised by commit 7, then cleared by commit 9.
        index.defer(&id, "ns", Some(500), CommitMark::new(&wal, 7));
        wal.synced_through(6);
        assert!(!index.apply_durable());
        assert_eq!(index.get(&id).unwrap(), Some(100));
        index.defer(&id, "ns", None, CommitMark::new(&wal, 9));
        // Only the newest update counts, and only once 9 is durable.
        wal.synced_through(8);
        assert!(!index.apply_durable());
        assert_eq!(index.get(&id).unwrap(), Some(100));
        wal.synced_through(9);
        assert!(index.apply_durable());
        assert_eq!(index.get(&id).unwrap(), None);
        wal.synced_through(10);
        assert!(!index.apply_durable());
    }

    #[test]
    fn a_lowering_drops_the_deferred_update_it_overtakes() {
        let dir = tempfile::tempdir().unwrap();
        let index = index(dir.path());
        let id = ObjectId::new("b".repeat(64));
        let wal = WalFile::new(&dir.path().join("object.sqlite-wal"));
        index.defer(&id, "ns", Some(900), CommitMark::new(&wal, 3));
        index
            .set(&id, "ns", Some(50), IndexWrite::Lowering)
            .unwrap();
        // Commit 3 turning durable must not raise the index above 50.
        wal.synced_through(3);
        assert!(!index.apply_durable());
        assert_eq!(index.get(&id).unwrap(), Some(50));
    }
}
