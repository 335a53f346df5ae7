//! Fanout (ref `DurabilityFanout`): atomically accept a batch of messages,
//! freeze each message's set of named targets, and deliver to each target
//! independently, at least once, with per-target ack, retry and dead
//! letter, durable dead-letter intent, and redrive.
//!
//! A work queue, not a log: a (message, target) delivery row is deleted once
//! it is settled, and a message's manifest once all its deliveries are.
//!
//! ```no_run
//! use std::rc::Rc;
//! use durability::fanout::{EnqueueOptions, Fanout, FanoutInput, FanoutMessage, StoredMessage, Target};
//! use durability::{HandlerError, Scheduler};
//!
//! # async fn demo(ctx: Rc<dyn durability_platform::Context>) -> Result<(), Box<dyn std::error::Error>> {
//! let scheduler = Scheduler::new(ctx)?;
//! let mail = Fanout::<String>::builder(&scheduler)
//!     .target("inbox", Target::consumer(|batch: Vec<FanoutMessage<String>>| async move {
//!         for message in batch {
//!             // ... hand message.body on, then:
//!             message.ack().await.map_err(|e| HandlerError::new(e.to_string()))?;
//!         }
//!         Ok::<_, HandlerError>(())
//!     }))
//!     .target("archive", Target::storage(|stored: StoredMessage<String>| async move {
//!         // write `stored` under `stored.id`, refusing overwrites
//!         Ok::<_, HandlerError>(())
//!     }))
//!     .build()?;
//!
//! // Durably accepted (not delivered) once this returns `Accepted`.
//! let result = mail
//!     .enqueue(vec![FanoutInput::new("hello".to_owned()).id("m-1")], &EnqueueOptions::all())
//!     .await?;
//! assert!(result.is_accepted());
//! # Ok(()) }
//! ```
//!
//! How it works, and why:
//! - **Acceptance** ([`Fanout::enqueue`]) writes every manifest and delivery
//!   row of the batch, and re-arms the object's alarm, in one transaction.
//!   A definite problem with the input is an [`EnqueueRejection`] with
//!   nothing written; a storage failure is an `Err`, because the commit may
//!   have happened.
//! - **Dispatch** runs one bounded pass per target at a time (`dispatch`):
//!   first deliveries before retries, one transaction to claim the batch
//!   (each claimed row's due time becomes the batch deadline, so a crash
//!   mid-batch brings it back then, its attempt already counted), then one
//!   call of the consumer with the whole batch.
//! - **Settlement** (`settle`) is a compare-and-set on the claimed attempt:
//!   a late or duplicated settlement changes nothing. Unsettled messages are
//!   retried. A dead letter's intent is committed before the DLQ write, so a
//!   crash repeats the write but never redelivers to the consumer.
//!
//! Decisions where the reference is silent, or that depart from it:
//! - **No accepted work is ever dropped.** Without a DLQ the reference drops
//!   a terminal delivery; here it is *parked* in the object's own table
//!   (`durability_fanout_parked`) with its failure, in the same transaction
//!   that removes its delivery row. Parked entries keep no alarm armed (the
//!   table is not scheduler work), and [`Fanout::parked`],
//!   [`Fanout::redrive_parked`], [`Fanout::purge_parked`] list, redrive and
//!   purge them. With a DLQ, the reference behaviour holds.
//! - A consumer's `Err` that is non-retryable
//!   ([`HandlerError::non_retryable`]) dead-letters the messages it left
//!   unsettled at once (reason `exhausted`), as it stops retries everywhere
//!   else in this crate; the reference retries them.
//! - A settlement whose compare-and-set finds the row owned by a newer
//!   attempt is not an error of the pass that finds it (the reference lets
//!   it fail the alarm run): it is logged and the pass goes on.
//! - First deliveries are taken by (due time, sequence), which is sequence
//!   order because first due times grow with the sequence; this lets the
//!   query stop at the batch size instead of walking deliveries that are
//!   not due (see `store`). Retries are taken by sequence, as in the
//!   reference.
//! - A removed target's due rows are postponed [`INFRASTRUCTURE_RETRY`] at
//!   most [`MISSING_TARGET_POSTPONE_BATCH`] per pass (the reference takes a
//!   delivery batch), so removing a target with a large backlog does not
//!   turn the object into a loop of tiny transactions.
//! - Bodies are limited to [`DEFAULT_MAX_BODY_BYTES`] of their own JSON by
//!   default ([`FanoutBuilder::max_body_bytes`]; the stored envelope is not
//!   counted); a larger body is rejected. Ids and keys are limited as in
//!   [`crate::limits`], and one call carries at most
//!   [`FanoutBuilder::max_enqueue_messages`] messages.
//! - A timed-out consumer is not cancelled (it runs on as a background task
//!   of the object, like an RPC that cannot be cancelled); its late
//!   settlement calls are rejected.
//! - Enqueue rejections keep the reference's `name` and message and add
//!   which message or target broke the rule.
//!
//! Owns the `durability_fanout_*` tables; all their SQL is in `store`.

