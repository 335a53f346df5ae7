//! The host journal of [`FlushMethod::Journal`](crate::FlushMethod::Journal):
//! one append-only file that a single `fdatasync` makes durable for the
//! commits of every object at once.
//!
//! Object connections open their files through a VFS of the journal's own
//! (see [`vfs`]): every write SQLite makes to an object's WAL goes to the
//! WAL as usual and is also kept as a record (the WAL's name under the data
//! directory, the offset, the bytes). A pass of the flusher appends the
//! records gathered since the last pass to the current *segment* and syncs
//! that one file; the WAL files themselves stay in the page cache, while
//! the segment, read only by a replay, is written past it (direct I/O, in
//! whole blocks: [`direct_io`]). Each pass starts at a fresh block, the
//! tail of the previous pass's last block padded with zeros: no write
//! touches a byte that a returned sync made durable (see below). After a
//! power cut, the host's next start *replays* the segments before it opens
//! any object: it writes every record back into its WAL, in order, syncs
//! those files, and starts a fresh segment. Each WAL then holds at least
//! every commit that was synced, and SQLite's recovery does the rest.
//!
//! Why a replay is exact:
//! - Replaying the writes of a file in their order leaves every byte they
//!   cover as the last synced write left it. Bytes no synced record covers
//!   hold what the disk held (an older write already durable, or a later
//!   one that reached the disk by itself).
//! - SQLite checksums WAL frames in a chain seeded by the WAL header, so
//!   recovery keeps a prefix of commits: a later frame on disk either
//!   continues the chain (a commit made after the last sync, kept, as a
//!   crash may keep it) or breaks it.
//! - A checkpoint copies WAL pages into the database file and syncs it;
//!   SQLite syncs the WAL first, and this VFS syncs the journal then too.
//!   So no replay can bring back a WAL shorter than what its database
//!   already holds (which would put older pages over newer ones).
//! - A *rotation* starts a new segment once the current one exceeds its
//!   limit: every WAL the old segment wrote to is synced in its own file,
//!   and only then is the old segment deleted.
//!
//! What a replay can trust:
//! - Each segment has a name no other segment of any life had (a sequence
//!   number, so they replay in order, and a random *nonce*), and every
//!   record carries the nonce and a CRC-32 of itself. A record of another
//!   segment (a file of an earlier life whose name or disk blocks came
//!   back) never decodes as one of this segment.
//! - A sync appends one *pass*: its records, numbered with the pass, and
//!   an end record. A pass that lacks its end was torn by a power cut
//!   before its sync returned, so no reply waited for it; a replay applies
//!   every whole pass and stops there.
//! - A pass starts at a block boundary ([`Format::V3`]); the bytes between
//!   its end record and the next boundary are padding, which no replay
//!   reads. A disk may garble the bytes a write was writing when the
//!   power went, even bytes it rewrote unchanged (SQLite's model of a
//!   power loss without powersafe overwrite), so a flush that wrote the
//!   last, partly filled block again would put synced records at the
//!   mercy of the next cut. Starting afresh costs the padding: at most one
//!   block a pass, half of one on average.
//! - A sync returns before the next pass is written, so past the torn
//!   pass nothing may decode but records of that same pass (blocks a
//!   disk's cache wrote out of order). A record of any other pass there,
//!   or in a segment after which a newer one was started, was made durable
//!   by a sync that returned: the disk lost synced writes before it, and
//!   replaying the prefix would roll objects back without a word. The
//!   replay then fails ([`JournalError::Lost`], naming the segment and the
//!   offsets) before it writes anything.

mod recovery;
mod vfs;

pub(crate) use recovery::recover as recover_damaged;
pub use recovery::{ByteRange, DAMAGED_DIR, DamagedSegment, ObjectRecovery, RecoveryReport};

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use rand::Rng as _;

use rusqlite::ffi;

/// A segment is rotated once it holds this many bytes.
pub(crate) const SEGMENT_LIMIT: u64 = 256 << 20;

/// The journal's directory under the data directory.
pub(crate) const JOURNAL_DIR: &str = "journal";

/// A segment file grows by this many zeros at a time, ahead of its
/// records, when a small pass reaches its end.
const ZERO_CHUNK: u64 = 1 << 20;

/// A segment is written in whole blocks of this size, at offsets and
/// from memory aligned to it, as direct I/O requires (see [`direct_io`]):
/// a multiple of every logical block size in use.
const BLOCK: usize = 4096;

/// What a segment grows by, written from here rather than allocated on
/// every growth (aligned, for direct I/O).
static ZEROS: Zeros = Zeros([0; 64 << 10]);

#[repr(C, align(4096))]
struct Zeros([u8; 64 << 10]);

/// Passes of at least this many bytes grow the segment without zeros.
///
/// Measured on `bench operations` (default mode, 64 callers, 100
/// objects; three interleaved pairs): zeros ahead of every pass cost
/// about a tenth of the throughput (6,512 / 6,964 / 7,108 ops/s against
/// 6,856 / 8,678 / 7,738), while they made a lone caller's operations
/// 2,654 ops/s (p50 335 us) instead of 1,691-2,086 (p50 465-553 us).
const ZERO_BELOW: usize = 64 << 10;

/// First bytes of every record of the current format ([`Format::V3`]).
const MAGIC: [u8; 4] = *b"DJR3";
/// Magic, nonce, pass, kind, name length, data length, offset (the header
/// of [`Format::V2`] and [`Format::V3`]).
const HEADER_LEN: usize = 4 + 8 + 8 + 1 + 2 + 4 + 8;
/// First bytes of a record of the second format (passes written one
/// after another, each flush writing the last block again), which a host
/// upgraded after a power cut still replays.
const MAGIC_V2: [u8; 4] = *b"DJR2";
/// First bytes of a record of the first format (no passes), which a host
/// upgraded after a power cut still replays.
const MAGIC_V1: [u8; 4] = *b"DJR1";
/// Magic, generation, kind, name length, data length, offset.
const HEADER_LEN_V1: usize = 4 + 8 + 1 + 2 + 4 + 8;
const CRC_LEN: usize = 4;
const KIND_WRITE: u8 = 1;
const KIND_TRUNCATE: u8 = 2;
/// Ends a pass. No name and no data; its offset is where the pass's first
/// record starts in the segment.
const KIND_END: u8 = 3;

/// A WAL the journal has records of, across its opens: its path under the
/// data directory, and how far its records are *settled*, that is durable
/// outside the journal, so that a segment holding only settled records of
/// it may go.
pub(crate) struct Wal {
    name: Box<[u8]>,
    /// Every record of this WAL numbered up to this is settled:
    /// - SQLite wrote a new WAL header (it starts over only once a
    ///   checkpoint copied every frame into the database file and synced
    ///   it, at `synchronous=NORMAL`): every earlier record is settled;
    /// - SQLite deleted the WAL (on close, after such a checkpoint);
    /// - the journal synced the WAL file itself (a straggler, below).
    settled: AtomicU64,
}

impl Wal {
    fn settle(&self, through: u64) {
        self.settled.fetch_max(through, Ordering::AcqRel);
    }

    fn settled(&self) -> u64 {
        self.settled.load(Ordering::Acquire)
    }
}

/// Why the journal failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JournalError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path}: record at byte {at} names {name:?}, which is not a WAL under the data directory"
    )]
    BadName {
        path: PathBuf,
        at: usize,
        name: String,
    },
    #[error(
        "{path}: the replayable records end at byte {at}, but a record a sync made durable lies at byte {found}: the disk lost synced writes, so replaying would roll objects back; nothing was replayed"
    )]
    Lost {
        path: PathBuf,
        at: usize,
        found: usize,
    },
    #[error(
        "{path} holds the segments of a journal recovery that did not finish; run the recovery again"
    )]
    RecoveryInterrupted { path: PathBuf },
    #[error("cannot register the journal's SQLite VFS: {0}")]
    Vfs(String),
    #[error("an earlier sync of the journal failed; it is not synced again (restart the host)")]
    Failed,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JournalError + '_ {
    move |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One change to a WAL, not yet in a segment.
struct Entry {
    wal: Arc<Wal>,
    /// Its number (of the last write merged into it).
    number: u64,
    kind: u8,
    offset: u64,
    /// Its bytes in [`Pending::bytes`].
    start: usize,
    len: usize,
}

/// What SQLite wrote since the last sync.
#[derive(Default)]
struct Pending {
    entries: Vec<Entry>,
    bytes: Vec<u8>,
}

/// The segment being appended to.
struct Segment {
    file: File,
    path: PathBuf,
    /// Its place among the segments of the directory.
    seq: u64,
    /// Random, in its name and every record (see the module).
    nonce: u64,
    /// Passes appended so far.
    passes: u64,
    /// Bytes of passes, padding included: where the next pass starts, at a
    /// block boundary.
    len: u64,
    /// Bytes of padding among them.
    padding: u64,
    /// Bytes of the file written (zeros past `len`).
    allocated: u64,
    /// The WALs it holds records of, with the number of the last: it may
    /// be deleted once each is settled through it.
    written: HashMap<usize, (Arc<Wal>, u64)>,
    /// What the next sync writes, kept (emptied) between syncs so its
    /// buffer is reused.
    encoded: Blocks,
    /// Its writes and syncs, as tests see them.
    log: IoLog,
}

/// What a segment wrote and synced: kept by tests (to check that no write
/// touches a byte a returned sync made durable), nothing otherwise.
#[derive(Default)]
struct IoLog {
    #[cfg(test)]
    ops: Vec<Io>,
}

/// One operation on a segment's file.
#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq)]
enum Io {
    /// A pass's blocks, from..to.
    Records(std::ops::Range<u64>),
    /// Zeros ahead of the records, from..to.
    Zeros(std::ops::Range<u64>),
    /// An `fdatasync` that returned.
    Synced,
}

impl IoLog {
    fn records(&mut self, at: u64, len: usize) {
        #[cfg(test)]
        self.ops.push(Io::Records(at..at + len as u64));
        #[cfg(not(test))]
        let _ = (at, len);
    }

    fn zeros(&mut self, at: u64, len: usize) {
        #[cfg(test)]
        self.ops.push(Io::Zeros(at..at + len as u64));
        #[cfg(not(test))]
        let _ = (at, len);
    }

    fn synced(&mut self) {
        #[cfg(test)]
        self.ops.push(Io::Synced);
    }
}

/// The current segment and the full ones not yet deleted.
struct Segments {
    current: Segment,
    /// Oldest first. One is deleted once every WAL it wrote to is settled
    /// (usually within one more segment: an active object's WAL starts
    /// over after each 1,000-page checkpoint); when a second full segment
    /// would wait, the oldest one's stragglers are synced in their own
    /// files and it goes.
    retiring: VecDeque<Segment>,
    /// The records a sync takes from `pending`, kept (emptied) between
    /// syncs so their buffers are reused.
    taken: Pending,
}

/// Full segments kept while their WALs settle by themselves.
const RETIRING: usize = 1;

