//! Lifecycle events (§5): what happened to a record, told to the user's
//! hooks after it committed.
//!
//! Events are best effort and not a journal: a crash after a commit loses
//! the event, and work re-run after a crash emits its events again. A hook
//! can never change state or the caller's control flow: each hook runs on its
//! own, a returned future is handed to
//! [`durability_platform::Context::wait_until`], and a
//! failing hook is only logged (`durability.lifecycle_hook.failed`).
//!
//! Serialized, an event has the reference library's camelCase shape, so it
//! can be forwarded to the same telemetry:
//!
//! ```
//! use durability::lifecycle::{Entity, LifecycleEvent};
//!
//! let event = LifecycleEvent::AttemptStarted {
//!     entity: Entity::NamedAlarm { alarm: "daily".into(), generation: "g1".into() },
//!     timestamp: 1_000,
//!     attempt: 1,
//! };
//! assert_eq!(
//!     serde_json::to_string(&event).unwrap(),
//!     r#"{"entityKind":"named_alarm","alarm":"daily","id":"daily","generation":"g1","type":"attempt_started","timestamp":1000,"attempt":1}"#
//! );
//! ```

use std::cell::{Cell, RefCell};
use std::fmt;
use std::future::Future;
use std::rc::{Rc, Weak};

use durability_platform::{Context, EpochMs, LocalBoxFuture};
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use serde_json::Value;

use crate::error::{HandlerError, SerializedError};

/// The kind of record an event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EntityKind {
    /// A durable operation (`durability_calls`).
    Operation,
    /// A named alarm (`durability_alarms`).
    NamedAlarm,
    /// One target's delivery of a fanout message.
    FanoutDelivery,
}

impl EntityKind {
    /// The serialized name: `operation`, `named_alarm` or `fanout_delivery`.
    pub fn as_str(self) -> &'static str {
        match self {
            EntityKind::Operation => "operation",
            EntityKind::NamedAlarm => "named_alarm",
            EntityKind::FanoutDelivery => "fanout_delivery",
        }
    }
}

impl fmt::Display for EntityKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The record an event is about, with the generation the event concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entity {
    /// An operation registration.
    Operation {
        operation: String,
        id: String,
        generation: String,
    },
    /// One occurrence of a named alarm; its id is its name.
    NamedAlarm { alarm: String, generation: String },
    /// A fanout message's delivery to one target.
    FanoutDelivery {
        id: String,
        target: String,
        generation: String,
    },
}

impl Entity {
    /// The kind of record.
    pub fn kind(&self) -> EntityKind {
        match self {
            Entity::Operation { .. } => EntityKind::Operation,
            Entity::NamedAlarm { .. } => EntityKind::NamedAlarm,
            Entity::FanoutDelivery { .. } => EntityKind::FanoutDelivery,
        }
    }

    /// The record's id (the alarm's name for named alarms).
    pub fn id(&self) -> &str {
        match self {
            Entity::Operation { id, .. } | Entity::FanoutDelivery { id, .. } => id,
            Entity::NamedAlarm { alarm, .. } => alarm,
        }
    }

    /// The generation the event concerns.
    pub fn generation(&self) -> &str {
        match self {
            Entity::Operation { generation, .. }
            | Entity::NamedAlarm { generation, .. }
            | Entity::FanoutDelivery { generation, .. } => generation,
        }
    }

    fn serialize_fields<M: SerializeMap>(&self, map: &mut M) -> Result<(), M::Error> {
        map.serialize_entry("entityKind", &self.kind())?;
        match self {
            Entity::Operation {
                operation,
                id,
                generation,
            } => {
                map.serialize_entry("operation", operation)?;
                map.serialize_entry("id", id)?;
                map.serialize_entry("generation", generation)
            }
            Entity::NamedAlarm { alarm, generation } => {
                map.serialize_entry("alarm", alarm)?;
                map.serialize_entry("id", alarm)?;
                map.serialize_entry("generation", generation)
            }
            Entity::FanoutDelivery {
                id,
                target,
                generation,
            } => {
                map.serialize_entry("id", id)?;
                map.serialize_entry("target", target)?;
                map.serialize_entry("generation", generation)
            }
        }
    }
}

