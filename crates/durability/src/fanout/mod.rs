//! Fanout (ref `DurabilityFanout`): atomically accept a batch of messages,
//! freeze each message's set of named targets, and deliver to each target
//! independently, at least once, with per-target ack, retry and dead
//! letter, durable dead-letter intent, and redrive.
//!
//! A work queue, not a log: a message is kept until every target of its
//! frozen set has passed it and none holds an exception for it.
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
//! - **Storage: per-target cursors, rows only for exceptions** (`store`
//!   has the tables). A message is stored once, in sequence order, with
//!   its frozen target set; an enqueue call adds one *span* per target
//!   (the sequence range it owes). Each target keeps a durable *cursor*:
//!   every message of it below `next_seq` was delivered or became an
//!   exception. Only deliveries that leave the common path get a row:
//!   waiting for a retry, dead-letter intent, or a delivery settled on its
//!   own while its cursor has not passed it yet (a tombstone). A message
//!   row goes by a range delete when its span's last target passes it.
//!   The common path (delivered on its first attempt, acked on return)
//!   writes per message only its row and its deletion; per batch and
//!   target, a claim and an advance of the cursor. On Cloudflare, where
//!   rows written are billed, that is the point.
//! - **Acceptance** ([`Fanout::enqueue`]) writes the batch's messages, one
//!   span per target and the sequence, and re-arms the object's alarm, in
//!   one transaction. A definite problem with the input is an
//!   [`EnqueueRejection`] with nothing written; a storage failure is an
//!   `Err`, because the commit may have happened.
//! - **Dispatch** (`dispatch`) runs one bounded pass per target at a time:
//!   the next messages of its due spans after its cursor, claimed as one
//!   range in one write to the cursor row (its attempt and deadline: a
//!   process that dies mid-batch leaves a claim that comes back at the
//!   deadline, the attempt counted, and the batch is delivered again, never
//!   skipped), then due exception rows, each claimed by a compare-and-set
//!   on its attempt; then one call of the target with the whole batch.
//!   While a target acks whole batches and more is due, the commit that
//!   moves its cursor past one batch claims the next (one commit per batch
//!   instead of two, at most 16 batches a pass).
//! - **Settlement** (`settle`): an explicit settlement of a delivery on the
//!   cursor gives it a row (a retry, dead-letter intent, or a tombstone for
//!   an ack), guarded by the cursor's claim; of an exception row, a
//!   compare-and-set on its attempt. A late or duplicated settlement
//!   changes nothing. After the target's turn the batch is ended: acked on
//!   return (one write moves the cursor past the whole batch), unsettled
//!   messages retried, the cursor moved past everything settled or turned
//!   into an exception. A failing message therefore never holds back its
//!   target's cursor, nor any other target. A dead letter's intent is
//!   committed before the DLQ write, so a crash repeats the write but never
//!   redelivers to the consumer.
//! - **Layers.** `store` (SQL, no policy) at the bottom; `batch` (a claimed
//!   batch in memory) on it; `dispatch` and `settle` on both, neither
//!   calling the other; this module wires a pass: claim, hand over,
//!   settle. A per-target gate (`flow`, flow control) sits in front of the
//!   claim.
//! - **Flow control** (issue 14; [`FlowControl`], [`FanoutBuilder::flow_control`],
//!   [`Fanout::set_flow_control`], [`Fanout::pause_target`]). The gate only
//!   decides how many deliveries a target's next claim may take; a target
//!   it holds back claims nothing, so its cursor, rows and attempts stay as
//!   they are: no message is dropped, dead-lettered or charged an attempt
//!   because of a limit. Passes of different targets run concurrently and
//!   a held-back pass returns at once, so a limited or paused target never
//!   slows another.
//! - **Reading.** `durability_fanout_deliveries` is a view of every owed
//!   delivery in the reference's columns (the table it was before
//!   migration 0013): tools, tests and memo ownership checks read it.
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
//! - First deliveries of a target go in sequence order, span by span; a
//!   span not due yet (its batch-delay window) holds back the later ones of
//!   that target, even if a changed `batch_delay` made a later one due
//!   earlier. Retries are taken by sequence, as in the reference.
//! - A removed target's cursor waits [`INFRASTRUCTURE_RETRY`] each time its
//!   first deliveries come due (one write), and its due exception rows are
//!   postponed as long, at most [`MISSING_TARGET_POSTPONE_BATCH`] per pass
//!   (the reference takes a delivery batch), so removing a target with a
//!   large backlog does not turn the object into a loop of tiny
//!   transactions.
//! - A storage target's written messages are acked together, in one
//!   transaction after the batch's writes (the reference acks each write).
//! - Deliveries carried over from the layout before migration 0013 drain
//!   as exception rows, after the new first deliveries of their target.
//! - A memo of a delivery still on its cursor is checked against the view
//!   of owed deliveries, which walks the target's backlog: memos cost more
//!   per call than on exception rows.
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
//! Flow control decisions (issue 14, where it is silent):
//! - **Concurrency** counts deliveries handed over and not yet returned or
//!   timed out. One batch of a target is out at a time (passes of a target
//!   never overlap), so it caps the batch size; a concurrency above
//!   `max_batch_size` adds no parallel batches. A consumer that outlives
//!   its attempt timeout is no longer counted (it cannot be cancelled; its
//!   late settlements are rejected), otherwise one hung call would stop its
//!   target for good.
//! - **Rate limit**: a token bucket per target holding `deliveries` tokens
//!   (the largest burst), starting full, refilled continuously in integer
//!   units (no drift: exactly `deliveries` per `interval`). Every delivery
//!   handed over takes a token, retries included; dead letters sent to the
//!   DLQ take none (they do not reach the target).
//! - **Batched wake-ups**: a rate-limited target claims once it has a
//!   batch's worth of tokens (`max_batch_size`, cut by its concurrency and
//!   by the bucket's size), and reports exactly that time to the
//!   scheduler's reconcile, so its timer or alarm fires when the tokens are
//!   due, never by polling, and a limited target with a backlog costs one
//!   claim per batch, not one per token. At 10/s with batches of 10 it gets
//!   10 each second; at 50/s, 10 each 200 ms.
//! - **Limits live in memory**: the builder's apply to each new instance,
//!   [`Fanout::set_flow_control`] changes them until then (the tokens
//!   earned stay, up to the new bucket; a target without a rate before
//!   starts full). The bucket starts full after a restart, so a restart can
//!   give one extra burst. A change applies from the next claim (a batch
//!   already out finishes) and re-arms the alarm.
//! - **Pause is durable** (migration 0015: a `paused` column on the
//!   target's cursor). A paused target keeps accepting; nothing of it is
//!   claimed (first deliveries, retries, dead-letter intent, a claim left
//!   by a crash); it arms no alarm; its backlog stays in
//!   [`Fanout::load`]'s `pending_deliveries` and the view of owed
//!   deliveries. A batch already out when it is paused finishes. Pausing or
//!   resuming is idempotent; a target neither configured nor owed anything
//!   is [`FanoutError::UnknownTarget`], nothing written. A paused target
//!   that is no longer configured is left paused (not postponed).
//! - A range claimed before a crash comes back whole at its deadline (its
//!   attempt counting needs the same range), even if it is larger than the
//!   target's current limits; it empties the bucket.
//! - The scheduler's due time is computed per target (one row per cursor:
//!   a probe of its spans and of its exceptions' due index). A target whose
//!   pass runs in this instance reports only its times still to come (its
//!   claim's deadline, which brings a batch back after a crash); what of it
//!   is already due is reported by one more reconcile when the pass ends:
//!   a retry coming due while its target's batch is out would otherwise
//!   fire the timer again and again.
//!
//! Owns the `durability_fanout_*` tables; all their SQL is in `store`.