/// The journal of one host.
pub(crate) struct Journal {
    root: PathBuf,
    dir: PathBuf,
    /// The data directory as SQLite names files under it, with a trailing
    /// separator: WAL names are relative to it.
    sqlite_root: Vec<u8>,
    limit: u64,
    pending: Mutex<Pending>,
    /// Numbers the records, in the order SQLite wrote them.
    numbered: AtomicU64,
    segments: Mutex<Segments>,
    /// Every WAL it has seen, by name.
    wals: Mutex<HashMap<Box<[u8]>, Arc<Wal>>>,
    registration: OnceLock<vfs::Registration>,
    /// Set by a failed sync (or [`Journal::fail`]): records are dropped
    /// and every later sync fails, so no checkpoint copies a WAL the
    /// journal no longer holds whole.
    failed: AtomicBool,
    /// The archive, if the host ships to one: told of every synced pass,
    /// asked before a segment is deleted (see [`crate::archive`]).
    shipping: OnceLock<Arc<crate::archive::Shipping>>,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// Names the VFS of each journal of the process.
static NEXT_VFS: AtomicU64 = AtomicU64::new(1);

impl Journal {
    /// Opens the journal of `data_dir`: replays what an earlier process
    /// left (see the module), then starts a fresh segment and registers
    /// the VFS object connections must use ([`Journal::vfs_name`]).
    pub(crate) fn open(data_dir: &Path, limit: u64) -> Result<Arc<Journal>, JournalError> {
        let dir = data_dir.join(JOURNAL_DIR);
        crate::directory::create_durably(&dir).map_err(io(&dir))?;
        let newest = replay(data_dir, &dir)?;
        let segment = Segment::create(&dir, newest + 1)?;
        let sqlite_root = sqlite_path(data_dir)?;
        let journal = Arc::new(Journal {
            root: data_dir.to_path_buf(),
            dir,
            sqlite_root,
            limit,
            pending: Mutex::new(Pending::default()),
            numbered: AtomicU64::new(0),
            segments: Mutex::new(Segments {
                current: segment,
                retiring: VecDeque::new(),
                taken: Pending::default(),
            }),
            wals: Mutex::new(HashMap::new()),
            registration: OnceLock::new(),
            failed: AtomicBool::new(false),
            shipping: OnceLock::new(),
        });
        let name = format!(
            "durability-journal-{}",
            NEXT_VFS.fetch_add(1, Ordering::Relaxed)
        );
        let registration = vfs::Registration::register(&name, Arc::downgrade(&journal))
            .map_err(JournalError::Vfs)?;
        let _ = journal.registration.set(registration);
        Ok(journal)
    }

    /// Reports every synced pass to `shipping` from now on, and keeps every
    /// segment it has not shipped (called before any object is opened).
    pub(crate) fn ship_to(&self, shipping: Arc<crate::archive::Shipping>) {
        let _ = self.shipping.set(shipping);
    }

    /// Whether segment `seq` may be deleted: no archive waits for it.
    fn shipped(&self, seq: u64) -> bool {
        self.shipping.get().is_none_or(|s| s.may_delete(seq))
    }

    /// The SQLite VFS that object connections open their files with.
    pub(crate) fn vfs_name(&self) -> &str {
        self.registration.get().map_or("", |r| r.name())
    }

    /// The WAL SQLite calls `path`, if it lies under the data directory.
    fn wal(&self, path: &[u8]) -> Option<Arc<Wal>> {
        let relative = path.strip_prefix(self.sqlite_root.as_slice())?;
        if !valid_name(relative) {
            return None;
        }
        let mut wals = self.wals.lock().unwrap_or_else(|e| e.into_inner());
        let wal = wals.entry(relative.into()).or_insert_with(|| {
            Arc::new(Wal {
                name: relative.into(),
                settled: AtomicU64::new(0),
            })
        });
        Some(Arc::clone(wal))
    }

    /// SQLite deleted the file at `path` (a WAL, after the checkpoint of
    /// its close). Once the deletion is durable, every record of it so far
    /// is settled. Until then a power cut may bring the file back as its
    /// last sync left it, older than its database, and only the journal's
    /// records make it whole again: so its directory is synced here first
    /// (one sync per object closed).
    fn deleted(&self, path: &[u8]) {
        let Some(relative) = path.strip_prefix(self.sqlite_root.as_slice()) else {
            return;
        };
        let wal = self
            .wals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(relative)
            .cloned();
        let Some(wal) = wal else {
            return;
        };
        // Records numbered later are of a WAL made anew under the name.
        let through = self.numbered.load(Ordering::Acquire);
        let Some(dir) = Path::new(std::ffi::OsStr::from_bytes(path)).parent() else {
            return;
        };
        match sync_dir(dir) {
            Ok(()) => wal.settle(through),
            Err(error) => {
                tracing::warn!(%error, "the directory of a deleted WAL could not be synced; its journal records stay until it is");
            }
        }
    }

    fn lock_pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// SQLite wrote `bytes` at `offset` of `wal` (and the write is in
    /// the file: a sync of it covers this record).
    fn wrote(&self, wal: &Arc<Wal>, offset: u64, bytes: &[u8]) {
        if self.failed.load(Ordering::Acquire) {
            return;
        }
        let mut pending = self.lock_pending();
        let number = self.numbered.fetch_add(1, Ordering::AcqRel) + 1;
        if offset == 0 {
            // A new WAL header: SQLite starts the log over (see `Wal`).
            wal.settle(number - 1);
        }
        let Pending {
            entries,
            bytes: all,
        } = &mut *pending;
        // A frame is two writes (its header, its page), and a commit's
        // frames follow one another: one record each.
        if let Some(last) = entries.last_mut()
            && last.kind == KIND_WRITE
            && Arc::ptr_eq(&last.wal, wal)
            && last.offset + last.len as u64 == offset
            && last.start + last.len == all.len()
            && last.len + bytes.len() <= u32::MAX as usize
        {
            last.len += bytes.len();
            last.number = number;
            all.extend_from_slice(bytes);
            return;
        }
        entries.push(Entry {
            wal: Arc::clone(wal),
            number,
            kind: KIND_WRITE,
            offset,
            start: all.len(),
            len: bytes.len(),
        });
        all.extend_from_slice(bytes);
    }

    /// SQLite truncated `wal` to `size` bytes.
    fn truncated(&self, wal: &Arc<Wal>, size: u64) {
        if self.failed.load(Ordering::Acquire) {
            return;
        }
        let mut pending = self.lock_pending();
        let number = self.numbered.fetch_add(1, Ordering::AcqRel) + 1;
        let start = pending.bytes.len();
        pending.entries.push(Entry {
            wal: Arc::clone(wal),
            number,
            kind: KIND_TRUNCATE,
            offset: size,
            start,
            len: 0,
        });
    }

    /// Makes every write SQLite made so far durable: appends them to the
    /// segment and syncs it (one `fdatasync` for every object).
    pub(crate) fn sync(&self) -> Result<(), JournalError> {
        let mut segments = self.segments.lock().unwrap_or_else(|e| e.into_inner());
        if self.failed.load(Ordering::Acquire) {
            return Err(JournalError::Failed);
        }
        let Segments { current, taken, .. } = &mut *segments;
        // The emptied buffers of the last sync take the pending records'
        // place.
        std::mem::swap(&mut *self.lock_pending(), taken);
        if taken.entries.is_empty() {
            return Ok(());
        }
        let result = current.append(taken);
        taken.entries.clear();
        taken.bytes.clear();
        if let Err(error) = result {
            self.fail();
            return Err(error);
        }
        if let Some(shipping) = self.shipping.get() {
            shipping.synced(current.seq, current.nonce, &current.path, current.len);
        }
        if let Err(error) = self.rotate(&mut segments) {
            // Nothing is lost: a segment not deleted is replayed.
            tracing::warn!(%error, "the journal could not rotate its segment; trying again at the next sync");
        }
        Ok(())
    }

    /// After a failed sync (the gates are shut for good): drops what is
    /// pending and refuses every later sync. The WAL files keep their
    /// writes; what the segment holds stays for the next start's replay.
    pub(crate) fn fail(&self) {
        self.failed.store(true, Ordering::Release);
        let mut pending = self.lock_pending();
        pending.entries = Vec::new();
        pending.bytes = Vec::new();
    }

    /// Starts the next segment once the current one is full, and deletes
    /// the full ones whose WALs are settled (forcing the oldest when too
    /// many wait).
    fn rotate(&self, segments: &mut Segments) -> Result<(), JournalError> {
        if segments.current.len >= self.limit {
            let next = Segment::create(&self.dir, segments.current.seq + 1)?;
            let full = std::mem::replace(&mut segments.current, next);
            full.closed();
            segments.retiring.push_back(full);
            // Forget the WALs nothing refers to any more (no open file, no
            // segment, no pending record), so the map does not grow with
            // every object the host ever opened.
            self.wals
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|_, wal| Arc::strong_count(wal) > 1);
        }
        let mut deleted = false;
        while let Some(oldest) = segments.retiring.front() {
            // An archive that is behind keeps the segment (and every
            // later one): its passes are shipped from the file.
            if !self.shipped(oldest.seq) {
                break;
            }
            if !oldest.settled() {
                if segments.retiring.len() <= RETIRING {
                    break;
                }
                self.settle(oldest.written.values())?;
            }
            std::fs::remove_file(&oldest.path).map_err(io(&oldest.path))?;
            segments.retiring.pop_front();
            deleted = true;
        }
        if deleted {
            sync_dir(&self.dir)?;
        }
        Ok(())
    }

    /// Syncs the WAL files of `written` not yet settled, in their own
    /// files: every record numbered so far is then settled.
    fn settle<'a>(
        &self,
        written: impl Iterator<Item = &'a (Arc<Wal>, u64)>,
    ) -> Result<(), JournalError> {
        let through = self.numbered.load(Ordering::Acquire);
        let unsettled: Vec<&Arc<Wal>> = written
            .filter(|(wal, last)| wal.settled() < *last)
            .map(|(wal, _)| wal)
            .collect();
        sync_files(&self.root, unsettled.iter().map(|wal| &*wal.name))?;
        for wal in unsettled {
            wal.settle(through);
        }
        Ok(())
    }
}

impl Drop for Journal {
    /// The last holder is gone, and with it every connection (each open
    /// WAL holds the journal): once the WALs the segments wrote to are
    /// settled (a clean close deleted them; any other is synced in its own
    /// file), the segments are not needed, and the next start has nothing
    /// to replay. If they cannot be synced the segments stay, and are.
    fn drop(&mut self) {
        if *self.failed.get_mut() {
            return;
        }
        let pending = std::mem::take(self.pending.get_mut().unwrap_or_else(|e| e.into_inner()));
        let shipping = self.shipping.get().cloned();
        let shipped = |seq| shipping.as_ref().is_none_or(|s| s.may_delete(seq));
        let segments = self.segments.get_mut().unwrap_or_else(|e| e.into_inner());
        segments.current.closed();
        let mut written: Vec<(Arc<Wal>, u64)> = pending
            .entries
            .iter()
            .map(|entry| (Arc::clone(&entry.wal), entry.number))
            .collect();
        let mut paths = vec![segments.current.path.clone()];
        written.extend(segments.current.written.values().cloned());
        for segment in &segments.retiring {
            paths.push(segment.path.clone());
            written.extend(segment.written.values().cloned());
        }
        // Segments an archive has not shipped stay for the next start,
        // which replays them (harmless: their WALs are settled).
        let mut kept = vec![shipped(segments.current.seq)];
        kept.extend(segments.retiring.iter().map(|s| shipped(s.seq)));
        paths = paths
            .into_iter()
            .zip(kept)
            .filter_map(|(path, shipped)| shipped.then_some(path))
            .collect();
        let cleared = self.settle(written.iter()).and_then(|()| {
            for path in &paths {
                std::fs::remove_file(path).map_err(io(path))?;
            }
            sync_dir(&self.dir)
        });
        if let Err(error) = cleared {
            tracing::warn!(%error, "journal segments were kept; the next start replays them");
        }
    }
}

