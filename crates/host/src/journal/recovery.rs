//! `recover`: the way out when a journal segment is really damaged (a disk
//! error, an edited file, a filesystem that lost synced bytes), so that a
//! start refuses it with [`JournalError::Lost`]. It applies every record it
//! can prove whole, moves the damaged segments aside (never deletes them)
//! and reports, per object, what it could not apply.
//!
//! What *proven whole* means here, conservatively:
//! - A record decodes: the segment's magic and nonce, a known kind, and
//!   its CRC-32 over header, name and data.
//! - A pass is whole when its end record decodes and, walking from the
//!   byte its end record names as the pass's start, records of that pass
//!   follow one another without a gap up to that end record. No record
//!   of it can be missing: each one's length says where the next starts.
//!   Passes found this way after a damaged stretch must be numbered above
//!   every pass before them, and in [`super::Format::V3`] start at a block
//!   boundary, as every pass of it does; the padding after a pass is
//!   never read. A record of a pass that is not whole is never applied.
//! - A record of a whole pass is applied unless a damaged stretch lies
//!   before it in the journal and its WAL has not started over since. A
//!   stretch the disk lost may have held records of any WAL; writing a
//!   WAL's later records without them would lay frames after a gap, or
//!   new-generation frames over an old header. A write at offset 0 of a
//!   WAL (a new header) proves the opposite: SQLite starts a WAL over only
//!   once a checkpoint copied every frame into the database file and
//!   synced it, so every earlier record of that WAL, lost or not, is in
//!   the database; from there on its records are applied again.
//!
//! What is left out without loss: the pass a power cut tore at the end of
//! the newest segment (no reply waited for it), as a start does.
//!
//! Crash safety: the segments move first into [`STAGING_DIR`], and a
//! host start refuses while it holds any ([`refuse_interrupted`]). The
//! writes are a function of the segments alone (the same bytes at the
//! same offsets, the same truncations), so running them again over a
//! half-written attempt leaves the same files. One rename of the staging
//! directory into [`DAMAGED_DIR`] ends the recovery; only then are the
//! segments that were whole deleted.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read as _;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::JournalError;
use super::{
    JOURNAL_DIR, KIND_END, KIND_WRITE, Replayer, SegmentFile, decode, io, replayable, segments,
    sync_dir, valid_name,
};

/// Where a recovery keeps the segments while it writes (under the
/// journal's directory).
pub(crate) const STAGING_DIR: &str = "recovering";

/// Where a finished recovery leaves the damaged segments (under the
/// journal's directory), one directory per recovery.
pub const DAMAGED_DIR: &str = "damaged";

/// The alarm index's files, moved aside with the segments by a recovery
/// that had to leave records out: objects went back to older states than
/// the index may say, and the next start rebuilds it from them.
const INDEX_FILES: [&str; 3] = ["index.sqlite", "index.sqlite-wal", "index.sqlite-shm"];

/// A stretch of bytes, `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ByteRange {
    /// The first byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

impl From<Range<usize>> for ByteRange {
    fn from(range: Range<usize>) -> ByteRange {
        ByteRange {
            start: range.start as u64,
            end: range.end as u64,
        }
    }
}

/// What [`crate::recover_journal`] did.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct RecoveryReport {
    /// The data directory.
    pub data_dir: PathBuf,
    /// Segments read.
    pub segments: usize,
    /// The segments that held synced records no pass could prove whole
    /// (or a record naming a file outside the data directory). Empty: the
    /// journal was whole and was replayed as a start replays it.
    pub damaged: Vec<DamagedSegment>,
    /// Where the damaged segments (and the alarm index's files) were
    /// moved; `None` when nothing was damaged.
    pub moved_to: Option<PathBuf>,
    /// Records written back into their WALs.
    pub records_applied: u64,
    /// Records that decode but were not applied (see [`ObjectRecovery`]).
    pub records_skipped: u64,
    /// Per WAL the journal holds records of, by object file.
    pub objects: Vec<ObjectRecovery>,
}

impl RecoveryReport {
    /// Whether every synced record was applied: nothing was damaged.
    pub fn is_whole(&self) -> bool {
        self.damaged.is_empty()
    }
}

/// A segment a recovery could not apply whole.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct DamagedSegment {
    /// Its file name (it is now under [`RecoveryReport::moved_to`]).
    pub segment: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// The stretches of it that a returned sync covered but that no whole
    /// pass accounts for: whatever they held is lost, for any object.
    pub lost: Vec<ByteRange>,
    /// Whole passes, applied (their records of WALs that had not started
    /// over since a lost stretch excepted).
    pub whole_passes: u64,
    /// Records naming a file outside the data directory, never applied.
    pub refused_records: u64,
}

