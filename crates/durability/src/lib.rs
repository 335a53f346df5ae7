//! `durability`: durable work inside objects.
//!
//! The capabilities of this crate run inside an *object* (an actor that owns
//! one SQLite database and one persistent alarm) and see it only through
//! [`durability_platform::Context`], so the same code runs on the embedded
//! host (`durability-host`) and, later, inside Cloudflare Durable Objects.

pub use durability_platform as platform;

pub mod alarms;
pub mod codec;
pub mod error;
pub mod fanout;
pub mod kind;
pub mod lifecycle;
pub mod limits;
pub mod load;
pub mod log;
pub mod memo;
pub mod migrations;
pub mod operations;
pub mod record;
pub mod retry;
pub mod routing;
pub mod scheduler;
pub mod state;
pub mod telemetry;
pub mod trace;

pub use alarms::{
    AlarmCall, AlarmEntry, AlarmState, Alarms, AlarmsBuilder, MissedTicks, Recurrence,
    RecurrenceError,
};
pub use error::{ConfigError, DurabilityError, HandlerError, SerializedError};
pub use fanout::{Fanout, FanoutBuilder};
pub use kind::ErrorKind;
pub use load::{Load, LoadSnapshot};
pub use log::{Log, LogBuilder, LogError};
pub use operations::{DurableCall, OperationResult, Operations, OperationsBuilder, Registration};
pub use scheduler::{AbortSignal, AlarmRetryInfo, Scheduler, SchedulerBuilder};

/// The Rust excerpts of the README and of the guide under `docs/`, compiled
/// as doctests of this crate, whose dev-dependencies (the host, the test
/// kit, tokio, tempfile, jiff) are what they use. `docs/axum.md` needs the
/// dashboard and axum, and is compiled by `durability-axum` instead. The
/// test `docs_links` checks that every file of `docs/` is included here or
/// there.
#[cfg(doctest)]
mod guide {
    #[doc = include_str!("../../../README.md")]
    mod readme {}
    #[doc = include_str!("../../../docs/README.md")]
    mod index {}
    #[doc = include_str!("../../../docs/capabilities.md")]
    mod capabilities {}
    #[doc = include_str!("../../../docs/observability.md")]
    mod observability {}
    #[doc = include_str!("../../../docs/configuration.md")]
    mod configuration {}
    #[doc = include_str!("../../../docs/testing.md")]
    mod testing {}
    #[doc = include_str!("../../../docs/guarantees.md")]
    mod guarantees {}
    #[doc = include_str!("../../../docs/limits.md")]
    mod limits {}
    #[doc = include_str!("../../../docs/operating.md")]
    mod operating {}
    #[doc = include_str!("../../../docs/benchmarks.md")]
    mod benchmarks {}
    #[doc = include_str!("../../../docs/torture-and-fuzz.md")]
    mod torture_and_fuzz {}
    #[doc = include_str!("../../../docs/layout.md")]
    mod layout {}
    // Its one Rust excerpt is `rust,ignore`: it implements the adapter's
    // trait, which exists only when building for wasm32 (the Workers
    // target), and doctests are built for the host. The adapter's own
    // wasm32 build (scripts/wasm-check) and the example worker compile the
    // same shape.
    #[doc = include_str!("../../../docs/cloudflare.md")]
    mod cloudflare {}
}
