//! Group commit: the host-wide flusher and the output gates of
//! [`Synchronous::Batched`](crate::Synchronous::Batched).
//!
//! In that mode an object's commit does not wait for a sync of its own.
//! Its connection runs with `synchronous=NORMAL` (SQLite writes the WAL
//! frames and returns; checkpoints still sync the WAL before copying it and
//! the database after), and every commit takes the next number of one
//! host-wide sequence and names its WAL file as dirty. The flusher takes
//! every dirty file that is due at once, makes them durable together, and
//! then marks each file synced through its last commit taken. Many commits
//! of many objects thus share one round of syncs: the disk's sync rate no
//! longer caps the commit rate.
//!
//! The *output gate*: a reply of `Stub::call` carries its object's last
//! commit when the reply was made (a [`CommitMark`]: the WAL and the
//! number), and it reaches the caller only once that WAL is synced
//! through that number: the object's thread hands the reply to the group
//! commit, and the pass that makes the mark durable sends it
//! ([`GroupCommit::release_when_durable`]), so a caller is woken once.
//! Whoever saw
//! a reply can therefore rely on every write the object made before it, as
//! with `synchronous=FULL`, also after a power loss. Work inside the host
//! (alarms, timers, in-process consumers) is not held; what could mark
//! such work done outside the object's own WAL, the host's alarm index, is
//! only raised or cleared once the object's commit is durable (see
//! [`crate::index`]).
//!
//! *Awaited and unawaited commits*: the gates are per object. A reply
//! waits only for its own object's WAL, and only a WAL that something
//! waits on is synced at once: a reply's gate, a deferred index update, a
//! shutdown. A commit nothing waits on yet (an operation's completion, an
//! alarm run) stays in the page cache for up to [`UNAWAITED_SYNC_DELAY`],
//! so that the object's next awaited commit, usually well within that,
//! makes both durable with one sync. With many objects each commit lands
//! in a different pass anyway, so this, not the batching across objects,
//! halves the syncs of an operation (register, then complete).
//!
//! Why syncing the dirty WAL files is enough:
//! - SQLite checksums WAL frames in a chain, so recovery keeps a prefix of
//!   commits: a synced WAL keeps every commit before the sync, whatever
//!   the kernel wrote back on its own in between.
//! - A file closed since its commit (eviction, shutdown) was checkpointed
//!   on close, and checkpoints sync; a missing WAL is therefore durable,
//!   unless its directory is missing too (the data directory was moved
//!   under the open files): that one is retried like a file that cannot
//!   be opened.
//! - A WAL created since the object was opened is a new directory entry:
//!   its directory is synced too, once per pass.
//! - [`FlushMethod::Syncfs`] replaces the whole pass with one `syncfs` of
//!   the data directory's filesystem, which covers all of the above.
//! - [`FlushMethod::Journal`] (the default) replaces the WAL syncs with one
//!   `fdatasync` of the host journal, which holds a copy of every WAL
//!   write and is replayed into the WAL files at the next start (see
//!   [`crate::journal`]). Since one sync covers every object, a journal
//!   pass takes every dirty file, and first waits a little while commits
//!   keep coming ([`GroupCommit::gather`]).
//!
//! A failed sync cannot be retried safely (the kernel may already have
//! dropped the pages it could not write), so after one the gates stay
//! shut: every later reply fails with `CallError::NotDurable`, and the host
//! should be restarted, which recovers what the disk holds. A file that
//! could not even be *opened* for its sync (say, the process ran out of
//! descriptors) lost nothing: its pass is tried again every
//! [`OPEN_RETRY_INTERVAL`], its replies wait, and only after
//! [`OPEN_RETRY_WINDOW`] of failures do the gates shut. Inline, where no
//! thread could retry, the first failure shuts them.
//!
//! Drivers: with executor threads, the flusher is a thread of its own that
//! sleeps on a condition variable until a commit names a file. In inline
//! mode (`threads(0)`, paused-time tests) the passes run on the caller's
//! `LocalSet`: a local task runs one after commits, and a reply that finds
//! its commit not yet durable runs the pass itself, so tests never wait on
//! another thread and paused time stays deterministic.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, mpsc};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, watch};

use crate::HostError;
use crate::index::AlarmIndex;
use crate::journal::{JOURNAL_DIR, Journal, JournalError, SEGMENT_LIMIT};

/// How the flusher makes a batch of commits durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlushMethod {
    /// `fdatasync` of each dirty WAL file that is due (something waits on
    /// it, or it was written 50 ms ago) in one pass,
    /// issued from up to 16 threads at once so the filesystem commits them
    /// together (and of the directory of a WAL created since its object
    /// was opened). Touches only the host's own files.
    WalFiles,
    /// One `syncfs` of the filesystem holding the data directory (Linux
    /// only). Costs one call per pass whatever the number of objects, but
    /// also writes back every other dirty file of that filesystem.
    Syncfs,
    /// One `fdatasync` of the host journal per pass, whatever the number
    /// of objects (Unix only): every write SQLite makes to an object's WAL
    /// is also appended to the journal, and the WAL files are written
    /// back later (at checkpoints and when a journal segment is rotated).
    /// After a power cut the host's next start replays the journal into
    /// the WAL files before it opens any object. Default.
    #[default]
    Journal,
}

/// A [`FlushMethod`] as a running group commit holds it: the journal's
/// method with its open journal.
pub(crate) enum Flush {
    WalFiles,
    Syncfs,
    Journal(Arc<Journal>),
}

impl Flush {
    /// `method` for the host of `data_dir` (opening its journal).
    pub(crate) fn open(method: FlushMethod, data_dir: &Path) -> Result<Flush, JournalError> {
        Ok(match method {
            FlushMethod::WalFiles => Flush::WalFiles,
            FlushMethod::Syncfs => Flush::Syncfs,
            FlushMethod::Journal => Flush::Journal(Journal::open(data_dir, SEGMENT_LIMIT)?),
        })
    }
}

/// How long a commit that nothing waits for may stay unsynced: the
/// object's next awaited commit usually comes sooner and syncs both.
///
/// Measured on `bench operations` (default mode, 100 objects, 64
/// callers): with every dirty WAL synced in the next pass, an operation
/// cost two `fdatasync`s (its registration and its completion landed in
/// different passes: 40,296 for 20,000 operations), and the sync threads
/// took 28% of the process's CPU on a 2-core machine.
pub(crate) const UNAWAITED_SYNC_DELAY: Duration = Duration::from_millis(50);

/// How long a journal pass waits for commits to stop coming before it
/// syncs (see [`GroupCommit::gather`]).
///
/// The cost of a pass (a write and a sync of the journal, the wake-ups of
/// the replies it releases) is nearly the same for one commit as for
/// fifty; on this project's 2-core VM each request to the disk is a VM
/// exit. Measured on `bench operations` (`default-journal`, 100 objects,
/// 64 callers, two interleaved runs each): passes at once 4,584 and 5,039
/// ops/s at 327 µs of CPU per operation (4.2 operations per pass); a fixed
/// 1 ms wait 6,074 / 6,697; a 100 µs quiet gap (at most 4 ms) 8,051 /
/// 9,145 at 169-195 µs, against 7,487 / 8,826 for NORMAL in the same
/// rounds; 200 and 400 µs gaps were no better.
pub(crate) const GATHER_QUIET: Duration = Duration::from_micros(100);

