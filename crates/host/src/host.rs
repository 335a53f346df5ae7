//! The [`Host`], its builder, namespaces and stubs: the handles other
//! threads use to reach objects.

use std::collections::HashMap;
use std::fs::{File, TryLockError};
use std::future::Future;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use durability_platform::{EpochMs, MAX_SAFE_INTEGER, ObjectId, StorageLimits};
use tokio::sync::{mpsc, oneshot};

use crate::archive::{ArchiveConfig, Archiver};
use crate::clock::Clock;
use crate::context::ObjectContext;
use crate::executor::{self, Constructor, ErasedObject, Job, Reply};
use crate::flush::{self, Flush, FlushMethod, Flusher, GroupCommit};
use crate::id::{executor_of, object_id, object_path, validate_name};
use crate::index::{AlarmIndex, IndexRebuild, IndexedAlarm};
use crate::journal::{self, JournalError};
use crate::residency::{Residency, default_max_live_objects};
use crate::work::WorkTracker;
use crate::{BoxError, CallError, DurableObject, HostError};

#[cfg(feature = "testing")]
mod testing;
#[cfg(feature = "testing")]
pub use testing::FiredAlarm;

/// How the host makes commits survive a process crash and a power loss.
///
/// | mode | a commit returns | process crash | power loss / OS crash |
/// | --- | --- | --- | --- |
/// | `Batched` (default) | at memory speed | nothing lost | nothing lost that a released reply depended on |
/// | `Full` | after its own sync | nothing lost | nothing lost |
/// | `Normal` | at memory speed | nothing lost | the last commits may be lost, replies included |
///
/// In all three, rows and the alarm of one transaction commit together,
/// and a WAL keeps a prefix of an object's commits: a power loss never
/// keeps a later commit of an object without its earlier ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// Group commit with output gates (default). Commits do not wait for a
    /// sync of their own; a host-wide flusher syncs pending commits of many
    /// objects together (see [`FlushMethod`]), and a reply of
    /// [`Stub::call`] is released only once every commit its object made
    /// before the reply is durable. A commit no reply waits for is synced
    /// within 50 ms, or with its object's next awaited commit. So whatever
    /// a caller saw survives a power loss, as with `Full`; work the host
    /// runs by itself (alarms, timers, in-process consumers) is not held
    /// and may be repeated after a power loss, but the host's alarm index
    /// never records an alarm as cleared before the clearing commit is
    /// durable. A failed sync shuts the gates for good
    /// ([`CallError::NotDurable`]).
    #[default]
    Batched,
    /// `synchronous=FULL`: each commit is synced to disk before it returns.
    Full,
    /// `synchronous=NORMAL`: with WAL, a commit survives a process crash
    /// but the last commits (and the replies that followed them) may be
    /// lost on power loss. Replies are not held.
    Normal,
}

impl Synchronous {
    /// The pragma of object connections: batched commits are synced by
    /// the flusher, not by SQLite.
    pub(crate) fn pragma(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal | Synchronous::Batched => "NORMAL",
        }
    }
}

/// Idle objects are evicted after this long by default.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// The most executor threads a host may start.
pub const MAX_THREADS: usize = 1024;
/// Shutdown waits this long for in-flight work by default.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// What every executor of a host shares. Only `Send + Sync` parts.
pub(crate) struct HostCore {
    pub(crate) data_dir: PathBuf,
    pub(crate) synchronous: Synchronous,
    /// What one statement of an object may carry.
    pub(crate) storage_limits: StorageLimits,
    pub(crate) idle_timeout: Duration,
    pub(crate) clock: Clock,
    pub(crate) index: Arc<AlarmIndex>,
    pub(crate) work: Arc<WorkTracker>,
    /// The live-object cap and the host-wide LRU of idle objects.
    pub(crate) residency: Arc<Residency>,
    pub(crate) shutting_down: AtomicBool,
    /// Group commit and the output gates (`Synchronous::Batched` only).
    pub(crate) group: Option<Arc<GroupCommit>>,
    /// Runs the group commit's passes; stops them when the core drops.
    _flusher: Option<Flusher>,
    /// Ships the journal's passes to the archive, if one is set.
    archiver: Option<Archiver>,
    namespaces: RwLock<HashMap<String, Constructor>>,
    /// The exclusive lock on [`DATA_DIR_LOCK_FILE`], held from build until
    /// shutdown ends (or the process dies: the OS releases it then).
    lock: Mutex<Option<File>>,
}

impl HostCore {
    pub(crate) fn constructor(&self, namespace: &str) -> Option<Constructor> {
        self.namespaces.read().ok()?.get(namespace).cloned()
    }
}

struct HostShared {
    core: Arc<HostCore>,
    executors: Vec<mpsc::UnboundedSender<Job>>,
    shutdown_grace: Duration,
    rebuild: Option<IndexRebuild>,
    /// The settings this host was built with, for [`Host::restart`].
    #[cfg(feature = "testing")]
    builder: HostBuilder,
}