impl Segment {
    /// Creates segment `seq` with a fresh nonce (and makes its name
    /// durable).
    fn create(dir: &Path, seq: u64) -> Result<Segment, JournalError> {
        let nonce = rand::rng().random::<u64>();
        let path = dir.join(segment_name(seq, nonce));
        let file = OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)
            .map_err(io(&path))?;
        direct_io(&file);
        sync_dir(dir)?;
        Ok(Segment {
            file,
            path,
            seq,
            nonce,
            passes: 0,
            len: 0,
            padding: 0,
            allocated: 0,
            written: HashMap::new(),
            encoded: Blocks::default(),
            log: IoLog::default(),
        })
    }

    /// Whether every WAL it holds records of is settled through them.
    fn settled(&self) -> bool {
        self.written
            .values()
            .all(|(wal, last)| wal.settled() >= *last)
    }

    /// Appends the records of `pending` as one pass and syncs.
    fn append(&mut self, pending: &Pending) -> Result<(), JournalError> {
        let written = self.write_pass(pending)?;
        self.file.sync_data().map_err(io(&self.path))?;
        crate::telemetry::fsynced();
        self.log.synced();
        self.synced(written);
        Ok(())
    }

    /// Writes the pass of `pending` at `len`, a block boundary, its last
    /// block padded with zeros; returns its bytes (padding included) and
    /// the padding's. No byte before `len` is written: every one of them
    /// belongs to a pass whose sync returned.
    fn write_pass(&mut self, pending: &Pending) -> Result<(u64, u64), JournalError> {
        let stamp = Stamp {
            nonce: self.nonce,
            pass: self.passes + 1,
        };
        for entry in &pending.entries {
            let data = pending
                .bytes
                .get(entry.start..entry.start + entry.len)
                .unwrap_or_default();
            encode(
                &mut self.encoded,
                stamp,
                entry.kind,
                &entry.wal.name,
                entry.offset,
                data,
            );
            self.written
                .entry(Arc::as_ptr(&entry.wal) as usize)
                .and_modify(|(_, last)| *last = entry.number)
                .or_insert_with(|| (Arc::clone(&entry.wal), entry.number));
        }
        // The pass is whole only with its end, written with it: a replay
        // takes no record of a pass whose end did not reach the disk.
        encode(&mut self.encoded, stamp, KIND_END, &[], self.len, &[]);
        let at = self.len;
        let records = self.encoded.len();
        let block = self.encoded.padded();
        let end = at + block.len() as u64;
        if end > self.allocated && records >= ZERO_BELOW {
            // A large pass (many callers) shares the cost of growing the
            // file; zeros would double the bytes written.
            self.allocated = end;
        } else if end > self.allocated {
            // A small pass (a lone caller) waits on its sync: zeros ahead
            // of the records make the next syncs of small passes write
            // data alone, where one that grows the file also commits its
            // size (measured here: 20 KB and an fdatasync, p50 110 us
            // against 270 us appended).
            let target = end.next_multiple_of(ZERO_CHUNK);
            while self.allocated < target {
                let n = usize::try_from(target - self.allocated)
                    .unwrap_or(ZEROS.0.len())
                    .min(ZEROS.0.len());
                write_blocks(&self.file, &ZEROS.0[..n], self.allocated).map_err(io(&self.path))?;
                self.log.zeros(self.allocated, n);
                self.allocated += n as u64;
            }
        }
        write_blocks(&self.file, block, at).map_err(io(&self.path))?;
        self.log.records(at, block.len());
        let written = block.len() as u64;
        self.encoded.clear();
        Ok((written, written - records as u64))
    }

    /// The pass [`Segment::write_pass`] wrote, `(bytes, padding)`, is
    /// durable: the next one starts after it.
    fn synced(&mut self, (bytes, padding): (u64, u64)) {
        self.len += bytes;
        self.padding += padding;
        self.passes += 1;
    }

    /// Says what the segment holds, as it stops being appended to (full,
    /// or its host closing): the space its padding took.
    fn closed(&self) {
        tracing::debug!(
            segment = %self.path.display(),
            passes = self.passes,
            bytes = self.len,
            padding = self.padding,
            file_bytes = self.allocated,
            "journal segment closed"
        );
    }
}

/// Asks the kernel to write `file` straight from the caller's memory to
/// the disk, past the page cache (`O_DIRECT`, Linux only).
///
/// Why: a segment is written once and read only by a replay, and
/// appending to a file through the page cache costs a new cached page for
/// every 4 KiB, filled by a copy. Measured here, appending 1 MiB passes
/// and syncing each took 630-3,750 us of CPU per MiB buffered, against
/// 120-160 us direct; on `bench operations` (64 callers, 100 objects)
/// those copies were a sixth of the whole process's CPU time. A
/// filesystem without direct I/O refuses the flag, and the segment stays
/// buffered: the writes are the same whole blocks either way.
fn direct_io(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
        let set = fcntl_getfl(file).and_then(|flags| fcntl_setfl(file, flags | OFlags::DIRECT));
        if let Err(error) = set {
            tracing::debug!(%error, "the journal's filesystem refuses direct I/O; its segments are written through the page cache");
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

/// Writes blocks of a segment at `at`. Should direct I/O refuse them
/// (`EINVAL`: a device whose blocks are larger than [`BLOCK`], say), the
/// segment goes through the page cache from then on and the write is made
/// again: the same bytes at the same place.
fn write_blocks(file: &File, bytes: &[u8], at: u64) -> std::io::Result<()> {
    match file.write_all_at(bytes, at) {
        #[cfg(target_os = "linux")]
        Err(error) if error.kind() == std::io::ErrorKind::InvalidInput => {
            use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
            let flags = fcntl_getfl(file)?;
            if !flags.contains(OFlags::DIRECT) {
                return Err(error);
            }
            fcntl_setfl(file, flags - OFlags::DIRECT)?;
            tracing::warn!(%error, "direct I/O refused a journal write; the segment is written through the page cache");
            file.write_all_at(bytes, at)
        }
        other => other,
    }
}

/// Bytes in memory aligned to [`BLOCK`], written out in whole blocks.
#[derive(Default)]
struct Blocks {
    blocks: Vec<Block>,
    len: usize,
}

#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Block([u8; BLOCK]);

impl Blocks {
    fn len(&self) -> usize {
        self.len
    }

    fn all(&mut self) -> &mut [u8] {
        let len = self.blocks.len() * BLOCK;
        // SAFETY: a `Block` is `BLOCK` initialized bytes and no padding
        // (its size equals its alignment), so the vector's blocks are
        // `len` contiguous initialized bytes, borrowed mutably with it;
        // any value is a valid `u8`.
        unsafe { std::slice::from_raw_parts_mut(self.blocks.as_mut_ptr().cast::<u8>(), len) }
    }

    fn put(&mut self, bytes: &[u8]) {
        let end = self.len + bytes.len();
        let blocks = end.div_ceil(BLOCK);
        if blocks > self.blocks.len() {
            let grown = blocks.max(self.blocks.len() * 2);
            self.blocks.resize(grown, Block([0; BLOCK]));
        }
        let start = self.len;
        if let Some(to) = self.all().get_mut(start..end) {
            to.copy_from_slice(bytes);
        }
        self.len = end;
    }

    /// The bytes put so far and zeros up to the end of their last block.
    fn padded(&mut self) -> &[u8] {
        let len = self.len;
        let end = len.next_multiple_of(BLOCK);
        let all = self.all();
        if let Some(pad) = all.get_mut(len..end) {
            pad.fill(0);
        }
        all.get(..end).unwrap_or_default()
    }

    /// Forgets the bytes put (the blocks stay, for the next ones).
    fn clear(&mut self) {
        self.len = 0;
    }
}

/// Where [`encode`] writes a record.
trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl Sink for Blocks {
    fn put(&mut self, bytes: &[u8]) {
        Blocks::put(self, bytes);
    }
}

/// The file name of segment `seq` with `nonce` in the current format
/// ([`Format::V3`]): names sort by `seq`.
fn segment_name(seq: u64, nonce: u64) -> String {
    format!("segment-{seq:020}-{nonce:016x}{V3_SUFFIX}.log")
}

/// What names a segment of [`Format::V3`], before `.log`: the format is
/// told by the name, so a segment whose first block is torn is still read
/// as what it is.
const V3_SUFFIX: &str = ".v3";

/// What every record of one pass carries.
#[derive(Clone, Copy)]
struct Stamp {
    nonce: u64,
    pass: u64,
}

fn encode(out: &mut impl Sink, stamp: Stamp, kind: u8, name: &[u8], offset: u64, data: &[u8]) {
    encode_with(out, MAGIC, stamp, kind, name, offset, data);
}

/// [`encode`] with the magic of `magic`'s format (tests write the older
/// [`Format::V2`] too).
fn encode_with(
    out: &mut impl Sink,
    magic: [u8; 4],
    stamp: Stamp,
    kind: u8,
    name: &[u8],
    offset: u64,
    data: &[u8],
) {
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&magic);
    header[4..12].copy_from_slice(&stamp.nonce.to_le_bytes());
    header[12..20].copy_from_slice(&stamp.pass.to_le_bytes());
    header[20] = kind;
    header[21..23].copy_from_slice(&(name.len() as u16).to_le_bytes());
    header[23..27].copy_from_slice(&(data.len() as u32).to_le_bytes());
    header[27..35].copy_from_slice(&offset.to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    for part in [&header[..], name, data] {
        crc.update(part);
        out.put(part);
    }
    out.put(&crc.finalize().to_le_bytes());
}

/// How a segment's records are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    /// Records without passes (`segment-<generation>.log`, `DJR1`).
    V1,
    /// Passes closed by end records, one right after another
    /// (`segment-<seq>-<nonce>.log`, `DJR2`); each flush wrote the last,
    /// partly filled block again.
    V2,
    /// As [`Format::V2`], and every pass starts at a block boundary
    /// (`segment-<seq>-<nonce>.v3.log`, `DJR3`): after a pass's end record,
    /// the bytes up to the next multiple of [`BLOCK`] are padding (zeros
    /// as written) and are never decoded.
    V3,
}

impl Format {
    /// The magic of its records and the length of their header.
    fn layout(self) -> ([u8; 4], usize) {
        match self {
            Format::V1 => (MAGIC_V1, HEADER_LEN_V1),
            Format::V2 => (MAGIC_V2, HEADER_LEN),
            Format::V3 => (MAGIC, HEADER_LEN),
        }
    }

    /// Whether its records belong to passes closed by end records.
    fn has_passes(self) -> bool {
        self != Format::V1
    }

    /// Where the pass after one whose end record ends at `at` starts.
    fn next_pass(self, at: usize) -> usize {
        match self {
            Format::V3 => at.next_multiple_of(BLOCK),
            Format::V1 | Format::V2 => at,
        }
    }

    /// Whether a pass may start at `at`.
    fn pass_starts_at(self, at: usize) -> bool {
        self != Format::V3 || at.is_multiple_of(BLOCK)
    }
}

/// One record read back.
struct Record<'a> {
    kind: u8,
    /// Its pass (0 in [`Format::V1`]).
    pass: u64,
    name: &'a [u8],
    offset: u64,
    data: &'a [u8],
}

