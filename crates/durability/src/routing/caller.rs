//! How the client reaches an object: [`ShardCaller`], which the application
//! implements over its platform's stubs, and [`ReportsLoad`], how the
//! client finds the load snapshot in a reply.
//!
//! The client does not know the host (capabilities and hosts never import
//! each other): an application, an example or a test writes the few lines
//! that turn a shard key into a stub call.

use std::future::Future;

use super::{CallContext, RoutingTarget};
use crate::fanout::EnqueueResult;
use crate::load::LoadSnapshot;
use crate::log::Appended;

/// Calls the application's method on the object named by a shard key.
///
/// The client calls it exactly once per push and never retries it. On the
/// embedded host an implementation is a stub call:
///
/// ```
/// use std::future::Future;
/// use std::rc::Rc;
/// use durability::fanout::{EnqueueOptions, EnqueueResult, Fanout, FanoutError, FanoutInput};
/// use durability::routing::{CallContext, RoutingTarget, ShardCaller};
/// use durability_host::{CallError, DurableObject, HostError, Namespace};
///
/// struct Mailbox {
///     fanout: Fanout<String>,
/// }
/// impl DurableObject for Mailbox {}
///
/// impl Mailbox {
///     // The application's method: what one push runs on the object.
///     async fn push(&self, batch: Vec<String>) -> Result<EnqueueResult<Vec<String>>, FanoutError> {
///         let batch = batch.into_iter().map(FanoutInput::new).collect();
///         self.fanout.enqueue(batch, &EnqueueOptions::all()).await
///     }
/// }
///
/// #[derive(Debug, thiserror::Error)]
/// enum MailboxError {
///     #[error("bad object name")]
///     Name(#[from] HostError),
///     #[error("the call did not complete")]
///     Call(#[from] CallError),
///     #[error("the mailbox failed")]
///     Fanout(#[from] FanoutError),
/// }
///
/// struct Mailboxes(Namespace<Mailbox>);
///
/// impl ShardCaller for Mailboxes {
///     type Input = Vec<String>;
///     type Output = EnqueueResult<Vec<String>>;
///     type Error = MailboxError;
///
///     fn call(&self, target: &RoutingTarget, batch: Vec<String>, _: &CallContext)
///         -> impl Future<Output = Result<Self::Output, MailboxError>> + Send
///     {
///         let stub = self.0.stub(&target.shard);
///         async move {
///             let stub = stub?;
///             Ok(stub.call(move |mailbox: Rc<Mailbox>| async move { mailbox.push(batch).await })
///                 .await??)
///         }
///     }
/// }
/// ```
///
/// The future must be `Send`, so the client can be shared by the tasks of a
/// multi-threaded runtime (the host's `Stub::call` future is). A platform
/// whose futures are not `Send` (a Worker on `wasm32`, which runs on one
/// thread) wraps them, e.g. with `worker::send::SendFuture`.
///
/// **Pushing to the object you are in.** A caller never captures a
/// capability (`Fanout`, `Log`: not `Send`); it always goes through the
/// platform's stub, also when the shard is the object whose code is
/// running the client. On the embedded host that works as is: the stub
/// call runs on the same object, interleaved at awaits like any other
/// call, so a dead letter can be redriven into the fanout it came from
/// through the same client that routes everything else (tested in
/// `tests/api_points.rs`). Code that knows it wants the current object
/// needs no client at all: call the capability directly.
pub trait ShardCaller: Send + Sync + 'static {
    /// What a push carries to the object.
    type Input: Send + 'static;
    /// The object's reply, returned to the pusher unchanged.
    type Output: ReportsLoad + Send + 'static;
    /// Why a call failed: the call may or may not have run on the object.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Calls the object `target.shard` (created where `target.location_hint`
    /// says, if the platform honours hints) with `input`. `context` is
    /// caller-local metadata; pass it on only if the object wants it.
    fn call(
        &self,
        target: &RoutingTarget,
        input: Self::Input,
        context: &CallContext,
    ) -> impl Future<Output = Result<Self::Output, Self::Error>> + Send;
}

/// A reply that carries the object's load: what the client learns from.
/// A reply without one (`None`) teaches the client nothing and is still
/// returned.
pub trait ReportsLoad {
    /// The snapshot the object took when it answered.
    fn load_snapshot(&self) -> Option<LoadSnapshot>;
}

impl ReportsLoad for LoadSnapshot {
    fn load_snapshot(&self) -> Option<LoadSnapshot> {
        Some(*self)
    }
}

impl<T> ReportsLoad for EnqueueResult<T> {
    fn load_snapshot(&self) -> Option<LoadSnapshot> {
        Some(*self.load())
    }
}

impl ReportsLoad for Appended {
    fn load_snapshot(&self) -> Option<LoadSnapshot> {
        Some(*self.load())
    }
}

impl<T> ReportsLoad for (T, LoadSnapshot) {
    fn load_snapshot(&self) -> Option<LoadSnapshot> {
        Some(self.1)
    }
}

impl<T> ReportsLoad for (T, Option<LoadSnapshot>) {
    fn load_snapshot(&self) -> Option<LoadSnapshot> {
        self.1
    }
}

impl<T: ReportsLoad> ReportsLoad for Option<T> {
    fn load_snapshot(&self) -> Option<LoadSnapshot> {
        self.as_ref().and_then(ReportsLoad::load_snapshot)
    }
}
