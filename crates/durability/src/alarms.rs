//! Named alarms: logical alarms multiplexed onto the object's one physical
//! alarm.
//!
//! Each name has at most one pending occurrence; scheduling again replaces
//! it (a new generation, attempt 0, errors cleared). Each occurrence carries
//! an idempotency key that is stable across its retries and different from
//! every other occurrence's. At most one handler per name runs in one
//! instance, across generations: a replacement scheduled while the old
//! handler runs waits for it, and the old handler's success deletes only its
//! own generation, never the replacement.
//!
//! Owns the `durability_alarms` table; all its SQL is in this module.

use std::collections::HashMap;
use std::future::Future;
use std::rc::{Rc, Weak};
use std::time::Duration;

use durability_platform::{AlarmInfo, EpochMs, LocalBoxFuture, Row, Sql, StorageError, params};

use crate::error::{ConfigError, DurabilityError, HandlerError, LibraryErrorKind};
use crate::lifecycle::{Emitter, Entity, EntityKind, LifecycleEvent, LifecycleHook};
use crate::limits;
use crate::memo::Memo;
use crate::migrations::{
    self, MigrationReport, MigrationTarget, NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS,
};
use crate::record::{AttemptRef, DurableTable, delete_attempt};
use crate::retry::{Delay, MethodPolicy, Policies, PolicyOptions, whole_millis};
use crate::scheduler::attempt::{ActiveMap, AttemptKind, ExecutionSpec, Output};
use crate::scheduler::{AbortSignal, Engine, Participant, Scheduler};

/// The record table of named alarms.
pub const ALARMS: DurableTable = DurableTable {
    name: "durability_alarms",
    key: "name",
};

/// The prefix of every occurrence's idempotency key; the rest is the
/// occurrence's generation id.
pub const IDEMPOTENCY_KEY_PREFIX: &str = "durability-alarm:v1:";

const DUE_BATCH: i64 = 100;

/// What a named alarm's handler receives for one attempt.
pub struct AlarmCall {
    /// The alarm's name.
    pub name: String,
    /// The time the occurrence was scheduled for (epoch ms).
    pub scheduled_time: EpochMs,
    /// This attempt of the occurrence, from 1.
    pub attempt: u32,
    /// `attempt > 1`.
    pub is_retry: bool,
    /// `attempt - 1`.
    pub retry_count: u32,
    /// The same for every attempt of this occurrence, different for every
    /// other occurrence: key side effects by it.
    pub idempotency_key: String,
    /// Aborts at the attempt's timeout or when the occurrence is purged.
    pub signal: AbortSignal,
    /// The physical alarm's invocation info when the run came from it;
    /// `None` for runs of the in-memory timer.
    pub platform: Option<AlarmInfo>,
    /// Persists a step's result so a retried attempt reuses it.
    pub memo: Memo,
}

type ErasedHandler = Rc<dyn Fn(AlarmCall) -> LocalBoxFuture<'static, Result<(), HandlerError>>>;

/// Configures [`Alarms`].
pub struct AlarmsBuilder {
    scheduler: Scheduler,
    handlers: HashMap<String, ErasedHandler>,
    policy: PolicyOptions,
    attempt_timeout: Option<Duration>,
    hooks: Vec<LifecycleHook>,
}

impl AlarmsBuilder {
    /// Registers the handler of the alarm `name`.
    pub fn handler<F, Fut>(mut self, name: &str, handler: F) -> Self
    where
        F: Fn(AlarmCall) -> Fut + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + 'static,
    {
        let erased: ErasedHandler = Rc::new(move |call| Box::pin(handler(call)));
        self.handlers.insert(name.to_owned(), erased);
        self
    }

