//! The host clock: wall-clock milliseconds that move with tokio's clock.
//!
//! The clock reads the system time once, when the host is built, and adds
//! the elapsed time of `tokio::time::Instant`. On paused tokio time (tests)
//! timers and the milliseconds that records store therefore advance
//! together, and a test can jump a day ahead without a real wait.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use durability_platform::EpochMs;
use tokio::time::Instant;

/// Milliseconds since the Unix epoch by the system clock, for stamps that
/// are not an object's time (a backup's, an archive's).
pub(crate) fn system_now_ms() -> EpochMs {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| EpochMs::try_from(d.as_millis()).unwrap_or(EpochMs::MAX))
        .unwrap_or(0)
}

/// A copyable clock; every object of a host shares the same origin.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    origin_ms: EpochMs,
    origin: Instant,
}

impl Clock {
    /// Starts the clock at `origin_ms`, or at the current system time.
    pub(crate) fn start(origin_ms: Option<EpochMs>) -> Self {
        let origin_ms = origin_ms.unwrap_or_else(system_now_ms);
        Clock {
            origin_ms,
            origin: Instant::now(),
        }
    }

    /// Milliseconds since the Unix epoch.
    pub(crate) fn now_ms(&self) -> EpochMs {
        let elapsed = Instant::now().saturating_duration_since(self.origin);
        self.origin_ms
            .saturating_add(i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX))
    }

    /// The tokio instant at which the clock reads `at_ms`; times before the
    /// origin map to the origin, which is in the past, so they fire at once.
    pub(crate) fn instant_at(&self, at_ms: EpochMs) -> Instant {
        let ahead_ms = at_ms.saturating_sub(self.origin_ms).max(0);
        let ahead = Duration::from_millis(u64::try_from(ahead_ms).unwrap_or(0));
        // checked_add fails only centuries ahead; such an alarm waits "forever".
        self.origin
            .checked_add(ahead)
            .unwrap_or_else(|| self.origin + Duration::from_secs(86_400 * 365 * 30))
    }
}
