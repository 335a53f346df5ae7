//! The abort signal handed to every attempt.
//!
//! An attempt's signal aborts at its timeout (the reason is the timeout
//! error) or when a purge removes its record, never otherwise. Aborting asks
//! the handler to stop; it cannot force it. A handler that ignores its signal
//! keeps its permit until it really ends, so no retry of the same record can
//! overlap it in this instance.

use std::cell::RefCell;
use std::rc::Rc;

use tokio::sync::Notify;

use crate::error::HandlerError;

/// Tells a running handler that its attempt was abandoned.
///
/// Cloning is one reference-count increment; every clone sees the same abort.
///
/// A handler that can stop early selects on [`AbortSignal::aborted`]:
///
/// ```
/// # use durability::AbortSignal;
/// async fn handler(signal: AbortSignal) -> Result<(), durability::HandlerError> {
///     let work = async { /* the real work */ };
///     futures::pin_mut!(work);
///     let stop = signal.aborted();
///     futures::pin_mut!(stop);
///     match futures::future::select(work, stop).await {
///         futures::future::Either::Left(_) => Ok(()),
///         futures::future::Either::Right(_) => Err(signal.reason().unwrap_or_else(|| durability::HandlerError::new("aborted"))),
///     }
/// }
/// # let _ = handler;
/// ```
#[derive(Clone, Default)]
pub struct AbortSignal {
    inner: Rc<Inner>,
}

#[derive(Default)]
struct Inner {
    reason: RefCell<Option<HandlerError>>,
    notify: Notify,
}

impl AbortSignal {
    /// A signal that has not aborted.
    pub fn new() -> Self {
        AbortSignal::default()
    }

    /// Whether the attempt was abandoned.
    pub fn is_aborted(&self) -> bool {
        self.inner.reason.borrow().is_some()
    }

    /// Why the attempt was abandoned, once it was.
    pub fn reason(&self) -> Option<HandlerError> {
        self.inner.reason.borrow().clone()
    }

    /// Resolves when the signal aborts (at once if it already did). Select
    /// on it beside the handler's own work to stop early.
    pub async fn aborted(&self) {
        loop {
            // Register interest before checking, so an abort between the
            // check and the await cannot be missed.
            let notified = self.inner.notify.notified();
            if self.is_aborted() {
                return;
            }
            notified.await;
        }
    }

    /// Aborts with `reason`. Only the first abort counts.
    pub(crate) fn abort(&self, reason: HandlerError) {
        {
            let mut slot = self.inner.reason.borrow_mut();
            if slot.is_some() {
                return;
            }
            *slot = Some(reason);
        }
        self.inner.notify.notify_waiters();
    }
}

impl std::fmt::Debug for AbortSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortSignal")
            .field("aborted", &self.is_aborted())
            .finish()
    }
}
