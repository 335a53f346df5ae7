//! Group commit: the host-wide flusher and the output gates of
//! [`Synchronous::Batched`](crate::Synchronous::Batched).
//!
//! In that mode an object's commit does not wait for a sync of its own.
//! Its connection runs with `synchronous=NORMAL` (SQLite writes the WAL
//! frames and returns; checkpoints still sync the WAL before copying it and
//! the database after), and every commit takes the next number of one
//! host-wide sequence and names its WAL file as dirty. The flusher takes
//! every dirty file at once, makes them durable together, and then
//! publishes the highest sequence number that pass covered. Many commits of
//! many objects thus share one round of syncs: the disk's sync rate no
//! longer caps the commit rate.
//!
//! The *output gate*: a reply of `Stub::call` carries the sequence number
//! of its object's last commit when the reply was made, and the stub
//! releases it to the caller only once that number is durable. Whoever saw
//! a reply can therefore rely on every write the object made before it, as
//! with `synchronous=FULL`, also after a power loss. Work inside the host
//! (alarms, timers, in-process consumers) is not held; what could mark
//! such work done outside the object's own WAL, the host's alarm index, is
//! only raised or cleared once the object's commit is durable (see
//! [`crate::index`]).
//!
//! Why syncing the dirty WAL files is enough:
//! - SQLite checksums WAL frames in a chain, so recovery keeps a prefix of
//!   commits: a synced WAL keeps every commit before the sync, whatever
//!   the kernel wrote back on its own in between.
//! - A file closed since its commit (eviction, shutdown) was checkpointed
//!   on close, and checkpoints sync; a missing WAL is therefore durable.
//! - A WAL created since the object was opened is a new directory entry:
//!   its directory is synced too, once per pass.
//! - [`FlushMethod::Syncfs`] replaces the whole pass with one `syncfs` of
//!   the data directory's filesystem, which covers all of the above.
//!
//! A failed sync cannot be retried safely (the kernel may already have
//! dropped the pages it could not write), so after one the gates stay
//! shut: every later reply fails with `CallError::NotDurable`, and the host
//! should be restarted, which recovers what the disk holds.
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

use tokio::sync::{Notify, watch};

use crate::HostError;
use crate::index::AlarmIndex;

/// How the flusher makes a batch of commits durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlushMethod {
    /// `fdatasync` of each dirty WAL file in one pass, issued from up to 16
    /// threads at once so the filesystem commits them together (and of the
    /// directory of a WAL created since its object was opened). Touches
    /// only the host's own files. Default.
    #[default]
    WalFiles,
    /// One `syncfs` of the filesystem holding the data directory (Linux
    /// only). Costs one call per pass whatever the number of objects, but
    /// also writes back every other dirty file of that filesystem.
    Syncfs,
}

/// What is durable so far, as the gates see it.
#[derive(Debug, Clone, Default)]
struct Durable {
    /// Every commit numbered up to this is on disk.
    seq: u64,
    /// Set by the first failed sync; the gates never open past `seq` again.
    failed: Option<Arc<str>>,
}

/// Commits made since the last pass.
#[derive(Default)]
struct Dirty {
    /// The number of the last commit made (0: none yet).
    last_seq: u64,
    /// Files to sync, each with whether its directory must be synced too.
    files: HashMap<Arc<Path>, bool>,
    stop: bool,
}

/// The shared state of one host's group commit. `Send + Sync`; executors
/// hold it through the host core, and each live object's storage holds a
/// clone to number its commits.
pub(crate) struct GroupCommit {
    data_dir: PathBuf,
    method: FlushMethod,
    index: Arc<AlarmIndex>,
    dirty: Mutex<Dirty>,
    /// Wakes the flusher thread.
    wake: Condvar,
    /// Wakes the inline driver.
    notify: Notify,
    inline: bool,
    durable: watch::Sender<Durable>,
    /// `durable.seq`, readable without the channel's lock: most replies
    /// find their commit durable already.
    durable_seq: AtomicU64,
    failed: AtomicBool,
    /// One pass at a time; the pass holds the sync lanes.
    pass: Mutex<SyncLanes>,
    images: Option<Images>,
}

