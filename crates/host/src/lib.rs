//! The embedded object host of `durability`.
//!
//! An *object* is a small actor addressed by (namespace, name). The host
//! gives each object one SQLite file (bundled SQLite, WAL) holding its rows
//! and its one persistent alarm, runs it on one executor thread with
//! run-to-completion between awaits, constructs it on its first call or
//! alarm, evicts it when idle, and wakes it when its alarm is due, also in a
//! new process. Objects see the host through [`ObjectContext`], the host's
//! implementation of [`durability_platform::Context`]; this crate knows
//! nothing of the capabilities built on that contract.
//!
//! Durability: by default commits do not wait for a sync of their own; a
//! host-wide flusher syncs them in batches, and a call's reply is released
//! only once the commits before it are on disk (output gates, see
//! [`Synchronous`] for the modes and what each promises).
//!
//! Module map: `host` (handles: [`Host`], [`Namespace`], [`Stub`]),
//! `executor` (where objects live, their alarms and eviction), `residency`
//! (the host-wide cap on live objects and its LRU), `storage` (one
//! object's database and alarm), `flush` (group commit and the output
//! gates), `index` (the host's alarm index), `id`
//! (names, ids and paths), `clock`, `context`, [`inspect`] (read-only
//! listing of a data directory), [`backup`] (consistent copies of a
//! running data directory, their verification and restore),
//! [`telemetry`] (metric names).
//!
//! [`Host`] opens with a runnable example: a namespace, a stub, a call.
//!
//! Feature `testing` adds what a test kit needs (the `durability-test`
//! crate is built on it): running an object's alarm now, running non-`Send`
//! closures in an object, a restart on the same directory, reading an
//! object's tables, and a storage failure injected at the next commit.
//! Enable it in `[dev-dependencies]` only.

#![warn(missing_docs)]

pub mod archive;
pub mod backup;
mod clock;
mod context;
mod directory;
mod error;
mod executor;
mod flush;
mod host;
mod id;
mod index;
pub mod inspect;
mod journal;
#[cfg(test)]
mod power_cut;
mod residency;
mod storage;
pub mod telemetry;
mod work;

use std::future::Future;

pub use backup::backup_dir;
pub use context::ObjectContext;
pub use durability_platform::{AlarmInfo, ObjectId, StorageLimits};
pub use error::{CallError, HostError};
pub use executor::{ALARM_MAX_RETRIES, ALARM_RETRY_BASE};
pub use flush::FlushMethod;
#[cfg(feature = "testing")]
pub use host::FiredAlarm;
pub use host::{
    DATA_DIR_LOCK_FILE, DEFAULT_IDLE_TIMEOUT, DEFAULT_SHUTDOWN_GRACE, Host, HostBuilder,
    MAX_THREADS, Namespace, SQLITE_MAX_PATH_BYTES, Stub, Synchronous, is_data_dir, recover_journal,
    replay_journal,
};
pub use id::MAX_NAME_BYTES;
pub use index::{BUILT_VERSION, INDEX_FILE, IndexRebuild, RebuildReason};
pub use journal::{ByteRange, DAMAGED_DIR, DamagedSegment, ObjectRecovery, RecoveryReport};
pub use residency::{DEFAULT_MAX_LIVE_OBJECTS_CEILING, FDS_PER_LIVE_OBJECT, RESERVED_FDS};

/// An error of an object's own code (factory, alarm handler). It need not
/// be `Send`: it never leaves the object's thread as a value.
pub type BoxError = Box<dyn std::error::Error>;

/// A user object type, registered with [`Host::namespace`].
pub trait DurableObject: 'static {
    /// Called when the object's alarm fires. Returning `Err` makes the host
    /// retry after 2 s, 4 s, 8 s, ... ([`ALARM_MAX_RETRIES`] times at most).
    ///
    /// An object whose capabilities arm the alarm (a `durability`
    /// scheduler) must delegate to them here. Default: returns
    /// [`NoAlarmHandler`], which the host treats as a mistake, not as a
    /// delivery: it logs an error, keeps the alarm in storage and does not
    /// retry it, so work behind the alarm is never cleared away unseen.
    fn alarm(&self, info: AlarmInfo) -> impl Future<Output = Result<(), BoxError>> {
        let _ = info;
        async { Err(Box::new(NoAlarmHandler) as BoxError) }
    }
}

/// The error of an alarm delivered to an object that does not handle
/// alarms: the default [`DurableObject::alarm`] returns it, and so may an
/// object whose alarm handler is missing a part it needs (a test harness
/// without its scheduler).
///
/// The host never clears an alarm that ended with this error (the work
/// behind it would be stranded) and never retries it (it cannot succeed):
/// it logs an error and keeps the alarm in the object's file, where the
/// object's next construction or next alarm change schedules it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the object's alarm fired but the object does not handle alarms (implement DurableObject::alarm and delegate to its scheduler)"
)]
pub struct NoAlarmHandler;
