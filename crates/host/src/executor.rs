//! Executors: where objects live.
//!
//! An executor is one task loop on one thread (a thread of the host, or the
//! caller's `LocalSet` in inline mode). It owns the live objects assigned to
//! it by id, their background tasks, their idle watchers, and the schedule
//! of their alarms. Every piece of an object runs here, so code between two
//! awaits of one object never runs beside other code of the same object.
//! Other threads reach an executor only by sending it a [`Job`].

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use durability_platform::{AlarmInfo, EpochMs, LocalBoxFuture, ObjectId};
use tokio::sync::{Notify, mpsc};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tracing::Instrument;

use crate::context::ObjectContext;
use crate::flush::CommitMark;
use crate::host::HostCore;
use crate::id::object_path;
use crate::index::IndexedAlarm;
use crate::residency::{Admission, Residency};
use crate::storage::ObjectStorage;
use crate::{BoxError, CallError, DurableObject, NoAlarmHandler};

#[cfg(feature = "testing")]
pub(crate) mod testing;

/// Work sent to an executor from any thread.
pub(crate) type Job = Box<dyn FnOnce(&Rc<Executor>) + Send>;

/// What a call sends back: its result, and the object's last commit when
/// the result was made (the default: none), for the output gate.
pub(crate) struct Reply<R> {
    pub(crate) result: Result<R, CallError>,
    pub(crate) after: CommitMark,
}

impl<R> Reply<R> {
    /// A failure the object's code never saw; nothing to wait for.
    fn failed(error: CallError) -> Self {
        Reply {
            result: Err(error),
            after: CommitMark::default(),
        }
    }
}

/// The first retry of a failed alarm waits this long; each further retry
/// doubles it (2 s, 4 s, 8 s, ...).
pub const ALARM_RETRY_BASE: Duration = Duration::from_secs(2);
/// A failed alarm is retried at most this many times, then dropped.
pub const ALARM_MAX_RETRIES: u32 = 6;

/// A user object with its type erased, so the executor can hold objects of
/// every namespace and deliver alarms by id.
pub(crate) trait ErasedObject {
    fn into_any(self: Rc<Self>) -> Rc<dyn Any>;
    fn deliver_alarm(
        self: Rc<Self>,
        info: AlarmInfo,
    ) -> LocalBoxFuture<'static, Result<(), BoxError>>;
}

impl<T: DurableObject> ErasedObject for T {
    fn into_any(self: Rc<Self>) -> Rc<dyn Any> {
        self
    }
    fn deliver_alarm(
        self: Rc<Self>,
        info: AlarmInfo,
    ) -> LocalBoxFuture<'static, Result<(), BoxError>> {
        Box::pin(async move { self.alarm(info).await })
    }
}

tokio::task_local! {
    /// The object whose task runs now: a call made from here is a nested
    /// call, which the live-object cap must not let deadlock.
    static CURRENT_OBJECT: ObjectId;
}

/// The object whose code is running on this task, if any.
pub(crate) fn current_object() -> Option<ObjectId> {
    CURRENT_OBJECT.try_with(ObjectId::clone).ok()
}

/// What to do with an object once it is live (or could not be made live):
/// the rest of a call or an alarm run.
type Then = Box<dyn FnOnce(&Rc<Executor>, Result<Rc<Slot>, CallError>)>;

/// A construction waiting for room under the live-object cap, with the
/// calls and alarm runs that wait for the object, in arrival order.
struct Waiting {
    namespace: Arc<str>,
    name: Option<Arc<str>>,
    then: Vec<Then>,
}

/// Builds an object of one namespace from its context.
pub(crate) type Constructor =
    Arc<dyn Fn(ObjectContext) -> Result<Rc<dyn ErasedObject>, BoxError> + Send + Sync>;

/// One live object.
struct Slot {
    object: Rc<dyn ErasedObject>,
    state: Rc<SlotState>,
    ctx: ObjectContext,
}

