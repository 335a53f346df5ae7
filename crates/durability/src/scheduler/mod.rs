//! The scheduler: one physical alarm, one FIFO concurrency pool and one
//! in-memory early timer, shared by every capability of an object.
//!
//! An object has exactly one alarm. If every capability reconciled it against
//! only its own tables they would clobber each other, so capabilities attach
//! to one [`Scheduler`] as *participants* and the scheduler alone reads and
//! writes the alarm: capabilities get SQL from it, never the storage handle,
//! so none can set the alarm behind its back.
//!
//! What it owns:
//! - the reconcile of the physical alarm, run inside the same storage
//!   transaction as every write that changes pending work (so a crash can
//!   never leave pending work without an alarm);
//! - the early timer, armed only after a commit, that runs work due sooner
//!   than the alarm's minimum delay from memory;
//! - the permit pool shared by eager starts, timer runs and alarm runs;
//! - the alarm run itself, with a handoff before the platform's wall-time
//!   limit and a fallback alarm of its own when a run fails (the platform
//!   drops an alarm after a few failed deliveries, which would strand work);
//! - the attempt lifecycle (`attempt`) and settlement watchers.
//!
//! It must not know what a record *means*: operations, named alarms and
//! fanout say that through `Participant` and `attempt::AttemptKind`.

pub(crate) mod attempt;
mod signal;

pub use signal::AbortSignal;

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::time::Duration;

use durability_platform::{
    AlarmInfo, Context, EpochMs, LocalBoxFuture, MAX_TIMER_MS, Sql, StorageError, StorageExt,
    Transaction, Value, params,
};
use futures::FutureExt;
use futures::future::{AbortHandle, Abortable, Either, Shared};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;

use crate::error::{ConfigError, DurabilityError, HandlerError, SerializedError};
use crate::lifecycle::{Emitter, LifecycleHook};
use crate::memo::MEMO_MIGRATIONS;
use crate::migrations::{self, MEMOS_CAPABILITY, Migration, MigrationTarget};
use crate::record::DurableTable;

/// Default number of handlers that may run at once on one scheduler.
pub const DEFAULT_ALARM_CONCURRENCY: usize = 10;
/// The most handlers a scheduler runs at once. All of an object's handlers
/// share one thread, so more permits only queue work in memory; far beyond
/// this, tokio's semaphore would panic (it holds at most `usize::MAX >> 3`).
pub const MAX_ALARM_CONCURRENCY: usize = 10_000;
/// Default (and largest) minimum distance of the physical alarm from now.
pub const DEFAULT_ALARM_MIN_DELAY: Duration = Duration::from_millis(15_000);
/// Smallest allowed minimum distance of the physical alarm from now.
pub const MIN_ALARM_MIN_DELAY: Duration = Duration::from_millis(1_000);
/// Largest allowed minimum distance of the physical alarm from now.
pub const MAX_ALARM_MIN_DELAY: Duration = Duration::from_millis(15_000);
/// Default time after which a running alarm hands unfinished work to a new
/// alarm: one minute inside the platform's 15-minute wall-time limit.
pub const DEFAULT_ALARM_HANDOFF: Duration = Duration::from_millis(14 * 60_000);

/// (the earliest time the physical alarm must cover, the earliest time
/// for the in-memory timer) of a participant.
pub(crate) type PendingTimes = (Option<EpochMs>, Option<EpochMs>);

/// Details of a failed alarm run, handed to the `on_alarm_retry` hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlarmRetryInfo {
    /// What failed.
    pub error: SerializedError,
    /// Delay until the re-armed fallback alarm fires.
    pub retry_in_ms: u64,
    /// The platform's retry count of the failed invocation, when the run came
    /// from the physical alarm (timer runs have none).
    pub retry_count: Option<u32>,
    /// Whether the platform marked the failed invocation as a retry.
    pub is_retry: Option<bool>,
    /// The owning object's id.
    pub object_id: Option<String>,
}

/// A hook called after a failed alarm run re-armed its own fallback alarm.
/// A returned future runs in the background; its error is only logged.
pub type AlarmRetryHook =
    Rc<dyn Fn(&AlarmRetryInfo) -> Option<LocalBoxFuture<'static, Result<(), HandlerError>>>>;

/// Configures a [`Scheduler`]; every option has a validated default.
pub struct SchedulerBuilder {
    ctx: Rc<dyn Context>,
    alarm_concurrency: usize,
    alarm_min_delay: Duration,
    /// `None`: [`DEFAULT_ALARM_HANDOFF`], or half the platform's CPU limit
    /// per invocation where that is sooner.
    alarm_handoff: Option<Duration>,
    live_timers: bool,
    on_alarm_retry: Option<AlarmRetryHook>,
}

impl SchedulerBuilder {
    /// Maximum handlers running at once across eager starts, timer runs and
    /// alarm runs. Default 10; from 1 to [`MAX_ALARM_CONCURRENCY`].
    pub fn alarm_concurrency(mut self, permits: usize) -> Self {
        self.alarm_concurrency = permits;
        self
    }

    /// The physical alarm is never set closer than this to now; nearer work
    /// runs from the in-memory timer. Default 15 s; 1 s to 15 s, whole ms.
    pub fn alarm_min_delay(mut self, delay: Duration) -> Self {
        self.alarm_min_delay = delay;
        self
    }

    /// Time after which a running alarm arms a new alarm for the work it has
    /// not finished and returns. Default 14 min, or half the platform's CPU
    /// limit per invocation ([`Context::invocation_cpu_limit`]) where that
    /// is sooner: 15 s on Cloudflare, whose 30 s CPU limit would otherwise
    /// end a long run (CPU time never exceeds the wall time of a run on one
    /// thread, so handing off by wall time bounds both). 1 ms to 2^31-1 ms,
    /// whole milliseconds, and below the platform's CPU limit.
    pub fn alarm_handoff(mut self, handoff: Duration) -> Self {
        self.alarm_handoff = Some(handoff);
        self
    }

    /// Experimental: start due work from in-memory timers at its exact time,
    /// however far out (up to 2^31-1 ms), and let newly due work run without
    /// waiting behind long-running handlers. The physical alarm stays armed as
    /// the eviction fallback. Default off.
    pub fn live_timers(mut self, on: bool) -> Self {
        self.live_timers = on;
        self
    }