/// How an invoked attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The handler succeeded and the completion committed. `result` is the
    /// handler's result only when the helper was asked to include results
    /// (off by default, to keep results out of telemetry).
    Completed { result: Option<Value> },
    /// The attempt failed and another one is scheduled.
    RetryScheduled {
        error: SerializedError,
        next_attempt_at: EpochMs,
    },
    /// The attempt failed for good.
    Failed { error: SerializedError },
}

/// Why a record ended without its handler being invoked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TerminalReason {
    /// A pending record had no attempts left when it was claimed.
    AttemptsExhausted,
    /// A fanout delivery was dead-lettered.
    DeadLettered,
}

/// One lifecycle event. Emitted only after the state it describes committed.
#[derive(Debug, Clone, PartialEq)]
pub enum LifecycleEvent {
    /// A new operation or fanout delivery row was inserted (not emitted for a
    /// deduplicated registration). `timestamp` is the row's `created_at`.
    Registered { entity: Entity, timestamp: EpochMs },
    /// A named alarm was (re)scheduled. `timestamp` is the row's `created_at`.
    Scheduled {
        entity: Entity,
        timestamp: EpochMs,
        scheduled_time: EpochMs,
    },
    /// An attempt was claimed and its handler is about to run.
    AttemptStarted {
        entity: Entity,
        timestamp: EpochMs,
        attempt: u32,
    },
    /// An invoked attempt's outcome committed.
    AttemptSettled {
        entity: Entity,
        timestamp: EpochMs,
        attempt: u32,
        /// `max(0, timestamp - started_at)`.
        duration_ms: u64,
        outcome: Outcome,
    },
    /// A record ended without invoking its handler.
    Terminal {
        entity: Entity,
        timestamp: EpochMs,
        attempt: u32,
        reason: TerminalReason,
        error: SerializedError,
    },
    /// `purge_before` ran (emitted even when it removed nothing).
    Purged {
        entity_kind: EntityKind,
        timestamp: EpochMs,
        before: EpochMs,
        count: u64,
    },
}

impl LifecycleEvent {
    /// The serialized `type`: `registered`, `scheduled`, `attempt_started`,
    /// `attempt_settled`, `terminal` or `purged`.
    pub fn lifecycle_type(&self) -> &'static str {
        match self {
            LifecycleEvent::Registered { .. } => "registered",
            LifecycleEvent::Scheduled { .. } => "scheduled",
            LifecycleEvent::AttemptStarted { .. } => "attempt_started",
            LifecycleEvent::AttemptSettled { .. } => "attempt_settled",
            LifecycleEvent::Terminal { .. } => "terminal",
            LifecycleEvent::Purged { .. } => "purged",
        }
    }

    /// The record the event is about; `None` for `purged`.
    pub fn entity(&self) -> Option<&Entity> {
        match self {
            LifecycleEvent::Registered { entity, .. }
            | LifecycleEvent::Scheduled { entity, .. }
            | LifecycleEvent::AttemptStarted { entity, .. }
            | LifecycleEvent::AttemptSettled { entity, .. }
            | LifecycleEvent::Terminal { entity, .. } => Some(entity),
            LifecycleEvent::Purged { .. } => None,
        }
    }

    /// The kind of record the event is about.
    pub fn entity_kind(&self) -> EntityKind {
        match self {
            LifecycleEvent::Purged { entity_kind, .. } => *entity_kind,
            other => other.entity().map_or(EntityKind::Operation, Entity::kind),
        }
    }

    /// When the event's state change happened.
    pub fn timestamp(&self) -> EpochMs {
        match self {
            LifecycleEvent::Registered { timestamp, .. }
            | LifecycleEvent::Scheduled { timestamp, .. }
            | LifecycleEvent::AttemptStarted { timestamp, .. }
            | LifecycleEvent::AttemptSettled { timestamp, .. }
            | LifecycleEvent::Terminal { timestamp, .. }
            | LifecycleEvent::Purged { timestamp, .. } => *timestamp,
        }
    }
}

