//! The caller-local context of a push: a JSON object that sharding reads
//! (`lane`, `tenant`, ...) and that layers add fields to by shallow merge.
//!
//! Context is untrusted caller metadata. The routing client never persists
//! it and never sends it to consumers; a [`ShardCaller`](super::ShardCaller)
//! may pass it to the object, and the object must not use it for identity
//! or authorization.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use thiserror::Error;

/// The context of one push: a JSON object, shallow-merged by layers.
///
/// ```
/// use durability::routing::CallContext;
///
/// let mut context = CallContext::new().with("lane", "bulk").with("tenant", "acme");
/// // A layer's contribution wins over what the caller passed, field by field;
/// // nested objects are replaced, never merged.
/// context.merge(&CallContext::new().with("lane", "vip"));
/// assert_eq!(context.get_str("lane"), Some("vip"));
/// assert_eq!(context.get_str("tenant"), Some("acme"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CallContext(Map<String, Value>);

/// A context built from JSON that is not an object (the reference's
/// `TypeError`: the context must be a plain, non-array object).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("routing context must be a JSON object, got {found}")]
pub struct ContextNotObject {
    /// The JSON type that was given instead.
    pub found: &'static str,
}

impl CallContext {
    /// An empty context.
    pub fn new() -> Self {
        CallContext(Map::new())
    }

    /// This context with `key` set to `value`.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<Value>) -> Self {
        self.insert(key, value);
        self
    }

    /// Sets `key` to `value`, replacing what was there.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<Value>) {
        self.0.insert(key.into(), value.into());
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key)
    }

    /// The value of `key` when it is a string.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(Value::as_str)
    }

    /// Shallow merge: every top-level field of `contribution` replaces the
    /// field of the same name here (`{...self, ...contribution}`).
    pub fn merge(&mut self, contribution: &CallContext) {
        for (key, value) in &contribution.0 {
            self.0.insert(key.clone(), value.clone());
        }
    }

    /// Whether no field is set.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The fields.
    pub fn as_map(&self) -> &Map<String, Value> {
        &self.0
    }

    /// The fields, owned.
    pub fn into_map(self) -> Map<String, Value> {
        self.0
    }
}

impl From<Map<String, Value>> for CallContext {
    fn from(map: Map<String, Value>) -> Self {
        CallContext(map)
    }
}

impl TryFrom<Value> for CallContext {
    type Error = ContextNotObject;

    /// An object becomes the context; `null` the empty context (an absent
    /// context); anything else is refused.
    fn try_from(value: Value) -> Result<Self, Self::Error> {
        match value {
            Value::Object(map) => Ok(CallContext(map)),
            Value::Null => Ok(CallContext::new()),
            Value::Array(_) => Err(ContextNotObject { found: "an array" }),
            Value::Bool(_) => Err(ContextNotObject { found: "a boolean" }),
            Value::Number(_) => Err(ContextNotObject { found: "a number" }),
            Value::String(_) => Err(ContextNotObject { found: "a string" }),
        }
    }
}
