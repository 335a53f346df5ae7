//! The host's error types and the one place where SQLite's error codes are
//! translated into the platform's [`StorageError`].

use std::path::PathBuf;

use durability_platform::StorageError;
use rusqlite::ErrorCode;
use thiserror::Error;

/// Why a host operation (building, registering a namespace, naming an
/// object, evicting, inspecting) failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum HostError {
    /// A namespace or object name breaks a naming rule.
    #[error("invalid {what}: {rule}")]
    InvalidName {
        /// Which name: `"namespace name"` or `"object name"`.
        what: &'static str,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// A namespace of this name is already registered on this host.
    #[error("namespace {name:?} is already registered on this host")]
    NamespaceExists {
        /// The namespace's name.
        name: String,
    },
    /// A builder setting is out of range.
    #[error("invalid host setting {setting}: {rule}")]
    InvalidSetting {
        /// The builder method.
        setting: &'static str,
        /// The rule its value breaks.
        rule: &'static str,
    },
    /// [`crate::HostBuilder::archive`] was set in a mode without the host
    /// journal, which is what the archive ships: no change would reach it.
    #[error(
        "invalid host setting archive: it needs the host journal (Synchronous::Batched with FlushMethod::Journal, the defaults), not {mode}, which keeps no record of changes to ship"
    )]
    ArchiveNeedsJournal {
        /// The mode that was set.
        mode: &'static str,
    },
    /// [`crate::HostBuilder::build`] was called outside a tokio runtime, or
    /// with `threads(0)` outside a `tokio::task::LocalSet`.
    #[error("the host must be built {required}")]
    NoRuntime {
        /// Where the build must happen.
        required: &'static str,
    },
    /// The data directory or an executor thread could not be set up.
    #[error("I/O error at {path}: {message}")]
    Io {
        /// The path that failed.
        path: PathBuf,
        /// The operating system's reason.
        message: String,
    },
    /// Another host (in this or another process) serves this data
    /// directory. Two hosts on one directory would both run the same
    /// objects and alarms; the second one is refused at once, never made to
    /// wait for the lock.
    #[error(
        "the data directory {path} is in use by another host ({}, lock file {lock})",
        holder_description(*.holder_pid)
    )]
    DataDirInUse {
        /// The data directory.
        path: PathBuf,
        /// The lock file the other host holds.
        lock: PathBuf,
        /// The process id the holder wrote into the lock file when it took
        /// the lock. `None` when the file holds none: a holder that has
        /// locked it but not written yet, or one of a release that did not
        /// write it.
        holder_pid: Option<u32>,
    },
    /// The host journal of an earlier process holds a record that a
    /// returned sync made durable beyond a stretch the disk lost (or
    /// garbled): replaying the records before it would roll objects back
    /// to an older state without a word, so nothing was replayed and no
    /// object file was touched. The disk did not keep what it acknowledged;
    /// copy the directory for inspection, then either restore the objects
    /// from a backup or run `durability recover DATA_DIR`
    /// ([`crate::recover_journal`]), which applies what it can prove whole,
    /// moves the segment aside and reports what each object lost.
    #[error(
        "the host journal segment {segment} lost synced records: its replayable records end at \
         byte {at}, but a record a returned sync made durable lies at byte {found}; nothing was \
         replayed and no object file was touched (`durability recover DATA_DIR` applies what can \
         be proven whole, moves the segment aside and reports what each object lost; see \
         docs/operating.md)"
    )]
    JournalLost {
        /// The segment file.
        segment: PathBuf,
        /// Where its replayable records end.
        at: u64,
        /// Where the first record beyond them starts.
        found: u64,
    },
    /// A journal recovery ([`crate::recover_journal`], `durability
    /// recover`) of this data directory stopped before it finished: its
    /// writes may be half done, so no host starts until it is run again.
    #[error(
        "a journal recovery of this data directory did not finish ({dir} still holds its \
         segments); run `durability recover DATA_DIR` again before starting a host"
    )]
    JournalRecoveryInterrupted {
        /// The recovery's staging directory.
        dir: PathBuf,
    },
    /// The host's alarm index (`index.sqlite` in the data directory) could
    /// not be opened or rebuilt for a reason other than damage (a damaged
    /// index is rebuilt from the object files, not an error).
    #[error("the alarm index {path} cannot be used: {source}")]
    Index {
        /// The index file.
        path: PathBuf,
        /// What SQLite or the file system said.
        #[source]
        source: StorageError,
    },
    /// The data directory's path is too long for SQLite: the object files
    /// under it could not be opened. Checked once, when the host starts.
    #[error(
        "the data directory {path} is too long for SQLite: its object files would have paths of \
         {object_path_bytes} bytes, and SQLite opens at most {limit_bytes} bytes; use a shorter path"
    )]
    PathTooLong {
        /// The data directory, made absolute.
        path: PathBuf,
        /// The length of the longest path the host would open under it.
        object_path_bytes: usize,
        /// The longest path SQLite opens.
        limit_bytes: usize,
    },
    /// The host's alarm index or an object's database failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The host is shutting down or its executors stopped.
    #[error("the host is shut down")]
    ShutDown,
    /// No namespace of this name is registered on this host.
    #[error("namespace {name:?} is not registered on this host")]
    UnknownNamespace {
        /// The namespace's name.
        name: String,
    },
}