impl GroupCommit {
    pub(crate) fn new(
        data_dir: &Path,
        method: FlushMethod,
        index: Arc<AlarmIndex>,
        inline: bool,
        images: Option<(PathBuf, Arc<RwLock<()>>)>,
    ) -> Arc<Self> {
        Arc::new(GroupCommit {
            data_dir: data_dir.to_path_buf(),
            method,
            index,
            dirty: Mutex::new(Dirty::default()),
            wake: Condvar::new(),
            notify: Notify::new(),
            inline,
            durable: watch::Sender::new(Durable::default()),
            durable_seq: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            pass: Mutex::new(SyncLanes::default()),
            images: images.map(|(dir, lock)| Images {
                dir,
                lock,
                next: AtomicU64::new(1),
            }),
        })
    }

    fn lock_dirty(&self) -> MutexGuard<'_, Dirty> {
        // A panic while holding it cannot leave `Dirty` half-updated
        // (each update is one insert or take), so a poisoned lock is used.
        self.dirty.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Numbers a commit just made to the WAL `wal`; `new_wal` when the WAL
    /// may be a directory entry that was never synced. Returns its number.
    pub(crate) fn committed(&self, wal: &Arc<Path>, new_wal: bool) -> u64 {
        let seq = {
            let mut dirty = self.lock_dirty();
            dirty.last_seq += 1;
            let entry = dirty.files.entry(Arc::clone(wal)).or_insert(false);
            *entry |= new_wal;
            dirty.last_seq
        };
        self.wake_driver();
        seq
    }

    /// The number of the last commit made, host-wide.
    pub(crate) fn last_seq(&self) -> u64 {
        self.lock_dirty().last_seq
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

    /// The output gate: resolves once commit `seq` is durable. `Err` says
    /// why it never will be.
    pub(crate) async fn gate(&self, seq: u64) -> Result<(), Arc<str>> {
        if seq <= self.durable_seq.load(Ordering::Acquire) {
            return Ok(());
        }
        if self.inline {
            // No other thread syncs for us: lead the pass ourselves.
            self.run_pass();
        }
        let mut durable = self.durable.subscribe();
        let reached = durable
            .wait_for(|d| d.seq >= seq || d.failed.is_some())
            .await
            .map(|d| (d.seq >= seq, d.failed.clone()));
        match reached {
            Ok((true, _)) => Ok(()),
            Ok((false, failed)) => Err(failed.unwrap_or_else(|| "the sync failed".into())),
            Err(_) => Err("the host stopped before the commit was synced".into()),
        }
    }

    /// Makes every commit made so far durable (shutdown).
    pub(crate) async fn flush(&self) -> Result<(), Arc<str>> {
        let last = self.last_seq();
        self.wake_driver();
        self.gate(last).await
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
            // exactly the commits numbered up to `seq`.
            let hold = images.lock.write().unwrap_or_else(|e| e.into_inner());
            let (seq, files) = self.take_dirty();
            let copy = images.copy(&self.data_dir);
            drop(hold);
            (seq, files, copy)
        });
        let (seq, files, copy) = match image {
            Some((seq, files, copy)) => (seq, files, Some(copy)),
            None => {
                let (seq, files) = self.take_dirty();
                (seq, files, None)
            }
        };
        if seq <= self.durable_seq.load(Ordering::Acquire) && files.is_empty() {
            return;
        }
        let synced = sync(self.method, &self.data_dir, &files, &mut lanes);
        let published = match (synced, copy) {
            (Ok(()), Some(Ok(image))) => self
                .images
                .as_ref()
                .map_or(Ok(()), |images| images.publish(image)),
            (Ok(()), Some(Err(error))) => Err(error),
            (result, _) => result,
        };
        match published {
            Ok(()) => {
                self.durable_seq.store(seq, Ordering::Release);
                self.durable.send_modify(|d| d.seq = d.seq.max(seq));
                if self.index.apply_durable(seq) {
                    // The index's own WAL: synced by the next pass.
                    self.lock_dirty()
                        .files
                        .entry(Arc::from(self.index.wal_path()))
                        .or_insert(false);
                    self.wake_driver();
                }
            }
            Err(error) => {
                let message: Arc<str> = format!("a sync of the data directory failed: {error}; replies waiting for it are never released (restart the host)").into();
                tracing::error!(%error, "group commit sync failed; no later reply is released");
                self.failed.store(true, Ordering::Release);
                self.durable.send_modify(|d| d.failed = Some(message));
            }
        }
    }

    fn take_dirty(&self) -> (u64, HashMap<Arc<Path>, bool>) {
        let mut dirty = self.lock_dirty();
        (dirty.last_seq, std::mem::take(&mut dirty.files))
    }
}

