//! [`ObjectContext`]: what a live object gets from the host, the host's
//! implementation of the platform's [`Context`].

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use durability_platform::{Context, EpochMs, LocalBoxFuture, ObjectId, Storage};
use rand::RngCore;

use crate::clock::Clock;
use crate::executor::SlotState;
use crate::storage::ObjectStorage;
use crate::work::WorkTracker;

/// The context of one live object: its id, its storage and alarm, the host
/// clock, randomness and background work.
///
/// Cloning is one reference-count increment; the factory, the object and
/// every capability of it share one context. It is not `Send`: an object
/// and everything it holds stay on the object's executor thread.
///
/// When the object is evicted, the context's storage is closed: a clone that
/// outlives its object gets `StorageError::Unavailable` instead of writing
/// behind the next instance.
#[derive(Clone)]
pub struct ObjectContext {
    inner: Rc<ContextInner>,
}

struct ContextInner {
    id: ObjectId,
    namespace: Arc<str>,
    name: Option<String>,
    storage: ObjectStorage,
    clock: Clock,
    state: Rc<SlotState>,
    work: Arc<WorkTracker>,
}

impl ObjectContext {
    pub(crate) fn new(
        id: ObjectId,
        namespace: Arc<str>,
        name: Option<String>,
        storage: ObjectStorage,
        clock: Clock,
        state: Rc<SlotState>,
        work: Arc<WorkTracker>,
    ) -> Self {
        ObjectContext {
            inner: Rc::new(ContextInner {
                id,
                namespace,
                name,
                storage,
                clock,
                state,
                work,
            }),
        }
    }

    /// The namespace the object belongs to.
    pub fn namespace(&self) -> &str {
        &self.inner.namespace
    }

    /// The object's name, if it was recorded (it is, once the object has
    /// been called through a stub).
    pub fn name(&self) -> Option<&str> {
        self.inner.name.as_deref()
    }

    /// The context as the trait object capabilities hold.
    pub fn into_dyn(self) -> Rc<dyn Context> {
        Rc::new(self)
    }

    pub(crate) fn object_storage(&self) -> &ObjectStorage {
        &self.inner.storage
    }
}

impl From<ObjectContext> for Rc<dyn Context> {
    fn from(ctx: ObjectContext) -> Self {
        ctx.into_dyn()
    }
}

impl Context for ObjectContext {
    fn id(&self) -> &ObjectId {
        &self.inner.id
    }

    fn storage(&self) -> &dyn Storage {
        &self.inner.storage
    }

    fn now_ms(&self) -> EpochMs {
        self.inner.clock.now_ms()
    }

    fn sleep(&self, duration: Duration) -> LocalBoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(duration))
    }

    fn random_bytes(&self, buf: &mut [u8]) {
        rand::rng().fill_bytes(buf);
    }

    fn spawn(&self, task: LocalBoxFuture<'static, ()>) {
        self.inner.state.spawn_tracked(task);
    }

    fn wait_until(&self, task: LocalBoxFuture<'static, ()>) {
        let activity = self.inner.state.begin_wait();
        let guard = self.inner.work.begin();
        self.inner.state.spawn_tracked(Box::pin(async move {
            task.await;
            drop(activity);
            drop(guard);
        }));
    }
}
