//! A test kit for objects built on `durability`: test your own handlers,
//! consumers and alarms against the real embedded host (a real SQLite file
//! per object in a temp dir) on paused time, as Cloudflare's Vitest
//! integration (`runInDurableObject`, `runDurableObjectAlarm`) and tokio's
//! paused clock let you do elsewhere.
//!
//! One call, [`TestHost::run`] (or [`TestHostBuilder::run`] to set the
//! clock's start), gives a current-thread runtime on paused tokio time with
//! a `LocalSet` and an inline host (objects run on the test's own thread) in
//! a temp dir, runs your test and shuts the host down. ([`block_on`] and
//! [`TestHost::start`] are the two halves, for tests that want them apart.)
//! From there:
//!
//! | you want to | call |
//! | --- | --- |
//! | run code inside an object and get non-`Send` values back | [`TestObject::run`] |
//! | let time pass, with every timer and alarm falling due running | [`TestHost::advance`] |
//! | fire the object's alarm now, with chosen [`AlarmInfo`], and learn whether one was armed | [`TestObject::fire_alarm`], [`TestObject::fire_alarm_with`] |
//! | drop the object from memory (eviction) | [`TestObject::evict`] |
//! | crash and restart the whole host on the same directory | [`TestHost::restart`] |
//! | read the object's tables and its stored alarm for assertions | [`TestObject::query`], [`TestObject::table`], [`TestObject::count`], [`TestObject::stored_alarm`] |
//! | make the object's next commit fail, to test your error paths | [`TestObject::fail_next_commit`] |
//!
//! **Capabilities are always built by the object's own constructor.** The
//! kit registers your object type with its factory, exactly as production
//! does, and never lets a test hand capabilities to a running object. After
//! an eviction or a restart the next call or alarm builds the object again
//! through that factory, with its scheduler; so a test cannot deliver an
//! alarm to an object that lost its scheduler. (The host is loud about it
//! too: an object type that does not implement `DurableObject::alarm`
//! gets [`durability_host::NoAlarmHandler`], and its alarm is kept, not
//! cleared.)
//!
//! The kit is built on the host's `testing` feature, which it enables; use
//! it from `[dev-dependencies]` only.
//!
//! Decisions where a user might guess otherwise:
//! - **Inline only.** Objects run on the test's thread (`threads(0)`), which
//!   is what makes paused time deterministic and lets [`TestObject::run`]
//!   return values that are not `Send`. (The host's testing API itself also
//!   works on threaded hosts, except `Stub::run_local`.)
//! - **A fixed, non-round clock start** ([`DEFAULT_CLOCK_START_MS`]), so
//!   stored times repeat from run to run and windowed work (a fanout's
//!   `batch_delay`) does not fall due at the very first instant.
//! - **A restart is a crash, not a shutdown:** nothing in flight gets a
//!   grace period, and the clock continues where it was.
//! - **A forced alarm run is a delivery:** it replaces the timed one and
//!   ends by the host's rules (cleared, kept, or retried with backoff).
//! - **Table reads never wake the object:** they use a read-only connection
//!   of their own and see committed rows only.
//! - **An injected failure hits the object's own code:** the object is
//!   constructed before the failure is armed, so its factory's migrations
//!   are not the commit that fails.
//!
//! # Examples
//!
//! One complete example per capability, each a test of a user's own object:
//!
//! - [`examples::operation_handler`]: a durable operation whose handler
//!   fails once, retried after its backoff; a restart in between.
//! - [`examples::fanout_consumer`]: a fanout consumer that dead-letters
//!   what it cannot handle; an injected commit failure on enqueue.
//! - [`examples::named_alarm`]: a named alarm fired by the host's physical
//!   alarm after an eviction; `fire_alarm` with chosen `AlarmInfo`.
//! - [`examples::log_consumer`]: a log consumer whose cursor survives a
//!   crash, so it resumes where it committed.
//!
//! The shortest test:
//!
//! ```
//! use durability_test::TestHost;
//! use durability_host::{DurableObject, ObjectContext};
//! use durability_platform::{Context, StorageExt, params};
//!
//! struct Counter(ObjectContext);
//! impl DurableObject for Counter {}
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! TestHost::builder().clock_start_ms(1_000_000).run(async |kit| {
//!     assert_eq!(kit.now_ms(), 1_000_000);
//!     let counters = kit.namespace("counters", |ctx| {
//!         ctx.storage().execute_script("CREATE TABLE IF NOT EXISTS n (v INTEGER)")?;
//!         Ok(Counter(ctx))
//!     })?;
//!     let counter = counters.object("visits")?;
//!     counter
//!         .run(|c| async move { c.0.storage().execute("INSERT INTO n VALUES (?1)", &params![1]) })
//!         .await??;
//!     kit.restart().await?; // a crash: memory gone, storage kept
//!     assert_eq!(counter.count("n")?, 1);
//!     Ok::<_, Box<dyn std::error::Error>>(())
//! })
//! # }
//! ```

#![warn(missing_docs)]

pub mod examples;
mod gate;

use std::cell::RefCell;
use std::future::Future;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

pub use durability_host::{AlarmInfo, FiredAlarm, StorageLimits};
use durability_host::{
    BoxError, CallError, DurableObject, Host, HostError, Namespace, ObjectContext, ObjectId, Stub,
};
use durability_platform::{EpochMs, Row, StorageError, Value};
use tempfile::TempDir;
use thiserror::Error;

pub use gate::Gate;

/// Where a [`TestHost`]'s clock starts unless told otherwise: 2025-01-01
/// 12:34:56.789 UTC, a fixed instant so stored times are the same on every
/// run. Deliberately not on a round boundary: work rounded to a window
/// (a fanout's `batch_delay`) would otherwise fall due at the very start.
pub const DEFAULT_CLOCK_START_MS: EpochMs = 1_735_734_896_789;

/// How many scheduler turns [`TestHost::settle`] gives the objects: enough
/// for a chain of due work (an alarm run, its commits, the timers it arms
/// at the current instant) to reach its next real wait.
pub const SETTLE_TURNS: usize = 256;

/// Why a kit call failed. [`KitError::kind`] gives a matchable kind.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum KitError {
    /// The host refused (a bad name, a second host on the directory, ...).
    #[error(transparent)]
    Host(#[from] HostError),
    /// A call did not reach the object or did not finish.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The temp dir could not be made, or the runtime could not start.
    #[error("test kit I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// What kind of failure a [`KitError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KitErrorKind {
    /// From the host: [`KitError::Host`].
    Host,
    /// From a call: [`KitError::Call`].
    Call,
    /// From the file system or the runtime: [`KitError::Io`].
    Io,
}

impl KitError {
    /// The kind of this error, to match on.
    pub fn kind(&self) -> KitErrorKind {
        match self {
            KitError::Host(_) => KitErrorKind::Host,
            KitError::Call(_) => KitErrorKind::Call,
            KitError::Io(_) => KitErrorKind::Io,
        }
    }
}

/// Runs `future` to completion on a fresh current-thread tokio runtime with
/// paused time, inside a `LocalSet` (what an inline host needs). Time only
/// moves when every task waits: a test that sleeps a day takes no time.
/// `Err` only if the runtime cannot start.
pub fn block_on<F: Future>(future: F) -> Result<F::Output, KitError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    Ok(tokio::task::LocalSet::new().block_on(&runtime, future))
}

/// Configures a [`TestHost`].
#[derive(Debug, Clone)]
pub struct TestHostBuilder {
    clock_start_ms: EpochMs,
    idle_timeout: Option<Duration>,
    max_live_objects: Option<usize>,
    data_dir: Option<PathBuf>,
    storage_limits: Option<StorageLimits>,
}

impl TestHostBuilder {
    /// Where the host clock starts (epoch ms). Default:
    /// [`DEFAULT_CLOCK_START_MS`].
    pub fn clock_start_ms(mut self, epoch_ms: EpochMs) -> Self {
        self.clock_start_ms = epoch_ms;
        self
    }

    /// How long an idle object stays in memory. Default: the host's (60 s).
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = Some(timeout);
        self
    }

    /// The most objects in memory at once. Default: the host's.
    pub fn max_live_objects(mut self, n: usize) -> Self {
        self.max_live_objects = Some(n);
        self
    }

    /// What one SQL statement may carry. [`StorageLimits::CLOUDFLARE`]
    /// holds every object to what a Cloudflare Durable Object stores (100
    /// bound parameters, 2 MB values, 100 KB statements), so a test here
    /// fails where the code would fail there. Default: the host's
    /// ([`StorageLimits::SQLITE`]).
    pub fn storage_limits(mut self, limits: StorageLimits) -> Self {
        self.storage_limits = Some(limits);
        self
    }

    /// Use `dir` as the data directory instead of a fresh temp dir (which
    /// is deleted when the [`TestHost`] is dropped); `dir` is kept.
    pub fn data_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.data_dir = Some(dir.into());
        self
    }

    /// Runs a whole test in one call: a paused-time runtime ([`block_on`]),
    /// this host, `body` with it, then a graceful shutdown. `body`'s error
    /// type only needs to take a [`KitError`] (`Box<dyn Error>` does).
    pub fn run<F, Fut, T, E>(self, body: F) -> Result<T, E>
    where
        F: FnOnce(TestHost) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: From<KitError>,
    {
        block_on(async move {
            let kit = self.build()?;
            let output = body(kit.clone()).await;
            kit.shutdown().await;
            output
        })?
    }

    /// Builds the host: inline (`threads(0)`), so call it inside a
    /// `LocalSet` on a runtime with time enabled; [`block_on`] gives both,
    /// on paused time.
    pub fn build(self) -> Result<TestHost, KitError> {
        let (temp, dir) = match self.data_dir {
            Some(dir) => (None, dir),
            None => {
                let temp = tempfile::tempdir()?;
                let dir = temp.path().to_path_buf();
                (Some(temp), dir)
            }
        };
        let mut builder = Host::builder(&dir)
            .threads(0)
            .clock_start_ms(self.clock_start_ms);
        if let Some(timeout) = self.idle_timeout {
            builder = builder.idle_timeout(timeout);
        }
        if let Some(n) = self.max_live_objects {
            builder = builder.max_live_objects(n);
        }
        if let Some(limits) = self.storage_limits {
            builder = builder.storage_limits(limits);
        }
        let host = builder.build()?;
        Ok(TestHost(Rc::new(Kit {
            host: RefCell::new(host),
            dir,
            _temp: temp,
        })))
    }
}