/// The embedded object host: namespaces of objects, one SQLite file and one
/// persistent alarm per object, executor threads, idle eviction.
///
/// Cloning is one reference-count increment. Dropping the last clone stops
/// the executors; [`Host::shutdown`] does it gracefully.
///
/// ```
/// use std::rc::Rc;
/// use durability_host::{DurableObject, Host};
/// use durability_platform::{Context, StorageExt, params};
///
/// struct Counter(durability_host::ObjectContext);
/// impl DurableObject for Counter {}
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dir = tempfile::tempdir()?;
/// let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
/// let local = tokio::task::LocalSet::new();
/// local.block_on(&rt, async {
///     let host = Host::builder(dir.path()).threads(0).build()?;
///     let counters = host.namespace("counters", |ctx| {
///         ctx.storage().execute_script("CREATE TABLE IF NOT EXISTS n (v INTEGER)")?;
///         Ok(Counter(ctx))
///     })?;
///     let stub = counters.stub("visits")?;
///     let count = stub
///         .call(|counter: Rc<Counter>| async move {
///             let sql = counter.0.storage();
///             sql.execute("INSERT INTO n (v) VALUES (?1)", &params![1])?;
///             sql.query_row("SELECT count(*) FROM n", &[])?
///                 .map_or(Ok(0), |row| row.get::<i64>(0))
///         })
///         .await??;
///     assert_eq!(count, 1);
///     host.shutdown().await;
///     Ok::<_, Box<dyn std::error::Error>>(())
/// })?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Host {
    shared: Arc<HostShared>,
}

/// Configures a [`Host`]; see each setting for its default.
#[derive(Debug, Clone)]
pub struct HostBuilder {
    data_dir: PathBuf,
    threads: Option<usize>,
    idle_timeout: Duration,
    synchronous: Synchronous,
    shutdown_grace: Duration,
    clock_start_ms: Option<EpochMs>,
    max_live_objects: Option<usize>,
    flush_method: FlushMethod,
    open_retry_window: Duration,
    sync_images: Option<PathBuf>,
    boot_id_file: PathBuf,
    storage_limits: StorageLimits,
    archive: Option<ArchiveConfig>,
}

impl Host {
    /// Starts configuring a host whose objects live under `data_dir`.
    pub fn builder(data_dir: impl Into<PathBuf>) -> HostBuilder {
        HostBuilder {
            data_dir: data_dir.into(),
            threads: None,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            synchronous: Synchronous::Batched,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            clock_start_ms: None,
            max_live_objects: None,
            flush_method: FlushMethod::default(),
            open_retry_window: flush::OPEN_RETRY_WINDOW,
            sync_images: None,
            boot_id_file: PathBuf::from(crate::index::BOOT_ID_FILE),
            storage_limits: StorageLimits::SQLITE,
            archive: None,
        }
    }
}