mod batch;
mod dispatch;
mod enqueue;
mod error;
mod flow;
mod message;
mod outcome;
mod parked;
mod settle;
mod store;
mod target;

pub use enqueue::{EnqueueOptions, EnqueueResult, FanoutInput};
pub use error::{
    EnqueueRejection, FANOUT_ENQUEUE_ERROR, FANOUT_SETTLEMENT_ERROR, FANOUT_TIMEOUT_ERROR,
    FanoutConfigError, FanoutError, SettlementError,
};
pub use flow::FlowControl;
pub use message::{Failure, FanoutMessage, Settling, StoredMessage};
pub use outcome::{DeadLetterReason, SettlementOutcome};
pub use target::Target;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::rc::Rc;
use std::time::Duration;

use durability_platform::{
    AlarmInfo, EpochMs, LocalBoxFuture, MAX_SAFE_INTEGER, Sql, Storage, StorageError,
};
use futures::future::join_all;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tracing::Instrument;

use crate::error::{ConfigError, DurabilityError, HandlerError};
use crate::lifecycle::{Emitter, Entity, HookRegistration, LifecycleEvent, LifecycleHook};
use crate::limits;
use crate::load::{Load, LoadSnapshot};
use crate::migrations::{
    self, FANOUT_CAPABILITY, FANOUT_MIGRATIONS, MigrationReport, MigrationTarget,
};
use crate::record::DurableTable;
use crate::retry::{Delay, Policies, PolicyOptions, whole_millis};
use crate::scheduler::{Engine, Participant, PendingTimes, Scheduler};
use crate::trace::TraceCapture;
use batch::SettleState;
use dispatch::Lanes;
use flow::Gate;
use store::DELIVERIES;
use target::{TargetKind, WriteFn};

