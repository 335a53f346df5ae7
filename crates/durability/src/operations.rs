//! Durable operations: effectively-once handlers keyed by a caller-chosen id.
//!
//! Registration returns once the row and the alarm reconcile have committed
//! together; the handler then runs eagerly (when a permit is free), from the
//! in-memory timer or from the physical alarm, with retries, and its result
//! is read later. Execution is at least once (a crash after a side effect
//! runs the handler again), registration and result exactly once: an id is
//! deduplicated for as long as its row is kept, which is until it is purged.
//!
//! Owns the `durability_calls` table; all its SQL is in this module.
//!
//! Decisions where the reference is silent or JavaScript-specific:
//! - Handler names cannot collide with methods in Rust, so no name is
//!   reserved; an empty name is rejected at construction.
//! - There is no private-scheduler mode: a helper always attaches to a
//!   [`Scheduler`], which makes the unsupported "two engines on one object"
//!   set-up impossible to build.
//! - Lookups of one id need no chaining: the row read, the active-map check
//!   and the registration of a new execution run with no await between them,
//!   so two callers on the object's one thread cannot both miss the map.
//! - Fewer commits per operation: an eager start claims its first attempt
//!   in the registration's own transaction, and in a due pass the
//!   completion of one attempt claims the next id of its lane in the same
//!   transaction (a no-op operation then costs two commits, not three).
//!   An eager registration is also lean inside its transaction: the row is
//!   inserted at attempt 1 (no separate claim), it is read back only when
//!   the id was taken already, and its attempt gets the trace context the
//!   registration stored without reading it again.
//!   Failures and timeouts do not hand off: their settlement may await the
//!   storage, and a claim must be handed over with no await between its
//!   commit and its claimer. A claimed id is reserved in memory until its
//!   claimer starts it, so no other pass spends a second attempt on it;
//!   a claim the process never ran (a crash, an eviction) counts as an
//!   attempt, like a crash during the handler.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::rc::{Rc, Weak};
use std::time::Duration;

use durability_platform::{AlarmInfo, EpochMs, LocalBoxFuture, Row, Sql, StorageError, params};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::codec::{self, CodecError};
use crate::error::{ConfigError, DurabilityError, HandlerError, SerializedError};
use crate::lifecycle::{Emitter, Entity, EntityKind, LifecycleEvent, LifecycleHook};
use crate::limits::{self, DEFAULT_MAX_BODY_BYTES};
use crate::memo::Memo;
use crate::migrations::{
    self, MigrationReport, MigrationTarget, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS,
};
use crate::record::{AttemptRef, DurableTable, claim_attempt};
use crate::retry::{Delay, MethodPolicy, Policies, PolicyOptions, whole_millis};
use crate::scheduler::attempt::{
    ActiveMap, AttemptKind, Claimed, ExecutionSpec, Output, Successor,
};
use crate::scheduler::{AbortSignal, Engine, Participant, Scheduler};
use crate::trace::TraceCapture;

/// The record table of operations.
pub const CALLS: DurableTable = DurableTable {
    name: "durability_calls",
    key: "id",
};

/// Most due rows one pass reads; the end-of-run reconcile re-arms an
/// immediate timer for the rest, so a backlog drains in passes.
const DUE_BATCH: i64 = 100;

/// What a handler receives for one attempt.
pub struct DurableCall<P> {
    /// The idempotency id the operation was registered with.
    pub id: String,
    /// The handler name.
    pub operation: String,
    /// The registered payload.
    pub payload: P,
    /// This attempt's number, from 1.
    pub attempt: u32,
    /// Aborts at the attempt's timeout or when the record is purged.
    pub signal: AbortSignal,
    /// Persists a step's result so a retried attempt reuses it.
    pub memo: Memo,
    /// The producer's trace context captured at registration (see
    /// [`crate::trace`]), to continue its trace; `None` without a capture.
    pub trace_context: Option<String>,
    /// The physical alarm's invocation info when this attempt runs in a
    /// pass the object's alarm started (`Scheduler::alarm(Some(info))`);
    /// `None` for an eager start at registration and for runs of the
    /// in-memory timer. The same rule as [`AlarmCall::platform`](crate::AlarmCall::platform).
    pub platform: Option<AlarmInfo>,
}

type ErasedHandler = Rc<dyn Fn(CallInput) -> LocalBoxFuture<'static, Result<Output, HandlerError>>>;

struct CallInput {
    id: String,
    operation: String,
    payload: String,
    attempt: u32,
    signal: AbortSignal,
    memo: Memo,
    trace_context: Option<String>,
    platform: Option<AlarmInfo>,
}

/// The state of one operation, as [`Operations::result`] reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum OperationResult<R> {
    /// No operation was registered with this id (or it was purged).
    NotFound,
    /// Registered and not finished: running, or waiting for a retry.
    Pending {
        /// Attempts claimed so far.
        attempt: u32,
        /// When the next attempt is due.
        next_attempt_at: EpochMs,
        /// The message of the last failure, if any.
        last_error: Option<String>,
    },
    /// Failed for good.
    Failed {
        attempt: u32,
        error: SerializedError,
    },
    /// Completed with this result.
    Completed { result: R },
}

