//! Continuous archive of a host's data directory and restore at a moment
//! ([`ArchiveConfig`], [`crate::HostBuilder::archive`], [`restore_at`]).
//!
//! What is shipped: a *base*, a backup of every object taken with
//! [`crate::backup`], then every pass of the host journal as it becomes
//! durable (its `fdatasync` returned), as *chunks*: copies of the synced
//! bytes of a journal segment, with the moment each pass's sync returned.
//! Chunks are cut from the segment files on disk, not kept in memory, so
//! an archive that falls behind costs disk, not memory: the journal keeps
//! every segment not yet shipped whole ([`Shipping::may_delete`]).
//! Copying synced byte ranges rather than whole closed segments keeps the
//! archive at most one ship interval ([`DEFAULT_SHIP_INTERVAL`]) behind
//! the disk, where whole segments (256 MiB) could leave hours unshipped.
//!
//! The store is a local directory (`file:///path`) or S3-compatible
//! object storage (`s3://bucket/prefix`, see [`ArchiveLocation`]); both
//! hold the same files. Every file is put whole (see `store`), chunks and
//! bases before the manifest that names them.
//!
//! Layout of an archive root:
//!
//! ```text
//! archive.json                               the manifest: lives, bases, gaps
//! lives/<life>/bases/<started_ms>/           a backup (crate::backup's layout)
//! lives/<life>/passes/<seq>-<start>.passes   one chunk of segment <seq>
//! ```
//!
//! A *life* is one run of a host: its journal segments are numbered
//! within it. A restore at `T` takes the newest base finished at or before
//! `T`, then replays every pass of that life from where the journal stood
//! when the base began, up to the last pass whose sync returned at or
//! before `T`: it reads the WAL frames out of the records and writes each
//! committed transaction's pages into the object's file. Replaying a
//! transaction the base already holds is harmless, because every later
//! one is replayed too: each page ends as the last transaction left it.
//!
//! Gaps: passes a host synced but did not ship before it died are replayed
//! into the WALs by the next start and are not archived; the moments
//! between the last shipped pass and the next life's first base are then
//! recorded as a gap, and [`restore_at`] refuses them
//! ([`ArchiveError::InGap`]). A store that fails does not make a gap: the
//! host goes on serving, the journal keeps the unshipped segments, the
//! lag shows on [`crate::telemetry::ARCHIVE_LAG`], and shipping resumes.
//!
//! Not covered: a transaction larger than SQLite's page cache writes
//! (spills) frames before its commit; one that began spilling before its
//! life's archive began and committed after the base would be replayed
//! without its first frames. A host's start takes the base while it
//! serves; no such transaction can be under way then.

mod store;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{Read as _, Seek as _};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use durability_platform::EpochMs;
use rand::Rng as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::backup::{BackupError, Restore};
use crate::clock::system_now_ms as now_ms;
pub use store::ArchiveLocation;
use store::Store;

/// How long an archive keeps what it needs to restore any moment: 7 days.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// How often synced passes are shipped: at most this much of the journal
/// is waiting when the store keeps up.
pub const DEFAULT_SHIP_INTERVAL: Duration = Duration::from_secs(1);
/// How often a new base is taken: a restore replays at most this much
/// journal after its base.
pub const DEFAULT_BASE_INTERVAL: Duration = Duration::from_secs(24 * 3600);
/// The manifest at the archive's root.
pub const ARCHIVE_MANIFEST_FILE: &str = "archive.json";
/// The manifest format this release writes and reads.
pub const ARCHIVE_FORMAT: u32 = 1;
/// The most journal bytes one chunk holds (unless one pass is larger).
const CHUNK_MAX_BYTES: u64 = 16 << 20;
/// First bytes of a chunk file whose data is zstd-compressed (what this
/// release writes).
const CHUNK_MAGIC: [u8; 8] = *b"DARCHIV2";
/// First bytes of a chunk file whose data is stored as it is (the first
/// release's chunks; still read).
const CHUNK_MAGIC_RAW: [u8; 8] = *b"DARCHIV1";
/// One of zstd's fast levels: a journal pass is mostly SQLite pages, which
/// compress many times over even so (18 x on a `bench operations` chunk,
/// against 26 x at level 1), at about 3 GB/s where level 1 makes 2 GB/s:
/// compression is most of the archive's CPU, which competes with the
/// host's on a loaded machine.
const CHUNK_ZSTD_LEVEL: i32 = -3;

/// Where and how a host archives its data directory.
///
/// ```
/// use std::time::Duration;
/// use durability_host::archive::ArchiveConfig;
///
/// let config = ArchiveConfig::new("file:///var/backups/durability")?
///     .retention(Duration::from_secs(3 * 24 * 3600));
/// assert_eq!(config.url(), "file:///var/backups/durability");
///
/// // Credentials, region and endpoint from the AWS environment variables.
/// let to_s3 = ArchiveConfig::new("s3://my-bucket/hosts/eu-1")?;
/// assert_eq!(to_s3.url(), "s3://my-bucket/hosts/eu-1");
/// # Ok::<_, durability_host::archive::ArchiveError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveConfig {
    location: ArchiveLocation,
    retention: Duration,
    ship_interval: Duration,
    base_interval: Duration,
}

impl ArchiveConfig {
    /// An archive at `url`: `file:///absolute/path` (a local directory,
    /// made if missing) or `s3://bucket/prefix` (S3-compatible object
    /// storage; see [`ArchiveLocation::S3`] for the environment it reads).
    pub fn new(url: &str) -> Result<Self, ArchiveError> {
        let location = ArchiveLocation::parse(url)?;
        Ok(ArchiveConfig {
            location,
            retention: DEFAULT_RETENTION,
            ship_interval: DEFAULT_SHIP_INTERVAL,
            base_interval: DEFAULT_BASE_INTERVAL,
        })
    }

    /// How far back a restore can reach (at least). Default
    /// [`DEFAULT_RETENTION`]; must be greater than zero.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How often synced passes are shipped. Default
    /// [`DEFAULT_SHIP_INTERVAL`]; from 1 ms to 1 minute.
    pub fn ship_interval(mut self, interval: Duration) -> Self {
        self.ship_interval = interval;
        self
    }

    /// How often a new base is taken. Default [`DEFAULT_BASE_INTERVAL`];
    /// must be greater than zero.
    pub fn base_interval(mut self, interval: Duration) -> Self {
        self.base_interval = interval;
        self
    }

    /// Where the archive lives.
    pub fn location(&self) -> &ArchiveLocation {
        &self.location
    }

    /// The archive's URL.
    pub fn url(&self) -> String {
        self.location.url()
    }

    /// The setting that breaks a rule, if one does.
    pub(crate) fn invalid(&self) -> Option<(&'static str, &'static str)> {
        if self.retention.is_zero() {
            return Some(("archive retention", "must be greater than zero"));
        }
        if self.ship_interval.is_zero() || self.ship_interval > Duration::from_secs(60) {
            return Some(("archive ship_interval", "must be from 1 ms to 1 minute"));
        }
        if self.base_interval.is_zero() {
            return Some(("archive base_interval", "must be greater than zero"));
        }
        None
    }
}

