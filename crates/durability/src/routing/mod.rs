//! Routing (ref `DurabilityRouting` and its client, §4): on the caller's
//! side, choose one shard (object) among many for each push, call the
//! application's method on it exactly once, and learn from the load
//! snapshot in the reply.
//!
//! On the object's side there is nothing to add: an object counts its work
//! in a [`Load`](crate::Load) that it hands to fanout or the log, and its
//! method returns their result, which carries a [`LoadSnapshot`].
//!
//! ```
//! use std::collections::HashMap;
//! use std::future::Future;
//! use std::sync::{Arc, Mutex};
//! use durability::load::{LoadSnapshot, OutboundProcessing, Processing, LOAD_WINDOW_MS};
//! use durability::routing::{CallContext, RoutingClient, RoutingTarget, ShardCaller};
//!
//! /// Objects that only count what they receive (a real application calls
//! /// a host stub here; see `ShardCaller`).
//! #[derive(Default)]
//! struct Counters(Mutex<HashMap<String, u64>>);
//!
//! #[derive(Debug, thiserror::Error)]
//! #[error("unreachable")]
//! struct Unreachable;
//!
//! impl ShardCaller for Counters {
//!     type Input = u64;
//!     type Output = LoadSnapshot;
//!     type Error = Unreachable;
//!
//!     fn call(&self, target: &RoutingTarget, n: u64, _: &CallContext)
//!         -> impl Future<Output = Result<LoadSnapshot, Unreachable>> + Send
//!     {
//!         let mut counts = self.0.lock().unwrap();
//!         let backlog = counts.entry(target.shard.clone()).or_default();
//!         *backlog += n;
//!         let snapshot = LoadSnapshot {
//!             observed_at: 0,
//!             window_ms: LOAD_WINDOW_MS,
//!             inbound: Processing { in_flight: 0, completed: 1, average_processing_ms: Some(1.0) },
//!             outbound: OutboundProcessing {
//!                 in_flight: 0, completed: 0, average_processing_ms: None,
//!                 pending_deliveries: *backlog,
//!             },
//!         };
//!         std::future::ready(Ok(snapshot))
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let rt = tokio::runtime::Builder::new_current_thread().build()?;
//! # rt.block_on(async {
//! // The default algorithm starts on one shard and widens when a reply
//! // reports a backlog above the soft limit (at most once a second).
//! let client = RoutingClient::builder(Counters::default(), || 0).build()?;
//! let reply = client.push(1_500, CallContext::new()).await?;
//! assert_eq!(reply.outbound.pending_deliveries, 1_500);
//! assert_eq!(client.width(), 2);
//! assert!(client.observations().contains_key("shard-0"));
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! # })?;
//! # Ok(())
//! # }
//! ```
//!
//! What the client promises (§4.7), and how:
//! - **One call per push.** A push calls [`ShardCaller::call`] once, on the
//!   shard it chose, and never retries or switches: an error reaches the
//!   caller as [`RoutingError::Call`] with the caller's error unchanged,
//!   and nothing is recorded from it. A rejection the object returns is a
//!   reply like any other and comes back unchanged.
//! - **Bounded, fresh observations.** The client keeps the newest snapshot
//!   per shard, at most [`MAX_OBSERVED_SHARDS`], and forgets any older than
//!   [`OBSERVATION_TTL_MS`] before sharding sees them. An older reply
//!   never overwrites a newer one.
//! - **Slow width changes.** The default algorithm's width is at least 1,
//!   grows by at most one per [`WIDEN_INTERVAL_MS`] and shrinks by at most
//!   one per [`NARROW_INTERVAL_MS`]. With custom sharding it never changes.
//!
//! Caller layers are tower [`Layer`]s: [`RoutingClient`] is a tower
//! [`Service`] of [`Push`] requests, so a [`ServiceBuilder`] stacks
//! [`ContextLayer`]s (context contributions, shallow-merged) and a
//! [`TimeoutLayer`] (which stops waiting but does not cancel) around it,
//! and any other tower middleware fits too.
//!
//! Sharing: the client is `Send + Sync` and cloning it is one
//! reference-count increment, so the tasks of a multi-threaded runtime can
//! share one. Its observations and width sit behind one `std` mutex, taken
//! twice per push (to choose, to learn) for a few map operations and never
//! across an await or the application's code.
//!
//! Time and randomness come from the caller (a clock closure, a seed), so
//! this module builds for `wasm32-unknown-unknown` like the rest of the
//! crate. Decisions where the reference is silent or that depart from it:
//! - Sharding is synchronous ([`RoutingClientBuilder::sharding`]): I/O
//!   belongs before the push.
//! - Custom sharding reads observations through a view ([`Observations`])
//!   instead of receiving a copy of up to 1,024 snapshots per push.
//! - A reply whose snapshot is already stale is not recorded (the next
//!   push would expire it, after it might have evicted a live entry).
//! - Staleness is judged on the client's clock against the fixed load
//!   window, never against a `window_ms` the reply claims.
//! - [`RoutingClientBuilder::max_width`] can cap the width (the reference
//!   has no cap; the default has none either).
//! - Context is a JSON object ([`CallContext`]); by construction it is
//!   never an array or a primitive, so the reference's `TypeError` and its
//!   "unknown routing method" check cannot occur.