/// Whether a registration created the operation or found it already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registration {
    /// A new operation was stored and will run.
    Created,
    /// The id was already registered for this operation (whatever its
    /// status or payload): nothing was written and nothing starts.
    Existing,
}

/// Configures [`Operations`].
pub struct OperationsBuilder {
    scheduler: Scheduler,
    handlers: HashMap<String, ErasedHandler>,
    policy: PolicyOptions,
    attempt_timeout: Option<Duration>,
    include_result: bool,
    max_payload_bytes: usize,
    hooks: Vec<LifecycleHook>,
    trace: Option<TraceCapture>,
}

impl OperationsBuilder {
    /// Registers the handler of the operation `name`: it receives the
    /// decoded payload and returns a result that is stored as JSON.
    ///
    /// A stored payload that does not decode as `P` fails the attempt
    /// without calling the handler. If it is valid stored text of another
    /// type, that is an ordinary, retryable failure (a fixed deployment may
    /// read it). If it is not in the stored format at all (a row written by
    /// hand as `'null'` instead of `{"kind":"value","value":null}`), no
    /// deployment can ever read it: the operation fails for good at its
    /// first attempt with a `NonRetryableError` that says what is wrong and
    /// what the format is, logged once.
    pub fn handler<P, R, F, Fut>(mut self, name: &str, handler: F) -> Self
    where
        P: DeserializeOwned + 'static,
        R: Serialize + 'static,
        F: Fn(DurableCall<P>) -> Fut + 'static,
        Fut: Future<Output = Result<R, HandlerError>> + 'static,
    {
        let erased: ErasedHandler = Rc::new(move |input: CallInput| {
            let payload = match codec::decode_as::<P>(&input.payload) {
                Ok(payload) => payload,
                Err(error) => {
                    return Box::pin(std::future::ready(Err(payload_error(&input, error))))
                        as LocalBoxFuture<'static, _>;
                }
            };
            let running = handler(DurableCall {
                id: input.id,
                operation: input.operation,
                payload,
                attempt: input.attempt,
                signal: input.signal,
                memo: input.memo,
                trace_context: input.trace_context,
                platform: input.platform,
            });
            Box::pin(async move {
                let result = running.await?;
                Ok(Output::Encoded(codec::encode(&result)))
            })
        });
        self.handlers.insert(name.to_owned(), erased);
        self
    }

    /// Attempts per registration, the first included. Default 5.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.policy = self.policy.max_attempts(attempts);
        self
    }

    /// How long one attempt may run before it is abandoned. Default 5 min;
    /// whole milliseconds, from 1 ms to 2^31 - 1 ms.
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

    /// Overrides the policy of one operation, field by field.
    pub fn method(mut self, name: &str, policy: MethodPolicy) -> Self {
        self.policy = self.policy.method(name, policy);
        self
    }

    /// Largest payload [`Operations::start`] accepts, in bytes of its own
    /// JSON. Default 1 MiB; from 1 byte to 32 MiB
    /// ([`MAX_BODY_BYTES_LIMIT`](crate::limits::MAX_BODY_BYTES_LIMIT)).
    /// On a platform with a per-value bound (Cloudflare: 2 MB), at most that
    /// bound less [`STORED_VALUE_OVERHEAD_BYTES`](crate::limits::STORED_VALUE_OVERHEAD_BYTES);
    /// `build` refuses more with [`ConfigError::AbovePlatformLimit`](crate::ConfigError::AbovePlatformLimit).
    pub fn max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// Puts each completed result into the `attempt_settled` event. Off by
    /// default, to keep results out of telemetry.
    pub fn include_result(mut self, on: bool) -> Self {
        self.include_result = on;
        self
    }

    /// Adds a lifecycle hook (best effort, never changes state).
    pub fn on_lifecycle_event(mut self, hook: LifecycleHook) -> Self {
        self.hooks.push(hook);
        self
    }

    /// Captures the producer's trace context at each registration and
    /// hands it to every attempt (see [`crate::trace`]). Default: none.
    pub fn trace_context(mut self, capture: TraceCapture) -> Self {
        self.trace = Some(capture);
        self
    }

    /// Validates the policy, migrates the schema and attaches to the
    /// scheduler.
    pub fn build(self) -> Result<Operations, DurabilityError> {
        let mut policy = self.policy;
        if let Some(timeout) = self.attempt_timeout {
            policy = policy.attempt_timeout_ms(whole_millis("attempt_timeout", timeout)?);
        }
        let policies = policy.validate_as("attempt_timeout", "retry_delay")?;
        if self.handlers.keys().any(String::is_empty) {
            return Err(ConfigError::NotPositive {
                field: "handler name length".into(),
            }
            .into());
        }
        for name in self.handlers.keys() {
            limits::check_id("handler name", name)?;
        }
        limits::check_body_setting(
            "max_payload_bytes",
            self.max_payload_bytes,
            &self.scheduler.engine.ctx.storage().limits(),
        )?;
        let engine = Rc::clone(&self.scheduler.engine);
        let emitter =
            engine.prepare_records(OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS, self.hooks)?;
        let inner = Rc::new(Inner {
            engine: Rc::clone(&engine),
            handlers: self.handlers,
            policies,
            include_result: self.include_result,
            max_payload_bytes: self.max_payload_bytes,
            emitter,
            active: ActiveMap::default(),
            trace: self.trace,
            reserved: RefCell::new(HashSet::new()),
        });
        engine.register(&inner)?;
        Ok(Operations { inner })
    }
}

