//! Counting the host's unfinished work (calls, alarm runs, `wait_until`
//! tasks) across threads, so shutdown can wait for it.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// How much work is unfinished; shared by every executor.
#[derive(Debug, Default)]
pub(crate) struct WorkTracker {
    count: AtomicUsize,
    idle: Notify,
}

/// One unit of unfinished work; dropping it (also by aborting the task that
/// holds it) finishes it.
#[derive(Debug)]
pub(crate) struct WorkGuard(Arc<WorkTracker>);

impl WorkTracker {
    pub(crate) fn begin(self: &Arc<Self>) -> WorkGuard {
        self.count.fetch_add(1, Ordering::SeqCst);
        WorkGuard(Arc::clone(self))
    }

    /// Waits until no work is unfinished.
    pub(crate) async fn idle(&self) {
        loop {
            let mut notified = pin!(self.idle.notified());
            // Registered before the check, so a finish between the check
            // and the await still wakes us.
            notified.as_mut().enable();
            if self.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for WorkGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}