/// An embedded host for tests: inline (objects run on the test's thread,
/// so paused time drives them deterministically), in a temp dir, clock
/// starting at a fixed instant. Cloning shares it. Not `Send`: it lives on
/// the test's thread.
#[derive(Clone)]
pub struct TestHost(Rc<Kit>);

struct Kit {
    /// The host serving now; [`TestHost::restart`] replaces it.
    host: RefCell<Host>,
    dir: PathBuf,
    /// Deleted last, after the host let go of it.
    _temp: Option<TempDir>,
}

impl TestHost {
    /// A host with the defaults of [`TestHost::builder`].
    pub fn start() -> Result<TestHost, KitError> {
        Self::builder().build()
    }

    /// Runs a whole test in one call with the default settings; see
    /// [`TestHostBuilder::run`].
    pub fn run<F, Fut, T, E>(body: F) -> Result<T, E>
    where
        F: FnOnce(TestHost) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: From<KitError>,
    {
        Self::builder().run(body)
    }

    /// Starts configuring a test host.
    pub fn builder() -> TestHostBuilder {
        TestHostBuilder {
            clock_start_ms: DEFAULT_CLOCK_START_MS,
            idle_timeout: None,
            max_live_objects: None,
            data_dir: None,
            storage_limits: None,
        }
    }