/// What a recovery did with one object's WAL records.
#[derive(Debug, Clone, Default, Serialize)]
#[non_exhaustive]
pub struct ObjectRecovery {
    /// The object's id (its file's name), empty for a WAL that is not an
    /// object's.
    pub object_id: String,
    /// The object's database file, under the data directory.
    pub object_file: PathBuf,
    /// Records written back into its WAL.
    pub applied_records: u64,
    /// Bytes they wrote.
    pub applied_bytes: u64,
    /// Records of it that decode but were not applied: in a pass that is
    /// not whole, or after a lost stretch before its WAL started over.
    /// The commits they carried are gone.
    pub skipped_records: u64,
    /// Bytes they would have written.
    pub skipped_bytes: u64,
    /// WAL frames (one page each) they would have written; `None` when
    /// the page size cannot be read from the WAL or the database file.
    pub skipped_pages: Option<u64>,
    /// The WAL offsets they covered, lowest to highest.
    pub skipped_wal_range: Option<ByteRange>,
    /// Its WAL started over (a new header) after the last lost stretch,
    /// so every record of it from there on was applied.
    pub started_over_after_loss: bool,
}

/// Fails when a recovery of the journal in `dir` did not finish: a start
/// must not replay what is left in `dir`, the recovery's writes being
/// half done.
pub(super) fn refuse_interrupted(dir: &Path) -> Result<(), JournalError> {
    let staging = dir.join(STAGING_DIR);
    match std::fs::read_dir(&staging) {
        Ok(mut entries) => match entries.next() {
            None => Ok(()),
            Some(_) => Err(JournalError::RecoveryInterrupted { path: staging }),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(&staging)(e)),
    }
}

/// One stretch of a segment, in file order.
enum Span {
    /// A whole pass (or, in the first format, records before any damage).
    Whole(Range<usize>),
    /// Synced bytes that no whole pass accounts for.
    Lost(Range<usize>),
}

/// How a recovery reads one segment.
struct Analysis {
    spans: Vec<Span>,
    whole_passes: u64,
}

/// Where the last byte that is not zero ends.
fn data_end(bytes: &[u8]) -> usize {
    bytes.iter().rposition(|&b| b != 0).map_or(0, |at| at + 1)
}

/// The positions in `bytes[from..to]` where a record of `segment` could
/// start (its magic), each with the record if it decodes.
fn decodable<'a>(
    segment: &'a SegmentFile,
    bytes: &'a [u8],
    range: Range<usize>,
) -> impl Iterator<Item = (usize, super::Record<'a>, usize)> + 'a {
    let (magic, _) = segment.format.layout();
    let mut from = range.start;
    std::iter::from_fn(move || {
        while from < range.end {
            let found = bytes
                .get(from..range.end.min(bytes.len()))?
                .windows(magic.len())
                .position(|w| w == magic)
                .map(|position| from + position)?;
            match bytes
                .get(found..)
                .and_then(|rest| decode(rest, segment.format, segment.nonce))
            {
                Some((record, len)) if found + len <= range.end => {
                    from = found + len;
                    return Some((found, record, len));
                }
                _ => from = found + 1,
            }
        }
        None
    })
}

/// Whether the end record at `end_at` (of pass `pass`, naming `start`)
/// closes a whole pass: records of that pass, one after another, from
/// `start` to it. Returns where the pass ends.
fn whole_pass(
    segment: &SegmentFile,
    bytes: &[u8],
    start: usize,
    end_at: usize,
    pass: u64,
) -> Option<usize> {
    let mut at = start;
    loop {
        let (record, len) = decode(bytes.get(at..)?, segment.format, segment.nonce)?;
        if record.pass != pass {
            return None;
        }
        if at == end_at {
            return (record.kind == KIND_END).then_some(at + len);
        }
        if record.kind == KIND_END {
            return None;
        }
        at += len;
        if at > end_at {
            return None;
        }
    }
}

/// Splits `segment` (its `bytes`) into whole passes and lost stretches.
/// `last`: no newer segment follows it, so its torn last pass is no loss.
fn analyze(segment: &SegmentFile, bytes: &[u8], last: bool) -> Result<Analysis, JournalError> {
    // The passes a start would replay, as it walks them.
    let mut spans = Vec::new();
    let mut whole_passes = 0;
    let mut at = 0;
    let mut open: Option<usize> = None;
    let mut closed = 0;
    let mut floor = 0;
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
                    spans.push(Span::Whole(start..at + len));
                    whole_passes += 1;
                    closed = record.pass;
                    open = None;
                    // The padding up to the next pass holds nothing.
                    floor = segment.format.next_pass(at + len);
                }
                (KIND_END, _) => break,
                (_, None) => open = Some(at),
                (_, Some(_)) => {}
            }
        } else {
            spans.push(Span::Whole(at..at + len));
            floor = at + len;
        }
        at += len;
        if open.is_none() {
            at = at.max(floor);
        }
    }
    let end = data_end(bytes);
    match replayable(segment, bytes, last) {
        Ok(_) => {
            return Ok(Analysis {
                spans,
                whole_passes,
            });
        }
        Err(JournalError::Lost { .. }) => {}
        Err(error) => return Err(error),
    }
    // Beyond the damage: every end record that closes a whole pass
    // numbered above the last one found.
    if segment.format.has_passes() {
        let mut from = floor;
        while from < end {
            let next = decodable(segment, bytes, from..end).find_map(|(at, record, len)| {
                let start = usize::try_from(record.offset).ok()?;
                (record.kind == KIND_END
                    && record.pass > closed
                    && (floor..=at).contains(&start)
                    && segment.format.pass_starts_at(start))
                .then(|| whole_pass(segment, bytes, start, at, record.pass))
                .flatten()
                .map(|pass_end| (start, pass_end, record.pass, at + len))
            });
            let Some((start, pass_end, pass, _)) = next else {
                break;
            };
            if start > floor {
                spans.push(Span::Lost(floor..start));
            }
            spans.push(Span::Whole(start..pass_end));
            whole_passes += 1;
            closed = pass;
            floor = segment.format.next_pass(pass_end);
            from = floor;
        }
    }
    // What follows the last whole pass: in the newest segment, records of
    // only the next pass are a torn pass no reply waited for.
    let torn = last
        && segment.format.has_passes()
        && decodable(segment, bytes, floor..end).all(|(_, record, _)| record.pass == closed + 1);
    if end > floor && !torn {
        spans.push(Span::Lost(floor..end));
    }
    Ok(Analysis {
        spans,
        whole_passes,
    })
}

