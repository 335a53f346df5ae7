//! One object's storage: its SQLite file, its one alarm, and the
//! transactions that commit rows and alarm together.
//!
//! The alarm is a row of a host table in the object's own file, so a
//! transaction that writes rows and changes the alarm commits or rolls back
//! both. The host's alarm index (see [`crate::index`]) is a second database
//! and is kept conservative around each commit. This module owns the
//! connection; it never touches another object's file.

use std::cell::{Cell, RefCell};
use std::io::Write;
use std::path::Path;
use std::rc::Weak;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use durability_platform::{
    EpochMs, LocalBoxFuture, MAX_SAFE_INTEGER, ObjectId, Rollback, Row, Sql, Storage, StorageError,
    StorageLimits, Transaction, Value, check_statement,
};
use rusqlite::config::DbConfig;
use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{Connection, OpenFlags, params};

use crate::Synchronous;
use crate::error::{closed_error, storage_error};
use crate::executor::Executor;
use crate::flush::{CommitMark, GroupCommit, WalFile};
use crate::index::{AlarmIndex, IndexWrite};

/// The host's tables inside every object file. Capabilities use other names.
pub(crate) const META_TABLE: &str = "_durability_host_meta";
pub(crate) const ALARM_TABLE: &str = "_durability_host_alarm";

const SETUP_SQL: &str = "
    CREATE TABLE IF NOT EXISTS _durability_host_meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS _durability_host_alarm (
        slot INTEGER PRIMARY KEY CHECK (slot = 0),
        at_ms INTEGER NOT NULL
    );";

/// The page size of new object files (existing files keep theirs).
///
/// Every commit writes each page it touched to the WAL whole, and the
/// flusher writes them back and syncs them; an operation touches about
/// five pages per commit (its row, the row's indexes, the alarm). With
/// rows of a few hundred bytes, 2 KiB pages halve the bytes written per
/// commit against SQLite's default of 4 KiB. Measured on `bench
/// operations` (default mode, 100 objects, 64 callers; three interleaved
/// runs each on a busy disk): median 4,470 ops/s at 4 KiB, 6,214 at
/// 2 KiB, 6,078 at 1 KiB. 2 KiB rather than 1 KiB keeps large bodies in
/// half as many overflow pages.
const OBJECT_PAGE_SIZE: i64 = 2048;

/// Prepared statements kept per connection; capabilities use a few dozen
/// distinct statements, and a miss costs a re-prepare, not a failure.
const STATEMENT_CACHE_CAPACITY: usize = 128;

/// Where an opened file says it belongs.
#[derive(Debug, Default)]
pub(crate) struct Recorded {
    pub(crate) name: Option<String>,
    pub(crate) alarm: Option<EpochMs>,
}

/// The storage of one live object. Not `Send`: it lives on its object's
/// executor thread, and its cells are only touched there.
pub(crate) struct ObjectStorage {
    /// `None` once the object is evicted or the host closed it, so a handle
    /// that outlives its object cannot write behind a newer instance.
    conn: RefCell<Option<Connection>>,
    id: ObjectId,
    namespace: Arc<str>,
    index: Arc<AlarmIndex>,
    executor: Weak<Executor>,
    /// The alarm as committed in the file.
    alarm: Cell<Option<EpochMs>>,
    /// What the index holds for this object (`None`: no entry). The index
    /// is never later than the file, see [`crate::index`].
    indexed: Cell<Option<EpochMs>>,
    /// The alarm change of the open transaction, applied to the cells
    /// above only after COMMIT. `Some(None)` is a delete.
    pending: Cell<Option<Option<EpochMs>>>,
    /// Transaction nesting; nested transactions are SAVEPOINTs.
    depth: Cell<u32>,
    /// Set when SQLite rolled the open transaction back by itself (after a
    /// full disk or I/O error), so later statements of the body fail
    /// instead of running outside any transaction and half-writing.
    aborted: RefCell<Option<StorageError>>,
    /// While the alarm handler runs, the alarm that fired is not reported.
    hidden: Cell<bool>,
    /// Whether the alarm was set or deleted since the handler started.
    changed: Cell<bool>,
    /// Whether a commit syncs the WAL (`synchronous=FULL`), for the metrics.
    syncs_on_commit: bool,
    /// Group commit (`Synchronous::Batched`): numbers each commit.
    group: Option<Arc<GroupCommit>>,
    /// The object's WAL file, which the flusher syncs.
    wal: Arc<WalFile>,
    /// Set by SQLite's commit hook, so a commit of any kind (a transaction,
    /// a statement in autocommit mode, a script) gets its number.
    committing: Arc<AtomicBool>,
    /// The number of this object's last commit (0: none yet).
    last_commit: Cell<u64>,
    /// Whether a commit has been numbered since the file was opened: the
    /// first one may have created the WAL, whose directory entry the
    /// flusher must sync too.
    numbered: Cell<bool>,
    /// What one statement may carry; checked before each one runs.
    limits: StorageLimits,
}

