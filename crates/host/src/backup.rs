//! Backups of a data directory: a consistent copy of every object file
//! with a manifest ([`backup_dir`], [`crate::Host::backup`]), a check of a
//! copy against its manifest ([`verify`]), and a restore into an empty data
//! directory ([`restore`]). This module reads object files and writes only
//! new directories (and `last-backup.json` in the data directory); it never
//! writes an object file a host may have open.
//!
//! ```
//! use durability_host::backup::{self, Restore};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let root = tempfile::tempdir()?;
//! let data = root.path().join("data");
//! std::fs::create_dir(&data)?;
//! // A directory no host serves (or one a host of another process serves).
//! let made = durability_host::backup_dir(&data, root.path().join("backup-1"))?;
//! assert_eq!(made.objects, 0);
//! let checked = backup::verify(root.path().join("backup-1"))?;
//! assert_eq!(checked.objects, 0);
//! backup::restore(root.path().join("backup-1"), root.path().join("restored"), &Restore::all())?;
//! # Ok(())
//! # }
//! ```
//!
//! How an object is copied: its file is opened read-only with SQLite's own
//! VFS (as [`crate::inspect`] does), a read transaction is begun, the
//! host's meta and alarm rows are read, and SQLite's online backup API
//! copies every page under that same transaction. The copy is therefore
//! one committed state of the object, with the alarm of that state, taken
//! while a host of this or another process goes on writing: a reader in
//! WAL mode sees every commit that was written to the `-wal` before its
//! transaction began, and with every flush method (the host journal
//! included) a commit is in the `-wal` before it returns. A read-only
//! connection never checkpoints nor rewrites a `-wal` (checkpoint on close
//! is also switched off), so the copy cannot disturb the host's own
//! bookkeeping of its WAL files (the journal's replay among it). A file is
//! never copied byte for byte while it may be live. When no host holds the
//! directory, [`backup_dir`] first replays the host journal an unclean
//! stop may have left (as a host's start would), so the copy holds every
//! commit that stop had made durable.
//!
//! A backup is complete or absent: it is written under a hidden temporary
//! name beside the destination (`.NAME.partial-*`), every file and
//! directory is synced (with `fsync`, which every file system forwards), the manifest is written last (with a SHA-256 of
//! itself, so a manifest that lost an entry is refused too), and only
//! then is the directory renamed to its name and the parent synced. A
//! crash leaves at most a `.partial-*` directory (delete it), never a
//! directory under the destination's name; [`verify`] refuses a directory
//! whose manifest is missing, does not parse or does not match its own
//! checksum. A restore is written the same way.
//!
//! Objects are copied at different moments, each consistent on its own,
//! which is no weaker than what the capabilities promise across objects
//! (nothing spans two objects atomically). An object created after the
//! backup listed the directory is not in it. An object file that cannot
//! be read fails the whole backup, naming it: a backup that silently
//! lacks an object would restore as a loss.

use std::fs::{File, TryLockError};
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use durability_platform::{EpochMs, ObjectId, StorageError};
use rusqlite::backup::{Backup, StepResult};
use rusqlite::config::DbConfig;
use rusqlite::{Connection, OpenFlags, OptionalExtension, params};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::clock::system_now_ms as now_ms;
use crate::error::storage_error;
use crate::id::{hex, is_object_id, object_file, object_path, objects_dir};
use crate::storage::{ALARM_TABLE, META_TABLE};
use crate::{DATA_DIR_LOCK_FILE, Host, HostError};

/// The manifest's file name inside a backup.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The manifest format this release writes and reads. A later format
/// keeps every field of this one and raises the number; a release refuses
/// a format newer than its own rather than misread it.
pub const MANIFEST_FORMAT: u32 = 1;

/// Where the last backup of a data directory is recorded, inside the data
/// directory (for dashboards; best effort, never needed by a restore).
pub const LAST_BACKUP_FILE: &str = "last-backup.json";

/// A copy step that finds the source busy (a WAL being recovered by the
/// host's first open) is retried for this long before the backup fails.
const BUSY_RETRY_WINDOW: Duration = Duration::from_secs(10);

/// Pause between two attempts of a busy copy step.
const BUSY_RETRY_PAUSE: Duration = Duration::from_millis(5);

/// Objects are copied on at most this many threads: each copy is mostly
/// page-cache reads and writes and a SHA-256, so a few threads keep the
/// copying going without taking every core from the host being backed
/// up.
const MAX_COPY_THREADS: usize = 4;

/// Copies are synced after the last one is made, on up to this many
/// threads at once: the file system then commits many of their syncs
/// together (as the host's flusher does with WAL files), where one sync
/// after another cost a journal commit each, most of a backup's time for
/// thousands of small objects. `fsync` rather than one `syncfs`: every
/// file system forwards it (FUSE and network mounts among them, which may
/// drop a `syncfs`), so a manifest is never written over copies that are
/// not durable.
const SYNC_THREADS: usize = 16;

/// Bytes read at a time when a copy is hashed or restored.
const READ_CHUNK_BYTES: usize = 64 << 10;

/// The record of one backup: what `manifest.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`] when this release wrote it.
    pub format: u32,
    /// The version of `durability-host` that made the backup.
    pub host_version: String,
    /// The data directory it was taken from, as given.
    pub source: String,
    /// When the backup began, epoch milliseconds (system clock).
    pub started_ms: EpochMs,
    /// When the last object was copied, epoch milliseconds.
    pub finished_ms: EpochMs,
    /// The bytes of every object copy together.
    pub bytes: u64,
    /// Every object copied, sorted by id.
    pub objects: Vec<ObjectCopy>,
    /// Lowercase hex SHA-256 of this manifest's compact JSON with this
    /// field empty: a manifest edited or cut down to an entry less (still
    /// valid JSON) is refused.
    pub checksum: String,
}