/// The longest a journal pass waits for more commits.
///
/// Under steady load commits never stop coming, so a pass waits this
/// long and a reply waits about this plus the pass: with a fixed number
/// of callers, that caps throughput. Since the journal is written with
/// direct I/O (a pass of 1 MB: about 0.5 ms of writing and 0.2 ms of
/// `fdatasync`), 2 ms shares the pass as well as 4 ms did: on `bench
/// operations` (default, 100 objects, 64 callers; six interleaved runs
/// each) median 12,676 ops/s at registration p50 4.2 ms, against 10,990
/// at 5.4 ms with 4 ms; 1 ms gave 9,648 / 12,438 / 12,235 in three.
pub(crate) const GATHER_MAX: Duration = Duration::from_millis(2);

/// How soon a pass whose files could not be opened is tried again.
pub(crate) const OPEN_RETRY_INTERVAL: Duration = Duration::from_millis(10);

/// How long a file may keep failing to open before the gates shut.
pub(crate) const OPEN_RETRY_WINDOW: Duration = Duration::from_secs(30);

/// Why one file could not be synced.
#[derive(Debug)]
struct SyncError {
    error: std::io::Error,
    /// Only opening the file failed (nothing was written or synced
    /// badly): nothing is lost, and its sync may be tried again.
    retryable: bool,
}

/// The files a pass could not open (see [`SyncError::retryable`]).
#[derive(Debug, Default)]
struct Unopened {
    /// By [`WalFile::key`].
    keys: HashSet<usize>,
    /// Every file of the pass (the directory itself, or a lane, failed).
    all: bool,
    /// The first reason.
    error: Option<String>,
}

impl Unopened {
    fn add(&mut self, key: usize, error: &std::io::Error) {
        self.keys.insert(key);
        self.error.get_or_insert_with(|| error.to_string());
    }

    fn everything(error: &dyn std::fmt::Display) -> Self {
        Unopened {
            all: true,
            error: Some(error.to_string()),
            ..Unopened::default()
        }
    }

    fn merge(&mut self, other: Unopened) {
        self.keys.extend(other.keys);
        self.all |= other.all;
        if self.error.is_none() {
            self.error = other.error;
        }
    }

    fn covers(&self, file: &DirtyFile) -> bool {
        self.all || self.keys.contains(&file.wal.key())
    }
}

/// What is durable so far, as the gates see it.
#[derive(Debug, Clone, Default)]
struct Durable {
    /// Every commit numbered up to this is on disk (of every object).
    seq: u64,
    /// Set by the first failed sync; the gates never open again.
    failed: Option<Arc<str>>,
}

/// One object's write-ahead log as group commit tracks it, shared by the
/// object's storage, the dirty set, and whatever waits on its commits.
pub(crate) struct WalFile {
    path: Arc<Path>,
    /// Every commit of this file numbered up to this is on disk.
    synced: AtomicU64,
}

impl WalFile {
    /// The log at `path` (which need not exist yet).
    pub(crate) fn new(path: &Path) -> Arc<Self> {
        Arc::new(WalFile {
            path: Arc::from(path),
            synced: AtomicU64::new(0),
        })
    }

    /// `fdatasync`s the log. `Ok(false)`: there is none (it was
    /// checkpointed and removed by its close, which synced it). A log
    /// whose directory is gone too was not removed by a close: the data
    /// directory was moved or unmounted under the open files, and the
    /// pass tries it again (retryable) rather than count it synced.
    ///
    /// Opened for each sync rather than kept open: a live object is
    /// budgeted [`FDS_PER_LIVE_OBJECT`](crate::FDS_PER_LIVE_OBJECT)
    /// descriptors (its connection's), and a fourth per object ran the
    /// default cap of live objects out of descriptors (`bench host-calls`,
    /// 1,000 objects: `EMFILE`, and with it a failed pass).
    fn sync(&self) -> Result<bool, SyncError> {
        match File::open(&self.path) {
            Ok(file) => file.sync_data().map(|()| true).map_err(|error| SyncError {
                error,
                retryable: false,
            }),
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    && self.path.parent().is_some_and(Path::is_dir) =>
            {
                Ok(false)
            }
            Err(error) => Err(SyncError {
                error,
                retryable: true,
            }),
        }
    }

    pub(crate) fn synced_through(&self, seq: u64) {
        self.synced.fetch_max(seq, Ordering::AcqRel);
    }

    fn key(self: &Arc<Self>) -> usize {
        Arc::as_ptr(self) as usize
    }
}

/// A point in one object's commits: durable once its WAL is synced
/// through `seq`. The default waits for nothing.
#[derive(Clone, Default)]
pub(crate) struct CommitMark {
    wal: Option<Arc<WalFile>>,
    seq: u64,
}

impl CommitMark {
    pub(crate) fn new(wal: &Arc<WalFile>, seq: u64) -> Self {
        CommitMark {
            wal: (seq > 0).then(|| Arc::clone(wal)),
            seq,
        }
    }

    /// Whether every commit up to this mark is on disk.
    pub(crate) fn is_durable(&self) -> bool {
        self.wal
            .as_ref()
            .is_none_or(|wal| wal.synced.load(Ordering::Acquire) >= self.seq)
    }

    /// Whether it is durable, by its own file or by the floor of every
    /// file in `durable`.
    fn reached(&self, durable: &Durable) -> bool {
        self.is_durable() || durable.seq >= self.seq
    }
}

/// A WAL with commits not yet synced.
struct DirtyFile {
    wal: Arc<WalFile>,
    /// Whether its directory must be synced too (the WAL may be new).
    new_wal: bool,
    /// Its first and last unsynced commits (`u64::MAX` and 0 for the
    /// index's log, whose writes are not numbered).
    first_seq: u64,
    last_seq: u64,
    /// When it must be synced: at once once something waits on it.
    due: Instant,
    /// Whether something waits on it (rather than its delay running out).
    urged: bool,
    /// Since when its passes have failed to open it (see [`SyncError`]).
    failing_since: Option<Instant>,
}

/// Commits made and not yet taken by a pass.
#[derive(Default)]
struct Dirty {
    /// The number of the last commit made (0: none yet).
    last_seq: u64,
    /// Files to sync, by [`WalFile::key`].
    files: HashMap<usize, DirtyFile>,
    stop: bool,
}

impl Dirty {
    /// Every commit below the oldest one still dirty is durable (once the
    /// pass that took the others has synced them).
    fn floor(&self) -> u64 {
        self.files
            .values()
            .map(|f| f.first_seq)
            .min()
            .map_or(self.last_seq, |first| {
                first.saturating_sub(1).min(self.last_seq)
            })
    }

