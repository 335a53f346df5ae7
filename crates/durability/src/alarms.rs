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
//! # Recurring schedules
//!
//! [`Alarms::schedule_recurring`] gives a name a [`Recurrence`] (a cron
//! pattern in an IANA time zone, or a fixed interval) and an optional JSON
//! payload. The schedule lives in `durability_alarm_schedules`; its one
//! pending occurrence is an ordinary row of `durability_alarms`, so it runs,
//! retries and keeps its idempotency key exactly like a one-shot alarm:
//! - one occurrence at a time: the row holds only the next one, and the
//!   per-name rule above keeps two runs of a name from overlapping;
//! - a failed attempt retries *that* occurrence by the alarm's retry
//!   policy; later ticks are not shifted (a retry that runs past them
//!   makes them missed ticks, handled by the schedule's policy);
//! - the run's success (or terminal failure) and the next occurrence are
//!   written in one transaction: the row moves to the first tick after the
//!   one that ran, with a new generation. No crash point lies between the
//!   two, so a schedule has exactly one next occurrence after any crash;
//!   a crash before that commit re-runs the same occurrence (same key),
//!   the at-least-once rule of every alarm;
//! - a terminal failure is recorded (`last_error`, kept until an
//!   occurrence succeeds) and the schedule goes on with its next tick;
//! - a tick that is missed (see [`recurrence`]) is handled when its
//!   occurrence is first picked up: the missed-tick policy rewrites the row
//!   to the tick that runs now, or to the next future tick, in one
//!   transaction, and the handler is told its tick and the missed count;
//! - registering the same schedule again (same recurrence and payload) is a
//!   no-op, so an object may register its schedules in its constructor;
//!   a different one replaces it (new first tick from now, counters reset)
//!   and keeps it paused if it was;
//! - [`Alarms::pause`] deletes the pending occurrence and marks the
//!   schedule paused; [`Alarms::resume`] schedules the first tick after now
//!   (ticks during the pause are neither run nor counted as missed);
//!   [`Alarms::cancel`] deletes the schedule and its occurrence. All three
//!   are idempotent, and none interrupts a running handler: its outcome no
//!   longer matches a row and changes nothing;
//! - [`Alarms::schedule`] on a recurring name replaces the schedule by a
//!   one-shot alarm; [`Alarms::purge_before`] purges schedules registered
//!   before the cutoff with their occurrences;
//! - a cron pattern that has no tick left ends the schedule (both rows
//!   are deleted after the last run).
//!
//! Owns the `durability_alarms` and `durability_alarm_schedules` tables;
//! all their SQL is in this module.

pub mod recurrence;

pub use recurrence::{MissedTicks, Recurrence, RecurrenceError};

use std::collections::HashMap;
use std::future::Future;
use std::rc::{Rc, Weak};
use std::time::Duration;

use durability_platform::{AlarmInfo, EpochMs, LocalBoxFuture, Row, Sql, StorageError, params};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{ConfigError, DurabilityError, HandlerError, LibraryErrorKind, SerializedError};
use crate::lifecycle::{Emitter, Entity, EntityKind, LifecycleEvent, LifecycleHook};
use crate::limits;
use crate::memo::Memo;
use crate::migrations::{
    self, MigrationReport, MigrationTarget, NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS,
};
use crate::record::{AttemptRef, DurableTable, delete_attempt, update_attempt};
use crate::retry::{Delay, MethodPolicy, Policies, PolicyOptions, whole_millis};
use crate::scheduler::attempt::{ActiveMap, AttemptKind, ExecutionSpec, Output};
use crate::scheduler::{AbortSignal, Engine, Participant, Scheduler};
use recurrence::Placement;

/// The record table of named alarms.
pub const ALARMS: DurableTable = DurableTable {
    name: "durability_alarms",
    key: "name",
};

/// The prefix of every occurrence's idempotency key; the rest is the
/// occurrence's generation id.
pub const IDEMPOTENCY_KEY_PREFIX: &str = "durability-alarm:v1:";

/// The table of recurring schedules, keyed by alarm name.
pub const SCHEDULES_TABLE: &str = "durability_alarm_schedules";

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
    /// How many ticks of a recurring schedule before `scheduled_time` did
    /// not run (skipped or folded into this run by the missed-tick
    /// policy); 0 for one-shot alarms.
    pub missed: u64,
    /// The payload the recurring schedule was registered with; `None` for
    /// one-shot alarms and schedules registered with `()`.
    pub payload: Option<serde_json::Value>,
}