impl Serialize for LifecycleEvent {
    /// The reference library's shape, keys in its order.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        match self {
            LifecycleEvent::Purged {
                entity_kind,
                timestamp,
                before,
                count,
            } => {
                map.serialize_entry("type", self.lifecycle_type())?;
                map.serialize_entry("entityKind", entity_kind)?;
                map.serialize_entry("timestamp", timestamp)?;
                map.serialize_entry("before", before)?;
                map.serialize_entry("count", count)?;
            }
            LifecycleEvent::Registered { entity, timestamp } => {
                entity.serialize_fields(&mut map)?;
                map.serialize_entry("type", self.lifecycle_type())?;
                map.serialize_entry("timestamp", timestamp)?;
                map.serialize_entry("attempt", &0)?;
            }
            LifecycleEvent::Scheduled {
                entity,
                timestamp,
                scheduled_time,
            } => {
                entity.serialize_fields(&mut map)?;
                map.serialize_entry("type", self.lifecycle_type())?;
                map.serialize_entry("timestamp", timestamp)?;
                map.serialize_entry("attempt", &0)?;
                map.serialize_entry("scheduledTime", scheduled_time)?;
            }
            LifecycleEvent::AttemptStarted {
                entity,
                timestamp,
                attempt,
            } => {
                entity.serialize_fields(&mut map)?;
                map.serialize_entry("type", self.lifecycle_type())?;
                map.serialize_entry("timestamp", timestamp)?;
                map.serialize_entry("attempt", attempt)?;
            }
            LifecycleEvent::AttemptSettled {
                entity,
                timestamp,
                attempt,
                duration_ms,
                outcome,
            } => {
                entity.serialize_fields(&mut map)?;
                map.serialize_entry("type", self.lifecycle_type())?;
                map.serialize_entry("timestamp", timestamp)?;
                map.serialize_entry("attempt", attempt)?;
                map.serialize_entry("durationMs", duration_ms)?;
                match outcome {
                    Outcome::Completed { result } => {
                        map.serialize_entry("outcome", "completed")?;
                        if let Some(result) = result {
                            map.serialize_entry("result", result)?;
                        }
                    }
                    Outcome::RetryScheduled {
                        error,
                        next_attempt_at,
                    } => {
                        map.serialize_entry("error", error)?;
                        map.serialize_entry("outcome", "retry_scheduled")?;
                        map.serialize_entry("nextAttemptAt", next_attempt_at)?;
                    }
                    Outcome::Failed { error } => {
                        map.serialize_entry("error", error)?;
                        map.serialize_entry("outcome", "failed")?;
                    }
                }
            }
            LifecycleEvent::Terminal {
                entity,
                timestamp,
                attempt,
                reason,
                error,
            } => {
                entity.serialize_fields(&mut map)?;
                map.serialize_entry("type", self.lifecycle_type())?;
                map.serialize_entry("timestamp", timestamp)?;
                map.serialize_entry("attempt", attempt)?;
                map.serialize_entry("reason", reason)?;
                map.serialize_entry("error", error)?;
            }
        }
        map.end()
    }
}

/// A user's hook. It may return a future for asynchronous work (sending the
/// event elsewhere); the future runs in the background under `wait_until`.
/// An `Err` from the future is logged and otherwise ignored.
pub type LifecycleHook =
    Rc<dyn Fn(&LifecycleEvent) -> Option<LocalBoxFuture<'static, Result<(), HandlerError>>>>;

/// A hook from a synchronous function (logging, counters).
///
/// ```
/// use durability::lifecycle::{sync_hook, LifecycleEvent};
///
/// let hook = sync_hook(|event: &LifecycleEvent| {
///     tracing::info!(event = event.lifecycle_type(), "durability event");
/// });
/// # let _ = hook;
/// ```
pub fn sync_hook(hook: impl Fn(&LifecycleEvent) + 'static) -> LifecycleHook {
    Rc::new(move |event: &LifecycleEvent| {
        hook(event);
        None
    })
}

