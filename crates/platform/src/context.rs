//! The context an object runs in: identity, storage, clock, sleep,
//! randomness and background work.

use std::fmt;
use std::time::Duration;

use crate::{EpochMs, LocalBoxFuture, Storage};

/// An object's identity: a hash of its namespace and name, in lowercase hex.
/// The host derives file paths from it, never from the user's name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId(String);

impl ObjectId {
    /// Wraps an id the platform computed.
    pub fn new(id: impl Into<String>) -> Self {
        ObjectId(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What the platform says about one delivery of the object's alarm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AlarmInfo {
    /// How many times this alarm was delivered before and failed.
    pub retry_count: u32,
    /// Whether this delivery is a retry of a failed one.
    pub is_retry: bool,
}

/// Everything an object's capabilities may use of the platform.
///
/// Cloning a context handle (`Rc<dyn Context>`) is one reference-count
/// increment; every capability of an object shares the same one.
pub trait Context {
    /// The object's id.
    fn id(&self) -> &ObjectId;

    /// The object's SQL storage and alarm.
    fn storage(&self) -> &dyn Storage;

    /// Wall-clock milliseconds since the Unix epoch. In tests on paused tokio
    /// time this advances together with [`Context::sleep`].
    fn now_ms(&self) -> EpochMs;

    /// A future that completes after `duration`. Dropping it cancels it.
    fn sleep(&self, duration: Duration) -> LocalBoxFuture<'static, ()>;

    /// Fills `buf` with random bytes (generation ids, jitter). Comes from the
    /// platform because `getrandom` needs a JavaScript backend on wasm.
    fn random_bytes(&self, buf: &mut [u8]);

    /// Runs `task` in the background on the object's thread. It is dropped
    /// when the object is evicted, like an in-memory timer; it does not keep
    /// the object alive.
    fn spawn(&self, task: LocalBoxFuture<'static, ()>);

    /// Runs `task` in the background on the object's thread and keeps the
    /// object alive until it ends: idle eviction waits for it, and shutdown
    /// waits for it up to the host's grace period.
    fn wait_until(&self, task: LocalBoxFuture<'static, ()>);

    /// The CPU time one event of the object (a request, an alarm delivery)
    /// may use before the platform ends it, where the platform sets such a
    /// limit: Cloudflare does (30 s by default), the embedded host does not.
    /// The scheduler hands a long alarm run over to a new alarm well before
    /// it, so a backlog drains over several invocations.
    fn invocation_cpu_limit(&self) -> Option<Duration> {
        None
    }

    /// When the platform event whose CPU budget the object's code now
    /// spends began (the latest request or alarm delivery), where the
    /// platform sets a CPU limit per event ([`Context::invocation_cpu_limit`]).
    /// On Cloudflare each incoming event gives the object a fresh budget,
    /// and in-memory timers that follow it spend that same budget; the
    /// scheduler stops chaining timer runs once they have run for the
    /// alarm handoff since this moment, and leaves the rest to the
    /// physical alarm, a new event. `None` where there is no such limit.
    fn invocation_started_at(&self) -> Option<EpochMs> {
        None
    }
}