impl HostBuilder {
    /// Executor threads, at most [`MAX_THREADS`]. `0` is inline mode:
    /// objects run as local tasks on the caller's `tokio::task::LocalSet`,
    /// so tests on paused tokio time are deterministic. Default: the
    /// machine's available parallelism.
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = Some(n);
        self
    }

    /// How long an object stays in memory with no call in flight and no
    /// `wait_until` work pending. Default: 60 s.
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// How commits are made durable; see [`Synchronous`] for what each
    /// mode promises. Default: `Batched`.
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How the flusher of `Synchronous::Batched` syncs a batch of commits.
    /// Ignored in the other modes. Default: [`FlushMethod::WalFiles`];
    /// `Syncfs` is refused outside Linux.
    pub fn flush_method(mut self, method: FlushMethod) -> Self {
        self.flush_method = method;
        self
    }

    /// How long group commit keeps retrying a file it cannot open for its
    /// sync (the process out of descriptors, the directory moved away)
    /// before it shuts the gates: until then the replies that wait for the
    /// file wait, and every other object's replies go on. A failure of the
    /// sync itself is never retried (see [`CallError::NotDurable`]).
    /// Ignored in the other modes and in inline mode (`threads(0)`), where
    /// the first failure shuts the gates. Default: 30 s.
    pub fn open_retry_window(mut self, window: Duration) -> Self {
        self.open_retry_window = window;
        self
    }

    /// Where the host reads the machine's boot id, which tells it whether
    /// the machine rebooted since a host stopped without a clean shutdown
    /// (then a power loss may have kept an object's commit but not the
    /// alarm index's entry for it, and the index is rebuilt). Default:
    /// Linux's `/proc/sys/kernel/random/boot_id`; an unreadable file counts
    /// as a reboot after every unclean stop. For power-cut tests that cut
    /// a filesystem without rebooting: name a file the test rewrites at
    /// every cut.
    pub fn boot_id_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.boot_id_file = path.into();
        self
    }

    /// For power-cut tests of `Synchronous::Batched`: after each flush, a
    /// copy of the data directory's database and WAL files as that flush
    /// made them durable goes to `<dir>/<n>/`, and `<dir>/latest` names the
    /// newest complete copy, written before any reply the flush covers is
    /// released. Restoring the latest copy is a power cut that drops every
    /// write not yet synced. Writes wait while a copy is taken: for tests
    /// with small data only. `dir` must be outside the data directory.
    pub fn sync_images(mut self, dir: impl Into<PathBuf>) -> Self {
        self.sync_images = Some(dir.into());
        self
    }

    /// What one SQL statement of an object may carry: its bound
    /// parameters, the bytes of its text and of each string or blob. A
    /// statement beyond them fails with
    /// [`StorageError::LimitExceeded`](durability_platform::StorageError::LimitExceeded)
    /// before it runs, and the capabilities' builders refuse settings they
    /// rule out. [`StorageLimits::CLOUDFLARE`] makes the host hold an
    /// object to what a Durable Object can store, so code that passes its
    /// tests here fits Cloudflare. Default: [`StorageLimits::SQLITE`].
    pub fn storage_limits(mut self, limits: StorageLimits) -> Self {
        self.storage_limits = limits;
        self
    }

    /// Ships every durable change to a continuous archive (a base, then
    /// every synced pass of the host journal; see [`crate::archive`]), so
    /// that [`crate::archive::restore_at`] can rebuild any moment within
    /// its retention. Needs the journal: `Synchronous::Batched` with
    /// `FlushMethod::Journal` (the defaults); any other mode is refused at
    /// build with [`HostError::ArchiveNeedsJournal`], since it keeps no
    /// record of changes to ship. Default: no archive.
    pub fn archive(mut self, config: ArchiveConfig) -> Self {
        self.archive = Some(config);
        self
    }

    /// How long [`Host::shutdown`] waits for in-flight calls, alarm runs and
    /// `wait_until` work. Default: 30 s.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// The most objects in memory at once, host-wide. Each live object
    /// holds three file descriptors (database, WAL, shared-memory index),
    /// so without a cap the descriptor limit decides, and opening one more
    /// object fails.
    ///
    /// When constructing an object would exceed the cap, the least recently
    /// used *idle* objects (no call or alarm run in flight, no `wait_until`
    /// pending) are evicted first, exactly as idle eviction would; their
    /// rows and alarms stay. If no object is idle, the call (or alarm run)
    /// waits until one is; busy objects are never evicted. If every live
    /// object is itself waiting on a call to an object that is not live,
    /// waiting would deadlock: one such call is admitted over the cap (a
    /// `tracing` warning says so) and the excess is evicted as soon as
    /// objects turn idle.
    ///
    /// Must be at least 1. Default: the process's soft `RLIMIT_NOFILE`
    /// minus [`RESERVED_FDS`](crate::RESERVED_FDS), divided by
    /// [`FDS_PER_LIVE_OBJECT`](crate::FDS_PER_LIVE_OBJECT), at most
    /// [`DEFAULT_MAX_LIVE_OBJECTS_CEILING`](crate::DEFAULT_MAX_LIVE_OBJECTS_CEILING)
    /// (about 6,600 at a limit of 20,000 descriptors).
    pub fn max_live_objects(mut self, n: usize) -> Self {
        self.max_live_objects = Some(n);
        self
    }

    /// Starts the host clock at `epoch_ms` instead of the system time.
    /// Tests and simulations use it to start a host "later" than a previous
    /// one stopped, on paused tokio time. Must be a non-negative safe integer.
    pub fn clock_start_ms(mut self, epoch_ms: EpochMs) -> Self {
        self.clock_start_ms = Some(epoch_ms);
        self
    }

    /// Builds the host: opens the alarm index (rebuilding it from the object
    /// files first when it is missing, corrupt or incomplete: see
    /// [`Host::index_rebuild`]) and starts the executors, which wake every
    /// object whose indexed alarm is due. A data directory too long for
    /// SQLite is refused here ([`HostError::PathTooLong`]).
    ///
    /// With `threads(0)`, call inside a `tokio::task::LocalSet` of a tokio
    /// runtime (outside one, tokio's refusal is reported through the panic
    /// hook and returned as [`HostError::NoRuntime`]). With threads, the
    /// host starts its own runtimes; [`Host::shutdown`] needs a tokio
    /// runtime with time enabled.
    pub fn build(self) -> Result<Host, HostError> {
        #[cfg(feature = "testing")]
        let builder = self.clone();
        let threads = self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        });
        if threads > MAX_THREADS {
            return Err(HostError::InvalidSetting {
                setting: "threads",
                rule: "must be at most 1024",
            });
        }
        if threads == 0 && tokio::runtime::Handle::try_current().is_err() {
            return Err(HostError::NoRuntime {
                required: "inside a tokio runtime and LocalSet when threads is 0",
            });
        }
        if self.idle_timeout.is_zero() {
            return Err(HostError::InvalidSetting {
                setting: "idle_timeout",
                rule: "must be greater than zero",
            });
        }
        if self.max_live_objects == Some(0) {
            return Err(HostError::InvalidSetting {
                setting: "max_live_objects",
                rule: "must be at least 1",
            });
        }
        let max_live_objects = self
            .max_live_objects
            .unwrap_or_else(default_max_live_objects);
        if self
            .clock_start_ms
            .is_some_and(|ms| !(0..=MAX_SAFE_INTEGER).contains(&ms))
        {
            return Err(HostError::InvalidSetting {
                setting: "clock_start_ms",
                rule: "must be a non-negative safe integer of milliseconds",
            });
        }
        crate::directory::create_durably(&self.data_dir).map_err(|e| HostError::Io {
            path: self.data_dir.clone(),
            message: e.to_string(),
        })?;
        if !flush::supported(self.flush_method) {
            return Err(HostError::InvalidSetting {
                setting: "flush_method",
                rule: "Syncfs is available on Linux only, Journal on Unix only",
            });
        }
        let images = match &self.sync_images {
            Some(_) if self.synchronous != Synchronous::Batched => {
                return Err(HostError::InvalidSetting {
                    setting: "sync_images",
                    rule: "needs Synchronous::Batched",
                });
            }
            Some(dir) => {
                std::fs::create_dir_all(dir).map_err(|e| HostError::Io {
                    path: dir.clone(),
                    message: e.to_string(),
                })?;
                Some((dir.clone(), Arc::new(RwLock::new(()))))
            }
            None => None,
        };
        if let Some(config) = &self.archive {
            let mode = match (self.synchronous, self.flush_method) {
                (Synchronous::Batched, FlushMethod::Journal) => None,
                (Synchronous::Batched, FlushMethod::WalFiles) => Some("FlushMethod::WalFiles"),
                (Synchronous::Batched, FlushMethod::Syncfs) => Some("FlushMethod::Syncfs"),
                (Synchronous::Full, _) => Some("Synchronous::Full"),
                (Synchronous::Normal, _) => Some("Synchronous::Normal"),
            };
            if let Some(mode) = mode {
                return Err(HostError::ArchiveNeedsJournal { mode });
            }
            if let Some((setting, rule)) = config.invalid() {
                return Err(HostError::InvalidSetting { setting, rule });
            }
        }
        check_path_length(&self.data_dir)?;
        let lock = lock_data_dir(&self.data_dir)?;
        // Before anything reads an object file (the index rebuild does):
        // what a journal of an earlier process holds goes back into the
        // WAL files, whatever this host's own mode.
        journal::recover(&self.data_dir).map_err(|e| journal_error(&self.data_dir, &e))?;
        let flush = (self.synchronous == Synchronous::Batched)
            .then(|| Flush::open(self.flush_method, &self.data_dir))
            .transpose()
            .map_err(|e| journal_error(&self.data_dir, &e))?;
        // Before any object is opened: the archive sees every pass.
        let archiver = match (&self.archive, &flush) {
            (Some(config), Some(Flush::Journal(journal))) => {
                let archiver =
                    Archiver::start(config.clone(), &self.data_dir).map_err(|e| HostError::Io {
                        path: PathBuf::from(config.url()),
                        message: format!("cannot start the archive: {e}"),
                    })?;
                journal.ship_to(archiver.shipping());
                Some(archiver)
            }
            _ => None,
        };
        let (index, rebuild) = AlarmIndex::open(
            &self.data_dir,
            &self.boot_id_file,
            self.synchronous,
            images.as_ref().map(|(_, lock)| Arc::clone(lock)),
        )?;
        let index = Arc::new(index);
        let alarms = index.all().map_err(|source| HostError::Index {
            path: self.data_dir.join(crate::index::INDEX_FILE),
            source,
        })?;
        let group = flush.map(|method| {
            GroupCommit::new(
                &self.data_dir,
                method,
                Arc::clone(&index),
                threads == 0,
                images,
                flush::UNAWAITED_SYNC_DELAY,
                self.open_retry_window,
            )
        });
        let flusher = group
            .as_ref()
            .map(|group| Flusher::start(group, &self.data_dir))
            .transpose()?;
        let core = Arc::new(HostCore {
            data_dir: self.data_dir.clone(),
            synchronous: self.synchronous,
            storage_limits: self.storage_limits,
            idle_timeout: self.idle_timeout,
            clock: Clock::start(self.clock_start_ms),
            index,
            work: Arc::new(WorkTracker::default()),
            residency: Arc::new(Residency::new(max_live_objects)),
            shutting_down: AtomicBool::new(false),
            group,
            _flusher: flusher,
            archiver,
            namespaces: RwLock::new(HashMap::new()),
            lock: Mutex::new(Some(lock)),
        });
        let executors = if threads == 0 {
            vec![start_inline(&core)?]
        } else {
            (0..threads)
                .map(|n| start_thread(&core, n))
                .collect::<Result<Vec<_>, _>>()?
        };
        core.residency.connect(
            executors
                .iter()
                .map(mpsc::UnboundedSender::downgrade)
                .collect(),
        );
        let host = Host {
            shared: Arc::new(HostShared {
                core,
                executors,
                shutdown_grace: self.shutdown_grace,
                rebuild,
                #[cfg(feature = "testing")]
                builder,
            }),
        };
        host.load_alarms(alarms);
        Ok(host)
    }
}