    /// Called each time an alarm run fails and the scheduler re-arms its own
    /// fallback alarm; best effort, it can never change scheduling.
    pub fn on_alarm_retry(mut self, hook: AlarmRetryHook) -> Self {
        self.on_alarm_retry = Some(hook);
        self
    }

    /// Validates the options and builds the scheduler.
    pub fn build(self) -> Result<Scheduler, ConfigError> {
        if self.alarm_concurrency == 0 {
            return Err(ConfigError::NotPositive {
                field: "alarm_concurrency".into(),
            });
        }
        if self.alarm_concurrency > MAX_ALARM_CONCURRENCY {
            return Err(ConfigError::OutOfRange {
                field: "alarm_concurrency".into(),
                min: 1,
                max: MAX_ALARM_CONCURRENCY as u64,
            });
        }
        let min_delay_ms = self.alarm_min_delay.as_millis();
        if self.alarm_min_delay < MIN_ALARM_MIN_DELAY
            || self.alarm_min_delay > MAX_ALARM_MIN_DELAY
            || !self
                .alarm_min_delay
                .subsec_nanos()
                .is_multiple_of(1_000_000)
        {
            return Err(ConfigError::DurationOutOfRange {
                field: "alarm_min_delay".into(),
                min_ms: 1_000,
                max_ms: 15_000,
            });
        }
        let cpu_limit = self.ctx.invocation_cpu_limit();
        let alarm_handoff = self.alarm_handoff.unwrap_or_else(|| {
            cpu_limit.map_or(DEFAULT_ALARM_HANDOFF, |limit| {
                DEFAULT_ALARM_HANDOFF.min(Duration::from_millis(
                    u64::try_from(limit.as_millis() / 2)
                        .unwrap_or(u64::MAX)
                        .max(1),
                ))
            })
        });
        if let Some(limit) = cpu_limit
            && alarm_handoff >= limit
        {
            return Err(ConfigError::AboveInvocationLimit {
                field: "alarm_handoff".into(),
                value_ms: u64::try_from(alarm_handoff.as_millis()).unwrap_or(u64::MAX),
                limit_ms: u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
            });
        }
        let handoff_ms = alarm_handoff.as_millis();
        if handoff_ms == 0 {
            return Err(ConfigError::NotPositive {
                field: "alarm_handoff".into(),
            });
        }
        if !alarm_handoff.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(ConfigError::NotWholeMilliseconds {
                field: "alarm_handoff".into(),
                value: alarm_handoff,
            });
        }
        if handoff_ms > u128::from(MAX_TIMER_MS) {
            return Err(ConfigError::AboveTimerLimit {
                field: "alarm_handoff".into(),
                value_ms: u64::try_from(handoff_ms).unwrap_or(u64::MAX),
            });
        }
        // Both were range-checked above, so the conversions cannot fail.
        let alarm_min_delay_ms = i64::try_from(min_delay_ms).unwrap_or(15_000);
        let alarm_handoff_ms = u64::try_from(handoff_ms).unwrap_or(MAX_TIMER_MS);
        let engine = Rc::new(Engine {
            ctx: self.ctx,
            alarm_concurrency: self.alarm_concurrency,
            alarm_min_delay_ms,
            alarm_handoff_ms,
            live_timers: self.live_timers,
            on_alarm_retry: self.on_alarm_retry,
            participants: RefCell::new(Vec::new()),
            migrated: RefCell::new(HashSet::new()),
            permits: Arc::new(Semaphore::new(self.alarm_concurrency)),
            refresh: RefCell::new(None),
            early: RefCell::new(None),
            failed_until: Cell::new(None),
            wanted_at: Cell::new(None),
            last_quiet: Cell::new(None),
            runs_ended: Cell::new(0),
            alarm_changes: Cell::new(0),
            in_run: Cell::new(0),
            next_id: Cell::new(0),
            watchers: RefCell::new(HashMap::new()),
            active_by_table: RefCell::new(HashMap::new()),
        });
        Ok(Scheduler { engine })
    }
}

/// The public handle of an object's scheduler.
///
/// Build one per object, attach every capability of the object to it, and
/// delegate the object's `alarm()` to [`Scheduler::alarm`]. Cloning is one
/// reference-count increment.
///
/// ```
/// use std::rc::Rc;
/// use durability::Scheduler;
/// use durability_platform::{AlarmInfo, Context};
///
/// struct Jobs {
///     scheduler: Scheduler,
/// }
///
/// impl Jobs {
///     fn new(ctx: Rc<dyn Context>) -> Result<Self, durability::ConfigError> {
///         let scheduler = Scheduler::builder(ctx).alarm_concurrency(4).build()?;
///         Ok(Jobs { scheduler })
///     }
///
///     // The object's alarm runs every attached capability's due work.
///     async fn alarm(&self, info: AlarmInfo) -> Result<(), durability::DurabilityError> {
///         self.scheduler.alarm(Some(info)).await
///     }
/// }
/// # let _ = Jobs::new;
/// # let _ = Jobs::alarm;
/// ```
#[derive(Clone)]
pub struct Scheduler {
    pub(crate) engine: Rc<Engine>,
}

impl Scheduler {
    /// Starts configuring a scheduler for the object behind `ctx`.
    pub fn builder(ctx: Rc<dyn Context>) -> SchedulerBuilder {
        SchedulerBuilder {
            ctx,
            alarm_concurrency: DEFAULT_ALARM_CONCURRENCY,
            alarm_min_delay: DEFAULT_ALARM_MIN_DELAY,
            alarm_handoff: None,
            live_timers: false,
            on_alarm_retry: None,
        }
    }

    /// A scheduler with every option at its default.
    pub fn new(ctx: Rc<dyn Context>) -> Result<Self, ConfigError> {
        Scheduler::builder(ctx).build()
    }

    /// Runs the due work of every attached capability and re-arms the
    /// physical alarm. Delegate the object's `alarm()` here.
    ///
    /// A failed run re-arms a fallback alarm of its own and returns `Ok`, so
    /// the platform does not count a failure (it drops an alarm after a few);
    /// this returns `Err` only when the fallback could not be armed either.
    pub async fn alarm(&self, info: Option<AlarmInfo>) -> Result<(), DurabilityError> {
        self.engine.alarm(info).await
    }