impl AlarmCall {
    /// The payload as `T`; a missing payload reads as JSON `null`.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, HandlerError> {
        let value = self.payload.clone().unwrap_or(serde_json::Value::Null);
        serde_json::from_value(value).map_err(|error| {
            HandlerError::non_retryable(format!(
                "payload of named alarm \"{}\" does not decode: {error}",
                self.name
            ))
        })
    }
}

/// What kind of row a listed alarm is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlarmState {
    /// An occurrence is waiting for its time or its next retry.
    Pending,
    /// A one-shot alarm failed terminally (kept until rescheduled or
    /// purged).
    Failed,
    /// A recurring schedule is paused: nothing is pending.
    Paused,
}

/// One named alarm of an object, as [`Alarms::list`] shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct AlarmEntry {
    /// The alarm's name.
    pub name: String,
    /// Pending, failed or paused.
    pub state: AlarmState,
    /// When the pending occurrence runs next (its tick, or its next retry);
    /// `None` when nothing is pending.
    pub next_run_at: Option<EpochMs>,
    /// The tick (or one-shot time) of the pending or failed occurrence.
    pub scheduled_time: Option<EpochMs>,
    /// Attempts the current occurrence has used.
    pub attempt: u32,
    /// The recurring schedule, `None` for a one-shot alarm.
    pub recurrence: Option<Recurrence>,
    /// Ticks missed before the pending occurrence.
    pub missed: u64,
    /// Occurrences of the schedule that finished (succeeded or failed
    /// terminally) since it was registered.
    pub runs: u64,
    /// The tick of the last finished occurrence.
    pub last_tick: Option<EpochMs>,
    /// The latest failure: of the current occurrence's attempts, or of the
    /// last occurrence that failed terminally (cleared by a success).
    pub last_error: Option<SerializedError>,
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
    attempt: u32,
    schedule: Option<DueSchedule>,
}

/// The recurring schedule behind a due occurrence.
struct DueSchedule {
    recurrence: Rc<Recurrence>,
    payload: Option<serde_json::Value>,
    /// Ticks missed before this occurrence.
    missed: u64,
    /// The missed-tick policy already chose this occurrence: it runs
    /// however late.
    placed: bool,
}

/// The columns `run_due` reads, in order.
const DUE_COLUMNS: &str = "a.name, a.generation_id, a.created_at, a.scheduled_at, a.attempt, \
     s.recurrence, s.payload, s.missed, s.placed";