    /// Registers your object type under namespace `name`, with the factory
    /// that builds an object (and its capabilities) from its context: the
    /// same factory production registers. It runs again after every
    /// eviction and restart.
    pub fn namespace<T: DurableObject>(
        &self,
        name: &str,
        factory: impl Fn(ObjectContext) -> Result<T, BoxError> + Send + Sync + 'static,
    ) -> Result<Objects<T>, KitError> {
        self.host().namespace(name, factory)?;
        Ok(Objects {
            kit: self.clone(),
            namespace: Arc::from(name),
            _object: PhantomData,
        })
    }

    /// The host serving now (a new one after each [`TestHost::restart`]).
    pub fn host(&self) -> Host {
        self.0.host.borrow().clone()
    }

    /// The data directory.
    pub fn data_dir(&self) -> &Path {
        &self.0.dir
    }

    /// The host clock (epoch ms).
    pub fn now_ms(&self) -> EpochMs {
        self.host().now_ms()
    }

    /// Lets `by` pass on paused time: every in-memory timer and every alarm
    /// that falls due in between runs at its own instant, in order, then
    /// the work they started runs until it waits (see
    /// [`TestHost::settle`]). Needs paused time ([`block_on`] gives it);
    /// on a running clock it really sleeps.
    pub async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
        self.settle().await;
    }

    /// Lets time pass until the host clock reads `at_ms` (at once if it is
    /// already past), like [`TestHost::advance`].
    pub async fn advance_to(&self, at_ms: EpochMs) {
        let ahead = u64::try_from(at_ms.saturating_sub(self.now_ms())).unwrap_or(0);
        self.advance(Duration::from_millis(ahead)).await;
    }

    /// Gives the objects [`SETTLE_TURNS`] scheduler turns without moving
    /// the clock, so work that is ready (a handler the last call woke, a
    /// timer due now) runs until it waits on time or on another call.
    pub async fn settle(&self) {
        for _ in 0..SETTLE_TURNS {
            tokio::task::yield_now().await;
        }
    }

    /// A simulated crash: stops the host at once (every object dropped,
    /// in-flight calls, handlers, timers and `wait_until` work aborted at
    /// their current await) and starts a new one on the same directory,
    /// with the same namespaces and factories and a clock that continues.
    /// Storage and alarms stay; alarms due now fire. [`Objects`] and
    /// [`TestObject`] handles keep working (they follow the new host).
    pub async fn restart(&self) -> Result<(), KitError> {
        let old = self.host();
        let new = old.restart().await?;
        *self.0.host.borrow_mut() = new;
        Ok(())
    }

    /// Shuts the host down gracefully (waiting for in-flight work up to
    /// the host's grace).
    pub async fn shutdown(self) {
        self.host().shutdown().await;
    }
}