/// Why an archive could not be written, read or restored.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// An archive URL breaks a rule.
    #[error("invalid archive URL {url:?}: {rule}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// A moment that does not parse.
    #[error("invalid time {value:?}: {rule}")]
    InvalidTime {
        /// The value as given.
        value: String,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// The object store failed or refused a request (after its retries),
    /// or its client could not be configured.
    #[error("{url}: {message}")]
    Store {
        /// The archive, or the file the request was for.
        url: String,
        /// What the store or its client said.
        message: String,
    },
    /// A file of the archive could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
    /// The path holds no archive manifest.
    #[error("{} is not an archive: it has no {ARCHIVE_MANIFEST_FILE}", path.display())]
    NotAnArchive {
        /// The path given.
        path: PathBuf,
    },
    /// The manifest does not parse or is of another format.
    #[error("{}: bad archive manifest: {message}", path.display())]
    BadManifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The moment lies before the oldest base the archive keeps.
    #[error(
        "cannot restore at {at_ms} ms: the archive reaches back to {earliest_ms:?} ms only (its oldest base; None: it holds none yet)"
    )]
    BeforeReach {
        /// The moment asked for, epoch ms.
        at_ms: EpochMs,
        /// The earliest moment it can restore (none: it holds no base).
        earliest_ms: Option<EpochMs>,
    },
    /// The moment lies after what the archive has shipped.
    #[error(
        "cannot restore at {at_ms} ms: the archive holds every change up to {through_ms} ms only"
    )]
    AfterReach {
        /// The moment asked for, epoch ms.
        at_ms: EpochMs,
        /// Every pass synced at or before it is archived.
        through_ms: EpochMs,
    },
    /// The moment lies inside a gap the archive recorded.
    #[error(
        "cannot restore at {at_ms} ms: the archive has a gap from {from_ms} ms to {to_ms} ms ({reason})"
    )]
    InGap {
        /// The moment asked for, epoch ms.
        at_ms: EpochMs,
        /// The gap's last restorable moment before it.
        from_ms: EpochMs,
        /// The gap's first restorable moment after it.
        to_ms: EpochMs,
        /// Why it exists.
        reason: String,
    },
    /// A chunk of journal passes is truncated, corrupted or missing.
    #[error("{}: damaged archive chunk: {rule}", file.display())]
    Damaged {
        /// The chunk file (for a missing one, the name it would have).
        file: PathBuf,
        /// What is wrong with it.
        rule: String,
    },
    /// A record in a chunk names a file that is not an object's WAL.
    #[error("{}: a record names {name:?}, which is not an object's WAL", file.display())]
    BadName {
        /// The chunk file.
        file: PathBuf,
        /// The name.
        name: String,
    },
    /// The base could not be restored.
    #[error("cannot restore the base {}", base.display())]
    Base {
        /// The base's directory.
        base: PathBuf,
        /// Why.
        #[source]
        source: Box<BackupError>,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ArchiveError + '_ {
    move |source| ArchiveError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Parses a moment: RFC 3339 (`2026-12-04T23:10:00.250Z`, offsets
/// allowed) or epoch milliseconds (`1796425800250`).
pub fn parse_time(value: &str) -> Result<EpochMs, ArchiveError> {
    let invalid = |rule: &'static str| ArchiveError::InvalidTime {
        value: value.to_owned(),
        rule,
    };
    let text = value.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text
            .parse::<EpochMs>()
            .ok()
            .filter(|ms| *ms <= durability_platform::MAX_SAFE_INTEGER)
            .ok_or_else(|| invalid("epoch milliseconds must be at most 2^53 - 1"));
    }
    let rfc3339 = "must be RFC 3339 (2026-12-04T23:10:00Z, optional fraction and offset) or epoch milliseconds";
    let at: jiff::Timestamp = text.parse().map_err(|_| invalid(rfc3339))?;
    Some(at.as_millisecond())
        .filter(|ms| (0..=durability_platform::MAX_SAFE_INTEGER).contains(ms))
        .ok_or_else(|| invalid("must lie between 1970 and 2^53 - 1 epoch milliseconds"))
}

/// A place in a life's journal: segment `seq`, byte `offset` (a pass
/// boundary).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Position {
    /// The segment's number.
    pub seq: u64,
    /// Bytes of the segment up to there.
    pub offset: u64,
}

/// The record of an archive: what `archive.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchiveManifest {
    /// [`ARCHIVE_FORMAT`] when this release wrote it.
    pub format: u32,
    /// The version of `durability-host` that last wrote it.
    pub host_version: String,
    /// Every run of a host archived here, oldest first.
    pub lives: Vec<Life>,
    /// Moments no restore can reach, oldest first.
    pub gaps: Vec<Gap>,
}

/// One run of a host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Life {
    /// Its directory under `lives/`.
    pub id: String,
    /// When it began shipping, epoch ms.
    pub started_ms: EpochMs,
    /// Its bases, oldest first.
    pub bases: Vec<Base>,
    /// Every pass synced at or before this moment is archived.
    pub through_ms: EpochMs,
    /// Where the chunks shipped so far end (none yet: `None`).
    pub shipped: Option<Position>,
    /// Whether it stopped with every pass shipped.
    pub closed: bool,
}

/// One base of a life.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Base {
    /// Its directory, relative to the archive root.
    pub dir: String,
    /// Where the journal's synced passes ended when it began (`None`: at
    /// the life's start): the passes after it are replayed over it.
    pub from: Option<Position>,
    /// When the copy began, epoch ms.
    pub started_ms: EpochMs,
    /// When the last object was copied: the earliest moment it restores.
    pub finished_ms: EpochMs,
}

/// Moments no restore can reach: `from_ms < T < to_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gap {
    /// The last restorable moment before it.
    pub from_ms: EpochMs,
    /// The first restorable moment after it.
    pub to_ms: EpochMs,
    /// Why it exists.
    pub reason: String,
}

/// An archive opened for reading: its manifest, a check of every file
/// ([`Archive::verify`]) and a restore at a moment ([`Archive::restore_at`]).
/// The free functions [`read_manifest`], [`verify`] and [`restore_at`] do
/// the same for a local directory.
pub struct Archive {
    store: Store,
}

impl Archive {
    /// Opens the archive at `location` (nothing is read yet).
    pub fn open(location: &ArchiveLocation) -> Result<Archive, ArchiveError> {
        Ok(Archive {
            store: Store::open(location)?,
        })
    }

    /// Opens the archive at `url` (`file:///dir` or `s3://bucket/prefix`).
    pub fn open_url(url: &str) -> Result<Archive, ArchiveError> {
        Archive::open(&ArchiveLocation::parse(url)?)
    }

    fn local(root: &Path) -> Archive {
        Archive {
            store: Store::Directory(root.to_path_buf()),
        }
    }

    /// Reads the archive's manifest.
    pub fn manifest(&self) -> Result<ArchiveManifest, ArchiveError> {
        load_manifest(&self.store)
    }

    /// The archive's URL (`file:///...` or `s3://bucket/prefix`).
    pub fn url(&self) -> String {
        self.store.url()
    }
}

impl ArchiveManifest {
    /// The earliest moment a restore can reach: its oldest base's end
    /// (`None`: it holds no base yet).
    pub fn earliest_ms(&self) -> Option<EpochMs> {
        self.lives
            .iter()
            .flat_map(|l| l.bases.iter().map(|b| b.finished_ms))
            .min()
    }

    /// The latest moment a restore can reach: every pass synced at or
    /// before it is archived (`None`: no base yet). Right after a life's
    /// first base it is earlier than [`ArchiveManifest::earliest_ms`]
    /// until the next shipment: nothing of that life is restorable yet.
    pub fn through_ms(&self) -> Option<EpochMs> {
        self.lives
            .iter()
            .filter(|l| !l.bases.is_empty())
            .map(|l| l.through_ms)
            .max()
    }

    /// Whether a host is (or was, until it died) shipping to it: its
    /// newest life did not stop with everything shipped.
    pub fn shipping(&self) -> bool {
        self.lives.last().is_some_and(|l| !l.closed)
    }

    /// How far the archive is behind at `now_ms`, as its manifest tells
    /// (a shipping host rewrites it every ship interval): zero when no
    /// host ships, else the time since [`ArchiveManifest::through_ms`].
    pub fn lag_ms(&self, now_ms: EpochMs) -> EpochMs {
        match self.lives.last() {
            Some(life) if !life.closed => now_ms.saturating_sub(life.through_ms).max(0),
            _ => 0,
        }
    }
}

fn load_manifest(store: &Store) -> Result<ArchiveManifest, ArchiveError> {
    let path = store.name(ARCHIVE_MANIFEST_FILE);
    let Some(text) = store.get(ARCHIVE_MANIFEST_FILE)? else {
        return Err(ArchiveError::NotAnArchive {
            path: store.name(""),
        });
    };
    let manifest: ArchiveManifest =
        serde_json::from_slice(&text).map_err(|e| ArchiveError::BadManifest {
            path: path.clone(),
            message: e.to_string(),
        })?;
    if manifest.format != ARCHIVE_FORMAT {
        return Err(ArchiveError::BadManifest {
            path,
            message: format!(
                "format {} (this release reads {ARCHIVE_FORMAT})",
                manifest.format
            ),
        });
    }
    Ok(manifest)
}

/// Reads the manifest of the archive in the local directory `root`.
pub fn read_manifest(root: impl AsRef<Path>) -> Result<ArchiveManifest, ArchiveError> {
    Archive::local(root.as_ref()).manifest()
}

