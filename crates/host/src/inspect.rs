//! Read-only listing of a data directory, for `durability inspect`.
//!
//! Every object file is opened read-only and no object is constructed, so
//! listing a directory that a running host serves changes nothing. A file
//! that cannot be read becomes an entry with an `error`, never a failure of
//! the whole listing.
//!
//! A read-only directory (a mounted backup, another user's files): SQLite
//! cannot open a WAL database read-only when it would have to create the
//! `-shm` file. Then, if the file has no write-ahead log (or an empty one),
//! it is opened `immutable`, which needs no lock and no `-shm` and misses
//! nothing. A file whose non-empty `-wal` cannot be read that way is an
//! entry with an error (reading it immutable would silently show its state
//! before the log): copy the directory somewhere writable to read it.

use std::path::Path;

use rusqlite::{Connection, ErrorCode, OpenFlags};
use serde::Serialize;

use durability_platform::{ObjectId, Row, Sql, StorageError, Value};

use crate::HostError;
use crate::error::storage_error;
use crate::id::{is_object_id, object_path, objects_dir};
use crate::storage::{ALARM_TABLE, META_TABLE};

/// What one object file holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ObjectSummary {
    /// The object id (the file's name).
    pub id: String,
    /// The namespace recorded in the file.
    pub namespace: Option<String>,
    /// The object's name, if it was recorded (it is once a stub called it).
    pub name: Option<String>,
    /// The alarm time in epoch milliseconds, if one is set.
    pub alarm_ms: Option<i64>,
    /// Bytes on disk: the database file plus its write-ahead log.
    pub file_bytes: u64,
    /// Row counts of the object's own tables and views (the host's tables
    /// excluded): a capability may show its state through a view.
    pub tables: Vec<TableRows>,
    /// Why the file could not be read, if it could not.
    pub error: Option<String>,
}

/// The row count of one table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TableRows {
    /// The table's name.
    pub table: String,
    /// How many rows it holds.
    pub rows: u64,
}

/// Lists every object file under `data_dir`, sorted by namespace, name and
/// id. Fails only when the directory itself cannot be read.
pub fn list_objects(data_dir: &Path) -> Result<Vec<ObjectSummary>, HostError> {
    let io = |path: &Path, e: std::io::Error| HostError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    std::fs::metadata(data_dir).map_err(|e| io(data_dir, e))?;
    let objects = objects_dir(data_dir);
    let mut summaries = Vec::new();
    let shards = match std::fs::read_dir(&objects) {
        Ok(shards) => shards,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(summaries),
        Err(e) => return Err(io(&objects, e)),
    };
    for shard in shards {
        let shard = shard.map_err(|e| io(&objects, e))?.path();
        if !shard.is_dir() {
            continue;
        }
        let files = std::fs::read_dir(&shard).map_err(|e| io(&shard, e))?;
        for file in files {
            let path = file.map_err(|e| io(&shard, e))?.path();
            let Some(id) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".sqlite"))
            else {
                continue;
            };
            if is_object_id(id) {
                summaries.push(summarize(&path, id));
            }
        }
    }
    summaries.sort_by(|a, b| (&a.namespace, &a.name, &a.id).cmp(&(&b.namespace, &b.name, &b.id)));
    Ok(summaries)
}

fn summarize(path: &Path, id: &str) -> ObjectSummary {
    let wal = path.with_extension("sqlite-wal");
    let file_bytes = [path, wal.as_path()]
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    let mut summary = ObjectSummary {
        id: id.to_owned(),
        namespace: None,
        name: None,
        alarm_ms: None,
        file_bytes,
        tables: Vec::new(),
        error: None,
    };
    if let Err(error) = read_into(path, &mut summary) {
        summary.error = Some(error.to_string());
    }
    summary
}

fn read_into(path: &Path, summary: &mut ObjectSummary) -> rusqlite::Result<()> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    match read_tables(&conn, summary) {
        Err(error) if cannot_open_read_only(&error) && !has_wal_frames(path) => {
            summary.tables.clear();
            read_tables(&open_immutable(path)?, summary)
        }
        other => other,
    }
}