/// Your objects of one namespace on a [`TestHost`]; follows restarts.
/// Cloning shares the kit.
pub struct Objects<T> {
    kit: TestHost,
    namespace: Arc<str>,
    _object: PhantomData<fn() -> T>,
}

impl<T> Clone for Objects<T> {
    fn clone(&self) -> Self {
        Objects {
            kit: self.kit.clone(),
            namespace: Arc::clone(&self.namespace),
            _object: PhantomData,
        }
    }
}

impl<T: DurableObject> Objects<T> {
    /// The namespace as the serving host knows it.
    pub fn namespace(&self) -> Result<Namespace<T>, KitError> {
        Ok(self.kit.host().registered_namespace(&self.namespace)?)
    }

    /// Object `name` (nothing is constructed until it is used).
    pub fn object(&self, name: &str) -> Result<TestObject<T>, KitError> {
        let id = self.namespace()?.id_of(name)?;
        Ok(TestObject {
            objects: self.clone(),
            name: Arc::from(name),
            id,
        })
    }
}

/// One of your objects on a [`TestHost`]; follows restarts. Cloning is
/// cheap.
pub struct TestObject<T> {
    objects: Objects<T>,
    name: Arc<str>,
    id: ObjectId,
}

impl<T> Clone for TestObject<T> {
    fn clone(&self) -> Self {
        TestObject {
            objects: self.objects.clone(),
            name: Arc::clone(&self.name),
            id: self.id.clone(),
        }
    }
}

impl<T: DurableObject> TestObject<T> {
    /// The object's id.
    pub fn id(&self) -> &ObjectId {
        &self.id
    }

    /// The object's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A stub on the serving host, for code under test that takes one.
    pub fn stub(&self) -> Result<Stub<T>, KitError> {
        Ok(self.objects.namespace()?.stub(&self.name)?)
    }