/// Whether `path` holds an archive (its manifest).
pub fn is_archive(path: impl AsRef<Path>) -> bool {
    path.as_ref().join(ARCHIVE_MANIFEST_FILE).is_file()
}

// ---------------------------------------------------------------------------
// Shipping: what the journal tells the archiver.

/// Synced passes of one segment that share a millisecond.
#[derive(Debug, Clone)]
struct Mark {
    seq: u64,
    end: u64,
    time_ms: EpochMs,
}

#[derive(Default)]
struct ShipState {
    /// Synced passes not yet shipped, oldest first.
    marks: VecDeque<Mark>,
    /// The segment files with passes in `marks`, by number.
    segments: BTreeMap<u64, (PathBuf, u64)>,
    /// Where the journal's synced passes end.
    synced: Option<Position>,
    /// Where the chunks shipped so far end.
    shipped: Option<Position>,
    /// The time of the last mark (kept from going back with the clock).
    last_ms: EpochMs,
    stop: bool,
}

/// Shared by the journal (which reports every synced pass and asks before
/// deleting a segment) and the archiver thread (which ships them).
pub(crate) struct Shipping {
    state: Mutex<ShipState>,
    wake: Condvar,
}

impl Shipping {
    fn new() -> Arc<Shipping> {
        Arc::new(Shipping {
            state: Mutex::new(ShipState::default()),
            wake: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, ShipState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A pass of segment `seq` (file `path`, `nonce`) was synced; the
    /// segment's synced passes now end at `end`. Called by the journal
    /// under its segments' lock, right after the sync returned and before
    /// any reply that waited on it is released.
    pub(crate) fn synced(&self, seq: u64, nonce: u64, path: &Path, end: u64) {
        let mut state = self.lock();
        let time_ms = now_ms().max(state.last_ms);
        state.last_ms = time_ms;
        state.synced = Some(Position { seq, offset: end });
        state
            .segments
            .entry(seq)
            .or_insert_with(|| (path.to_path_buf(), nonce));
        match state.marks.back_mut() {
            Some(last) if last.seq == seq && last.time_ms == time_ms => last.end = end,
            _ => state.marks.push_back(Mark { seq, end, time_ms }),
        }
    }

    /// Whether segment `seq` may be deleted: every pass of it is shipped.
    pub(crate) fn may_delete(&self, seq: u64) -> bool {
        self.lock().marks.front().is_none_or(|m| m.seq > seq)
    }
}

// ---------------------------------------------------------------------------
// The archiver.

/// Runs the shipping of one host; [`Archiver::finish`] ships what is left
/// and stops it.
pub(crate) struct Archiver {
    shipping: Arc<Shipping>,
    done: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

impl Archiver {
    /// Starts shipping `data_dir` to `config`'s archive. The journal must
    /// report to [`Archiver::shipping`] before any object is opened.
    pub(crate) fn start(config: ArchiveConfig, data_dir: &Path) -> Result<Archiver, ArchiveError> {
        let store = Store::open(&config.location)?;
        let config_url = config.url();
        let shipping = Shipping::new();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut worker = Worker {
            store,
            config,
            data_dir: data_dir.to_path_buf(),
            shipping: Arc::clone(&shipping),
            manifest: None,
            life: format!("{}-{:08x}", now_ms(), rand::rng().random::<u32>()),
            started_ms: now_ms(),
            last_base_ms: None,
            chunk_end: None,
            read_buf: Vec::new(),
            compressor: None,
        };
        std::thread::Builder::new()
            .name("durability-archive".into())
            .spawn(move || {
                worker.run();
                let _ = tx.send(());
            })
            .map_err(|e| ArchiveError::Store {
                url: config_url.clone(),
                message: format!("cannot start the archive thread: {e}"),
            })?;
        Ok(Archiver {
            shipping,
            done: Mutex::new(Some(rx)),
        })
    }

    /// How long the oldest synced pass not yet shipped has waited (zero
    /// when the archive is caught up).
    pub(crate) fn lag(&self) -> Duration {
        let state = self.shipping.lock();
        let ms = state
            .marks
            .front()
            .map_or(0, |m| now_ms().saturating_sub(m.time_ms).max(1));
        Duration::from_millis(u64::try_from(ms).unwrap_or(0))
    }

    pub(crate) fn shipping(&self) -> Arc<Shipping> {
        Arc::clone(&self.shipping)
    }

    /// Ships what is synced and stops, waiting up to `grace`. Call after
    /// the last flush. What could not be shipped stays in the journal's
    /// segments (and becomes a gap at the next start).
    pub(crate) fn finish(&self, grace: Duration) {
        self.shipping.lock().stop = true;
        self.shipping.wake.notify_all();
        let rx = self.done.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(rx) = rx
            && rx.recv_timeout(grace).is_err()
        {
            tracing::warn!(
                "the archive did not ship everything before shutdown; the journal keeps what is left"
            );
        }
    }
}

impl Drop for Archiver {
    fn drop(&mut self) {
        self.shipping.lock().stop = true;
        self.shipping.wake.notify_all();
    }
}

struct Worker {
    store: Store,
    config: ArchiveConfig,
    data_dir: PathBuf,
    shipping: Arc<Shipping>,
    /// Loaded (and this life added) once the store answers.
    manifest: Option<ArchiveManifest>,
    life: String,
    started_ms: EpochMs,
    last_base_ms: Option<EpochMs>,
    /// Where the last chunk this life shipped ends.
    chunk_end: Option<Position>,
    /// The synced bytes of the chunk being shipped (kept: see ship_chunk).
    read_buf: Vec<u8>,
    /// zstd's context, made at the first chunk.
    compressor: Option<zstd::bulk::Compressor<'static>>,
}

/// A failure of one cycle: logged, counted in the lag, tried again.
type Cycle = Result<(), ArchiveError>;

impl Worker {
    fn run(&mut self) {
        loop {
            let stop = {
                let state = self.shipping.lock();
                let (state, _) = self
                    .shipping
                    .wake
                    .wait_timeout_while(state, self.config.ship_interval, |s| !s.stop)
                    .unwrap_or_else(|e| e.into_inner());
                state.stop
            };
            let result = self.cycle(stop);
            self.report_lag();
            match result {
                Ok(()) if stop => return,
                Ok(()) => {}
                Err(error) => {
                    tracing::warn!(%error, "the archive could not ship; the journal keeps what is not shipped and it is tried again");
                    if stop {
                        return;
                    }
                }
            }
        }
    }

    fn report_lag(&self) {
        let state = self.shipping.lock();
        let lag_ms = state
            .marks
            .front()
            .map_or(0, |m| now_ms().saturating_sub(m.time_ms).max(1));
        crate::telemetry::archive_lag(lag_ms);
    }

    fn life_mut(&mut self) -> Option<&mut Life> {
        let id = self.life.clone();
        self.manifest
            .as_mut()?
            .lives
            .iter_mut()
            .find(|life| life.id == id)
    }

    fn cycle(&mut self, stopping: bool) -> Cycle {
        if self.manifest.is_none() {
            self.load()?;
        }
        let (marks, segments, through_ms) = {
            let state = self.shipping.lock();
            (
                state.marks.iter().cloned().collect::<Vec<_>>(),
                state.segments.clone(),
                // A pass synced after this snapshot takes this
                // millisecond or a later one: only the earlier ones are
                // surely all in it.
                now_ms().max(state.last_ms) - 1,
            )
        };
        let mut from = 0;
        while from < marks.len() {
            let seq = marks[from].seq;
            let to = marks[from..]
                .iter()
                .position(|m| m.seq != seq)
                .map_or(marks.len(), |n| from + n);
            let Some((path, nonce)) = segments.get(&seq) else {
                from = to;
                continue;
            };
            // At most CHUNK_MAX_BYTES a chunk (but one pass at least): an
            // archive catching up after an outage ships a segment in
            // pieces, in memory bounded however far behind it fell.
            let mut start = match self.chunk_end {
                Some(end) if end.seq == seq => end.offset,
                _ => 0,
            };
            let mut first = from;
            while first < to {
                let mut last = first + 1;
                while last < to && marks[last].end.saturating_sub(start) <= CHUNK_MAX_BYTES {
                    last += 1;
                }
                self.ship_chunk(seq, *nonce, path, &marks[first..last])?;
                start = marks[last - 1].end;
                first = last;
            }
            from = to;
        }
        let shipped = self.chunk_end;
        if let Some(life) = self.life_mut() {
            life.through_ms = through_ms;
            life.shipped = shipped;
            life.closed = stopping;
        }
        self.write_manifest()?;
        let due = self
            .last_base_ms
            .is_none_or(|at| now_ms().saturating_sub(at) >= duration_ms(self.config.base_interval));
        // A host that stops before its first base would leave a life no
        // restore can start from: it takes one on its way out (the last
        // flush is done, so the base holds everything it shipped).
        if due && (!stopping || self.last_base_ms.is_none()) {
            self.take_base()?;
            if stopping {
                // Nothing commits after the last flush: the life reaches
                // the end of that base too.
                let finished = self.last_base_ms;
                if let (Some(finished), Some(life)) = (finished, self.life_mut()) {
                    life.through_ms = life.through_ms.max(finished);
                }
                self.write_manifest()?;
            }
        }
        Ok(())
    }

    /// Reads the manifest (or starts one) and adds this life.
    fn load(&mut self) -> Cycle {
        self.store.prepare()?;
        let removed = self.store.remove_leftovers()?;
        if removed > 0 {
            tracing::info!(
                removed,
                "removed the half-written files an earlier host left in the archive"
            );
        }
        let mut manifest = match load_manifest(&self.store) {
            Ok(manifest) => manifest,
            Err(ArchiveError::NotAnArchive { .. }) => ArchiveManifest {
                format: ARCHIVE_FORMAT,
                host_version: String::new(),
                lives: Vec::new(),
                gaps: Vec::new(),
            },
            Err(error) => return Err(error),
        };
        manifest.host_version = env!("CARGO_PKG_VERSION").to_owned();
        // A life that stopped with everything shipped reaches until this
        // one began: nothing changed while no host ran.
        if let Some(last) = manifest.lives.last_mut()
            && last.closed
        {
            last.through_ms = last.through_ms.max(self.started_ms);
        }
        // A new object's file starts as a copy of these bytes, which no
        // WAL write carries: a restore starts an object missing from its
        // base from them.
        if let Some(bytes) = crate::storage::new_object_bytes(&self.data_dir) {
            self.store.put(&new_object_rel(&self.life), bytes)?;
        }
        manifest.lives.push(Life {
            id: self.life.clone(),
            started_ms: self.started_ms,
            bases: Vec::new(),
            through_ms: self.started_ms,
            shipped: None,
            closed: false,
        });
        self.manifest = Some(manifest);
        Ok(())
    }

    fn write_manifest(&self) -> Cycle {
        let Some(manifest) = &self.manifest else {
            return Ok(());
        };
        let text = serde_json::to_vec_pretty(manifest).map_err(|e| ArchiveError::BadManifest {
            path: self.store.name(ARCHIVE_MANIFEST_FILE),
            message: e.to_string(),
        })?;
        self.store.put(ARCHIVE_MANIFEST_FILE, text)
    }

    /// Ships the synced bytes of segment `seq` that `marks` cover.
    fn ship_chunk(&mut self, seq: u64, nonce: u64, path: &Path, marks: &[Mark]) -> Cycle {
        let start = match self.chunk_end {
            Some(end) if end.seq == seq => end.offset,
            _ => 0,
        };
        let Some(end) = marks.last().map(|m| m.end) else {
            return Ok(());
        };
        if end <= start {
            self.shipped(seq, end);
            return Ok(());
        }
        // Into a buffer kept from cycle to cycle, without zeroing it
        // first: a fresh one each second would page-fault in every byte
        // the journal synced (the archive's largest cost, measured).
        self.read_buf.clear();
        let read = File::open(path).and_then(|mut file| {
            file.seek(std::io::SeekFrom::Start(start))?;
            file.take(end - start).read_to_end(&mut self.read_buf)
        });
        match read {
            Ok(n) if n as u64 == end - start => {}
            Ok(n) => {
                return Err(io(path)(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("{n} of the {} synced bytes from {start} read", end - start),
                )));
            }
            Err(error) => return Err(io(path)(error)),
        }
        let chunk = encode_chunk(
            &mut self.compressor,
            &ChunkHeader {
                seq,
                nonce,
                start,
                end,
                prev: self.chunk_end,
                marks: marks.iter().map(|m| (m.end, m.time_ms)).collect(),
            },
            &self.read_buf,
        );
        self.store.put(&self.chunk_name(seq, start), chunk)?;
        self.chunk_end = Some(Position { seq, offset: end });
        self.shipped(seq, end);
        Ok(())
    }

    /// Passes of `seq` through `end` are shipped: the journal may let
    /// their segment go once nothing of it waits.
    fn shipped(&self, seq: u64, end: u64) {
        let mut state = self.shipping.lock();
        while state
            .marks
            .front()
            .is_some_and(|m| m.seq < seq || (m.seq == seq && m.end <= end))
        {
            state.marks.pop_front();
        }
        state.shipped = Some(Position { seq, offset: end });
        let oldest = state.marks.front().map_or(seq, |m| m.seq);
        state.segments.retain(|&s, _| s >= oldest);
    }

    fn chunk_name(&self, seq: u64, start: u64) -> String {
        chunk_rel(&self.life, seq, start)
    }

    /// Takes a base into `lives/<life>/bases/<ms>` and records it.
    fn take_base(&mut self) -> Cycle {
        let from = self.shipping.lock().synced;
        let started_ms = now_ms();
        let rel = format!("lives/{}/bases/{started_ms}", self.life);
        let failed = |dest: &Path| {
            let base = dest.to_path_buf();
            move |source| ArchiveError::Base {
                base,
                source: Box::new(source),
            }
        };
        let report = match self.store.directory() {
            // A local archive takes the backup in place: it is written
            // under a temporary name and renamed whole.
            Some(root) => {
                let dest = root.join(&rel);
                crate::backup::backup_files(&self.data_dir, &dest).map_err(failed(&dest))?
            }
            // Object storage: the backup is staged in the temporary
            // directory (TMPDIR), then put file by file, its manifest
            // last; the archive's manifest names it only after that.
            None => {
                let staging = tempfile::Builder::new()
                    .prefix("durability-archive-base-")
                    .tempdir()
                    .map_err(io(&std::env::temp_dir()))?;
                let dest = staging.path().join("base");
                let report =
                    crate::backup::backup_files(&self.data_dir, &dest).map_err(failed(&dest))?;
                self.store
                    .put_tree(&rel, &dest, crate::backup::MANIFEST_FILE)?;
                report
            }
        };
        let finished_ms = report.manifest.finished_ms.max(started_ms);
        self.last_base_ms = Some(finished_ms);
        let life_id = self.life.clone();
        if let Some(manifest) = self.manifest.as_mut() {
            let first_of_life = manifest
                .lives
                .iter()
                .find(|l| l.id == life_id)
                .is_some_and(|l| l.bases.is_empty());
            let reach_before = manifest
                .lives
                .iter()
                .filter(|l| l.id != life_id && !l.bases.is_empty())
                .map(|l| l.through_ms)
                .max();
            if first_of_life && let Some(from_ms) = reach_before {
                manifest.gaps.push(Gap {
                    from_ms,
                    to_ms: finished_ms,
                    reason: "between two lives of the host: passes its last one did not ship, its start and the new base".into(),
                });
            }
            if let Some(life) = manifest.lives.iter_mut().find(|l| l.id == life_id) {
                life.bases.push(Base {
                    dir: rel,
                    from,
                    started_ms,
                    finished_ms,
                });
            }
        }
        self.write_manifest()?;
        self.retain()
    }

    /// Drops what no restore within the retention needs: bases older than
    /// the newest one before the retention's start, their lives' earlier
    /// chunks, and lives left without a base (but this one).
    fn retain(&mut self) -> Cycle {
        let cutoff = now_ms().saturating_sub(duration_ms(self.config.retention));
        let Some(manifest) = self.manifest.as_mut() else {
            return Ok(());
        };
        let mut finished: Vec<EpochMs> = manifest
            .lives
            .iter()
            .flat_map(|l| l.bases.iter().map(|b| b.finished_ms))
            .collect();
        finished.sort_unstable();
        let keep_from = finished
            .iter()
            .rev()
            .find(|&&ms| ms <= cutoff)
            .copied()
            .unwrap_or(EpochMs::MIN);
        let mut doomed_dirs = Vec::new();
        let mut trims = Vec::new();
        for life in &mut manifest.lives {
            let (keep, drop): (Vec<Base>, Vec<Base>) = life
                .bases
                .drain(..)
                .partition(|b| b.finished_ms >= keep_from);
            doomed_dirs.extend(drop.into_iter().map(|b| b.dir));
            life.bases = keep;
            if let Some(first) = life.bases.first() {
                trims.push((life.id.clone(), first.from));
            }
        }
        let current = self.life.clone();
        manifest.lives.retain(|life| {
            let keep = !life.bases.is_empty() || life.id == current;
            if !keep {
                doomed_dirs.push(format!("lives/{}", life.id));
            }
            keep
        });
        let earliest = manifest
            .lives
            .iter()
            .filter_map(|l| l.bases.first().map(|b| b.finished_ms))
            .min();
        manifest
            .gaps
            .retain(|gap| earliest.is_some_and(|e| gap.to_ms > e));
        self.write_manifest()?;
        for dir in doomed_dirs {
            self.store.delete_tree(&dir)?;
        }
        for (life, from) in trims {
            trim_chunks(&self.store, &life, from)?;
        }
        Ok(())
    }
}

fn duration_ms(d: Duration) -> EpochMs {
    EpochMs::try_from(d.as_millis()).unwrap_or(EpochMs::MAX)
}

fn new_object_rel(life: &str) -> String {
    format!("lives/{life}/new-object.sqlite")
}

fn chunk_rel(life: &str, seq: u64, start: u64) -> String {
    format!("lives/{life}/passes/{seq:020}-{start:020}.passes")
}

/// Deletes the chunks of `life` that a restore from a base beginning at
/// `from` does not read: all but the one holding `from`, the one before
/// it (see [`replay_life`]) and the later ones.
fn trim_chunks(store: &Store, life: &str, from: Option<Position>) -> Cycle {
    let Some(from) = from else {
        return Ok(());
    };
    let chunks = list_chunks(store, life)?;
    for three in chunks.windows(3) {
        if let [(_, rel), _, (after_next, _)] = three
            && *after_next <= from
        {
            store.delete(rel)?;
        }
    }
    Ok(())
}

/// The chunk files of `life` (their names relative to the archive root),
/// by position.
fn list_chunks(store: &Store, life: &str) -> Result<Vec<(Position, String)>, ArchiveError> {
    let dir = format!("lives/{life}/passes");
    let mut chunks = Vec::new();
    for name in store.list(&dir)? {
        let Some((seq, start)) = name.strip_suffix(".passes").and_then(|n| n.split_once('-'))
        else {
            continue;
        };
        if let (Ok(seq), Ok(offset)) = (seq.parse(), start.parse()) {
            chunks.push((Position { seq, offset }, format!("{dir}/{name}")));
        }
    }
    chunks.sort();
    Ok(chunks)
}

// ---------------------------------------------------------------------------
// Chunk files.

/// What a chunk says of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ChunkHeader {
    seq: u64,
    nonce: u64,
    start: u64,
    end: u64,
    /// Where the chunk before it in its life ended (`None`: the first).
    prev: Option<Position>,
    /// `(end, time_ms)`: the passes ending at or before `end` (and after
    /// the mark before) were synced in millisecond `time_ms`.
    marks: Vec<(u64, EpochMs)>,
}

/// Magic, the header's fields, the data compressed, a SHA-256 of all
/// before it (of the bytes as stored: a damaged chunk is refused before
/// anything decompresses it). `compressor` is kept between chunks, so
/// its context is allocated once.
fn encode_chunk(
    compressor: &mut Option<zstd::bulk::Compressor<'static>>,
    header: &ChunkHeader,
    data: &[u8],
) -> Vec<u8> {
    if compressor.is_none() {
        *compressor = zstd::bulk::Compressor::new(CHUNK_ZSTD_LEVEL).ok();
    }
    match compressor.as_mut().map(|c| c.compress(data)) {
        Some(Ok(compressed)) => encode_chunk_as(CHUNK_MAGIC, header, &compressed),
        // Only an allocation failure of the compressor gets here: the
        // chunk is then stored as it is, which every release reads.
        _ => encode_chunk_as(CHUNK_MAGIC_RAW, header, data),
    }
}

fn encode_chunk_as(magic: [u8; 8], header: &ChunkHeader, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 96 + header.marks.len() * 16);
    out.extend_from_slice(&magic);
    for n in [header.seq, header.nonce, header.start, header.end] {
        out.extend_from_slice(&n.to_le_bytes());
    }
    let (has_prev, prev) = header
        .prev
        .map_or((0u64, Position { seq: 0, offset: 0 }), |p| (1, p));
    for n in [has_prev, prev.seq, prev.offset, header.marks.len() as u64] {
        out.extend_from_slice(&n.to_le_bytes());
    }
    for (end, time) in &header.marks {
        out.extend_from_slice(&end.to_le_bytes());
        out.extend_from_slice(&time.to_le_bytes());
    }
    out.extend_from_slice(data);
    let digest = Sha256::digest(&out);
    out.extend_from_slice(&digest);
    out
}

/// Reads a chunk back, refusing one whose checksum, length or fields do
/// not hold.
fn decode_chunk(file: &Path, bytes: &[u8]) -> Result<(ChunkHeader, Vec<u8>), ArchiveError> {
    let damaged = |rule: &str| ArchiveError::Damaged {
        file: file.to_path_buf(),
        rule: rule.to_owned(),
    };
    let body_len = bytes
        .len()
        .checked_sub(32)
        .ok_or_else(|| damaged("shorter than its checksum (truncated)"))?;
    let (body, digest) = bytes.split_at(body_len);
    if Sha256::digest(body).as_slice() != digest {
        return Err(damaged(
            "its SHA-256 does not match (truncated or corrupted)",
        ));
    }
    let compressed = match body.get(..8) {
        Some(magic) if magic == CHUNK_MAGIC => true,
        Some(magic) if magic == CHUNK_MAGIC_RAW => false,
        _ => return Err(damaged("does not start with the chunk magic")),
    };
    let mut at = 8;
    let mut next = || -> Result<u64, ArchiveError> {
        let field = body
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| damaged("its header is cut short"))?;
        at += 8;
        Ok(field)
    };
    let (seq, nonce, start, end) = (next()?, next()?, next()?, next()?);
    let (has_prev, prev_seq, prev_offset, count) = (next()?, next()?, next()?, next()?);
    let count = usize::try_from(count).map_err(|_| damaged("too many marks"))?;
    if count > body.len() / 16 {
        return Err(damaged("more marks than bytes"));
    }
    let mut marks = Vec::with_capacity(count);
    for _ in 0..count {
        let end = next()?;
        let time = next()?;
        marks.push((end, EpochMs::from_le_bytes(time.to_le_bytes())));
    }
    let stored = body.get(at..).unwrap_or_default();
    let len = end
        .checked_sub(start)
        .and_then(|len| usize::try_from(len).ok())
        .ok_or_else(|| damaged("its header's end lies before its start"))?;
    let data = if compressed {
        // At most the length the header gives: a chunk cannot make the
        // restore allocate more than it says it holds.
        zstd::bulk::decompress(stored, len)
            .map_err(|e| damaged(&format!("its data does not decompress: {e}")))?
    } else {
        stored.to_vec()
    };
    if data.len() != len {
        return Err(damaged("its data is not as long as its header says"));
    }
    if marks.last().map(|m| m.0) != Some(end) || marks.windows(2).any(|w| w[0].0 >= w[1].0) {
        return Err(damaged("its pass marks are out of order"));
    }
    Ok((
        ChunkHeader {
            seq,
            nonce,
            start,
            end,
            prev: (has_prev == 1).then_some(Position {
                seq: prev_seq,
                offset: prev_offset,
            }),
            marks,
        },
        data,
    ))
}