/// Default most messages per batch handed to a target.
pub const DEFAULT_MAX_BATCH_SIZE: usize = 10;
/// Default largest body, measured as its own JSON (1 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = crate::limits::DEFAULT_MAX_BODY_BYTES;
/// How long a removed target's due rows, and a dead letter whose DLQ write
/// failed, wait before the next try; also the DLQ write's deadline.
pub const INFRASTRUCTURE_RETRY: Duration = Duration::from_millis(60_000);
/// Most batches one pass of a target hands over back to back, each claimed
/// in the commit that ends the one before; then the pass yields to the
/// scheduler (and to the target's due retries).
const PIPELINED_BATCHES: u32 = 16;
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
    flow: Vec<(String, FlowControl)>,
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
    /// On a platform with a per-value bound (Cloudflare: 2 MB), at most that
    /// bound less [`STORED_VALUE_OVERHEAD_BYTES`](crate::limits::STORED_VALUE_OVERHEAD_BYTES);
    /// `build` refuses more with [`ConfigError::AbovePlatformLimit`](crate::ConfigError::AbovePlatformLimit).
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

    /// Limits how fast target `target` gets deliveries (concurrency and a
    /// rate, see [`FlowControl`]); the last call for a target wins.
    /// Default: no limit. Change it while running with
    /// [`Fanout::set_flow_control`]; pause a target with
    /// [`Fanout::pause_target`].
    pub fn flow_control(mut self, target: impl Into<String>, flow: FlowControl) -> Self {
        self.flow.push((target.into(), flow));
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
        limits::check_body_setting(
            "max_body_bytes",
            self.max_body_bytes,
            &self.scheduler.engine.ctx.storage().limits(),
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
        let mut gates = HashMap::new();
        for (id, flow) in self.flow {
            if !targets.contains_key(&id) {
                return Err(FanoutConfigError::InvalidTarget {
                    id,
                    rule: "flow_control names a target that is not configured",
                });
            }
            let limits = flow.validate()?;
            gates.insert(id, Gate::new(limits, engine.now()));
        }
        gates.retain(|_, gate: &mut Gate| !gate.is_open());
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
            deferred: RefCell::new(HashSet::new()),
            pending: Cell::new(None),
            gates: RefCell::new(gates),
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
            flow: Vec::new(),
            trace: None,
        }
    }

    /// Replaces the flow control of the configured target `target` while
    /// running (`FlowControl::new()` lifts every limit). It applies from
    /// the target's next claim: a batch already handed over finishes. The
    /// tokens the target has earned stay (up to the new bucket's size); a
    /// target that had no rate limit starts with a full bucket. Limits
    /// live in memory: a new instance starts from its builder's.
    pub fn set_flow_control(
        &self,
        target: &str,
        flow: FlowControl,
    ) -> Result<(), FanoutConfigError> {
        if !self.inner.targets.contains_key(target) {
            return Err(FanoutConfigError::InvalidTarget {
                id: target.to_owned(),
                rule: "set_flow_control names a target that is not configured",
            });
        }
        let limits = flow.validate()?;
        let now = self.inner.engine.now();
        {
            let mut gates = self.inner.gates.borrow_mut();
            match gates.get_mut(target) {
                Some(gate) => gate.change(limits, now),
                None => {
                    gates.insert(target.to_owned(), Gate::new(limits, now));
                }
            }
            gates.retain(|_, gate| !gate.is_open());
        }
        // The object's alarm follows the new limits (a looser one may make
        // the target due sooner); a failed reconcile leaves the alarm where
        // it was, which only wakes the target later, and the next
        // transaction reconciles again.
        let refresh = self.inner.engine.schedule_next_alarm();
        self.inner.engine.ctx.spawn(Box::pin(async move {
            if let Err(error) = refresh.await {
                tracing::warn!(
                    event = "durability.fanout.flow_reconcile_failed",
                    %error,
                    "the alarm was not moved after a flow control change"
                );
            }
        }));
        Ok(())
    }

    /// Pauses `target` durably: it keeps accepting messages but nothing is
    /// handed to it (first deliveries, retries, dead letters to the DLQ)
    /// until [`Fanout::resume_target`], across evictions and restarts. Its
    /// backlog stays counted in [`Fanout::load`]. A batch already handed
    /// over finishes. Idempotent. A target neither configured nor owed
    /// anything is [`FanoutError::UnknownTarget`].
    pub async fn pause_target(&self, target: &str) -> Result<(), FanoutError> {
        self.inner.set_paused(target, true).await
    }

    /// Resumes a paused target: its backlog is due at once, in order, under
    /// its flow control. Idempotent.
    pub async fn resume_target(&self, target: &str) -> Result<(), FanoutError> {
        self.inner.set_paused(target, false).await
    }

    /// The deliveries still owed to `target` (paused or not): its share of
    /// [`Fanout::load`]'s `pending_deliveries`. Counts its backlog on each
    /// call (a walk of its owed deliveries): for operators and dashboards,
    /// not for every request.
    pub fn backlog(&self, target: &str) -> Result<u64, FanoutError> {
        Ok(store::count_owed_of(self.inner.engine.sql(), target)?)
    }

    /// The paused targets, in order.
    pub fn paused_targets(&self) -> Result<Vec<String>, FanoutError> {
        Ok(store::paused_targets(self.inner.engine.sql())?)
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
    /// Running targets a reconcile left out (`next_due`): their pass
    /// reconciles once more when it ends.
    deferred: RefCell<HashSet<String>>,
    /// The exact number of delivery rows, once counted. Counting the table
    /// on every enqueue costs O(backlog), which made a shard that fell
    /// behind fall further behind; so it is counted once and kept exact by
    /// every insert and removal, inside their transactions. A failed
    /// transaction may have counted changes that rolled back, so it drops
    /// the count and the next read counts again.
    pending: Cell<Option<u64>>,
    /// The flow control of the targets that have limits (`flow`); a target
    /// without an entry is unlimited.
    gates: RefCell<HashMap<String, Gate>>,
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
        let count = store::count_owed(self.engine.sql())?;
        self.pending.set(Some(count));
        Ok(count)
    }

    fn load(&self) -> Result<LoadSnapshot, FanoutError> {
        Ok(self.routing.snapshot(self.pending_count()?))
    }

    /// How many deliveries the next claim of `target` may take now: the
    /// batch size, cut by the target's concurrency and tokens.
    pub(crate) fn allowance(&self, target: &str, now: EpochMs) -> usize {
        match self.gates.borrow_mut().get_mut(target) {
            Some(gate) => gate.allowance(now, self.max_batch_size),
            None => self.max_batch_size,
        }
    }

    /// Takes the tokens of `deliveries` handed to `target`.
    pub(crate) fn take_tokens(&self, target: &str, deliveries: usize, now: EpochMs) {
        if deliveries == 0 {
            return;
        }
        if let Some(gate) = self.gates.borrow_mut().get_mut(target) {
            gate.take(deliveries, now);
        }
    }

    /// The earliest time a target that is not paused has work it may take:
    /// its due time, or when it has a batch's tokens if it is short of
    /// them. A target whose pass runs in this instance reports only its
    /// times still to come (a claim's deadline above all, which brings a
    /// batch back after a crash); work of it already due is the running
    /// pass's, or is reported by the reconcile that runs when the pass
    /// ends. Otherwise a retry coming due while its target's batch is out
    /// would fire the timer again and again, each run only joining the
    /// running pass.
    /// (the earliest time the physical alarm must cover; the earliest time
    /// for the timer). A running target's times that are due now are left
    /// out of the timer (its pass re-runs it, see `deferred`) but not out
    /// of the physical alarm: if the process dies during the pass, the
    /// alarm is what brings the owed deliveries back.
    fn next_due(&self, sql: &dyn Sql) -> Result<PendingTimes, StorageError> {
        let now = self.engine.now();
        let gates = self.gates.borrow();
        let running = self.running.borrow();
        let mut physical: Option<EpochMs> = None;
        let mut earliest: Option<EpochMs> = None;
        for due in store::next_due_by_target(sql)? {
            let gated = |at: EpochMs| match gates.get(&due.target) {
                Some(gate) => at.max(gate.next_token_at(now, self.max_batch_size)),
                None => at,
            };
            let times = [due.cursor, due.exceptions].into_iter().flatten();
            if let Some(at) = times.clone().min().map(gated) {
                physical = Some(physical.map_or(at, |p| p.min(at)));
            }
            let at = if running.contains_key(&due.target) {
                let (later, now_due): (Vec<EpochMs>, Vec<EpochMs>) =
                    times.partition(|at| *at > now);
                if !now_due.is_empty() {
                    self.deferred.borrow_mut().insert(due.target.clone());
                }
                later.into_iter().min()
            } else {
                times.min()
            };
            let Some(at) = at.map(gated) else {
                continue;
            };
            earliest = Some(earliest.map_or(at, |e| e.min(at)));
        }
        Ok((physical, earliest))
    }

    async fn set_paused(&self, target: &str, paused: bool) -> Result<(), FanoutError> {
        let configured = self.targets.contains_key(target);
        self.transaction(|sql| {
            if !configured && store::read_cursor(sql, target)?.is_none() {
                return Err(FanoutError::UnknownTarget {
                    target: target.to_owned(),
                });
            }
            if store::set_paused(sql, target, paused)? {
                tracing::info!(
                    event = "durability.fanout.target_paused",
                    target,
                    paused,
                    "fanout target {}",
                    if paused { "paused" } else { "resumed" }
                );
            }
            Ok(())
        })
        .await
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

/// The scheduler sees fanout as one participant: its due time is the
/// earliest of its targets' (`store::next_due_by_target`), paused targets
/// left out and rate-limited ones at their next token.
impl<B> Participant for Inner<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    fn table(&self) -> DurableTable {
        DELIVERIES
    }

    fn run_due(
        self: Rc<Self>,
        _now: EpochMs,
        _info: Option<AlarmInfo>,
    ) -> LocalBoxFuture<'static, Result<(), DurabilityError>> {
        Box::pin(async move { self.run_due().await.map_err(DurabilityError::from) })
    }

    fn custom_pending_times(&self, sql: &dyn Sql) -> Option<Result<PendingTimes, StorageError>> {
        Some(self.next_due(sql))
    }
}

