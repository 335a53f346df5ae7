//! Why a push failed. A rejection the object returned is not here: it is a
//! reply, returned unchanged.

use std::time::Duration;

use thiserror::Error;

use super::ShardingError;

/// Why a push failed. `E` is the [`ShardCaller`](super::ShardCaller)'s error.
///
/// Only [`RoutingError::Call`] and [`RoutingError::TimedOut`] are
/// *uncertain*: the object may have accepted the input. The others called
/// no object.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RoutingError<E> {
    /// Custom sharding returned an empty shard key.
    #[error("Sharding must return a non-empty shard key or {{ shard, locationHint }}")]
    EmptyShard,
    /// Custom sharding refused to place the push.
    #[error("sharding refused the push")]
    Sharding(#[source] ShardingError),
    /// The call to the chosen shard failed. `source` is the caller's error,
    /// unchanged; the client recorded nothing and will not retry.
    #[error("the call to shard \"{shard}\" failed")]
    Call {
        /// The shard the push went to.
        shard: String,
        /// The caller's error.
        #[source]
        source: E,
    },
    /// A [`TimeoutLayer`](super::TimeoutLayer) stopped waiting.
    #[error(transparent)]
    TimedOut(#[from] TimedOut),
}

/// A [`TimeoutLayer`](super::TimeoutLayer) stopped waiting for a push.
///
/// This is not a cancellation: the object keeps running the call it
/// received and may still accept the input. Nothing was recorded from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("the push was not answered within {} ms; the object may still run it", after.as_millis())]
pub struct TimedOut {
    /// How long the layer waited.
    pub after: Duration,
}