/// The record of segment `nonce` at the start of `bytes`, with its
/// length, if it checks.
fn decode(bytes: &[u8], format: Format, nonce: u64) -> Option<(Record<'_>, usize)> {
    let (magic, header_len) = format.layout();
    let header = bytes.get(..header_len)?;
    if header[..4] != magic {
        return None;
    }
    let field = |at: usize, len: usize| header.get(at..at + len);
    let u64_at = |at: usize| Some(u64::from_le_bytes(field(at, 8)?.try_into().ok()?));
    let record_nonce = u64_at(4)?;
    let (pass, rest) = match format {
        Format::V1 => (0, 12),
        Format::V2 | Format::V3 => (u64_at(12)?, 20),
    };
    let kind = *header.get(rest)?;
    let name_len = usize::from(u16::from_le_bytes(field(rest + 1, 2)?.try_into().ok()?));
    let data_len =
        usize::try_from(u32::from_le_bytes(field(rest + 3, 4)?.try_into().ok()?)).ok()?;
    let offset = u64_at(rest + 7)?;
    let body_end = header_len.checked_add(name_len)?.checked_add(data_len)?;
    let end = body_end.checked_add(CRC_LEN)?;
    let crc = u32::from_le_bytes(bytes.get(body_end..end)?.try_into().ok()?);
    let kind_fits = match kind {
        KIND_WRITE | KIND_TRUNCATE => true,
        KIND_END => format.has_passes() && name_len == 0 && data_len == 0,
        _ => false,
    };
    if crc32fast::hash(bytes.get(..body_end)?) != crc || record_nonce != nonce || !kind_fits {
        return None;
    }
    let name = bytes.get(header_len..header_len + name_len)?;
    let data = bytes.get(header_len + name_len..body_end)?;
    Some((
        Record {
            kind,
            pass,
            name,
            offset,
            data,
        },
        end,
    ))
}

/// One record of an archived pass, as [`archived_passes`] reads it.
pub(crate) enum ArchivedRecord<'a> {
    /// A write (`truncate` false: `data` is its range in the bytes given)
    /// or a truncation to `offset` of the WAL `name`.
    Change {
        truncate: bool,
        name: &'a [u8],
        offset: u64,
        data: std::ops::Range<usize>,
    },
    /// The pass ends; the next starts at `end` (padding skipped).
    PassEnd { end: usize },
}

/// Reads whole passes of a [`Format::V3`] segment's synced bytes, as an
/// archive copied them (see [`crate::archive`]), calling `each` for every
/// record and pass end until it returns false. Fails with the byte where
/// no whole pass lies.
pub(crate) fn archived_passes<'a>(
    bytes: &'a [u8],
    nonce: u64,
    mut each: impl FnMut(ArchivedRecord<'a>) -> bool,
) -> Result<(), usize> {
    let mut at = 0;
    let mut pass_start = 0;
    while at < bytes.len() {
        let (record, len) = bytes
            .get(at..)
            .and_then(|rest| decode(rest, Format::V3, nonce))
            .ok_or(pass_start)?;
        let event = if record.kind == KIND_END {
            let end = Format::V3.next_pass(at + len);
            pass_start = end;
            at = end;
            ArchivedRecord::PassEnd { end }
        } else {
            let data_start = at + len - CRC_LEN - record.data.len();
            at += len;
            ArchivedRecord::Change {
                truncate: record.kind == KIND_TRUNCATE,
                name: record.name,
                offset: record.offset,
                data: data_start..data_start + record.data.len(),
            }
        };
        if !each(event) {
            return Ok(());
        }
    }
    if pass_start != bytes.len() {
        return Err(pass_start);
    }
    Ok(())
}

/// A name the journal may write to: a relative path of plain components
/// ending in `-wal`.
fn valid_name(name: &[u8]) -> bool {
    let path = Path::new(std::ffi::OsStr::from_bytes(name));
    name.ends_with(b"-wal")
        && path
            .components()
            .all(|component| matches!(component, Component::Normal(_)))
}

/// Replays what a journal left in `data_dir` (nothing if it has none):
/// run at every host start before any object file is read, in every mode.
pub(crate) fn recover(data_dir: &Path) -> Result<(), JournalError> {
    let dir = data_dir.join(JOURNAL_DIR);
    if dir.is_dir() {
        replay(data_dir, &dir)?;
    }
    Ok(())
}

/// The most WAL files a replay keeps open at once.
const REPLAY_OPEN_FILES: usize = 64;

/// A segment file found in a journal's directory.
#[derive(Debug)]
struct SegmentFile {
    seq: u64,
    nonce: u64,
    format: Format,
    path: PathBuf,
}

/// The segments in `dir`, oldest first.
fn segments(dir: &Path) -> Result<Vec<SegmentFile>, JournalError> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let name = entry.file_name();
        let Some(stem) = name
            .to_str()
            .and_then(|n| n.strip_prefix("segment-"))
            .and_then(|n| n.strip_suffix(".log"))
        else {
            continue;
        };
        let (stem, format) = match stem.strip_suffix(V3_SUFFIX) {
            Some(stem) => (stem, Format::V3),
            None => (stem, Format::V2),
        };
        let parsed = match stem.split_once('-') {
            Some((seq, nonce)) => seq
                .parse::<u64>()
                .ok()
                .zip(u64::from_str_radix(nonce, 16).ok())
                .map(|(seq, nonce)| (seq, nonce, format)),
            // The first format named a segment by its generation, which
            // its records carry where the nonce is now.
            None if format == Format::V2 => stem.parse::<u64>().ok().map(|g| (g, g, Format::V1)),
            None => None,
        };
        if let Some((seq, nonce, format)) = parsed {
            found.push(SegmentFile {
                seq,
                nonce,
                format,
                path: entry.path(),
            });
        }
    }
    found.sort_by_key(|segment| segment.seq);
    Ok(found)
}

/// Where the replayable records of `segment` (its bytes) end: after its
/// last whole pass. `last`: no newer segment follows it. Fails if a
/// record that a returned sync made durable lies beyond that end (see the
/// module).
fn replayable(segment: &SegmentFile, bytes: &[u8], last: bool) -> Result<usize, JournalError> {
    let mut at = 0;
    let mut end = 0;
    let mut closed = 0;
    let mut open: Option<usize> = None;
    while let Some((record, len)) = bytes
        .get(at..)
        .and_then(|rest| decode(rest, segment.format, segment.nonce))
    {
        if segment.format.has_passes() {
            if record.pass != closed + 1 {
                break;
            }
            match (record.kind, open) {
                (KIND_END, Some(start)) if record.offset == start as u64 => {
                    closed = record.pass;
                    open = None;
                }
                (KIND_END, _) => break,
                (_, None) => open = Some(at),
                (_, Some(_)) => {}
            }
        }
        at += len;
        if open.is_none() {
            // The padding after a pass (Format::V3) is never decoded: the
            // replayable bytes end where the next pass would start.
            at = segment.format.next_pass(at);
            end = at.min(bytes.len());
        }
    }
    // Past `end`, only the pass being written when the power went may
    // have left records, and only in the newest segment: a sync returned
    // before a newer segment or pass was begun. A first-format segment has
    // no passes to tell them apart by, so anything there is refused.
    let torn = closed + 1;
    let (magic, header_len) = segment.format.layout();
    let mut from = end;
    while let Some(found) = bytes
        .get(from..)
        .and_then(|rest| rest.windows(magic.len()).position(|w| w == magic))
        .map(|position| from + position)
    {
        if let Some((record, _)) = bytes
            .get(found..)
            .and_then(|rest| decode(rest, segment.format, segment.nonce))
        {
            let torn_pass = last && segment.format.has_passes() && record.pass == torn;
            if !torn_pass {
                return Err(JournalError::Lost {
                    path: segment.path.clone(),
                    at: end,
                    found,
                });
            }
        }
        from = found + 1;
        if bytes.len() < from + header_len {
            break;
        }
    }
    if bytes
        .get(end..)
        .is_some_and(|rest| rest.iter().any(|&b| b != 0))
    {
        tracing::info!(segment = %segment.path.display(), kept = end, dropped = bytes.len() - end, "journal replay: a torn pass was left out (no reply waited for it)");
    }
    Ok(end)
}

/// Writes every record the segments in `dir` hold back into its WAL under
/// `root`, syncs those files, and deletes the segments. Every segment is
/// checked ([`replayable`]) before anything is written, so a journal that
/// lost synced records leaves every file as it found it. Returns the
/// newest segment's number (0 for none).
fn replay(root: &Path, dir: &Path) -> Result<u64, JournalError> {
    recovery::refuse_interrupted(dir)?;
    let segments = segments(dir)?;
    let Some(newest) = segments.last().map(|segment| segment.seq) else {
        return Ok(0);
    };
    let mut ends = Vec::with_capacity(segments.len());
    for (n, segment) in segments.iter().enumerate() {
        let bytes = std::fs::read(&segment.path).map_err(io(&segment.path))?;
        ends.push(replayable(segment, &bytes, n + 1 == segments.len())?);
    }
    let mut replayer = Replayer::default();
    for (segment, end) in segments.iter().zip(ends) {
        let path = &segment.path;
        let bytes = std::fs::read(path).map_err(io(path))?;
        let mut at = 0;
        while at < end {
            let Some((record, len)) = bytes
                .get(at..)
                .and_then(|rest| decode(rest, segment.format, segment.nonce))
            else {
                break;
            };
            if record.kind == KIND_END {
                at = segment.format.next_pass(at + len);
            } else {
                replayer.apply(root, path, at, &record)?;
                at += len;
            }
        }
    }
    let (records, files) = (replayer.records, replayer.touched.len());
    replayer.sync(root)?;
    for segment in &segments {
        std::fs::remove_file(&segment.path).map_err(io(&segment.path))?;
    }
    sync_dir(dir)?;
    tracing::info!(
        segments = segments.len(),
        records,
        files,
        "journal replayed"
    );
    Ok(newest)
}

/// Writes records back into their WALs: a few files open at a time (a
/// journal may name more WALs than the process may open), and every one
/// written is synced by name at the end ([`Replayer::sync`]).
#[derive(Default)]
struct Replayer {
    files: HashMap<Vec<u8>, File>,
    touched: HashSet<Vec<u8>>,
    records: u64,
}

