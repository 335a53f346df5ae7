//! Fixtures shared by the capability tests, over the public test kit
//! (`durability-test`): a real inline host (one SQLite file per object in a
//! temp dir, objects on the test's thread so paused tokio time drives
//! everything) and a plain object that hands its context to the test.
//!
//! What is here and not in the kit is specific to these tests: objects
//! whose capabilities a test builds inside a call (`TestObject`,
//! `Harness`), lifecycle event traces, and `open_host` for directories
//! another process wrote (on the system clock, as that process was).
//!
//! Every host here holds its objects to Cloudflare's storage limits
//! ([`StorageLimits::CLOUDFLARE`]: 100 bound parameters, 2 MB values,
//! 100 KB statements), so each statement any capability test makes is
//! checked against them and one beyond them fails its test with
//! `StorageError::LimitExceeded`: the capabilities must run unchanged in a
//! Durable Object.

#![allow(dead_code, unused_imports)] // each test binary uses a different part of the support module

use std::future::Future;
use std::path::Path;
use std::rc::Rc;

use std::cell::RefCell;

use durability::Scheduler;
use durability_host::{
    AlarmInfo, BoxError, DurableObject, Host, Namespace, NoAlarmHandler, ObjectContext, ObjectId,
    StorageLimits,
};
use durability_platform::Context;
pub use durability_test::Gate;

/// The object type of the tests: nothing but its context.
pub struct TestObject {
    pub ctx: ObjectContext,
}

impl DurableObject for TestObject {}

impl TestObject {
    /// The context as capabilities hold it.
    pub fn context(&self) -> Rc<dyn Context> {
        self.ctx.clone().into_dyn()
    }
}

/// An object whose `alarm()` delegates to the scheduler a test installs in
/// it, the way an application object does. Capabilities built in a test are
/// kept in `state` so they live as long as the object.
pub struct Harness {
    pub ctx: ObjectContext,
    pub scheduler: RefCell<Option<Scheduler>>,
    pub state: RefCell<Vec<Box<dyn std::any::Any>>>,
}

impl Harness {
    /// The context as capabilities hold it.
    pub fn context(&self) -> Rc<dyn Context> {
        self.ctx.clone().into_dyn()
    }

    /// Installs `scheduler` as the one the object's alarm delegates to.
    pub fn install(&self, scheduler: &Scheduler) {
        *self.scheduler.borrow_mut() = Some(scheduler.clone());
    }

    /// Keeps `value` alive as long as the object.
    pub fn keep<T: 'static>(&self, value: T) {
        self.state.borrow_mut().push(Box::new(value));
    }
}

impl DurableObject for Harness {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        let scheduler = self.scheduler.borrow().clone();
        match scheduler {
            Some(scheduler) => scheduler
                .alarm(Some(info))
                .await
                .map_err(|e| Box::new(e) as BoxError),
            // Its scheduler went with an eviction or a restart: the work
            // behind the alarm must not be cleared away as delivered.
            None => Err(Box::new(NoAlarmHandler)),
        }
    }
}

/// The namespace of [`Harness`] objects.
pub const HARNESS_NAMESPACE: &str = "harness";

fn harness(ctx: ObjectContext) -> Result<Harness, BoxError> {
    Ok(Harness {
        ctx,
        scheduler: RefCell::new(None),
        state: RefCell::new(Vec::new()),
    })
}

/// Opens an inline host over `dir` (on the system clock, for directories a
/// child process wrote) with the [`Harness`] namespace.
pub fn open_harness_host(dir: &Path) -> (Host, Namespace<Harness>) {
    let host = Host::builder(dir)
        .threads(0)
        .clock_start_ms(1_000_000)
        .storage_limits(StorageLimits::CLOUDFLARE)
        .build()
        .expect("host");
    let objects = host
        .namespace(HARNESS_NAMESPACE, harness)
        .expect("namespace");
    (host, objects)
}