mod adaptive;
mod caller;
mod context;
mod error;
mod layers;
mod observations;
mod sharding;

pub use adaptive::{
    DEFAULT_SOFT_BACKLOG_LIMIT, NARROW_INTERVAL_MS, SHARD_KEY_PREFIX, WIDEN_INTERVAL_MS, shard_key,
};
pub use caller::{ReportsLoad, ShardCaller};
pub use context::{CallContext, ContextNotObject};
pub use error::{RoutingError, TimedOut};
pub use layers::{ContextLayer, Push, Timeout, TimeoutFuture, TimeoutLayer, WithContext};
pub use observations::{MAX_OBSERVED_SHARDS, OBSERVATION_TTL_MS, Observations};
pub use sharding::{RoutingTarget, ShardingError};
pub use tower::{Layer, Service, ServiceBuilder, ServiceExt};

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};

use durability_platform::{EpochMs, MAX_SAFE_INTEGER};

use crate::error::ConfigError;
use crate::load::LoadSnapshot;
use adaptive::{Adaptive, Resize};
use observations::{ObservationTable, RoutingState};

/// A clock of epoch milliseconds, shared by the client's pushes.
type Clock = Box<dyn Fn() -> EpochMs + Send + Sync>;

/// A custom sharding function, type-erased.
type ShardingFn<I> = Box<
    dyn Fn(&I, &CallContext, &Observations<'_>) -> Result<RoutingTarget, ShardingError>
        + Send
        + Sync,
>;

/// Chooses a shard per push among the objects `caller` reaches, calls it
/// once, and learns from the reply's load.
///
/// Cloning is one reference-count increment; clones share observations and
/// width. `Send + Sync`: share it across tasks and threads.
pub struct RoutingClient<C: ShardCaller> {
    inner: Arc<Inner<C>>,
}

struct Inner<C: ShardCaller> {
    caller: C,
    clock: Clock,
    /// `None`: the default adaptive algorithm.
    sharding: Option<ShardingFn<C::Input>>,
    /// Observations, and the default algorithm's width (which stays 1 for
    /// ever with custom sharding).
    state: Mutex<RoutingState>,
}

/// Configures a [`RoutingClient`]; every option has a validated default.
pub struct RoutingClientBuilder<C: ShardCaller> {
    caller: C,
    clock: Clock,
    sharding: Option<ShardingFn<C::Input>>,
    soft_backlog_limit: u64,
    max_width: Option<u64>,
    seed: Option<u64>,
}

impl<C: ShardCaller> RoutingClient<C> {
    /// Starts configuring a client that reaches objects through `caller`
    /// and reads time from `clock` (epoch milliseconds; the host's clock on
    /// the embedded host, so paused test time moves it).
    pub fn builder(
        caller: C,
        clock: impl Fn() -> EpochMs + Send + Sync + 'static,
    ) -> RoutingClientBuilder<C> {
        RoutingClientBuilder {
            caller,
            clock: Box::new(clock),
            sharding: None,
            soft_backlog_limit: DEFAULT_SOFT_BACKLOG_LIMIT,
            max_width: None,
            seed: None,
        }
    }

    /// Chooses a shard for `input`, calls it once and returns its reply
    /// unchanged, accepted or rejected.
    ///
    /// `Err` is either definite (sharding refused, or returned an empty
    /// key: no object was called) or uncertain ([`RoutingError::Call`]: the
    /// object may have accepted the input). The client never retries.
    pub async fn push(
        &self,
        input: C::Input,
        context: CallContext,
    ) -> Result<C::Output, RoutingError<C::Error>> {
        let inner = &*self.inner;
        let target = inner.choose(&input, &context, (inner.clock)())?;
        let reply = inner
            .caller
            .call(&target, input, &context)
            .await
            .map_err(|source| RoutingError::Call {
                shard: target.shard.clone(),
                source,
            })?;
        inner.learn(&target.shard, &reply);
        Ok(reply)
    }

    /// Copies of the snapshots held now, by shard key, after forgetting the
    /// stale ones.
    pub fn observations(&self) -> HashMap<String, LoadSnapshot> {
        let now = (self.inner.clock)();
        let mut state = observations::lock(&self.inner.state);
        state.table.expire(now);
        state.table.fresh(now)
    }

    /// How many shards the default algorithm spreads pushes over now
    /// (`shard-0 .. shard-<width-1>`); always 1 with custom sharding.
    pub fn width(&self) -> u64 {
        observations::lock(&self.inner.state).adaptive.width()
    }

    /// The caller the client reaches objects with.
    pub fn caller(&self) -> &C {
        &self.inner.caller
    }
}

impl<C: ShardCaller> Inner<C> {
    fn choose(
        &self,
        input: &C::Input,
        context: &CallContext,
        now: EpochMs,
    ) -> Result<RoutingTarget, RoutingError<C::Error>> {
        let Some(sharding) = &self.sharding else {
            let mut state = observations::lock(&self.state);
            let (a, b) = state.adaptive.candidates();
            state.table.expire(now);
            return Ok(RoutingTarget::new(shard_key(adaptive::choose(
                &state.table,
                a,
                b,
            ))));
        };
        // No lock is held while the application's function runs; the view
        // hides what is stale at `now`, and `learn` expires it for good.
        let view = Observations::new(&self.state, now);
        let target = sharding(input, context, &view).map_err(RoutingError::Sharding)?;
        if target.shard.is_empty() {
            return Err(RoutingError::EmptyShard);
        }
        Ok(target)
    }

    /// Records the reply's snapshot for `shard` and, with the default
    /// algorithm, lets it resize the width.
    fn learn(&self, shard: &str, reply: &C::Output) {
        let Some(snapshot) = reply.load_snapshot() else {
            return;
        };
        let now = (self.clock)();
        let mut state = observations::lock(&self.state);
        state.table.expire(now);
        state.table.record(shard, snapshot, now);
        if self.sharding.is_some() {
            return;
        }
        if let Some(change) = state.adaptive.resize(&snapshot, now) {
            let width = state.adaptive.width();
            drop(state);
            tracing::debug!(
                event = match change {
                    Resize::Widened => "durability.routing.widened",
                    Resize::Narrowed => "durability.routing.narrowed",
                },
                shard,
                width,
                pending_deliveries = snapshot.outbound.pending_deliveries,
                "routing width changed"
            );
        }
    }
}

impl<C: ShardCaller> RoutingClientBuilder<C> {
    /// Replaces the default adaptive algorithm with the application's
    /// choice from (input, context, recent observations): stable keys for
    /// affinity, lanes, tenants. With it the width never changes.
    ///
    /// The function is synchronous on purpose: the choice is a pure
    /// function of what it is given, so nothing sits between reading the
    /// observations and calling the object. Look-ups that need I/O belong
    /// before the push (put their answer in the context).
    ///
    /// ```
    /// # use durability::routing::{CallContext, RoutingClientBuilder, RoutingTarget, ShardCaller, ShardingError};
    /// # fn configure<C: ShardCaller<Input = Vec<String>>>(builder: RoutingClientBuilder<C>) -> RoutingClientBuilder<C> {
    /// builder.sharding(|batch: &Vec<String>, context, _observations| {
    ///     match context.get_str("lane") {
    ///         Some(lane) => Ok(RoutingTarget::new(lane)),
    ///         None => batch
    ///             .first()
    ///             .map(|first| RoutingTarget::new(format!("customer-{first}")))
    ///             .ok_or_else(|| ShardingError::new("an empty batch has no customer")),
    ///     }
    /// })
    /// # }
    /// ```
    pub fn sharding<F>(mut self, sharding: F) -> Self
    where
        F: Fn(&C::Input, &CallContext, &Observations<'_>) -> Result<RoutingTarget, ShardingError>
            + Send
            + Sync
            + 'static,
    {
        self.sharding = Some(Box::new(sharding));
        self
    }

    /// The backlog (`pending_deliveries`) above which a reply widens the
    /// default algorithm; it narrows below a quarter of it. Default 1,000;
    /// a safe integer of at least 1.
    pub fn soft_backlog_limit(mut self, limit: u64) -> Self {
        self.soft_backlog_limit = limit;
        self
    }

    /// The most shards the default algorithm widens to. Default: no limit
    /// (as the reference). At least 1.
    pub fn max_width(mut self, width: u64) -> Self {
        self.max_width = Some(width);
        self
    }

    /// Seeds the two-choice sampling, for reproducible runs. Default: the
    /// clock mixed with a per-process counter, so clients built in the same
    /// millisecond still differ.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Validates the options and builds the client.
    pub fn build(self) -> Result<RoutingClient<C>, ConfigError> {
        if !(1..=MAX_SAFE_INTEGER.unsigned_abs()).contains(&self.soft_backlog_limit) {
            return Err(ConfigError::OutOfRange {
                field: "soft_backlog_limit".into(),
                min: 1,
                max: MAX_SAFE_INTEGER.unsigned_abs(),
            });
        }
        if self.max_width == Some(0) {
            return Err(ConfigError::NotPositive {
                field: "max_width".into(),
            });
        }
        let seed = self.seed.unwrap_or_else(|| default_seed((self.clock)()));
        Ok(RoutingClient {
            inner: Arc::new(Inner {
                caller: self.caller,
                clock: self.clock,
                sharding: self.sharding,
                state: Mutex::new(RoutingState {
                    table: ObservationTable::default(),
                    adaptive: Adaptive::new(self.soft_backlog_limit, self.max_width, seed),
                }),
            }),
        })
    }
}

fn default_seed(now: EpochMs) -> u64 {
    static CLIENTS: AtomicU64 = AtomicU64::new(0);
    let n = CLIENTS.fetch_add(1, Ordering::Relaxed);
    now.unsigned_abs() ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl<C: ShardCaller> Clone for RoutingClient<C> {
    fn clone(&self) -> Self {
        RoutingClient {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<C: ShardCaller> fmt::Debug for RoutingClient<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RoutingClient")
            .field("custom_sharding", &self.inner.sharding.is_some())
            .field("width", &self.width())
            .field(
                "observed_shards",
                &observations::lock(&self.inner.state).table.len(),
            )
            .finish_non_exhaustive()
    }
}

/// A push future of the client as a tower service: boxed, because an
/// `async fn` future has no name.
pub type PushFuture<O, E> = Pin<Box<dyn Future<Output = Result<O, RoutingError<E>>> + Send>>;

/// The client as a tower service, so caller layers stack around it. It is
/// always ready; each call is one [`RoutingClient::push`].
impl<C: ShardCaller> Service<Push<C::Input>> for RoutingClient<C> {
    type Response = C::Output;
    type Error = RoutingError<C::Error>;
    type Future = PushFuture<C::Output, C::Error>;

    fn poll_ready(&mut self, _: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, push: Push<C::Input>) -> Self::Future {
        let client = self.clone();
        Box::pin(async move { client.push(push.input, push.context).await })
    }
}