impl ObjectStorage {
    /// Opens (creating if needed) the file of object `id` and records its
    /// namespace and, when known, its name.
    #[allow(clippy::too_many_arguments)] // each argument is a distinct part of the object's identity or host
    pub(crate) fn open(
        path: &Path,
        id: ObjectId,
        namespace: Arc<str>,
        name: Option<&str>,
        synchronous: Synchronous,
        index: Arc<AlarmIndex>,
        group: Option<Arc<GroupCommit>>,
        executor: Weak<Executor>,
    ) -> Result<(Self, Recorded), StorageError> {
        // No sync image may be copied while the file is being made.
        let files = group.as_ref().and_then(|g| g.hold_files());
        if let Some(dir) = path.parent() {
            // A new `objects/xx` must not vanish at a power cut with the
            // files made in it.
            crate::directory::create_durably(dir).map_err(|e| StorageError::Unavailable {
                message: format!("cannot create {}: {e}", dir.display()),
            })?;
            if !path.exists() {
                create_from_template(path, dir);
            }
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = match group.as_ref().and_then(|g| g.vfs()) {
            // Its WAL writes go to the host journal too.
            Some(vfs) => Connection::open_with_flags_and_vfs(path, flags, vfs),
            None => Connection::open_with_flags(path, flags),
        }
        .map_err(storage_error)?;
        // No-ops on a file made from the template (the page size of a
        // database that has pages cannot change); a new file where the
        // template was not used gets both.
        conn.pragma_update(None, "page_size", OBJECT_PAGE_SIZE)
            .map_err(storage_error)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(storage_error)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE_CAPACITY);
        // Without the query planner stability guarantee, SQLite 3.50
        // recompiles a statement on every new binding of a parameter the
        // planner looked at: each `LIMIT ?` the capabilities use would be
        // parsed again on every run (a tenth of the operation path's CPU,
        // measured). Plans never depend on bound values here.
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)
            .map_err(storage_error)?;
        let committing = Arc::new(AtomicBool::new(false));
        if group.is_some() {
            let flag = Arc::clone(&committing);
            conn.commit_hook(Some(move || {
                flag.store(true, Ordering::Release);
                false
            }));
        }
        let recorded = setup(&conn, &id, &namespace, name)?;
        conn.pragma_update(None, "synchronous", synchronous.pragma())
            .map_err(storage_error)?;
        drop(files);
        let mut wal = path.as_os_str().to_owned();
        wal.push("-wal");
        let storage = ObjectStorage {
            conn: RefCell::new(Some(conn)),
            id,
            namespace,
            index,
            executor,
            alarm: Cell::new(recorded.alarm),
            indexed: Cell::new(None),
            pending: Cell::new(None),
            depth: Cell::new(0),
            aborted: RefCell::new(None),
            hidden: Cell::new(false),
            changed: Cell::new(false),
            syncs_on_commit: synchronous == Synchronous::Full,
            group,
            wal: WalFile::new(Path::new(&wal)),
            committing,
            last_commit: Cell::new(0),
            numbered: Cell::new(false),
            limits: StorageLimits::SQLITE,
        };
        storage.correct_index(recorded.alarm)?;
        Ok((storage, recorded))
    }

    /// The file is the truth: a crash between the two commits (or a lost
    /// index) left the index early or stale; make it exact.
    fn correct_index(&self, alarm: Option<EpochMs>) -> Result<(), StorageError> {
        let indexed = self.index.get(&self.id)?;
        self.indexed.set(indexed);
        if indexed == alarm {
            return Ok(());
        }
        let lowering = match (alarm, indexed) {
            (Some(at), Some(indexed)) => at < indexed,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if lowering {
            self.index
                .set(&self.id, &self.namespace, alarm, IndexWrite::Lowering)?;
        } else {
            self.index_after_commit(alarm, true);
        }
        self.indexed.set(alarm);
        Ok(())
    }

    /// Writes the exact index entry after a commit: at once, or with group
    /// commit once the commit is durable (see [`crate::index`]). With
    /// `unnumbered`, what the file holds may include commits this storage
    /// did not number (an earlier process's, not yet synced): they are
    /// numbered now, so the update waits for a sync of the file.
    fn index_after_commit(&self, alarm: Option<EpochMs>, unnumbered: bool) {
        if let Some(group) = &self.group {
            if unnumbered {
                self.number_commit(group);
            }
            let mark = self.last_commit();
            self.index
                .defer(&self.id, &self.namespace, alarm, mark.clone());
            // Until the update is written the index may wake the object
            // for nothing: do not leave the commit for later.
            group.urge(&mark);
            return;
        }
        if let Err(error) = self
            .index
            .set(&self.id, &self.namespace, alarm, IndexWrite::Relaxed)
        {
            // The index stays earlier than (or as stale as) the file,
            // which costs at most a spurious wake.
            tracing::warn!(object = %self.id, %error, "alarm index update failed");
        }
    }

    fn number_commit(&self, group: &GroupCommit) {
        let seq = group.committed(&self.wal, !self.numbered.replace(true));
        self.last_commit.set(seq);
    }

    /// The index names an alarm the file does not hold: remove the entry
    /// (an alarm run found nothing to deliver).
    pub(crate) fn forget_stale_index_entry(&self) {
        self.index_after_commit(None, true);
        self.indexed.set(None);
    }

    /// The object's last commit, for the output gate.
    pub(crate) fn last_commit(&self) -> CommitMark {
        CommitMark::new(&self.wal, self.last_commit.get())
    }

    /// Closes the connection; later calls fail with `Unavailable`.
    pub(crate) fn close(&self) {
        // Closing checkpoints the WAL into the database file.
        let _files = self.group.as_ref().and_then(|g| g.hold_files());
        if let Ok(mut conn) = self.conn.try_borrow_mut() {
            conn.take();
        }
        // Closing checkpointed the file (and synced it), so its alarm is
        // durable: the index may now follow a later or cleared alarm.
        let alarm = self.alarm.get();
        if self.indexed.get() != alarm {
            if let Err(error) =
                self.index
                    .set(&self.id, &self.namespace, alarm, IndexWrite::Relaxed)
            {
                // Left early or stale: at most a spurious wake.
                tracing::warn!(object = %self.id, %error, "alarm index update at close failed");
            }
            self.indexed.set(alarm);
        }
    }

    /// The committed alarm, ignoring the firing rule (for the host).
    pub(crate) fn committed_alarm(&self) -> Option<EpochMs> {
        self.alarm.get()
    }

    /// The firing alarm's handler starts: hide it from `get_alarm`.
    pub(crate) fn begin_fire(&self) {
        self.hidden.set(true);
        self.changed.set(false);
    }

    /// The handler ended. Returns whether it changed the alarm itself.
    pub(crate) fn end_fire(&self) -> bool {
        self.hidden.set(false);
        self.changed.replace(false)
    }

    /// Removes the alarm after a delivery that needs no repeat.
    pub(crate) fn clear_alarm(&self) -> Result<(), StorageError> {
        self.change_alarm(None)
    }

    fn with_conn<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StorageError>,
    ) -> Result<T, StorageError> {
        if self.depth.get() > 0
            && let Ok(aborted) = self.aborted.try_borrow()
            && let Some(error) = aborted.as_ref()
        {
            return Err(error.clone());
        }
        let conn = self.conn.try_borrow().map_err(|_| closed_error())?;
        let conn = conn.as_ref().ok_or_else(closed_error)?;
        let files = self.group.as_ref().and_then(|g| g.hold_files());
        let result = f(conn);
        if let Some(group) = &self.group
            && self.depth.get() == 0
            && self.committing.swap(false, Ordering::AcqRel)
        {
            // Numbered before a sync image may be copied: the image then
            // holds exactly the commits up to its number.
            self.number_commit(group);
        }
        drop(files);
        if let Err(error) = &result {
            // SQLite rolls a transaction back by itself after some errors
            // (full disk, I/O); remember it so the body cannot go on in
            // autocommit mode and leave half of its writes behind.
            if self.depth.get() > 0
                && conn.is_autocommit()
                && let Ok(mut aborted) = self.aborted.try_borrow_mut()
            {
                aborted.get_or_insert_with(|| error.clone());
            }
        }
        result
    }

    fn take_abort(&self) -> Option<StorageError> {
        self.aborted
            .try_borrow_mut()
            .ok()
            .and_then(|mut a| a.take())
    }

    fn write_alarm(&self, at_ms: Option<EpochMs>) -> Result<(), StorageError> {
        if let Some(at) = at_ms
            && !(0..=MAX_SAFE_INTEGER).contains(&at)
        {
            return Err(StorageError::InvalidAlarmTime { at_ms: at });
        }
        self.with_conn(|conn| {
            let result = match at_ms {
                Some(at) => conn
                    .prepare_cached(
                        "INSERT INTO _durability_host_alarm (slot, at_ms) VALUES (0, ?1)
                         ON CONFLICT (slot) DO UPDATE SET at_ms = excluded.at_ms",
                    )
                    .and_then(|mut s| s.execute(params![at])),
                None => conn
                    .prepare_cached("DELETE FROM _durability_host_alarm")
                    .and_then(|mut s| s.execute([])),
            };
            result.map(|_| ()).map_err(storage_error)
        })?;
        self.pending.set(Some(at_ms));
        Ok(())
    }

    /// The alarm as seen inside the open transaction.
    fn visible_alarm(&self) -> Option<EpochMs> {
        match self.pending.get() {
            Some(pending) => pending,
            None if self.hidden.get() => None,
            None => self.alarm.get(),
        }
    }

    /// Runs `body` in a transaction (a SAVEPOINT when nested). Returns
    /// `Ok(false)` when the body asked for a rollback.
    fn run_transaction(
        &self,
        body: &mut dyn FnMut() -> Result<(), Rollback>,
    ) -> Result<bool, StorageError> {
        let depth = self.depth.get();
        let outer = depth == 0;
        let begin = if outer {
            "BEGIN IMMEDIATE"
        } else {
            "SAVEPOINT durability_nested"
        };
        self.with_conn(|conn| control(conn, begin))?;
        let saved_pending = self.pending.get();
        if outer {
            self.take_abort();
        }
        self.depth.set(depth + 1);
        let outcome = body();
        self.depth.set(depth);
        let aborted = if outer {
            self.take_abort()
        } else {
            self.aborted.try_borrow().ok().and_then(|a| a.clone())
        };
        if let Some(error) = aborted {
            // SQLite already rolled back; make sure nothing stays open.
            if outer {
                self.rollback();
                self.pending.set(None);
            }
            return Err(error);
        }
        match outcome {
            Err(Rollback) => {
                if outer {
                    self.rollback();
                    self.pending.set(None);
                } else {
                    self.with_conn(|conn| {
                        conn.execute_batch(
                            "ROLLBACK TO durability_nested; RELEASE durability_nested",
                        )
                        .map_err(storage_error)
                    })?;
                    self.pending.set(saved_pending);
                }
                Ok(false)
            }
            Ok(()) if !outer => {
                self.with_conn(|conn| control(conn, "RELEASE durability_nested"))?;
                Ok(true)
            }
            Ok(()) => self.commit().map(|()| true),
        }
    }

    fn rollback(&self) {
        let _ = self.with_conn(|conn| {
            if !conn.is_autocommit() {
                conn.execute_batch("ROLLBACK").map_err(storage_error)?;
            }
            Ok(())
        });
    }

    /// Commits the outer transaction, keeping the alarm index conservative.
    fn commit(&self) -> Result<(), StorageError> {
        let pending = self.pending.take();
        #[cfg(feature = "testing")]
        if let Some(error) = self
            .executor
            .upgrade()
            .and_then(|executor| executor.take_injected_failure(&self.id))
        {
            // As if COMMIT itself had failed: nothing of the body stays.
            self.rollback();
            return Err(error);
        }
        if let Some(Some(at)) = pending {
            // Lower the index before the file can hold an earlier alarm: a
            // crash after this commit must still find the object due.
            if self.indexed.get().is_none_or(|indexed| at < indexed) {
                if let Err(error) =
                    self.index
                        .set(&self.id, &self.namespace, Some(at), IndexWrite::Lowering)
                {
                    self.rollback();
                    return Err(error);
                }
                self.indexed.set(Some(at));
            }
        }
        if let Err(error) = self.with_conn(|conn| control(conn, "COMMIT")) {
            self.rollback();
            return Err(error);
        }
        crate::telemetry::committed(self.syncs_on_commit);
        if let Some(alarm) = pending {
            self.alarm_committed(alarm);
        }
        Ok(())
    }

    fn alarm_committed(&self, alarm: Option<EpochMs>) {
        self.alarm.set(alarm);
        self.hidden.set(false);
        self.changed.set(true);
        // The index was lowered before the commit if it had to be; a later
        // or cleared alarm reaches the index when the object closes (see
        // `close` and the index's module docs).
        if let Some(executor) = self.executor.upgrade() {
            executor.alarm_changed(&self.id, &self.namespace, alarm);
        }
    }
}