    /// The host's clock, in epoch milliseconds.
    pub fn now_ms(&self) -> EpochMs {
        self.engine.now()
    }

    /// The wall time after which an alarm run hands its unfinished work to
    /// a new alarm: the builder's `alarm_handoff`, or its default for this
    /// platform (see [`SchedulerBuilder::alarm_handoff`]).
    pub fn alarm_handoff(&self) -> Duration {
        Duration::from_millis(self.engine.alarm_handoff_ms)
    }
}

impl fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scheduler")
            .field("object", &self.engine.ctx.id().as_str())
            .field("alarm_concurrency", &self.engine.alarm_concurrency)
            .field("alarm_min_delay_ms", &self.engine.alarm_min_delay_ms)
            .field("live_timers", &self.engine.live_timers)
            .finish()
    }
}

/// One record table attached to the scheduler: how to find and run its due
/// work. The engine holds participants weakly: a capability that is dropped
/// stops taking part.
pub(crate) trait Participant {
    /// The table whose records this participant owns; unique per scheduler.
    fn table(&self) -> DurableTable;

    /// Runs the work due at `now`. An error makes the alarm run fail (and
    /// the fallback alarm take over); handler failures are outcomes, not
    /// errors.
    fn run_due(
        self: Rc<Self>,
        now: EpochMs,
        info: Option<AlarmInfo>,
    ) -> LocalBoxFuture<'static, Result<(), DurabilityError>>;

    /// The earliest due time for tables without `status` and
    /// `next_attempt_at` columns; `None` means "read those columns".
    fn custom_next_pending_at(
        &self,
        _sql: &dyn Sql,
    ) -> Option<Result<Option<EpochMs>, StorageError>> {
        None
    }

    /// Like [`Participant::custom_next_pending_at`], as (the earliest time
    /// the physical alarm must cover, running work included; the earliest
    /// time for the timer). Override where running work is left out of the
    /// timer's time: the physical alarm is the fallback if the process dies
    /// while that work runs. The default uses one time for both.
    fn custom_pending_times(&self, sql: &dyn Sql) -> Option<Result<PendingTimes, StorageError>> {
        self.custom_next_pending_at(sql)
            .map(|at| at.map(|at| (at, at)))
    }

    /// True while the participant keeps an alarm invocation open to run its
    /// own work: its time then only arms the physical alarm, never the timer.
    fn holding(&self) -> bool {
        false
    }
}

/// Called after a record may have settled; a completion passes the executed
/// row because some tables delete it on success.
pub(crate) type SettlementListener = Rc<dyn Fn(Option<&SettledRow>)>;

/// The identity of a record generation whose attempt completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SettledRow {
    pub generation: String,
    pub created_at: EpochMs,
}

/// Removes its listener when dropped.
pub(crate) struct WatchGuard {
    engine: Weak<Engine>,
    table: &'static str,
    key: String,
    id: u64,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        let Some(engine) = self.engine.upgrade() else {
            return;
        };
        let mut watchers = engine.watchers.borrow_mut();
        if let Some(by_key) = watchers.get_mut(self.table)
            && let Some(listeners) = by_key.get_mut(&self.key)
        {
            listeners.retain(|(id, _)| *id != self.id);
            if listeners.is_empty() {
                by_key.remove(&self.key);
            }
        }
    }
}

struct EarlyTimer {
    at: EpochMs,
    id: u64,
    abort: AbortHandle,
}

type Refresh = Shared<LocalBoxFuture<'static, Result<(), StorageError>>>;

/// The machinery behind [`Scheduler`]; crate-internal.
pub(crate) struct Engine {
    pub(crate) ctx: Rc<dyn Context>,
    pub(crate) alarm_concurrency: usize,
    alarm_min_delay_ms: EpochMs,
    alarm_handoff_ms: u64,
    pub(crate) live_timers: bool,
    on_alarm_retry: Option<AlarmRetryHook>,
    participants: RefCell<Vec<(DurableTable, Weak<dyn Participant>)>>,
    migrated: RefCell<HashSet<&'static str>>,
    // tokio's semaphore is fair: waiters are served in request order, and a
    // permit is released exactly once, on drop.
    permits: Arc<Semaphore>,
    refresh: RefCell<Option<Refresh>>,
    early: RefCell<Option<EarlyTimer>>,
    /// Set when a run failed or stalled (see [`Engine::stalled`]): until a
    /// run succeeds with progress, the commits *of a run*
    /// arm the in-memory timer no earlier than the fallback alarm.
    /// Otherwise a pass that fails on a row it cannot advance (a damaged
    /// row) while its own commits re-arm the timer for that still-due row
    /// loops at full speed. New work registered meanwhile still arms it at
    /// once.
    failed_until: Cell<Option<EpochMs>>,
    /// The earliest time the last reconcile wanted the timer at, before
    /// the failed-run clamp: whether work is still due at once.
    wanted_at: Cell<Option<EpochMs>>,
    /// When the last quiet run ended, the count it left, and its number
    /// among the runs ended (see [`Engine::stalled`]).
    last_quiet: Cell<Option<(EpochMs, i64, u64)>>,
    /// Runs ended so far; a quiet run records its number.
    runs_ended: Cell<u64>,
    /// Rows the scheduler's own alarm writes changed (see
    /// [`Engine::write_alarm`]).
    alarm_changes: Cell<i64>,
    /// Alarm runs in progress.
    in_run: Cell<u32>,
    next_id: Cell<u64>,
    #[allow(clippy::type_complexity)] // table -> key -> listeners, read in one place
    watchers: RefCell<HashMap<&'static str, HashMap<String, Vec<(u64, SettlementListener)>>>>,
    // Keys whose attempt is executing, per table. Under live timers the
    // in-memory timer skips them, so a still-due running row cannot drive a
    // zero-delay timer loop.
    active_by_table: RefCell<HashMap<&'static str, HashSet<String>>>,
}

impl Engine {
    pub(crate) fn now(&self) -> EpochMs {
        self.ctx.now_ms()
    }

    pub(crate) fn sql(&self) -> &dyn Sql {
        self.ctx.storage()
    }

    pub(crate) fn next_id(&self) -> u64 {
        let id = self.next_id.get().wrapping_add(1);
        self.next_id.set(id);
        id
    }