/// The longest path SQLite's unix VFS opens (its `mxPathname`), in bytes.
pub const SQLITE_MAX_PATH_BYTES: usize = 512;

/// What an object file's path adds to the data directory, plus the 8 bytes
/// SQLite reserves after a database path for its `-journal` name (it
/// refuses a database whose path + 8 exceeds its limit):
/// `/objects/xx/<64 hex digits>.sqlite-journal`.
const OBJECT_PATH_SUFFIX_BYTES: usize = "/objects/xx/".len() + 64 + ".sqlite-journal".len();

/// Refuses, once and before anything is opened, a data directory whose
/// object files SQLite could not open: otherwise every object would fail
/// on its own with a bare "unable to open database file".
fn check_path_length(data_dir: &Path) -> Result<(), HostError> {
    // SQLite makes every path absolute and resolves symbolic links first.
    let full = std::fs::canonicalize(data_dir).map_err(|e| HostError::Io {
        path: data_dir.to_path_buf(),
        message: e.to_string(),
    })?;
    let object_path_bytes = full.as_os_str().len() + OBJECT_PATH_SUFFIX_BYTES;
    if object_path_bytes > SQLITE_MAX_PATH_BYTES {
        return Err(HostError::PathTooLong {
            path: full,
            object_path_bytes,
            limit_bytes: SQLITE_MAX_PATH_BYTES,
        });
    }
    Ok(())
}