/// Creates the host tables on first use and reads what the file records.
fn setup(
    conn: &Connection,
    id: &ObjectId,
    namespace: &str,
    name: Option<&str>,
) -> Result<Recorded, StorageError> {
    let mut recorded = Recorded::default();
    let mut recorded_id = None;
    let mut recorded_namespace = None;
    match read_meta(conn) {
        Ok(meta) => {
            for (key, value) in meta {
                match key.as_str() {
                    "id" => recorded_id = Some(value),
                    "namespace" => recorded_namespace = Some(value),
                    "name" => recorded.name = Some(value),
                    _ => {}
                }
            }
        }
        // A fresh file has no host tables yet; anything else is a real failure.
        Err(rusqlite::Error::SqliteFailure(failure, _))
            if failure.code == rusqlite::ErrorCode::Unknown => {}
        Err(error) => return Err(storage_error(error)),
    }
    if recorded_id.as_deref().is_some_and(|r| r != id.as_str()) {
        return Err(StorageError::Corrupt {
            message: format!("file of object {id} records another object id"),
        });
    }
    let needs_name = name.is_some() && recorded.name.is_none();
    // An existing file that records all it should is only read: no commit.
    if recorded_id.is_none() || recorded_namespace.is_none() || needs_name {
        // Everything the host writes into a file is one transaction (tables,
        // id, namespace, name), committed with synchronous=NORMAL: in WAL
        // mode a power cut can lose that commit but never corrupt the file,
        // and a lost setup is simply done again by the next open, since it
        // only writes what is missing. The object's first durable commit
        // (synchronous as configured, set after this) makes it durable too:
        // one fsync of the WAL covers every frame before it.
        conn.pragma_update(None, "synchronous", Synchronous::Normal.pragma())
            .map_err(storage_error)?;
        let tx = conn.unchecked_transaction().map_err(storage_error)?;
        tx.execute_batch(SETUP_SQL).map_err(storage_error)?;
        let mut insert = tx
            .prepare_cached(
                "INSERT OR IGNORE INTO _durability_host_meta (key, value) VALUES (?1, ?2)",
            )
            .map_err(storage_error)?;
        insert
            .execute(params!["id", id.as_str()])
            .map_err(storage_error)?;
        insert
            .execute(params!["namespace", namespace])
            .map_err(storage_error)?;
        if let Some(name) = name {
            insert
                .execute(params!["name", name])
                .map_err(storage_error)?;
            recorded.name = Some(name.to_owned());
        }
        drop(insert);
        tx.commit().map_err(storage_error)?;
    }
    recorded.alarm = conn
        .prepare_cached("SELECT at_ms FROM _durability_host_alarm WHERE slot = 0")
        .and_then(|mut s| {
            let mut rows = s.query([])?;
            match rows.next()? {
                Some(row) => row.get(0).map(Some),
                None => Ok(None),
            }
        })
        .map_err(storage_error)?;
    Ok(recorded)
}