/// Book-keeping of one live object that its context needs too: what keeps
/// it alive and which background tasks die with it.
pub(crate) struct SlotState {
    id: ObjectId,
    /// The index of the object's executor, for the host-wide LRU.
    executor: usize,
    residency: Arc<Residency>,
    /// Calls and alarm runs in flight.
    calls: Cell<usize>,
    /// `wait_until` tasks pending.
    waits: Cell<usize>,
    /// When the object last stopped being busy.
    last_active: Cell<Instant>,
    /// Tasks aborted when the object is evicted.
    tasks: RefCell<HashMap<u64, AbortHandle>>,
    next_task: Cell<u64>,
    evicted: Cell<bool>,
}

/// Keeps its object busy (not evictable) while it lives.
pub(crate) struct Activity {
    state: Rc<SlotState>,
    wait: bool,
}

impl Drop for Activity {
    fn drop(&mut self) {
        let counter = if self.wait {
            &self.state.waits
        } else {
            &self.state.calls
        };
        counter.set(counter.get().saturating_sub(1));
        self.state.last_active.set(Instant::now());
        // An evicted object's tasks end by abort; it is no longer a
        // candidate for anything.
        if !self.state.busy() && !self.state.evicted.get() {
            self.state
                .residency
                .became_idle(&self.state.id, self.state.executor);
        }
    }
}

impl SlotState {
    fn new(id: ObjectId, executor: usize, residency: Arc<Residency>) -> Rc<Self> {
        Rc::new(SlotState {
            id,
            executor,
            residency,
            calls: Cell::new(0),
            waits: Cell::new(0),
            last_active: Cell::new(Instant::now()),
            tasks: RefCell::new(HashMap::new()),
            next_task: Cell::new(0),
            evicted: Cell::new(false),
        })
    }

    fn busy(&self) -> bool {
        self.calls.get() > 0 || self.waits.get() > 0
    }

    /// Tells the host-wide LRU that the object is about to turn busy.
    fn begin_activity(&self) {
        if !self.busy() && !self.evicted.get() {
            self.residency.became_busy(&self.id);
        }
    }

    pub(crate) fn begin_call(self: &Rc<Self>) -> Activity {
        self.begin_activity();
        self.calls.set(self.calls.get() + 1);
        Activity {
            state: Rc::clone(self),
            wait: false,
        }
    }

    pub(crate) fn begin_wait(self: &Rc<Self>) -> Activity {
        self.begin_activity();
        self.waits.set(self.waits.get() + 1);
        Activity {
            state: Rc::clone(self),
            wait: true,
        }
    }

    /// Spawns `task` on this executor; it is aborted when the object is
    /// evicted. Work that must notice the abort keeps a drop guard inside.
    pub(crate) fn spawn_tracked(self: &Rc<Self>, task: LocalBoxFuture<'static, ()>) {
        if self.evicted.get() {
            // The object is gone: its background work goes with it.
            return;
        }
        let key = self.next_task.get();
        self.next_task.set(key.wrapping_add(1));
        let weak = Rc::downgrade(self);
        let task = CURRENT_OBJECT.scope(self.id.clone(), task);
        let handle = tokio::task::spawn_local(async move {
            task.await;
            if let Some(state) = weak.upgrade()
                && let Ok(mut tasks) = state.tasks.try_borrow_mut()
            {
                tasks.remove(&key);
            }
        });
        if let Ok(mut tasks) = self.tasks.try_borrow_mut() {
            tasks.insert(key, handle.abort_handle());
        }
    }

    fn abort_all(&self) {
        self.evicted.set(true);
        let tasks: Vec<AbortHandle> = match self.tasks.try_borrow_mut() {
            Ok(mut tasks) => tasks.drain().map(|(_, h)| h).collect(),
            Err(_) => Vec::new(),
        };
        for task in tasks {
            task.abort();
        }
    }
}

/// One scheduled alarm delivery.
#[derive(Debug, Clone)]
struct Entry {
    at_ms: EpochMs,
    namespace: Arc<str>,
    retry_count: u32,
}

/// The alarms of one executor's objects, live or evicted.
#[derive(Default)]
struct Schedule {
    by_time: BTreeSet<(EpochMs, ObjectId)>,
    entries: HashMap<ObjectId, Entry>,
    /// Objects whose alarm handler runs now; their entry comes back when
    /// the run ends.
    running: HashSet<ObjectId>,
    /// Due alarms of namespaces not registered yet, by namespace.
    parked: HashMap<Arc<str>, Vec<(ObjectId, Entry)>>,
}