/// Makes `files` durable with `method`.
fn sync(
    method: FlushMethod,
    data_dir: &Path,
    files: &HashMap<Arc<Path>, bool>,
    lanes: &mut SyncLanes,
) -> std::io::Result<()> {
    match method {
        FlushMethod::Syncfs => syncfs(data_dir),
        FlushMethod::WalFiles => {
            let files: Vec<(Arc<Path>, bool)> = files
                .iter()
                .map(|(path, dir)| (Arc::clone(path), *dir))
                .collect();
            lanes.sync(files)
        }
    }
}

/// The most threads one pass syncs WAL files from.
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
    files: Vec<(Arc<Path>, bool)>,
    done: mpsc::Sender<std::io::Result<()>>,
}

impl SyncLanes {
    /// Syncs `files`, spread over up to [`SYNC_LANES`] lanes.
    fn sync(&mut self, files: Vec<(Arc<Path>, bool)>) -> std::io::Result<()> {
        let wanted = files.len().clamp(1, SYNC_LANES);
        if wanted == 1 {
            return sync_wal_files(&files);
        }
        let chunk = files.len().div_ceil(wanted);
        let (done, results) = mpsc::channel();
        let mut sent = 0;
        let mut first_error = None;
        let mut parts = files.chunks(chunk);
        for lane in 0.. {
            let Some(part) = parts.next() else {
                break;
            };
            let job = LaneJob {
                files: part.to_vec(),
                done: done.clone(),
            };
            match self.lane(lane) {
                Some(sender) => match sender.send(job) {
                    Ok(()) => sent += 1,
                    // The lane's thread is gone: sync its part here.
                    Err(mpsc::SendError(job)) => {
                        if let Err(error) = sync_wal_files(&job.files) {
                            first_error.get_or_insert(error);
                        }
                    }
                },
                None => {
                    if let Err(error) = sync_wal_files(&job.files) {
                        first_error.get_or_insert(error);
                    }
                }
            }
        }
        drop(done);
        for _ in 0..sent {
            match results.recv() {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    first_error.get_or_insert(error);
                }
                Err(_) => {
                    first_error.get_or_insert(std::io::Error::other("a sync lane stopped"));
                    break;
                }
            }
        }
        first_error.map_or(Ok(()), Err)
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

/// `fdatasync` of each WAL (a missing one was checkpointed and synced by
/// its close), then of the directories of WALs that may be new.
fn sync_wal_files(files: &[(Arc<Path>, bool)]) -> std::io::Result<()> {
    let mut dirs = HashSet::new();
    for (path, new_wal) in files {
        match File::open(path) {
            Ok(file) => {
                file.sync_data()?;
                crate::telemetry::fsynced();
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        }
        if *new_wal && let Some(dir) = path.parent() {
            dirs.insert(dir);
        }
    }
    for dir in dirs {
        File::open(dir)?.sync_all()?;
        crate::telemetry::fsynced();
    }
    Ok(())
}

#[cfg(target_os = "linux")]
fn syncfs(data_dir: &Path) -> std::io::Result<()> {
    let dir = File::open(data_dir)?;
    rustix::fs::syncfs(&dir).map_err(std::io::Error::from)
}

#[cfg(not(target_os = "linux"))]
fn syncfs(_data_dir: &Path) -> std::io::Result<()> {
    // The builder refuses Syncfs elsewhere; this is never reached.
    Err(std::io::Error::other("syncfs is Linux only"))
}

/// Whether `method` can run on this platform.
pub(crate) fn supported(method: FlushMethod) -> bool {
    method == FlushMethod::WalFiles || cfg!(target_os = "linux")
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
        copy_databases(data_dir, data_dir, &path)?;
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
fn copy_databases(root: &Path, from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if entry.file_type()?.is_dir() {
            // Only the layout the host makes: objects/<xx>/.
            if from == root && name != "objects" {
                continue;
            }
            copy_databases(root, &path, &to.join(&*name))?;
        } else if name.ends_with(".sqlite") || name.ends_with(".sqlite-wal") {
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
            while dirty.files.is_empty() && !dirty.stop {
                dirty = group.wake.wait(dirty).unwrap_or_else(|e| e.into_inner());
            }
            if dirty.files.is_empty() && dirty.stop {
                return;
            }
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