impl Replayer {
    /// Writes `record` (a write or a truncation, found at byte `at` of
    /// the segment `path`) into its WAL under `root`.
    fn apply(
        &mut self,
        root: &Path,
        path: &Path,
        at: usize,
        record: &Record<'_>,
    ) -> Result<(), JournalError> {
        if !valid_name(record.name) {
            return Err(JournalError::BadName {
                path: path.to_path_buf(),
                at,
                name: String::from_utf8_lossy(record.name).into_owned(),
            });
        }
        let target = root.join(std::ffi::OsStr::from_bytes(record.name));
        if self.files.len() >= REPLAY_OPEN_FILES && !self.files.contains_key(record.name) {
            self.files.clear();
        }
        if !self.touched.contains(record.name) {
            self.touched.insert(record.name.to_vec());
        }
        let file = match self.files.entry(record.name.to_vec()) {
            std::collections::hash_map::Entry::Occupied(file) => file.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => {
                if let Some(parent) = target.parent() {
                    crate::directory::create_durably(parent).map_err(io(parent))?;
                }
                let file = OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&target)
                    .map_err(io(&target))?;
                slot.insert(file)
            }
        };
        match record.kind {
            KIND_WRITE => file.write_all_at(record.data, record.offset),
            _ => file.set_len(record.offset),
        }
        .map_err(io(&target))?;
        self.records += 1;
        Ok(())
    }

    /// Syncs every WAL written (and its directory).
    fn sync(self, root: &Path) -> Result<(), JournalError> {
        drop(self.files);
        sync_files(root, self.touched.iter().map(Vec::as_slice))
    }
}

/// `fdatasync`s the WALs `names` under `root` (a missing one was
/// checkpointed and removed by its close) and their directories.
fn sync_files<'a>(root: &Path, names: impl Iterator<Item = &'a [u8]>) -> Result<(), JournalError> {
    let mut dirs = HashSet::new();
    for name in names {
        let path = root.join(std::ffi::OsStr::from_bytes(name));
        match File::open(&path) {
            Ok(file) => {
                file.sync_data().map_err(io(&path))?;
                crate::telemetry::fsynced();
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&path)(e)),
        }
        if let Some(parent) = path.parent() {
            dirs.insert(parent.to_path_buf());
        }
    }
    for dir in dirs {
        match File::open(&dir) {
            Ok(file) => file.sync_all().map_err(io(&dir))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&dir)(e)),
        }
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<(), JournalError> {
    crate::directory::sync(dir).map_err(io(dir))
}

/// `dir` as SQLite's platform VFS names it (absolute, links resolved),
/// with a trailing separator.
fn sqlite_path(dir: &Path) -> Result<Vec<u8>, JournalError> {
    let fail = |message: String| JournalError::Vfs(format!("{}: {message}", dir.display()));
    let name =
        std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(|e| fail(e.to_string()))?;
    // SAFETY: the default VFS stays registered for the life of the process.
    let root = unsafe { ffi::sqlite3_vfs_find(std::ptr::null()) };
    // SAFETY: `root` is null or a live VFS.
    let (size, full) = match unsafe { root.as_ref() } {
        Some(vfs) => (
            usize::try_from(vfs.mxPathname).unwrap_or(0) + 1,
            vfs.xFullPathname,
        ),
        None => return Err(fail("SQLite has no default VFS".into())),
    };
    let Some(full) = full else {
        return Err(fail("the default VFS cannot name files".into()));
    };
    let mut out = vec![0u8; size];
    // SAFETY: `out` has `size` writable bytes, as the call is told.
    let rc = unsafe { full(root, name.as_ptr(), c_int(size), out.as_mut_ptr().cast()) };
    if rc & 0xff != ffi::SQLITE_OK {
        return Err(fail(format!("xFullPathname failed with code {rc}")));
    }
    let len = out.iter().position(|&b| b == 0).unwrap_or(out.len());
    out.truncate(len);
    if !out.ends_with(b"/") {
        out.push(b'/');
    }
    Ok(out)
}