/// Durable operations of one object. Cloning is one reference-count
/// increment.
///
/// ```
/// # use std::rc::Rc;
/// # use durability_host::{DurableObject, Host, ObjectContext};
/// # struct Doc { ctx: ObjectContext }
/// # impl DurableObject for Doc {}
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), String> {
/// # let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
/// # tokio::task::LocalSet::new().run_until(async move {
/// # let host = Host::builder(dir.path()).threads(0).build().map_err(|e| e.to_string())?;
/// # let docs = host.namespace("doc", |ctx| Ok(Doc { ctx })).map_err(|e| e.to_string())?;
/// # let stub = docs.stub("doc").map_err(|e| e.to_string())?;
/// # stub.call(|doc: Rc<Doc>| async move { run(doc.ctx.clone().into_dyn()).await.map_err(|e| e.to_string()) })
/// #     .await.map_err(|e| e.to_string())??;
/// # host.shutdown().await;
/// # Ok(()) }).await }
/// # async fn run(ctx: Rc<dyn durability_platform::Context>) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use durability::{DurableCall, HandlerError, OperationResult, Operations, Scheduler};
///
/// let scheduler = Scheduler::new(ctx)?;
/// let operations = Operations::builder(&scheduler)
///     .handler("charge", |call: DurableCall<u64>| async move {
///         // charge call.payload cents, idempotently keyed by call.id
///         Ok::<_, HandlerError>(format!("receipt for {}", call.payload))
///     })
///     .build()?;
///
/// operations.start("charge", "order-17", &1_250_u64).await?;
/// let done = operations
///     .wait::<String>("charge", "order-17", Duration::from_secs(5))
///     .await?;
/// assert_eq!(done, OperationResult::Completed { result: "receipt for 1250".into() });
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Operations {
    inner: Rc<Inner>,
}

struct Inner {
    engine: Rc<Engine>,
    handlers: HashMap<String, ErasedHandler>,
    policies: Policies,
    include_result: bool,
    max_payload_bytes: usize,
    emitter: Emitter,
    active: ActiveMap,
    trace: Option<TraceCapture>,
    /// Ids whose attempt was claimed ahead of their execution (an eager
    /// start, a hand-off) and whose claimer has not started it yet. Any
    /// other execution leaves them alone: claiming again would spend an
    /// attempt for nothing, and enough of those fail the operation.
    reserved: RefCell<HashSet<String>>,
}

/// Reads one call row by id: the columns [`CallRow::decode`] takes, in
/// its order.
const READ_CALL: &str = "SELECT id, operation, payload, status, result, attempt, \
     next_attempt_at, last_error, last_error_name, generation_id, created_at \
     FROM durability_calls WHERE id = ?";

struct CallRow {
    id: String,
    operation: String,
    payload: String,
    status: String,
    result: Option<String>,
    attempt: u32,
    next_attempt_at: EpochMs,
    last_error: Option<String>,
    last_error_name: Option<String>,
    generation: String,
    created_at: EpochMs,
}

impl CallRow {
    fn read(sql: &dyn Sql, id: &str) -> Result<Option<CallRow>, DurabilityError> {
        match sql.query_row(READ_CALL, &params![id])? {
            None => Ok(None),
            Some(row) => CallRow::decode(&row, id).map(Some),
        }
    }

    fn decode(row: &Row, key: &str) -> Result<CallRow, DurabilityError> {
        let decoded = (|| -> Result<CallRow, StorageError> {
            Ok(CallRow {
                id: row.get(0)?,
                operation: row.get(1)?,
                payload: row.get(2)?,
                status: row.get(3)?,
                result: row.get(4)?,
                attempt: row.get(5)?,
                next_attempt_at: row.get(6)?,
                last_error: row.get(7)?,
                last_error_name: row.get(8)?,
                generation: row.get(9)?,
                created_at: row.get(10)?,
            })
        })();
        decoded.map_err(|error| DurabilityError::Decode {
            table: CALLS.name,
            key: key.to_owned(),
            detail: error.to_string(),
        })
    }
}

impl Operations {
    /// Starts configuring the operations of the object behind `scheduler`.
    pub fn builder(scheduler: &Scheduler) -> OperationsBuilder {
        OperationsBuilder {
            scheduler: scheduler.clone(),
            handlers: HashMap::new(),
            policy: PolicyOptions::default(),
            attempt_timeout: None,
            include_result: false,
            max_payload_bytes: DEFAULT_MAX_BODY_BYTES,
            hooks: Vec::new(),
            trace: None,
        }
    }

    /// Registers operation `operation` under the idempotency `id`. Returns
    /// once the row and the alarm have committed; never waits for the
    /// handler. An id already registered for this operation writes nothing;
    /// an operation without a handler here is rejected and writes nothing.
    /// An empty id, one longer than [`limits::MAX_ID_BYTES`], a payload
    /// larger than `max_payload_bytes` or nested deeper than the codec
    /// allows is a typed error, and writes nothing.
    pub async fn start<P: Serialize + ?Sized>(
        &self,
        operation: &str,
        id: &str,
        payload: &P,
    ) -> Result<Registration, DurabilityError> {
        let inner = &self.inner;
        if !inner.handlers.contains_key(operation) {
            return Err(DurabilityError::UnknownHandler {
                kind: "operation",
                name: operation.to_owned(),
            });
        }
        limits::check_id("id", id)?;
        let payload = codec::encode(payload)?;
        limits::check_body(
            "payload",
            codec::body_bytes(&payload),
            inner.max_payload_bytes,
            "max_payload_bytes",
        )?;
        let engine = &inner.engine;
        let now = engine.now();
        let generation = engine.new_generation();
        let trace_context = crate::trace::capture(inner.trace.as_ref());
        // Eager start only when a permit is free right now; otherwise the
        // timer armed by the commit queues for one. With a permit, the
        // first attempt is claimed in the registration's own transaction:
        // one commit instead of two, and the attempt still counts before
        // the handler runs. The claim is the insert itself (the row starts
        // at attempt 1): what a claim's `attempt + 1` would make of the
        // fresh row, without a second statement.
        let permit = engine.try_acquire_permit();
        let max_attempts = inner.policies.resolve(operation).max_attempts;
        let claim_on_insert = permit.is_some() && max_attempts >= 1;
        let first_attempt = u32::from(claim_on_insert);
        let insert = "INSERT INTO durability_calls \
             (id, operation, payload, status, result, attempt, next_attempt_at, last_error, \
              last_error_name, completed_at, generation_id, created_at) \
             VALUES (?, ?, ?, 'pending', NULL, ?, ?, NULL, NULL, NULL, ?, ?) \
             ON CONFLICT(id) DO NOTHING";
        let tracked = Cell::new(false);
        let registered = engine
            .transaction(|sql| {
                let inserted = sql.execute(
                    insert,
                    &params![
                        id,
                        operation,
                        payload.as_str(),
                        first_attempt,
                        now,
                        generation.as_str(),
                        now
                    ],
                )? == 1;
                if !inserted {
                    // The id is taken: by this operation (nothing to
                    // write) or by another one (an error).
                    let Some(row) = CallRow::read(sql, id)? else {
                        return Err(DurabilityError::NotPersisted { id: id.to_owned() });
                    };
                    if row.operation != operation {
                        return Err(DurabilityError::DuplicateCall {
                            id: id.to_owned(),
                            existing: row.operation,
                            requested: operation.to_owned(),
                        });
                    }
                    return Ok(None);
                }
                if let Some(context) = &trace_context {
                    crate::trace::store(sql, CALLS, id, &generation, now, context)?;
                }
                let claimed = claim_on_insert.then_some(first_attempt);
                if claimed.is_some() {
                    // Running from now on, for the reconcile of this very
                    // transaction too: it arms no timer for the record the
                    // eager start is about to run.
                    engine.track_active(CALLS.name, id);
                    tracked.set(true);
                }
                Ok(Some(claimed))
            })
            .await;
        if registered.is_err() && tracked.get() {
            engine.release_active(CALLS.name, id);
        }
        let registered = registered?;
        let Some(claimed) = registered else {
            return Ok(Registration::Existing);
        };
        inner.emitter.emit(&LifecycleEvent::Registered {
            entity: Entity::Operation {
                operation: operation.to_owned(),
                id: id.to_owned(),
                generation: generation.clone(),
            },
            timestamp: now,
        });
        if let (Some(permit), Some(attempt)) = (permit, claimed) {
            // What the registration stored is known: the row it inserted
            // (nothing else writes a pending row of an id this instance
            // reserved; a completion checks the generation and the attempt
            // anyway) and the trace context, so the attempt reads neither.
            let row = CallRow {
                id: id.to_owned(),
                operation: operation.to_owned(),
                payload,
                status: "pending".to_owned(),
                result: None,
                attempt,
                next_attempt_at: now,
                last_error: None,
                last_error_name: None,
                generation: generation.clone(),
                created_at: now,
            };
            let trace = Some(trace_context);
            inner.reserved.borrow_mut().insert(id.to_owned());
            let run = Rc::clone(inner);
            let operation = operation.to_owned();
            let id = id.to_owned();
            let claimed = Claimed {
                key: id.clone(),
                generation,
                attempt,
            };
            // Run in the caller's span, so the attempt links to the producer.
            let task = async move {
                let start = Start {
                    eager_permit: Some(permit),
                    claimed: Some(claimed),
                    trace,
                    ..Start::default()
                };
                run.release_claim(&id);
                if let Err(error) = run.run_row(row, start).await {
                    tracing::error!(
                        event = "durability.background_execution.failed",
                        operation = %operation,
                        id = %id,
                        %error,
                        "eager operation start failed"
                    );
                    // Every settlement reconciles in its own transaction;
                    // only a start that failed before one needs a re-arm.
                    run.engine.release_active(CALLS.name, &id);
                    if let Err(error) = run.engine.schedule_next_alarm().await {
                        tracing::error!(
                            event = "durability.background_execution.failed",
                            operation = %operation,
                            id = %id,
                            %error,
                            "re-arming after an eager start failed"
                        );
                    }
                }
            };
            engine
                .ctx
                .wait_until(Box::pin(tracing::Instrument::in_current_span(task)));
        }
        Ok(Registration::Created)
    }

    /// Reads the state of operation `operation` registered under `id`.
    /// Never changes anything.
    ///
    /// The name is asked beside the id on purpose: the result is decoded
    /// as the caller's `R`, which belongs to one operation, and ids are the
    /// caller's own strings, so reading an id under the wrong operation is
    /// a mix-up worth an error rather than a decode failure or a wrong
    /// value. It is [`DurabilityError::OperationMismatch`] naming both
    /// operations (a registration under the wrong name, by contrast, is
    /// [`DurabilityError::DuplicateCall`]).
    pub fn result<R: DeserializeOwned>(
        &self,
        operation: &str,
        id: &str,
    ) -> Result<OperationResult<R>, DurabilityError> {
        let Some(row) = CallRow::read(self.inner.engine.sql(), id)? else {
            return Ok(OperationResult::NotFound);
        };
        result_of(row, operation)
    }

    /// Waits up to `timeout` for the operation to settle (complete, fail for
    /// good, or be purged), then returns its state. In memory only: a wait
    /// does not survive eviction, and a zero timeout just reads. A wrong
    /// name answers at once with [`DurabilityError::OperationMismatch`], as
    /// [`Operations::result`] does.
    pub async fn wait<R: DeserializeOwned>(
        &self,
        operation: &str,
        id: &str,
        timeout: Duration,
    ) -> Result<OperationResult<R>, DurabilityError> {
        let engine = &self.inner.engine;
        let Some(row) = CallRow::read(engine.sql(), id)? else {
            return Ok(OperationResult::NotFound);
        };
        if row.status != "pending" || timeout.is_zero() || row.operation != operation {
            return result_of(row, operation);
        }
        let generation = row.generation;
        let woken = Rc::new(tokio::sync::Notify::new());
        let listener = {
            let woken = Rc::clone(&woken);
            Rc::new(move |_: Option<&crate::scheduler::SettledRow>| woken.notify_one())
        };
        // Subscribe first, then re-read, so a settlement in between is seen.
        let _guard = engine.watch(CALLS, id, listener);
        let deadline = engine.ctx.sleep(timeout);
        futures::pin_mut!(deadline);
        loop {
            match CallRow::read(engine.sql(), id)? {
                Some(row) if row.status == "pending" && row.generation == generation => {}
                Some(row) => return result_of(row, operation),
                None => return Ok(OperationResult::NotFound),
            }
            let notified = woken.notified();
            futures::pin_mut!(notified);
            if let futures::future::Either::Right(_) =
                futures::future::select(notified, deadline.as_mut()).await
            {
                return self.result(operation, id);
            }
        }
    }

    /// Deletes every operation (any status) registered before `before`
    /// (epoch ms) and aborts their running attempts; returns how many were
    /// deleted. A purged id can be registered again at once.
    pub async fn purge_before(&self, before: EpochMs) -> Result<u64, DurabilityError> {
        let inner = &self.inner;
        let count = inner
            .engine
            .purge(
                CALLS,
                before,
                &inner.active,
                "Durable operation was purged",
                &[],
            )
            .await?;
        inner.emitter.emit(&LifecycleEvent::Purged {
            entity_kind: EntityKind::Operation,
            timestamp: inner.engine.now(),
            before,
            count,
        });
        Ok(count)
    }

    /// Runs due work of every capability on the scheduler (the same as
    /// [`Scheduler::alarm`]).
    pub async fn alarm(&self, info: Option<AlarmInfo>) -> Result<(), DurabilityError> {
        self.inner.engine.alarm(info).await
    }

    /// Migrates the operations schema of `storage` to `target` explicitly.
    pub fn migrate(
        storage: &dyn durability_platform::Storage,
        target: MigrationTarget,
    ) -> Result<MigrationReport, DurabilityError> {
        let report = migrations::migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            target,
        )?;
        crate::memo::delete_memos_of_dropped_table(storage, CALLS)?;
        Ok(report)
    }
}