    fn host(&self) -> Host {
        self.objects.kit.host()
    }

    /// Runs `f` inside the object (constructing it through its factory if
    /// it is not in memory) and returns its result on the test's thread:
    /// neither `f`, its future nor the result need be `Send`, so a test can
    /// take `Rc`s, capabilities or recorded values out of the object. It
    /// interleaves with the object's other work only at awaits, like any
    /// call.
    pub async fn run<F, Fut, R>(&self, f: F) -> Result<R, KitError>
    where
        F: FnOnce(Rc<T>) -> Fut + 'static,
        Fut: Future<Output = R> + 'static,
        R: 'static,
    {
        Ok(self.stub()?.run_local(f).await?)
    }

    /// Runs the object's alarm handler now, as a first delivery
    /// (`retry_count` 0), if its alarm is armed; says whether one was and
    /// how the handler ended. See [`TestObject::fire_alarm_with`].
    pub async fn fire_alarm(&self) -> Result<FiredAlarm, KitError> {
        self.fire_alarm_with(AlarmInfo {
            retry_count: 0,
            is_retry: false,
        })
        .await
    }

    /// Runs the object's alarm handler now with `info` (to test how your
    /// handler treats a platform retry), if its alarm is armed, whatever
    /// time it is armed for. The run replaces the timed delivery and ends
    /// like one: after `Ok` the alarm is cleared unless the handler set a
    /// new one; after an error the host retries it with backoff.
    /// [`FiredAlarm::NotArmed`] means nothing ran.
    pub async fn fire_alarm_with(&self, info: AlarmInfo) -> Result<FiredAlarm, KitError> {
        Ok(self.stub()?.fire_alarm(info).await?)
    }

    /// The object's alarm as stored in its file (`None`: not armed),
    /// read without waking the object.
    pub fn stored_alarm(&self) -> Result<Option<EpochMs>, KitError> {
        Ok(self.host().stored_alarm(&self.id)?)
    }

    /// Evicts the object: its memory, in-memory timers, background tasks
    /// and in-flight calls go; storage and alarm stay. The next call or
    /// alarm builds it again through its factory.
    pub async fn evict(&self) -> Result<(), KitError> {
        Ok(self.host().evict(&self.id).await?)
    }

    /// Runs the read-only statement `sql` on the object's database through
    /// a connection of its own (the object is not woken; committed rows
    /// only). A writing statement fails.
    pub fn query(&self, sql: &str, params: &[Value]) -> Result<Vec<Row>, KitError> {
        Ok(self.host().query_object(&self.id, sql, params)?)
    }

    /// Every row of `table`, ordered by its first column.
    pub fn table(&self, table: &str) -> Result<Vec<Row>, KitError> {
        self.query(
            &format!("SELECT * FROM {} ORDER BY 1", quote_identifier(table)),
            &[],
        )
    }

    /// How many rows `table` holds.
    pub fn count(&self, table: &str) -> Result<i64, KitError> {
        let rows = self.query(
            &format!("SELECT COUNT(*) FROM {}", quote_identifier(table)),
            &[],
        )?;
        match rows.first() {
            Some(row) => Ok(row.get::<i64>(0).map_err(HostError::Storage)?),
            None => Ok(0),
        }
    }

    /// Makes the object's next commit fail with a storage error and roll
    /// back (nothing of that transaction is written), to test your error
    /// paths. Constructs the object first if needed, so the commit hit is
    /// one of your code's, not of its factory. Armed once.
    pub async fn fail_next_commit(&self) -> Result<(), KitError> {
        self.fail_next_commit_with(StorageError::Unavailable {
            message: "injected by the test kit".to_owned(),
        })
        .await
    }

    /// Like [`TestObject::fail_next_commit`] with the error of your choice
    /// (e.g. [`StorageError::Full`]).
    pub async fn fail_next_commit_with(&self, error: StorageError) -> Result<(), KitError> {
        Ok(self.stub()?.fail_next_commit(error).await?)
    }
}

/// `name` as an SQL identifier: double-quoted, inner quotes doubled, so a
/// table name is never read as SQL.
fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