/// The file in a data directory that the serving host holds an exclusive
/// lock on.
pub const DATA_DIR_LOCK_FILE: &str = "host.lock";

/// Whether `dir` holds anything a host leaves in a data directory (its
/// objects, its journal, its alarm index or its lock file): what the
/// commands that take a data directory check before they act on one.
pub fn is_data_dir(dir: &Path) -> bool {
    [
        crate::id::objects_dir(dir),
        dir.join(journal::JOURNAL_DIR),
        dir.join(crate::index::INDEX_FILE),
        dir.join(DATA_DIR_LOCK_FILE),
    ]
    .iter()
    .any(|path| path.exists())
}

/// Takes the data directory's exclusive lock and writes this process's id
/// into the lock file, or says who holds it (the id its holder wrote).
///
/// The lock is `flock`'s (std's `File::try_lock`): the kernel releases it
/// when its holder dies, so a pid left in the file by a dead host names no
/// one and is overwritten by the next host. The attempt never blocks: a
/// second host on a busy directory is refused at once.
fn lock_data_dir(data_dir: &Path) -> Result<File, HostError> {
    let path = data_dir.join(DATA_DIR_LOCK_FILE);
    let io_error = |e: std::io::Error| HostError::Io {
        path: path.clone(),
        message: e.to_string(),
    };
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_error)?;
    match file.try_lock() {
        Ok(()) => {
            record_holder(&file, &path);
            Ok(file)
        }
        Err(TryLockError::WouldBlock) => Err(HostError::DataDirInUse {
            path: data_dir.to_path_buf(),
            lock: path.clone(),
            holder_pid: read_holder(&path),
        }),
        Err(TryLockError::Error(e)) => Err(io_error(e)),
    }
}

/// Writes this process's id into the lock file just taken. Best effort: the
/// lock is what keeps a second host out, the pid only tells its user who
/// holds it, so a failure to write it is logged and the host starts.
fn record_holder(file: &File, path: &Path) {
    use std::io::{Seek as _, Write as _};
    let mut file = file;
    let written = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{}", std::process::id()));
    if let Err(error) = written {
        tracing::warn!(
            lock = %path.display(),
            %error,
            "cannot write this process's id into the data directory's lock file"
        );
    }
}