/// The failure of an attempt whose stored payload does not decode.
///
/// A payload of the wrong *type* (the handler's `P` changed) is an ordinary,
/// retryable failure: a fixed deployment may read it. Stored text that is
/// not the stored format at all (not JSON, or JSON without the
/// `{"kind":"value","value":...}` envelope, such as a raw row written as
/// `'null'`) can never decode, whatever is deployed: it fails the operation
/// for good at once, with a stored error saying what is wrong and what the
/// format is, logged once, instead of burning its attempts as if the
/// handler had failed.
fn payload_error(input: &CallInput, error: CodecError) -> HandlerError {
    match error {
        CodecError::Malformed { .. } | CodecError::Envelope { .. } => {
            let message = format!(
                "the stored payload of operation \"{}\" (id \"{}\") is not in the stored format: {error}; \
                 payloads are stored as {{\"kind\":\"value\",\"value\":<json>}} or {{\"kind\":\"undefined\"}}, \
                 so a row written by hand must wrap its JSON in that envelope",
                input.operation, input.id
            );
            tracing::error!(
                operation = %input.operation,
                id = %input.id,
                %error,
                "stored payload is not in the stored format; the operation fails without retries"
            );
            HandlerError::non_retryable(message)
        }
        other => HandlerError::from(other),
    }
}