    /// A uniform sample in [0, 1) from the platform's randomness (jitter).
    pub(crate) fn uniform(&self) -> f64 {
        let mut bytes = [0u8; 8];
        self.ctx.random_bytes(&mut bytes);
        // The top 53 bits make every f64 in [0, 1) with that spacing equally likely.
        #[allow(clippy::cast_precision_loss)] // 53 bits fit an f64 mantissa exactly
        let sample = (u64::from_le_bytes(bytes) >> 11) as f64;
        sample / (1u64 << 53) as f64
    }

    /// A random UUID v4 string naming one generation of a record.
    pub(crate) fn new_generation(&self) -> String {
        let mut b = [0u8; 16];
        self.ctx.random_bytes(&mut b);
        let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
        uuid::Builder::from_random_bytes(b)
            .into_uuid()
            .hyphenated()
            .encode_lower(&mut text)
            .to_owned()
    }

    /// Attaches `participant` to this scheduler, held weakly: a capability
    /// that is dropped stops taking part and gives its table back. A second
    /// live participant for the same table is refused.
    pub(crate) fn register<P: Participant + 'static>(
        &self,
        participant: &Rc<P>,
    ) -> Result<(), ConfigError> {
        let table = participant.table();
        let participant: Rc<dyn Participant> = Rc::clone(participant) as Rc<dyn Participant>;
        let mut participants = self.participants.borrow_mut();
        participants.retain(|(_, p)| p.strong_count() > 0);
        if participants.iter().any(|(t, _)| t.name == table.name) {
            return Err(ConfigError::DuplicateParticipant {
                table: table.name.to_owned(),
            });
        }
        participants.push((table, Rc::downgrade(&participant)));
        Ok(())
    }

    /// What every capability with attempt records does when it is built:
    /// its schema and the memos' schema are current, and its lifecycle
    /// hooks are attached to a new emitter.
    pub(crate) fn prepare_records(
        &self,
        capability: &'static str,
        migrations: &[Migration],
        hooks: Vec<LifecycleHook>,
    ) -> Result<Emitter, DurabilityError> {
        self.migrate_schema(capability, migrations)?;
        self.migrate_schema(MEMOS_CAPABILITY, MEMO_MIGRATIONS)?;
        let emitter = Emitter::new(Rc::clone(&self.ctx));
        for hook in hooks {
            emitter.add(hook).keep();
        }
        Ok(emitter)
    }

    fn live_participants(&self) -> Vec<Rc<dyn Participant>> {
        self.participants
            .borrow()
            .iter()
            .filter_map(|(_, p)| p.upgrade())
            .collect()
    }

    /// Applies a capability's migrations once per scheduler; skipped when the
    /// stored history already matches, so construction stays cheap.
    pub(crate) fn migrate_schema(
        &self,
        capability: &'static str,
        list: &[Migration],
    ) -> Result<(), DurabilityError> {
        if self.migrated.borrow().contains(capability) {
            return Ok(());
        }
        let storage = self.ctx.storage();
        if !migrations::is_schema_current(storage, capability, list)? {
            migrations::migrate(storage, capability, list, MigrationTarget::Latest)?;
        }
        self.migrated.borrow_mut().insert(capability);
        Ok(())
    }

    /// Runs synchronous writes atomically without touching the alarm.
    pub(crate) fn transaction_sync<T, E: From<StorageError>>(
        &self,
        write: impl FnOnce(&dyn Sql) -> Result<T, E>,
    ) -> Result<T, E> {
        self.ctx.storage().transaction_sync(write)
    }

    /// Runs the writes and reconciles the physical alarm in one storage
    /// transaction, then arms the in-memory timer, only after the commit.
    pub(crate) async fn transaction<T, E: From<StorageError>>(
        self: &Rc<Self>,
        write: impl FnOnce(&dyn Sql) -> Result<T, E>,
    ) -> Result<T, E> {
        let (value, timer_at) = self
            .ctx
            .storage()
            .transaction(|txn: &dyn Transaction| {
                let value = write(txn)?;
                let timer_at = self.reconcile(txn)?;
                Ok::<_, E>((value, timer_at))
            })
            .await?;
        self.schedule_early_alarm(timer_at);
        Ok(value)
    }

    /// A reconcile with no writes. Concurrent callers share one transaction.
    pub(crate) fn schedule_next_alarm(self: &Rc<Self>) -> Refresh {
        if let Some(refresh) = self.refresh.borrow().as_ref() {
            return refresh.clone();
        }
        let engine = Rc::clone(self);
        let refresh = async move {
            let result = engine.transaction(|_| Ok::<_, StorageError>(())).await;
            engine.refresh.borrow_mut().take();
            result
        }
        .boxed_local()
        .shared();
        *self.refresh.borrow_mut() = Some(refresh.clone());
        refresh
    }

    pub(crate) fn track_active(&self, table: &'static str, key: &str) {
        self.active_by_table
            .borrow_mut()
            .entry(table)
            .or_default()
            .insert(key.to_owned());
    }

    pub(crate) fn release_active(&self, table: &'static str, key: &str) {
        let mut by_table = self.active_by_table.borrow_mut();
        if let Some(keys) = by_table.get_mut(table) {
            keys.remove(key);
            if keys.is_empty() {
                by_table.remove(table);
            }
        }
    }

    /// The earliest pending time of one participant: `physical` arms the
    /// alarm (the eviction fallback) and includes running work; `timer`
    /// drives the in-memory timer and, under live timers, skips running work.
    fn pending_times(
        &self,
        participant: &dyn Participant,
        sql: &dyn Sql,
    ) -> Result<(Option<EpochMs>, Option<EpochMs>), StorageError> {
        if let Some(custom) = participant.custom_pending_times(sql) {
            let (physical, timer) = custom?;
            let physical = min_time(physical, timer);
            return Ok(if participant.holding() {
                (physical, None)
            } else {
                (physical, timer)
            });
        }
        let table = participant.table();
        let active = self.active_by_table.borrow();
        let active = active.get(table.name);
        // The timer skips running work in both modes: what runs re-arms
        // it when it settles (its settling transaction reconciles, and an
        // execution that leaves its record pending refreshes once it is
        // no longer running). A timer armed for a running record would
        // only start a pass that waits for it and then commits an extra
        // reconcile: one more commit per eager start, measured.
        let limit = active.map_or(0, HashSet::len) + 1;
        // -1 is SQLite's "no limit"; a larger integer would not bind on every
        // platform (JavaScript numbers stop at 2^53).
        let rows = sql.query(
            &pending_query(table),
            &params![i64::try_from(limit).unwrap_or(-1)],
        )?;
        let mut physical = None;
        let mut timer = None;
        for (index, row) in rows.iter().enumerate() {
            let at: EpochMs = row.get(1)?;
            if index == 0 {
                physical = Some(at);
            }
            let key: Value = row.get(0)?;
            let is_active = match (&key, active) {
                (Value::Text(k), Some(keys)) => keys.contains(k),
                _ => false,
            };
            if !is_active {
                timer = Some(at);
                break;
            }
        }
        Ok((physical, timer))
    }

    /// Arms the physical alarm from the earliest pending time and returns
    /// the earliest time the in-memory timer should fire.
    fn reconcile(&self, txn: &dyn Transaction) -> Result<Option<EpochMs>, StorageError> {
        let mut physical_at: Option<EpochMs> = None;
        let mut timer_at: Option<EpochMs> = None;
        for participant in self.live_participants() {
            let (physical, timer) = self.pending_times(participant.as_ref(), txn)?;
            physical_at = min_time(physical_at, physical);
            timer_at = min_time(timer_at, timer);
        }
        let current = txn.get_alarm()?;
        let Some(earliest) = physical_at else {
            if current.is_some() {
                self.write_alarm(txn, None)?;
            }
            return Ok(None);
        };
        let target = earliest.max(self.now().saturating_add(self.alarm_min_delay_ms));
        // A fallback already inside [earliest, target] is kept, so frequent
        // reconciles cannot keep pushing it later.
        match current {
            Some(at) if at >= earliest && at <= target => {}
            _ => self.write_alarm(txn, Some(target))?,
        }
        Ok(timer_at)
    }

    /// Sets or deletes the physical alarm inside a transaction, counting the
    /// rows that costs where the platform keeps the alarm in SQL: the
    /// stall guard ([`Engine::stalled`]) must not take re-arming the alarm
    /// for progress (a reconcile during a pass may delete it, the pass's
    /// deferred one set it again, on every run of a stalled loop). Only
    /// writes during an alarm run are counted: the guard compares counts
    /// taken at a run's start and end, and the count costs two queries,
    /// which the eager path (a registration and its completion, each
    /// moving the alarm) should not pay.
    fn write_alarm(&self, txn: &dyn Transaction, at: Option<EpochMs>) -> Result<(), StorageError> {
        let before = if self.in_run.get() > 0 {
            self.total_changes()
        } else {
            None
        };
        match at {
            Some(at) => txn.set_alarm(at)?,
            None => txn.delete_alarm()?,
        }
        self.count_alarm_changes(before);
        Ok(())
    }

    /// Adds the rows changed since `before` to the alarm's own writes.
    fn count_alarm_changes(&self, before: Option<i64>) {
        // Counted only when `before` was (not on the eager path).
        if let Some(before) = before
            && let Some(after) = self.total_changes()
        {
            self.alarm_changes.set(
                self.alarm_changes
                    .get()
                    .wrapping_add(after.wrapping_sub(before)),
            );
        }
    }

    /// Arms (or cancels) the in-memory timer. Called only after a commit.
    fn schedule_early_alarm(self: &Rc<Self>, at: Option<EpochMs>) {
        self.wanted_at.set(at);
        let mut early = self.early.borrow_mut();
        if early.as_ref().map(|timer| timer.at) == at {
            return;
        }
        if let Some(old) = early.take() {
            old.abort.abort();
        }
        let Some(at) = at else {
            return;
        };
        // After a failed run, a run's own commits arm nothing earlier than
        // its fallback.
        let at = match self.failed_until.get() {
            Some(until) if self.in_run.get() > 0 => at.max(until),
            _ => at,
        };
        let delay = at.saturating_sub(self.now());
        // Without live timers the timer only covers the window the physical
        // alarm may not serve; with them, anything a timer can reach.
        if !self.live_timers && delay >= self.alarm_min_delay_ms {
            return;
        }
        if delay > i64::try_from(MAX_TIMER_MS).unwrap_or(i64::MAX) {
            return;
        }
        if self.invocation_budget_spent() {
            // The physical alarm the reconcile set takes it from here.
            return;
        }
        let id = self.next_id();
        let (abort, registration) = AbortHandle::new_pair();
        let sleep = self.ctx.sleep(Duration::from_millis(
            u64::try_from(delay.max(0)).unwrap_or(0),
        ));
        let engine = Rc::downgrade(self);
        let fire = async move {
            sleep.await;
            let Some(engine) = engine.upgrade() else {
                return;
            };
            {
                let mut early = engine.early.borrow_mut();
                // A superseded timer never runs.
                if early.as_ref().map(|timer| timer.id) != Some(id) {
                    return;
                }
                early.take();
            }
            tracing::trace!(scheduled_time = at, "scheduler early alarm");
            let run = Rc::clone(&engine);
            engine.ctx.wait_until(Box::pin(async move {
                if let Err(error) = run.alarm(None).await {
                    tracing::error!(
                        event = "durability.background_execution.failed",
                        scheduled_time = at,
                        %error,
                        "timer-driven alarm run failed"
                    );
                }
            }));
        };
        self.ctx
            .spawn(Box::pin(Abortable::new(fire, registration).map(|_| ())));
        *early = Some(EarlyTimer { at, id, abort });
    }

    /// Whether the in-memory runs have spent this event's share of the
    /// platform's CPU limit: they have gone on for the alarm handoff (and
    /// at most half the limit) since the latest request or alarm delivery
    /// began ([`Context::invocation_started_at`]). Timer runs after an
    /// event spend that event's CPU budget, so a backlog drained pass after
    /// pass from the timer would otherwise run into the limit; once spent,
    /// no timer is armed and the physical alarm, a new event with a budget
    /// of its own, runs the rest. Never spent where the platform sets no
    /// limit (the embedded host).
    pub(crate) fn invocation_budget_spent(&self) -> bool {
        let (Some(limit), Some(started)) = (
            self.ctx.invocation_cpu_limit(),
            self.ctx.invocation_started_at(),
        ) else {
            return false;
        };
        let half_limit = u64::try_from(limit.as_millis() / 2).unwrap_or(u64::MAX);
        let budget = self.alarm_handoff_ms.min(half_limit);
        let spent = u64::try_from(self.now().saturating_sub(started)).unwrap_or(0);
        spent >= budget
    }

    pub(crate) fn try_acquire_permit(&self) -> Option<OwnedSemaphorePermit> {
        Arc::clone(&self.permits).try_acquire_owned().ok()
    }

    pub(crate) async fn acquire_permit(&self) -> Result<OwnedSemaphorePermit, DurabilityError> {
        // The semaphore is never closed, so this cannot fail in practice.
        Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .map_err(|_| DurabilityError::Interrupted)
    }

    /// Runs `worker` over `items` on at most `alarm_concurrency` lanes, each
    /// taking the next item in order when its previous one finished. Lanes
    /// bound a participant's fan-out; permits bound handlers across them.
    pub(crate) async fn run_concurrent<I, F, Fut, T>(&self, items: Vec<I>, worker: F) -> Vec<T>
    where
        F: Fn(I) -> Fut,
        Fut: std::future::Future<Output = T>,
    {
        use futures::StreamExt;
        futures::stream::iter(items.into_iter().map(worker))
            .buffered(self.alarm_concurrency.max(1))
            .collect()
            .await
    }

    /// Runs due work and re-arms the alarm; a failed run arms a fallback of
    /// our own instead of letting the platform retry (it gives up after a
    /// few failures and drops the alarm, stranding pending work).
    pub(crate) async fn alarm(
        self: &Rc<Self>,
        info: Option<AlarmInfo>,
    ) -> Result<(), DurabilityError> {
        let span = tracing::info_span!(
            "alarm_run",
            object = %self.ctx.id(),
            retry_count = info.map(|i| i.retry_count)
        );
        self.alarm_with_fallback(info).instrument(span).await
    }

    async fn alarm_with_fallback(
        self: &Rc<Self>,
        info: Option<AlarmInfo>,
    ) -> Result<(), DurabilityError> {
        self.in_run.set(self.in_run.get() + 1);
        let changes_before = self.progress_count();
        let ended_before = self.runs_ended.get();
        let ran = self.run_alarm(info).await;
        self.runs_ended.set(self.runs_ended.get().wrapping_add(1));
        let ran = match ran {
            Ok(()) => self
                .stalled(changes_before, ended_before)
                .map_or(Ok(()), Err),
            Err(error) => Err(error),
        };
        self.in_run.set(self.in_run.get().saturating_sub(1));
        let Err(error) = ran else {
            return Ok(());
        };
        let fallback_at = self.now().saturating_add(self.alarm_min_delay_ms);
        self.failed_until.set(Some(fallback_at));
        if let Ok(mut early) = self.early.try_borrow_mut()
            && let Some(timer) = early.take_if(|timer| timer.at < fallback_at)
        {
            timer.abort.abort();
        }
        let before = self.total_changes();
        if self.ctx.storage().set_alarm(fallback_at).await.is_err() {
            return Err(error);
        }
        self.count_alarm_changes(before);
        tracing::error!(
            event = "durability.alarm.failed",
            retry_in_ms = self.alarm_min_delay_ms,
            %error,
            "alarm run failed; fallback alarm armed"
        );
        self.notify_alarm_retry(&error, info);
        Ok(())
    }

    /// The guard against a run that changes nothing while its work stays
    /// due. A pass that returns `Ok` without advancing a damaged row (a
    /// compare-and-set that never matches, a row outside every query's
    /// range) leaves that row due, and the run's own reconcile re-arms the
    /// timer at once: a hot loop no failing-run check catches.
    ///
    /// A run is *quiet* when it ends `Ok` with work due at once while the
    /// connection's `total_changes()` did not move from its start to its
    /// end (no claim, no settlement, no new work; the scheduler's own alarm
    /// writes not counted). One quiet run is normal (a run that finds the
    /// due work running already, or held by a gate, and leaves it to
    /// them). A quiet run that began after the last quiet run ended, at
    /// the same instant and with the count unchanged, is the hot loop (one
    /// run re-arming the next at once): it counts as
    /// failed with [`DurabilityError::NoProgress`] (logged, reported to
    /// `on_alarm_retry`, retried at the fallback pace). Any run that finds
    /// nothing due at once or moved the count lifts the pace. A backlog
    /// that drains writes on every run and is never slowed. Where the count
    /// cannot be read (a platform refusing the function), the guard is
    /// off.
    fn stalled(&self, changes_before: Option<i64>, ended_before: u64) -> Option<DurabilityError> {
        let now = self.now();
        let due_at_once = self.wanted_at.get().is_some_and(|at| at <= now);
        let changes = self.progress_count();
        if !due_at_once || changes.is_none() || changes != changes_before {
            self.last_quiet.set(None);
            self.failed_until.set(None);
            return None;
        }
        let ended = self.runs_ended.get();
        let previous = self
            .last_quiet
            .replace(changes.map(|changes| (now, changes, ended)));
        // A loop: the last quiet run ended at this instant with this count
        // *before this run began*. Runs that overlapped (several waiting on
        // one running handler, ending together) are not one.
        let looping = previous.is_some_and(|(at, count, index)| {
            Some(count) == changes && at == now && index <= ended_before
        });
        if !looping {
            self.failed_until.set(None);
            return None;
        }
        let tables = self
            .live_participants()
            .iter()
            .filter(|participant| {
                self.pending_times(participant.as_ref(), self.sql())
                    .is_ok_and(|(_, timer)| timer.is_some_and(|at| at <= now))
            })
            .map(|participant| participant.table().name.to_owned())
            .collect();
        Some(DurabilityError::NoProgress { tables })
    }

    /// Rows changed on the object's connection so far, when readable.
    fn total_changes(&self) -> Option<i64> {
        self.sql()
            .query_row("SELECT total_changes()", &[])
            .ok()
            .flatten()
            .and_then(|row| row.get::<i64>(0).ok())
    }

    /// Rows changed on the object's connection so far, but those of the
    /// reconciles' alarm writes: what the stall guard counts as progress.
    fn progress_count(&self) -> Option<i64> {
        self.total_changes()
            .map(|changes| changes.wrapping_sub(self.alarm_changes.get()))
    }

    fn notify_alarm_retry(&self, failure: &DurabilityError, invocation: Option<AlarmInfo>) {
        let Some(hook) = &self.on_alarm_retry else {
            return;
        };
        let retry_in_ms = u64::try_from(self.alarm_min_delay_ms).unwrap_or(0);
        let info = AlarmRetryInfo {
            error: serialize_failure(failure),
            retry_in_ms,
            retry_count: invocation.map(|i| i.retry_count),
            is_retry: invocation.map(|i| i.is_retry),
            object_id: Some(self.ctx.id().to_string()),
        };
        if let Some(pending) = hook(&info) {
            self.ctx.wait_until(Box::pin(async move {
                if let Err(error) = pending.await {
                    tracing::error!(
                        event = "durability.alarm.retry_hook_failed",
                        retry_in_ms,
                        %error,
                        "on_alarm_retry hook failed"
                    );
                }
            }));
        }
    }

    /// Runs every participant's due work concurrently, hands off to a new
    /// alarm if the run nears the wall-time limit, then reconciles.
    async fn run_alarm(self: &Rc<Self>, info: Option<AlarmInfo>) -> Result<(), DurabilityError> {
        let started_at = self.now();
        // Each participant runs as background work of its own, so that after
        // a handoff or a first failure the others keep going.
        let mut results = Vec::new();
        for participant in self.live_participants() {
            let (sender, receiver) = tokio::sync::oneshot::channel();
            let run = participant.run_due(started_at, info);
            self.ctx.wait_until(Box::pin(async move {
                let _ = sender.send(run.await);
            }));
            results.push(receiver);
        }
        let all = async move {
            for receiver in results {
                match receiver.await {
                    Ok(result) => result?,
                    Err(_) => return Err(DurabilityError::Interrupted),
                }
            }
            Ok(())
        };
        let elapsed = u64::try_from(self.now().saturating_sub(started_at)).unwrap_or(0);
        let remaining = self.alarm_handoff_ms.saturating_sub(elapsed);
        let handoff = self.ctx.sleep(Duration::from_millis(remaining));
        futures::pin_mut!(all);
        match futures::future::select(all, handoff).await {
            Either::Left((result, _)) => {
                result?;
                self.schedule_next_alarm().await?;
            }
            Either::Right(((), _)) => self.arm_for_handoff().await?,
        }
        Ok(())
    }

    /// Arms the alarm so a new invocation picks up what this one leaves
    /// running; the running work itself continues in memory.
    async fn arm_for_handoff(&self) -> Result<(), StorageError> {
        let target = self.now().saturating_add(self.alarm_min_delay_ms);
        self.ctx
            .storage()
            .transaction(|txn: &dyn Transaction| {
                match txn.get_alarm()? {
                    Some(current) if current <= target => {}
                    _ => self.write_alarm(txn, Some(target))?,
                }
                Ok::<_, StorageError>(())
            })
            .await
    }

    /// Aborts the matching running handlers, then deletes the table's
    /// records created before `before` and reconciles, in one transaction.
    /// `also` are further `DELETE ... WHERE created_at < ?` statements of
    /// the capability's own side tables, run in the same transaction.
    pub(crate) async fn purge(
        self: &Rc<Self>,
        table: DurableTable,
        before: EpochMs,
        active: &attempt::ActiveMap,
        abort_reason: &str,
        also: &[&'static str],
    ) -> Result<u64, DurabilityError> {
        if !(0..=durability_platform::MAX_SAFE_INTEGER).contains(&before) {
            return Err(DurabilityError::InvalidTimestamp {
                field: "before",
                value: before,
            });
        }
        for running in active.borrow().values() {
            if running.created_at < before
                && let Some(signal) = &running.signal
            {
                signal.abort(HandlerError::new(abort_reason));
            }
        }
        let count_sql = format!(
            "SELECT COUNT(*) FROM {name} WHERE created_at < ?",
            name = table.name
        );
        let delete_sql = format!("DELETE FROM {name} WHERE created_at < ?", name = table.name);
        let removed = self
            .transaction(|sql| {
                let count: u64 = match sql.query_row(&count_sql, &params![before])? {
                    Some(row) => row.get(0)?,
                    None => 0,
                };
                sql.execute(&delete_sql, &params![before])?;
                for statement in also {
                    sql.execute(statement, &params![before])?;
                }
                crate::memo::delete_stale_memos(sql, table)?;
                Ok::<_, StorageError>(count)
            })
            .await?;
        if removed > 0 {
            let keys: Vec<String> = self
                .watchers
                .borrow()
                .get(table.name)
                .map(|by_key| by_key.keys().cloned().collect())
                .unwrap_or_default();
            for key in keys {
                self.notify(table, &key, None);
            }
        }
        Ok(removed)
    }

    /// In memory only: listeners never survive eviction.
    pub(crate) fn watch(
        self: &Rc<Self>,
        table: DurableTable,
        key: &str,
        listener: SettlementListener,
    ) -> WatchGuard {
        let id = self.next_id();
        self.watchers
            .borrow_mut()
            .entry(table.name)
            .or_default()
            .entry(key.to_owned())
            .or_default()
            .push((id, listener));
        WatchGuard {
            engine: Rc::downgrade(self),
            table: table.name,
            key: key.to_owned(),
            id,
        }
    }

    /// Call only after the change has committed.
    pub(crate) fn notify(&self, table: DurableTable, key: &str, completed: Option<&SettledRow>) {
        // Clone the listeners first: one may unwatch (and so borrow) while running.
        let listeners: Vec<SettlementListener> = self
            .watchers
            .borrow()
            .get(table.name)
            .and_then(|by_key| by_key.get(key))
            .map(|listeners| listeners.iter().map(|(_, l)| Rc::clone(l)).collect())
            .unwrap_or_default();
        for listener in listeners {
            listener(completed);
        }
    }
}