/// The pid a lock file's holder wrote, if it wrote one.
fn read_holder(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn start_inline(core: &Arc<HostCore>) -> Result<mpsc::UnboundedSender<Job>, HostError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let run = executor::run(Arc::clone(core), 0, rx);
    // tokio offers no way to ask whether a LocalSet is current other than
    // trying; its refusal is turned into a typed error here.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tokio::task::spawn_local(run);
    }))
    .map_err(|_| HostError::NoRuntime {
        required: "inside a tokio::task::LocalSet when threads is 0",
    })?;
    Ok(tx)
}

fn start_thread(core: &Arc<HostCore>, n: usize) -> Result<mpsc::UnboundedSender<Job>, HostError> {
    let io_error = |e: std::io::Error| HostError::Io {
        path: core.data_dir.clone(),
        message: format!("cannot start executor thread {n}: {e}"),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(io_error)?;
    let (tx, rx) = mpsc::unbounded_channel();
    let core = Arc::clone(core);
    std::thread::Builder::new()
        .name(format!("durability-host-{n}"))
        .spawn(move || {
            let local = tokio::task::LocalSet::new();
            local.block_on(&runtime, executor::run(core, n, rx));
        })
        .map_err(io_error)?;
    Ok(tx)
}

impl Host {
    /// Registers the object type of namespace `name`. `factory` builds an
    /// object from its context on its first call or alarm (run migrations
    /// there); it runs on the object's executor thread.
    pub fn namespace<T: DurableObject>(
        &self,
        name: &str,
        factory: impl Fn(ObjectContext) -> Result<T, BoxError> + Send + Sync + 'static,
    ) -> Result<Namespace<T>, HostError> {
        validate_name("namespace name", name)?;
        let constructor: Constructor =
            Arc::new(move |ctx| factory(ctx).map(|object| Rc::new(object) as Rc<dyn ErasedObject>));
        let registered = self.register(name, constructor)?;
        Ok(Namespace {
            host: self.clone(),
            name: registered,
            _object: PhantomData,
        })
    }

    /// Adds namespace `name` and tells every executor, which wakes the
    /// alarms that waited for it.
    fn register(&self, name: &str, constructor: Constructor) -> Result<Arc<str>, HostError> {
        let core = &self.shared.core;
        {
            let mut namespaces = core.namespaces.write().map_err(|_| HostError::ShutDown)?;
            if namespaces.contains_key(name) {
                return Err(HostError::NamespaceExists {
                    name: name.to_owned(),
                });
            }
            namespaces.insert(name.to_owned(), constructor);
        }
        let registered: Arc<str> = Arc::from(name);
        for executor in &self.shared.executors {
            let registered = Arc::clone(&registered);
            let _ = executor.send(Box::new(move |e: &Rc<executor::Executor>| {
                e.namespace_registered(&registered);
            }));
        }
        Ok(registered)
    }

    /// Evicts object `id` now if it is live: drops it, aborts its
    /// background tasks and in-flight calls, closes its file. Storage and
    /// alarm stay. Meant for tests.
    pub async fn evict(&self, id: &ObjectId) -> Result<(), HostError> {
        let (tx, rx) = oneshot::channel();
        let target = id.clone();
        self.send(
            id,
            Box::new(move |e| {
                e.evict(&target);
                let _ = tx.send(());
            }),
        )?;
        rx.await.map_err(|_| HostError::ShutDown)
    }

    /// Refuses new calls, waits up to the shutdown grace for in-flight
    /// calls, alarm runs and `wait_until` work, then evicts every object
    /// and closes its database.
    pub async fn shutdown(&self) {
        let shared = &self.shared;
        shared.core.shutting_down.store(true, Ordering::SeqCst);
        if tokio::time::timeout(shared.shutdown_grace, shared.core.work.idle())
            .await
            .is_err()
        {
            tracing::warn!(
                grace_ms = shared.shutdown_grace.as_millis(),
                "shutdown grace elapsed with work still in flight; it is dropped"
            );
        }
        self.close_executors().await;
        // After the last flush: what is synced goes to the archive before
        // the journal lets its segments go.
        // It blocks this thread for one ship cycle at most (no object runs
        // any more), or the grace if the store hangs.
        if let Some(archiver) = &shared.core.archiver {
            archiver.finish(shared.shutdown_grace);
        }
        // Every executor closed its objects: another host may take over.
        if let Ok(mut lock) = shared.core.lock.lock() {
            lock.take();
        }
    }

    /// Evicts every object of every executor and stops their alarm loops.
    async fn close_executors(&self) {
        let shared = &self.shared;
        let mut acks = Vec::new();
        for executor in &shared.executors {
            let (tx, rx) = oneshot::channel();
            let sent = executor.send(Box::new(move |e: &Rc<executor::Executor>| {
                e.close();
                let _ = tx.send(());
            }));
            if sent.is_ok() {
                acks.push(rx);
            }
        }
        for ack in acks {
            let _ = ack.await;
        }
        // Closing checkpointed and synced every file; this releases the
        // replies still waiting at their gates.
        let flushed = match &shared.core.group {
            Some(group) => group.flush().await.map_err(|error| {
                tracing::warn!(%error, "last flush at shutdown failed");
            }),
            None => Ok(()),
        };
        // Only a stop that left every commit durable is clean: the next
        // start then trusts the index even after a reboot.
        if flushed.is_ok()
            && let Err(error) = shared.core.index.mark_clean_stop()
        {
            tracing::warn!(%error, "could not record the clean stop in the alarm index");
        }
    }

    /// How far the archive is behind ([`HostBuilder::archive`]): how long
    /// the oldest synced journal pass not yet shipped has waited, zero
    /// when it is caught up; `None` without an archive. Also the gauge
    /// [`crate::telemetry::ARCHIVE_LAG`].
    pub fn archive_lag(&self) -> Option<Duration> {
        self.shared.core.archiver.as_ref().map(Archiver::lag)
    }

    /// The host clock: milliseconds since the Unix epoch, moving with
    /// tokio's clock.
    pub fn now_ms(&self) -> EpochMs {
        self.shared.core.clock.now_ms()
    }

    /// How many objects are in memory now, counting constructions under
    /// way (for tests and memory benchmarks). At most
    /// [`HostBuilder::max_live_objects`], except while a deadlock is broken.
    pub fn live_objects(&self) -> usize {
        self.shared.core.residency.live()
    }

    /// What the rebuild of the alarm index found, if this host rebuilt it
    /// when it started (the index was missing, corrupt or incomplete; the
    /// object files are the truth). `None` when the index was sound.
    pub fn index_rebuild(&self) -> Option<&IndexRebuild> {
        self.shared.rebuild.as_ref()
    }

    /// The data directory.
    pub fn data_dir(&self) -> &Path {
        &self.shared.core.data_dir
    }

    /// The database file of object `id`: derived from the id only.
    pub fn object_file(&self, id: &ObjectId) -> PathBuf {
        object_path(&self.shared.core.data_dir, id)
    }

    fn send(&self, id: &ObjectId, job: Job) -> Result<(), HostError> {
        let executors = &self.shared.executors;
        let executor = executors
            .get(executor_of(id, executors.len()))
            .ok_or(HostError::ShutDown)?;
        executor.send(job).map_err(|_| HostError::ShutDown)
    }

    fn load_alarms(&self, alarms: Vec<IndexedAlarm>) {
        let executors = &self.shared.executors;
        let mut per_executor: Vec<Vec<IndexedAlarm>> =
            executors.iter().map(|_| Vec::new()).collect();
        for alarm in alarms {
            if let Some(batch) = per_executor.get_mut(executor_of(&alarm.id, executors.len())) {
                batch.push(alarm);
            }
        }
        for (executor, batch) in executors.iter().zip(per_executor) {
            if !batch.is_empty() {
                let _ = executor.send(Box::new(move |e: &Rc<executor::Executor>| {
                    e.load_alarms(batch)
                }));
            }
        }
    }
}

/// The objects of one type: a registered namespace. Cloning is one
/// reference-count increment; it is `Send + Sync`.
pub struct Namespace<T> {
    host: Host,
    name: Arc<str>,
    _object: PhantomData<fn() -> T>,
}

impl<T> Clone for Namespace<T> {
    fn clone(&self) -> Self {
        Namespace {
            host: self.host.clone(),
            name: Arc::clone(&self.name),
            _object: PhantomData,
        }
    }
}

impl<T: DurableObject> Namespace<T> {
    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The id of object `name`, without touching it.
    pub fn id_of(&self, name: &str) -> Result<ObjectId, HostError> {
        validate_name("object name", name)?;
        Ok(object_id(&self.name, name))
    }

    /// A handle to object `name`. Nothing is opened until the first call.
    pub fn stub(&self, name: &str) -> Result<Stub<T>, HostError> {
        let id = self.id_of(name)?;
        Ok(Stub {
            host: self.host.clone(),
            namespace: Arc::clone(&self.name),
            name: Arc::from(name),
            id,
            _object: PhantomData,
        })
    }
}

/// A handle to one object: sends calls to the object's executor. Cloning
/// costs three reference-count increments and a 64-byte id copy; it is
/// `Send + Sync`.
pub struct Stub<T> {
    host: Host,
    namespace: Arc<str>,
    name: Arc<str>,
    id: ObjectId,
    _object: PhantomData<fn() -> T>,
}

impl<T> Clone for Stub<T> {
    fn clone(&self) -> Self {
        Stub {
            host: self.host.clone(),
            namespace: Arc::clone(&self.namespace),
            name: Arc::clone(&self.name),
            id: self.id.clone(),
            _object: PhantomData,
        }
    }
}

impl<T: DurableObject> Stub<T> {
    /// The object's id.
    pub fn id(&self) -> &ObjectId {
        &self.id
    }

    /// The object's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `f` on the object's executor, constructing the object first if
    /// it is not in memory. Many calls may be in flight on one object; they
    /// interleave only at awaits.
    pub async fn call<F, Fut, R>(&self, f: F) -> Result<R, CallError>
    where
        F: FnOnce(Rc<T>) -> Fut + Send + 'static,
        Fut: Future<Output = R> + 'static,
        R: Send + 'static,
    {
        let core = &self.host.shared.core;
        if core.shutting_down.load(Ordering::SeqCst) {
            return Err(CallError::ShuttingDown);
        }
        // Counted before it is sent, so shutdown cannot miss a call that
        // is on its way to the executor.
        let guard = core.work.begin();
        let (tx, rx) = oneshot::channel();
        let id = self.id.clone();
        let namespace = Arc::clone(&self.namespace);
        let name = Arc::clone(&self.name);
        // A call from an object's own code: if it must wait for room, the
        // caller stays busy meanwhile, which the live-object cap must know.
        let caller = executor::current_object();
        // The call's span on the object's thread is a child of the caller's
        // span, so a trace follows a request into the object.
        let span = tracing::info_span!(
            parent: tracing::Span::current(),
            "call",
            object = %self.id,
            namespace = %self.namespace,
            name = %self.name,
        );
        let started = std::time::Instant::now();
        // The reply waits at the output gate on the object's side, and
        // goes to this caller once the commits before it are durable.
        let group = core.group.clone();
        let deliver = move |reply: Reply<R>| match group {
            Some(group) => {
                let after = reply.after.clone();
                group.release_when_durable(
                    after,
                    Box::new(move || {
                        let _ = tx.send(reply);
                    }),
                );
            }
            None => {
                let _ = tx.send(reply);
            }
        };
        let job: Job = Box::new(move |e| {
            e.call::<T, F, Fut, R, _>(id, namespace, name, caller, f, deliver, guard, span)
        });
        let core = Arc::clone(core);
        self.host
            .send(&self.id, job)
            .map_err(|_| CallError::ShuttingDown)?;
        let Ok(Reply { result, after }) = rx.await else {
            return Err(CallError::Aborted {
                id: self.id.to_string(),
            });
        };
        // The output gate: nothing the object said leaves before the
        // commits it made until then are durable.
        if let Some(group) = &core.group
            && let Err(reason) = group.gate(&after).await
        {
            return Err(CallError::NotDurable {
                id: self.id.to_string(),
                message: reason.to_string(),
            });
        }
        crate::telemetry::call_finished(&self.namespace, started.elapsed());
        result
    }
}

/// Replays the host journal left in `data_dir` into its object files,
/// as a host's start does first (see [`FlushMethod::Journal`]): for tools
/// that read the files of a host that stopped without a clean shutdown,
/// and for power-cut tests. Takes the data directory's lock, so it fails
/// with [`HostError::DataDirInUse`] while a host serves the directory. A
/// directory without a journal is left as it is. A journal that lost
/// records a sync had made durable fails with [`HostError::JournalLost`]
/// and leaves every file as it was.
pub fn replay_journal(data_dir: &Path) -> Result<(), HostError> {
    let _lock = lock_data_dir(data_dir)?;
    journal::recover(data_dir).map_err(|e| journal_error(data_dir, &e))
}

/// The way out when a start refuses the journal with
/// [`HostError::JournalLost`]: applies every record of the journal left in
/// `data_dir` that can be proven whole, moves each damaged segment aside
/// (under `journal/damaged/`, never deleted) with the alarm index (rebuilt
/// at the next start), and reports per object what it could not apply.
/// On a journal that is whole it replays as a start would. Safe to run
/// again after a crash in the middle: a start refuses the directory until
/// a recovery has finished ([`HostError::JournalRecoveryInterrupted`]).
/// Takes the data directory's lock ([`HostError::DataDirInUse`] while a
/// host serves it). `durability recover DATA_DIR` runs it; see
/// docs/operating.md for what is lost.
pub fn recover_journal(data_dir: &Path) -> Result<journal::RecoveryReport, HostError> {
    let _lock = lock_data_dir(data_dir)?;
    journal::recover_damaged(data_dir).map_err(|e| journal_error(data_dir, &e))
}

fn journal_error(data_dir: &Path, error: &JournalError) -> HostError {
    if let JournalError::Lost { path, at, found } = error {
        return HostError::JournalLost {
            segment: path.clone(),
            at: *at as u64,
            found: *found as u64,
        };
    }
    if let JournalError::RecoveryInterrupted { path } = error {
        return HostError::JournalRecoveryInterrupted { dir: path.clone() };
    }
    HostError::Io {
        path: data_dir.join(journal::JOURNAL_DIR),
        message: format!("the host journal: {error}"),
    }
}