/// The bytes of an empty object file already in WAL mode with the host's
/// tables: made once per process by SQLite itself, in a scratch file.
/// `None` if it could not be made; new files are then created by SQLite.
static TEMPLATE: OnceLock<Option<Vec<u8>>> = OnceLock::new();

/// Creates the new file of an object from [`TEMPLATE`], best effort.
///
/// Why: SQLite creates a file in rollback-journal mode, and switching it to
/// WAL is a journaled transaction of its own (four fsyncs, with the journal
/// and its directory). A copy of a file that is already in WAL mode with the
/// host tables costs one fsync. The copy is written to a scratch name,
/// synced, then linked under the object's name, so the object's name never
/// shows a partial file, and an existing file is never replaced (the link
/// fails). Any failure leaves the creation to SQLite, as before.
fn create_from_template(path: &Path, dir: &Path) {
    let Some(template) = TEMPLATE.get_or_init(|| make_template(dir)) else {
        return;
    };
    let scratch = path.with_extension("sqlite-new");
    let written = std::fs::File::create(&scratch).and_then(|mut file| {
        file.write_all(template)?;
        // The link may reach the disk before the bytes would: sync first.
        // The directory itself is synced by SQLite when it creates the WAL,
        // before the object's first commit returns.
        file.sync_all()
    });
    let linked = written.and_then(|()| std::fs::hard_link(&scratch, path));
    if let Err(error) = linked
        && error.kind() != std::io::ErrorKind::AlreadyExists
    {
        tracing::debug!(path = %path.display(), %error, "new object file not made from the template");
    }
    let _ = std::fs::remove_file(&scratch);
}