fn c_int(n: usize) -> std::ffi::c_int {
    std::ffi::c_int::try_from(n).unwrap_or(std::ffi::c_int::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::{Connection, OpenFlags};

    /// An object file under `dir` opened through `journal`'s VFS, in WAL
    /// mode at `synchronous=NORMAL` as the host runs it; checkpoints only
    /// when a test asks.
    fn open(journal: &Journal, dir: &Path) -> Connection {
        open_object(journal, dir, "object")
    }

    /// Object file `objects/ab/<name>.sqlite` under `dir`, as [`open`].
    pub(super) fn open_object(journal: &Journal, dir: &Path, name: &str) -> Connection {
        let path = dir.join(format!("objects/ab/{name}.sqlite"));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let conn = Connection::open_with_flags_and_vfs(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
            journal.vfs_name(),
        )
        .unwrap();
        conn.execute_batch(
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;
             PRAGMA wal_autocheckpoint=0;
             CREATE TABLE IF NOT EXISTS rows (n INTEGER PRIMARY KEY, body TEXT);",
        )
        .unwrap();
        conn
    }

    /// A data directory with a journal of segments of `limit` bytes and
    /// one object file open through it.
    fn journaled(limit: u64) -> (tempfile::TempDir, Arc<Journal>, Connection) {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path(), limit).unwrap();
        let conn = open(&journal, dir.path());
        (dir, journal, conn)
    }

    pub(super) fn insert(conn: &Connection, range: std::ops::Range<i64>) {
        for n in range {
            conn.execute(
                "INSERT INTO rows (n, body) VALUES (?1, ?2)",
                rusqlite::params![n, "x".repeat(300)],
            )
            .unwrap();
        }
    }

    /// The rows of the object file under `dir`, read with the default VFS.
    fn rows(dir: &Path) -> Vec<i64> {
        let conn = Connection::open(dir.join("objects/ab/object.sqlite")).unwrap();
        let mut stmt = conn.prepare("SELECT n FROM rows ORDER BY n").unwrap();
        stmt.query_map([], |row| row.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// The disk after a power cut that kept the database file and the
    /// journal but lost every write to the WAL the journal holds: the WAL
    /// is `wal` (`None`: gone).
    fn cut(dir: &Path, wal: Option<&[u8]>) -> tempfile::TempDir {
        let cut = tempfile::tempdir().unwrap();
        let objects = cut.path().join("objects/ab");
        std::fs::create_dir_all(&objects).unwrap();
        std::fs::copy(
            dir.join("objects/ab/object.sqlite"),
            objects.join("object.sqlite"),
        )
        .unwrap();
        if let Some(wal) = wal {
            std::fs::write(objects.join("object.sqlite-wal"), wal).unwrap();
        }
        let journal = cut.path().join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal).unwrap();
        for segment in segments(&dir.join(JOURNAL_DIR)).unwrap() {
            std::fs::copy(
                &segment.path,
                journal.join(segment.path.file_name().unwrap()),
            )
            .unwrap();
        }
        cut
    }

    #[test]
    fn a_replay_brings_back_every_synced_commit_whatever_the_wal_lost() {
        let (dir, journal, conn) = journaled(SEGMENT_LIMIT);
        insert(&conn, 0..50);
        journal.sync().unwrap();
        // Written but not synced: a power cut may lose these.
        insert(&conn, 50..60);
        let wal = std::fs::read(dir.path().join("objects/ab/object.sqlite-wal")).unwrap();
        let header_only = &wal[..32];
        let garbage = vec![0xa5; wal.len()];
        for lost in [
            None,
            Some(header_only),
            Some(&garbage[..]),
            Some(&wal[..wal.len() / 2]),
        ] {
            let cut = cut(dir.path(), lost);
            recover(cut.path()).unwrap();
            assert_intact(cut.path(), 50);
            assert!(segments(&cut.path().join(JOURNAL_DIR)).unwrap().is_empty());
        }
    }

    /// Rows 0..n, in order, and an intact file, in the cut.
    fn assert_intact(cut: &Path, at_least: usize) {
        let kept = rows(cut);
        assert!(
            kept.len() >= at_least && kept.iter().copied().eq(0..kept.len() as i64),
            "{} rows, {at_least} expected: {kept:?}",
            kept.len()
        );
        let check: String = Connection::open(cut.join("objects/ab/object.sqlite"))
            .unwrap()
            .query_row("PRAGMA integrity_check", [], |row| row.get(0))
            .unwrap();
        assert_eq!(check, "ok");
    }

    #[test]
    fn every_commit_is_whole_in_its_wal_file_when_it_returns() {
        // The shim holds a commit's frames back and writes them at once:
        // another connection (the default VFS, reading the files) sees
        // each commit as soon as it returned, the largest as well as the
        // smallest, and nothing of a transaction still open.
        let (dir, _journal, conn) = journaled(SEGMENT_LIMIT);
        let reader = Connection::open(dir.path().join("objects/ab/object.sqlite")).unwrap();
        let count = |reader: &Connection| -> i64 {
            reader
                .query_row("SELECT COUNT(*) FROM rows", [], |row| row.get(0))
                .unwrap()
        };
        insert(&conn, 0..3);
        assert_eq!(count(&reader), 3);
        conn.execute_batch("BEGIN").unwrap();
        // About 1.2 MB in one commit: several times what the shim holds
        // and what one platform write takes.
        for n in 3..4_003 {
            conn.execute(
                "INSERT INTO rows (n, body) VALUES (?1, ?2)",
                rusqlite::params![n, "y".repeat(300)],
            )
            .unwrap();
        }
        assert_eq!(count(&reader), 3, "an open transaction is not visible");
        conn.execute_batch("COMMIT").unwrap();
        assert_eq!(count(&reader), 4_003);
        insert(&conn, 4_003..4_004);
        assert_eq!(count(&reader), 4_004);
    }

    #[test]
    fn a_commit_that_spilled_and_rewrote_its_frames_survives_a_kill_and_a_power_cut() {
        // A transaction larger than the page cache writes pages to the WAL
        // before its commit, writes some of them again in place, and then
        // rewrites the checksums of every frame after the first rewritten
        // one, after its commit frame. Those writes must reach the file
        // (what a killed process leaves) and the journal (what a power cut
        // leaves) before the commit returns, or the log's checksum chain
        // breaks and recovery drops the commit.
        let (dir, journal, conn) = journaled(SEGMENT_LIMIT);
        conn.execute_batch("PRAGMA cache_size = 10;").unwrap();
        insert(&conn, 0..10);
        conn.execute_batch("BEGIN").unwrap();
        insert(&conn, 10..2_010);
        for n in (0..2_010).step_by(7) {
            conn.execute(
                "UPDATE rows SET body = ?2 WHERE n = ?1",
                rusqlite::params![n, "z".repeat(300)],
            )
            .unwrap();
        }
        conn.execute_batch("COMMIT").unwrap();
        // Killed now: the files as they are.
        let killed = tempfile::tempdir().unwrap();
        let objects = killed.path().join("objects/ab");
        std::fs::create_dir_all(&objects).unwrap();
        for file in ["object.sqlite", "object.sqlite-wal"] {
            std::fs::copy(dir.path().join("objects/ab").join(file), objects.join(file)).unwrap();
        }
        assert_intact(killed.path(), 2_010);
        let changed: i64 = Connection::open(objects.join("object.sqlite"))
            .unwrap()
            .query_row(
                "SELECT COUNT(*) FROM rows WHERE body LIKE 'z%'",
                [],
                |row| row.get(0),
            )
            .unwrap();
        assert_eq!(changed, 288);
        assert_a_power_cut_keeps(dir.path(), &journal, 2_010);
    }

    /// After a sync, a power cut that loses the WAL leaves at least
    /// `rows` rows once the journal is replayed.
    fn assert_a_power_cut_keeps(dir: &Path, journal: &Journal, rows: usize) {
        journal.sync().unwrap();
        let cut = cut(dir, None);
        recover(cut.path()).unwrap();
        assert_intact(cut.path(), rows);
    }

    #[test]
    fn a_commit_larger_than_one_write_comes_back_whole_from_the_journal() {
        let (dir, journal, conn) = journaled(SEGMENT_LIMIT);
        insert(&conn, 0..10);
        conn.execute_batch("BEGIN").unwrap();
        insert(&conn, 10..3_010);
        conn.execute_batch("COMMIT").unwrap();
        assert_a_power_cut_keeps(dir.path(), &journal, 3_010);
    }

    #[test]
    fn a_replay_after_a_checkpoint_never_puts_an_older_wal_over_the_database() {
        let (dir, journal, conn) = journaled(SEGMENT_LIMIT);
        insert(&conn, 0..40);
        journal.sync().unwrap();
        // Not synced by a pass: the checkpoint's own WAL sync must put
        // these in the journal before the database holds them, or a
        // replay would lay the WAL as of row 40 over a database of 80.
        insert(&conn, 40..80);
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
        let cut_after_checkpoint = cut(dir.path(), None);
        recover(cut_after_checkpoint.path()).unwrap();
        assert_intact(cut_after_checkpoint.path(), 80);
        // The WAL starts over, over its old frames.
        insert(&conn, 80..100);
        journal.sync().unwrap();
        insert(&conn, 100..110);
        let cut = cut(dir.path(), None);
        recover(cut.path()).unwrap();
        assert_intact(cut.path(), 100);
    }

    /// The bytes of the valid records of the one segment in `dir`.
    fn records_len(dir: &Path) -> usize {
        let segment = &segments(dir).unwrap()[0];
        let bytes = std::fs::read(&segment.path).unwrap();
        let at = replayable(segment, &bytes, true).unwrap();
        assert!(
            bytes[at..].iter().all(|&b| b == 0),
            "zeros follow the records"
        );
        at
    }

    #[test]
    fn a_torn_tail_ends_the_replay_and_what_came_before_is_kept() {
        let (dir, journal, conn) = journaled(SEGMENT_LIMIT);
        insert(&conn, 0..20);
        journal.sync().unwrap();
        let whole = records_len(&dir.path().join(JOURNAL_DIR));
        insert(&conn, 20..40);
        journal.sync().unwrap();
        // The second sync's records, torn: zeros from the middle of them
        // on (the file is longer than its records: zeros follow them).
        let cut = cut(dir.path(), None);
        let len = records_len(&cut.path().join(JOURNAL_DIR));
        let segment = segments(&cut.path().join(JOURNAL_DIR)).unwrap()[0]
            .path
            .clone();
        let file = OpenOptions::new().write(true).open(&segment).unwrap();
        let torn_at = whole + (len - whole) / 2;
        file.write_all_at(&vec![0; len - torn_at], torn_at as u64)
            .unwrap();
        drop(file);
        recover(cut.path()).unwrap();
        let kept = rows(cut.path());
        assert!(
            (20..40).contains(&kept.len()) && kept.iter().copied().eq(0..kept.len() as i64),
            "{kept:?}"
        );
    }

    #[test]
    fn full_segments_wait_for_their_wals_to_settle_and_stragglers_are_synced() {
        let (dir, journal, conn) = journaled(64 << 10);
        // No checkpoint: the WAL never starts over, so a full segment
        // waits until a second one is full, then the WAL is synced.
        let mut waited = false;
        for batch in 0..20 {
            insert(&conn, batch * 10..batch * 10 + 10);
            journal.sync().unwrap();
            let left = segments(&dir.path().join(JOURNAL_DIR)).unwrap();
            assert!(left.len() <= 1 + RETIRING, "{left:?}");
            waited |= left.len() == 1 + RETIRING;
        }
        assert!(waited, "no full segment waited for its WAL");
        let left = segments(&dir.path().join(JOURNAL_DIR)).unwrap();
        assert!(
            left.last().unwrap().seq > 3,
            "rotated more than twice: {left:?}"
        );
        // What the deleted segments held is in the WAL file.
        let wal = std::fs::read(dir.path().join("objects/ab/object.sqlite-wal")).unwrap();
        let cut = cut(dir.path(), Some(&wal));
        recover(cut.path()).unwrap();
        assert_eq!(rows(cut.path()), (0..200).collect::<Vec<_>>());
        // A checkpoint that lets SQLite start the WAL over settles every
        // record before it: the waiting segment goes at the next sync.
        // (Fill the current segment so that it waits.)
        while segments(&dir.path().join(JOURNAL_DIR)).unwrap().len() == 1 {
            insert(&conn, 1_000..1_001);
            conn.execute("DELETE FROM rows WHERE n >= 1000", [])
                .unwrap();
            journal.sync().unwrap();
        }
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
        insert(&conn, 200..201);
        journal.sync().unwrap();
        let left = segments(&dir.path().join(JOURNAL_DIR)).unwrap();
        assert_eq!(left.len(), 1, "{left:?}");
        // A clean close leaves nothing to replay.
        drop(conn);
        drop(journal);
        assert!(segments(&dir.path().join(JOURNAL_DIR)).unwrap().is_empty());
        assert_eq!(rows(dir.path()), (0..201).collect::<Vec<_>>());
    }

    #[test]
    fn a_wal_deleted_by_its_close_settles_the_segment_waiting_for_it() {
        let (dir, journal, conn) = journaled(64 << 10);
        let journal_dir = dir.path().join(JOURNAL_DIR);
        // Fill segments until a full one waits for this WAL to settle.
        let mut n = 0;
        while segments(&journal_dir).unwrap().len() == 1 {
            insert(&conn, n..n + 10);
            journal.sync().unwrap();
            n += 10;
        }
        // The close checkpoints the WAL and SQLite deletes it.
        drop(conn);
        assert!(!dir.path().join("objects/ab/object.sqlite-wal").exists());
        // Another object's next sync finds the waiting segment settled.
        let other = open_object(&journal, dir.path(), "other");
        insert(&other, 0..1);
        journal.sync().unwrap();
        let left = segments(&journal_dir).unwrap();
        assert_eq!(left.len(), 1, "{left:?}");
    }

    #[test]
    fn after_a_failure_no_sync_and_no_checkpoint_goes_through_and_the_segment_stays() {
        let (dir, journal, conn) = journaled(SEGMENT_LIMIT);
        insert(&conn, 0..20);
        journal.sync().unwrap();
        insert(&conn, 20..30);
        journal.fail();
        assert!(matches!(journal.sync(), Err(JournalError::Failed)));
        // The checkpoint's WAL sync is the journal's: it fails, and the
        // database file is not written.
        let database = dir.path().join("objects/ab/object.sqlite");
        let before = std::fs::read(&database).unwrap();
        let checkpointed = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
        assert!(checkpointed.is_err(), "{checkpointed:?}");
        assert_eq!(std::fs::read(&database).unwrap(), before);
        // What was synced stays for the next start's replay.
        let _ = conn.close();
        drop(journal);
        let left = segments(&dir.path().join(JOURNAL_DIR)).unwrap();
        assert_eq!(left.len(), 1, "{left:?}");
        recover(dir.path()).unwrap();
        assert_intact(dir.path(), 30);
    }

    #[test]
    fn a_record_naming_a_file_outside_the_data_directory_stops_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let journal_dir = dir.path().join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal_dir).unwrap();
        write_segment(
            &journal_dir,
            7,
            &[vec![(
                b"../elsewhere.sqlite-wal".to_vec(),
                0,
                b"abc".to_vec(),
            )]],
        );
        let error = recover(dir.path()).unwrap_err();
        assert!(matches!(error, JournalError::BadName { .. }), "{error}");
        assert!(!dir.path().join("../elsewhere.sqlite-wal").exists());
    }

    /// One write of a hand-made pass: the WAL's name, the offset, the
    /// bytes.
    pub(super) type Write = (Vec<u8>, u64, Vec<u8>);

    /// Writes segment `seq` into `dir` as [`Segment::append`] lays passes
    /// out; returns it.
    pub(super) fn write_segment(dir: &Path, seq: u64, passes: &[Vec<Write>]) -> SegmentFile {
        write_segment_as(Format::V3, dir, seq, passes)
    }

    /// [`write_segment`] in `format` (V2 or V3): V3 pads every pass to
    /// the end of its last block, as [`Segment::append`] does.
    fn write_segment_as(
        format: Format,
        dir: &Path,
        seq: u64,
        passes: &[Vec<Write>],
    ) -> SegmentFile {
        let nonce = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let (magic, _) = format.layout();
        let mut bytes = Vec::new();
        for (n, pass) in passes.iter().enumerate() {
            let stamp = Stamp {
                nonce,
                pass: n as u64 + 1,
            };
            let start = bytes.len() as u64;
            for (name, offset, data) in pass {
                encode_with(&mut bytes, magic, stamp, KIND_WRITE, name, *offset, data);
            }
            encode_with(&mut bytes, magic, stamp, KIND_END, &[], start, &[]);
            bytes.resize(format.next_pass(bytes.len()), 0);
        }
        let name = match format {
            Format::V3 => segment_name(seq, nonce),
            _ => format!("segment-{seq:020}-{nonce:016x}.log"),
        };
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        SegmentFile {
            seq,
            nonce,
            format,
            path,
        }
    }

    /// Where pass `pass` (from 1) of `segment` starts and ends.
    pub(super) fn pass_bounds(segment: &SegmentFile, pass: u64) -> (usize, usize) {
        let bytes = std::fs::read(&segment.path).unwrap();
        let mut at = 0;
        let mut start = None;
        while let Some((record, len)) = decode(&bytes[at..], segment.format, segment.nonce) {
            if record.pass == pass && start.is_none() {
                start = Some(at);
            }
            at += len;
            if record.pass == pass && record.kind == KIND_END {
                return (start.unwrap(), at);
            }
            if record.kind == KIND_END {
                at = segment.format.next_pass(at);
            }
        }
        panic!("no pass {pass}");
    }

    /// Zeros `len` bytes of `path` at `at`, as a lost write leaves them.
    pub(super) fn zero(path: &Path, at: usize, len: usize) {
        let file = OpenOptions::new().write(true).open(path).unwrap();
        file.write_all_at(&vec![0; len], at as u64).unwrap();
    }

    fn writes(name: &str, pass: u8) -> Vec<Write> {
        (0..3)
            .map(|n| {
                (
                    name.as_bytes().to_vec(),
                    u64::from(pass) * 16 + n * 4,
                    vec![pass; 4],
                )
            })
            .collect()
    }

    #[test]
    fn a_replay_refuses_synced_records_beyond_a_hole_and_touches_no_file() {
        // Pass 2 lost a stretch, pass 3 is whole: pass 3 was only written
        // after pass 2's sync returned, so the hole is in synced data.
        let dir = tempfile::tempdir().unwrap();
        let journal_dir = dir.path().join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal_dir).unwrap();
        let name = "objects/ab/x.sqlite-wal";
        let segment = write_segment(
            &journal_dir,
            4,
            &[writes(name, 1), writes(name, 2), writes(name, 3)],
        );
        let (start, end) = pass_bounds(&segment, 2);
        zero(&segment.path, start + 10, end - start - 20);
        let before = std::fs::read(&segment.path).unwrap();
        let error = recover(dir.path()).unwrap_err();
        let JournalError::Lost { path, at, found } = &error else {
            panic!("{error}");
        };
        assert_eq!((path, *at), (&segment.path, start), "{error}");
        assert!(*found >= end, "{error}");
        assert!(!dir.path().join(name).exists(), "a WAL was written");
        assert_eq!(std::fs::read(&segment.path).unwrap(), before);
    }

    #[test]
    fn a_torn_last_pass_is_left_out_even_with_its_later_blocks_on_disk() {
        // The disk's cache wrote the end of pass 2 but not its start: no
        // sync returned for it, so it is dropped and pass 1 is replayed.
        let dir = tempfile::tempdir().unwrap();
        let journal_dir = dir.path().join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal_dir).unwrap();
        let name = "objects/ab/x.sqlite-wal";
        let segment = write_segment(&journal_dir, 4, &[writes(name, 1), writes(name, 2)]);
        let (start, _) = pass_bounds(&segment, 2);
        zero(&segment.path, start, 40);
        recover(dir.path()).unwrap();
        let mut expected = vec![0; 16];
        expected.extend_from_slice(&[1; 12]);
        assert_eq!(std::fs::read(dir.path().join(name)).unwrap(), expected);
        assert!(segments(&journal_dir).unwrap().is_empty());
    }

    #[test]
    fn a_newer_segment_means_every_pass_of_the_older_one_was_synced() {
        // The older segment's last pass lacks its end: it was synced
        // before the newer segment began, so the loss is refused.
        let dir = tempfile::tempdir().unwrap();
        let journal_dir = dir.path().join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal_dir).unwrap();
        let name = "objects/ab/x.sqlite-wal";
        let older = write_segment(&journal_dir, 4, &[writes(name, 1), writes(name, 2)]);
        write_segment(&journal_dir, 5, &[writes(name, 3)]);
        let (_, end) = pass_bounds(&older, 2);
        zero(&older.path, end - 20, 20);
        let error = recover(dir.path()).unwrap_err();
        assert!(
            matches!(&error, JournalError::Lost { path, .. } if *path == older.path),
            "{error}"
        );
        assert!(!dir.path().join(name).exists());
    }

    #[test]
    fn records_an_earlier_life_left_in_a_reused_file_are_never_replayed() {
        // Every life names its segments anew; a record of an earlier life
        // (its file's blocks, or its name, back after a power cut) right
        // after this life's records does not decode as one of them.
        let dir = tempfile::tempdir().unwrap();
        let journal_dir = dir.path().join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal_dir).unwrap();
        let earlier = {
            let journal = Journal::open(dir.path(), SEGMENT_LIMIT).unwrap();
            let conn = open(&journal, dir.path());
            insert(&conn, 0..30);
            journal.sync().unwrap();
            let path = segments(&journal_dir).unwrap()[0].path.clone();
            let bytes = std::fs::read(&path).unwrap();
            // A crash: the journal is not dropped, so it stays to replay.
            std::mem::forget(conn);
            std::mem::forget(journal);
            (path, bytes)
        };
        recover(dir.path()).unwrap();
        // Synced by the replay: durable.
        let replayed = std::fs::read(dir.path().join("objects/ab/object.sqlite-wal")).unwrap();
        let journal = Journal::open(dir.path(), SEGMENT_LIMIT).unwrap();
        let current = segments(&journal_dir).unwrap()[0].path.clone();
        assert_ne!(current, earlier.0, "a segment name came back");
        let conn = open(&journal, dir.path());
        // The WAL starts over: an earlier life's records of it, replayed
        // after this life's, would put the old log over the new one.
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
        conn.execute("DELETE FROM rows WHERE n >= 10", []).unwrap();
        journal.sync().unwrap();
        let cut = cut(dir.path(), Some(&replayed));
        // The earlier life's records, right after this life's.
        let segment = &segments(&cut.path().join(JOURNAL_DIR)).unwrap()[0];
        let bytes = std::fs::read(&segment.path).unwrap();
        let end = replayable(segment, &bytes, true).unwrap();
        let file = OpenOptions::new().write(true).open(&segment.path).unwrap();
        file.write_all_at(&earlier.1, end as u64).unwrap();
        drop(file);
        recover(cut.path()).unwrap();
        assert_eq!(rows(cut.path()), (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn a_wal_deleted_at_close_stays_deleted_through_a_power_cut() {
        // Its deletion settles the journal's records of it, and a segment
        // may go with them: were the deletion not durable, a cut could
        // bring the WAL back as its last sync left it, older than its
        // database. The power-cut filesystem decides what is durable; its
        // metadata cut undoes a seeded number of undurable namespace
        // changes, newest first (the WAL's deletion is the newest here).
        let cut = crate::power_cut::PowerCut::mount();
        let mountpoint = &cut.dir;
        let journal = Journal::open(mountpoint, SEGMENT_LIMIT).unwrap();
        for seed in 0..8 {
            let name = format!("object-{seed}");
            let conn = open_object(&journal, mountpoint, &name);
            insert(&conn, 0..5);
            journal.sync().unwrap();
            drop(conn);
            let wal = mountpoint.join(format!("objects/ab/{name}.sqlite-wal"));
            assert!(!wal.exists(), "the close deleted the WAL");
            cut.fs
                .cut(durability_powercut::Fault::Metadata, seed)
                .unwrap();
            assert!(
                !wal.exists(),
                "seed {seed}: a cut brought the deleted WAL back"
            );
        }
        drop(journal);
        cut.fs.unmount().unwrap();
    }

    /// A pass of one write to `wal` of `len` bytes of `byte` at `offset`.
    fn one_write(wal: &Arc<Wal>, offset: u64, byte: u8, len: usize) -> Pending {
        Pending {
            entries: vec![Entry {
                wal: Arc::clone(wal),
                number: offset + 1,
                kind: KIND_WRITE,
                offset,
                start: 0,
                len,
            }],
            bytes: vec![byte; len],
        }
    }

    #[test]
    fn a_cut_that_tears_a_flush_in_flight_keeps_every_synced_pass() {
        // A flush's write, torn by a power cut before its sync returned,
        // garbles what it was writing: it must not have been writing a
        // byte of a synced record, which a caller was told is durable.
        let cut = crate::power_cut::PowerCut::mount();
        let dir = &cut.dir;
        let name = "objects/ab/x.sqlite-wal";
        let wal = wal(name.as_bytes());
        for seed in 0..4 {
            let journal_dir = dir.join(JOURNAL_DIR);
            std::fs::create_dir_all(&journal_dir).unwrap();
            let mut segment = Segment::create(&journal_dir, 1 + seed).unwrap();
            let synced = 100 + 700 * seed as usize;
            segment.append(&one_write(&wal, 0, 1, synced)).unwrap();
            segment
                .write_pass(&one_write(&wal, synced as u64, 2, 300))
                .unwrap();
            let report = cut
                .fs
                .cut(durability_powercut::Fault::TornOverwrite, seed)
                .unwrap();
            assert!(report.bytes_garbled > 0, "seed {seed}: nothing was torn");
            drop(segment);
            recover(dir).unwrap();
            assert_eq!(
                std::fs::read(dir.join(name)).ok(),
                Some(vec![1; synced]),
                "seed {seed}: the synced pass did not come back"
            );
            std::fs::remove_dir_all(dir.join("objects")).unwrap();
        }
    }

    fn wal(name: &[u8]) -> Arc<Wal> {
        Arc::new(Wal {
            name: name.into(),
            settled: AtomicU64::new(0),
        })
    }

    #[test]
    fn a_replay_writes_more_wals_than_it_keeps_open() {
        let dir = tempfile::tempdir().unwrap();
        let journal_dir = dir.path().join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal_dir).unwrap();
        let count = REPLAY_OPEN_FILES * 2 + 1;
        // Two passes over every file, so each is reopened after the cache
        // was emptied.
        let passes: Vec<_> = (0..2_u8)
            .map(|round| {
                (0..count)
                    .map(|n| {
                        let name = format!("objects/{:02x}/{n}.sqlite-wal", n % 7);
                        (name.into_bytes(), u64::from(round) * 4, vec![round + 1; 4])
                    })
                    .collect()
            })
            .collect();
        write_segment(&journal_dir, 3, &passes);
        recover(dir.path()).unwrap();
        for n in 0..count {
            let path = dir
                .path()
                .join(format!("objects/{:02x}/{n}.sqlite-wal", n % 7));
            assert_eq!(
                std::fs::read(&path).unwrap(),
                [1, 1, 1, 1, 2, 2, 2, 2],
                "{n}"
            );
        }
        assert!(segments(&journal_dir).unwrap().is_empty());
    }

    /// Passes of `sizes` (bytes of data per record, one pass per inner
    /// list) appended to a fresh segment; returns it with the data.
    fn appended(dir: &Path, sizes: &[&[usize]]) -> (Segment, Vec<Vec<u8>>) {
        let mut segment = Segment::create(dir, 5).unwrap();
        let wal = wal(b"objects/ab/x.sqlite-wal");
        let mut written = Vec::new();
        for pass in sizes {
            let mut pending = Pending::default();
            for &size in *pass {
                let n = written.len();
                let data: Vec<u8> = (0..size).map(|i| (i * 31 + n) as u8).collect();
                pending.entries.push(Entry {
                    wal: Arc::clone(&wal),
                    number: n as u64 + 1,
                    kind: KIND_WRITE,
                    offset: n as u64,
                    start: pending.bytes.len(),
                    len: size,
                });
                pending.bytes.extend_from_slice(&data);
                written.push(data);
            }
            segment.append(&pending).unwrap();
            let file_len = segment.file.metadata().unwrap().len();
            assert_eq!(file_len % BLOCK as u64, 0, "whole blocks: {file_len}");
            assert!(file_len >= segment.len, "{file_len} < {}", segment.len);
        }
        (segment, written)
    }

    #[test]
    fn passes_of_any_size_leave_every_record_in_order_in_whole_blocks() {
        let dir = tempfile::tempdir().unwrap();
        // Records ending inside a block, exactly at its end, spanning
        // several; small passes (zeros ahead) and one past ZERO_BELOW.
        let sizes: &[&[usize]] = &[
            &[10],
            &[100, 3_000],
            &[BLOCK - HEADER_LEN - 23 - CRC_LEN],
            &[1],
            &[9_000, 17],
            &[ZERO_BELOW + 5_000],
            &[4_095, 4_096, 4_097],
            &[0],
        ];
        let (segment, written) = appended(dir.path(), sizes);
        let bytes = std::fs::read(&segment.path).unwrap();
        let mut at = 0;
        let mut read = Vec::new();
        let mut ends = 0;
        while let Some((record, len)) = decode(&bytes[at..], Format::V3, segment.nonce) {
            at += len;
            if record.kind == KIND_END {
                ends += 1;
                assert_eq!(record.pass, ends);
                assert_eq!(record.offset % BLOCK as u64, 0, "a pass starts a block");
                assert!(
                    bytes[at..at.next_multiple_of(BLOCK)]
                        .iter()
                        .all(|&b| b == 0),
                    "padding is zeros"
                );
                at = at.next_multiple_of(BLOCK);
            } else {
                assert_eq!(record.offset, read.len() as u64);
                assert_eq!(record.pass, ends + 1);
                read.push(record.data.to_vec());
            }
        }
        assert_eq!(ends, sizes.len() as u64, "one end record a pass");
        assert_eq!(at as u64, segment.len);
        assert!(
            bytes[at..].iter().all(|&b| b == 0),
            "zeros follow the records"
        );
        assert_eq!(read, written);
    }

    /// Fails if a write in `log` touches a byte below the end of what
    /// the syncs before it made durable (the records and padding of every
    /// pass whose sync returned). Zeros written ahead may be overwritten:
    /// they hold no record. Returns the passes synced.
    fn assert_no_synced_byte_rewritten(log: &[Io]) -> usize {
        let (mut durable, mut last, mut passes) = (0, 0, 0);
        for op in log {
            match op {
                Io::Records(range) | Io::Zeros(range) => {
                    assert!(
                        range.start >= durable,
                        "{op:?} rewrites synced bytes below {durable}"
                    );
                    if let Io::Records(range) = op {
                        last = range.end;
                    }
                }
                Io::Synced => {
                    durable = durable.max(last);
                    passes += 1;
                }
            }
        }
        passes
    }

    #[test]
    fn no_write_touches_a_byte_that_a_returned_sync_made_durable() {
        // Passes of every size the journal sees: lone commits smaller
        // than a block, ones that end on a block's end, large
        // transactions, many objects at once, and a checkpoint's sync.
        let (dir, journal, conn) = journaled(SEGMENT_LIMIT);
        let others: Vec<_> = (0..3)
            .map(|n| open_object(&journal, dir.path(), &format!("other-{n}")))
            .collect();
        let mut n = 0;
        for round in 0..40_i64 {
            for _ in 0..1 + round % 5 {
                insert(&conn, n..n + 1);
                n += 1;
            }
            if round % 7 == 3 {
                conn.execute_batch("BEGIN").unwrap();
                insert(&conn, n..n + 200);
                n += 200;
                conn.execute_batch("COMMIT").unwrap();
            }
            if round % 3 == 0 {
                for other in &others {
                    insert(other, round * 10..round * 10 + 1 + round % 4);
                }
            }
            if round == 20 {
                conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
                    .unwrap();
            }
            journal.sync().unwrap();
        }
        let segments = journal.segments.lock().unwrap();
        let passes = assert_no_synced_byte_rewritten(&segments.current.log.ops);
        assert!(passes >= 40, "{passes} passes");
        drop(segments);
        assert_a_power_cut_keeps(dir.path(), &journal, n as usize);
    }

    #[test]
    fn passes_ending_anywhere_in_a_block_never_rewrite_it() {
        // Every size up to two blocks, in steps that land the end of a
        // pass at every place in a block.
        let dir = tempfile::tempdir().unwrap();
        let sizes: Vec<Vec<usize>> = (0..2 * BLOCK).step_by(331).map(|n| vec![n]).collect();
        let sizes: Vec<&[usize]> = sizes.iter().map(Vec::as_slice).collect();
        let (segment, _) = appended(dir.path(), &sizes);
        let passes = assert_no_synced_byte_rewritten(&segment.log.ops);
        assert_eq!(passes, sizes.len());
        assert!(segment.padding > 0 && segment.padding < (sizes.len() * BLOCK) as u64);
    }

    /// What replaying `segments` (made by `make` in a journal directory)
    /// leaves in WAL `name`.
    fn replayed(make: impl FnOnce(&Path), name: &str) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let journal_dir = dir.path().join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal_dir).unwrap();
        make(&journal_dir);
        recover(dir.path()).unwrap();
        assert!(segments(&journal_dir).unwrap().is_empty());
        std::fs::read(dir.path().join(name)).unwrap()
    }

    /// Three passes over one WAL, of sizes that leave padding of every
    /// kind (a few bytes, most of a block, none), and the WAL they make.
    fn padded_passes(name: &str) -> (Vec<Vec<Write>>, Vec<u8>) {
        let end_record = HEADER_LEN + CRC_LEN;
        let record = |len: usize| HEADER_LEN + name.len() + len + CRC_LEN;
        let exact = BLOCK - end_record - record(0);
        let lens = [exact - 5, 10, exact];
        let mut wal = Vec::new();
        let passes = lens
            .iter()
            .enumerate()
            .map(|(n, &len)| {
                let bytes = vec![n as u8 + 1; len];
                let write = (name.as_bytes().to_vec(), wal.len() as u64, bytes.clone());
                wal.extend_from_slice(&bytes);
                vec![write]
            })
            .collect();
        (passes, wal)
    }

    #[test]
    fn a_replay_skips_the_padding_after_every_pass_whatever_it_holds() {
        let name = "objects/ab/x.sqlite-wal";
        let (passes, wal) = padded_passes(name);
        assert_eq!(
            replayed(|dir| drop(write_segment(dir, 2, &passes)), name),
            wal
        );
        // Padding is never decoded: bytes that look like anything there
        // (even a record of the segment) change nothing.
        let garbled = replayed(
            |dir| {
                let segment = write_segment(dir, 2, &passes);
                let (_, end) = pass_bounds(&segment, 2);
                let mut bytes = std::fs::read(&segment.path).unwrap();
                assert!(end % BLOCK != 0, "pass 2 leaves padding");
                bytes[end..end.next_multiple_of(BLOCK)].fill(0xa5);
                std::fs::write(&segment.path, bytes).unwrap();
                assert_eq!(
                    pass_bounds(&segment, 3).1 % BLOCK,
                    0,
                    "pass 3 fills its block"
                );
            },
            name,
        );
        assert_eq!(garbled, wal);
    }

    #[test]
    fn segments_of_the_second_format_are_still_replayed_and_recovered() {
        let name = "objects/ab/x.sqlite-wal";
        let (passes, wal) = padded_passes(name);
        // An older host's segment alone, then followed by a newer one.
        assert_eq!(
            replayed(
                |dir| drop(write_segment_as(Format::V2, dir, 2, &passes)),
                name
            ),
            wal
        );
        let (older, newer) = passes.split_at(2);
        assert_eq!(
            replayed(
                |dir| {
                    let v2 = write_segment_as(Format::V2, dir, 2, older);
                    assert!(!v2.path.to_string_lossy().contains(V3_SUFFIX));
                    let v3 = write_segment(dir, 3, newer);
                    let found: Vec<_> = segments(dir).unwrap().iter().map(|s| s.format).collect();
                    assert_eq!(found, [Format::V2, Format::V3]);
                    drop(v3);
                },
                name
            ),
            wal
        );
        // A torn last pass of an old segment is left out as before, and a
        // recovery reads it too.
        let dir = tempfile::tempdir().unwrap();
        let journal_dir = dir.path().join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal_dir).unwrap();
        let segment = write_segment_as(Format::V2, &journal_dir, 2, &passes);
        let (start, _) = pass_bounds(&segment, 3);
        zero(&segment.path, start, 20);
        let report = recover_damaged(dir.path()).unwrap();
        assert!(report.is_whole(), "{report:?}");
        let two_passes = &wal[..passes[0][0].2.len() + passes[1][0].2.len()];
        assert_eq!(std::fs::read(dir.path().join(name)).unwrap(), two_passes);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn segments_are_written_past_the_page_cache_where_the_filesystem_allows() {
        use rustix::fs::{OFlags, fcntl_getfl};
        let dir = tempfile::tempdir().unwrap();
        // Whether this filesystem takes direct I/O at all.
        let probe = File::create(dir.path().join("probe")).unwrap();
        let flags = fcntl_getfl(&probe).unwrap();
        let direct = rustix::fs::fcntl_setfl(&probe, flags | OFlags::DIRECT).is_ok();
        let (segment, _) = appended(dir.path(), &[&[10], &[ZERO_BELOW]]);
        assert_eq!(
            fcntl_getfl(&segment.file).unwrap().contains(OFlags::DIRECT),
            direct
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_write_direct_io_refuses_goes_through_the_page_cache() {
        use rustix::fs::{OFlags, fcntl_getfl};
        let dir = tempfile::tempdir().unwrap();
        let segment = Segment::create(dir.path(), 1).unwrap();
        if !fcntl_getfl(&segment.file).unwrap().contains(OFlags::DIRECT) {
            return; // this filesystem has no direct I/O to refuse anything
        }
        // Memory one byte past a block's start: direct I/O refuses it.
        let mut blocks = Blocks::default();
        blocks.put(&[7; BLOCK + 1]);
        let unaligned = &blocks.padded()[1..=BLOCK];
        write_blocks(&segment.file, unaligned, 0).unwrap();
        assert!(!fcntl_getfl(&segment.file).unwrap().contains(OFlags::DIRECT));
        assert_eq!(std::fs::read(&segment.path).unwrap(), vec![7; BLOCK]);
    }

    #[test]
    fn records_of_another_segment_or_with_a_bad_checksum_do_not_decode() {
        let stamp = Stamp { nonce: 3, pass: 9 };
        let mut bytes = Vec::new();
        encode(
            &mut bytes,
            stamp,
            KIND_WRITE,
            b"objects/ab/x.sqlite-wal",
            4096,
            b"hello",
        );
        let (record, len) = decode(&bytes, Format::V3, 3).unwrap();
        assert_eq!(
            (record.offset, record.data, record.pass, len),
            (4096, &b"hello"[..], 9, bytes.len())
        );
        assert!(decode(&bytes, Format::V3, 4).is_none());
        assert!(decode(&bytes, Format::V2, 3).is_none());
        assert!(decode(&bytes, Format::V1, 3).is_none());
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        assert!(decode(&bytes, Format::V3, 3).is_none());
        assert!(decode(&bytes[..10], Format::V3, 3).is_none());
    }

    #[test]
    fn a_wal_outside_the_data_directory_cannot_be_opened_through_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path(), SEGMENT_LIMIT).unwrap();
        let conn = Connection::open_with_flags_and_vfs(
            elsewhere.path().join("stray.sqlite"),
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
            journal.vfs_name(),
        )
        .unwrap();
        let error = conn
            .execute_batch("PRAGMA journal_mode=WAL; CREATE TABLE t (x);")
            .unwrap_err();
        assert_eq!(
            error.sqlite_error_code(),
            Some(rusqlite::ErrorCode::CannotOpen),
            "{error}"
        );
    }
}