fn result_of<R: DeserializeOwned>(
    row: CallRow,
    operation: &str,
) -> Result<OperationResult<R>, DurabilityError> {
    if row.operation != operation {
        return Err(DurabilityError::OperationMismatch {
            id: row.id,
            registered: row.operation,
            requested: operation.to_owned(),
        });
    }
    match row.status.as_str() {
        "pending" => Ok(OperationResult::Pending {
            attempt: row.attempt,
            next_attempt_at: row.next_attempt_at,
            last_error: row.last_error,
        }),
        "failed" => Ok(OperationResult::Failed {
            attempt: row.attempt,
            error: SerializedError::new(
                row.last_error_name.unwrap_or_else(|| "Error".into()),
                row.last_error
                    .unwrap_or_else(|| "Durable operation failed".into()),
            ),
        }),
        "completed" => {
            let Some(text) = row.result else {
                return Err(DurabilityError::CompletedWithoutResult { id: row.id });
            };
            let result = codec::decode_as::<R>(&text).map_err(|error| DurabilityError::Decode {
                table: CALLS.name,
                key: row.id.clone(),
                detail: error.to_string(),
            })?;
            Ok(OperationResult::Completed { result })
        }
        other => Err(DurabilityError::Decode {
            table: CALLS.name,
            key: row.id,
            detail: format!("unknown status {other:?}"),
        }),
    }
}