mod dispatch;
mod enqueue;
mod error;
mod message;
mod parked;
mod settle;
mod store;
mod target;

pub use enqueue::{EnqueueOptions, EnqueueResult, FanoutInput};
pub use error::{
    EnqueueRejection, FANOUT_ENQUEUE_ERROR, FANOUT_SETTLEMENT_ERROR, FANOUT_TIMEOUT_ERROR,
    FanoutConfigError, FanoutError, SettlementError,
};
pub use message::{
    DeadLetterReason, Failure, FanoutMessage, SettlementOutcome, Settling, StoredMessage,
};
pub use target::Target;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::rc::Rc;
use std::time::Duration;

use durability_platform::{AlarmInfo, EpochMs, MAX_SAFE_INTEGER, Sql, Storage, StorageError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use crate::error::{ConfigError, DurabilityError, HandlerError};
use crate::lifecycle::{Emitter, Entity, HookRegistration, LifecycleEvent, LifecycleHook};
use crate::limits;
use crate::load::{Load, LoadSnapshot};
use crate::migrations::{
    self, FANOUT_CAPABILITY, FANOUT_MIGRATIONS, MigrationReport, MigrationTarget,
};
use crate::retry::{Delay, Policies, PolicyOptions, whole_millis};
use crate::scheduler::{Engine, Scheduler};
use crate::trace::TraceCapture;
use store::DELIVERIES;
use target::{TargetKind, WriteFn};

/// Default most messages per batch handed to a target.
pub const DEFAULT_MAX_BATCH_SIZE: usize = 10;
/// Default largest body, measured as its own JSON (1 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = crate::limits::DEFAULT_MAX_BODY_BYTES;
/// How long a removed target's due rows, and a dead letter whose DLQ write
/// failed, wait before the next try; also the DLQ write's deadline.
pub const INFRASTRUCTURE_RETRY: Duration = Duration::from_millis(60_000);
/// Most due rows of a removed target postponed by one pass.
pub const MISSING_TARGET_POSTPONE_BATCH: usize = 1_000;

const INFRASTRUCTURE_RETRY_MS: EpochMs = 60_000;

/// Configures a [`Fanout`]; every option has a validated default.
pub struct FanoutBuilder<B> {
    scheduler: Scheduler,
    targets: Vec<(String, Target<B>)>,
    policy: PolicyOptions,
    attempt_timeout: Option<Duration>,
    dlq: Option<WriteFn<B>>,
    max_batch_size: usize,
    batch_delay: Duration,
    max_body_bytes: usize,
    max_enqueue_messages: usize,
    routing: Option<Load>,
    hooks: Vec<LifecycleHook>,
    trace: Option<TraceCapture>,
}

impl<B> FanoutBuilder<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// Adds the static target `id`. Ids are fixed for the object's life:
    /// a message's targets are frozen when it is accepted, and a target
    /// removed from a later configuration keeps its rows, paused, until it
    /// is configured again.
    pub fn target(mut self, id: impl Into<String>, target: Target<B>) -> Self {
        self.targets.push((id.into(), target));
        self
    }

    /// Where terminal deliveries go: a write of the [`StoredMessage`] with
    /// its failure, retried every minute until it succeeds, never
    /// redelivered to the consumer. Without a DLQ, terminal deliveries are
    /// parked in the object's own table.
    pub fn dlq<F, Fut>(mut self, write: F) -> Self
    where
        F: Fn(StoredMessage<B>) -> Fut + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + 'static,
    {
        self.dlq = Some(target::erase_write(write));
        self
    }

    /// Most messages per batch handed to a target. Default 10; at least 1.
    pub fn max_batch_size(mut self, size: usize) -> Self {
        self.max_batch_size = size;
        self
    }

    /// Holds first deliveries until the next multiple of `delay` since the
    /// epoch, so messages accepted in the same window share a batch.
    /// Default 0 (deliver at once); whole milliseconds, at most 2^53 - 1.
    pub fn batch_delay(mut self, delay: Duration) -> Self {
        self.batch_delay = delay;
        self
    }

    /// Largest body accepted, measured as the body's own JSON (what
    /// `serde_json::to_string` writes for it). Default 1 MiB; from 1 byte
    /// to 32 MiB ([`MAX_BODY_BYTES_LIMIT`](crate::limits::MAX_BODY_BYTES_LIMIT)).
    /// A larger body rejects its whole batch.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// Most messages one [`Fanout::enqueue`] (or parked ids one
    /// [`Fanout::redrive_parked`]) may carry: each call is one transaction.
    /// Default 1,000; from 1 to 100,000
    /// ([`MAX_ITEMS_PER_CALL_LIMIT`](crate::limits::MAX_ITEMS_PER_CALL_LIMIT)).
    /// A larger call is rejected whole.
    pub fn max_enqueue_messages(mut self, messages: usize) -> Self {
        self.max_enqueue_messages = messages;
        self
    }

    /// Attempts per delivery, the first included. Default 5.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.policy = self.policy.max_attempts(attempts);
        self
    }

    /// How long a target has for one batch (its call and the settlements
    /// it starts). Default 5 min; whole milliseconds, from 1 ms to
    /// 2^31 - 1 ms.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// The delay before each retry. Default: equal jitter over exponential
    /// backoff from 1 s up to 5 min.
    pub fn retry_delay(mut self, delay: Delay) -> Self {
        self.policy = self.policy.delay(delay);
        self
    }

    /// Counts this fanout's work in `load`, shared with other capabilities
    /// (their numbers add up). Default: a private one.
    pub fn routing(mut self, load: Load) -> Self {
        self.routing = Some(load);
        self
    }

    /// Adds a lifecycle hook (best effort, never changes state).
    pub fn on_lifecycle_event(mut self, hook: LifecycleHook) -> Self {
        self.hooks.push(hook);
        self
    }

    /// Captures the producer's trace context when messages are accepted
    /// (enqueue, redrive) and hands it to every delivery of them (see
    /// [`crate::trace`]). Default: none.
    pub fn trace_context(mut self, capture: TraceCapture) -> Self {
        self.trace = Some(capture);
        self
    }

    /// Validates the options, migrates the schema and attaches to the
    /// scheduler (one fanout per scheduler).
    pub fn build(self) -> Result<Fanout<B>, FanoutConfigError> {
        limits::check_setting(
            "max_batch_size",
            self.max_batch_size,
            limits::MAX_ITEMS_PER_CALL_LIMIT,
        )?;
        let batch_delay_ms = i64::try_from(whole_millis("batch_delay", self.batch_delay)?)
            .ok()
            .filter(|ms| *ms <= MAX_SAFE_INTEGER)
            .ok_or_else(|| ConfigError::OutOfRange {
                field: "batch_delay".into(),
                min: 0,
                max: MAX_SAFE_INTEGER.unsigned_abs(),
            })?;
        limits::check_setting(
            "max_body_bytes",
            self.max_body_bytes,
            limits::MAX_BODY_BYTES_LIMIT,
        )?;
        limits::check_setting(
            "max_enqueue_messages",
            self.max_enqueue_messages,
            limits::MAX_ITEMS_PER_CALL_LIMIT,
        )?;
        if self.targets.is_empty() {
            return Err(FanoutConfigError::NoTargets);
        }
        let mut policy = self.policy;
        if let Some(timeout) = self.attempt_timeout {
            policy = policy.attempt_timeout_ms(whole_millis("attempt_timeout", timeout)?);
        }
        let mut targets = HashMap::with_capacity(self.targets.len());
        for (id, target) in self.targets {
            if id.is_empty() {
                return Err(FanoutConfigError::InvalidTarget {
                    id,
                    rule: "a target id must be a non-empty string",
                });
            }
            if id.len() > limits::MAX_ID_BYTES {
                return Err(FanoutConfigError::InvalidTarget {
                    id,
                    rule: "a target id must be at most 1024 bytes (MAX_ID_BYTES)",
                });
            }
            if target.ack_on_return && matches!(target.kind, TargetKind::Storage { .. }) {
                return Err(FanoutConfigError::InvalidTarget {
                    id,
                    rule: "ack_on_return applies to consumer targets only",
                });
            }
            if let Some(overrides) = &target.policy {
                policy = policy.method(id.clone(), overrides.clone());
            }
            if targets.contains_key(&id) {
                return Err(FanoutConfigError::InvalidTarget {
                    id,
                    rule: "the id is configured twice",
                });
            }
            targets.insert(id, target);
        }
        let policies = policy.validate_as("attempt_timeout", "retry_delay")?;
        let engine = Rc::clone(&self.scheduler.engine);
        let emitter = engine.prepare_records(FANOUT_CAPABILITY, FANOUT_MIGRATIONS, self.hooks)?;
        let routing = self
            .routing
            .unwrap_or_else(|| Load::for_context(&engine.ctx));
        let inner = Rc::new(Inner {
            engine: Rc::clone(&engine),
            targets,
            policies,
            dlq: self.dlq,
            max_batch_size: self.max_batch_size,
            batch_delay_ms,
            max_body_bytes: self.max_body_bytes,
            max_enqueue_messages: self.max_enqueue_messages,
            routing,
            emitter,
            running: RefCell::new(HashMap::new()),
            pending: Cell::new(None),
            trace: self.trace,
        });
        engine.register(&inner)?;
        Ok(Fanout { inner })
    }
}