/// Marks a target's pass as running for as long as it lives; dropping it
/// (the pass ended, or its task was dropped) lets the next pass start and
/// wakes the passes that joined this one.
struct RunningPass<B> {
    inner: Rc<Inner<B>>,
    target: String,
    done: watch::Sender<bool>,
}

impl<B> Drop for RunningPass<B> {
    fn drop(&mut self) {
        self.inner.running.borrow_mut().remove(&self.target);
        let _ = self.done.send(true);
    }
}

/// The wiring of a pass: `dispatch` claims and hands over, `settle` ends
/// the batch; neither calls the other.
///
/// A pass of one target never overlaps another pass of the same target in
/// this instance (a second caller joins the running one), while different
/// targets run concurrently, each holding one permit of the scheduler's
/// pool; a slow or removed target cannot stop another, and every query is
/// per target, so one target's backlog cannot hide another's work behind a
/// global limit. A per-target gate (flow control) belongs in
/// [`Inner::run_target`], before the claim: a pass it holds back claims
/// nothing and leaves the target's cursor where it is.
impl<B> Inner<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// One pass over every target that has a cursor (configured or not)
    /// and is not paused, the targets concurrently. Fails with the first failing target; the
    /// others still finish.
    pub(crate) async fn run_due(self: Rc<Self>) -> Result<(), FanoutError> {
        let targets = store::list_targets(self.engine.sql())?;
        let passes: Vec<_> = targets
            .into_iter()
            .map(|target| self.start_pass(target))
            .collect();
        for result in join_all(passes).await {
            result?;
        }
        Ok(())
    }

    /// Runs a pass of `target`, or joins the one already running.
    fn start_pass(
        self: &Rc<Self>,
        target: String,
    ) -> LocalBoxFuture<'static, Result<(), FanoutError>> {
        let running = self.running.borrow().get(&target).cloned();
        if let Some(mut done) = running {
            return Box::pin(async move {
                // An error means the running pass was dropped: over too.
                let _ = done.wait_for(|done| *done).await;
                Ok(())
            });
        }
        let (done, receiver) = watch::channel(false);
        self.running.borrow_mut().insert(target.clone(), receiver);
        let guard = RunningPass {
            inner: Rc::clone(self),
            target: target.clone(),
            done,
        };
        let inner = Rc::clone(self);
        let span = tracing::info_span!(
            "fanout_pass",
            object = %self.engine.ctx.id(),
            target = %target,
        );
        Box::pin(
            async move {
                let result = inner.run_target(&target).await;
                drop(guard);
                let deferred = inner.deferred.borrow_mut().remove(&target);
                if deferred {
                    // A transaction of its own: a shared refresh may have
                    // begun while the pass still ran.
                    inner.transaction(|_| Ok::<_, StorageError>(())).await?;
                }
                result
            }
            .instrument(span),
        )
    }

    /// Bounded batches of one target: claim, hand over, settle. While the
    /// target acks whole batches and more is due, the commit that ends a
    /// batch claims the next one, up to [`PIPELINED_BATCHES`] a pass.
    async fn run_target(self: &Rc<Self>, target_id: &str) -> Result<(), FanoutError> {
        let _permit = self.engine.acquire_permit().await?;
        let Some(target) = self.targets.get(target_id) else {
            return self.postpone_missing(target_id).await;
        };
        let policy = self.policies.resolve(target_id);
        let mut batch = self.claim_batch(target_id, &policy).await?;
        for round in 1..=PIPELINED_BATCHES {
            if batch.claims.is_empty() && batch.terminal.is_empty() && batch.range.is_none() {
                return Ok(());
            }
            let started_at = self.engine.now();
            let states: Vec<Rc<SettleState>> = batch
                .claims
                .into_iter()
                .map(|claim| Rc::new(SettleState::new(claim, policy.clone(), started_at)))
                .collect();
            let handover = if states.is_empty() {
                None
            } else {
                Some(self.hand_over(target, &states, &policy).await)
            };
            let claim_next = |sql: &dyn Sql| {
                (round < PIPELINED_BATCHES)
                    .then(|| {
                        self.claim_in(sql, target_id, &policy, Lanes::CursorOnly)
                            .ok()
                    })
                    .flatten()
                    .filter(|next| !next.claims.is_empty())
            };
            let next = self
                .finish_batch(
                    target_id,
                    Some(target),
                    &states,
                    batch.terminal,
                    batch.range,
                    handover,
                    &claim_next,
                )
                .await?;
            match next {
                Some(next) => batch = next,
                None => return Ok(()),
            }
        }
        Ok(())
    }
}