/// One object of a backup.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectCopy {
    /// The object id.
    pub id: String,
    /// Its namespace, as its file records it.
    pub namespace: Option<String>,
    /// Its name, if its file records one.
    pub name: Option<String>,
    /// The copy's path inside the backup, always
    /// `objects/<first two digits>/<id>.sqlite` (the same place as in a
    /// data directory); any other value is refused.
    pub file: String,
    /// The copy's size in bytes.
    pub bytes: u64,
    /// Lowercase hex SHA-256 of the copy.
    pub sha256: String,
    /// The object's alarm in the copied state, epoch milliseconds.
    pub alarm_ms: Option<EpochMs>,
    /// The system clock just before the copy's read transaction began:
    /// every commit of the object that returned before this moment is in
    /// the copy; later ones may be.
    pub copied_ms: EpochMs,
}

impl Manifest {
    /// The checksum this manifest should carry.
    fn digest(&self) -> String {
        let unsigned = Manifest {
            checksum: String::new(),
            ..self.clone()
        };
        // Serializing a struct of strings and integers cannot fail, and
        // gives the same bytes for the same values on every release.
        let json = serde_json::to_vec(&unsigned).unwrap_or_default();
        hex(&Sha256::digest(&json))
    }
}

/// What a backup made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupReport {
    /// The backup's directory.
    pub dest: PathBuf,
    /// Objects copied.
    pub objects: u64,
    /// Bytes of the copies.
    pub bytes: u64,
    /// How long the backup took, from listing to the final rename.
    pub elapsed: Duration,
    /// The manifest's path.
    pub manifest_path: PathBuf,
    /// The manifest written.
    pub manifest: Manifest,
}

/// The last backup of a data directory, as [`LAST_BACKUP_FILE`] records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LastBackup {
    /// Where it was written.
    pub dest: String,
    /// When it ended, epoch milliseconds.
    pub finished_ms: EpochMs,
    /// Objects copied.
    pub objects: u64,
    /// Bytes of the copies.
    pub bytes: u64,
    /// How long it took.
    pub seconds: f64,
}

impl From<&BackupReport> for LastBackup {
    fn from(report: &BackupReport) -> Self {
        LastBackup {
            dest: report.dest.display().to_string(),
            finished_ms: report.manifest.finished_ms,
            objects: report.objects,
            bytes: report.bytes,
            seconds: report.elapsed.as_secs_f64(),
        }
    }
}

/// What a successful [`verify`] checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Objects checked (size, checksum and `integrity_check`).
    pub objects: u64,
    /// Bytes read.
    pub bytes: u64,
    /// The manifest read.
    pub manifest: Manifest,
}

/// What a successful [`restore`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreReport {
    /// The data directory written.
    pub data_dir: PathBuf,
    /// Objects restored.
    pub objects: u64,
    /// Bytes written.
    pub bytes: u64,
    /// Alarms now in the rebuilt alarm index.
    pub alarms: u64,
    /// How long the restore took, verification included.
    pub elapsed: Duration,
}

/// Which objects [`restore`] writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restore {
    only: Option<Vec<String>>,
}

impl Restore {
    /// Every object of the backup.
    pub fn all() -> Self {
        Restore { only: None }
    }

    /// Only the objects with these ids (each must be an object id held by
    /// the backup; a repeated id counts once).
    pub fn only(ids: impl IntoIterator<Item = impl Into<String>>) -> Self {
        let mut ids: Vec<String> = ids.into_iter().map(Into::into).collect();
        ids.sort();
        ids.dedup();
        Restore { only: Some(ids) }
    }
}

/// What is wrong with one object of a backup.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Problem {
    /// The manifest lists it but the file is not there.
    #[error("the file is missing")]
    Missing,
    /// The file's size is not the manifest's (a truncated or extended copy).
    #[error("the file has {found} bytes, the manifest says {manifest}")]
    Size {
        /// Bytes the manifest recorded.
        manifest: u64,
        /// Bytes found.
        found: u64,
    },
    /// The file's SHA-256 is not the manifest's (its bytes changed).
    #[error("its SHA-256 is {found}, the manifest says {manifest}")]
    Checksum {
        /// The manifest's digest.
        manifest: String,
        /// The file's digest.
        found: String,
    },
    /// SQLite's `PRAGMA integrity_check` found damage.
    #[error("PRAGMA integrity_check: {message}")]
    Integrity {
        /// What the check reported (its first lines).
        message: String,
    },
    /// The file could not be read or opened.
    #[error("cannot read it: {message}")]
    Unreadable {
        /// The reason.
        message: String,
    },
}

/// One bad object of a backup: which, where, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: object {id}: {problem}", file.display())]
pub struct BadObject {
    /// The object id.
    pub id: String,
    /// The copy's path.
    pub file: PathBuf,
    /// What is wrong with it.
    pub problem: Problem,
}