/// Fanout on one object. Cloning is one reference-count increment.
///
/// The object must delegate its `alarm()` to the scheduler the fanout is
/// attached to (or to [`Fanout::alarm`]): that is how delivery resumes
/// after a restart.
pub struct Fanout<B> {
    inner: Rc<Inner<B>>,
}

impl<B> Clone for Fanout<B> {
    fn clone(&self) -> Self {
        Fanout {
            inner: Rc::clone(&self.inner),
        }
    }
}

impl<B> fmt::Debug for Fanout<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut targets: Vec<&String> = self.inner.targets.keys().collect();
        targets.sort();
        f.debug_struct("Fanout")
            .field("targets", &targets)
            .field("dlq", &self.inner.dlq.is_some())
            .field("max_batch_size", &self.inner.max_batch_size)
            .field("batch_delay_ms", &self.inner.batch_delay_ms)
            .finish_non_exhaustive()
    }
}

impl<B> Fanout<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// Starts configuring the fanout of the object behind `scheduler`.
    pub fn builder(scheduler: &Scheduler) -> FanoutBuilder<B> {
        FanoutBuilder {
            scheduler: scheduler.clone(),
            targets: Vec::new(),
            policy: PolicyOptions::default(),
            attempt_timeout: None,
            dlq: None,
            max_batch_size: DEFAULT_MAX_BATCH_SIZE,
            batch_delay: Duration::ZERO,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_enqueue_messages: limits::DEFAULT_MAX_ENQUEUE_MESSAGES,
            routing: None,
            hooks: Vec::new(),
            trace: None,
        }
    }

    /// The object's load now; `pending_deliveries` is the exact number of
    /// (message, target) deliveries still owed (counted once per instance,
    /// then kept in memory).
    pub fn load(&self) -> Result<LoadSnapshot, FanoutError> {
        self.inner.load()
    }

    /// Attaches a lifecycle hook until the registration is dropped or
    /// detached.
    pub fn lifecycle(&self, hook: LifecycleHook) -> HookRegistration {
        self.inner.emitter.add(hook)
    }

    /// Runs due work of every capability on the scheduler (the same as
    /// [`Scheduler::alarm`]).
    pub async fn alarm(&self, info: Option<AlarmInfo>) -> Result<(), DurabilityError> {
        self.inner.engine.alarm(info).await
    }

    /// Migrates the fanout schema of `storage` to `target` explicitly; a
    /// migration that drops the deliveries table also drops their memos.
    pub fn migrate(
        storage: &dyn Storage,
        target: MigrationTarget,
    ) -> Result<MigrationReport, DurabilityError> {
        let report = migrations::migrate(storage, FANOUT_CAPABILITY, FANOUT_MIGRATIONS, target)?;
        crate::memo::delete_memos_of_dropped_table(storage, DELIVERIES)?;
        Ok(report)
    }
}