impl Schedule {
    fn set(&mut self, id: &ObjectId, entry: Option<Entry>) {
        if let Some(old) = self.entries.remove(id) {
            self.by_time.remove(&(old.at_ms, id.clone()));
        }
        if let Some(entry) = entry {
            self.by_time.insert((entry.at_ms, id.clone()));
            self.entries.insert(id.clone(), entry);
        }
    }

    fn next_deadline(&self) -> Option<EpochMs> {
        self.by_time.first().map(|(at, _)| *at)
    }

    fn pop_due(&mut self, now_ms: EpochMs) -> Option<(ObjectId, Entry)> {
        let (at, _) = self.by_time.first()?;
        if *at > now_ms {
            return None;
        }
        let (_, id) = self.by_time.pop_first()?;
        let entry = self.entries.remove(&id)?;
        Some((id, entry))
    }
}

/// One executor: the live objects and alarm schedule of one thread.
pub(crate) struct Executor {
    core: Arc<HostCore>,
    me: Weak<Executor>,
    /// This executor's index among the host's executors.
    index: usize,
    objects: RefCell<HashMap<ObjectId, Rc<Slot>>>,
    /// Objects waiting for room under the live-object cap.
    waiting: RefCell<HashMap<ObjectId, Waiting>>,
    schedule: RefCell<Schedule>,
    /// Wakes the alarm loop when the schedule changed.
    wake: Notify,
    closed: Cell<bool>,
    /// Storage failures a test armed for the next commit of an object.
    #[cfg(feature = "testing")]
    injected_failures: RefCell<HashMap<ObjectId, durability_platform::StorageError>>,
}

/// Makes executor `index` and returns its loop, which runs until its host
/// is dropped or shut down. The executor exists (and, with the `testing`
/// feature, is reachable from this thread) before the loop first runs.
pub(crate) fn run(
    core: Arc<HostCore>,
    index: usize,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) -> impl std::future::Future<Output = ()> {
    let executor = Rc::new_cyclic(|me| Executor {
        core,
        me: me.clone(),
        index,
        objects: RefCell::new(HashMap::new()),
        waiting: RefCell::new(HashMap::new()),
        schedule: RefCell::new(Schedule::default()),
        wake: Notify::new(),
        closed: Cell::new(false),
        #[cfg(feature = "testing")]
        injected_failures: RefCell::new(HashMap::new()),
    });
    // Lets a test on this thread reach the executor without a `Send` job.
    #[cfg(feature = "testing")]
    let registered = testing::register(&executor);
    async move {
        #[cfg(feature = "testing")]
        let _registered = registered;
        tokio::task::spawn_local(alarm_loop(Rc::clone(&executor)));
        while let Some(job) = jobs.recv().await {
            job(&executor);
            if executor.closed.get() {
                break;
            }
        }
        executor.close();
    }
}

/// Sleeps until the next alarm is due or the schedule changes, then fires
/// every due alarm (the mini-redis purge-task shape).
async fn alarm_loop(executor: Rc<Executor>) {
    loop {
        if executor.closed.get() {
            return;
        }
        if executor.core.shutting_down.load(Ordering::SeqCst) {
            // No new alarm runs during shutdown; wait for the close.
            executor.wake.notified().await;
            continue;
        }
        let next = executor.schedule.borrow().next_deadline();
        match next {
            Some(at_ms) => {
                let when = executor.core.clock.instant_at(at_ms);
                tokio::select! {
                    () = tokio::time::sleep_until(when) => executor.fire_due(),
                    () = executor.wake.notified() => {}
                }
            }
            None => executor.wake.notified().await,
        }
    }
}