/// The bytes new object files of this process start from ([`TEMPLATE`]),
/// made in `dir` if no object was created yet: an archive keeps them, as
/// these bytes reach an object file without passing through its WAL.
pub(crate) fn new_object_bytes(dir: &Path) -> Option<Vec<u8>> {
    TEMPLATE.get_or_init(|| make_template(dir)).clone()
}

/// Makes the template with SQLite in a scratch file of `dir`.
fn make_template(dir: &Path) -> Option<Vec<u8>> {
    let mut suffix = [0u8; 8];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut suffix);
    let scratch = dir.join(format!(
        "template-{}-{:016x}.sqlite-new",
        std::process::id(),
        u64::from_le_bytes(suffix)
    ));
    let made = (|| -> Result<Vec<u8>, String> {
        let conn = Connection::open(&scratch).map_err(|e| e.to_string())?;
        // A scratch file read back at once: no fsync needed.
        conn.pragma_update(None, "page_size", OBJECT_PAGE_SIZE)
            .and_then(|()| conn.pragma_update(None, "synchronous", "OFF"))
            .and_then(|()| conn.pragma_update(None, "journal_mode", "WAL"))
            .and_then(|()| conn.execute_batch(SETUP_SQL))
            .map_err(|e| e.to_string())?;
        // Closing the last connection checkpoints the WAL into the file.
        conn.close().map_err(|(_, e)| e.to_string())?;
        let bytes = std::fs::read(&scratch).map_err(|e| e.to_string())?;
        // Bytes 18 and 19 of the header are 2 in WAL mode (SQLite file format).
        if bytes.get(18..20) != Some(&[2, 2]) {
            return Err("the template is not in WAL mode".into());
        }
        Ok(bytes)
    })();
    for suffix in ["", "-wal", "-shm"] {
        let mut path = scratch.clone().into_os_string();
        path.push(suffix);
        let _ = std::fs::remove_file(path);
    }
    match made {
        Ok(bytes) => Some(bytes),
        Err(error) => {
            tracing::warn!(%error, "no template for new object files; SQLite creates them");
            None
        }
    }
}