/// Why a backup, a verification or a restore failed. Each variant names
/// the file or directory it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackupError {
    /// The destination already exists and is not an empty directory: a
    /// backup or restore never writes over anything.
    #[error(
        "{} already exists and is not an empty directory; a backup or restore writes to a new path only",
        path.display()
    )]
    DestinationExists {
        /// The destination.
        path: PathBuf,
    },
    /// The destination path has no last component to name it by (`/`,
    /// `..`), or lies inside the data directory it copies.
    #[error("{}: invalid destination: {rule}", path.display())]
    InvalidDestination {
        /// The destination.
        path: PathBuf,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// A data directory to restore into is not empty.
    #[error(
        "the data directory {} is not empty (it holds {entry:?}); restore writes into an empty or new directory only",
        path.display()
    )]
    NotEmpty {
        /// The data directory.
        path: PathBuf,
        /// One entry found in it.
        entry: String,
    },
    /// A file or directory could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The operating system's reason.
        #[source]
        source: std::io::Error,
    },
    /// The object files of the data directory could not be listed.
    #[error("cannot list the object files of {}: {source}", path.display())]
    List {
        /// The data directory.
        path: PathBuf,
        /// The reason.
        #[source]
        source: StorageError,
    },
    /// An object file could not be copied.
    #[error("cannot copy object {id} from {}: {source}", file.display())]
    Copy {
        /// The object id.
        id: String,
        /// Its file in the data directory.
        file: PathBuf,
        /// SQLite's reason.
        #[source]
        source: StorageError,
    },
    /// The directory has no manifest: it is not a backup, or one that
    /// never completed.
    #[error("{} is not a complete backup: it has no {MANIFEST_FILE}", path.display())]
    NoManifest {
        /// The manifest's expected path.
        path: PathBuf,
    },
    /// The manifest is not one this release can trust (truncated, not
    /// JSON, a newer format, a checksum that does not match, an entry that
    /// breaks a rule).
    #[error("{}: {message}", path.display())]
    BadManifest {
        /// The manifest's path.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Objects of the backup failed verification; each is named with its
    /// file and its problem.
    #[error(
        "{} objects of the backup {} failed verification:\n{}",
        bad.len(), path.display(), list(bad)
    )]
    Damaged {
        /// The backup.
        path: PathBuf,
        /// Every bad object.
        bad: Vec<BadObject>,
    },
    /// An object to restore is not named by an object id (64 lowercase
    /// hex digits).
    #[error("invalid object id {id:?}: must be 64 lowercase hex digits")]
    InvalidObjectId {
        /// The id given.
        id: String,
    },
    /// An object to restore is not in the backup.
    #[error("the backup {} holds no object {id}", path.display())]
    UnknownObject {
        /// The backup.
        path: PathBuf,
        /// The id asked for.
        id: String,
    },
    /// The host side failed: the data directory to restore into is held by
    /// a host, its journal could not be replayed, or the alarm index of a
    /// restore could not be built.
    #[error(transparent)]
    Host(#[from] HostError),
    /// The backup thread of [`crate::Host::backup`] stopped before it
    /// reported (it panicked).
    #[error("the backup thread stopped before it finished")]
    Aborted,
}