impl Executor {
    /// Runs a call on object `id`, constructing it if needed (after
    /// waiting for room under the live-object cap). The result goes to
    /// `reply`; `guard` keeps the host's shutdown waiting. `caller` is the
    /// object whose code made the call, if one did.
    #[allow(clippy::too_many_arguments)] // each argument is a distinct part of one call
    pub(crate) fn call<T, F, Fut, R, D>(
        self: &Rc<Self>,
        id: ObjectId,
        namespace: Arc<str>,
        name: Arc<str>,
        caller: Option<ObjectId>,
        f: F,
        reply: D,
        guard: crate::work::WorkGuard,
        span: tracing::Span,
    ) where
        T: DurableObject,
        F: FnOnce(Rc<T>) -> Fut + 'static,
        Fut: std::future::Future<Output = R> + 'static,
        R: 'static,
        D: FnOnce(Reply<R>) + 'static,
    {
        let then: Then = Box::new(move |_executor, slot| {
            let slot = match slot {
                Ok(slot) => slot,
                Err(error) => {
                    reply(Reply::failed(error));
                    return;
                }
            };
            let object = match Rc::clone(&slot.object).into_any().downcast::<T>() {
                Ok(object) => object,
                Err(_) => {
                    reply(Reply::failed(CallError::WrongType {
                        id: slot.state.id.to_string(),
                    }));
                    return;
                }
            };
            let activity = slot.state.begin_call();
            let ctx = slot.ctx.clone();
            let run = async move {
                let result = f(object).await;
                let after = ctx.object_storage().last_commit();
                reply(Reply {
                    result: Ok(result),
                    after,
                });
                drop(activity);
                drop(guard);
            };
            slot.state.spawn_tracked(Box::pin(run.instrument(span)));
        });
        self.with_object(id, namespace, Some(name), caller, then);
    }

    /// Runs `then` with the live object `id`: at once if it is live or
    /// there is room to construct it, else once room is made.
    fn with_object(
        self: &Rc<Self>,
        id: ObjectId,
        namespace: Arc<str>,
        name: Option<Arc<str>>,
        caller: Option<ObjectId>,
        then: Then,
    ) {
        let live = self.objects.borrow().get(&id).cloned();
        if let Some(slot) = live {
            then(self, Ok(slot));
            return;
        }
        if let Some(waiting) = self.waiting.borrow_mut().get_mut(&id) {
            // One construction per object: later calls queue behind it.
            if waiting.name.is_none() {
                waiting.name = name;
            }
            waiting.then.push(then);
            if let Some(caller) = caller {
                self.core.residency.also_waiting(&id, caller);
            }
            return;
        }
        if self.closed.get() {
            then(self, Err(CallError::ShuttingDown));
            return;
        }
        let residency = &self.core.residency;
        loop {
            match residency.admit(&id, self.index, caller.clone()) {
                Admission::Now => {
                    self.build(&id, &namespace, name.as_deref(), vec![then]);
                    return;
                }
                Admission::EvictFirst(victim) => {
                    // The host's least recently used idle object lives
                    // here: it makes room, then the request is repeated
                    // (another thread may have taken the freed slot).
                    if !self.evict(&victim) {
                        residency.spare(&victim);
                    }
                }
                Admission::Wait => {
                    tracing::debug!(object = %id, "waiting for room under the live-object cap");
                    self.waiting.borrow_mut().insert(
                        id,
                        Waiting {
                            namespace,
                            name,
                            then: vec![then],
                        },
                    );
                    return;
                }
            }
        }
    }

    /// A slot was taken for the waiting object `id`: construct it and run
    /// what waited for it.
    pub(crate) fn admitted(self: &Rc<Self>, id: &ObjectId) {
        let Some(waiting) = self.waiting.borrow_mut().remove(id) else {
            // Its wait was cancelled (the executor closed).
            self.core.residency.release_unbuilt();
            return;
        };
        if self.closed.get() {
            self.core.residency.release_unbuilt();
            for then in waiting.then {
                then(self, Err(CallError::ShuttingDown));
            }
            return;
        }
        self.build(
            id,
            &waiting.namespace,
            waiting.name.as_deref(),
            waiting.then,
        );
    }