    /// Attempts per occurrence, the first included. Default 5.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.policy = self.policy.max_attempts(attempts);
        self
    }

    /// How long one attempt may run. Default 5 min; whole milliseconds,
    /// from 1 ms to 2^31 - 1 ms. A timed-out attempt is
    /// terminal unless the alarm's policy sets `retry_timeouts`.
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

    /// Overrides the policy of one alarm, field by field (including
    /// `retry_timeouts`).
    pub fn method(mut self, name: &str, policy: MethodPolicy) -> Self {
        self.policy = self.policy.method(name, policy);
        self
    }

    /// Adds a lifecycle hook (best effort, never changes state).
    pub fn on_lifecycle_event(mut self, hook: LifecycleHook) -> Self {
        self.hooks.push(hook);
        self
    }

    /// Validates the policy, migrates the schema and attaches to the
    /// scheduler.
    pub fn build(self) -> Result<Alarms, DurabilityError> {
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
        let engine = Rc::clone(&self.scheduler.engine);
        let emitter =
            engine.prepare_records(NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS, self.hooks)?;
        let inner = Rc::new(Inner {
            engine: Rc::clone(&engine),
            handlers: self.handlers,
            policies,
            emitter,
            active: ActiveMap::default(),
        });
        engine.register(&inner)?;
        Ok(Alarms { inner })
    }
}

/// The named alarms of one object. Cloning is one reference-count increment.
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
/// use std::cell::Cell;
/// use std::time::Duration;
/// use durability::{AlarmCall, Alarms, HandlerError, Scheduler};
/// let scheduler = Scheduler::new(ctx)?;
/// let fired = Rc::new(Cell::new(0));
/// let counter = Rc::clone(&fired);
/// let alarms = Alarms::builder(&scheduler)
///     .handler("cleanup", move |call: AlarmCall| {
///         // delete expired rows, keyed by call.idempotency_key
///         counter.set(counter.get() + 1);
///         async { Ok::<_, HandlerError>(()) }
///     })
///     .build()?;
/// let soon = scheduler.now_ms() + 1_000;
/// alarms.schedule("cleanup", soon).await?;
/// alarms.schedule("cleanup", soon + 500).await?; // replaces the pending one
/// tokio::time::sleep(Duration::from_secs(2)).await;
/// assert_eq!(fired.get(), 1);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Alarms {
    inner: Rc<Inner>,
}

struct Inner {
    engine: Rc<Engine>,
    handlers: HashMap<String, ErasedHandler>,
    policies: Policies,
    emitter: Emitter,
    active: ActiveMap,
}

struct DueAlarm {
    name: String,
    generation: String,
    created_at: EpochMs,
    scheduled_at: EpochMs,
}

impl DueAlarm {
    /// Decodes one due row; a row that does not decode is reported with the
    /// table and its name, so it can be found and rescheduled.
    fn decode(row: &Row) -> Result<DueAlarm, DurabilityError> {
        let decoded = (|| -> Result<DueAlarm, StorageError> {
            Ok(DueAlarm {
                name: row.get(0)?,
                generation: row.get(1)?,
                created_at: row.get(2)?,
                scheduled_at: row.get(3)?,
            })
        })();
        decoded.map_err(|error| DurabilityError::Decode {
            table: ALARMS.name,
            key: row
                .get::<String>(0)
                .unwrap_or_else(|_| format!("{:?}", row.values().first())),
            detail: error.to_string(),
        })
    }
}

impl Alarms {
    /// Starts configuring the named alarms of the object behind `scheduler`.
    pub fn builder(scheduler: &Scheduler) -> AlarmsBuilder {
        AlarmsBuilder {
            scheduler: scheduler.clone(),
            handlers: HashMap::new(),
            policy: PolicyOptions::default(),
            attempt_timeout: None,
            hooks: Vec::new(),
        }
    }