fn list(bad: &[BadObject]) -> String {
    bad.iter()
        .map(|b| format!("  {b}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BackupError + '_ {
    move |source| BackupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Backs up every object of `data_dir` into the new directory `dest`
/// (see the module docs), whether no host serves the directory or a host
/// of another process does (from the process of a serving host, use
/// [`Host::backup`]). When no host holds it, the host journal an unclean
/// stop left is replayed first, under the directory's lock, as a host's
/// start would do (a host starting in that moment is refused with
/// [`HostError::DataDirInUse`], as beside any other holder).
///
/// Fails with [`BackupError::DestinationExists`] when `dest` exists (an
/// empty directory is allowed), and with [`BackupError::Copy`] naming the
/// file when an object cannot be read: a backup that lacks an object is
/// not written at all.
pub fn backup_dir(
    data_dir: impl AsRef<Path>,
    dest: impl AsRef<Path>,
) -> Result<BackupReport, BackupError> {
    let data_dir = data_dir.as_ref();
    std::fs::metadata(data_dir).map_err(io(data_dir))?;
    // No journal, nothing to replay: a read-only copy of a stopped
    // directory (where the lock file cannot be made) is backed up too.
    if data_dir.join(crate::journal::JOURNAL_DIR).exists() {
        match crate::replay_journal(data_dir) {
            Ok(()) => {}
            // A serving host replayed the journal when it started.
            Err(HostError::DataDirInUse { .. }) => {}
            Err(error) => return Err(error.into()),
        }
    }
    backup_files(data_dir, dest.as_ref())
}

impl Host {
    /// Backs up every object of this host's data directory into the new
    /// directory `dest` while the host goes on serving (see
    /// [`crate::backup`]), and records it as the directory's last backup.
    /// The copying runs on threads of its own; dropping the future does
    /// not stop it (the backup is then finished or removed unseen).
    ///
    /// In the host's own process, each copied object the host has open
    /// keeps one more file descriptor until the host closes the object:
    /// SQLite defers closing the copy's descriptor while the host's
    /// connection holds the file's lock. Leave room for one descriptor per
    /// live object ([`crate::HostBuilder::max_live_objects`]), or back up
    /// from another process ([`backup_dir`], `durability backup`), which
    /// costs the host nothing.
    pub async fn backup(&self, dest: impl Into<PathBuf>) -> Result<BackupReport, BackupError> {
        let data_dir = self.data_dir().to_path_buf();
        let dest = dest.into();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("durability-backup".into())
            .spawn(move || {
                let _ = tx.send(backup_files(&data_dir, &dest));
            })
            .map_err(io(self.data_dir()))?;
        rx.await.map_err(|_| BackupError::Aborted)?
    }
}

/// The copy itself, for a directory whose journal needs no replay.
pub(crate) fn backup_files(data_dir: &Path, dest: &Path) -> Result<BackupReport, BackupError> {
    let started = Instant::now();
    let started_ms = now_ms();
    refuse_inside(data_dir, dest)?;
    let temporary = Temporary::beside(dest, "partial")?;
    let files = crate::index::object_files(data_dir).map_err(|source| BackupError::List {
        path: data_dir.to_path_buf(),
        source,
    })?;
    let mut objects = copy_all(&files, temporary.path())?;
    objects.sort_by(|a, b| a.id.cmp(&b.id));
    let mut manifest = Manifest {
        format: MANIFEST_FORMAT,
        host_version: env!("CARGO_PKG_VERSION").to_owned(),
        source: data_dir.display().to_string(),
        started_ms,
        finished_ms: now_ms(),
        bytes: objects.iter().map(|o| o.bytes).sum(),
        objects,
        checksum: String::new(),
    };
    manifest.checksum = manifest.digest();
    // Every copy and directory is durable before the manifest exists, and
    // the manifest before the name: whatever a power cut keeps, a
    // directory under `dest`'s name has every file its manifest lists.
    let written: Vec<PathBuf> = manifest
        .objects
        .iter()
        .map(|o| temporary.path().join(&o.file))
        .collect();
    sync_files(&written)?;
    sync_tree(temporary.path())?;
    let text = serde_json::to_vec_pretty(&manifest).map_err(|e| BackupError::BadManifest {
        path: dest.join(MANIFEST_FILE),
        message: e.to_string(),
    })?;
    write_synced(&temporary.path().join(MANIFEST_FILE), &text)?;
    crate::directory::sync(temporary.path()).map_err(io(temporary.path()))?;
    temporary.finish()?;
    let report = BackupReport {
        dest: dest.to_path_buf(),
        objects: manifest.objects.len() as u64,
        bytes: manifest.bytes,
        elapsed: started.elapsed(),
        manifest_path: dest.join(MANIFEST_FILE),
        manifest,
    };
    record_last(data_dir, &report);
    Ok(report)
}

/// Refuses a destination inside the data directory: a later restore of
/// that directory would carry every older backup along.
fn refuse_inside(data_dir: &Path, dest: &Path) -> Result<(), BackupError> {
    let Ok(data) = std::fs::canonicalize(data_dir) else {
        return Ok(());
    };
    // The nearest ancestor of `dest` that exists, resolved: the parts
    // below it are new directories, so they cannot be links elsewhere.
    let parent = parent_of(dest);
    let inside = parent
        .ancestors()
        .find_map(|ancestor| std::fs::canonicalize(ancestor).ok())
        .or_else(|| std::fs::canonicalize(".").ok())
        .is_some_and(|existing| existing.starts_with(&data));
    if inside {
        return Err(BackupError::InvalidDestination {
            path: dest.to_path_buf(),
            rule: "must not lie inside the data directory it backs up",
        });
    }
    Ok(())
}

/// The last backup recorded in `data_dir`, if one was (and the record
/// reads).
pub fn last_backup(data_dir: impl AsRef<Path>) -> Option<LastBackup> {
    let text = std::fs::read(data_dir.as_ref().join(LAST_BACKUP_FILE)).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Records `report` as the last backup of `data_dir`. Best effort: a
/// read-only data directory is backed up all the same. Renamed into place,
/// so a reader never sees half a record.
fn record_last(data_dir: &Path, report: &BackupReport) {
    let path = data_dir.join(LAST_BACKUP_FILE);
    let staged = data_dir.join(format!(".{LAST_BACKUP_FILE}.{}", std::process::id()));
    let written = serde_json::to_vec_pretty(&LastBackup::from(report))
        .map_err(std::io::Error::other)
        .and_then(|text| std::fs::write(&staged, text))
        .and_then(|()| std::fs::rename(&staged, &path));
    if let Err(error) = written {
        let _ = std::fs::remove_file(&staged);
        tracing::warn!(file = %path.display(), %error, "cannot record the last backup");
    }
}

/// Copies every file, on up to [`MAX_COPY_THREADS`] threads.
fn copy_all(
    files: &[crate::index::ObjectFile],
    into: &Path,
) -> Result<Vec<ObjectCopy>, BackupError> {
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .clamp(1, MAX_COPY_THREADS);
    let chunk = files.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let workers: Vec<_> = files
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|file| copy_object(&file.id, &file.path, into))
                        .collect::<Result<Vec<_>, _>>()
                })
            })
            .collect();
        let mut copies = Vec::with_capacity(files.len());
        for worker in workers {
            copies.extend(worker.join().map_err(|_| BackupError::Aborted)??);
        }
        Ok(copies)
    })
}

/// Opens an object file to copy it: read-only, and `immutable` when the
/// directory cannot be written (no `-shm` can be made) and the file has no
/// `-wal` frames, so nothing writes to it now and immutable misses nothing.
fn open_source(source: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(
        source,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    match conn.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(())) {
        Err(error)
            if crate::inspect::cannot_open_read_only(&error)
                && !crate::inspect::has_wal_frames(source) =>
        {
            crate::inspect::open_immutable(source)
        }
        _ => Ok(conn),
    }
}