    /// Constructs object `id` in a slot already taken for it and runs
    /// `thens` in order; a failed construction frees the slot.
    fn build(
        self: &Rc<Self>,
        id: &ObjectId,
        namespace: &Arc<str>,
        name: Option<&str>,
        thens: Vec<Then>,
    ) {
        match self.construct(id, namespace, name) {
            Ok(slot) => {
                for then in thens {
                    then(self, Ok(Rc::clone(&slot)));
                }
                if !slot.state.busy() && !slot.state.evicted.get() {
                    self.core.residency.became_idle(id, self.index);
                }
            }
            Err(error) => {
                self.core.residency.release_unbuilt();
                let message = error.to_string();
                let mut thens = thens.into_iter();
                if let Some(first) = thens.next() {
                    first(self, Err(error));
                }
                // CallError is not Clone; the others get the same story.
                for then in thens {
                    then(
                        self,
                        Err(CallError::Construct {
                            id: id.to_string(),
                            message: message.clone(),
                        }),
                    );
                }
            }
        }
    }

    /// Constructs object `id`; the caller holds a slot for it.
    fn construct(
        self: &Rc<Self>,
        id: &ObjectId,
        namespace: &Arc<str>,
        name: Option<&str>,
    ) -> Result<Rc<Slot>, CallError> {
        let constructor = self
            .core
            .constructor(namespace)
            .ok_or_else(|| CallError::Construct {
                id: id.to_string(),
                message: format!("namespace {namespace:?} is not registered"),
            })?;
        let path = object_path(&self.core.data_dir, id);
        let (storage, recorded) = ObjectStorage::open(
            &path,
            id.clone(),
            Arc::clone(namespace),
            name,
            self.core.synchronous,
            Arc::clone(&self.core.index),
            self.core.group.clone(),
            self.me.clone(),
        )
        .map_err(|source| CallError::Storage {
            id: id.to_string(),
            source,
        })?;
        let storage = storage.with_limits(self.core.storage_limits);
        let state = SlotState::new(id.clone(), self.index, Arc::clone(&self.core.residency));
        let ctx = ObjectContext::new(
            id.clone(),
            Arc::clone(namespace),
            recorded.name.or_else(|| name.map(str::to_owned)),
            storage,
            self.core.clock,
            Rc::clone(&state),
            Arc::clone(&self.core.work),
        );
        // A panicking factory must not take the executor (and every other
        // object on it) down with it.
        let built =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| constructor(ctx.clone())))
                .unwrap_or_else(|_| Err("the namespace's factory panicked".into()));
        let object = match built {
            Ok(object) => object,
            Err(error) => {
                state.abort_all();
                ctx.object_storage().close();
                return Err(CallError::Construct {
                    id: id.to_string(),
                    message: error.to_string(),
                });
            }
        };
        // The file is the truth about the alarm; an object whose alarm the
        // index lost (or never had) is scheduled from its own row.
        let alarm = ctx.object_storage().committed_alarm();
        if alarm.is_some() && !self.schedule.borrow().running.contains(id) {
            let known = self.schedule.borrow().entries.contains_key(id);
            if !known {
                self.alarm_changed(id, namespace, alarm);
            }
        }
        let slot = Rc::new(Slot {
            object,
            state: Rc::clone(&state),
            ctx,
        });
        self.objects
            .borrow_mut()
            .insert(id.clone(), Rc::clone(&slot));
        let watcher = watch_idle(
            self.me.clone(),
            id.clone(),
            Rc::downgrade(&state),
            self.core.idle_timeout,
        );
        state.spawn_tracked(Box::pin(watcher));
        crate::telemetry::constructed(namespace);
        crate::telemetry::live_objects(self.core.residency.live());
        Ok(slot)
    }

    /// Drops a live object: its memory, its background tasks and in-memory
    /// timers, its connection. Storage and alarm stay; its slot frees.
    pub(crate) fn evict(&self, id: &ObjectId) -> bool {
        let Some(slot) = self.objects.borrow_mut().remove(id) else {
            return false;
        };
        slot.state.abort_all();
        slot.ctx.object_storage().close();
        self.core.residency.left(id);
        crate::telemetry::evicted();
        crate::telemetry::live_objects(self.core.residency.live());
        tracing::debug!(object = %id, "object evicted");
        true
    }

    /// The residency chose object `id` to make room: it goes if it is still
    /// idle and still chosen (a call may have arrived since).
    pub(crate) fn evict_leaving(&self, id: &ObjectId) {
        let idle = self
            .objects
            .borrow()
            .get(id)
            .is_some_and(|slot| !slot.state.busy());
        if idle && self.core.residency.is_leaving(id) {
            self.evict(id);
        } else {
            self.core.residency.spare(id);
        }
    }

    /// Evicts every object and stops the alarm loop (host shutdown). What
    /// waited for room fails with `ShuttingDown`.
    pub(crate) fn close(self: &Rc<Self>) {
        self.closed.set(true);
        self.core.residency.cancel_waiting_on(self.index);
        let waiting: Vec<Waiting> = self.waiting.borrow_mut().drain().map(|(_, w)| w).collect();
        for waiting in waiting {
            for then in waiting.then {
                then(self, Err(CallError::ShuttingDown));
            }
        }
        let ids: Vec<ObjectId> = self.objects.borrow().keys().cloned().collect();
        for id in ids {
            self.evict(&id);
        }
        self.wake.notify_one();
    }

    /// Adds alarms read from the index at host start.
    pub(crate) fn load_alarms(&self, alarms: Vec<IndexedAlarm>) {
        let mut schedule = self.schedule.borrow_mut();
        for alarm in alarms {
            let entry = Entry {
                at_ms: alarm.at_ms,
                namespace: Arc::from(alarm.namespace),
                retry_count: 0,
            };
            schedule.set(&alarm.id, Some(entry));
        }
        drop(schedule);
        self.wake.notify_one();
    }

    /// A namespace was registered: its parked alarms are due now.
    pub(crate) fn namespace_registered(&self, namespace: &str) {
        let mut schedule = self.schedule.borrow_mut();
        let parked = schedule.parked.remove(namespace).unwrap_or_default();
        for (id, entry) in parked {
            if !schedule.entries.contains_key(&id) {
                schedule.set(&id, Some(entry));
            }
        }
        drop(schedule);
        self.wake.notify_one();
    }

    /// A committed change of object `id`'s alarm. While the object's alarm
    /// handler runs the run's end decides, from the committed row.
    pub(crate) fn alarm_changed(
        &self,
        id: &ObjectId,
        namespace: &Arc<str>,
        at_ms: Option<EpochMs>,
    ) {
        let mut schedule = self.schedule.borrow_mut();
        if schedule.running.contains(id) {
            return;
        }
        let entry = at_ms.map(|at_ms| Entry {
            at_ms,
            namespace: Arc::clone(namespace),
            retry_count: 0,
        });
        schedule.set(id, entry);
        drop(schedule);
        self.wake.notify_one();
    }

    fn fire_due(self: &Rc<Self>) {
        if self.core.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        let now_ms = self.core.clock.now_ms();
        loop {
            let due = self.schedule.borrow_mut().pop_due(now_ms);
            let Some((id, entry)) = due else { break };
            if self.core.constructor(&entry.namespace).is_none() {
                // Its type is not registered yet; registering it wakes it.
                self.schedule
                    .borrow_mut()
                    .parked
                    .entry(Arc::clone(&entry.namespace))
                    .or_default()
                    .push((id, entry));
                continue;
            }
            self.start_alarm(id, entry);
        }
    }

    fn start_alarm(self: &Rc<Self>, id: ObjectId, entry: Entry) {
        // Marked running before construction (which may wait for room), so
        // the new object does not schedule its own row a second time.
        self.schedule.borrow_mut().running.insert(id.clone());
        let namespace = Arc::clone(&entry.namespace);
        let target = id.clone();
        let then: Then = Box::new(move |executor, slot| {
            executor.schedule.borrow_mut().running.remove(&id);
            let now_ms = executor.core.clock.now_ms();
            executor.run_alarm(id, entry, now_ms, slot);
        });
        self.with_object(target, namespace, None, None, then);
    }

    fn run_alarm(
        self: &Rc<Self>,
        id: ObjectId,
        entry: Entry,
        now_ms: EpochMs,
        slot: Result<Rc<Slot>, CallError>,
    ) {
        let slot = match slot {
            Ok(slot) => slot,
            Err(error) => {
                tracing::warn!(object = %id, %error, "object could not be woken for its alarm");
                if self.alarm_failed(&id, entry, now_ms).is_none() {
                    tracing::warn!(object = %id, "alarm dropped from memory after its last retry; it fires again after a restart");
                }
                return;
            }
        };
        let storage = slot.ctx.object_storage();
        match storage.committed_alarm() {
            // A stale index entry: the object's own row is the truth.
            None => {
                storage.forget_stale_index_entry();
                return;
            }
            Some(at_ms) if at_ms > now_ms && entry.retry_count == 0 => {
                self.schedule
                    .borrow_mut()
                    .set(&id, Some(Entry { at_ms, ..entry }));
                return;
            }
            Some(_) => {}
        }
        let info = AlarmInfo {
            retry_count: entry.retry_count,
            is_retry: entry.retry_count > 0,
        };
        self.deliver_alarm(&slot, id, entry, info, None);
    }

    /// Runs the alarm handler of the live object in `slot` with `info`;
    /// the run's end (see [`AlarmRun::finish`]) clears, keeps or retries
    /// the alarm. `report`, when given, learns how the handler ended.
    fn deliver_alarm(
        self: &Rc<Self>,
        slot: &Rc<Slot>,
        id: ObjectId,
        entry: Entry,
        info: AlarmInfo,
        report: Option<AlarmReport>,
    ) {
        self.schedule.borrow_mut().running.insert(id.clone());
        let run = AlarmRun {
            executor: Rc::clone(self),
            id: id.clone(),
            entry: Some(entry.clone()),
            report,
        };
        let lateness_ms =
            (entry.retry_count == 0).then(|| self.core.clock.now_ms().saturating_sub(entry.at_ms));
        crate::telemetry::alarm_fired(&entry.namespace, lateness_ms);
        let span = tracing::info_span!(
            "alarm",
            object = %id,
            namespace = %entry.namespace,
            retry_count = entry.retry_count,
        );
        let activity = slot.state.begin_call();
        let guard = self.core.work.begin();
        let object = Rc::clone(&slot.object);
        let slot_for_run = Rc::clone(slot);
        let task = async move {
            slot_for_run.ctx.object_storage().begin_fire();
            let result = object.deliver_alarm(info).await;
            run.finish(&slot_for_run, result);
            drop(activity);
            drop(guard);
        };
        slot.state.spawn_tracked(Box::pin(task.instrument(span)));
    }

    /// Schedules the retry of a failed delivery, or drops the alarm after
    /// the last retry.
    fn alarm_failed(&self, id: &ObjectId, entry: Entry, now_ms: EpochMs) -> Option<()> {
        let retry_count = entry.retry_count + 1;
        if retry_count > ALARM_MAX_RETRIES {
            return None;
        }
        let delay = ALARM_RETRY_BASE.saturating_mul(1 << (retry_count - 1).min(30));
        let at_ms = now_ms.saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
        self.schedule.borrow_mut().set(
            id,
            Some(Entry {
                at_ms,
                namespace: entry.namespace,
                retry_count,
            }),
        );
        self.wake.notify_one();
        Some(())
    }
}