fn read_meta(conn: &Connection) -> rusqlite::Result<Vec<(String, String)>> {
    let mut stmt = conn.prepare_cached("SELECT key, value FROM _durability_host_meta")?;
    let rows = stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?;
    rows.collect()
}

fn to_sql(value: &Value) -> ToSqlOutput<'_> {
    ToSqlOutput::Borrowed(match value {
        Value::Null => ValueRef::Null,
        Value::Integer(v) => ValueRef::Integer(*v),
        Value::Real(v) => ValueRef::Real(*v),
        Value::Text(v) => ValueRef::Text(v.as_bytes()),
        Value::Blob(v) => ValueRef::Blob(v),
    })
}

fn from_sql(value: ValueRef<'_>) -> Value {
    match value {
        ValueRef::Null => Value::Null,
        ValueRef::Integer(v) => Value::Integer(v),
        ValueRef::Real(v) => Value::Real(v),
        ValueRef::Text(v) => Value::Text(String::from_utf8_lossy(v).into_owned()),
        ValueRef::Blob(v) => Value::Blob(v.to_vec()),
    }
}

pub(crate) fn execute(conn: &Connection, sql: &str, params: &[Value]) -> rusqlite::Result<usize> {
    conn.prepare_cached(sql)?
        .execute(rusqlite::params_from_iter(params.iter().map(to_sql)))
}