/// How an execution starts, beside the id it runs.
#[derive(Default)]
struct Start {
    /// An eager start's permit; released on return when none starts.
    eager_permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The attempt already claimed for it (a claimed attempt stays counted
    /// when none starts, as after a crash before its handler ran).
    claimed: Option<Claimed>,
    /// The trace context stored for this generation, when the caller knows
    /// it (the eager start that registered it): the attempt skips reading
    /// it.
    trace: Option<Option<String>>,
    /// Takes the next record of a due pass when this one completes.
    successor: Option<Rc<dyn Successor>>,
    /// The platform alarm that started the pass.
    platform: Option<AlarmInfo>,
}

impl Inner {
    /// Runs the pending generation of `id` unless this instance already
    /// runs it, as `start` says.
    async fn execute(self: &Rc<Self>, id: &str, start: Start) -> Result<(), DurabilityError> {
        if start.claimed.is_some() {
            self.release_claim(id);
        } else if self.reserved.borrow().contains(id) {
            // Claimed for another execution, which is about to start it.
            return Ok(());
        } else if self.engine.live_timers && self.active.borrow().contains_key(id) {
            // Running here already (a due pass lists running records too):
            // its settlement re-arms the timer. The pending row of an id
            // running here is the running generation's (only a settled row
            // can be purged and registered anew), so there is nothing to
            // read.
            return Ok(());
        }
        let Some(row) = CallRow::read(self.engine.sql(), id)? else {
            return Ok(());
        };
        self.run_row(row, start).await
    }

    /// The claimer of `id` starts it now (no await until it is active).
    /// The claim marked it running for the timer; `start_execution` marks
    /// it again, with no await in between.
    fn release_claim(&self, id: &str) {
        self.reserved.borrow_mut().remove(id);
        self.engine.release_active(CALLS.name, id);
    }