/// What a recovery does with one segment: the records it applies (by
/// position) and what its report says.
struct Plan {
    segment: SegmentFile,
    apply: Vec<usize>,
    damaged: Option<DamagedSegment>,
}

/// One WAL's tally while the segments are read.
#[derive(Default)]
struct Tally {
    report: ObjectRecovery,
    /// The lost stretch it last started over after (see [`plan`]).
    clean_since: u64,
    /// The writes left out: WAL offset and length.
    skipped: Vec<(u64, u64)>,
    /// The page size a header in its records names.
    page_size: Option<u64>,
}

impl Tally {
    fn skip(&mut self, kind: u8, offset: u64, len: usize) {
        let report = &mut self.report;
        report.skipped_records += 1;
        report.skipped_bytes += len as u64;
        if kind == KIND_WRITE {
            let end = offset + len as u64;
            let range = report
                .skipped_wal_range
                .get_or_insert(ByteRange { start: offset, end });
            range.start = range.start.min(offset);
            range.end = range.end.max(end);
            self.skipped.push((offset, len as u64));
        }
    }
}

/// Reads every segment and decides what to apply (see the module).
fn plan(
    segments: Vec<SegmentFile>,
    wals: &mut HashMap<Vec<u8>, Tally>,
) -> Result<Vec<Plan>, JournalError> {
    // Lost stretches passed so far: a WAL is clean when it started over
    // after the last one.
    let mut losses = 0u64;
    let count = segments.len();
    let mut plans = Vec::with_capacity(count);
    for (n, segment) in segments.into_iter().enumerate() {
        let bytes = std::fs::read(&segment.path).map_err(io(&segment.path))?;
        let analysis = analyze(&segment, &bytes, n + 1 == count)?;
        let mut apply = Vec::new();
        let mut lost = Vec::new();
        let mut refused = 0;
        for span in analysis.spans {
            match span {
                Span::Whole(range) => {
                    for (at, record, _) in decodable(&segment, &bytes, range) {
                        if record.kind == KIND_END {
                            continue;
                        }
                        if !valid_name(record.name) {
                            refused += 1;
                            continue;
                        }
                        let tally = wals.entry(record.name.to_vec()).or_default();
                        if record.kind == KIND_WRITE && record.offset == 0 {
                            tally.clean_since = losses;
                            tally.page_size = tally.page_size.or(wal_page_size(record.data));
                        }
                        if tally.clean_since == losses {
                            tally.report.applied_records += 1;
                            tally.report.applied_bytes += record.data.len() as u64;
                            apply.push(at);
                        } else {
                            tally.skip(record.kind, record.offset, record.data.len());
                        }
                    }
                }
                Span::Lost(range) => {
                    losses += 1;
                    for (_, record, _) in decodable(&segment, &bytes, range.clone()) {
                        if record.kind != KIND_END && valid_name(record.name) {
                            wals.entry(record.name.to_vec()).or_default().skip(
                                record.kind,
                                record.offset,
                                record.data.len(),
                            );
                        }
                    }
                    lost.push(ByteRange::from(range));
                }
            }
        }
        let damaged = (!lost.is_empty() || refused > 0).then(|| DamagedSegment {
            segment: file_name(&segment.path),
            bytes: bytes.len() as u64,
            lost,
            whole_passes: analysis.whole_passes,
            refused_records: refused,
        });
        plans.push(Plan {
            segment,
            apply,
            damaged,
        });
    }
    for tally in wals.values_mut() {
        tally.report.started_over_after_loss = losses > 0 && tally.clean_since == losses;
    }
    Ok(plans)
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The page size a WAL header (its first 32 bytes) names.
fn wal_page_size(header: &[u8]) -> Option<u64> {
    let size = u32::from_be_bytes(header.get(8..12)?.try_into().ok()?);
    (size.is_power_of_two() && (512..=65536).contains(&size)).then_some(u64::from(size))
}

/// The page size of the database file at `path` (its header's bytes
/// 16-17, where 1 means 65,536).
fn database_page_size(path: &Path) -> Option<u64> {
    let mut header = [0u8; 18];
    File::open(path).ok()?.read_exact(&mut header).ok()?;
    match u16::from_be_bytes([header[16], header[17]]) {
        1 => Some(65536),
        size if size.is_power_of_two() && size >= 512 => Some(u64::from(size)),
        _ => None,
    }
}

/// How many WAL frames of `page_size` start inside the writes `skipped`.
fn frames(skipped: &[(u64, u64)], page_size: u64) -> u64 {
    const WAL_HEADER: u64 = 32;
    let frame = page_size + 24;
    // The frames starting before `at`.
    let before = |at: u64| at.saturating_sub(WAL_HEADER).div_ceil(frame);
    skipped
        .iter()
        .map(|&(offset, len)| before(offset + len).saturating_sub(before(offset)))
        .sum()
}

/// Fills in what each WAL's report needs from the files: the object it
/// belongs to, and the pages left out.
fn object_reports(root: &Path, wals: HashMap<Vec<u8>, Tally>) -> Vec<ObjectRecovery> {
    let mut objects: Vec<ObjectRecovery> = wals
        .into_iter()
        .map(|(name, mut tally)| {
            let wal = PathBuf::from(String::from_utf8_lossy(&name).into_owned());
            let object_file = wal.with_extension("sqlite");
            tally.report.object_id = object_file
                .file_stem()
                .filter(|_| wal.starts_with("objects"))
                .map(|stem| stem.to_string_lossy().into_owned())
                .unwrap_or_default();
            if tally.report.skipped_records > 0 {
                let page_size = tally.page_size.or_else(|| {
                    let mut header = [0u8; 32];
                    File::open(root.join(&wal))
                        .and_then(|mut file| file.read_exact(&mut header))
                        .ok()
                        .and_then(|()| wal_page_size(&header))
                        .or_else(|| database_page_size(&root.join(&object_file)))
                });
                tally.report.skipped_pages = page_size.map(|size| frames(&tally.skipped, size));
            }
            tally.report.object_file = object_file;
            tally.report
        })
        .collect();
    objects.sort_by(|a, b| a.object_file.cmp(&b.object_file));
    objects
}

/// Recovers the journal of `root` (the data directory, whose lock the
/// caller holds): see the module.
pub(crate) fn recover(root: &Path) -> Result<RecoveryReport, JournalError> {
    let dir = root.join(JOURNAL_DIR);
    let staging = dir.join(STAGING_DIR);
    let mut report = RecoveryReport {
        data_dir: root.to_path_buf(),
        segments: 0,
        damaged: Vec::new(),
        moved_to: None,
        records_applied: 0,
        records_skipped: 0,
        objects: Vec::new(),
    };
    if !dir.is_dir() {
        return Ok(report);
    }
    // An interrupted recovery left some segments (or all) in the staging
    // directory: together with those still in the journal's, they are the
    // same set as the first attempt's.
    let interrupted = refuse_interrupted(&dir).is_err();
    let mut found = segments(&dir)?;
    if staging.is_dir() {
        found.extend(segments(&staging)?);
    }
    found.sort_by_key(|segment| segment.seq);
    report.segments = found.len();
    let mut wals = HashMap::new();
    let mut plans = plan(found, &mut wals)?;
    let damaged = plans.iter().any(|plan| plan.damaged.is_some());
    if damaged || interrupted {
        // From here on a start refuses the directory until this ends.
        crate::directory::create_durably(&staging).map_err(io(&staging))?;
        for plan in &mut plans {
            let to = staging.join(file_name(&plan.segment.path));
            if plan.segment.path != to {
                std::fs::rename(&plan.segment.path, &to).map_err(io(&plan.segment.path))?;
                plan.segment.path = to;
            }
        }
        for name in INDEX_FILES {
            let from = root.join(name);
            if from.exists() {
                std::fs::rename(&from, staging.join(name)).map_err(io(&from))?;
            }
        }
        sync_dir(&staging)?;
        sync_dir(&dir)?;
        sync_dir(root)?;
    }
    let mut replayer = Replayer::default();
    for plan in &plans {
        let path = &plan.segment.path;
        let bytes = std::fs::read(path).map_err(io(path))?;
        for &at in &plan.apply {
            if let Some((record, _)) = bytes
                .get(at..)
                .and_then(|rest| decode(rest, plan.segment.format, plan.segment.nonce))
            {
                replayer.apply(root, path, at, &record)?;
            }
        }
    }
    report.records_applied = replayer.records;
    replayer.sync(root)?;
    if damaged || interrupted {
        report.moved_to = Some(finish(&dir, &staging, &plans)?);
    } else {
        for plan in &plans {
            std::fs::remove_file(&plan.segment.path).map_err(io(&plan.segment.path))?;
        }
        sync_dir(&dir)?;
    }
    report.damaged = plans.into_iter().filter_map(|plan| plan.damaged).collect();
    report.objects = object_reports(root, wals);
    report.records_skipped = report.objects.iter().map(|o| o.skipped_records).sum();
    tracing::info!(
        segments = report.segments,
        damaged = report.damaged.len(),
        applied = report.records_applied,
        skipped = report.records_skipped,
        "journal recovered"
    );
    Ok(report)
}

/// Ends a recovery that moved segments aside: one rename of the staging
/// directory into [`DAMAGED_DIR`]; then the segments that were whole (all
/// applied) go. Returns where the damaged ones are.
fn finish(dir: &Path, staging: &Path, plans: &[Plan]) -> Result<PathBuf, JournalError> {
    let damaged_dir = dir.join(DAMAGED_DIR);
    crate::directory::create_durably(&damaged_dir).map_err(io(&damaged_dir))?;
    let stem = plans
        .iter()
        .find(|plan| plan.damaged.is_some())
        .or(plans.last())
        .map(|plan| file_name(&plan.segment.path))
        .unwrap_or_default();
    let stem = stem.strip_suffix(".log").unwrap_or(&stem).to_owned();
    let mut to = damaged_dir.join(&stem);
    let mut n = 1;
    while to.exists() {
        n += 1;
        to = damaged_dir.join(format!("{stem}.{n}"));
    }
    std::fs::rename(staging, &to).map_err(io(staging))?;
    sync_dir(&damaged_dir)?;
    sync_dir(dir)?;
    // Done: what follows only frees space.
    let mut removed = false;
    for plan in plans.iter().filter(|plan| plan.damaged.is_none()) {
        let path = to.join(file_name(&plan.segment.path));
        match std::fs::remove_file(&path) {
            Ok(()) => removed = true,
            Err(error) => {
                tracing::warn!(%error, path = %path.display(), "a whole segment a recovery applied was kept");
            }
        }
    }
    if removed && let Err(error) = sync_dir(&to) {
        tracing::warn!(%error, "the removal of whole segments a recovery applied may not be durable");
    }
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{Write, insert, open_object, pass_bounds, write_segment, zero};
    use super::super::{Journal, SEGMENT_LIMIT};
    use super::*;

    /// The bytes of every file under `dir/objects`, by path.
    fn object_files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
        let mut files = Vec::new();
        let mut dirs = vec![dir.join("objects")];
        while let Some(at) = dirs.pop() {
            for entry in std::fs::read_dir(&at).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                } else {
                    files.push((path.clone(), std::fs::read(&path).unwrap()));
                }
            }
        }
        files.sort();
        files
    }

    /// Objects committed through the journal's VFS, then the disk a power
    /// cut leaves: the object files as they stand (never checkpointed) and
    /// the journal's segment, but none of the WAL files (never synced by
    /// themselves), copied into `dir` (a fresh directory, so no SQLite
    /// state of this process is shared with it). Then a zeroed hole of a
    /// mebibyte in the segment from the middle of the first pass that
    /// starts past its first mebibyte: synced passes follow it. Returns the
    /// segment, where the damaged pass starts and where the hole ends.
    fn holed(dir: &Path) -> (SegmentFile, usize, usize) {
        const OBJECTS: usize = 3;
        const PASSES: i64 = 40;
        const HOLE_BYTES: usize = 1 << 20;
        let work = tempfile::tempdir().unwrap();
        let journal = Journal::open(work.path(), SEGMENT_LIMIT).unwrap();
        let conns: Vec<_> = (0..OBJECTS)
            .map(|n| open_object(&journal, work.path(), &format!("object-{n}")))
            .collect();
        for pass in 0..PASSES {
            for conn in &conns {
                insert(conn, pass * 10..pass * 10 + 10);
            }
            journal.sync().unwrap();
        }
        std::fs::create_dir_all(dir.join("objects/ab")).unwrap();
        for n in 0..OBJECTS {
            let name = format!("objects/ab/object-{n}.sqlite");
            std::fs::copy(work.path().join(&name), dir.join(&name)).unwrap();
        }
        let source = segments(&work.path().join(JOURNAL_DIR)).unwrap().remove(0);
        std::fs::create_dir_all(dir.join(JOURNAL_DIR)).unwrap();
        let copy = dir.join(JOURNAL_DIR).join(source.path.file_name().unwrap());
        std::fs::copy(&source.path, &copy).unwrap();
        drop(conns);
        drop(journal);
        let segment = segments(&dir.join(JOURNAL_DIR)).unwrap().remove(0);
        let damaged = (1..)
            .find(|&pass| pass_bounds(&segment, pass).0 >= 1 << 20)
            .unwrap();
        let (start, _) = pass_bounds(&segment, damaged);
        let hole_end = start + 10 + HOLE_BYTES;
        let total = std::fs::metadata(&segment.path).unwrap().len() as usize;
        assert!(
            hole_end + (128 << 10) < total,
            "synced passes follow the hole"
        );
        zero(&segment.path, start + 10, HOLE_BYTES);
        (segment, start, hole_end)
    }

    /// What a start replays of the disk `holed` made when its segment
    /// ends where the damaged pass starts (no hole, nothing after it):
    /// the rows a recovery must keep, found by the ordinary replay.
    fn replayed_before(dir: &Path, segment: &SegmentFile, start: usize) -> Vec<Vec<i64>> {
        let oracle = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(oracle.path().join("objects/ab")).unwrap();
        for n in 0..3 {
            let name = format!("objects/ab/object-{n}.sqlite");
            std::fs::copy(dir.join(&name), oracle.path().join(&name)).unwrap();
        }
        std::fs::create_dir_all(oracle.path().join(JOURNAL_DIR)).unwrap();
        let bytes = std::fs::read(&segment.path).unwrap();
        std::fs::write(
            oracle
                .path()
                .join(JOURNAL_DIR)
                .join(segment.path.file_name().unwrap()),
            &bytes[..start],
        )
        .unwrap();
        super::super::recover(oracle.path()).unwrap();
        (0..3).map(|n| rows_of(oracle.path(), n)).collect()
    }

    fn rows_of(dir: &Path, object: usize) -> Vec<i64> {
        let conn =
            rusqlite::Connection::open(dir.join(format!("objects/ab/object-{object}.sqlite")))
                .unwrap();
        let mut stmt = conn.prepare("SELECT n FROM rows ORDER BY n").unwrap();
        stmt.query_map([], |row| row.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    #[tokio::test]
    async fn a_start_refuses_a_mebibyte_hole_before_synced_passes_naming_it_and_touches_no_object_file()
     {
        // The shape LazyFS left in ../shared/evidence/powercut-journal-refusal
        // (a hole of 1.7 MiB before synced passes), made by the journal's
        // own writer.
        let dir = tempfile::tempdir().unwrap();
        let (segment, start, hole_end) = holed(dir.path());
        let objects = object_files(dir.path());
        let journal_bytes = std::fs::read(&segment.path).unwrap();
        let built = tokio::task::LocalSet::new()
            .run_until(async { crate::Host::builder(dir.path()).threads(0).build() })
            .await;
        let Err(error) = built else {
            panic!("a host started on a journal that lost synced records");
        };
        let crate::HostError::JournalLost {
            segment: named,
            at,
            found,
        } = &error
        else {
            panic!("{error}");
        };
        assert_eq!((named, *at), (&segment.path, start as u64), "{error}");
        assert!(*found >= hole_end as u64, "{error}");
        assert!(error.to_string().contains("durability recover"), "{error}");
        assert_eq!(
            object_files(dir.path()),
            objects,
            "an object file was touched"
        );
        assert_eq!(std::fs::read(&segment.path).unwrap(), journal_bytes);
    }

    #[tokio::test]
    async fn recover_applies_the_passes_before_a_hole_reports_the_rest_and_a_host_then_starts() {
        let dir = tempfile::tempdir().unwrap();
        let (segment, start, hole_end) = holed(dir.path());
        let kept = replayed_before(dir.path(), &segment, start);
        assert!(
            kept.iter().all(|rows| !rows.is_empty() && rows.len() < 400),
            "the passes before the hole hold some rows, not all: {kept:?}"
        );
        let bytes = std::fs::read(&segment.path).unwrap();
        let report = crate::recover_journal(dir.path()).unwrap();
        // The passes before the damaged one; no WAL started over after
        // it (no checkpoint), so nothing after the hole.
        for (object, rows) in kept.iter().enumerate() {
            assert_eq!(&rows_of(dir.path(), object), rows, "object {object}");
        }
        assert_eq!(report.damaged.len(), 1, "{report:?}");
        let lost = &report.damaged[0].lost;
        assert_eq!(lost.len(), 1, "{lost:?}");
        assert_eq!(lost[0].start, start as u64);
        assert!(lost[0].end >= hole_end as u64, "{lost:?}");
        assert_eq!(report.objects.len(), 3, "{report:?}");
        for (n, object) in report.objects.iter().enumerate() {
            assert_eq!(object.object_id, format!("object-{n}"));
            assert!(
                object.skipped_records > 0 && object.skipped_pages > Some(0),
                "{object:?}"
            );
            assert!(!object.started_over_after_loss);
        }
        // Kept aside whole, and the journal holds no segment.
        let moved = report.moved_to.clone().unwrap();
        assert_eq!(
            std::fs::read(moved.join(segment.path.file_name().unwrap())).unwrap(),
            bytes
        );
        assert!(segments(&dir.path().join(JOURNAL_DIR)).unwrap().is_empty());
        let host = tokio::task::LocalSet::new()
            .run_until(async { crate::Host::builder(dir.path()).threads(0).build() })
            .await;
        assert!(host.is_ok(), "{:?}", host.err());
        for (object, rows) in kept.iter().enumerate() {
            assert_eq!(&rows_of(dir.path(), object), rows, "object {object}");
        }
    }

    const A: &str = "objects/aa/a.sqlite-wal";
    const B: &str = "objects/bb/b.sqlite-wal";
    const C: &str = "objects/cc/c.sqlite-wal";

    fn write(name: &str, offset: u64, byte: u8, len: usize) -> Write {
        (name.as_bytes().to_vec(), offset, vec![byte; len])
    }

    /// A segment whose pass 2 lost its middle record; pass 3 starts A
    /// over; pass 5, the last, is torn (its end is gone). Returns it with
    /// where pass 2 and pass 3 start.
    fn crafted(dir: &Path) -> (SegmentFile, usize, usize) {
        let journal_dir = dir.join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal_dir).unwrap();
        let segment = write_segment(
            &journal_dir,
            9,
            &[
                vec![write(A, 0, 1, 40), write(B, 0, 1, 40)],
                vec![write(A, 40, 2, 8), write(B, 40, 2, 8), write(A, 48, 2, 8)],
                vec![write(A, 0, 3, 40), write(B, 48, 3, 8)],
                vec![write(A, 40, 4, 8), write(C, 8, 4, 8)],
                vec![write(A, 48, 5, 8)],
            ],
        );
        let (lost_start, _) = pass_bounds(&segment, 2);
        let (third, _) = pass_bounds(&segment, 3);
        let (_, last_end) = pass_bounds(&segment, 5);
        // Pass 2's second record: its header, name and data.
        let bytes = std::fs::read(&segment.path).unwrap();
        let (_, first) = decode(&bytes[lost_start..], segment.format, segment.nonce).unwrap();
        let (_, second) =
            decode(&bytes[lost_start + first..], segment.format, segment.nonce).unwrap();
        zero(&segment.path, lost_start + first, second);
        // Pass 5's end record: the last record of the segment.
        let end_len = super::super::HEADER_LEN + super::super::CRC_LEN;
        zero(&segment.path, last_end - end_len, end_len);
        (segment, lost_start, third)
    }

    fn tally<'a>(report: &'a RecoveryReport, wal: &str) -> &'a ObjectRecovery {
        let file = PathBuf::from(wal.strip_suffix("-wal").unwrap());
        report
            .objects
            .iter()
            .find(|object| object.object_file == file)
            .unwrap_or_else(|| panic!("no {wal} in {report:?}"))
    }

    #[test]
    fn after_a_lost_stretch_only_wals_that_started_over_are_written_and_the_rest_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let (segment, lost_start, third) = crafted(dir.path());
        let bytes = std::fs::read(&segment.path).unwrap();
        let report = recover(dir.path()).unwrap();
        // A: pass 1, then its new header (pass 3) and what followed it
        // (pass 4); the torn pass 5 is left out. B: pass 1 only. C: its
        // only record follows the loss without a new header.
        let read = |name: &str| std::fs::read(dir.path().join(name)).ok();
        let mut a = vec![3; 40];
        a.extend_from_slice(&[4; 8]);
        assert_eq!(read(A), Some(a));
        assert_eq!(read(B), Some(vec![1; 40]));
        assert_eq!(read(C), None);
        assert_eq!(report.damaged.len(), 1);
        let damaged = &report.damaged[0];
        assert_eq!(
            damaged.lost,
            vec![ByteRange {
                start: lost_start as u64,
                end: third as u64
            }]
        );
        assert_eq!(damaged.whole_passes, 3);
        let a = tally(&report, A);
        assert_eq!((a.applied_records, a.skipped_records), (3, 2), "{a:?}");
        assert_eq!(a.skipped_wal_range, Some(ByteRange { start: 40, end: 56 }));
        assert!(a.started_over_after_loss);
        assert_eq!(a.object_id, "a");
        let b = tally(&report, B);
        assert_eq!((b.applied_records, b.skipped_records), (1, 1), "{b:?}");
        assert_eq!(b.skipped_wal_range, Some(ByteRange { start: 48, end: 56 }));
        assert!(!b.started_over_after_loss);
        let c = tally(&report, C);
        assert_eq!((c.applied_records, c.skipped_records), (0, 1), "{c:?}");
        assert_eq!(report.records_applied, 4);
        // The segment is kept aside as it was; a start finds nothing to
        // replay.
        let moved = report.moved_to.clone().unwrap();
        assert_eq!(
            moved.parent().unwrap(),
            dir.path().join(JOURNAL_DIR).join(DAMAGED_DIR)
        );
        assert_eq!(
            std::fs::read(moved.join(segment.path.file_name().unwrap())).unwrap(),
            bytes
        );
        assert!(!dir.path().join(JOURNAL_DIR).join(STAGING_DIR).exists());
        super::super::recover(dir.path()).unwrap();
        drop(Journal::open(dir.path(), SEGMENT_LIMIT).unwrap());
    }

    #[test]
    fn an_interrupted_recovery_stops_a_start_and_running_it_again_ends_as_one_run_would() {
        let once = tempfile::tempdir().unwrap();
        crafted(once.path());
        recover(once.path()).unwrap();
        // The other crashed after it staged the segment and wrote pass 1.
        let crashed = tempfile::tempdir().unwrap();
        let (segment, _, _) = crafted(crashed.path());
        let journal_dir = crashed.path().join(JOURNAL_DIR);
        let staging = journal_dir.join(STAGING_DIR);
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::rename(
            &segment.path,
            staging.join(segment.path.file_name().unwrap()),
        )
        .unwrap();
        for name in [A, B] {
            let path = crashed.path().join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, [1; 40]).unwrap();
        }
        let refused = super::super::recover(crashed.path()).unwrap_err();
        assert!(
            matches!(refused, JournalError::RecoveryInterrupted { .. }),
            "{refused}"
        );
        let report = recover(crashed.path()).unwrap();
        assert_eq!(report.damaged.len(), 1, "{report:?}");
        for name in [A, B, C] {
            assert_eq!(
                std::fs::read(crashed.path().join(name)).ok(),
                std::fs::read(once.path().join(name)).ok(),
                "{name}"
            );
        }
        super::super::recover(crashed.path()).unwrap();
    }

    #[test]
    fn a_whole_journal_is_replayed_as_a_start_would_and_nothing_is_moved() {
        let dir = tempfile::tempdir().unwrap();
        let journal_dir = dir.path().join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal_dir).unwrap();
        write_segment(
            &journal_dir,
            3,
            &[vec![write(A, 0, 1, 40)], vec![write(A, 40, 2, 8)]],
        );
        let report = recover(dir.path()).unwrap();
        assert!(report.is_whole() && report.moved_to.is_none(), "{report:?}");
        assert_eq!((report.records_applied, report.records_skipped), (2, 0));
        let mut a = vec![1; 40];
        a.extend_from_slice(&[2; 8]);
        assert_eq!(std::fs::read(dir.path().join(A)).unwrap(), a);
        assert!(segments(&journal_dir).unwrap().is_empty());
        assert!(!journal_dir.join(DAMAGED_DIR).exists());
    }

    #[test]
    fn a_record_naming_a_file_outside_the_data_directory_is_refused_and_its_segment_kept() {
        let dir = tempfile::tempdir().unwrap();
        let journal_dir = dir.path().join(JOURNAL_DIR);
        std::fs::create_dir_all(&journal_dir).unwrap();
        write_segment(
            &journal_dir,
            3,
            &[vec![write(A, 0, 1, 40), write("../x.sqlite-wal", 0, 1, 4)]],
        );
        let report = recover(dir.path()).unwrap();
        assert_eq!(report.damaged.len(), 1, "{report:?}");
        assert_eq!(report.damaged[0].refused_records, 1);
        assert_eq!(std::fs::read(dir.path().join(A)).unwrap(), vec![1; 40]);
        assert!(!dir.path().join("../x.sqlite-wal").exists());
        assert!(report.moved_to.is_some_and(|to| to.is_dir()));
    }
}