/// Runs `body` on one [`Harness`] object of a fresh kit host (clock
/// starting at 1,000,000 ms) inside a `LocalSet`; the whole test body runs
/// on the object, so paused tokio time drives handlers, timers and alarms
/// alike. Shuts the host down afterwards.
pub async fn on_harness<F, Fut, R>(body: F) -> R
where
    F: FnOnce(Rc<Harness>) -> Fut + 'static,
    Fut: Future<Output = R> + 'static,
    R: 'static,
{
    tokio::task::LocalSet::new()
        .run_until(async move {
            let kit = durability_test::TestHost::builder()
                .clock_start_ms(1_000_000)
                .storage_limits(StorageLimits::CLOUDFLARE)
                .build()
                .expect("kit host");
            let object = kit
                .namespace(HARNESS_NAMESPACE, harness)
                .and_then(|objects| objects.object("object"))
                .expect("harness object");
            let output = object.run(body).await.expect("the call reaches the object");
            kit.shutdown().await;
            output
        })
        .await
}

/// A kit host (inline, temp dir) with one namespace of [`TestObject`]s.
/// Build it inside a `LocalSet` (see [`with_host`]).
pub struct TestHost {
    pub kit: durability_test::TestHost,
    /// The namespace as the kit holds it (follows restarts).
    pub kit_objects: durability_test::Objects<TestObject>,
    pub host: Host,
    pub objects: Namespace<TestObject>,
}

/// The namespace of [`TestObject`]s.
pub const TEST_NAMESPACE: &str = "test";

impl TestHost {
    /// A host with `threads(0)`: objects run on the caller's `LocalSet`.
    pub fn new() -> Self {
        let kit = durability_test::TestHost::builder()
            .storage_limits(StorageLimits::CLOUDFLARE)
            .build()
            .expect("kit host");
        let kit_objects = kit
            .namespace(TEST_NAMESPACE, |ctx| Ok(TestObject { ctx }))
            .expect("namespace");
        let objects = kit_objects.namespace().expect("namespace");
        let host = kit.host();
        TestHost {
            kit,
            kit_objects,
            host,
            objects,
        }
    }

    /// Object `name` as the kit sees it (alarms, tables, eviction).
    pub fn object(&self, name: &str) -> durability_test::TestObject<TestObject> {
        self.kit_objects.object(name).expect("valid object name")
    }

    /// Runs `f` on object `name` with its context, constructing the object
    /// if needed; `f` and its result need not be `Send`.
    pub async fn run<F, Fut, R>(&self, name: &str, f: F) -> R
    where
        F: FnOnce(Rc<dyn Context>) -> Fut + 'static,
        Fut: Future<Output = R> + 'static,
        R: 'static,
    {
        self.object(name)
            .run(move |object: Rc<TestObject>| f(object.context()))
            .await
            .expect("the call reaches the object")
    }

    /// The id of object `name`.
    pub fn id(&self, name: &str) -> ObjectId {
        self.objects.id_of(name).expect("valid object name")
    }

    /// Evicts object `name`: memory, timers and background tasks go, its
    /// storage and alarm stay (what a restart looks like to the object).
    pub async fn evict(&self, name: &str) {
        self.object(name).evict().await.expect("evict");
    }
}

impl Default for TestHost {
    fn default() -> Self {
        Self::new()
    }
}

/// Opens an inline host over `dir` with the [`TestObject`] namespace; for
/// tests that reopen a directory another host (or process) wrote.
pub fn open_host(dir: &Path) -> (Host, Namespace<TestObject>) {
    let host = Host::builder(dir)
        .threads(0)
        .storage_limits(StorageLimits::CLOUDFLARE)
        .build()
        .expect("host");
    let objects = host
        .namespace(TEST_NAMESPACE, |ctx| Ok(TestObject { ctx }))
        .expect("namespace");
    (host, objects)
}

/// Runs `body` with a fresh [`TestHost`] inside a `LocalSet`, then shuts the
/// host down.
pub async fn with_host<F, Fut>(body: F) -> Fut::Output
where
    F: FnOnce(Rc<TestHost>) -> Fut,
    Fut: Future,
{
    tokio::task::LocalSet::new()
        .run_until(async move {
            let host = Rc::new(TestHost::new());
            let output = body(Rc::clone(&host)).await;
            host.kit.host().shutdown().await;
            output
        })
        .await
}