    /// The earliest time a file is due.
    fn next_due(&self) -> Option<Instant> {
        self.files.values().map(|f| f.due).min()
    }
}

/// The shared state of one host's group commit. `Send + Sync`; executors
/// hold it through the host core, and each live object's storage holds a
/// clone to number its commits.
pub(crate) struct GroupCommit {
    data_dir: PathBuf,
    flush: Flush,
    index: Arc<AlarmIndex>,
    dirty: Mutex<Dirty>,
    /// Wakes the flusher thread.
    wake: Condvar,
    /// Wakes the inline driver.
    notify: Notify,
    inline: bool,
    /// How long an unawaited commit may wait ([`UNAWAITED_SYNC_DELAY`];
    /// zero inline and while sync images are taken).
    delay: Duration,
    /// The alarm index's own log, synced after deferred updates are written.
    index_wal: Arc<WalFile>,
    /// How long a file may fail to open before the gates shut
    /// ([`OPEN_RETRY_WINDOW`]).
    open_retry: Duration,
    durable: watch::Sender<Durable>,
    failed: AtomicBool,
    /// One pass at a time; the pass holds the sync lanes.
    pass: Mutex<SyncLanes>,
    images: Option<Images>,
    /// Replies that waited at a gate so far, and as of the last gathered
    /// pass (see [`GroupCommit::gather`]).
    gated: AtomicU64,
    gated_before_pass: AtomicU64,
    /// Replies held until their commits are durable, with what sends each
    /// (see [`GroupCommit::release_when_durable`]).
    held: Mutex<Vec<(CommitMark, Release)>>,
}

/// Sends one held reply to its caller.
pub(crate) type Release = Box<dyn FnOnce() + Send>;

impl GroupCommit {
    pub(crate) fn new(
        data_dir: &Path,
        flush: Flush,
        index: Arc<AlarmIndex>,
        inline: bool,
        images: Option<(PathBuf, Arc<RwLock<()>>)>,
        delay: Duration,
        open_retry: Duration,
    ) -> Arc<Self> {
        // Inline (paused-time tests) nothing waits on a timer; sync images
        // must hold exactly what was synced, so every pass takes all.
        let delay = if inline || images.is_some() {
            Duration::ZERO
        } else {
            delay
        };
        let index_wal = WalFile::new(index.wal_path());
        Arc::new(GroupCommit {
            data_dir: data_dir.to_path_buf(),
            index,
            dirty: Mutex::new(Dirty::default()),
            wake: Condvar::new(),
            notify: Notify::new(),
            inline,
            delay,
            index_wal,
            open_retry,
            durable: watch::Sender::new(Durable::default()),
            failed: AtomicBool::new(false),
            pass: Mutex::new(SyncLanes::default()),
            images: images.map(|(dir, lock)| Images {
                dir,
                lock,
                next: AtomicU64::new(1),
                wal_files: !matches!(flush, Flush::Journal(_)),
            }),
            flush,
            gated: AtomicU64::new(0),
            held: Mutex::new(Vec::new()),
            gated_before_pass: AtomicU64::new(0),
        })
    }

    /// The SQLite VFS object connections must open their files with, if
    /// not the default.
    pub(crate) fn vfs(&self) -> Option<&str> {
        self.journal().map(|journal| journal.vfs_name())
    }

    fn journal(&self) -> Option<&Arc<Journal>> {
        match &self.flush {
            Flush::Journal(journal) => Some(journal),
            Flush::WalFiles | Flush::Syncfs => None,
        }
    }

    fn lock_dirty(&self) -> MutexGuard<'_, Dirty> {
        // A panic while holding it cannot leave `Dirty` half-updated
        // (each update is one insert or take), so a poisoned lock is used.
        self.dirty.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Numbers a commit just made to the WAL `wal`; `new_wal` when the WAL
    /// may be a directory entry that was never synced. Returns its number.
    /// Nothing waits for it yet: see [`GroupCommit::gate`].
    pub(crate) fn committed(&self, wal: &Arc<WalFile>, new_wal: bool) -> u64 {
        self.mark_dirty(wal, new_wal, true)
    }

    /// Names `wal` dirty, due after the delay if it was clean; a
    /// `numbered` write takes the next commit number (returned; else 0).
    fn mark_dirty(&self, wal: &Arc<WalFile>, new_wal: bool, numbered: bool) -> u64 {
        let (seq, wake) = {
            let mut dirty = self.lock_dirty();
            // The driver sleeps until the earliest due file; a new file is
            // due last, so only a first one (or no delay) needs it awake.
            let wake = dirty.files.is_empty() || self.delay.is_zero();
            let seq = if numbered {
                dirty.last_seq += 1;
                dirty.last_seq
            } else {
                0
            };
            let due = Instant::now() + self.delay;
            let entry = dirty.files.entry(wal.key()).or_insert_with(|| DirtyFile {
                wal: Arc::clone(wal),
                new_wal: false,
                first_seq: u64::MAX,
                last_seq: 0,
                due,
                urged: false,
                failing_since: None,
            });
            entry.new_wal |= new_wal;
            if numbered {
                entry.first_seq = entry.first_seq.min(seq);
                entry.last_seq = seq;
            }
            (seq, wake)
        };
        if wake {
            self.wake_driver();
        }
        seq
    }

    /// Something waits for `mark`: make its file due now.
    pub(crate) fn urge(&self, mark: &CommitMark) {
        let Some(wal) = &mark.wal else {
            return;
        };
        let urged = {
            let mut dirty = self.lock_dirty();
            let now = Instant::now();
            match dirty.files.get_mut(&wal.key()) {
                Some(file) if file.due > now => {
                    file.due = now;
                    file.urged = true;
                    true
                }
                // Already due, or taken by a pass under way (which syncs
                // it), or synced.
                _ => false,
            }
        };
        if urged {
            self.wake_driver();
        }
    }

    fn wake_driver(&self) {
        if self.inline {
            self.notify.notify_one();
        } else {
            self.wake.notify_one();
        }
    }

