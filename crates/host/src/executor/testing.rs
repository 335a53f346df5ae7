//! The executor's side of the host's testing API (feature `testing`): a
//! per-thread registry of executors, so a test on an inline host's thread
//! can run non-`Send` closures in an object; alarm runs on demand; storage
//! failures armed for an object's next commit.
//!
//! Nothing here changes how objects run: a forced alarm run goes through
//! the same delivery and the same end-of-run rules as a timed one.

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::sync::Arc;

use durability_platform::{AlarmInfo, ObjectId, StorageError};
use tokio::sync::oneshot;

use super::{Entry, Executor, Then};
use crate::CallError;

/// How a forced alarm run went, as the executor sees it.
pub(crate) enum Forced {
    /// The object has no alarm armed.
    NotArmed,
    /// Its alarm handler runs now; a second run is not started.
    AlreadyRunning,
    /// The handler started; its outcome arrives here.
    Started(oneshot::Receiver<Result<(), String>>),
}

/// An executor's key: its host core's address and its index there.
type ExecutorKey = (usize, usize);

thread_local! {
    /// The executors running on this thread. Weak: the registry never
    /// keeps an executor alive.
    static EXECUTORS: RefCell<Vec<(ExecutorKey, Weak<Executor>)>> =
        const { RefCell::new(Vec::new()) };
}

/// Keeps an executor in this thread's registry while it runs.
pub(crate) struct Registered(ExecutorKey);

impl Drop for Registered {
    fn drop(&mut self) {
        let key = self.0;
        let _ = EXECUTORS.try_with(|executors| {
            if let Ok(mut executors) = executors.try_borrow_mut() {
                executors.retain(|(k, _)| *k != key);
            }
        });
    }
}

fn key_of(executor: &Executor) -> ExecutorKey {
    (Arc::as_ptr(&executor.core) as usize, executor.index)
}

/// Registers `executor` as running on this thread.
pub(crate) fn register(executor: &Rc<Executor>) -> Registered {
    let key = key_of(executor);
    let _ = EXECUTORS.try_with(|executors| {
        if let Ok(mut executors) = executors.try_borrow_mut() {
            executors.push((key, Rc::downgrade(executor)));
        }
    });
    Registered(key)
}

/// The executor `index` of the host whose core lives at `core`, if it
/// runs on this thread.
pub(crate) fn on_this_thread(core: usize, index: usize) -> Option<Rc<Executor>> {
    EXECUTORS
        .try_with(|executors| {
            executors.try_borrow().ok().and_then(|executors| {
                executors
                    .iter()
                    .find(|(key, _)| *key == (core, index))
                    .and_then(|(_, executor)| executor.upgrade())
            })
        })
        .ok()
        .flatten()
}

impl Executor {
    /// Arms `error` for the next commit of object `id`, constructing the
    /// object first if it is not live so that its factory's commits are
    /// not the ones hit.
    pub(crate) fn inject_failure(
        self: &Rc<Self>,
        id: ObjectId,
        namespace: Arc<str>,
        name: Arc<str>,
        error: StorageError,
        reply: oneshot::Sender<Result<(), CallError>>,
    ) {
        let target = id.clone();
        let then: Then = Box::new(move |executor, slot| {
            let armed = slot.map(|_| {
                executor.injected_failures.borrow_mut().insert(id, error);
            });
            let _ = reply.send(armed);
        });
        self.with_object(target, namespace, Some(name), None, then);
    }

    /// The failure armed for object `id`'s next commit, disarming it.
    pub(crate) fn take_injected_failure(&self, id: &ObjectId) -> Option<StorageError> {
        self.injected_failures.try_borrow_mut().ok()?.remove(id)
    }

    /// Runs object `id`'s alarm handler now with `info` if its alarm is
    /// armed, constructing the object first if needed. The run replaces
    /// the timed delivery and ends like one: cleared after success unless
    /// the handler set a new alarm, retried with backoff after a failure
    /// (counting from `info.retry_count`).
    pub(crate) fn fire_now(
        self: &Rc<Self>,
        id: ObjectId,
        namespace: Arc<str>,
        name: Arc<str>,
        info: AlarmInfo,
        reply: oneshot::Sender<Result<Forced, CallError>>,
    ) {
        if self.schedule.borrow().running.contains(&id) {
            let _ = reply.send(Ok(Forced::AlreadyRunning));
            return;
        }
        let target = id.clone();
        let entry_namespace = Arc::clone(&namespace);
        let then: Then = Box::new(move |executor, slot| {
            let slot = match slot {
                Ok(slot) => slot,
                Err(error) => {
                    let _ = reply.send(Err(error));
                    return;
                }
            };
            if executor.schedule.borrow().running.contains(&id) {
                let _ = reply.send(Ok(Forced::AlreadyRunning));
                return;
            }
            let Some(at_ms) = slot.ctx.object_storage().committed_alarm() else {
                let _ = reply.send(Ok(Forced::NotArmed));
                return;
            };
            // This run is the delivery: the timed one must not follow it.
            executor.schedule.borrow_mut().set(&id, None);
            let entry = Entry {
                at_ms,
                namespace: entry_namespace,
                retry_count: info.retry_count,
            };
            let (report, outcome) = oneshot::channel();
            executor.deliver_alarm(&slot, id, entry, info, Some(report));
            let _ = reply.send(Ok(Forced::Started(outcome)));
        });
        self.with_object(target, namespace, Some(name), None, then);
    }
}