/// The `{name, message}` form of an engine-level failure, for the
/// `on_alarm_retry` hook.
fn serialize_failure(failure: &DurabilityError) -> SerializedError {
    let name = match failure {
        DurabilityError::Storage(_) => "StorageError",
        DurabilityError::Migration(_) => "MigrationError",
        DurabilityError::Decode { .. } => "DecodeError",
        _ => "DurabilityError",
    };
    SerializedError::new(name, failure.to_string())
}

/// The earliest pending rows of `table`, first `?` of them, with their
/// keys as `pk`; covered by the table's (status, next_attempt_at) index.
/// The built-in tables' text is written out (it runs in every transaction
/// that reconciles); a test checks it against [`format_pending_query`].
fn pending_query(table: DurableTable) -> Cow<'static, str> {
    Cow::Borrowed(match table {
        DurableTable::OPERATIONS => {
            "SELECT id AS pk, next_attempt_at FROM durability_calls \
             WHERE status = 'pending' ORDER BY next_attempt_at ASC LIMIT ?"
        }
        DurableTable::NAMED_ALARMS => {
            "SELECT name AS pk, next_attempt_at FROM durability_alarms \
             WHERE status = 'pending' ORDER BY next_attempt_at ASC LIMIT ?"
        }
        DurableTable::FANOUT_DELIVERIES => {
            "SELECT id AS pk, next_attempt_at FROM durability_fanout_deliveries \
             WHERE status = 'pending' ORDER BY next_attempt_at ASC LIMIT ?"
        }
        other => return Cow::Owned(format_pending_query(other)),
    })
}

