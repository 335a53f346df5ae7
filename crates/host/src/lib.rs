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
//! Module map: `host` (handles: [`Host`], [`Namespace`], [`Stub`]),
//! `executor` (where objects live, their alarms and eviction), `residency`
//! (the host-wide cap on live objects and its LRU), `storage` (one
//! object's database and alarm), `index` (the host's alarm index), `id`
//! (names, ids and paths), `clock`, `context`, [`inspect`] (read-only
//! listing of a data directory), [`telemetry`] (metric names).
//!
//! [`Host`] opens with a runnable example: a namespace, a stub, a call.

#![warn(missing_docs)]

mod clock;
mod context;
mod error;
mod executor;
mod host;
mod id;
mod index;
pub mod inspect;
mod residency;
mod storage;
pub mod telemetry;
mod work;

use std::future::Future;

pub use context::ObjectContext;
pub use durability_platform::{AlarmInfo, ObjectId};
pub use error::{CallError, HostError};
pub use executor::{ALARM_MAX_RETRIES, ALARM_RETRY_BASE};
pub use host::{
    DATA_DIR_LOCK_FILE, DEFAULT_IDLE_TIMEOUT, DEFAULT_SHUTDOWN_GRACE, Host, HostBuilder,
    MAX_THREADS, Namespace, Stub, Synchronous,
};
pub use id::MAX_NAME_BYTES;
pub use residency::{DEFAULT_MAX_LIVE_OBJECTS_CEILING, FDS_PER_LIVE_OBJECT, RESERVED_FDS};

/// An error of an object's own code (factory, alarm handler). It need not
/// be `Send`: it never leaves the object's thread as a value.
pub type BoxError = Box<dyn std::error::Error>;

/// A user object type, registered with [`Host::namespace`].
pub trait DurableObject: 'static {
    /// Called when the object's alarm fires. Returning `Err` makes the host
    /// retry after 2 s, 4 s, 8 s, ... ([`ALARM_MAX_RETRIES`] times at most).
    /// Default: does nothing and returns `Ok(())`.
    fn alarm(&self, info: AlarmInfo) -> impl Future<Output = Result<(), BoxError>> {
        let _ = info;
        async { Ok(()) }
    }
}