/// Copies one object file into `into` (see the module docs for why this
/// is consistent while a host writes).
fn copy_object(id: &str, source: &Path, into: &Path) -> Result<ObjectCopy, BackupError> {
    let failed = |source_error: StorageError| BackupError::Copy {
        id: id.to_owned(),
        file: source.to_path_buf(),
        source: source_error,
    };
    let sqlite = |e: rusqlite::Error| failed(storage_error(e));
    // Ids are hex, so the relative path is ASCII.
    let relative = object_file(id).to_string_lossy().into_owned();
    let dest = into.join(&relative);
    if let Some(shard) = dest.parent() {
        std::fs::create_dir_all(shard).map_err(io(shard))?;
    }
    let from = open_source(source).map_err(sqlite)?;
    from.busy_timeout(BUSY_RETRY_WINDOW).map_err(sqlite)?;
    // Read-only connections do not checkpoint at close; say so anyway, so
    // no later SQLite can write the host's WAL into its file from here.
    from.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true)
        .map_err(sqlite)?;
    let mut to = Connection::open_with_flags(
        &dest,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(sqlite)?;
    // The copy is a new file in a directory that is thrown away on any
    // failure, and synced once it is whole: no journal, no sync per step.
    to.pragma_update(None, "journal_mode", "OFF")
        .and_then(|()| to.pragma_update(None, "synchronous", "OFF"))
        .map_err(sqlite)?;
    let copied_ms = now_ms();
    // One read transaction covers the host rows read here and every page
    // the backup copies (a step in a connection's open read transaction
    // uses it): they are the same committed state.
    from.execute_batch("BEGIN").map_err(sqlite)?;
    let recorded = read_recorded(&from).map_err(sqlite)?;
    {
        let backup = Backup::new(&from, &mut to).map_err(sqlite)?;
        let deadline = Instant::now() + BUSY_RETRY_WINDOW;
        loop {
            match backup.step(-1).map_err(sqlite)? {
                StepResult::Done => break,
                StepResult::More => {}
                StepResult::Busy | StepResult::Locked if Instant::now() < deadline => {
                    std::thread::sleep(BUSY_RETRY_PAUSE);
                }
                _ => {
                    return Err(failed(StorageError::Unavailable {
                        message: "the file stayed busy; the copy gave up".into(),
                    }));
                }
            }
        }
    }
    from.execute_batch("COMMIT").map_err(sqlite)?;
    drop(from);
    to.close().map_err(|(_, e)| sqlite(e))?;
    let (bytes, sha256) = hash_file(&dest)?;
    Ok(ObjectCopy {
        id: id.to_owned(),
        namespace: recorded.namespace,
        name: recorded.name,
        file: relative,
        bytes,
        sha256,
        alarm_ms: recorded.alarm_ms,
        copied_ms,
    })
}

#[derive(Default)]
struct Recorded {
    namespace: Option<String>,
    name: Option<String>,
    alarm_ms: Option<EpochMs>,
}

/// The host's rows of an object file; a file made but never set up (a
/// crash between the two) has none.
fn read_recorded(conn: &Connection) -> rusqlite::Result<Recorded> {
    let has = |table: &str| -> rusqlite::Result<bool> {
        conn.query_row(
            "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?1",
            params![table],
            |row| row.get(0),
        )
    };
    let mut recorded = Recorded::default();
    if has(META_TABLE)? {
        let meta = |key: &str| {
            conn.query_row(
                &format!("SELECT value FROM {META_TABLE} WHERE key = ?1"),
                params![key],
                |row| row.get::<_, String>(0),
            )
            .optional()
        };
        recorded.namespace = meta("namespace")?;
        recorded.name = meta("name")?;
    }
    if has(ALARM_TABLE)? {
        recorded.alarm_ms = conn
            .query_row(
                &format!("SELECT at_ms FROM {ALARM_TABLE} WHERE slot = 0"),
                [],
                |row| row.get(0),
            )
            .optional()?;
    }
    Ok(recorded)
}

/// Checks every object of the backup at `backup` against its manifest:
/// the size and SHA-256 of each copy, then SQLite's `PRAGMA
/// integrity_check` (the copy opened `immutable`, so nothing is written
/// into the backup). Fails with [`BackupError::Damaged`] naming every bad
/// object, or with [`BackupError::NoManifest`] /
/// [`BackupError::BadManifest`] when the backup never completed or its
/// manifest was damaged.
pub fn verify(backup: impl AsRef<Path>) -> Result<VerifyReport, BackupError> {
    let backup = backup.as_ref();
    let manifest = read_manifest(backup)?;
    let bad: Vec<BadObject> = manifest
        .objects
        .iter()
        .filter_map(|object| check_object(backup, object).err())
        .collect();
    if !bad.is_empty() {
        return Err(BackupError::Damaged {
            path: backup.to_path_buf(),
            bad,
        });
    }
    Ok(VerifyReport {
        objects: manifest.objects.len() as u64,
        bytes: manifest.bytes,
        manifest,
    })
}

