//! Residency: how many objects may be in memory at once, host-wide, and
//! which one leaves first when a new object needs room.
//!
//! Each live object holds three file descriptors (its database, WAL and
//! shared-memory index), so the number of live objects is capped
//! ([`crate::HostBuilder::max_live_objects`]). The cap is host-wide but
//! objects live on different executor threads, so one coordinator owns the
//! accounting: a count of the slots taken, the idle objects in
//! least-recently-used order, and the constructions waiting for room. It is
//! one std `Mutex`, held for a few map operations and never across an await.
//! An object takes the lock only when it turns idle or busy, not on every
//! call that finds it already busy.
//!
//! Why one coordinator rather than an atomic count with one LRU per
//! executor: the victim must be the least recently used idle object of the
//! whole host, and a per-executor LRU would evict a warm object of one
//! thread while a cold one sleeps on another. The coordinator decides;
//! executors act on its orders ([`Order`]) as jobs on their own thread, the
//! only place an object can be checked and evicted.
//!
//! The rules:
//! - Only *idle* objects are evicted (no call or alarm run in flight, no
//!   `wait_until` pending): the idle-eviction rule. A busy object is never
//!   chosen, and a victim that turns busy before its executor acts is
//!   spared; another idle object is chosen instead.
//! - When nothing is idle the construction waits, first come first served,
//!   and gets the next slot that frees.
//! - Waiting could deadlock: when every live object is busy with a call of
//!   its own that waits for room (object A calls object B, which is not
//!   live), no slot can ever free. Then the coordinator admits one waiting
//!   construction over the cap (with a `tracing::warn!`), preferring a call
//!   made from inside an object. The excess is reclaimed as soon as objects
//!   turn idle: they are evicted until the count is back under the cap.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use durability_platform::ObjectId;
use tokio::sync::mpsc::WeakUnboundedSender;

use crate::executor::{Executor, Job};

/// File descriptors one live object holds: its database, WAL and
/// shared-memory index.
pub const FDS_PER_LIVE_OBJECT: usize = 3;
/// File descriptors the default cap leaves to everything else of the
/// process: the alarm index, executor threads, the server's sockets, logs.
pub const RESERVED_FDS: usize = 256;
/// The default cap never exceeds this many live objects, however high the
/// descriptor limit: beyond it memory, not descriptors, is the bound.
pub const DEFAULT_MAX_LIVE_OBJECTS_CEILING: usize = 65_536;

/// The default cap: as many objects as the soft `RLIMIT_NOFILE` leaves
/// descriptors for after [`RESERVED_FDS`], between 1 and
/// [`DEFAULT_MAX_LIVE_OBJECTS_CEILING`].
pub(crate) fn default_max_live_objects() -> usize {
    let fds = soft_fd_limit().unwrap_or(DEFAULT_MAX_LIVE_OBJECTS_CEILING * FDS_PER_LIVE_OBJECT);
    (fds.saturating_sub(RESERVED_FDS) / FDS_PER_LIVE_OBJECT)
        .clamp(1, DEFAULT_MAX_LIVE_OBJECTS_CEILING)
}

#[cfg(unix)]
fn soft_fd_limit() -> Option<usize> {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    // `None` is "unlimited".
    limit
        .current
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
}

#[cfg(not(unix))]
fn soft_fd_limit() -> Option<usize> {
    None
}

/// What an executor must do for the coordinator, on its own thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Order {
    /// Evict object `id` if it is still idle and still chosen.
    Evict { executor: usize, id: ObjectId },
    /// A slot is taken for the waiting construction of object `id`.
    Admit { executor: usize, id: ObjectId },
}

/// The answer to a construction's request for a slot.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// A slot is taken for it: construct now.
    Now,
    /// The least recently used idle object lives on the asking executor:
    /// evict it there, now, and ask again.
    EvictFirst(ObjectId),
    /// It waits; an [`Order::Admit`] comes when a slot is taken for it.
    Wait,
}

/// One live object or waiting construction and where it lives.
#[derive(Debug, Clone)]
struct Resident {
    id: ObjectId,
    executor: usize,
}

#[derive(Debug)]
struct Waiter {
    resident: Resident,
    /// The objects whose code made calls that wait for this construction.
    callers: Vec<ObjectId>,
}

#[derive(Debug, Default)]
struct State {
    /// Slots taken: live objects plus constructions admitted and not yet
    /// built (or failed).
    taken: usize,
    /// Idle live objects, least recently used first, by the stamp of the
    /// moment they turned idle.
    idle: BTreeMap<u64, Resident>,
    stamps: HashMap<ObjectId, u64>,
    next_stamp: u64,
    /// Objects chosen to leave, whose executor has not evicted them yet.
    leaving: HashSet<ObjectId>,
    /// Constructions waiting for a slot, first come first served.
    waiting: VecDeque<Waiter>,
    /// For each object with calls waiting in `waiting`, how many.
    stuck: HashMap<ObjectId, usize>,
}