/// The state behind a [`Fanout`], shared by its passes and messages.
pub(crate) struct Inner<B> {
    engine: Rc<Engine>,
    targets: HashMap<String, Target<B>>,
    policies: Policies,
    dlq: Option<WriteFn<B>>,
    max_batch_size: usize,
    batch_delay_ms: EpochMs,
    max_body_bytes: usize,
    max_enqueue_messages: usize,
    routing: Load,
    emitter: Emitter,
    /// The target passes running in this instance: a pass for a target that
    /// already runs joins it instead of starting a second one.
    running: RefCell<HashMap<String, watch::Receiver<bool>>>,
    /// The exact number of delivery rows, once counted. Counting the table
    /// on every enqueue costs O(backlog), which made a shard that fell
    /// behind fall further behind; so it is counted once and kept exact by
    /// every insert and removal, inside their transactions. A failed
    /// transaction may have counted changes that rolled back, so it drops
    /// the count and the next read counts again.
    pending: Cell<Option<u64>>,
    /// Captures the producer's trace context at enqueue and redrive.
    trace: Option<TraceCapture>,
}

impl<B> Inner<B> {
    /// Writes plus the alarm reconcile, in one transaction; a failure drops
    /// the cached count.
    async fn transaction<T, E: From<StorageError>>(
        &self,
        write: impl FnOnce(&dyn Sql) -> Result<T, E>,
    ) -> Result<T, E> {
        let result = self.engine.transaction(write).await;
        if result.is_err() {
            self.pending.set(None);
        }
        result
    }