/// [`pending_query`] for any table.
fn format_pending_query(DurableTable { name, key }: DurableTable) -> String {
    format!(
        "SELECT {key} AS pk, next_attempt_at FROM {name} \
         WHERE status = 'pending' ORDER BY next_attempt_at ASC LIMIT ?"
    )
}

fn min_time(a: Option<EpochMs>, b: Option<EpochMs>) -> Option<EpochMs> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;
    use std::time::Duration;

    use durability_host::{DurableObject, Host, ObjectContext};

    use super::*;

    #[test]
    fn the_written_out_pending_queries_are_the_formatted_ones() {
        for table in [
            DurableTable::OPERATIONS,
            DurableTable::NAMED_ALARMS,
            DurableTable::FANOUT_DELIVERIES,
        ] {
            assert!(matches!(pending_query(table), Cow::Borrowed(_)));
            assert_eq!(pending_query(table), format_pending_query(table));
        }
        let other = DurableTable {
            name: "t",
            key: "k",
        };
        assert_eq!(pending_query(other), format_pending_query(other));
    }

    /// An object whose alarm runs its scheduler.
    struct Plain {
        ctx: ObjectContext,
        scheduler: RefCell<Option<Scheduler>>,
    }

    impl DurableObject for Plain {
        async fn alarm(&self, info: AlarmInfo) -> Result<(), durability_host::BoxError> {
            let scheduler = self.scheduler.borrow().clone();
            match scheduler {
                Some(scheduler) => Ok(scheduler.alarm(Some(info)).await?),
                None => Ok(()),
            }
        }
    }

    /// A participant whose work is always due and whose pass changes
    /// nothing and returns `Ok`: what a damaged row no query of its pass
    /// matches looks like to the scheduler.
    struct AlwaysDue {
        passes: Cell<u64>,
        runaway: tokio::sync::Notify,
    }

    impl Participant for AlwaysDue {
        fn table(&self) -> DurableTable {
            DurableTable {
                name: "always_due",
                key: "id",
            }
        }

        fn run_due(
            self: Rc<Self>,
            _now: EpochMs,
            _info: Option<AlarmInfo>,
        ) -> LocalBoxFuture<'static, Result<(), DurabilityError>> {
            self.passes.set(self.passes.get() + 1);
            if self.passes.get() == 10_000 {
                self.runaway.notify_one();
            }
            Box::pin(async { Ok(()) })
        }

        fn custom_next_pending_at(
            &self,
            _sql: &dyn Sql,
        ) -> Option<Result<Option<EpochMs>, StorageError>> {
            Some(Ok(Some(0)))
        }
    }

    /// Without the stall guard each such run re-armed the timer at once:
    /// 10,000 passes without the (paused) clock moving. With it, a run
    /// that changes nothing while its work stays due fails with
    /// `NoProgress` naming the table, and the next comes at the fallback
    /// pace: about two runs per 15 s (the physical alarm's and the
    /// timer's).
    #[tokio::test(start_paused = true)]
    async fn a_run_that_changes_nothing_while_its_work_stays_due_backs_off_to_the_fallback_pace() {
        let (passes, reports) = tokio::task::LocalSet::new()
            .run_until(async {
                let dir = tempfile::tempdir().unwrap();
                let host = Host::builder(dir.path())
                    .threads(0)
                    .clock_start_ms(1_000_000)
                    .build()
                    .unwrap();
                let objects = host
                    .namespace("stall", |ctx| {
                        Ok(Plain {
                            ctx,
                            scheduler: RefCell::new(None),
                        })
                    })
                    .unwrap();
                let result = objects
                    .stub("o")
                    .unwrap()
                    .call(|object: Rc<Plain>| async move {
                        let reports = Rc::new(RefCell::new(Vec::<String>::new()));
                        let hook: AlarmRetryHook = {
                            let reports = Rc::clone(&reports);
                            Rc::new(move |info: &AlarmRetryInfo| {
                                reports.borrow_mut().push(info.error.message.clone());
                                None
                            })
                        };
                        let scheduler = Scheduler::builder(object.ctx.clone().into_dyn())
                            .on_alarm_retry(hook)
                            .build()
                            .unwrap();
                        let participant = Rc::new(AlwaysDue {
                            passes: Cell::new(0),
                            runaway: tokio::sync::Notify::new(),
                        });
                        scheduler.engine.register(&participant).unwrap();
                        *object.scheduler.borrow_mut() = Some(scheduler.clone());
                        let drive = async {
                            let _ = scheduler.alarm(None).await;
                            tokio::time::sleep(Duration::from_secs(150)).await;
                        };
                        tokio::select! {
                            () = participant.runaway.notified() => {}
                            () = drive => {}
                        }
                        let reports = reports.borrow().clone();
                        (participant.passes.get(), reports)
                    })
                    .await
                    .unwrap();
                host.shutdown().await;
                result
            })
            .await;
        assert!(passes < 10_000, "{passes} passes in 150 s: a hot loop");
        assert!(passes <= 2 * 150 / 15 + 4, "{passes} passes in 150 s");
        assert!(reports.len() >= 2, "{reports:?}");
        assert!(
            reports
                .iter()
                .all(|message| message.contains("no progress") && message.contains("always_due")),
            "{reports:?}"
        );
    }
}
