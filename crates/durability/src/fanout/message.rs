//! What targets receive: a [`FanoutMessage`] per delivery for consumers,
//! with its settlement capabilities, and a [`StoredMessage`] for storage
//! targets and the DLQ.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use durability_platform::{EpochMs, LocalBoxFuture};
use futures::FutureExt;
use futures::future::Shared;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::Inner;
use super::batch::SettleState;
use super::error::SettlementError;
use super::outcome::DeadLetterReason;
use crate::error::SerializedError;
use crate::memo::Memo;

/// Why a stored message is a dead letter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// Why it was dead-lettered.
    pub reason: DeadLetterReason,
    /// The last failure, if any (an explicit dead letter on a first attempt
    /// has none).
    pub error: Option<SerializedError>,
}

/// A message as storage targets and the DLQ receive it, and as parked
/// deliveries are listed (§3.18).
///
/// `id` is the *delivery identity*, `["<generation>","<target>"]`: unique
/// per registration and target and stable across attempts. Writers must key
/// entries by it and refuse to overwrite an existing one, which makes a
/// repeated write (after a crash or a timeout) idempotent. To redrive an
/// entry, enqueue its body with `id = message_id`, the deduplication key
/// `id` and the single target `target`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredMessage<B> {
    /// The delivery identity (the DLQ entry's key).
    pub id: String,
    /// The message id consumers saw.
    pub message_id: String,
    /// The target the delivery was for.
    pub target: String,
    /// The message body.
    pub body: B,
    /// When the message was accepted (epoch ms).
    pub enqueued_at: EpochMs,
    /// Storage targets: when this write happened. Dead letters: when the
    /// delivery was first dead-lettered (stable across retried writes).
    pub stored_at: EpochMs,
    /// Attempts made so far.
    pub attempts: u32,
    /// Present on dead letters only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
}

/// A settlement that has already started: unlike most Rust futures it is
/// **eager**. The call that returned it (`ack`, `retry`, `retry_after`,
/// `dead_letter`) has already claimed the message's one settlement and
/// started the commit; dropping a `Settling` unawaited does not cancel it,
/// it only throws away the outcome. Awaiting it gives that outcome
/// (a rejection, or a storage failure after which the message is retried).
/// Cloning shares it.
///
/// Why eager: the first settlement call is binding at the moment it is
/// made (the reference library's rule, and what a consumer that settles
/// some messages and returns relies on: with `ack_on_return`, everything
/// not settled *by a call* is acked on return). A lazy settlement dropped
/// unawaited would silently turn an explicit `dead_letter` into an ack.
///
/// The eagerness cannot go unnoticed: the type and the calls are
/// `#[must_use]`, so `message.ack();` warns; write
/// `message.ack().await?` (or `drop(message.ack());` to settle without
/// learning the outcome, on purpose).
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// fn settle(message: &durability::fanout::FanoutMessage<String>) {
///     message.ack(); // warns: the outcome of an eager settlement is dropped
/// }
/// ```
///
/// ```
/// #![deny(unused_must_use)]
/// fn settle(message: &durability::fanout::FanoutMessage<String>) {
///     drop(message.ack()); // settles; the outcome is ignored on purpose
/// }
/// ```
#[derive(Clone)]
#[must_use = "the settlement has already started (it is eager); await it to learn whether it was accepted, or `drop` it to ignore the outcome on purpose"]
pub struct Settling(Shared<LocalBoxFuture<'static, Result<(), SettlementError>>>);

impl Settling {
    pub(crate) fn new(
        shared: Shared<LocalBoxFuture<'static, Result<(), SettlementError>>>,
    ) -> Self {
        Settling(shared)
    }

    pub(crate) fn rejected(error: SettlementError) -> Self {
        let ready: LocalBoxFuture<'static, Result<(), SettlementError>> =
            Box::pin(std::future::ready(Err(error)));
        Settling(ready.shared())
    }
}

impl Future for Settling {
    type Output = Result<(), SettlementError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        self.0.poll_unpin(cx)
    }
}

impl fmt::Debug for Settling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settling")
            .field("done", &self.0.peek().is_some())
            .finish()
    }
}

/// One message of a batch, as a consumer target receives it, with the
/// capability to settle it.
///
/// The first settlement call (`ack`, `retry`, `retry_after`, `dead_letter`)
/// is binding; a second one, or any call after the consumer returned or the
/// batch timed out, is rejected with [`SettlementError`]. A message the
/// consumer leaves unsettled is retried, unless the target acks on return.
///
/// Settlement calls are eager: the call itself settles, and the returned
/// [`Settling`] only reports the outcome (see there for why).
pub struct FanoutMessage<B> {
    /// The message id (given at enqueue, or generated).
    pub id: String,
    /// The delivery identity `["<generation>","<target>"]`: the id a DLQ
    /// entry of this delivery gets.
    pub delivery_id: String,
    /// The target delivering it.
    pub target: String,
    /// The message body.
    pub body: B,
    /// This attempt, from 1.
    pub attempt: u32,
    /// When the message was accepted (epoch ms).
    pub enqueued_at: EpochMs,
    /// Persists a step's result for this message and target, so a retried
    /// delivery reuses it; deleted when the delivery is settled for good.
    pub memo: Memo,
    /// The producer's trace context captured at enqueue (see
    /// [`crate::trace`]), to continue its trace; `None` without a capture.
    pub trace_context: Option<String>,
    pub(crate) state: Rc<SettleState>,
    pub(crate) fanout: Rc<Inner<B>>,
}

impl<B> FanoutMessage<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// Marks the message delivered, in one transaction.
    #[must_use = "the settlement has already started; await it to learn its outcome"]
    pub fn ack(&self) -> Settling {
        self.fanout.ack(&self.state)
    }

    /// Asks for another delivery after the target's retry delay (or a dead
    /// letter when the attempts are used up).
    #[must_use = "the settlement has already started; await it to learn its outcome"]
    pub fn retry(&self) -> Settling {
        self.fanout.retry(&self.state, None)
    }

    /// Asks for another delivery after `delay` (whole milliseconds; zero is
    /// due at once, still behind first deliveries). A delay whose due time
    /// is beyond 2^53 - 1 ms is rejected and leaves the message unsettled.
    #[must_use = "the settlement has already started; await it to learn its outcome"]
    pub fn retry_after(&self, delay: Duration) -> Settling {
        self.fanout.retry(&self.state, Some(delay))
    }

    /// Stops delivering this message to this target: it goes to the DLQ,
    /// or is parked when the fanout has none.
    #[must_use = "the settlement has already started; await it to learn its outcome"]
    pub fn dead_letter(&self) -> Settling {
        self.fanout.dead_letter(&self.state)
    }
}

impl<B: fmt::Debug> fmt::Debug for FanoutMessage<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FanoutMessage")
            .field("id", &self.id)
            .field("delivery_id", &self.delivery_id)
            .field("target", &self.target)
            .field("body", &self.body)
            .field("attempt", &self.attempt)
            .field("enqueued_at", &self.enqueued_at)
            .finish_non_exhaustive()
    }
}
