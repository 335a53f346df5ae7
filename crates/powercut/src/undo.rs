//! What is not durable yet, as the means to take it back.
//!
//! Every change reaches the backing directory at once (so reads are plain
//! passthrough); this module keeps the undo record of the changes no sync
//! has covered: per file, the synced size, the synced content of each
//! 4 KiB block written since and the byte ranges whose synced content a
//! write overwrote; for the namespace, a log of the changes no directory
//! sync has covered. It reads the backing files to capture
//! pre-images and never writes them: applying the record is the cut's job.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// The unit a cut keeps or takes back: the page size, which is what Linux
/// writes back (and loses) at once.
pub(crate) const BLOCK_BYTES: u64 = 4096;

/// The unit a torn block is torn at: what a disk writes atomically.
pub(crate) const SECTOR_BYTES: u64 = 512;

/// The unsynced data of one file.
#[derive(Debug)]
pub(crate) struct FileUndo {
    /// The size the file had at its last successful sync (or when this
    /// record began, which is the same thing: every change since went
    /// through here).
    pub(crate) synced_size: u64,
    /// Block index to its synced content: `None` for a block that began
    /// beyond the synced size (it goes back to not existing, or to zeros
    /// if the size it lies in survives); a block straddling the synced size
    /// has only the bytes below it.
    pub(crate) blocks: BTreeMap<u64, Option<Vec<u8>>>,
    /// The bytes below the synced size that writes since the sync covered
    /// (start to end, disjoint, not adjacent): synced content a write was
    /// overwriting when the power went, which [`crate::Fault::TornOverwrite`]
    /// garbles. Truncations are not writes and add nothing.
    pub(crate) overwritten: BTreeMap<u64, u64>,
    /// Blocks a failed sync should have made durable and that were not
    /// written since: Linux marks their pages clean after the writeback
    /// error, so a later sync that succeeds does not cover them.
    poisoned: BTreeSet<u64>,
}

impl FileUndo {
    /// A record for a file whose size is `synced_size` now, before its
    /// first unsynced change.
    pub(crate) fn new(synced_size: u64) -> FileUndo {
        FileUndo {
            synced_size,
            blocks: BTreeMap::new(),
            overwritten: BTreeMap::new(),
            poisoned: BTreeSet::new(),
        }
    }

    /// A write is about to cover `start..end`: keeps the part of it below
    /// the synced size, merged with the ranges kept so far.
    pub(crate) fn overwrite(&mut self, start: u64, end: u64) {
        let end = end.min(self.synced_size);
        if start >= end {
            return;
        }
        let mut merged = start..end;
        // Every kept range that overlaps or touches `merged` joins it.
        let touching: Vec<Range<u64>> = self
            .overwritten
            .range(..=end)
            .rev()
            .take_while(|&(_, &e)| e >= start)
            .map(|(&s, &e)| s..e)
            .collect();
        for range in touching {
            self.overwritten.remove(&range.start);
            merged.start = merged.start.min(range.start);
            merged.end = merged.end.max(range.end);
        }
        self.overwritten.insert(merged.start, merged.end);
    }

    /// Captures the synced content of the blocks overlapping
    /// `start..end` that have none yet, reading `file` before the change
    /// that is about to overwrite them. Until a block is captured its
    /// backing content is its synced content, which is why reading it now
    /// is right.
    pub(crate) fn capture(&mut self, file: &File, start: u64, end: u64) -> io::Result<()> {
        if end <= start {
            return Ok(());
        }
        for block in start / BLOCK_BYTES..end.div_ceil(BLOCK_BYTES) {
            // Written again after a failed sync: the next sync covers it.
            self.poisoned.remove(&block);
            if self.blocks.contains_key(&block) {
                continue;
            }
            let block_start = block * BLOCK_BYTES;
            let pre_image = if block_start >= self.synced_size {
                None
            } else {
                let len = (self.synced_size - block_start).min(BLOCK_BYTES);
                Some(read_up_to(file, block_start, len)?)
            };
            self.blocks.insert(block, pre_image);
        }
        Ok(())
    }

    /// A sync of the file succeeded at `current_size`: all but the poisoned
    /// blocks are durable. Returns whether nothing is left to undo.
    pub(crate) fn synced(&mut self, current_size: u64) -> bool {
        let poisoned = &self.poisoned;
        self.blocks.retain(|block, _| poisoned.contains(block));
        // What a poisoned block's writes overwrote is still in flight.
        self.overwritten.retain(|&start, end| {
            (start / BLOCK_BYTES..end.div_ceil(BLOCK_BYTES)).any(|block| poisoned.contains(&block))
        });
        self.synced_size = current_size;
        self.blocks.is_empty()
    }

    /// A sync of the file failed: what it should have made durable stays
    /// undone, and a later sync will not cover it either.
    pub(crate) fn poison(&mut self) {
        self.poisoned.extend(self.blocks.keys().copied());
    }
}

/// Reads up to `len` bytes at `offset`, fewer only at end of file.
pub(crate) fn read_up_to(file: &File, offset: u64, len: u64) -> io::Result<Vec<u8>> {
    let mut buf = vec![0; usize::try_from(len).unwrap_or(usize::MAX)];
    let mut filled = 0;
    while filled < buf.len() {
        match file.read_at(&mut buf[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(filled);
    Ok(buf)
}

/// A backing directory's identity: its inode number in the backing
/// filesystem, which a rename of the directory does not change.
pub(crate) type DirId = u64;

/// One namespace change, with the paths (relative to the backing root) it
/// had when it was made, so undoing the log newest first walks back
/// through exactly the states it went through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Change {
    /// A file, node or directory was made at `path`.
    Created { path: PathBuf },
    /// What was at `path` (unlinked file or removed directory) now sits in
    /// the stash at `stashed`.
    Removed { path: PathBuf, stashed: PathBuf },
    /// `from` became `to`; what `to` replaced sits in the stash.
    Renamed {
        from: PathBuf,
        to: PathBuf,
        replaced: Option<PathBuf>,
    },
}

/// A change and the directories whose sync it still waits for.
#[derive(Debug)]
struct Pending {
    change: Change,
    unsynced_dirs: Vec<DirId>,
}

/// The namespace changes no directory sync has covered, oldest first.
#[derive(Debug, Default)]
pub(crate) struct NamespaceLog {
    pending: Vec<Pending>,
}

impl NamespaceLog {
    /// Logs `change`, durable once each of `dirs` was synced after it.
    pub(crate) fn record(&mut self, change: Change, mut dirs: Vec<DirId>) {
        dirs.dedup();
        self.pending.push(Pending {
            change,
            unsynced_dirs: dirs,
        });
    }

    /// Directory `dir` was synced: every earlier change in it is durable
    /// there. Returns the changes that became durable, so the caller can
    /// delete what they stashed.
    pub(crate) fn dir_synced(&mut self, dir: DirId) -> Vec<Change> {
        let mut durable = Vec::new();
        self.pending.retain_mut(|pending| {
            pending.unsynced_dirs.retain(|&d| d != dir);
            if pending.unsynced_dirs.is_empty() {
                durable.push(pending.change.clone());
                false
            } else {
                true
            }
        });
        durable
    }

    pub(crate) fn len(&self) -> usize {
        self.pending.len()
    }

    /// Empties the log, newest change first.
    pub(crate) fn take_newest_first(&mut self) -> Vec<Change> {
        let mut changes: Vec<Change> = self.pending.drain(..).map(|p| p.change).collect();
        changes.reverse();
        changes
    }
}