/// The errors SQLite gives for a WAL database in a directory it cannot write.
pub(crate) fn cannot_open_read_only(error: &rusqlite::Error) -> bool {
    matches!(
        error.sqlite_error_code(),
        Some(ErrorCode::ReadOnly | ErrorCode::CannotOpen)
    )
}

/// Whether the file's `-wal` exists and holds anything.
pub(crate) fn has_wal_frames(path: &Path) -> bool {
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(wal).is_ok_and(|m| m.len() > 0)
}

/// Opens `path` with SQLite's `immutable` URI parameter: no lock, no
/// `-shm`, no look at a `-wal`.
pub(crate) fn open_immutable(path: &Path) -> rusqlite::Result<Connection> {
    let mut uri = String::from("file:");
    for c in path.to_string_lossy().chars() {
        match c {
            '%' => uri.push_str("%25"),
            '?' => uri.push_str("%3f"),
            '#' => uri.push_str("%23"),
            c => uri.push(c),
        }
    }
    uri.push_str("?immutable=1");
    Connection::open_with_flags(
        uri,
        OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )
}

fn read_tables(conn: &Connection, summary: &mut ObjectSummary) -> rusqlite::Result<()> {
    let mut tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name")?
        .query_map([], |row| row.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    if tables.iter().any(|t| t == META_TABLE) {
        let mut stmt = conn.prepare(&format!("SELECT key, value FROM {META_TABLE}"))?;
        let meta = stmt.query_map([], |row| {
            Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?))
        })?;
        for entry in meta {
            let (key, value) = entry?;
            match key.as_str() {
                "namespace" => summary.namespace = Some(value),
                "name" => summary.name = Some(value),
                _ => {}
            }
        }
    }
    if tables.iter().any(|t| t == ALARM_TABLE) {
        summary.alarm_ms = conn
            .prepare(&format!("SELECT at_ms FROM {ALARM_TABLE} WHERE slot = 0"))?
            .query_map([], |row| row.get(0))?
            .next()
            .transpose()?;
    }
    tables.retain(|t| t != META_TABLE && t != ALARM_TABLE);
    for table in tables {
        let quoted = table.replace('"', "\"\"");
        let rows: i64 =
            conn.query_row(&format!("SELECT count(*) FROM \"{quoted}\""), [], |row| {
                row.get(0)
            })?;
        summary.tables.push(TableRows {
            table,
            rows: u64::try_from(rows).unwrap_or(0),
        });
    }
    Ok(())
}

/// Runs `read` on a read-only view of object `id`'s file, for dashboards
/// that show what a capability holds without constructing the object (the
/// capabilities' own read queries take a [`Sql`]). Statements that write
/// fail with a storage error. `None` when `id` is not an object id or the
/// file does not exist.
pub fn read_object<T>(
    data_dir: &Path,
    id: &str,
    read: impl FnOnce(&dyn Sql) -> T,
) -> Result<Option<T>, StorageError> {
    if !is_object_id(id) {
        return Ok(None);
    }
    let path = object_path(data_dir, &ObjectId::new(id));
    if !path.exists() {
        return Ok(None);
    }
    let conn = Connection::open_with_flags(
        &path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(storage_error)?;
    Ok(Some(read(&ReadOnly(conn))))
}

/// A read-only connection as the platform's [`Sql`].
struct ReadOnly(Connection);

impl Sql for ReadOnly {
    fn execute(&self, sql: &str, params: &[Value]) -> Result<usize, StorageError> {
        crate::storage::execute(&self.0, sql, params).map_err(storage_error)
    }

    fn query(&self, sql: &str, params: &[Value]) -> Result<Vec<Row>, StorageError> {
        crate::storage::query(&self.0, sql, params).map_err(storage_error)
    }

    fn execute_script(&self, sql: &str) -> Result<(), StorageError> {
        self.0.execute_batch(sql).map_err(storage_error)
    }
}