/// A hook whose work is asynchronous (sending the event elsewhere). The
/// future runs in the background; its `Err` is logged.
pub fn async_hook<F>(hook: impl Fn(&LifecycleEvent) -> F + 'static) -> LifecycleHook
where
    F: Future<Output = Result<(), HandlerError>> + 'static,
{
    Rc::new(move |event: &LifecycleEvent| {
        Some(Box::pin(hook(event)) as LocalBoxFuture<'static, Result<(), HandlerError>>)
    })
}

/// Calls the attached hooks for each event. Cloning is one reference-count
/// increment; clones share the hooks.
#[derive(Clone)]
pub struct Emitter {
    inner: Rc<EmitterInner>,
}

struct EmitterInner {
    ctx: Rc<dyn Context>,
    hooks: RefCell<Vec<(u64, LifecycleHook)>>,
    next_hook_id: Cell<u64>,
}

impl Emitter {
    /// An emitter without hooks, whose hook futures run under `ctx`'s
    /// `wait_until`.
    pub fn new(ctx: Rc<dyn Context>) -> Self {
        Emitter {
            inner: Rc::new(EmitterInner {
                ctx,
                hooks: RefCell::new(Vec::new()),
                next_hook_id: Cell::new(0),
            }),
        }
    }

    /// Attaches `hook` until the returned registration is dropped or
    /// [`HookRegistration::detach`]ed; [`HookRegistration::keep`] attaches it
    /// for the emitter's lifetime.
    #[must_use = "the hook is detached when the registration is dropped; call .keep() to keep it"]
    pub fn add(&self, hook: LifecycleHook) -> HookRegistration {
        let id = self.inner.next_hook_id.get();
        self.inner.next_hook_id.set(id + 1);
        self.inner.hooks.borrow_mut().push((id, hook));
        HookRegistration {
            emitter: Rc::downgrade(&self.inner),
            id,
            keep: false,
        }
    }

    /// Whether any hook is attached (building an event can be skipped if not).
    pub fn has_hooks(&self) -> bool {
        !self.inner.hooks.borrow().is_empty()
    }

    /// Calls every attached hook with `event`. Never fails and never changes
    /// state: a hook's failure is logged and does not stop the other hooks.
    pub fn emit(&self, event: &LifecycleEvent) {
        crate::telemetry::record_event(event);
        // A snapshot, so that a hook may attach or detach hooks (or emit)
        // without finding the list borrowed.
        let hooks: Vec<LifecycleHook> = self
            .inner
            .hooks
            .borrow()
            .iter()
            .map(|(_, hook)| Rc::clone(hook))
            .collect();
        for hook in hooks {
            let Some(work) = hook(event) else { continue };
            let kind = event.entity_kind();
            let lifecycle_type = event.lifecycle_type();
            let entity_id = event
                .entity()
                .map_or_else(|| "durability".to_owned(), |entity| entity.id().to_owned());
            self.inner.ctx.wait_until(Box::pin(async move {
                if let Err(error) = work.await {
                    report_hook_failure(kind, lifecycle_type, &entity_id, &error);
                }
            }));
        }
    }
}

impl fmt::Debug for Emitter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Emitter")
            .field("hooks", &self.inner.hooks.borrow().len())
            .finish()
    }
}

fn report_hook_failure(
    kind: EntityKind,
    lifecycle_type: &str,
    entity_id: &str,
    error: &HandlerError,
) {
    let serialized = error.serialize();
    tracing::error!(
        event = "durability.lifecycle_hook.failed",
        entityKind = kind.as_str(),
        lifecycleType = lifecycle_type,
        entityId = entity_id,
        error.name = %serialized.name,
        error.message = %serialized.message,
        "durability.lifecycle_hook.failed"
    );
}

/// Keeps a hook attached. Dropping it (or calling [`detach`](Self::detach))
/// detaches the hook; events emitted afterwards do not reach it.
#[derive(Debug)]
pub struct HookRegistration {
    emitter: Weak<EmitterInner>,
    id: u64,
    keep: bool,
}

impl HookRegistration {
    /// Detaches the hook now.
    pub fn detach(self) {
        drop(self);
    }

