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