// ---------------------------------------------------------------------------
// Restore at a moment.

/// What a restore at a moment did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PointInTimeReport {
    /// The data directory written.
    pub data_dir: PathBuf,
    /// The moment restored, epoch ms.
    pub at_ms: EpochMs,
    /// The base it started from (its directory).
    pub base: PathBuf,
    /// Objects in the restored directory.
    pub objects: u64,
    /// Journal passes replayed over the base.
    pub passes: u64,
    /// Transactions replayed over the base.
    pub transactions: u64,
    /// Chunk files read.
    pub chunks: u64,
    /// How long it took.
    pub elapsed: Duration,
}

/// Restores the archive in the local directory `root` into `data_dir`:
/// [`Archive::restore_at`].
pub fn restore_at(
    root: impl AsRef<Path>,
    data_dir: impl AsRef<Path>,
    at_ms: EpochMs,
) -> Result<PointInTimeReport, ArchiveError> {
    Archive::local(root.as_ref()).restore_at(data_dir, at_ms)
}

/// Checks every file of the archive in the local directory `root`:
/// [`Archive::verify`].
pub fn verify(root: impl AsRef<Path>) -> Result<ArchiveVerifyReport, ArchiveError> {
    Archive::local(root.as_ref()).verify()
}

/// What a verification of an archive checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveVerifyReport {
    /// Lives of a host in the archive.
    pub lives: u64,
    /// Bases verified (each as [`crate::backup::verify`] does).
    pub bases: u64,
    /// Object copies in those bases.
    pub objects: u64,
    /// Chunk files read and checked.
    pub chunks: u64,
    /// Bytes of journal passes in those chunks.
    pub bytes: u64,
}

