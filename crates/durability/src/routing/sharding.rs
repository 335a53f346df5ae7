//! What custom sharding returns: the one shard a push goes to, or a
//! refusal.

use std::fmt;

use thiserror::Error;

/// Where one push goes: the shard key (the object's name) and an optional
/// location hint, which only influences where the platform first creates
/// the object (the embedded host has one location and ignores it).
///
/// ```
/// use durability::routing::RoutingTarget;
///
/// let target = RoutingTarget::from("customer-42").location_hint("weur");
/// assert_eq!(target.shard, "customer-42");
/// assert_eq!(target.location_hint.as_deref(), Some("weur"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RoutingTarget {
    /// The shard key: the name of the object the push is sent to. Never
    /// empty once the client accepted it.
    pub shard: String,
    /// Where the object should be created if it does not exist yet.
    pub location_hint: Option<String>,
}

impl RoutingTarget {
    /// A target with no location hint.
    pub fn new(shard: impl Into<String>) -> Self {
        RoutingTarget {
            shard: shard.into(),
            location_hint: None,
        }
    }

    /// This target with a location hint.
    pub fn location_hint(mut self, hint: impl Into<String>) -> Self {
        self.location_hint = Some(hint.into());
        self
    }
}

impl From<String> for RoutingTarget {
    fn from(shard: String) -> Self {
        RoutingTarget::new(shard)
    }
}

impl From<&str> for RoutingTarget {
    fn from(shard: &str) -> Self {
        RoutingTarget::new(shard)
    }
}

impl fmt::Display for RoutingTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shard)
    }
}

/// A sharding function's refusal to place a push (an input it cannot key,
/// a lane it does not know). The push calls no object.
#[derive(Debug, Error)]
#[error("{message}")]
pub struct ShardingError {
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl ShardingError {
    /// A refusal with this message.
    pub fn new(message: impl Into<String>) -> Self {
        ShardingError {
            message: message.into(),
            source: None,
        }
    }

    /// A refusal caused by `source`.
    pub fn caused_by(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        ShardingError {
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }
}