/// Runs a transaction-control statement (`BEGIN`, `COMMIT`, `RELEASE`)
/// from the statement cache: `execute_batch` would parse it on every
/// transaction.
fn control(conn: &Connection, sql: &str) -> Result<(), StorageError> {
    conn.prepare_cached(sql)
        .and_then(|mut statement| statement.execute([]))
        .map(|_| ())
        .map_err(storage_error)
}

pub(crate) fn query(conn: &Connection, sql: &str, params: &[Value]) -> rusqlite::Result<Vec<Row>> {
    let mut stmt = conn.prepare_cached(sql)?;
    let columns: Arc<[String]> = stmt.column_names().into_iter().map(str::to_owned).collect();
    let width = columns.len();
    let mut rows = stmt.query(rusqlite::params_from_iter(params.iter().map(to_sql)))?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        let mut values = Vec::with_capacity(width);
        for i in 0..width {
            values.push(from_sql(row.get_ref(i)?));
        }
        out.push(Row::new(Arc::clone(&columns), values));
    }
    Ok(out)
}

impl Sql for ObjectStorage {
    fn execute(&self, sql: &str, params: &[Value]) -> Result<usize, StorageError> {
        check_statement(&self.limits, sql, params)?;
        self.with_conn(|conn| execute(conn, sql, params).map_err(storage_error))
    }

    fn query(&self, sql: &str, params: &[Value]) -> Result<Vec<Row>, StorageError> {
        check_statement(&self.limits, sql, params)?;
        self.with_conn(|conn| query(conn, sql, params).map_err(storage_error))
    }

    fn execute_script(&self, sql: &str) -> Result<(), StorageError> {
        check_statement(&self.limits, sql, &[])?;
        self.with_conn(|conn| conn.execute_batch(sql).map_err(storage_error))
    }
}

/// The view a transaction body gets: the object's SQL plus its alarm.
struct TransactionView<'a>(&'a ObjectStorage);

impl Sql for TransactionView<'_> {
    fn execute(&self, sql: &str, params: &[Value]) -> Result<usize, StorageError> {
        self.0.execute(sql, params)
    }
    fn query(&self, sql: &str, params: &[Value]) -> Result<Vec<Row>, StorageError> {
        self.0.query(sql, params)
    }
    fn execute_script(&self, sql: &str) -> Result<(), StorageError> {
        self.0.execute_script(sql)
    }
}

impl Transaction for TransactionView<'_> {
    fn get_alarm(&self) -> Result<Option<EpochMs>, StorageError> {
        Ok(self.0.visible_alarm())
    }
    fn set_alarm(&self, at_ms: EpochMs) -> Result<(), StorageError> {
        self.0.write_alarm(Some(at_ms))
    }
    fn delete_alarm(&self) -> Result<(), StorageError> {
        self.0.write_alarm(None)
    }
}