/// Reads and checks `backup`'s manifest: it parses, its format is known,
/// its checksum matches, every entry's id and file follow the rules, and
/// its total is the sum of its entries.
pub fn read_manifest(backup: impl AsRef<Path>) -> Result<Manifest, BackupError> {
    let backup = backup.as_ref();
    std::fs::metadata(backup).map_err(io(backup))?;
    let path = backup.join(MANIFEST_FILE);
    let bad = |message: String| BackupError::BadManifest {
        path: path.clone(),
        message,
    };
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(BackupError::NoManifest { path });
        }
        Err(source) => return Err(BackupError::Io { path, source }),
    };
    let manifest: Manifest =
        serde_json::from_slice(&text).map_err(|e| bad(format!("not a complete manifest: {e}")))?;
    if manifest.format > MANIFEST_FORMAT || manifest.format == 0 {
        return Err(bad(format!(
            "format {} is not one this release reads (it reads 1 to {MANIFEST_FORMAT})",
            manifest.format
        )));
    }
    let digest = manifest.digest();
    if digest != manifest.checksum {
        return Err(bad(format!(
            "its checksum is {:?} but its contents hash to {digest:?}: the manifest was changed or damaged",
            manifest.checksum
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for object in &manifest.objects {
        if !is_object_id(&object.id) {
            return Err(bad(format!(
                "{:?} is not an object id (64 lowercase hex digits)",
                object.id
            )));
        }
        if Path::new(&object.file) != object_file(&object.id) {
            return Err(bad(format!(
                "object {} names the file {:?}; it must be {:?}",
                object.id,
                object.file,
                object_file(&object.id)
            )));
        }
        if !seen.insert(object.id.as_str()) {
            return Err(bad(format!("object {} is listed twice", object.id)));
        }
    }
    let sum: u64 = manifest.objects.iter().map(|o| o.bytes).sum();
    if sum != manifest.bytes {
        return Err(bad(format!(
            "bytes is {} but its objects add up to {sum}",
            manifest.bytes
        )));
    }
    Ok(manifest)
}

/// Checks one copy: size, checksum, integrity.
fn check_object(backup: &Path, object: &ObjectCopy) -> Result<(), BadObject> {
    let file = backup.join(&object.file);
    let bad = |problem: Problem| BadObject {
        id: object.id.clone(),
        file: file.clone(),
        problem,
    };
    let found = match std::fs::metadata(&file) {
        Ok(meta) => meta.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(bad(Problem::Missing)),
        Err(e) => {
            return Err(bad(Problem::Unreadable {
                message: e.to_string(),
            }));
        }
    };
    if found != object.bytes {
        return Err(bad(Problem::Size {
            manifest: object.bytes,
            found,
        }));
    }
    let (_, digest) = hash_file(&file).map_err(|e| {
        bad(Problem::Unreadable {
            message: e.to_string(),
        })
    })?;
    if digest != object.sha256 {
        return Err(bad(Problem::Checksum {
            manifest: object.sha256.clone(),
            found: digest,
        }));
    }
    integrity(&file).map_err(bad)
}

/// SQLite's `integrity_check` of a copy, opened without a lock, a `-shm`
/// or a look at a `-wal` (a copy has none), so checking writes nothing.
fn integrity(file: &Path) -> Result<(), Problem> {
    let unreadable = |e: rusqlite::Error| Problem::Unreadable {
        message: e.to_string(),
    };
    let conn = crate::inspect::open_immutable(file).map_err(unreadable)?;
    let lines: Vec<String> = conn
        .prepare("PRAGMA integrity_check(20)")
        .and_then(|mut stmt| {
            stmt.query_map([], |row| row.get::<_, String>(0))?
                .collect::<rusqlite::Result<_>>()
        })
        .map_err(|e| match e.sqlite_error_code() {
            Some(rusqlite::ErrorCode::NotADatabase | rusqlite::ErrorCode::DatabaseCorrupt) => {
                Problem::Integrity {
                    message: e.to_string(),
                }
            }
            _ => unreadable(e),
        })?;
    if lines == ["ok"] {
        Ok(())
    } else {
        Err(Problem::Integrity {
            message: lines.join("; "),
        })
    }
}

/// Restores the backup at `backup` into `data_dir`, which must not exist
/// or be an empty directory that no host holds. Verifies the objects to
/// restore first (nothing is written if one is bad), writes them under a
/// temporary name beside `data_dir`, checking each copy's checksum again
/// as it is written, builds the alarm index from them (so a host started
/// on the directory wakes every restored alarm that is due), syncs
/// everything and renames the directory into place.
pub fn restore(
    backup: impl AsRef<Path>,
    data_dir: impl AsRef<Path>,
    which: &Restore,
) -> Result<RestoreReport, BackupError> {
    restore_then(backup.as_ref(), data_dir.as_ref(), which, |_| Ok(()))
}

/// [`restore`], with `then` run on the restored objects (in the temporary
/// directory) before the alarm index is built and the directory renamed:
/// a restore at a moment replays the archive's journal there
/// ([`crate::archive::restore_at`]); if it fails, nothing is left.
pub(crate) fn restore_then(
    backup: &Path,
    data_dir: &Path,
    which: &Restore,
    then: impl FnOnce(&Path) -> Result<(), BackupError>,
) -> Result<RestoreReport, BackupError> {
    let started = Instant::now();
    if let Some(id) = which.only.iter().flatten().find(|id| !is_object_id(id)) {
        return Err(BackupError::InvalidObjectId { id: id.clone() });
    }
    refuse_unless_empty(data_dir)?;
    let manifest = read_manifest(backup)?;
    let chosen: Vec<&ObjectCopy> = match &which.only {
        None => manifest.objects.iter().collect(),
        Some(ids) => ids
            .iter()
            .map(|id| {
                manifest
                    .objects
                    .iter()
                    .find(|o| &o.id == id)
                    .ok_or_else(|| BackupError::UnknownObject {
                        path: backup.to_path_buf(),
                        id: id.clone(),
                    })
            })
            .collect::<Result<_, _>>()?,
    };
    let bad: Vec<BadObject> = chosen
        .iter()
        .filter_map(|object| check_object(backup, object).err())
        .collect();
    if !bad.is_empty() {
        return Err(BackupError::Damaged {
            path: backup.to_path_buf(),
            bad,
        });
    }
    let temporary = Temporary::beside(data_dir, "restoring")?;
    let mut bytes = 0;
    let mut written = Vec::with_capacity(chosen.len());
    for object in &chosen {
        bytes += restore_object(backup, object, temporary.path())?;
        written.push(object_path(
            temporary.path(),
            &ObjectId::new(object.id.clone()),
        ));
    }
    sync_files(&written)?;
    then(temporary.path())?;
    // The index a host would rebuild at its first start, built now so the
    // restored directory is complete as it appears.
    let built = crate::index::AlarmIndex::build_new(temporary.path())?;
    if built.unreadable > 0 {
        return Err(BackupError::Host(HostError::Io {
            path: temporary.path().to_path_buf(),
            message: format!(
                "{} restored object files could not be read to index their alarms",
                built.unreadable
            ),
        }));
    }
    sync_tree(temporary.path())?;
    temporary.finish()?;
    Ok(RestoreReport {
        data_dir: data_dir.to_path_buf(),
        objects: chosen.len() as u64,
        bytes,
        alarms: built.alarms,
        elapsed: started.elapsed(),
    })
}

/// Writes one verified copy into a data directory being restored, checking
/// the checksum of the bytes it writes (the backup may have changed since
/// it was verified); it is made durable with the others
/// ([`sync_files`]).
fn restore_object(backup: &Path, object: &ObjectCopy, into: &Path) -> Result<u64, BackupError> {
    let from = backup.join(&object.file);
    let to = object_path(into, &ObjectId::new(object.id.clone()));
    if let Some(shard) = to.parent() {
        std::fs::create_dir_all(shard).map_err(io(shard))?;
    }
    let mut reader = File::open(&from).map_err(io(&from))?;
    let mut writer = File::create_new(&to).map_err(io(&to))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; READ_CHUNK_BYTES];
    let mut bytes = 0u64;
    loop {
        let n = reader.read(&mut buffer).map_err(io(&from))?;
        let Some(chunk) = buffer.get(..n).filter(|c| !c.is_empty()) else {
            break;
        };
        hasher.update(chunk);
        writer.write_all(chunk).map_err(io(&to))?;
        bytes += n as u64;
    }
    let digest = hex(&hasher.finalize());
    if digest != object.sha256 {
        return Err(BackupError::Damaged {
            path: backup.to_path_buf(),
            bad: vec![BadObject {
                id: object.id.clone(),
                file: from,
                problem: Problem::Checksum {
                    manifest: object.sha256.clone(),
                    found: digest,
                },
            }],
        });
    }
    Ok(bytes)
}

/// Refuses a data directory that a host holds or that holds anything.
fn refuse_unless_empty(data_dir: &Path) -> Result<(), BackupError> {
    let mut entries = match std::fs::read_dir(data_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(BackupError::Io {
                path: data_dir.to_path_buf(),
                source,
            });
        }
    };
    // Held first: "in use by pid N" says more than "not empty".
    let lock = data_dir.join(DATA_DIR_LOCK_FILE);
    if let Ok(file) = File::open(&lock)
        && matches!(file.try_lock_shared(), Err(TryLockError::WouldBlock))
    {
        return Err(HostError::DataDirInUse {
            path: data_dir.to_path_buf(),
            holder_pid: std::fs::read_to_string(&lock)
                .ok()
                .and_then(|pid| pid.trim().parse().ok()),
            lock,
        }
        .into());
    }
    if let Some(entry) = entries.next() {
        let entry = entry.map_err(io(data_dir))?;
        return Err(BackupError::NotEmpty {
            path: data_dir.to_path_buf(),
            entry: entry.file_name().to_string_lossy().into_owned(),
        });
    }
    Ok(())
}

/// A directory being written under a hidden name beside its destination,
/// removed if it is dropped before [`Temporary::finish`] renames it.
struct Temporary {
    path: PathBuf,
    dest: PathBuf,
    finished: bool,
}

impl Temporary {
    /// Creates `.NAME.<what>-<pid>-<nanos>` in `dest`'s parent (made
    /// durably if missing). Refuses a `dest` that exists and is not an
    /// empty directory.
    fn beside(dest: &Path, what: &str) -> Result<Temporary, BackupError> {
        refuse_occupied(dest)?;
        let name = dest
            .file_name()
            .ok_or_else(|| BackupError::InvalidDestination {
                path: dest.to_path_buf(),
                rule: "must end in a file name (not `/` or `..`)",
            })?
            .to_string_lossy()
            .into_owned();
        let parent = parent_of(dest);
        crate::directory::create_durably(&parent).map_err(io(&parent))?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = parent.join(format!(".{name}.{what}-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&path).map_err(io(&path))?;
        Ok(Temporary {
            path,
            dest: dest.to_path_buf(),
            finished: false,
        })
    }

    fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the directory to its destination (an empty directory there
    /// is replaced; rename(2) refuses one that is not) and syncs the
    /// parent, so the name survives a power cut.
    fn finish(mut self) -> Result<(), BackupError> {
        refuse_occupied(&self.dest)?;
        std::fs::rename(&self.path, &self.dest).map_err(|e| {
            if e.kind() == std::io::ErrorKind::DirectoryNotEmpty {
                BackupError::DestinationExists {
                    path: self.dest.clone(),
                }
            } else {
                io(&self.dest)(e)
            }
        })?;
        self.finished = true;
        let parent = parent_of(&self.dest);
        crate::directory::sync(&parent).map_err(io(&parent))
    }
}

/// Refuses a path that exists unless it is an empty directory.
fn refuse_occupied(dest: &Path) -> Result<(), BackupError> {
    let occupied = match std::fs::symlink_metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(io(dest)(e)),
        Ok(meta) if meta.is_dir() => std::fs::read_dir(dest).map_err(io(dest))?.next().is_some(),
        Ok(_) => true,
    };
    if occupied {
        return Err(BackupError::DestinationExists {
            path: dest.to_path_buf(),
        });
    }
    Ok(())
}

impl Drop for Temporary {
    fn drop(&mut self) {
        if !self.finished
            && let Err(error) = std::fs::remove_dir_all(&self.path)
        {
            tracing::warn!(dir = %self.path.display(), %error, "cannot remove an unfinished backup or restore");
        }
    }
}

fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Syncs every directory of a backup or restored data directory (files
/// are synced as they are written): the shards, `objects/`, the root. The
/// layout is fixed, so a loop over one level of shards covers it.
fn sync_tree(root: &Path) -> Result<(), BackupError> {
    let objects = objects_dir(root);
    if objects.is_dir() {
        for shard in std::fs::read_dir(&objects).map_err(io(&objects))? {
            let shard = shard.map_err(io(&objects))?.path();
            if shard.is_dir() {
                crate::directory::sync(&shard).map_err(io(&shard))?;
            }
        }
        crate::directory::sync(&objects).map_err(io(&objects))?;
    }
    crate::directory::sync(root).map_err(io(root))
}

/// Syncs every file of `files` on up to [`SYNC_THREADS`] threads.
fn sync_files(files: &[PathBuf]) -> Result<(), BackupError> {
    let chunk = files.len().div_ceil(SYNC_THREADS).max(1);
    std::thread::scope(|scope| {
        let workers: Vec<_> = files
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    part.iter().try_for_each(|path| {
                        File::open(path)
                            .and_then(|file| file.sync_all())
                            .map_err(io(path))
                    })
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|worker| worker.join().map_err(|_| BackupError::Aborted)?)
    })
}

/// Writes `bytes` to a new file at `path` and syncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), BackupError> {
    File::create_new(path)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            file.sync_all()
        })
        .map_err(io(path))
}