    /// Holds off the flusher's copy of the files (sync images) while a
    /// write to them is under way; `None` when no images are taken.
    pub(crate) fn hold_files(&self) -> Option<RwLockReadGuard<'_, ()>> {
        let images = self.images.as_ref()?;
        Some(images.lock.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The output gate: resolves once the commits up to `mark` (of one
    /// object) are durable, syncing its file now if it was left for later.
    /// `Err` says why they never will be.
    pub(crate) async fn gate(&self, mark: &CommitMark) -> Result<(), Arc<str>> {
        if mark.is_durable() {
            return Ok(());
        }
        self.gated.fetch_add(1, Ordering::AcqRel);
        self.urge(mark);
        self.wait(|d| mark.reached(d)).await
    }

    /// The output gate as the object's thread closes it: `release` (which
    /// sends a reply made after the commits up to `mark`) runs once those
    /// commits are durable, on the thread of the pass that made them so,
    /// or at once if they already are or a sync failed (the caller's own
    /// [`GroupCommit::gate`] then passes at once, or reports the failure).
    ///
    /// Compared with sending the reply and letting the caller wait at the
    /// gate, the caller is woken once instead of twice, and the object's
    /// thread wakes no one: the pass wakes every caller it released
    /// together. Inline, where no other thread runs passes, the reply
    /// goes at once and the caller's gate runs the pass.
    pub(crate) fn release_when_durable(&self, mark: CommitMark, release: Release) {
        if self.inline {
            release();
            return;
        }
        {
            let mut held = self.lock_held();
            // Looked at under the lock that a pass takes after it marks
            // its files synced: either this sees that pass's marks, or
            // the pass sees this reply.
            if !self.releasable(&mark) {
                held.push((mark.clone(), release));
                drop(held);
                self.gated.fetch_add(1, Ordering::AcqRel);
                self.urge(&mark);
                return;
            }
        }
        release();
    }

    /// Whether a reply after `mark` may go: its commits are durable, or
    /// they never will be.
    fn releasable(&self, mark: &CommitMark) -> bool {
        self.failed.load(Ordering::Acquire) || mark.reached(&self.durable.borrow())
    }

    fn lock_held(&self) -> MutexGuard<'_, Vec<(CommitMark, Release)>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends the held replies that may go now (after a pass, or a failure).
    fn release_held(&self) {
        let ready: Vec<Release> = self
            .lock_held()
            .extract_if(.., |(mark, _)| self.releasable(mark))
            .map(|(_, release)| release)
            .collect();
        for release in ready {
            release();
        }
    }

    /// Waits until `reached` holds of what is durable, or a sync failed.
    async fn wait(&self, reached: impl Fn(&Durable) -> bool) -> Result<(), Arc<str>> {
        if self.inline {
            // No other thread syncs for us: lead the pass ourselves.
            self.run_pass();
        }
        let mut durable = self.durable.subscribe();
        let outcome = durable
            .wait_for(|d| reached(d) || d.failed.is_some())
            .await
            .map(|d| (reached(&d), d.failed.clone()));
        match outcome {
            Ok((true, _)) => Ok(()),
            Ok((false, failed)) => Err(failed.unwrap_or_else(|| "the sync failed".into())),
            Err(_) => Err("the host stopped before the commit was synced".into()),
        }
    }

    /// Makes every commit made so far durable (shutdown).
    pub(crate) async fn flush(&self) -> Result<(), Arc<str>> {
        let last = {
            let mut dirty = self.lock_dirty();
            let now = Instant::now();
            for file in dirty.files.values_mut() {
                file.due = file.due.min(now);
                file.urged = true;
            }
            dirty.last_seq
        };
        self.wake_driver();
        self.wait(|d| d.seq >= last).await
    }

    /// One pass: take every dirty file, sync, publish, then apply the
    /// index updates that waited for these commits.
    pub(crate) fn run_pass(&self) {
        let mut lanes = self.pass.lock().unwrap_or_else(|e| e.into_inner());
        if self.failed.load(Ordering::Acquire) {
            // The gates stay shut; drop what accumulates.
            self.lock_dirty().files.clear();
            return;
        }
        let image = self.images.as_ref().map(|images| {
            // No write to the files while they are copied, so the copy is
            // exactly the commits numbered so far (images take every file).
            let hold = images.lock.write().unwrap_or_else(|e| e.into_inner());
            let files = self.take_due();
            // The journal's records are in memory until its sync: write
            // them first, so the image holds them.
            let journaled = match self.journal() {
                Some(journal) => journal.sync().map_err(std::io::Error::other),
                None => Ok(()),
            };
            let copy = journaled.and_then(|()| images.copy(&self.data_dir));
            drop(hold);
            (files, copy)
        });
        let (files, copy) = match image {
            Some((files, copy)) => (files, Some(copy)),
            None => (self.take_due(), None),
        };
        if files.is_empty() && copy.is_none() {
            return;
        }
        let synced = self.sync(&files, &mut lanes);
        let published = match (synced, copy) {
            (Ok(unopened), Some(Ok(image))) => self
                .images
                .as_ref()
                .map_or(Ok(()), |images| images.publish(image))
                .map(|()| unopened),
            (Ok(_), Some(Err(error))) => Err(error),
            (result, _) => result,
        };
        let unopened = match published {
            Ok(unopened) => unopened,
            Err(error) => return self.fail(&error),
        };
        let (retry, synced): (Vec<DirtyFile>, Vec<DirtyFile>) =
            files.into_iter().partition(|file| unopened.covers(file));
        for file in &synced {
            file.wal.synced_through(file.last_seq);
        }
        if !retry.is_empty() {
            let error = unopened.error.unwrap_or_default();
            // Inline no thread would retry; an image must hold only what
            // was synced, and it already copied these files.
            if self.inline || self.images.is_some() || !self.retry_later(retry, &error) {
                return self.fail(&error);
            }
        }
        let floor = self.lock_dirty().floor();
        // Every waiter looks again, also those on one file's mark.
        self.durable.send_modify(|d| d.seq = d.seq.max(floor));
        self.release_held();
        if self.index.apply_durable() {
            // The index's own WAL: nothing waits on it.
            self.index_dirty();
        }
    }

    /// Shuts the gates for good.
    fn fail(&self, error: &dyn std::fmt::Display) {
        let message: Arc<str> = format!("a sync of the data directory failed: {error}; replies waiting for it are never released (restart the host)").into();
        tracing::error!(%error, "group commit sync failed; no later reply is released");
        self.failed.store(true, Ordering::Release);
        if let Some(journal) = self.journal() {
            // Nothing is synced any more: stop gathering records.
            journal.fail();
        }
        self.durable.send_modify(|d| d.failed = Some(message));
        self.release_held();
    }

    /// A pass could not open these files: nothing was lost, so they go
    /// back to the dirty set, due again after [`OPEN_RETRY_INTERVAL`].
    /// Returns `false` once a file has failed for longer than the retry
    /// window: then the gates must shut.
    fn retry_later(&self, files: Vec<DirtyFile>, error: &str) -> bool {
        let now = Instant::now();
        let due = now + OPEN_RETRY_INTERVAL;
        let mut first_failure = false;
        let mut gave_up = false;
        {
            let mut dirty = self.lock_dirty();
            for file in files {
                let since = file.failing_since.unwrap_or_else(|| {
                    first_failure = true;
                    now
                });
                gave_up |= now.saturating_duration_since(since) >= self.open_retry;
                let key = file.wal.key();
                match dirty.files.get_mut(&key) {
                    // Committed to again since the pass took it.
                    Some(newer) => {
                        newer.first_seq = newer.first_seq.min(file.first_seq);
                        newer.last_seq = newer.last_seq.max(file.last_seq);
                        newer.new_wal |= file.new_wal;
                        newer.due = due;
                        newer.urged = false;
                        newer.failing_since = Some(since);
                    }
                    None => {
                        dirty.files.insert(
                            key,
                            DirtyFile {
                                due,
                                urged: false,
                                failing_since: Some(since),
                                ..file
                            },
                        );
                    }
                }
            }
        }
        if first_failure && !gave_up {
            tracing::warn!(%error, retry_ms = OPEN_RETRY_INTERVAL.as_millis() as u64, "group commit could not open a file to sync it; replies wait while it is tried again");
        }
        !gave_up
    }

    /// Takes the files due now (all of them when stopping, with no delay,
    /// or with `syncfs`, which syncs them all anyway). When a file's delay
    /// ran out, files due within a quarter of the delay come along, so the
    /// unawaited commits share passes; a pass for waiting replies takes
    /// only what is due, and stays short (with one caller over 100
    /// objects, taking the others too made every reply wait for about 20
    /// syncs).
    fn take_due(&self) -> Vec<DirtyFile> {
        let mut dirty = self.lock_dirty();
        let all = dirty.stop || self.delay.is_zero() || matches!(self.flush, Flush::Syncfs);
        if all {
            return dirty.files.drain().map(|(_, file)| file).collect();
        }
        let now = Instant::now();
        if self.journal().is_some() {
            // One journal sync covers every object's commits: take them
            // all. The index's own log, synced by itself, waits its delay.
            let index = self.index_wal.key();
            let taken: Vec<usize> = dirty
                .files
                .iter()
                .filter(|(key, file)| **key != index || file.due <= now)
                .map(|(key, _)| *key)
                .collect();
            return taken
                .into_iter()
                .filter_map(|key| dirty.files.remove(&key))
                .collect();
        }
        let delay_ran_out = dirty
            .files
            .values()
            .any(|file| file.due <= now && !file.urged);
        let horizon = if delay_ran_out {
            now + self.delay / 4
        } else {
            now
        };
        let due: Vec<usize> = dirty
            .files
            .iter()
            .filter(|(_, file)| file.due <= horizon)
            .map(|(key, _)| *key)
            .collect();
        due.into_iter()
            .filter_map(|key| dirty.files.remove(&key))
            .collect()
    }

    /// Before a journal pass: while commits keep coming (executors busy
    /// with more work whose replies will wait too), let them join this
    /// pass, for up to [`GATHER_MAX`]; a quiet [`GATHER_QUIET`] ends the
    /// wait. Unless at most one reply came to wait since the last pass (a
    /// lone caller): that one is synced at once.
    fn gather(&self) {
        let waited = self.gated.load(Ordering::Acquire);
        let since_last_pass = waited - self.gated_before_pass.swap(waited, Ordering::AcqRel);
        if since_last_pass <= 1 {
            // One reply waits, as from a lone caller: no one to share with.
            return;
        }
        let started = Instant::now();
        let mut seen = {
            let dirty = self.lock_dirty();
            let index = self.index_wal.key();
            if dirty.files.keys().filter(|key| **key != index).count() <= 1 {
                // One busy object: its commits follow one another on one
                // executor, which goes on while this pass syncs.
                return;
            }
            dirty.last_seq
        };
        while started.elapsed() < GATHER_MAX {
            std::thread::sleep(GATHER_QUIET);
            let dirty = self.lock_dirty();
            if dirty.stop || dirty.last_seq == seen {
                return;
            }
            seen = dirty.last_seq;
        }
    }

    /// The index wrote to its log (not numbered): sync it within the delay.
    fn index_dirty(&self) {
        self.mark_dirty(&self.index_wal, false, false);
    }
}

impl GroupCommit {
    /// Makes `files` durable with the host's method.
    fn sync(&self, files: &[DirtyFile], lanes: &mut SyncLanes) -> std::io::Result<Unopened> {
        let wal_files = |own: &dyn Fn(&DirtyFile) -> bool| -> Vec<(Arc<WalFile>, bool)> {
            files
                .iter()
                .filter(|file| own(file))
                .map(|file| (Arc::clone(&file.wal), file.new_wal))
                .collect()
        };
        match &self.flush {
            Flush::Syncfs => syncfs(&self.data_dir),
            Flush::WalFiles => lanes.sync(wal_files(&|_| true)),
            Flush::Journal(journal) => {
                journal.sync().map_err(std::io::Error::other)?;
                // Not journaled: the index's log. A new WAL's directory
                // entry (and with it the object file's, made just before)
                // must be durable too; syncing the WAL with it costs one
                // sync per object opened.
                let own =
                    wal_files(&|file| file.new_wal || Arc::ptr_eq(&file.wal, &self.index_wal));
                if own.is_empty() {
                    Ok(Unopened::default())
                } else {
                    lanes.sync(own)
                }
            }
        }
    }
}

/// The most threads one pass syncs WAL files from (the flusher among them).
const SYNC_LANES: usize = 16;

/// Threads that sync WAL files for the passes, kept between passes.
///
/// Syncs issued together are committed together: the filesystem folds
/// concurrent fsyncs into one journal commit and one cache flush of the
/// device, where one after another each pays its own. The lanes live as
/// long as the host's group commit: a thread started per lane and pass
/// cost more CPU than the syncs themselves (measured at about 35,000
/// thread starts in four seconds of `bench operations`, preempting the
/// executors on a 2-core machine).
#[derive(Default)]
pub(crate) struct SyncLanes {
    lanes: Vec<mpsc::Sender<LaneJob>>,
}

/// A part of one pass for one lane, and where its result goes.
struct LaneJob {
    files: Vec<(Arc<WalFile>, bool)>,
    done: mpsc::Sender<std::io::Result<Unopened>>,
}

impl SyncLanes {
    /// Syncs `files`, spread over up to [`SYNC_LANES`] lanes.
    fn sync(&mut self, files: Vec<(Arc<WalFile>, bool)>) -> std::io::Result<Unopened> {
        let wanted = files.len().clamp(1, SYNC_LANES);
        if wanted == 1 {
            return sync_wal_files(&files);
        }
        let chunk = files.len().div_ceil(wanted);
        let (done, results) = mpsc::channel();
        let mut sent = 0;
        let mut outcomes = Vec::with_capacity(wanted);
        let mut parts = files.chunks(chunk);
        // This thread syncs one part itself once the others are handed
        // out: one thread fewer to wake per pass, and most lanes' results
        // are in by the time it is done.
        let own = parts.next();
        for (lane, part) in parts.enumerate() {
            let job = LaneJob {
                files: part.to_vec(),
                done: done.clone(),
            };
            let unsent = match self.lane(lane) {
                Some(sender) => match sender.send(job) {
                    Ok(()) => {
                        sent += 1;
                        None
                    }
                    Err(mpsc::SendError(job)) => Some(job),
                },
                None => Some(job),
            };
            // No lane took it (its thread is gone, or none could start):
            // sync it here.
            if let Some(job) = unsent {
                outcomes.push(sync_wal_files(&job.files));
            }
        }
        if let Some(own) = own {
            outcomes.push(sync_wal_files(own));
        }
        drop(done);
        for _ in 0..sent {
            match results.recv() {
                Ok(outcome) => outcomes.push(outcome),
                Err(_) => {
                    // Its files may not be synced; syncing them again is safe.
                    outcomes.push(Ok(Unopened::everything(&"a sync lane stopped")));
                    break;
                }
            }
        }
        let mut unopened = Unopened::default();
        for outcome in outcomes {
            unopened.merge(outcome?);
        }
        Ok(unopened)
    }

    /// Lane `n`, started on first use; `None` when no thread can start
    /// (the caller then syncs that part itself).
    fn lane(&mut self, n: usize) -> Option<&mpsc::Sender<LaneJob>> {
        while self.lanes.len() <= n {
            let (sender, jobs) = mpsc::channel::<LaneJob>();
            std::thread::Builder::new()
                .name("durability-sync".into())
                .spawn(move || {
                    // Ends when the lanes (and so every sender) are dropped.
                    while let Ok(job) = jobs.recv() {
                        let _ = job.done.send(sync_wal_files(&job.files));
                    }
                })
                .ok()?;
            self.lanes.push(sender);
        }
        self.lanes.get(n)
    }
}

/// `fdatasync` of each WAL (see [`WalFile::sync`] for a missing one), then
/// of the directories of WALs that may be new.
/// A file that cannot be opened is left in the result, to be tried again;
/// a failed sync is an error.
fn sync_wal_files(files: &[(Arc<WalFile>, bool)]) -> std::io::Result<Unopened> {
    let mut unopened = Unopened::default();
    let mut dirs: HashMap<&Path, Vec<usize>> = HashMap::new();
    for (wal, new_wal) in files {
        match wal.sync() {
            Ok(true) => crate::telemetry::fsynced(),
            Ok(false) => continue,
            Err(SyncError {
                error,
                retryable: true,
            }) => {
                unopened.add(wal.key(), &error);
                continue;
            }
            Err(SyncError { error, .. }) => return Err(error),
        }
        if *new_wal && let Some(dir) = wal.path.parent() {
            dirs.entry(dir).or_default().push(wal.key());
        }
    }
    for (dir, wals) in dirs {
        match File::open(dir) {
            Ok(handle) => {
                handle.sync_all()?;
                crate::telemetry::fsynced();
            }
            Err(error) => {
                for key in wals {
                    unopened.add(key, &error);
                }
            }
        }
    }
    Ok(unopened)
}

#[cfg(target_os = "linux")]
fn syncfs(data_dir: &Path) -> std::io::Result<Unopened> {
    match File::open(data_dir) {
        Ok(dir) => rustix::fs::syncfs(&dir)
            .map(|()| Unopened::default())
            .map_err(std::io::Error::from),
        Err(error) => Ok(Unopened::everything(&error)),
    }
}

#[cfg(not(target_os = "linux"))]
fn syncfs(_data_dir: &Path) -> std::io::Result<Unopened> {
    // The builder refuses Syncfs elsewhere; this is never reached.
    Err(std::io::Error::other("syncfs is Linux only"))
}

/// Whether `method` can run on this platform.
pub(crate) fn supported(method: FlushMethod) -> bool {
    match method {
        FlushMethod::WalFiles => true,
        FlushMethod::Syncfs => cfg!(target_os = "linux"),
        FlushMethod::Journal => cfg!(unix),
    }
}

/// Copies of the database files as each pass made them durable, for
/// power-cut tests: `<dir>/<n>/` mirrors the data directory's database and
/// WAL files, and `<dir>/latest` names the newest complete image. An
/// image is complete once its pass's sync returned, before any reply it
/// covers is released.
struct Images {
    dir: PathBuf,
    /// Every write to a database file holds it shared; the copy holds it
    /// exclusively.
    lock: Arc<RwLock<()>>,
    next: AtomicU64,
    /// Whether WAL files are copied. With the journal they are not: a
    /// power cut may lose every WAL write the journal holds, and the
    /// image is then the database files and the journal (valid while no
    /// segment was rotated, as in the tests that take images).
    wal_files: bool,
}

/// An image copied but not yet published.
struct Image {
    number: u64,
    path: PathBuf,
}

impl Images {
    fn copy(&self, data_dir: &Path) -> std::io::Result<Image> {
        let number = self.next.fetch_add(1, Ordering::Relaxed);
        let path = self.dir.join(format!("{number}.partial"));
        copy_databases(data_dir, data_dir, &path, self.wal_files)?;
        Ok(Image { number, path })
    }

    fn publish(&self, image: Image) -> std::io::Result<()> {
        let done = self.dir.join(image.number.to_string());
        std::fs::rename(&image.path, &done)?;
        let latest = self.dir.join("latest.partial");
        std::fs::write(&latest, image.number.to_string())?;
        std::fs::rename(&latest, self.dir.join("latest"))?;
        if let Some(previous) = image.number.checked_sub(1) {
            let _ = std::fs::remove_dir_all(self.dir.join(previous.to_string()));
        }
        Ok(())
    }
}

/// Copies every `*.sqlite` and `*.sqlite-wal` file under `from` to the
/// same place under `to`. Shared-memory files are left out: SQLite
/// rebuilds them from the WAL, as after a reboot.
fn copy_databases(root: &Path, from: &Path, to: &Path, wal_files: bool) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if entry.file_type()?.is_dir() {
            // Only the layout the host makes: objects/<xx>/ (and the
            // journal).
            if from == root && name != "objects" && name != JOURNAL_DIR {
                continue;
            }
            copy_databases(root, &path, &to.join(&*name), wal_files)?;
        } else if name.ends_with(".sqlite")
            || (name.ends_with(".sqlite-wal") && (wal_files || from == root))
            || (from != root && name.ends_with(".log"))
        {
            match std::fs::copy(&path, to.join(&*name)) {
                Ok(_) => {}
                // Deleted by a close since it was listed: it was checkpointed.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Runs the passes of one host: a thread of its own with executor
/// threads, a local task in inline mode. Dropping it (with the host core)
/// stops the driver after a last pass.
pub(crate) struct Flusher {
    group: Arc<GroupCommit>,
}

impl Flusher {
    /// Starts the driver. Inline, call inside the host's `LocalSet`.
    pub(crate) fn start(group: &Arc<GroupCommit>, data_dir: &Path) -> Result<Self, HostError> {
        let shared = Arc::clone(group);
        if group.inline {
            // As for the inline executor: tokio's refusal outside a
            // LocalSet is turned into a typed error.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                tokio::task::spawn_local(drive_inline(shared));
            }))
            .map_err(|_| HostError::NoRuntime {
                required: "inside a tokio::task::LocalSet when threads is 0",
            })?;
        } else {
            std::thread::Builder::new()
                .name("durability-flusher".into())
                .spawn(move || drive_thread(&shared))
                .map_err(|e| HostError::Io {
                    path: data_dir.to_path_buf(),
                    message: format!("cannot start the flusher thread: {e}"),
                })?;
        }
        Ok(Flusher {
            group: Arc::clone(group),
        })
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        self.group.lock_dirty().stop = true;
        self.group.wake_driver();
    }
}

fn drive_thread(group: &GroupCommit) {
    loop {
        {
            let mut dirty = group.lock_dirty();
            loop {
                let Some(due) = dirty.next_due() else {
                    if dirty.stop {
                        return;
                    }
                    dirty = group.wake.wait(dirty).unwrap_or_else(|e| e.into_inner());
                    continue;
                };
                let now = Instant::now();
                if dirty.stop || due <= now {
                    break;
                }
                dirty = group
                    .wake
                    .wait_timeout(dirty, due - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        if group.journal().is_some() {
            group.gather();
        }
        group.run_pass();
    }
}

/// Blocking syncs on the `LocalSet`'s thread: inline mode is for tests and
/// single-threaded embedding, where that thread is the whole host anyway.
async fn drive_inline(group: Arc<GroupCommit>) {
    loop {
        let notified = group.notify.notified();
        let (empty, stop) = {
            let dirty = group.lock_dirty();
            (dirty.files.is_empty(), dirty.stop)
        };
        if !empty {
            group.run_pass();
        } else if stop {
            return;
        } else {
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Synchronous;

    /// A group commit over `dir` with its flusher thread.
    fn start(dir: &Path, method: FlushMethod, delay: Duration) -> (Arc<GroupCommit>, Flusher) {
        start_with_retry(dir, method, delay, OPEN_RETRY_WINDOW)
    }

    fn start_with_retry(
        dir: &Path,
        method: FlushMethod,
        delay: Duration,
        open_retry: Duration,
    ) -> (Arc<GroupCommit>, Flusher) {
        let group = group(dir, method, delay, open_retry);
        let flusher = Flusher::start(&group, dir).unwrap();
        (group, flusher)
    }

    /// A group commit over `dir` whose passes nobody drives.
    fn group(
        dir: &Path,
        method: FlushMethod,
        delay: Duration,
        open_retry: Duration,
    ) -> Arc<GroupCommit> {
        let (index, _) = AlarmIndex::open(
            dir,
            Path::new(crate::index::BOOT_ID_FILE),
            Synchronous::Batched,
            None,
        )
        .unwrap();
        GroupCommit::new(
            dir,
            Flush::open(method, dir).unwrap(),
            Arc::new(index),
            false,
            None,
            delay,
            open_retry,
        )
    }

    /// A group commit syncing WAL files whose passes the test runs itself
    /// (no flusher thread); nothing is due by the clock.
    fn undriven(dir: &Path) -> Arc<GroupCommit> {
        group(
            dir,
            FlushMethod::WalFiles,
            Duration::from_secs(3600),
            OPEN_RETRY_WINDOW,
        )
    }

    #[tokio::test]
    async fn a_log_that_cannot_be_opened_is_tried_again_and_its_reply_waits_without_failing() {
        let dir = tempfile::tempdir().unwrap();
        let (group, _flusher) = start(dir.path(), FlushMethod::WalFiles, Duration::from_secs(3600));
        let (blocker, stuck) = unopenable_wal(dir.path(), "a.sqlite-wal");
        let mark = commit(&group, &stuck);
        let gate = {
            let group = Arc::clone(&group);
            let mark = mark.clone();
            tokio::spawn(async move { group.gate(&mark).await })
        };
        // Several retries fail meanwhile; none of them shuts the gates.
        let mut durable = group.durable.subscribe();
        let waited = tokio::time::timeout(
            Duration::from_millis(100),
            durable.wait_for(|d| d.failed.is_some()),
        )
        .await;
        assert!(waited.is_err(), "a failed open shut the gates");
        assert!(!mark.is_durable());
        assert!(!gate.is_finished());
        // Another object's reply is still released meanwhile.
        let other_wal = wal(dir.path(), "b.sqlite-wal");
        let other = commit(&group, &other_wal);
        group.gate(&other).await.unwrap();

        // The cause goes away: the next retry syncs the file.
        std::fs::remove_file(&blocker).unwrap();
        std::fs::create_dir(&blocker).unwrap();
        std::fs::write(blocker.join("a.sqlite-wal"), b"frames").unwrap();
        tokio::time::timeout(Duration::from_secs(60), gate)
            .await
            .expect("the retried sync never released the reply")
            .unwrap()
            .unwrap();
        assert!(mark.is_durable());
    }

    #[tokio::test]
    async fn a_log_that_keeps_failing_to_open_shuts_the_gates_after_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let (group, _flusher) = start_with_retry(
            dir.path(),
            FlushMethod::WalFiles,
            Duration::from_secs(3600),
            Duration::ZERO,
        );
        let (_, stuck) = unopenable_wal(dir.path(), "a.sqlite-wal");
        let mark = commit(&group, &stuck);
        let error = tokio::time::timeout(Duration::from_secs(60), group.gate(&mark))
            .await
            .expect("the gate never gave up")
            .unwrap_err();
        assert!(error.contains("Not a directory"), "{error}");
        // Shut for good, also for files that would sync.
        let fine = wal(dir.path(), "b.sqlite-wal");
        assert!(group.gate(&commit(&group, &fine)).await.is_err());
    }

    /// A log named `name` under `<dir>/objects`, which is made a regular
    /// file (returned, to be replaced by a directory later): opening a
    /// path under it fails with ENOTDIR, a failure to open, as running out
    /// of descriptors is, not a failed sync.
    fn unopenable_wal(dir: &Path, name: &str) -> (PathBuf, Arc<WalFile>) {
        let blocker = dir.join("objects");
        std::fs::write(&blocker, b"not a directory").unwrap();
        let wal = WalFile::new(&blocker.join(name));
        (blocker, wal)
    }

    #[test]
    fn a_log_a_pass_cannot_open_is_never_counted_synced_whichever_thread_had_it() {
        let dir = tempfile::tempdir().unwrap();
        let (_, stuck) = unopenable_wal(dir.path(), "stuck.sqlite-wal");
        let fine = [
            wal(dir.path(), "a.sqlite-wal"),
            wal(dir.path(), "b.sqlite-wal"),
        ];
        let mut lanes = SyncLanes::default();
        // Three files, three parts: the first is synced by the pass's own
        // thread, the others by lanes.
        for position in [0, 2] {
            let mut files: Vec<(Arc<WalFile>, bool)> =
                fine.iter().map(|wal| (Arc::clone(wal), true)).collect();
            files.insert(position, (Arc::clone(&stuck), true));
            let unopened = lanes.sync(files).unwrap();
            assert!(!unopened.all);
            assert_eq!(
                unopened.keys,
                HashSet::from([stuck.key()]),
                "stuck at {position}"
            );
            assert!(
                unopened
                    .error
                    .as_deref()
                    .is_some_and(|e| e.contains("Not a directory")),
                "{unopened:?}"
            );
        }
    }

    /// A log file with something in it.
    fn wal(dir: &Path, name: &str) -> Arc<WalFile> {
        let path = dir.join(name);
        std::fs::write(&path, b"frames").unwrap();
        WalFile::new(&path)
    }

    fn commit(group: &GroupCommit, wal: &Arc<WalFile>) -> CommitMark {
        CommitMark::new(wal, group.committed(wal, true))
    }

    #[tokio::test]
    async fn an_unawaited_commit_is_left_for_later_and_a_gate_syncs_its_own_file() {
        let dir = tempfile::tempdir().unwrap();
        // Nothing is ever due by the clock in this test.
        let (group, _flusher) = start(dir.path(), FlushMethod::WalFiles, Duration::from_secs(3600));
        let a = wal(dir.path(), "a.sqlite-wal");
        let b = wal(dir.path(), "b.sqlite-wal");
        let first = commit(&group, &a);
        let other = commit(&group, &b);
        let second = commit(&group, &a);
        assert!(!first.is_durable());
        assert!(!other.is_durable());

        group.gate(&second).await.unwrap();
        assert!(
            first.is_durable(),
            "the file's earlier commit is synced with it"
        );
        assert!(second.is_durable());
        assert!(
            !other.is_durable(),
            "another object's commit waits for its own reader"
        );
        // A commit the flush did not cover is not claimed durable either.
        assert_eq!(group.durable.borrow().seq, first.seq);

        group.flush().await.unwrap();
        assert!(other.is_durable(), "shutdown syncs every file");
        assert_eq!(group.durable.borrow().seq, second.seq);
    }

    #[test]
    fn a_held_reply_goes_with_the_pass_that_makes_its_commit_durable_or_with_a_failure() {
        let dir = tempfile::tempdir().unwrap();
        let group = undriven(dir.path());
        let a = wal(dir.path(), "a.sqlite-wal");
        let b = wal(dir.path(), "b.sqlite-wal");
        let sent = Arc::new(Mutex::new(Vec::new()));
        let reply = |name: &'static str| -> Release {
            let sent = Arc::clone(&sent);
            Box::new(move || sent.lock().unwrap().push(name))
        };
        let sent_so_far = || sent.lock().unwrap().clone();

        let first = commit(&group, &a);
        let other = commit(&group, &b);
        group.release_when_durable(first.clone(), reply("a"));
        // After no commit at all, a reply goes at once.
        group.release_when_durable(CommitMark::default(), reply("none"));
        assert_eq!(sent_so_far(), ["none"]);

        // The held reply urged its file: the pass syncs it, and only it.
        group.run_pass();
        assert!(first.is_durable() && !other.is_durable());
        assert_eq!(sent_so_far(), ["none", "a"]);
        // Already durable: at once.
        group.release_when_durable(first, reply("a again"));
        assert_eq!(sent_so_far(), ["none", "a", "a again"]);

        group.release_when_durable(other.clone(), reply("b"));
        assert_eq!(sent_so_far(), ["none", "a", "a again"]);
        // A failure sends what is held (its caller's gate reports it).
        group.fail(&"injected");
        assert_eq!(sent_so_far(), ["none", "a", "a again", "b"]);
        assert!(!other.is_durable());
    }

    #[tokio::test]
    async fn an_unawaited_commit_is_synced_once_its_delay_has_passed() {
        let dir = tempfile::tempdir().unwrap();
        let (group, _flusher) = start(dir.path(), FlushMethod::WalFiles, Duration::from_millis(20));
        let a = wal(dir.path(), "a.sqlite-wal");
        let mark = commit(&group, &a);
        // No gate and no flush: the flusher's own timer takes the file.
        let mut durable = group.durable.subscribe();
        tokio::time::timeout(
            Duration::from_secs(60),
            durable.wait_for(|_| mark.is_durable()),
        )
        .await
        .expect("the commit was never synced")
        .unwrap();
    }

    #[tokio::test]
    async fn a_log_removed_by_its_close_counts_as_synced() {
        let dir = tempfile::tempdir().unwrap();
        let (group, _flusher) = start(dir.path(), FlushMethod::WalFiles, Duration::from_secs(3600));
        let gone = WalFile::new(&dir.path().join("closed.sqlite-wal"));
        let mark = commit(&group, &gone);
        group.gate(&mark).await.unwrap();
        assert!(mark.is_durable());
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn one_syncfs_covers_every_dirty_file() {
        let dir = tempfile::tempdir().unwrap();
        let (group, _flusher) = start(dir.path(), FlushMethod::Syncfs, Duration::from_secs(3600));
        let a = wal(dir.path(), "a.sqlite-wal");
        let b = wal(dir.path(), "b.sqlite-wal");
        let waited = commit(&group, &a);
        let unawaited = commit(&group, &b);
        group.gate(&waited).await.unwrap();
        assert!(unawaited.is_durable(), "syncfs synced it too");
    }

    #[test]
    fn a_pass_for_a_waiting_reply_takes_only_what_is_due_and_a_timer_pass_gathers() {
        let dir = tempfile::tempdir().unwrap();
        let group = undriven(dir.path());
        let soon = Instant::now() + Duration::from_secs(60);
        let due_within = |wal: &Arc<WalFile>, at: Instant| {
            if let Some(file) = group.lock_dirty().files.get_mut(&wal.key()) {
                file.due = at;
            }
        };
        let lazy = WalFile::new(Path::new("lazy.sqlite-wal"));
        let waited = WalFile::new(Path::new("waited.sqlite-wal"));
        commit(&group, &lazy);
        due_within(&lazy, soon);
        let mark = commit(&group, &waited);
        group.urge(&mark);
        let taken: Vec<usize> = group.take_due().iter().map(|f| f.wal.key()).collect();
        assert_eq!(taken, vec![waited.key()], "a reply's pass stays short");

        // A delay ran out: the pass also takes what is due soon.
        let late = WalFile::new(Path::new("late.sqlite-wal"));
        commit(&group, &late);
        due_within(&late, Instant::now() - Duration::from_millis(1));
        let mut taken: Vec<usize> = group.take_due().iter().map(|f| f.wal.key()).collect();
        taken.sort_unstable();
        let mut expected = vec![lazy.key(), late.key()];
        expected.sort_unstable();
        assert_eq!(taken, expected);
    }

    #[test]
    fn the_floor_stops_below_the_oldest_commit_still_dirty() {
        let mut dirty = Dirty {
            last_seq: 9,
            ..Dirty::default()
        };
        assert_eq!(dirty.floor(), 9);
        let wal = WalFile::new(Path::new("x.sqlite-wal"));
        let due = Instant::now();
        dirty.files.insert(
            wal.key(),
            DirtyFile {
                wal: Arc::clone(&wal),
                new_wal: false,
                first_seq: 4,
                last_seq: 7,
                due,
                urged: false,
                failing_since: None,
            },
        );
        assert_eq!(dirty.floor(), 3);
        // The index's log holds no numbered commit.
        let index = WalFile::new(Path::new("index.sqlite-wal"));
        dirty.files.clear();
        dirty.files.insert(
            index.key(),
            DirtyFile {
                wal: index,
                new_wal: false,
                first_seq: u64::MAX,
                last_seq: 0,
                due,
                urged: false,
                failing_since: None,
            },
        );
        assert_eq!(dirty.floor(), 9);
    }
}