/// The host-wide coordinator of live objects. Shared by every executor.
#[derive(Debug)]
pub(crate) struct Residency {
    max_live: usize,
    state: Mutex<State>,
    /// The executors' job queues, set once they started. Weak, so that the
    /// host's last handle still closes the queues and stops the executors.
    executors: OnceLock<Vec<WeakUnboundedSender<Job>>>,
}

impl Residency {
    pub(crate) fn new(max_live: usize) -> Self {
        Residency {
            max_live,
            state: Mutex::new(State::default()),
            executors: OnceLock::new(),
        }
    }

    pub(crate) fn connect(&self, executors: Vec<WeakUnboundedSender<Job>>) {
        let _ = self.executors.set(executors);
    }

    /// Slots taken now: live objects and constructions under way.
    pub(crate) fn live(&self) -> usize {
        self.lock().taken
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent at every await-free step, so a panic
        // elsewhere while it was held leaves nothing half-done worth refusing.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A construction of object `id` on `executor` asks for a slot.
    /// `caller` is the object whose code made the call, if one did.
    pub(crate) fn admit(
        self: &Arc<Self>,
        id: &ObjectId,
        executor: usize,
        caller: Option<ObjectId>,
    ) -> Admission {
        let mut orders = Vec::new();
        let admission = {
            let mut state = self.lock();
            if state.waiting.is_empty() && state.taken < self.max_live {
                state.taken += 1;
                Admission::Now
            } else if state.waiting.is_empty()
                && let Some(victim) = state.pop_lru_on(executor)
            {
                // Synchronous on the asking thread: the victim is idle now
                // and nothing else of its executor runs until it is gone.
                state.leaving.insert(victim.clone());
                Admission::EvictFirst(victim)
            } else {
                if let Some(caller) = &caller {
                    *state.stuck.entry(caller.clone()).or_default() += 1;
                }
                state.waiting.push_back(Waiter {
                    resident: Resident {
                        id: id.clone(),
                        executor,
                    },
                    callers: caller.into_iter().collect(),
                });
                self.settle(&mut state, &mut orders);
                Admission::Wait
            }
        };
        self.dispatch(orders);
        admission
    }

    /// A call from object `caller` queues behind the waiting construction
    /// of object `id`: `caller` now waits for room too.
    pub(crate) fn also_waiting(self: &Arc<Self>, id: &ObjectId, caller: ObjectId) {
        let mut orders = Vec::new();
        {
            let mut state = self.lock();
            let State { waiting, stuck, .. } = &mut *state;
            // Not found: a slot is already on its way to the construction.
            if let Some(waiter) = waiting.iter_mut().find(|w| w.resident.id == *id) {
                *stuck.entry(caller.clone()).or_default() += 1;
                waiter.callers.push(caller);
                self.settle(&mut state, &mut orders);
            }
        }
        self.dispatch(orders);
    }

    /// Object `id` turned busy: it may not be evicted until it is idle.
    pub(crate) fn became_busy(self: &Arc<Self>, id: &ObjectId) {
        let mut orders = Vec::new();
        {
            let mut state = self.lock();
            if let Some(stamp) = state.stamps.remove(id) {
                state.idle.remove(&stamp);
            }
            // A chosen victim that got a call in the meantime is spared.
            state.leaving.remove(id);
            self.settle(&mut state, &mut orders);
        }
        self.dispatch(orders);
    }

    /// Object `id` of `executor` turned idle (or was just built and is not
    /// busy): the most recently used now. If room is wanted, it leaves.
    pub(crate) fn became_idle(self: &Arc<Self>, id: &ObjectId, executor: usize) {
        let mut orders = Vec::new();
        {
            let mut state = self.lock();
            if let Some(stamp) = state.stamps.remove(id) {
                state.idle.remove(&stamp);
            }
            let stamp = state.next_stamp;
            state.next_stamp += 1;
            state.stamps.insert(id.clone(), stamp);
            state.idle.insert(
                stamp,
                Resident {
                    id: id.clone(),
                    executor,
                },
            );
            self.settle(&mut state, &mut orders);
        }
        self.dispatch(orders);
    }

    /// Whether object `id` is still chosen to leave (its executor checks
    /// before it evicts on an [`Order::Evict`]).
    pub(crate) fn is_leaving(&self, id: &ObjectId) -> bool {
        self.lock().leaving.contains(id)
    }

    /// A victim was not evicted after all (gone already, or busy): choose
    /// another if room is still wanted.
    pub(crate) fn spare(self: &Arc<Self>, id: &ObjectId) {
        let mut orders = Vec::new();
        {
            let mut state = self.lock();
            state.leaving.remove(id);
            self.settle(&mut state, &mut orders);
        }
        self.dispatch(orders);
    }

    /// Live object `id` was evicted, for whatever reason: its slot frees.
    pub(crate) fn left(self: &Arc<Self>, id: &ObjectId) {
        let mut orders = Vec::new();
        {
            let mut state = self.lock();
            if let Some(stamp) = state.stamps.remove(id) {
                state.idle.remove(&stamp);
            }
            state.leaving.remove(id);
            state.taken = state.taken.saturating_sub(1);
            self.settle(&mut state, &mut orders);
        }
        self.dispatch(orders);
    }

    /// A slot taken for a construction frees without an object: the
    /// construction failed, or its executor closed first.
    pub(crate) fn release_unbuilt(self: &Arc<Self>) {
        let mut orders = Vec::new();
        {
            let mut state = self.lock();
            state.taken = state.taken.saturating_sub(1);
            self.settle(&mut state, &mut orders);
        }
        self.dispatch(orders);
    }

    /// `executor` closes: its waiting constructions stop waiting.
    pub(crate) fn cancel_waiting_on(self: &Arc<Self>, executor: usize) {
        let mut orders = Vec::new();
        {
            let mut state = self.lock();
            let waiting = std::mem::take(&mut state.waiting);
            for waiter in waiting {
                if waiter.resident.executor == executor {
                    state.unstick(&waiter.callers);
                } else {
                    state.waiting.push_back(waiter);
                }
            }
            self.settle(&mut state, &mut orders);
        }
        self.dispatch(orders);
    }

    /// Brings the state back to its rules after any change: free slots go
    /// to waiters in order; idle objects are chosen to leave while room is
    /// wanted; a deadlocked wait is admitted over the cap.
    fn settle(&self, state: &mut State, orders: &mut Vec<Order>) {
        while state.taken < self.max_live
            && let Some(waiter) = state.waiting.pop_front()
        {
            state.unstick(&waiter.callers);
            state.taken += 1;
            orders.push(Order::Admit {
                executor: waiter.resident.executor,
                id: waiter.resident.id,
            });
        }
        // Room is wanted for every waiter, and for every object over the cap.
        let wanted = state.waiting.len() + state.taken.saturating_sub(self.max_live);
        while state.leaving.len() < wanted
            && let Some(victim) = state.pop_lru()
        {
            state.leaving.insert(victim.id.clone());
            orders.push(Order::Evict {
                executor: victim.executor,
                id: victim.id,
            });
        }
        // Nothing idle, nothing on its way out, and every slot held by an
        // object whose own call waits here: no slot can ever free.
        if !state.waiting.is_empty()
            && state.idle.is_empty()
            && state.leaving.is_empty()
            && state.stuck.len() >= state.taken
        {
            let first_nested = state
                .waiting
                .iter()
                .position(|w| !w.callers.is_empty())
                .unwrap_or(0);
            if let Some(waiter) = state.waiting.remove(first_nested) {
                tracing::warn!(
                    object = %waiter.resident.id,
                    max_live_objects = self.max_live,
                    live = state.taken,
                    "every live object waits on a call to an object that is not live; admitting it over the cap"
                );
                state.unstick(&waiter.callers);
                state.taken += 1;
                orders.push(Order::Admit {
                    executor: waiter.resident.executor,
                    id: waiter.resident.id,
                });
            }
        }
    }

    /// Sends each order to its executor as a job, after the lock is gone.
    fn dispatch(self: &Arc<Self>, orders: Vec<Order>) {
        for order in orders {
            let (executor, job): (usize, Job) = match order {
                Order::Evict { executor, id } => (
                    executor,
                    Box::new(move |e: &Rc<Executor>| e.evict_leaving(&id)),
                ),
                Order::Admit { executor, id } => {
                    let mut grant = Grant {
                        residency: Arc::clone(self),
                        id: Some(id),
                    };
                    (
                        executor,
                        Box::new(move |e: &Rc<Executor>| {
                            if let Some(id) = grant.id.take() {
                                e.admitted(&id);
                            }
                        }),
                    )
                }
            };
            let sender = self
                .executors
                .get()
                .and_then(|senders| senders.get(executor))
                .and_then(WeakUnboundedSender::upgrade);
            if let Some(sender) = sender {
                // A job refused by a stopped executor is dropped here.
                let _ = sender.send(job);
            }
        }
    }
}

/// A slot taken for a waiting construction, on its way to its executor.
/// Dropped unused (the executor stopped before it ran the job), it frees
/// the slot again, so the count stays exact.
struct Grant {
    residency: Arc<Residency>,
    id: Option<ObjectId>,
}

impl Drop for Grant {
    fn drop(&mut self) {
        if self.id.is_some() {
            self.residency.release_unbuilt();
        }
    }
}

impl State {
    fn pop_lru(&mut self) -> Option<Resident> {
        let (_, victim) = self.idle.pop_first()?;
        self.stamps.remove(&victim.id);
        Some(victim)
    }

    /// The least recently used idle object, if it lives on `executor`.
    fn pop_lru_on(&mut self, executor: usize) -> Option<ObjectId> {
        let (_, first) = self.idle.first_key_value()?;
        if first.executor != executor {
            return None;
        }
        self.pop_lru().map(|victim| victim.id)
    }

    fn unstick(&mut self, callers: &[ObjectId]) {
        for caller in callers {
            if let Some(count) = self.stuck.get_mut(caller) {
                *count -= 1;
                if *count == 0 {
                    self.stuck.remove(caller);
                }
            }
        }
    }
}