/// One running alarm delivery. If its task ends without finishing, the
/// row is still in the file and the alarm is delivered again: at once when
/// the object was evicted mid-run, after the retry backoff when the handler
/// panicked (so a panicking handler cannot spin).
struct AlarmRun {
    executor: Rc<Executor>,
    id: ObjectId,
    entry: Option<Entry>,
    /// Who asked for this run and waits for its outcome (a test firing
    /// the alarm now); dropped unanswered if the run is aborted.
    report: Option<AlarmReport>,
}

/// Learns how an alarm handler ended: `Err` carries its error's text.
pub(crate) type AlarmReport = tokio::sync::oneshot::Sender<Result<(), String>>;

impl AlarmRun {
    fn finish(mut self, slot: &Slot, result: Result<(), BoxError>) {
        let Some(entry) = self.entry.take() else {
            return;
        };
        let report = self.report.take();
        let outcome = result.as_ref().map(|_| ()).map_err(ToString::to_string);
        self.settle(slot, entry, result);
        // Only now: whoever waits (on another thread, perhaps) must see
        // the alarm already cleared, kept or rescheduled.
        if let Some(report) = report {
            let _ = report.send(outcome);
        }
    }

    /// Clears, keeps or reschedules the alarm after its handler ended.
    fn settle(&self, slot: &Slot, entry: Entry, result: Result<(), BoxError>) {
        let executor = &self.executor;
        let storage = slot.ctx.object_storage();
        let changed = storage.end_fire();
        executor.schedule.borrow_mut().running.remove(&self.id);
        let now_ms = executor.core.clock.now_ms();
        match result {
            Ok(()) => {
                if !changed {
                    // Delivered: only now may the alarm go (at least once).
                    if let Err(error) = storage.clear_alarm() {
                        tracing::warn!(%error, "delivered alarm could not be cleared; it will fire again after a restart");
                        return;
                    }
                }
            }
            Err(error) if changed => {
                tracing::warn!(%error, "alarm handler failed after setting a new alarm; the new alarm stands");
            }
            Err(error) if error.is::<NoAlarmHandler>() => {
                // Whoever armed this alarm (a capability's scheduler) has
                // work behind it that only the object's handler can run:
                // clearing it would strand that work, retrying cannot
                // help. It stays in the file, out of this process's
                // schedule until the object is built again or sets a new
                // alarm.
                tracing::error!(
                    object = %self.id,
                    namespace = %entry.namespace,
                    %error,
                    "alarm fired for an object that does not handle alarms; it is kept in storage, not retried"
                );
                return;
            }
            Err(error) => {
                if executor
                    .alarm_failed(&self.id, entry.clone(), now_ms)
                    .is_some()
                {
                    tracing::info!(%error, retry_count = entry.retry_count, "alarm handler failed; retrying");
                    return;
                }
                tracing::warn!(%error, retries = ALARM_MAX_RETRIES, "alarm handler failed after its last retry; the alarm is dropped");
                if let Err(error) = storage.clear_alarm() {
                    tracing::warn!(%error, "dropped alarm could not be cleared");
                }
            }
        }
        executor.alarm_changed(&self.id, &entry.namespace, storage.committed_alarm());
    }
}