/// A base where the restore or the check can read it: the archive's own
/// directory, or a local copy of one in object storage (removed on drop).
struct LocalBase {
    dir: PathBuf,
    _staging: Option<tempfile::TempDir>,
}

impl Archive {
    fn local_base(&self, base: &Base) -> Result<LocalBase, ArchiveError> {
        if let Some(root) = self.store.directory() {
            return Ok(LocalBase {
                dir: root.join(&base.dir),
                _staging: None,
            });
        }
        let staging = tempfile::Builder::new()
            .prefix("durability-archive-base-")
            .tempdir()
            .map_err(io(&std::env::temp_dir()))?;
        let dir = staging.path().join("base");
        self.store.get_tree(&base.dir, &dir)?;
        Ok(LocalBase {
            dir,
            _staging: Some(staging),
        })
    }

    /// Restores the archive into `data_dir` (which must not exist or be
    /// empty, as for [`crate::backup::restore`]) as it stood at `at_ms`:
    /// every transaction whose journal pass was synced at or before it,
    /// and no later one.
    ///
    /// Refuses a moment before the oldest base
    /// ([`ArchiveError::BeforeReach`]), after the last shipped pass
    /// ([`ArchiveError::AfterReach`]), inside a recorded gap
    /// ([`ArchiveError::InGap`]), and a chunk that is truncated, corrupted
    /// or missing ([`ArchiveError::Damaged`], naming the file); nothing is
    /// left in `data_dir` then. A base in object storage is first copied
    /// to the temporary directory (TMPDIR).
    pub fn restore_at(
        &self,
        data_dir: impl AsRef<Path>,
        at_ms: EpochMs,
    ) -> Result<PointInTimeReport, ArchiveError> {
        let started = std::time::Instant::now();
        let data_dir = data_dir.as_ref();
        let manifest = self.manifest()?;
        if let Some(gap) = manifest
            .gaps
            .iter()
            .find(|g| g.from_ms < at_ms && at_ms < g.to_ms)
        {
            return Err(ArchiveError::InGap {
                at_ms,
                from_ms: gap.from_ms,
                to_ms: gap.to_ms,
                reason: gap.reason.clone(),
            });
        }
        let chosen = manifest
            .lives
            .iter()
            .flat_map(|life| life.bases.iter().map(move |base| (life, base)))
            .filter(|(_, base)| base.finished_ms <= at_ms)
            .max_by_key(|(_, base)| base.finished_ms);
        let Some((life, base)) = chosen else {
            return Err(ArchiveError::BeforeReach {
                at_ms,
                earliest_ms: manifest.earliest_ms(),
            });
        };
        if at_ms > life.through_ms {
            return Err(ArchiveError::AfterReach {
                at_ms,
                through_ms: life.through_ms,
            });
        }
        let local = self.local_base(base)?;
        let mut counts = (0u64, 0u64, 0u64);
        let mut failure: Option<ArchiveError> = None;
        let restored = crate::backup::restore_then(&local.dir, data_dir, &Restore::all(), |into| {
            match replay_life(&self.store, life, base.from, at_ms, into) {
                Ok(done) => {
                    counts = done;
                    Ok(())
                }
                Err(error) => {
                    failure = Some(error);
                    Err(BackupError::Aborted)
                }
            }
        });
        let report = match (restored, failure) {
            (_, Some(error)) => return Err(error),
            (Err(source), None) => {
                return Err(ArchiveError::Base {
                    base: self.store.name(&base.dir),
                    source: Box::new(source),
                });
            }
            (Ok(report), None) => report,
        };
        let objects = crate::index::object_files(data_dir)
            .map(|files| files.len() as u64)
            .unwrap_or(report.objects);
        Ok(PointInTimeReport {
            data_dir: data_dir.to_path_buf(),
            at_ms,
            base: self.store.name(&base.dir),
            objects,
            passes: counts.0,
            transactions: counts.1,
            chunks: counts.2,
            elapsed: started.elapsed(),
        })
    }