/// Runs `f` with the context of a fresh object on a fresh host: the
/// shortest way to get real storage in a test.
pub async fn with_context<F, Fut, R>(f: F) -> R
where
    F: FnOnce(Rc<dyn Context>) -> Fut + 'static,
    Fut: Future<Output = R> + 'static,
    R: 'static,
{
    with_host(|host| async move { host.run("object", f).await }).await
}

/// Lifecycle events a hook recorded, in emit order. Cloning shares the list.
#[derive(Clone, Default)]
pub struct Events(Rc<RefCell<Vec<durability::lifecycle::LifecycleEvent>>>);

impl Events {
    /// A hook that appends every event to this list.
    pub fn hook(&self) -> durability::lifecycle::LifecycleHook {
        let events = Rc::clone(&self.0);
        Rc::new(move |event| {
            events.borrow_mut().push(event.clone());
            None
        })
    }

    /// Every event recorded so far.
    pub fn all(&self) -> Vec<durability::lifecycle::LifecycleEvent> {
        self.0.borrow().clone()
    }

    /// The events about record `id`, as `type` or `attempt_settled:<outcome>`
    /// with the attempt number: `"attempt_started 1"`, `"attempt_settled:completed 2"`.
    pub fn trace(&self, id: &str) -> Vec<String> {
        use durability::lifecycle::{LifecycleEvent, Outcome};
        self.0
            .borrow()
            .iter()
            .filter(|event| event.entity().is_none_or(|entity| entity.id() == id))
            .map(|event| match event {
                LifecycleEvent::AttemptStarted { attempt, .. } => {
                    format!("attempt_started {attempt}")
                }
                LifecycleEvent::AttemptSettled {
                    attempt, outcome, ..
                } => {
                    let outcome = match outcome {
                        Outcome::Completed { .. } => "completed",
                        Outcome::RetryScheduled { .. } => "retry_scheduled",
                        Outcome::Failed { .. } => "failed",
                    };
                    format!("attempt_settled:{outcome} {attempt}")
                }
                LifecycleEvent::Terminal { attempt, .. } => format!("terminal {attempt}"),
                other => other.lifecycle_type().to_owned(),
            })
            .collect()
    }
}

/// The object's physical alarm.
pub async fn physical_alarm(ctx: &dyn Context) -> Option<i64> {
    ctx.storage().get_alarm().await.expect("read the alarm")
}

/// One integer from a query (`SELECT COUNT(*) ...`).
pub fn query_i64(ctx: &dyn Context, sql: &str, params: &[durability_platform::Value]) -> i64 {
    ctx.storage()
        .query_row(sql, params)
        .expect("query")
        .expect("a row")
        .get::<i64>(0)
        .expect("an integer")
}

/// Every row of `table` as text, ordered by its first column: a snapshot to
/// compare before and after a call that must not write.
pub fn table_snapshot(ctx: &dyn Context, table: &str) -> Vec<Vec<durability_platform::Value>> {
    ctx.storage()
        .query(&format!("SELECT * FROM {table} ORDER BY 1"), &[])
        .expect("snapshot")
        .iter()
        .map(|row| row.values().to_vec())
        .collect()
}

/// `[[...[1]...]]`, `depth` arrays deep.
pub fn nested_json(depth: usize) -> serde_json::Value {
    let mut value = serde_json::Value::from(1);
    for _ in 0..depth {
        value = serde_json::Value::Array(vec![value]);
    }
    value
}

/// Takes a value from [`nested_json`] apart one level at a time: the derived
/// drop of a `serde_json::Value` recurses once per level, which a value
/// thousands of levels deep must not do on a test thread's stack.
pub fn dismantle_json(mut value: serde_json::Value) {
    while let serde_json::Value::Array(mut items) = value {
        value = items.pop().unwrap_or(serde_json::Value::Null);
    }
}