    /// [`Inner::execute`] once the row is in hand.
    async fn run_row(self: &Rc<Self>, row: CallRow, start: Start) -> Result<(), DurabilityError> {
        let Start {
            eager_permit,
            claimed,
            trace,
            successor,
            platform,
        } = start;
        if row.status != "pending" {
            return Ok(());
        }
        // A claim made for a generation that was replaced since is void.
        let claimed = claimed
            .filter(|c| c.generation == row.generation && c.attempt == row.attempt)
            .map(|c| c.attempt);
        // A known trace context is the claimed generation's.
        let trace = trace.filter(|_| claimed.is_some());
        let running = self
            .active
            .borrow()
            .get(&row.id)
            .filter(|active| active.generation == row.generation)
            .map(|active| active.settled());
        if let Some(settled) = running {
            drop(eager_permit);
            // Under live timers a due pass does not wait behind a running
            // handler; its own settlement re-arms the timer.
            if !self.engine.live_timers {
                settled.await;
            }
            return Ok(());
        }
        let policy = self.policies.resolve(&row.operation);
        let spec = ExecutionSpec {
            table: CALLS,
            key: row.id.clone(),
            generation: row.generation.clone(),
            created_at: row.created_at,
            label: format!("operation \"{}\"", row.operation),
            entity: Entity::Operation {
                operation: row.operation.clone(),
                id: row.id.clone(),
                generation: row.generation.clone(),
            },
            active: self.active.clone(),
            policy: policy.clone(),
            emitter: self.emitter.clone(),
            include_result: self.include_result,
            kind: Rc::new(OperationAttempt {
                inner: Rc::downgrade(self),
                id: row.id,
                operation: row.operation,
                payload: row.payload,
                generation: row.generation,
                max_attempts: policy.max_attempts,
                attempt_timeout_ms: policy.attempt_timeout_ms,
                platform,
                trace,
            }),
            claimed,
            successor,
        };
        self.engine.start_execution(spec, eager_permit).await
    }
}

impl Inner {
    /// Runs the due `ids` on at most `alarm_concurrency` lanes, each taking
    /// the next id in order when its previous one finished. A lane whose
    /// attempt completes claims the next id in the completion's own
    /// transaction (one commit instead of two) and runs it next.
    async fn run_lanes(
        self: &Rc<Self>,
        ids: Vec<String>,
        now: EpochMs,
        info: Option<AlarmInfo>,
    ) -> Vec<(String, Result<(), DurabilityError>)> {
        // No more lanes than ids: a lane without an id ends at once, but
        // thousands of them (alarm_concurrency goes up to 10,000) made
        // every pass allocate and poll them all (fuzz seed 1000001 case
        // 956589 spun on that).
        let lanes = self.engine.alarm_concurrency.clamp(1, ids.len().max(1));
        let queue = Rc::new(RefCell::new(VecDeque::from(ids)));
        let lanes = (0..lanes).map(|_| {
            let queue = Rc::clone(&queue);
            async move {
                let mut results = Vec::new();
                let mut next = queue.borrow_mut().pop_front().map(|id| (id, None));
                while let Some((id, claimed)) = next.take() {
                    let handoff = Rc::new(Handoff {
                        inner: Rc::downgrade(self),
                        queue: Rc::clone(&queue),
                        due_by: now,
                        taken: RefCell::new(None),
                    });
                    let successor: Rc<dyn Successor> = Rc::clone(&handoff) as Rc<dyn Successor>;
                    let start = Start {
                        claimed,
                        successor: Some(successor),
                        platform: info,
                        ..Start::default()
                    };
                    let outcome = self.execute(&id, start).await;
                    results.push((id, outcome));
                    next = match handoff.taken.borrow_mut().take() {
                        Some(claimed) => Some((claimed.key.clone(), Some(claimed))),
                        None => queue.borrow_mut().pop_front().map(|id| (id, None)),
                    };
                }
                results
            }
        });
        futures::future::join_all(lanes)
            .await
            .into_iter()
            .flatten()
            .collect()
    }
}

/// The hand-off of one lane of a due pass: the next id of the pass,
/// claimed by the transaction that completes the lane's current attempt.
struct Handoff {
    inner: Weak<Inner>,
    queue: Rc<RefCell<VecDeque<String>>>,
    /// The pass's time: only records due by then are taken.
    due_by: EpochMs,
    taken: RefCell<Option<Claimed>>,
}

impl Successor for Handoff {
    fn claim(&self, sql: &dyn Sql, now: EpochMs) -> Result<Option<Claimed>, StorageError> {
        let Some(inner) = self.inner.upgrade() else {
            return Ok(None);
        };
        let Some(id) = self.queue.borrow().front().cloned() else {
            return Ok(None);
        };
        // Running or claimed in this instance already: the lane that takes
        // it waits for it as usual.
        if inner.active.borrow().contains_key(&id) || inner.reserved.borrow().contains(&id) {
            return Ok(None);
        }
        let row = match CallRow::read(sql, &id) {
            Ok(Some(row)) => row,
            // Gone, or not readable: the lane's own execute says why.
            Ok(None) | Err(_) => return Ok(None),
        };
        if row.status != "pending" || row.next_attempt_at > self.due_by.max(now) {
            return Ok(None);
        }
        let max_attempts = inner.policies.resolve(&row.operation).max_attempts;
        let Some(attempt) = claim_attempt(sql, CALLS, &id, &row.generation, max_attempts, None)?
        else {
            return Ok(None);
        };
        // Taken for this lane now, before the commit (see `Successor`).
        {
            let mut queue = self.queue.borrow_mut();
            if let Some(at) = queue.iter().position(|queued| *queued == id) {
                queue.remove(at);
            }
        }
        inner.reserved.borrow_mut().insert(id.clone());
        inner.engine.track_active(CALLS.name, &id);
        let claimed = Claimed {
            key: id,
            generation: row.generation,
            attempt,
        };
        *self.taken.borrow_mut() = Some(claimed.clone());
        Ok(Some(claimed))
    }

    fn abandon(&self, claimed: &Claimed) {
        self.taken.borrow_mut().take();
        self.queue.borrow_mut().push_front(claimed.key.clone());
        if let Some(inner) = self.inner.upgrade() {
            inner.reserved.borrow_mut().remove(&claimed.key);
            inner.engine.release_active(CALLS.name, &claimed.key);
        }
    }
}

impl Participant for Inner {
    fn table(&self) -> DurableTable {
        CALLS
    }

