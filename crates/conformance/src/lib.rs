//! Host-neutral conformance scenarios: one scenario body, two platforms.
//!
//! The same [`Fixture`] object (every capability of the crate on one
//! scheduler, over the platform contract) runs in the embedded host and
//! inside a Cloudflare Durable Object under `workerd`. The scenarios in
//! [`scenarios`] drive it only through a [`Driver`](scenarios::Driver):
//! send a [`Command`] to an object by name, sleep, restart the platform. The
//! embedded host's test (`tests/host.rs`) and the workerd runner
//! (`durability-conformance-worker`) each implement the driver, so every
//! scenario here is checked on both platforms.
//!
//! The fixture is split by capability ([`fixture`]): each module owns its
//! commands, its handlers and their configuration. What handlers see is
//! written to one table ([`fixture::events`]), so a scenario checks what
//! really ran, with the attempt and the platform's alarm info, instead of
//! trusting timing. Each scenario works on objects of its own name, so
//! every scenario also runs the capabilities' migrations on a fresh object.
//!
//! The fixture is compiled into the worker: nothing here may panic on input
//! or storage; every failure is an `Err` with what went wrong.

pub mod fixture;
pub mod scenarios;

use std::time::Duration;

use durability_platform::{AlarmInfo, EpochMs, MAX_SAFE_INTEGER};
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use fixture::Fixture;
pub use fixture::alarms::{AlarmsCommand, RecurrenceSpec};
pub use fixture::fanout::{FanoutCommand, FanoutSpec};
pub use fixture::limits::LimitsCommand;
pub use fixture::log::LogCommand;
pub use fixture::migrations::{MigrateTo, MigrationsCommand};
pub use fixture::operations::{OpSpec, OperationsCommand};
pub use fixture::platform::PlatformCommand;
pub use fixture::routing::RoutingCommand;
pub use fixture::scheduler::SchedulerCommand;

/// The delay between attempts of the `flaky` operation: the same as the
/// minimum alarm delay, so its retries are the physical alarm's work.
pub const RETRY_DELAY_MS: u64 = 1_000;

/// The scheduler's `alarm_min_delay` in the fixture: the smallest allowed,
/// so scenarios that wait for the physical alarm stay short.
pub const ALARM_MIN_DELAY: Duration = Duration::from_secs(1);

/// The scheduler's `alarm_concurrency` in the fixture: small, so the pool
/// scenario can see its limit with a handful of operations.
pub const ALARM_CONCURRENCY: usize = 2;

/// How long scenarios wait for work that is due: generous, since CI shares
/// two cores with builds.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);

/// One request to a [`Fixture`], as JSON over HTTP under workerd: the
/// capability it is for and that capability's command.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "capability", content = "command", rename_all = "snake_case")]
pub enum Command {
    /// The storage contract itself (tables, transactions, integers).
    Platform(PlatformCommand),
    /// The scheduler: the physical alarm, its runs and failures.
    Scheduler(SchedulerCommand),
    /// Durable operations.
    Operations(OperationsCommand),
    /// Named alarms, one-shot and recurring.
    Alarms(AlarmsCommand),
    /// Schema migrations.
    Migrations(MigrationsCommand),
    /// Fanout.
    Fanout(FanoutCommand),
    /// The retained log.
    Log(LogCommand),
    /// Load snapshots and the routing client.
    Routing(RoutingCommand),
    /// The platform's limits: statements and builder settings beyond them.
    Limits(LimitsCommand),
    /// What the fixture's handlers recorded under `kind`, in order.
    Events { kind: String },
}

macro_rules! command_from {
    ($($variant:ident($inner:ty)),* $(,)?) => {
        $(impl From<$inner> for Command {
            fn from(command: $inner) -> Self {
                Command::$variant(command)
            }
        })*
    };
}

command_from!(
    Platform(PlatformCommand),
    Scheduler(SchedulerCommand),
    Operations(OperationsCommand),
    Alarms(AlarmsCommand),
    Migrations(MigrationsCommand),
    Fanout(FanoutCommand),
    Log(LogCommand),
    Routing(RoutingCommand),
    Limits(LimitsCommand),
);

/// How an object reaches other objects of the fixture's class by name:
/// what the routing client needs. Each platform implements it over its own
/// stubs (a host `Namespace`, a Durable Object binding).
///
/// `Send + Sync` and `Send` futures because the routing client asks for
/// them (it may be shared by a multi-threaded runtime); a Worker, which
/// runs on one thread, wraps its futures.
pub trait Peers: Send + Sync + 'static {
    /// Sends `command` to the object named `object` and returns its answer.
    fn call(&self, object: &str, command: Command) -> PeerCall;
}

/// The answer of another object, on its way.
pub type PeerCall = BoxFuture<'static, Result<Value, String>>;

/// What the platform said about a delivery of the physical alarm, as JSON
/// (`null` for runs of the in-memory timer and eager starts).
pub fn platform_info(info: Option<AlarmInfo>) -> Value {
    match info {
        Some(info) => serde_json::json!({
            "retry_count": info.retry_count,
            "is_retry": info.is_retry,
        }),
        None => Value::Null,
    }
}

/// `now + delta_ms`, or the error a scenario sees when it asked for a time
/// no platform can store.
pub fn at_offset(now: EpochMs, delta_ms: i64) -> Result<EpochMs, String> {
    now.checked_add(delta_ms)
        .filter(|at| (0..=MAX_SAFE_INTEGER).contains(at))
        .ok_or_else(|| format!("{now} + {delta_ms} ms is not a safe timestamp"))
}

/// Whether `value` is an integer every platform stores exactly.
pub fn is_safe_integer(value: i64) -> bool {
    (-MAX_SAFE_INTEGER..=MAX_SAFE_INTEGER).contains(&value)
}