    /// Schedules the alarm `name` for `scheduled_time` (epoch ms; a past
    /// time is due at once), replacing its pending occurrence if any. A name
    /// without a handler here is rejected and writes nothing.
    /// Returns once the row and the physical alarm have committed together.
    pub async fn schedule(
        &self,
        name: &str,
        scheduled_time: EpochMs,
    ) -> Result<(), DurabilityError> {
        DurabilityError::require_timestamp("scheduled_time", scheduled_time)?;
        let inner = &self.inner;
        if !inner.handlers.contains_key(name) {
            return Err(DurabilityError::UnknownHandler {
                kind: "named alarm",
                name: name.to_owned(),
            });
        }
        let engine = &inner.engine;
        let generation = engine.new_generation();
        let created_at = engine.now();
        engine
            .transaction(|sql| {
                // Every column is replaced, whatever the old status: a new
                // occurrence starts clean.
                sql.execute(
                    "INSERT INTO durability_alarms \
                     (name, generation_id, status, scheduled_at, next_attempt_at, attempt, \
                      last_error, last_error_name, created_at) \
                     VALUES (?, ?, 'pending', ?, ?, 0, NULL, NULL, ?) \
                     ON CONFLICT(name) DO UPDATE SET generation_id = excluded.generation_id, \
                     status = 'pending', scheduled_at = excluded.scheduled_at, \
                     next_attempt_at = excluded.next_attempt_at, attempt = 0, last_error = NULL, \
                     last_error_name = NULL, created_at = excluded.created_at",
                    &params![
                        name,
                        generation.as_str(),
                        scheduled_time,
                        scheduled_time,
                        created_at
                    ],
                )?;
                Ok::<_, StorageError>(())
            })
            .await?;
        inner.emitter.emit(&LifecycleEvent::Scheduled {
            entity: Entity::NamedAlarm {
                alarm: name.to_owned(),
                generation,
            },
            timestamp: created_at,
            scheduled_time,
        });
        Ok(())
    }