/// Why a call through a [`crate::Stub`] failed. The call's own result type
/// carries the object's errors; these are the host's.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CallError {
    /// The object's database could not be opened or set up (corrupt file,
    /// disk full, permissions). Other objects are unaffected.
    #[error("object {id} could not open its storage: {source}")]
    Storage {
        /// The object's id.
        id: String,
        /// What the database said.
        #[source]
        source: StorageError,
    },
    /// The namespace's factory returned an error while constructing the object.
    #[error("object {id} could not be constructed: {message}")]
    Construct {
        /// The object's id.
        id: String,
        /// The factory's error.
        message: String,
    },
    /// The host refuses new calls because it is shutting down.
    #[error("the host is shutting down")]
    ShuttingDown,
    /// The call was dropped before it finished: the object was evicted
    /// explicitly, the host shut down, or the call's code panicked.
    #[error("the call to object {id} was dropped before it finished")]
    Aborted {
        /// The object's id.
        id: String,
    },
    /// The call ran, but a sync of the host's group commit failed, so the
    /// commits before its reply may not be on disk: the reply is withheld
    /// (`Synchronous::Batched`). Every later reply fails the same way;
    /// restart the host to recover what the disk holds.
    #[error("the reply of object {id} is withheld: {message}")]
    NotDurable {
        /// The object's id.
        id: String,
        /// Why its commits are not known to be durable.
        message: String,
    },
    /// The object in memory has another type than the stub expects; only
    /// possible if a namespace was registered with two object types.
    #[error("object {id} is not of the type this stub expects")]
    WrongType {
        /// The object's id.
        id: String,
    },
    /// `Stub::run_local` (feature `testing`) was called on a host whose
    /// object does not run on the calling thread: only an inline host
    /// (`threads(0)`) driven by this thread can hand back a value that is
    /// not `Send`.
    #[error(
        "object {id} does not run on this thread; run_local needs an inline host (threads(0)) on the caller's LocalSet"
    )]
    NotOnThisThread {
        /// The object's id.
        id: String,
    },
}

/// Maps a rusqlite error to the platform's storage error: the variant says
/// what a caller can do about it (full disk, damaged file, I/O, constraint,
/// a wrong statement).
pub(crate) fn storage_error(error: rusqlite::Error) -> StorageError {
    let message = error.to_string();
    match &error {
        rusqlite::Error::SqliteFailure(failure, _) => match failure.code {
            ErrorCode::DiskFull => StorageError::Full { message },
            ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt => {
                StorageError::Corrupt { message }
            }
            ErrorCode::CannotOpen
            | ErrorCode::SystemIoFailure
            | ErrorCode::PermissionDenied
            | ErrorCode::ReadOnly
            | ErrorCode::DatabaseBusy
            | ErrorCode::DatabaseLocked
            | ErrorCode::FileLockingProtocolFailed
            | ErrorCode::NoLargeFileSupport
            | ErrorCode::OutOfMemory => StorageError::Unavailable { message },
            ErrorCode::ConstraintViolation => StorageError::Constraint { message },
            _ => StorageError::Sql { message },
        },
        _ => StorageError::Sql { message },
    }
}

/// The error for storage used after its object was evicted or the host
/// closed it.
pub(crate) fn closed_error() -> StorageError {
    StorageError::Unavailable {
        message: "the object's storage is closed (the object was evicted or the host shut down)"
            .into(),
    }
}

/// The holder part of [`HostError::DataDirInUse`]'s message.
fn holder_description(pid: Option<u32>) -> String {
    match pid {
        Some(pid) => format!("pid {pid}"),
        None => "pid unknown".to_owned(),
    }
}