    /// Emits the event `event` builds. Built even when no hook listens:
    /// the metrics (`crate::telemetry`) count every event.
    fn emit(&self, event: impl FnOnce() -> LifecycleEvent) {
        self.emitter.emit(&event());
    }

    /// Changes the cached count inside a transaction body.
    fn adjust_pending(&self, delta: i64) {
        if let Some(count) = self.pending.get() {
            self.pending.set(Some(count.saturating_add_signed(delta)));
        }
    }

    fn pending_count(&self) -> Result<u64, StorageError> {
        if let Some(count) = self.pending.get() {
            return Ok(count);
        }
        let count = store::count_deliveries(self.engine.sql())?;
        self.pending.set(Some(count));
        Ok(count)
    }

    fn load(&self) -> Result<LoadSnapshot, FanoutError> {
        Ok(self.routing.snapshot(self.pending_count()?))
    }

    /// When a first delivery accepted at `created_at` is due: at once, or at
    /// the next multiple of the batch delay, so that everything accepted in
    /// one window becomes due at the same instant.
    fn first_attempt_at(&self, created_at: EpochMs) -> EpochMs {
        if self.batch_delay_ms == 0 {
            return created_at;
        }
        let delay = self.batch_delay_ms;
        let windows =
            created_at.div_euclid(delay) + EpochMs::from(created_at.rem_euclid(delay) != 0);
        windows.saturating_mul(delay)
    }
}

/// The lifecycle entity of one delivery.
fn entity(message_id: &str, target: &str, generation: &str) -> Entity {
    Entity::FanoutDelivery {
        id: message_id.to_owned(),
        target: target.to_owned(),
        generation: generation.to_owned(),
    }
}