impl Drop for AlarmRun {
    fn drop(&mut self) {
        let Some(entry) = self.entry.take() else {
            return;
        };
        if let Ok(mut schedule) = self.executor.schedule.try_borrow_mut() {
            schedule.running.remove(&self.id);
        }
        let now_ms = self.executor.core.clock.now_ms();
        if std::thread::panicking() {
            tracing::warn!(object = %self.id, "alarm handler panicked");
            if self
                .executor
                .alarm_failed(&self.id, entry, now_ms)
                .is_none()
            {
                tracing::warn!(object = %self.id, "alarm dropped from memory after its last retry; it fires again after a restart");
            }
            return;
        }
        if let Ok(mut schedule) = self.executor.schedule.try_borrow_mut() {
            schedule.set(
                &self.id,
                Some(Entry {
                    at_ms: now_ms,
                    ..entry
                }),
            );
        }
        self.executor.wake.notify_one();
    }
}

/// Evicts object `id` once it has been idle (no call in flight, no
/// `wait_until` pending) for `timeout`. One sleeping task per live object;
/// a call only moves a timestamp.
async fn watch_idle(
    executor: Weak<Executor>,
    id: ObjectId,
    state: Weak<SlotState>,
    timeout: Duration,
) {
    loop {
        let Some(state_now) = state.upgrade() else {
            return;
        };
        // A timeout too large to add never evicts.
        let Some(deadline) = state_now.last_active.get().checked_add(timeout) else {
            return;
        };
        drop(state_now);
        tokio::time::sleep_until(deadline).await;
        let Some(current) = state.upgrade() else {
            return;
        };
        if current.busy() {
            // Its activity ends later and moves last_active; check again then.
            drop(current);
            tokio::time::sleep(timeout).await;
            continue;
        }
        if current
            .last_active
            .get()
            .checked_add(timeout)
            .is_some_and(|deadline| Instant::now() < deadline)
        {
            continue;
        }
        drop(current);
        if let Some(executor) = executor.upgrade() {
            executor.evict(&id);
        }
        return;
    }
}