/// The size and SHA-256 of a file, read in chunks (an object may be
/// larger than memory).
fn hash_file(path: &Path) -> Result<(u64, String), BackupError> {
    let mut file = File::open(path).map_err(io(path))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; READ_CHUNK_BYTES];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buffer).map_err(io(path))?;
        let Some(chunk) = buffer.get(..n).filter(|c| !c.is_empty()) else {
            break;
        };
        hasher.update(chunk);
        bytes += n as u64;
    }
    Ok((bytes, hex(&hasher.finalize())))
}

#[cfg(test)]
mod tests {
    use super::*;

    use durability_powercut::Fault;

    /// Objects of the power-cut test's data directory.
    const OBJECTS: usize = 200;
    /// Set only in the child that runs the backup: `DATA_DIR DEST`.
    const CHILD_ENV: &str = "DURABILITY_POWER_CUT_BACKUP";

    /// A data directory of `OBJECTS` object files, written with plain
    /// SQLite in the host's layout (ids are what the host would make).
    fn data_dir(dir: &Path) {
        for i in 0..OBJECTS {
            let id = crate::id::object_id("ns", &format!("object-{i}"));
            let path = object_path(dir, &id);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(
                "PRAGMA journal_mode=WAL;
                 CREATE TABLE t (v TEXT);
                 INSERT INTO t VALUES (hex(randomblob(3000)));",
            )
            .unwrap();
        }
    }

