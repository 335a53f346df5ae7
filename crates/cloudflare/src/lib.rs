//! The durability platform contract inside a Cloudflare Durable Object.
//!
//! The capabilities of `durability` (scheduler, operations, named alarms,
//! fanout, log, routing) are written against `durability-platform`. This
//! crate implements that contract over workers-rs (`worker` 0.8), so the same
//! capability code that runs in the embedded host runs in a Durable Object,
//! which Cloudflare shards across its network.
//!
//! ```ignore
//! use std::rc::Rc;
//! use durability::Scheduler;
//! use durability_cloudflare::{AlarmInfo, CloudflareContext, DurableObject};
//! use worker::{Env, Request, Response};
//!
//! struct Counter { scheduler: Scheduler }
//!
//! impl DurableObject for Counter {
//!     fn new(ctx: Rc<CloudflareContext>, _env: Env) -> worker::Result<Self> {
//!         let scheduler = Scheduler::new(ctx).map_err(|e| worker::Error::RustError(e.to_string()))?;
//!         Ok(Counter { scheduler })
//!     }
//!     async fn fetch(&self, _req: Request) -> worker::Result<Response> {
//!         Response::ok("hello")
//!     }
//!     async fn alarm(&self, info: AlarmInfo) -> worker::Result<()> {
//!         self.scheduler.alarm(Some(info)).await.map_err(|e| worker::Error::RustError(e.to_string()))
//!     }
//! }
//!
//! // `class_name = "Counter"` in wrangler.toml.
//! durability_cloudflare::durable_object!(CounterClass, Counter);
//! ```
//!
//! What the runtime lacks and how the adapter closes it:
//!
//! | gap | here |
//! | --- | --- |
//! | `alarmInfo` dropped by workers-rs' `#[durable_object]` | [`durable_object!`] exports the class itself and passes [`AlarmInfo`] on ([`object`](crate::ObjectHost)) |
//! | SQL `transactionSync` not bound | bound in [`CloudflareStorage`]; alarm calls inside it commit with the rows |
//! | `getAlarm` is a Promise | loaded under `blockConcurrencyWhile`, kept current, reloaded per alarm |
//! | integers are JavaScript numbers | outside ±(2^53 - 1) a typed [`StorageError::UnsafeInteger`](durability_platform::StorageError::UnsafeInteger); integral numbers read back as INTEGER ([`value`]) |
//! | `rowsWritten` counts index writes | `execute` returns SQLite's `changes()`: as `RETURNING 1` rows of the write itself where that is certain ([`changes`](crate::changes)), else a `SELECT changes()` |
//!
//! On targets other than `wasm32` only [`value`] (the pure conversion rules)
//! is compiled, so the workspace builds and tests on the host.

pub mod value;

// Pure, so its tests run on the host; only the wasm32 storage uses it.
#[cfg(any(target_arch = "wasm32", test))]
mod changes;

#[cfg(target_arch = "wasm32")]
mod context;
#[cfg(target_arch = "wasm32")]
mod object;
#[cfg(target_arch = "wasm32")]
mod storage;

pub use durability_platform::AlarmInfo;

#[cfg(target_arch = "wasm32")]
pub use context::{CloudflareContext, DEFAULT_INVOCATION_CPU_LIMIT};
#[cfg(target_arch = "wasm32")]
pub use object::{DurableObject, ObjectHost, alarm_info};
#[cfg(target_arch = "wasm32")]
pub use storage::{CloudflareStorage, SqlCounts};

/// What [`durable_object!`] expands to refers to; not an API.
#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
pub mod __private {
    pub use worker::wasm_bindgen;
    pub use worker::wasm_bindgen_futures;
    pub use worker::worker_sys;
    pub use worker::{Env, js_sys, web_sys};
}