    /// Checks every file the archive's manifest relies on: each base as
    /// [`crate::backup::verify`] does (sizes, SHA-256 sums, `PRAGMA
    /// integrity_check`), and each chunk's checksum, header and journal
    /// passes, that the chunks of a life follow one another without a
    /// hole from what its oldest base needs to where the manifest says
    /// they reach. Refuses the first bad file with a typed error naming
    /// it ([`ArchiveError::Damaged`], [`ArchiveError::Base`]).
    pub fn verify(&self) -> Result<ArchiveVerifyReport, ArchiveError> {
        let manifest = self.manifest()?;
        let mut report = ArchiveVerifyReport {
            lives: manifest.lives.len() as u64,
            bases: 0,
            objects: 0,
            chunks: 0,
            bytes: 0,
        };
        for life in &manifest.lives {
            for base in &life.bases {
                let local = self.local_base(base)?;
                let checked =
                    crate::backup::verify(&local.dir).map_err(|source| ArchiveError::Base {
                        base: self.store.name(&base.dir),
                        source: Box::new(source),
                    })?;
                report.bases += 1;
                report.objects += checked.objects;
            }
            let chunks = list_chunks(&self.store, &life.id)?;
            let needed_from = life.bases.first().and_then(|b| b.from);
            let mut prev_end: Option<Position> = None;
            for (key, rel) in &chunks {
                let (header, data) = read_chunk(&self.store, life, *key, rel, prev_end)?;
                if prev_end.is_none()
                    && !life.bases.is_empty()
                    && needed_from.is_none_or(|from| *key > from)
                    && header.prev.is_some()
                {
                    return Err(ArchiveError::Damaged {
                        file: self.store.name(rel),
                        rule: "the chunks before it, which its oldest base needs, are missing"
                            .into(),
                    });
                }
                if let Err(at) = crate::journal::archived_passes(&data, header.nonce, |_| true) {
                    return Err(ArchiveError::Damaged {
                        file: self.store.name(rel),
                        rule: format!("no whole journal pass at byte {at} of its data"),
                    });
                }
                report.chunks += 1;
                report.bytes += data.len() as u64;
                prev_end = Some(Position {
                    seq: header.seq,
                    offset: header.end,
                });
            }
            if let Some(shipped) = life.shipped
                && prev_end.is_none_or(|end| end < shipped)
            {
                return Err(missing_after(&self.store, life, prev_end, shipped));
            }
        }
        Ok(report)
    }
}

/// Reads chunk `rel` of `life` at `key` and checks it: checksum, header,
/// the name it is stored under, and that it follows the chunk that ended
/// at `prev_end`.
fn read_chunk(
    store: &Store,
    life: &Life,
    key: Position,
    rel: &str,
    prev_end: Option<Position>,
) -> Result<(ChunkHeader, Vec<u8>), ArchiveError> {
    let file = store.name(rel);
    let bytes = store.get(rel)?.ok_or_else(|| ArchiveError::Damaged {
        file: file.clone(),
        rule: "listed, then missing when read".into(),
    })?;
    let (header, data) = decode_chunk(&file, &bytes)?;
    if header.seq != key.seq || header.start != key.offset {
        return Err(ArchiveError::Damaged {
            file,
            rule: "its header names another place than its file name".into(),
        });
    }
    if let Some(prev) = prev_end
        && header.prev != Some(prev)
    {
        return Err(ArchiveError::Damaged {
            file: store.name(&chunk_rel(&life.id, prev.seq, prev.offset)),
            rule: "missing: the chunk after it does not follow the one before".into(),
        });
    }
    Ok((header, data))
}