impl DueAlarm {
    /// Decodes one due row; a row that does not decode is reported with the
    /// table and its name, so it can be found and rescheduled.
    fn decode(row: &Row) -> Result<DueAlarm, DurabilityError> {
        let decoded = (|| -> Result<DueAlarm, String> {
            let recurrence: Option<String> = row.get(5).map_err(|e| e.to_string())?;
            let schedule = match recurrence {
                None => None,
                Some(text) => {
                    let payload: Option<String> = row.get(6).map_err(|e| e.to_string())?;
                    let payload = match payload {
                        None => None,
                        Some(text) => crate::codec::decode(&text).map_err(|e| e.to_string())?,
                    };
                    Some(DueSchedule {
                        recurrence: Rc::new(Recurrence::from_stored(&text)?),
                        payload,
                        missed: row.get(7).map_err(|e| e.to_string())?,
                        placed: row.get::<i64>(8).map_err(|e| e.to_string())? != 0,
                    })
                }
            };
            Ok(DueAlarm {
                name: row.get(0).map_err(|e| e.to_string())?,
                generation: row.get(1).map_err(|e| e.to_string())?,
                created_at: row.get(2).map_err(|e| e.to_string())?,
                scheduled_at: row.get(3).map_err(|e| e.to_string())?,
                attempt: row.get(4).map_err(|e| e.to_string())?,
                schedule,
            })
        })();
        decoded.map_err(|detail| DurabilityError::Decode {
            table: ALARMS.name,
            key: row
                .get::<String>(0)
                .unwrap_or_else(|_| format!("{:?}", row.values().first())),
            detail,
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
                // A one-shot alarm replaces a recurring schedule of the name.
                sql.execute(
                    "DELETE FROM durability_alarm_schedules WHERE name = ?",
                    &params![name],
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

    /// Gives the alarm `name` a recurring schedule: an occurrence at each
    /// tick of `recurrence`, the first one the first tick after now. The
    /// handler receives `payload` (any JSON-serializable value; `&()` for
    /// none) with every occurrence.
    ///
    /// The payload's own JSON may be at most
    /// [`limits::DEFAULT_MAX_BODY_BYTES`] (1 MiB).
    ///
    /// Registering the same recurrence and payload again changes nothing
    /// (the pending occurrence, its retries and a pause stay as they are),
    /// so an object may call this in its constructor. Anything different
    /// replaces the schedule: new first tick, counters reset, still paused
    /// if it was. Replaces a one-shot alarm of the name. A name without a
    /// handler, a bad option or a pattern with no future tick is rejected
    /// and writes nothing.
    ///
    /// Returns when the next run is due (`None` while paused), once the
    /// schedule, its occurrence and the physical alarm have committed.
    pub async fn schedule_recurring<P: Serialize + ?Sized>(
        &self,
        name: &str,
        recurrence: &Recurrence,
        payload: &P,
    ) -> Result<Option<EpochMs>, DurabilityError> {
        let inner = &self.inner;
        if !inner.handlers.contains_key(name) {
            return Err(DurabilityError::UnknownHandler {
                kind: "named alarm",
                name: name.to_owned(),
            });
        }
        recurrence.validate()?;
        let payload = crate::codec::encode(payload)?;
        // Not configurable: a schedule's payload is configuration, not data.
        limits::check_body(
            "payload",
            crate::codec::body_bytes(&payload),
            limits::DEFAULT_MAX_BODY_BYTES,
            "DEFAULT_MAX_BODY_BYTES",
        )?;
        // `()` and `None` encode as JSON null: stored as no payload at all.
        let payload =
            (crate::codec::decode(&payload)?.is_some_and(|v| !v.is_null())).then_some(payload);
        let stored = recurrence.to_stored();
        let engine = &inner.engine;
        let now = engine.now();
        let first = recurrence
            .next_after(now)
            .ok_or_else(|| RecurrenceError::NoNextTick {
                schedule: recurrence.to_string(),
                after_ms: now,
            })?;
        let generation = engine.new_generation();
        let outcome = engine
            .transaction(|sql| {
                let existing = sql.query_row(
                    "SELECT s.recurrence, s.payload, s.paused, a.next_attempt_at \
                     FROM durability_alarm_schedules s \
                     LEFT JOIN durability_alarms a ON a.name = s.name WHERE s.name = ?",
                    &params![name],
                )?;
                if let Some(row) = existing {
                    let same =
                        row.get::<String>(0)? == stored && row.get::<Option<String>>(1)? == payload;
                    let paused = row.get::<i64>(2)? != 0;
                    let next = row.get::<Option<EpochMs>>(3)?;
                    if same && (paused || next.is_some()) {
                        return Ok::<_, StorageError>((false, next));
                    }
                    write_schedule(sql, name, &stored, payload.as_deref(), paused, now)?;
                    if paused {
                        sql.execute(
                            "DELETE FROM durability_alarms WHERE name = ?",
                            &params![name],
                        )?;
                        return Ok((true, None));
                    }
                } else {
                    write_schedule(sql, name, &stored, payload.as_deref(), false, now)?;
                }
                insert_occurrence(sql, name, &generation, first, now)?;
                Ok((true, Some(first)))
            })
            .await?;
        let (changed, next) = outcome;
        if changed && let Some(next) = next {
            inner.emitter.emit(&LifecycleEvent::Scheduled {
                entity: Entity::NamedAlarm {
                    alarm: name.to_owned(),
                    generation,
                },
                timestamp: now,
                scheduled_time: next,
            });
        }
        Ok(next)
    }

    /// Pauses the recurring schedule `name`: its pending occurrence is
    /// deleted and nothing runs until [`Alarms::resume`]. Idempotent; a
    /// running occurrence finishes but its outcome changes nothing. Returns
    /// whether the schedule was running before.
    pub async fn pause(&self, name: &str) -> Result<bool, DurabilityError> {
        let paused = self
            .inner
            .engine
            .transaction(|sql| {
                let Some(row) = sql.query_row(
                    "SELECT paused FROM durability_alarm_schedules WHERE name = ?",
                    &params![name],
                )?
                else {
                    return Ok(None);
                };
                if row.get::<i64>(0)? != 0 {
                    return Ok(Some(false));
                }
                sql.execute(
                    "UPDATE durability_alarm_schedules SET paused = 1, missed = 0, placed = 0 \
                     WHERE name = ?",
                    &params![name],
                )?;
                sql.execute(
                    "DELETE FROM durability_alarms WHERE name = ?",
                    &params![name],
                )?;
                crate::memo::delete_memos(sql, ALARMS, name)?;
                Ok::<_, StorageError>(Some(true))
            })
            .await?;
        paused.ok_or_else(|| DurabilityError::NotRecurring {
            name: name.to_owned(),
        })
    }

    /// Resumes the paused schedule `name` at its first tick after now.
    /// Idempotent: a running schedule keeps its pending occurrence. Returns
    /// the next run time.
    pub async fn resume(&self, name: &str) -> Result<EpochMs, DurabilityError> {
        let engine = &self.inner.engine;
        let now = engine.now();
        let generation = engine.new_generation();
        let resumed = engine
            .transaction(|sql| {
                let Some(row) = sql.query_row(
                    "SELECT s.recurrence, s.paused, a.next_attempt_at \
                     FROM durability_alarm_schedules s \
                     LEFT JOIN durability_alarms a ON a.name = s.name WHERE s.name = ?",
                    &params![name],
                )?
                else {
                    return Ok(None);
                };
                if row.get::<i64>(1)? == 0
                    && let Some(next) = row.get::<Option<EpochMs>>(2)?
                {
                    return Ok(Some(Ok(next)));
                }
                let text: String = row.get(0)?;
                let recurrence = match Recurrence::from_stored(&text) {
                    Ok(recurrence) => recurrence,
                    Err(detail) => {
                        return Ok(Some(Err(DurabilityError::Decode {
                            table: SCHEDULES_TABLE,
                            key: name.to_owned(),
                            detail,
                        })));
                    }
                };
                let Some(first) = recurrence.next_after(now) else {
                    return Ok(Some(Err(RecurrenceError::NoNextTick {
                        schedule: recurrence.to_string(),
                        after_ms: now,
                    }
                    .into())));
                };
                sql.execute(
                    "UPDATE durability_alarm_schedules SET paused = 0, missed = 0, placed = 0 \
                     WHERE name = ?",
                    &params![name],
                )?;
                let created_at: EpochMs = sql
                    .query_row(
                        "SELECT created_at FROM durability_alarm_schedules WHERE name = ?",
                        &params![name],
                    )?
                    .map(|row| row.get(0))
                    .transpose()?
                    .unwrap_or(now);
                insert_occurrence(sql, name, &generation, first, created_at)?;
                Ok::<_, StorageError>(Some(Ok(first)))
            })
            .await?;
        match resumed {
            None => Err(DurabilityError::NotRecurring {
                name: name.to_owned(),
            }),
            Some(result) => result,
        }
    }

    /// Deletes the alarm `name`, recurring or one-shot, with its pending
    /// occurrence. Idempotent; a running handler finishes but its outcome
    /// changes nothing. Returns whether anything was deleted.
    pub async fn cancel(&self, name: &str) -> Result<bool, DurabilityError> {
        let deleted = self
            .inner
            .engine
            .transaction(|sql| {
                let occurrences = sql.execute(
                    "DELETE FROM durability_alarms WHERE name = ?",
                    &params![name],
                )?;
                let schedules = sql.execute(
                    "DELETE FROM durability_alarm_schedules WHERE name = ?",
                    &params![name],
                )?;
                crate::memo::delete_memos(sql, ALARMS, name)?;
                Ok::<_, StorageError>(occurrences + schedules > 0)
            })
            .await?;
        Ok(deleted)
    }

    /// Every named alarm of the object, one-shot and recurring, by name,
    /// with its next run time.
    pub fn list(&self) -> Result<Vec<AlarmEntry>, DurabilityError> {
        self.entries(None)
    }

    /// The named alarm `name`, if it has a pending or failed occurrence or
    /// a schedule.
    pub fn get(&self, name: &str) -> Result<Option<AlarmEntry>, DurabilityError> {
        Ok(self.entries(Some(name))?.into_iter().next())
    }

    fn entries(&self, only: Option<&str>) -> Result<Vec<AlarmEntry>, DurabilityError> {
        let sql = self.inner.engine.sql();
        let query = format!(
            "SELECT n.name, a.status, a.scheduled_at, a.next_attempt_at, a.attempt, \
             a.last_error_name, a.last_error, s.recurrence, s.paused, s.missed, s.runs, \
             s.last_tick FROM (SELECT name FROM durability_alarms UNION \
             SELECT name FROM durability_alarm_schedules) n \
             LEFT JOIN durability_alarms a ON a.name = n.name \
             LEFT JOIN durability_alarm_schedules s ON s.name = n.name {} ORDER BY n.name",
            if only.is_some() {
                "WHERE n.name = ?"
            } else {
                ""
            }
        );
        let rows = match only {
            Some(name) => sql.query(&query, &params![name])?,
            None => sql.query(&query, &[])?,
        };
        rows.iter().map(decode_entry).collect()
    }

    /// Deletes every occurrence (any status) scheduled before `before`
    /// (epoch ms of the scheduling call) and aborts their running attempts;
    /// returns how many were deleted. An aborted handler that keeps running
    /// still holds its name: a replacement waits until it ends.
    pub async fn purge_before(&self, before: EpochMs) -> Result<u64, DurabilityError> {
        let inner = &self.inner;
        let count = inner
            .engine
            .purge(
                ALARMS,
                before,
                &inner.active,
                "Durable alarm was purged",
                &["DELETE FROM durability_alarm_schedules WHERE created_at < ?"],
            )
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

/// Writes a schedule row: a new registration (counters reset).
fn write_schedule(
    sql: &dyn Sql,
    name: &str,
    recurrence: &str,
    payload: Option<&str>,
    paused: bool,
    now: EpochMs,
) -> Result<(), StorageError> {
    sql.execute(
        "INSERT INTO durability_alarm_schedules \
         (name, recurrence, payload, paused, missed, placed, runs, last_tick, created_at) \
         VALUES (?, ?, ?, ?, 0, 0, 0, NULL, ?) \
         ON CONFLICT(name) DO UPDATE SET recurrence = excluded.recurrence, \
         payload = excluded.payload, paused = excluded.paused, missed = 0, placed = 0, \
         runs = 0, last_tick = NULL, created_at = excluded.created_at",
        &params![name, recurrence, payload, i64::from(paused), now],
    )?;
    Ok(())
}

/// Writes the pending occurrence of a schedule, replacing any row of the
/// name.
fn insert_occurrence(
    sql: &dyn Sql,
    name: &str,
    generation: &str,
    tick: EpochMs,
    created_at: EpochMs,
) -> Result<(), StorageError> {
    sql.execute(
        "INSERT INTO durability_alarms \
         (name, generation_id, status, scheduled_at, next_attempt_at, attempt, \
          last_error, last_error_name, created_at) \
         VALUES (?, ?, 'pending', ?, ?, 0, NULL, NULL, ?) \
         ON CONFLICT(name) DO UPDATE SET generation_id = excluded.generation_id, \
         status = 'pending', scheduled_at = excluded.scheduled_at, \
         next_attempt_at = excluded.next_attempt_at, attempt = 0, last_error = NULL, \
         last_error_name = NULL, created_at = excluded.created_at",
        &params![name, generation, tick, tick, created_at],
    )?;
    Ok(())
}

fn decode_entry(row: &Row) -> Result<AlarmEntry, DurabilityError> {
    let name: String = row.get(0)?;
    let decode_error = |detail: String| DurabilityError::Decode {
        table: SCHEDULES_TABLE,
        key: name.clone(),
        detail,
    };
    let status: Option<String> = row.get(1)?;
    let recurrence = match row.get::<Option<String>>(7)? {
        None => None,
        Some(text) => Some(Recurrence::from_stored(&text).map_err(decode_error)?),
    };
    let paused = row.get::<Option<i64>>(8)?.unwrap_or(0) != 0;
    let state = match (status.as_deref(), paused) {
        (Some("pending"), _) => AlarmState::Pending,
        (Some("failed"), _) => AlarmState::Failed,
        (None, true) => AlarmState::Paused,
        (other, _) => {
            return Err(DurabilityError::Decode {
                table: ALARMS.name,
                key: name.clone(),
                detail: format!("unexpected status {other:?}"),
            });
        }
    };
    let last_error = match (row.get::<Option<String>>(5)?, row.get::<Option<String>>(6)?) {
        (Some(error_name), Some(message)) => Some(SerializedError::new(error_name, message)),
        (None, Some(message)) => Some(SerializedError::new("Error", message)),
        _ => None,
    };
    Ok(AlarmEntry {
        state,
        next_run_at: match state {
            AlarmState::Pending => row.get(3)?,
            AlarmState::Failed | AlarmState::Paused => None,
        },
        scheduled_time: row.get(2)?,
        attempt: row.get::<Option<u32>>(4)?.unwrap_or(0),
        recurrence,
        missed: row.get::<Option<u64>>(9)?.unwrap_or(0),
        runs: row.get::<Option<u64>>(10)?.unwrap_or(0),
        last_tick: row.get(11)?,
        last_error,
        name,
    })
}

impl Inner {
    /// Applies the missed-tick policy to a recurring occurrence picked up
    /// for its first attempt after its tick was missed. Returns the
    /// occurrence to run now, or `None` when nothing runs now (the row moved
    /// to a future tick, ended, or changed under us).
    async fn place_missed(
        self: &Rc<Self>,
        mut due: DueAlarm,
    ) -> Result<Option<DueAlarm>, DurabilityError> {
        let Some(schedule) = due.schedule.as_mut() else {
            return Ok(Some(due));
        };
        let now = self.engine.now();
        if due.attempt > 0
            || schedule.placed
            || !schedule.recurrence.is_missed(due.scheduled_at, now)
        {
            return Ok(Some(due));
        }
        let placement = schedule
            .recurrence
            .place(due.scheduled_at, schedule.missed, now);
        let (tick, missed, run_now) = match placement {
            Placement::Run { tick, missed } => (tick, missed, true),
            Placement::Wait { tick, missed } => (tick, missed, false),
            Placement::Finished => {
                let name = due.name.clone();
                let generation = due.generation.clone();
                self.engine
                    .transaction(|sql| {
                        let deleted = sql.execute(
                            "DELETE FROM durability_alarms WHERE name = ? AND generation_id = ? \
                             AND status = 'pending' AND attempt = 0",
                            &params![name.as_str(), generation.as_str()],
                        )?;
                        if deleted > 0 {
                            sql.execute(
                                "DELETE FROM durability_alarm_schedules WHERE name = ?",
                                &params![name.as_str()],
                            )?;
                        }
                        Ok::<_, StorageError>(())
                    })
                    .await?;
                return Ok(None);
            }
        };
        let generation = self.engine.new_generation();
        let (name, old_generation) = (due.name.clone(), due.generation.clone());
        let moved = self
            .engine
            .transaction(|sql| {
                let moved = sql.execute(
                    "UPDATE durability_alarms SET generation_id = ?, scheduled_at = ?, \
                     next_attempt_at = ? WHERE name = ? AND generation_id = ? \
                     AND status = 'pending' AND attempt = 0",
                    &params![
                        generation.as_str(),
                        tick,
                        tick,
                        name.as_str(),
                        old_generation.as_str()
                    ],
                )?;
                if moved > 0 {
                    sql.execute(
                        "UPDATE durability_alarm_schedules SET missed = ?, placed = ? \
                         WHERE name = ?",
                        &params![
                            // Integers travel as JavaScript numbers on the edge.
                            i64::try_from(missed)
                                .unwrap_or(i64::MAX)
                                .min(durability_platform::MAX_SAFE_INTEGER),
                            i64::from(run_now),
                            name.as_str()
                        ],
                    )?;
                }
                Ok::<_, StorageError>(moved > 0)
            })
            .await?;
        tracing::info!(
            event = "durability.alarm.missed_ticks",
            alarm = %due.name,
            missed_tick = due.scheduled_at,
            tick,
            missed,
            run_now,
            "recurring alarm picked up after missed ticks"
        );
        if !moved || !run_now {
            return Ok(None);
        }
        due.generation = generation;
        due.scheduled_at = tick;
        schedule.missed = missed;
        schedule.placed = true;
        Ok(Some(due))
    }

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
        let Some(due) = self.place_missed(due).await? else {
            return Ok(());
        };
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
                schedule: due.schedule,
                platform: info,
                max_attempts: policy.max_attempts,
                attempt_timeout_ms: policy.attempt_timeout_ms,
                retry_timeouts: policy.retry_timeouts,
            }),
            claimed: None,
            successor: None,
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
            // The schedule is looked up by its primary key.
            let rows = self.engine.sql().query(
                &format!(
                    "SELECT {DUE_COLUMNS} FROM durability_alarms a \
                     LEFT JOIN durability_alarm_schedules s ON s.name = a.name \
                     WHERE a.status = 'pending' AND a.next_attempt_at <= ? \
                     ORDER BY a.next_attempt_at ASC LIMIT ?"
                ),
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
    schedule: Option<DueSchedule>,
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
            missed: self.schedule.as_ref().map_or(0, |s| s.missed),
            payload: self.schedule.as_ref().and_then(|s| s.payload.clone()),
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
        if let Some(schedule) = &self.schedule {
            // The run's success and the next occurrence commit together.
            let attempt_ref = AttemptRef {
                key: self.name.clone(),
                generation: self.generation.clone(),
                attempt,
            };
            let advanced = self.advance(sql, schedule, Some(&attempt_ref))?;
            return Ok(advanced.then_some(now));
        }
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

    fn after_terminal(&self, sql: &dyn Sql, _now: EpochMs) -> Result<(), StorageError> {
        if let Some(schedule) = &self.schedule {
            // The failure stays readable (`last_error`); the schedule goes on.
            self.advance(sql, schedule, None)?;
        }
        Ok(())
    }
}

impl AlarmAttempt {
    /// Moves the schedule from the occurrence that just finished to the
    /// first tick after it, in the caller's transaction: from the pending
    /// row of `succeeded` (success), or from this generation's failed row
    /// (`None`: terminal failure). Counted from the finished tick, not from
    /// now, so a late or retried run never shifts later ticks. Returns
    /// whether this occurrence still owned the row.
    fn advance(
        &self,
        sql: &dyn Sql,
        schedule: &DueSchedule,
        succeeded: Option<&AttemptRef>,
    ) -> Result<bool, StorageError> {
        let next = schedule.recurrence.next_after(self.scheduled_at);
        let moved = match (next, succeeded) {
            (Some(tick), Some(attempt)) => {
                let generation = self.next_generation();
                update_attempt(
                    sql,
                    ALARMS,
                    attempt,
                    "generation_id = ?, scheduled_at = ?, next_attempt_at = ?, attempt = 0, \
                     last_error = NULL, last_error_name = NULL",
                    &params![generation.as_str(), tick, tick],
                )?
            }
            (Some(tick), None) => {
                let generation = self.next_generation();
                sql.execute(
                    "UPDATE durability_alarms SET generation_id = ?, status = 'pending', \
                     scheduled_at = ?, next_attempt_at = ?, attempt = 0 \
                     WHERE name = ? AND generation_id = ? AND status = 'failed'",
                    &params![
                        generation.as_str(),
                        tick,
                        tick,
                        self.name.as_str(),
                        self.generation.as_str()
                    ],
                )? > 0
            }
            // No tick left: the schedule ends with this occurrence.
            (None, Some(attempt)) => delete_attempt(sql, ALARMS, attempt)?,
            (None, None) => {
                sql.execute(
                    "DELETE FROM durability_alarms \
                     WHERE name = ? AND generation_id = ? AND status = 'failed'",
                    &params![self.name.as_str(), self.generation.as_str()],
                )? > 0
            }
        };
        if !moved {
            return Ok(false);
        }
        if next.is_some() {
            sql.execute(
                "UPDATE durability_alarm_schedules SET missed = 0, placed = 0, \
                 runs = runs + 1, last_tick = ? WHERE name = ?",
                &params![self.scheduled_at, self.name.as_str()],
            )?;
        } else {
            sql.execute(
                "DELETE FROM durability_alarm_schedules WHERE name = ?",
                &params![self.name.as_str()],
            )?;
        }
        Ok(true)
    }

    fn next_generation(&self) -> String {
        match self.inner.upgrade() {
            Some(inner) => inner.engine.new_generation(),
            // Only a dropped helper gets here, and its writes are moot; the
            // name keeps the row unique all the same.
            None => format!("{}-next", self.generation),
        }
    }
}