    /// The child: backs up `DATA_DIR` into `DEST` and exits.
    #[test]
    #[ignore = "the backup child of a power-cut test; run by that test"]
    fn power_cut_backup_child() {
        let Some(args) = std::env::var_os(CHILD_ENV) else {
            return;
        };
        let args = args.to_string_lossy().into_owned();
        let (data, dest) = args.split_once('\n').unwrap();
        backup_dir(data, dest).unwrap();
    }

    fn copies_in(dir: &Path) -> usize {
        std::fs::read_dir(objects_dir(dir))
            .map(|shards| {
                shards
                    .filter_map(|s| std::fs::read_dir(s.ok()?.path()).ok())
                    .map(Iterator::count)
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Whether a backup under `parent` (DEST or a hidden partial) has
    /// written `copies` object files so far.
    fn copied(parent: &Path, copies: usize) -> bool {
        std::fs::read_dir(parent).is_ok_and(|entries| {
            entries
                .filter_map(Result::ok)
                .any(|e| copies_in(&e.path()) >= copies)
        })
    }

    #[test]
    fn a_power_cut_during_a_backup_leaves_no_backup_that_verifies_but_is_incomplete() {
        let root = tempfile::tempdir().unwrap();
        let data = root.path().join("data");
        data_dir(&data);
        let cut = crate::power_cut::PowerCut::mount();
        // Killed after so many copies (`None`: let it finish), then the
        // power is cut with the seed.
        for (seed, kill_after) in [(1, Some(1)), (2, Some(80)), (3, Some(OBJECTS)), (4, None)] {
            let parent = cut.dir.join(format!("run-{seed}"));
            // Made durably: the cut undoes what no directory sync covered.
            crate::directory::create_durably(&parent).unwrap();
            let dest = parent.join("backup");
            let mut child = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "backup::tests::power_cut_backup_child"])
                .args(["--ignored", "--nocapture"])
                .env(CHILD_ENV, format!("{}\n{}", data.display(), dest.display()))
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap();
            match kill_after {
                Some(copies) => {
                    let deadline = Instant::now() + Duration::from_secs(120);
                    while !copied(&parent, copies) && child.try_wait().unwrap().is_none() {
                        assert!(Instant::now() < deadline, "seed {seed}: no progress");
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    let _ = child.kill();
                    child.wait().unwrap();
                }
                None => assert!(child.wait().unwrap().success(), "seed {seed}"),
            }
            let report = cut.fs.cut(Fault::Metadata, seed).unwrap();
            // Whatever is left beside DEST either does not verify or is a
            // whole backup.
            for entry in std::fs::read_dir(&parent).unwrap() {
                let path = entry.unwrap().path();
                if let Ok(checked) = verify(&path) {
                    assert_eq!(
                        checked.objects,
                        OBJECTS as u64,
                        "seed {seed}: {} verifies with {} objects ({report:?})",
                        path.display(),
                        checked.objects
                    );
                }
            }
            if kill_after.is_none() {
                let checked = verify(&dest).unwrap();
                assert_eq!(
                    checked.objects, OBJECTS as u64,
                    "a finished backup survives"
                );
            }
        }
        cut.fs.unmount().unwrap();
    }
}