    /// Keeps the hook attached for as long as the emitter lives.
    pub fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for HookRegistration {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        if let Some(inner) = self.emitter.upgrade() {
            inner.hooks.borrow_mut().retain(|(id, _)| *id != self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn operation() -> Entity {
        Entity::Operation {
            operation: "charge".into(),
            id: "c1".into(),
            generation: "g".into(),
        }
    }

    fn to_json(event: &LifecycleEvent) -> String {
        serde_json::to_string(event).unwrap()
    }

    #[test]
    fn events_serialize_to_the_reference_shape() {
        assert_eq!(
            to_json(&LifecycleEvent::Registered {
                entity: operation(),
                timestamp: 5
            }),
            r#"{"entityKind":"operation","operation":"charge","id":"c1","generation":"g","type":"registered","timestamp":5,"attempt":0}"#
        );
        assert_eq!(
            to_json(&LifecycleEvent::Scheduled {
                entity: Entity::NamedAlarm {
                    alarm: "a".into(),
                    generation: "g".into()
                },
                timestamp: 5,
                scheduled_time: 9,
            }),
            r#"{"entityKind":"named_alarm","alarm":"a","id":"a","generation":"g","type":"scheduled","timestamp":5,"attempt":0,"scheduledTime":9}"#
        );
        assert_eq!(
            to_json(&LifecycleEvent::AttemptSettled {
                entity: Entity::FanoutDelivery {
                    id: "m".into(),
                    target: "t".into(),
                    generation: "g".into()
                },
                timestamp: 7,
                attempt: 2,
                duration_ms: 3,
                outcome: Outcome::RetryScheduled {
                    error: SerializedError::new("Error", "busy"),
                    next_attempt_at: 1_007,
                },
            }),
            r#"{"entityKind":"fanout_delivery","id":"m","target":"t","generation":"g","type":"attempt_settled","timestamp":7,"attempt":2,"durationMs":3,"error":{"name":"Error","message":"busy"},"outcome":"retry_scheduled","nextAttemptAt":1007}"#
        );
        assert_eq!(
            to_json(&LifecycleEvent::AttemptSettled {
                entity: operation(),
                timestamp: 7,
                attempt: 1,
                duration_ms: 0,
                outcome: Outcome::Completed {
                    result: Some(json!({"ok": true}))
                },
            }),
            r#"{"entityKind":"operation","operation":"charge","id":"c1","generation":"g","type":"attempt_settled","timestamp":7,"attempt":1,"durationMs":0,"outcome":"completed","result":{"ok":true}}"#
        );
        assert_eq!(
            to_json(&LifecycleEvent::AttemptSettled {
                entity: operation(),
                timestamp: 7,
                attempt: 1,
                duration_ms: 0,
                outcome: Outcome::Completed { result: None },
            }),
            r#"{"entityKind":"operation","operation":"charge","id":"c1","generation":"g","type":"attempt_settled","timestamp":7,"attempt":1,"durationMs":0,"outcome":"completed"}"#
        );
        assert_eq!(
            to_json(&LifecycleEvent::AttemptSettled {
                entity: operation(),
                timestamp: 7,
                attempt: 5,
                duration_ms: 1,
                outcome: Outcome::Failed {
                    error: SerializedError::new("E", "m")
                },
            }),
            r#"{"entityKind":"operation","operation":"charge","id":"c1","generation":"g","type":"attempt_settled","timestamp":7,"attempt":5,"durationMs":1,"error":{"name":"E","message":"m"},"outcome":"failed"}"#
        );
        assert_eq!(
            to_json(&LifecycleEvent::Terminal {
                entity: operation(),
                timestamp: 8,
                attempt: 5,
                reason: TerminalReason::AttemptsExhausted,
                error: SerializedError::new("DurableAttemptsExhaustedError", "x"),
            }),
            r#"{"entityKind":"operation","operation":"charge","id":"c1","generation":"g","type":"terminal","timestamp":8,"attempt":5,"reason":"attempts_exhausted","error":{"name":"DurableAttemptsExhaustedError","message":"x"}}"#
        );
        assert_eq!(
            to_json(&LifecycleEvent::Purged {
                entity_kind: EntityKind::NamedAlarm,
                timestamp: 9,
                before: 4,
                count: 0,
            }),
            r#"{"type":"purged","entityKind":"named_alarm","timestamp":9,"before":4,"count":0}"#
        );
    }

    #[test]
    fn accessors_name_the_entity() {
        let event = LifecycleEvent::AttemptStarted {
            entity: operation(),
            timestamp: 1,
            attempt: 1,
        };
        assert_eq!(event.lifecycle_type(), "attempt_started");
        assert_eq!(event.entity_kind(), EntityKind::Operation);
        assert_eq!(event.entity().map(Entity::id), Some("c1"));
        assert_eq!(event.entity().map(Entity::generation), Some("g"));
        let purged = LifecycleEvent::Purged {
            entity_kind: EntityKind::FanoutDelivery,
            timestamp: 1,
            before: 1,
            count: 1,
        };
        assert_eq!(purged.entity_kind(), EntityKind::FanoutDelivery);
        assert!(purged.entity().is_none());
    }
}
