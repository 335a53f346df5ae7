//! The platform contract of `durability`: everything the capabilities need
//! from the thing that runs an object, and nothing more.
//!
//! An *object* is a small actor that owns one SQLite database and one
//! persistent alarm (the model of Cloudflare Durable Objects). The
//! capabilities (`durability`) see an object only through [`Context`]; the
//! embedded host (`durability-host`) implements it on rusqlite and tokio, and
//! an adapter on `workers-rs` can implement it on Cloudflare later. This crate
//! therefore depends on nothing platform-specific and builds for
//! `wasm32-unknown-unknown`.
//!
//! Everything an object does runs on one thread, and code between two awaits
//! never interleaves with other work of the same object (run-to-completion).
//! That is why futures here are not `Send` and why storage is synchronous:
//! a synchronous SQL call cannot be interrupted by another task of the object.
//!
//! ```
//! use durability_platform::{params, Value};
//!
//! let p = params![7_i64, "seven", None::<i64>];
//! assert_eq!(p[0], Value::Integer(7));
//! assert_eq!(p[1], Value::Text("seven".into()));
//! assert_eq!(p[2], Value::Null);
//! ```

mod context;
mod limits;
mod sql;
mod storage;

pub use context::{AlarmInfo, Context, ObjectId};
pub use limits::{StorageLimits, check_statement};
pub use sql::{FromValue, Row, Sql, Value, ValueType};
pub use storage::{Rollback, Storage, StorageError, StorageExt, Transaction};

use std::future::Future;
use std::pin::Pin;

/// A boxed future that need not be `Send`: objects run on one thread.
pub type LocalBoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// Milliseconds since the Unix epoch, the unit of every persisted time.
pub type EpochMs = i64;

/// The largest integer a persisted timestamp may hold (2^53 - 1), so that
/// records stay readable by the JavaScript reference library.
pub const MAX_SAFE_INTEGER: i64 = 9_007_199_254_740_991;

/// The longest delay an in-memory timer may be asked for (2^31 - 1 ms, about
/// 24.8 days). Platforms with JavaScript timers treat longer delays as zero,
/// so capabilities leave anything further out to the persistent alarm.
pub const MAX_TIMER_MS: u64 = 2_147_483_647;

/// Builds a parameter list for [`Sql`] calls from values of mixed types.
#[macro_export]
macro_rules! params {
    () => { [] as [$crate::Value; 0] };
    ($($value:expr),+ $(,)?) => { [$($crate::Value::from($value)),+] };
}