    fn run_due(
        self: Rc<Self>,
        now: EpochMs,
        info: Option<AlarmInfo>,
    ) -> LocalBoxFuture<'static, Result<(), DurabilityError>> {
        Box::pin(async move {
            // Covered by durability_calls_pending_idx (status, next_attempt_at).
            let rows = self.engine.sql().query(
                "SELECT id FROM durability_calls WHERE status = 'pending' AND next_attempt_at <= ? \
                 ORDER BY next_attempt_at ASC LIMIT ?",
                &params![now, DUE_BATCH],
            )?;
            let mut ids = Vec::with_capacity(rows.len());
            for row in &rows {
                ids.push(row.get::<String>(0)?);
            }
            let results = self.run_lanes(ids, now, info).await;
            // One failing operation must not hold back the others: every
            // item ran. Its record stays pending and due, though, so the
            // failure must fail the run: a successful run would reconcile
            // and re-arm the in-memory timer for that past-due record at
            // once, looping without pause (a row that does not decode never
            // stops failing). A failed run arms the fallback alarm instead,
            // which retries after `alarm_min_delay`.
            let mut first_error = None;
            for (id, outcome) in results {
                if let Err(error) = outcome {
                    tracing::error!(id = %id, %error, "operation execution failed");
                    first_error.get_or_insert(error);
                }
            }
            first_error.map_or(Ok(()), Err)
        })
    }
}

struct OperationAttempt {
    inner: Weak<Inner>,
    id: String,
    operation: String,
    payload: String,
    generation: String,
    max_attempts: u32,
    attempt_timeout_ms: u64,
    platform: Option<AlarmInfo>,
    /// The stored trace context, when known without a read.
    trace: Option<Option<String>>,
}

impl AttemptKind for OperationAttempt {
    fn completion_ends_the_record(&self) -> bool {
        true
    }

    fn exhausted_error(&self) -> HandlerError {
        HandlerError::attempts_exhausted("operation", &self.operation, self.max_attempts)
    }

    fn timeout_error(&self) -> HandlerError {
        HandlerError::attempt_timeout(&self.operation, self.attempt_timeout_ms)
    }

    fn invoke(
        &self,
        attempt: u32,
        signal: AbortSignal,
    ) -> LocalBoxFuture<'static, Result<Output, HandlerError>> {
        let Some(inner) = self.inner.upgrade() else {
            return Box::pin(std::future::ready(Err(HandlerError::new(
                "the operations helper was dropped",
            ))));
        };
        let Some(handler) = inner.handlers.get(&self.operation).cloned() else {
            return Box::pin(std::future::ready(Err(HandlerError::no_operation_handler(
                &self.operation,
            ))));
        };
        let memo = Memo::new(
            Rc::clone(&inner.engine.ctx),
            CALLS,
            AttemptRef {
                key: self.id.clone(),
                generation: self.generation.clone(),
                attempt,
            },
        )
        .max_value_bytes(inner.max_payload_bytes, "max_payload_bytes");
        let trace_context = match &self.trace {
            Some(known) => known.clone(),
            None => crate::trace::load(inner.engine.sql(), CALLS, &self.id, &self.generation)
                .unwrap_or_else(|error| {
                    tracing::warn!(%error, "trace context unreadable; the attempt runs without it");
                    None
                }),
        };
        if let Some(context) = &trace_context {
            tracing::Span::current().record("producer", context.as_str());
        }
        handler(CallInput {
            id: self.id.clone(),
            operation: self.operation.clone(),
            payload: self.payload.clone(),
            attempt,
            signal,
            memo,
            trace_context,
            platform: self.platform,
        })
    }

    fn complete(
        &self,
        sql: &dyn Sql,
        output: &Output,
        attempt: u32,
        now: EpochMs,
    ) -> Result<Option<EpochMs>, HandlerError> {
        let encoded = match output {
            Output::Encoded(Ok(text)) => text.clone(),
            Output::Encoded(Err(cause)) => {
                return Err(HandlerError::result_serialization(
                    &self.operation,
                    HandlerError::from(cause.clone()),
                ));
            }
            Output::Unit => codec::encode_value(None)?,
        };
        // A result is a body like the payload: the same limit (issue 10).
        // Too large, the attempt fails like an unserializable result.
        let max_bytes = self
            .inner
            .upgrade()
            .map_or(limits::DEFAULT_MAX_BODY_BYTES, |inner| {
                inner.max_payload_bytes
            });
        if let Err(error) = limits::check_body(
            "result",
            codec::body_bytes(&encoded),
            max_bytes,
            "max_payload_bytes",
        ) {
            return Err(HandlerError::result_serialization(&self.operation, error));
        }
        let owned = crate::record::update_attempt(
            sql,
            CALLS,
            &AttemptRef {
                key: self.id.clone(),
                generation: self.generation.clone(),
                attempt,
            },
            "status = 'completed', result = ?, last_error = NULL, last_error_name = NULL, \
             completed_at = ?",
            &params![encoded, now],
        )?;
        Ok(owned.then_some(now))
    }

    fn is_terminal(&self, error: &HandlerError) -> bool {
        error.kind() == Some(crate::error::LibraryErrorKind::ResultSerialization)
    }
}
