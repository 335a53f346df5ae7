//! The static named targets of a fanout: consumers, which receive batches
//! and settle each message, and storage targets, which get each message
//! written and are acked when the write succeeds.

use std::fmt;
use std::future::Future;
use std::rc::Rc;

use durability_platform::LocalBoxFuture;

use super::message::{FanoutMessage, StoredMessage};
use crate::error::HandlerError;
use crate::retry::MethodPolicy;

/// A consumer's delivery function, type-erased.
pub(crate) type DeliverFn<B> =
    Rc<dyn Fn(Vec<FanoutMessage<B>>) -> LocalBoxFuture<'static, Result<(), HandlerError>>>;

/// A write of one stored message (storage targets and the DLQ), type-erased.
pub(crate) type WriteFn<B> =
    Rc<dyn Fn(StoredMessage<B>) -> LocalBoxFuture<'static, Result<(), HandlerError>>>;

/// Erases a write function of the caller's.
pub(crate) fn erase_write<B, F, Fut>(write: F) -> WriteFn<B>
where
    B: 'static,
    F: Fn(StoredMessage<B>) -> Fut + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + 'static,
{
    Rc::new(move |message| Box::pin(write(message)) as LocalBoxFuture<'static, _>)
}

pub(crate) enum TargetKind<B> {
    Consumer { deliver: DeliverFn<B> },
    Storage { write: WriteFn<B> },
}

/// One named target of a fanout, with optional retry-policy overrides.
///
/// ```
/// use durability::fanout::Target;
/// use durability::retry::MethodPolicy;
/// use durability::HandlerError;
///
/// // A consumer that handles a batch and lets every message it did not
/// // settle be acked when it returns.
/// let inbox = Target::consumer(|batch: Vec<durability::fanout::FanoutMessage<String>>| async move {
///     for message in &batch {
///         let _ = &message.body;
///     }
///     Ok::<_, HandlerError>(())
/// })
/// .ack_on_return(true)
/// .policy(MethodPolicy::new().max_attempts(3));
///
/// // A storage target: each message is written, then acked.
/// let archive = Target::storage(|stored: durability::fanout::StoredMessage<String>| async move {
///     let _ = stored.id; // key the write by it and refuse overwrites
///     Ok::<_, HandlerError>(())
/// });
/// # let _ = (inbox, archive);
/// ```
pub struct Target<B> {
    pub(crate) kind: TargetKind<B>,
    pub(crate) ack_on_return: bool,
    pub(crate) policy: Option<MethodPolicy>,
}

impl<B: 'static> Target<B> {
    /// A consumer: `deliver` receives each batch (at most the fanout's
    /// `max_batch_size` messages, all for this target) and settles each
    /// message. An `Err` retries every message it left unsettled.
    pub fn consumer<F, Fut>(deliver: F) -> Self
    where
        F: Fn(Vec<FanoutMessage<B>>) -> Fut + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + 'static,
    {
        Target {
            kind: TargetKind::Consumer {
                deliver: Rc::new(move |batch| Box::pin(deliver(batch))),
            },
            ack_on_return: false,
            policy: None,
        }
    }

    /// A storage target: every message of a batch is written concurrently
    /// as a [`StoredMessage`] and acked once its write succeeded; a failed
    /// write is retried on its own.
    pub fn storage<F, Fut>(write: F) -> Self
    where
        F: Fn(StoredMessage<B>) -> Fut + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + 'static,
    {
        Target {
            kind: TargetKind::Storage {
                write: erase_write(write),
            },
            ack_on_return: false,
            policy: None,
        }
    }

    /// Consumers only: when `deliver` returns `Ok` in time, ack every
    /// message it left unsettled in one transaction (instead of one per
    /// message). Explicit `retry` and `dead_letter` calls still win.
    /// Setting it on a storage target is a configuration error.
    pub fn ack_on_return(mut self, on: bool) -> Self {
        self.ack_on_return = on;
        self
    }

    /// Overrides the fanout's retry policy for this target, field by field
    /// (`retry_timeouts` does not apply to fanout).
    pub fn policy(mut self, policy: MethodPolicy) -> Self {
        self.policy = Some(policy);
        self
    }
}

impl<B> fmt::Debug for Target<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            TargetKind::Consumer { .. } => "consumer",
            TargetKind::Storage { .. } => "storage",
        };
        f.debug_struct("Target")
            .field("kind", &kind)
            .field("ack_on_return", &self.ack_on_return)
            .field("policy", &self.policy)
            .finish()
    }
}