/// The refusal of a life whose chunks end at `end`, before `shipped`
/// where its manifest says they reach.
fn missing_after(
    store: &Store,
    life: &Life,
    end: Option<Position>,
    shipped: Position,
) -> ArchiveError {
    let next = end.unwrap_or(Position { seq: 0, offset: 0 });
    ArchiveError::Damaged {
        file: store.name(&chunk_rel(&life.id, next.seq, next.offset)),
        rule: format!(
            "missing: the manifest says chunks reach segment {} byte {}",
            shipped.seq, shipped.offset
        ),
    }
}

/// Replays the chunks of `life` from `from` into the object files under
/// `into`, up to the last pass synced at or before `at_ms`. Returns
/// (passes, transactions, chunks).
fn replay_life(
    store: &Store,
    life: &Life,
    from: Option<Position>,
    at_ms: EpochMs,
    into: &Path,
) -> Result<(u64, u64, u64), ArchiveError> {
    let chunks = list_chunks(store, &life.id)?;
    // The chunk before the one holding `from` (or the first): a commit
    // whose frames were being written when the base began has its first
    // frames there (a commit's frames are written in one go, well within
    // a ship interval). Replaying passes the base already holds is
    // harmless.
    let first = match from {
        None => 0,
        Some(from) => chunks
            .iter()
            .rposition(|(key, _)| *key <= from)
            .map_or(0, |n| n.saturating_sub(1)),
    };
    let template = store.get(&new_object_rel(&life.id))?;
    let mut pages = Pages::new(into, template);
    let (mut passes, mut chunks_read) = (0u64, 0u64);
    let mut prev_end: Option<Position> = None;
    let mut reached = false;
    for (key, rel) in chunks.iter().skip(first) {
        let (header, data) = read_chunk(store, life, *key, rel, prev_end)?;
        let path = store.name(rel);
        if prev_end.is_none() && first == 0 && from.is_some_and(|f| *key > f) {
            return Err(ArchiveError::Damaged {
                file: path,
                rule: "the chunks before it, which its base needs, are missing".into(),
            });
        }
        chunks_read += 1;
        prev_end = Some(Position {
            seq: header.seq,
            offset: header.end,
        });
        let stop = pages.replay_chunk(&path, &header, &data, at_ms, &mut passes)?;
        if stop {
            reached = true;
            break;
        }
    }
    if !reached
        && let Some(shipped) = life.shipped
        && prev_end.is_none_or(|e| e < shipped)
    {
        return Err(missing_after(store, life, prev_end, shipped));
    }
    let transactions = pages.transactions;
    pages.finish()?;
    Ok((passes, transactions, chunks_read))
}

/// The WAL of one object as its records are replayed: the frames of the
/// transaction under way.
struct WalReplay {
    db: PathBuf,
    page_size: Option<u64>,
    /// Where the transaction under way starts in the WAL.
    txn_start: Option<u64>,
    /// Its bytes from `txn_start`.
    buf: Vec<u8>,
    /// How many of them, from the first, were written (a frame is whole
    /// once they cover it).
    filled: usize,
}

/// Writes committed transactions' pages into object files.
struct Pages {
    into: PathBuf,
    wals: HashMap<Vec<u8>, WalReplay>,
    files: HashMap<PathBuf, File>,
    touched: Vec<PathBuf>,
    transactions: u64,
    /// What a new object's file starts as (see [`new_object_rel`]).
    template: Option<Vec<u8>>,
}

/// A WAL's header, and each frame's header before its page.
const WAL_HEADER_BYTES: u64 = 32;
const FRAME_HEADER_BYTES: u64 = 24;
/// Object files kept open at once while replaying.
const OPEN_FILES: usize = 64;

impl Pages {
    fn new(into: &Path, template: Option<Vec<u8>>) -> Pages {
        Pages {
            into: into.to_path_buf(),
            wals: HashMap::new(),
            files: HashMap::new(),
            touched: Vec::new(),
            transactions: 0,
            template,
        }
    }

    /// Replays the passes of one chunk synced at or before `at_ms`;
    /// returns whether a later pass was met (the restore is complete).
    fn replay_chunk(
        &mut self,
        path: &Path,
        header: &ChunkHeader,
        data: &[u8],
        at_ms: EpochMs,
        passes: &mut u64,
    ) -> Result<bool, ArchiveError> {
        let mut records: Vec<(bool, Vec<u8>, u64, std::ops::Range<usize>)> = Vec::new();
        let mut mark = 0;
        let mut stop = false;
        let mut failed: Option<ArchiveError> = None;
        let result = crate::journal::archived_passes(data, header.nonce, |event| {
            match event {
                crate::journal::ArchivedRecord::Change {
                    truncate,
                    name,
                    offset,
                    data: range,
                } => records.push((truncate, name.to_vec(), offset, range)),
                crate::journal::ArchivedRecord::PassEnd { end } => {
                    let end = header.start + end as u64;
                    while header.marks.get(mark).is_some_and(|m| m.0 < end) {
                        mark += 1;
                    }
                    let time = header.marks.get(mark).map_or(EpochMs::MAX, |m| m.1);
                    if time > at_ms {
                        stop = true;
                        return false;
                    }
                    *passes += 1;
                    for (truncate, name, offset, range) in records.drain(..) {
                        let bytes = data.get(range).unwrap_or_default();
                        if let Err(error) = self.change(path, truncate, &name, offset, bytes) {
                            failed = Some(error);
                            return false;
                        }
                    }
                }
            }
            true
        });
        if let Some(error) = failed {
            return Err(error);
        }
        if let Err(at) = result {
            return Err(ArchiveError::Damaged {
                file: path.to_path_buf(),
                rule: format!("no whole journal pass at byte {at} of its data"),
            });
        }
        Ok(stop)
    }

    /// One WAL record: a write or a truncation.
    fn change(
        &mut self,
        path: &Path,
        truncate: bool,
        name: &[u8],
        offset: u64,
        data: &[u8],
    ) -> Result<(), ArchiveError> {
        let wal = match self.wals.entry(name.to_vec()) {
            std::collections::hash_map::Entry::Occupied(wal) => wal.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => {
                let Some(db) = object_db(&self.into, name) else {
                    return Err(ArchiveError::BadName {
                        file: path.to_path_buf(),
                        name: String::from_utf8_lossy(name).into_owned(),
                    });
                };
                // An object created after its base was copied.
                if let Some(template) = &self.template
                    && !db.exists()
                {
                    if let Some(parent) = db.parent() {
                        std::fs::create_dir_all(parent).map_err(io(parent))?;
                    }
                    std::fs::write(&db, template).map_err(io(&db))?;
                    self.touched.push(db.clone());
                }
                slot.insert(WalReplay {
                    db,
                    page_size: None,
                    txn_start: None,
                    buf: Vec::new(),
                    filled: 0,
                })
            }
        };
        if truncate {
            wal.txn_start = None;
            wal.buf.clear();
            wal.filled = 0;
            return Ok(());
        }
        let mut offset = offset;
        let mut data = data;
        if offset == 0 && data.len() as u64 >= WAL_HEADER_BYTES {
            // A new WAL header: SQLite starts the log over.
            let size = u32::from_be_bytes([data[8], data[9], data[10], data[11]]);
            wal.page_size = Some(if size == 1 { 65_536 } else { u64::from(size) });
            wal.txn_start = Some(WAL_HEADER_BYTES);
            wal.buf.clear();
            wal.filled = 0;
            data = &data[WAL_HEADER_BYTES as usize..];
            offset = WAL_HEADER_BYTES;
            if data.is_empty() {
                return Ok(());
            }
        }
        if wal.page_size.is_none() {
            wal.page_size = Some(db_page_size(&wal.db));
        }
        let start = match wal.txn_start {
            Some(start) if offset >= start => start,
            _ => {
                // The first write seen of a WAL begun before this archive
                // (or a restart below the transaction's start): a
                // transaction starts here.
                wal.txn_start = Some(offset);
                wal.buf.clear();
                wal.filled = 0;
                offset
            }
        };
        let page = wal.page_size.unwrap_or(4096);
        let frame = (FRAME_HEADER_BYTES + page) as usize;
        if offset == start && data.len() > FRAME_HEADER_BYTES as usize {
            // A frame written (not a header rewritten) where the
            // transaction starts: what the buffer holds is of one rolled
            // back.
            wal.buf.clear();
            wal.filled = 0;
        }
        let at = usize::try_from(offset - start).unwrap_or(usize::MAX);
        let end = at.saturating_add(data.len());
        if wal.buf.len() < end {
            wal.buf.resize(end, 0);
        }
        if let Some(slot) = wal.buf.get_mut(at..end) {
            slot.copy_from_slice(data);
        }
        if at <= wal.filled {
            wal.filled = wal.filled.max(end);
        }
        // Every commit frame now whole: apply its transaction.
        let mut commits = Vec::new();
        let mut scan = 0;
        while scan + frame <= wal.filled {
            let size = u32::from_be_bytes([
                wal.buf[scan + 4],
                wal.buf[scan + 5],
                wal.buf[scan + 6],
                wal.buf[scan + 7],
            ]);
            if size != 0 {
                commits.push(scan + frame);
            }
            scan += frame;
        }
        if let Some(&last) = commits.last() {
            let txn: Vec<u8> = wal.buf.drain(..last).collect();
            wal.filled -= last;
            wal.txn_start = Some(start + last as u64);
            let db = wal.db.clone();
            let mut from = 0;
            for commit in commits {
                self.apply(&db, page, frame, &txn[from..commit])?;
                from = commit;
            }
        }
        Ok(())
    }