    /// Deletes every occurrence (any status) scheduled before `before`
    /// (epoch ms of the scheduling call) and aborts their running attempts;
    /// returns how many were deleted. An aborted handler that keeps running
    /// still holds its name: a replacement waits until it ends.
    pub async fn purge_before(&self, before: EpochMs) -> Result<u64, DurabilityError> {
        let inner = &self.inner;
        let count = inner
            .engine
            .purge(ALARMS, before, &inner.active, "Durable alarm was purged")
            .await?;
        inner.emitter.emit(&LifecycleEvent::Purged {
            entity_kind: EntityKind::NamedAlarm,
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

    /// Migrates the named-alarms schema of `storage` to `target` explicitly.
    pub fn migrate(
        storage: &dyn durability_platform::Storage,
        target: MigrationTarget,
    ) -> Result<MigrationReport, DurabilityError> {
        let report = migrations::migrate(
            storage,
            NAMED_ALARMS_CAPABILITY,
            NAMED_ALARMS_MIGRATIONS,
            target,
        )?;
        crate::memo::delete_memos_of_dropped_table(storage, ALARMS)?;
        Ok(report)
    }
}

impl Inner {
    /// Runs one due occurrence unless a handler of the same name (any
    /// generation) is active here; then it waits for that one instead, and a
    /// replacement runs on a later pass.
    async fn execute(
        self: &Rc<Self>,
        due: DueAlarm,
        info: Option<AlarmInfo>,
    ) -> Result<(), DurabilityError> {
        let running = self.active.borrow().get(&due.name).map(|a| a.settled());
        if let Some(settled) = running {
            if !self.engine.live_timers {
                settled.await;
            }
            return Ok(());
        }
        let policy = self.policies.resolve(&due.name);
        let spec = ExecutionSpec {
            table: ALARMS,
            key: due.name.clone(),
            generation: due.generation.clone(),
            created_at: due.created_at,
            label: format!("named alarm \"{}\"", due.name),
            entity: Entity::NamedAlarm {
                alarm: due.name.clone(),
                generation: due.generation.clone(),
            },
            active: self.active.clone(),
            policy: policy.clone(),
            emitter: self.emitter.clone(),
            include_result: false,
            kind: Rc::new(AlarmAttempt {
                inner: Rc::downgrade(self),
                name: due.name,
                generation: due.generation,
                scheduled_at: due.scheduled_at,
                platform: info,
                max_attempts: policy.max_attempts,
                attempt_timeout_ms: policy.attempt_timeout_ms,
                retry_timeouts: policy.retry_timeouts,
            }),
        };
        self.engine.start_execution(spec, None).await
    }
}

impl Participant for Inner {
    fn table(&self) -> DurableTable {
        ALARMS
    }

    fn run_due(
        self: Rc<Self>,
        now: EpochMs,
        info: Option<AlarmInfo>,
    ) -> LocalBoxFuture<'static, Result<(), DurabilityError>> {
        Box::pin(async move {
            // Covered by durability_alarms_pending_idx (status, next_attempt_at).
            let rows = self.engine.sql().query(
                "SELECT name, generation_id, created_at, scheduled_at FROM durability_alarms \
                 WHERE status = 'pending' AND next_attempt_at <= ? \
                 ORDER BY next_attempt_at ASC LIMIT ?",
                &params![now, DUE_BATCH],
            )?;
            let mut due = Vec::with_capacity(rows.len());
            for row in &rows {
                due.push(DueAlarm::decode(row)?);
            }
            let this = &self;
            let results = self
                .engine
                .run_concurrent(due, |due| this.execute(due, info))
                .await;
            // Handler failures are outcomes; only bookkeeping failures reach
            // here, and they fail the run so the fallback alarm retries it.
            results.into_iter().collect::<Result<Vec<()>, _>>()?;
            Ok(())
        })
    }
}

struct AlarmAttempt {
    inner: Weak<Inner>,
    name: String,
    generation: String,
    scheduled_at: EpochMs,
    platform: Option<AlarmInfo>,
    max_attempts: u32,
    attempt_timeout_ms: u64,
    retry_timeouts: bool,
}

impl AttemptKind for AlarmAttempt {
    fn exhausted_error(&self) -> HandlerError {
        HandlerError::attempts_exhausted("named alarm", &self.name, self.max_attempts)
    }

    fn timeout_error(&self) -> HandlerError {
        HandlerError::alarm_timeout(&self.name, self.attempt_timeout_ms)
    }

    fn invoke(
        &self,
        attempt: u32,
        signal: AbortSignal,
    ) -> LocalBoxFuture<'static, Result<Output, HandlerError>> {
        let Some(inner) = self.inner.upgrade() else {
            return Box::pin(std::future::ready(Err(HandlerError::new(
                "the alarms helper was dropped",
            ))));
        };
        let Some(handler) = inner.handlers.get(&self.name).cloned() else {
            return Box::pin(std::future::ready(Err(HandlerError::no_alarm_handler(
                &self.name,
            ))));
        };
        if attempt == 1 {
            let lateness_ms = inner.engine.now().saturating_sub(self.scheduled_at);
            crate::telemetry::alarm_lateness(&self.name, lateness_ms);
        }
        let memo = Memo::new(
            Rc::clone(&inner.engine.ctx),
            ALARMS,
            AttemptRef {
                key: self.name.clone(),
                generation: self.generation.clone(),
                attempt,
            },
        );
        let running = handler(AlarmCall {
            name: self.name.clone(),
            scheduled_time: self.scheduled_at,
            attempt,
            is_retry: attempt > 1,
            retry_count: attempt.saturating_sub(1),
            idempotency_key: format!("{IDEMPOTENCY_KEY_PREFIX}{}", self.generation),
            signal,
            platform: self.platform,
            memo,
        });
        Box::pin(async move {
            running.await?;
            Ok(Output::Unit)
        })
    }

    fn complete(
        &self,
        sql: &dyn Sql,
        _output: &Output,
        attempt: u32,
        now: EpochMs,
    ) -> Result<Option<EpochMs>, HandlerError> {
        // Success deletes only the executed generation and attempt: a
        // replacement scheduled meanwhile is a different generation.
        let deleted = delete_attempt(
            sql,
            ALARMS,
            &AttemptRef {
                key: self.name.clone(),
                generation: self.generation.clone(),
                attempt,
            },
        )?;
        Ok(deleted.then_some(now))
    }

    fn is_terminal(&self, error: &HandlerError) -> bool {
        error.kind() == Some(LibraryErrorKind::AlarmTimeout) && !self.retry_timeouts
    }
}