impl Storage for ObjectStorage {
    fn transaction_sync_dyn(
        &self,
        body: &mut dyn FnMut(&dyn Sql) -> Result<(), Rollback>,
    ) -> Result<bool, StorageError> {
        self.run_transaction(&mut || body(self))
    }

    fn transaction_dyn<'a>(
        &'a self,
        body: &'a mut dyn FnMut(&dyn Transaction) -> Result<(), Rollback>,
    ) -> LocalBoxFuture<'a, Result<bool, StorageError>> {
        // The alarm lives in the object's own file, so the whole
        // transaction is synchronous; the future only fits the contract.
        let result = self.run_transaction(&mut || body(&TransactionView(self)));
        Box::pin(std::future::ready(result))
    }

    fn get_alarm(&self) -> LocalBoxFuture<'_, Result<Option<EpochMs>, StorageError>> {
        let result = self.with_conn(|_| Ok(())).map(|()| self.visible_alarm());
        Box::pin(std::future::ready(result))
    }

    fn set_alarm(&self, at_ms: EpochMs) -> LocalBoxFuture<'_, Result<(), StorageError>> {
        Box::pin(std::future::ready(self.change_alarm(Some(at_ms))))
    }

    fn delete_alarm(&self) -> LocalBoxFuture<'_, Result<(), StorageError>> {
        Box::pin(std::future::ready(self.change_alarm(None)))
    }

    fn limits(&self) -> StorageLimits {
        self.limits
    }
}

impl ObjectStorage {
    /// The same storage, checking every statement against `limits`.
    pub(crate) fn with_limits(mut self, limits: StorageLimits) -> Self {
        self.limits = limits;
        self
    }

    fn change_alarm(&self, at_ms: Option<EpochMs>) -> Result<(), StorageError> {
        let mut failure = None;
        let committed = self.run_transaction(&mut || {
            self.write_alarm(at_ms).map_err(|error| {
                failure = Some(error);
                Rollback
            })
        })?;
        match (committed, failure) {
            (_, Some(error)) => Err(error),
            (true, None) => Ok(()),
            (false, None) => Err(StorageError::Sql {
                message: "the alarm change was rolled back".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::flush::{Flush, Flusher, OPEN_RETRY_WINDOW};
    use crate::id::object_path;

    /// An index entry the file does not hold (a stale one: the alarm was
    /// cleared before the index learned of it) is removed once the file's
    /// commits are durable. With group commit that update is deferred; the
    /// storage urges its file at once rather than leave it for the delay,
    /// which here is an hour: only the urge can bring the index up to date.
    #[test]
    fn a_deferred_index_update_does_not_wait_for_the_sync_delay() {
        let dir = tempfile::tempdir().unwrap();
        let (index, _) = AlarmIndex::open(
            dir.path(),
            Path::new(crate::index::BOOT_ID_FILE),
            Synchronous::Batched,
            None,
        )
        .unwrap();
        let index = Arc::new(index);
        let group = GroupCommit::new(
            dir.path(),
            Flush::WalFiles,
            Arc::clone(&index),
            false,
            None,
            Duration::from_secs(3600),
            OPEN_RETRY_WINDOW,
        );
        let _flusher = Flusher::start(&group, dir.path()).unwrap();
        let id = ObjectId::new("0".repeat(64));
        index
            .set(&id, "ns", Some(1_000), IndexWrite::Lowering)
            .unwrap();

        let (storage, recorded) = ObjectStorage::open(
            &object_path(dir.path(), &id),
            id.clone(),
            Arc::from("ns"),
            None,
            Synchronous::Batched,
            Arc::clone(&index),
            Some(Arc::clone(&group)),
            Weak::new(),
        )
        .unwrap();
        assert_eq!(recorded.alarm, None);
        let deadline = Instant::now() + Duration::from_secs(60);
        while index.get(&id).unwrap().is_some() {
            assert!(
                Instant::now() < deadline,
                "the stale entry waited for the sync delay"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        storage.close();
    }
}