    /// Writes the pages of one committed transaction's frames into `db`,
    /// and sets its size from the commit frame.
    fn apply(
        &mut self,
        db: &Path,
        page: u64,
        frame: usize,
        frames: &[u8],
    ) -> Result<(), ArchiveError> {
        if self.files.len() >= OPEN_FILES && !self.files.contains_key(db) {
            self.files.clear();
        }
        let file = match self.files.entry(db.to_path_buf()) {
            std::collections::hash_map::Entry::Occupied(file) => file.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => {
                if let Some(parent) = db.parent() {
                    std::fs::create_dir_all(parent).map_err(io(parent))?;
                }
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(db)
                    .map_err(io(db))?;
                self.touched.push(db.to_path_buf());
                slot.insert(file)
            }
        };
        let mut size = 0u32;
        for one in frames.chunks_exact(frame) {
            let pgno = u32::from_be_bytes([one[0], one[1], one[2], one[3]]);
            let commit = u32::from_be_bytes([one[4], one[5], one[6], one[7]]);
            if pgno == 0 {
                continue;
            }
            let at = u64::from(pgno - 1) * page;
            file.write_all_at(&one[FRAME_HEADER_BYTES as usize..], at)
                .map_err(io(db))?;
            if commit != 0 {
                size = commit;
            }
        }
        if size != 0 {
            file.set_len(u64::from(size) * page).map_err(io(db))?;
        }
        self.transactions += 1;
        Ok(())
    }

    /// Syncs every object file written.
    fn finish(mut self) -> Result<(), ArchiveError> {
        self.files.clear();
        self.touched.sort();
        self.touched.dedup();
        for path in &self.touched {
            File::open(path)
                .and_then(|f| f.sync_all())
                .map_err(io(path))?;
        }
        let mut dirs: Vec<PathBuf> = self
            .touched
            .iter()
            .filter_map(|p| p.parent().map(Path::to_path_buf))
            .collect();
        dirs.sort();
        dirs.dedup();
        for dir in dirs {
            crate::directory::sync(&dir).map_err(io(&dir))?;
        }
        Ok(())
    }
}

/// The object file whose WAL the journal calls `name`
/// (`objects/<shard>/<id>.sqlite-wal`), under `into`.
fn object_db(into: &Path, name: &[u8]) -> Option<PathBuf> {
    let name = std::str::from_utf8(name).ok()?;
    let rest = name.strip_prefix("objects/")?.strip_suffix(".sqlite-wal")?;
    let (shard, id) = rest.split_once('/')?;
    if !crate::id::is_object_id(id) || id.get(..2) != Some(shard) {
        return None;
    }
    Some(into.join(format!("objects/{shard}/{id}.sqlite")))
}

/// The page size an object file records (4096 when it has none yet).
fn db_page_size(db: &Path) -> u64 {
    let mut header = [0u8; 18];
    let read = File::open(db).and_then(|mut f| f.read_exact(&mut header));
    match read {
        Ok(()) => match u16::from_be_bytes([header[16], header[17]]) {
            1 => 65_536,
            0 => 4096,
            n => u64::from(n),
        },
        Err(_) => 4096,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_as_rfc3339_or_epoch_milliseconds() {
        assert_eq!(parse_time("0").ok(), Some(0));
        assert_eq!(parse_time("1796425800250").ok(), Some(1_796_425_800_250));
        assert_eq!(parse_time("1970-01-01T00:00:00Z").ok(), Some(0));
        assert_eq!(
            parse_time("2026-12-04T23:10:00.25Z").ok(),
            Some(1_796_425_800_250)
        );
        assert_eq!(
            parse_time("2026-12-05T00:10:00.250+01:00").ok(),
            Some(1_796_425_800_250)
        );
        for bad in [
            "",
            "yesterday",
            "2026-13-01T00:00:00Z",
            "2026-12-04T23:10:00",
            "-5",
        ] {
            assert!(
                matches!(parse_time(bad), Err(ArchiveError::InvalidTime { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn an_archive_keeps_7_days_ships_every_second_and_takes_a_base_a_day_by_default() {
        let config = ArchiveConfig::new("file:///a/b").expect("a valid URL");
        assert_eq!(config.retention, Duration::from_secs(7 * 24 * 3600));
        assert_eq!(config.ship_interval, Duration::from_secs(1));
        assert_eq!(config.base_interval, Duration::from_secs(24 * 3600));
        assert_eq!(config.invalid(), None);
    }

    #[test]
    fn urls_other_than_absolute_file_urls_and_s3_buckets_are_refused() {
        assert!(ArchiveConfig::new("file:///a/b").is_ok());
        assert!(ArchiveConfig::new("s3://bucket/prefix").is_ok());
        for bad in ["/a/b", "file://a/b", "s3://Bucket/prefix", "file:///a/../b"] {
            assert!(
                matches!(
                    ArchiveConfig::new(bad),
                    Err(ArchiveError::InvalidUrl { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_chunk_reads_back_and_any_changed_byte_is_refused() {
        let header = ChunkHeader {
            seq: 3,
            nonce: 9,
            start: 4096,
            end: 4096 + 5,
            prev: Some(Position {
                seq: 3,
                offset: 4096,
            }),
            marks: vec![(4096 + 5, 17)],
        };
        let bytes = encode_chunk(&mut None, &header, b"hello");
        assert_eq!(bytes[..8], CHUNK_MAGIC);
        let path = Path::new("x.passes");
        let (back, data) = decode_chunk(path, &bytes).expect("decodes");
        assert_eq!((back, data.as_slice()), (header.clone(), &b"hello"[..]));
        // The first release's chunks, stored as they are, still read.
        let raw = encode_chunk_as(CHUNK_MAGIC_RAW, &header, b"hello");
        let (back, data) = decode_chunk(path, &raw).expect("decodes");
        assert_eq!((back, data.as_slice()), (header.clone(), &b"hello"[..]));
        // A header that claims less than the data decompresses to.
        let short = ChunkHeader {
            end: header.start + 2,
            marks: vec![(header.start + 2, 17)],
            ..header.clone()
        };
        let lying = encode_chunk_as(
            CHUNK_MAGIC,
            &short,
            &zstd::bulk::compress(b"hello", CHUNK_ZSTD_LEVEL).expect("compresses"),
        );
        assert!(matches!(
            decode_chunk(path, &lying),
            Err(ArchiveError::Damaged { .. })
        ));
        for at in [0, 20, bytes.len() - 40, bytes.len() - 1] {
            let mut bad = bytes.clone();
            bad[at] ^= 1;
            assert!(matches!(
                decode_chunk(path, &bad),
                Err(ArchiveError::Damaged { .. })
            ));
        }
        assert!(matches!(
            decode_chunk(path, &bytes[..bytes.len() - 3]),
            Err(ArchiveError::Damaged { .. })
        ));
    }
}
