//! The cut: applies a [`Fault`] to the undo record, then forgets the
//! record, as a reboot forgets the page cache.
//!
//! It owns the order the spec of a power loss needs: namespace first
//! (newest change first, so each undo finds the state right after its
//! change), then data by inode at whatever path the file has by then.
//! Everything is seeded by the caller's seed alone, and files are visited
//! by path, so one seed over one workload cuts the same way every time.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::state::{Handle, STASH_DIR, State};
use crate::undo::{BLOCK_BYTES, Change, FileUndo, SECTOR_BYTES, read_up_to};
use crate::{CutReport, Fault, PowerCutError};

/// What becomes of one unsynced block.
enum Fate {
    /// Back to its synced content.
    Back,
    /// Keeps what was written.
    Kept,
    /// The first `new_sectors` sectors keep what was written, the rest go
    /// back.
    Torn { new_sectors: u64 },
}

/// How the blocks and sizes of the unsynced files are decided.
enum Plan {
    /// Everything goes back.
    Drop,
    /// A coin per block and per size change; one block, the
    /// `torn`-th over all files, torn.
    Reorder {
        rng: Box<StdRng>,
        torn: Option<u64>,
        seen: u64,
    },
}

impl Plan {
    fn size(&mut self, current: u64, synced: u64) -> u64 {
        match self {
            Plan::Drop => synced,
            Plan::Reorder { rng, .. } => {
                if current != synced && rng.random_bool(0.5) {
                    current
                } else {
                    synced
                }
            }
        }
    }

    fn fate(&mut self) -> Fate {
        match self {
            Plan::Drop => Fate::Back,
            Plan::Reorder { rng, torn, seen } => {
                let index = *seen;
                *seen += 1;
                if *torn == Some(index) {
                    Fate::Torn {
                        new_sectors: rng.random_range(1..BLOCK_BYTES / SECTOR_BYTES),
                    }
                } else if rng.random_bool(0.5) {
                    Fate::Kept
                } else {
                    Fate::Back
                }
            }
        }
    }
}

fn io_error(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> PowerCutError {
    let path = path.to_path_buf();
    move |source| PowerCutError::Io { what, path, source }
}

/// Applies `fault` seeded by `seed` and leaves everything durable.
pub(crate) fn apply(
    state: &mut State,
    fault: Fault,
    seed: u64,
) -> Result<CutReport, PowerCutError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut report = CutReport {
        namespace_pending: state.namespace.len(),
        ..CutReport::default()
    };
    let changes = state.namespace.take_newest_first();
    if fault == Fault::Metadata {
        // 0..=n, so that both "nothing reached the disk" and "all of it
        // did" are among the outcomes.
        let undone = rng.random_range(0..=changes.len());
        for change in changes.iter().take(undone) {
            if undo_change(state, change)? {
                report.undone += 1;
            }
        }
    }

    let files = std::mem::take(&mut state.files);
    report.files = files.len();
    let mut targets: Vec<(PathBuf, FileUndo)> = files
        .into_iter()
        .filter_map(|(ino, undo)| {
            // Gone (its creation undone) or stashed (its removal kept):
            // no data of it survives to restore.
            let path = state.inodes.path(ino)?;
            (!path.starts_with(STASH_DIR)).then(|| (path.to_path_buf(), undo))
        })
        .collect();
    targets.sort_by(|a, b| a.0.cmp(&b.0));

    // Seeded apart from the plan's draws, so the garbage of one seed is
    // the same whatever the plan drew before.
    let mut garble = (fault == Fault::TornOverwrite).then(|| StdRng::seed_from_u64(!seed));
    let mut plan = match fault {
        Fault::Drop | Fault::Metadata | Fault::TornOverwrite => Plan::Drop,
        Fault::Reorder => {
            let blocks: u64 = targets.iter().map(|(_, u)| u.blocks.len() as u64).sum();
            let torn = (blocks > 0).then(|| rng.random_range(0..blocks));
            Plan::Reorder {
                rng: Box::new(rng),
                torn,
                seen: 0,
            }
        }
    };
    for (relative, undo) in &targets {
        let backing = state.backing(relative);
        restore_file(&backing, undo, &mut plan, garble.as_mut(), &mut report)
            .map_err(io_error("restore the unsynced data of", &backing))?;
    }

    reboot(state)?;
    tracing::info!(?report, "cut applied");
    Ok(report)
}

/// Brings one file to what the plan says survived; with `garble`, then
/// tears the overwrites of synced bytes ([`Fault::TornOverwrite`]).
fn restore_file(
    backing: &Path,
    undo: &FileUndo,
    plan: &mut Plan,
    garble: Option<&mut StdRng>,
    report: &mut CutReport,
) -> io::Result<()> {
    let file = match OpenOptions::new().read(true).write(true).open(backing) {
        Ok(file) => file,
        // Removed durably since: nothing of it survives.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    // What the writes put there, read before the blocks go back.
    let written: Vec<(u64, u64, Vec<u8>)> = match garble {
        Some(_) => undo
            .overwritten
            .iter()
            .map(|(&start, &end)| Ok((start, end, read_up_to(&file, start, end - start)?)))
            .collect::<io::Result<_>>()?,
        None => Vec::new(),
    };
    let current = file.metadata()?.len();
    let size = plan.size(current, undo.synced_size);
    file.set_len(size)?;
    for (&block, pre_image) in &undo.blocks {
        let old_from = match plan.fate() {
            Fate::Back => {
                report.blocks_dropped += 1;
                0
            }
            Fate::Kept => {
                report.blocks_kept += 1;
                continue;
            }
            Fate::Torn { new_sectors } => {
                report.blocks_torn += 1;
                new_sectors * SECTOR_BYTES
            }
        };
        write_old(
            &file,
            block * BLOCK_BYTES,
            pre_image.as_deref(),
            old_from,
            size,
        )?;
    }
    if let Some(rng) = garble {
        for (start, end, new) in written {
            report.bytes_garbled += tear(&file, start, end.min(size), &new, rng)?;
        }
    }
    Ok(())
}

/// Overwrites `start..end` of `file` (its synced content, put back) with
/// bytes that differ from both what was there and `new`, what the torn
/// write was writing (shorter where the file was truncated since).
/// Returns how many bytes it garbled.
fn tear(file: &File, start: u64, end: u64, new: &[u8], rng: &mut StdRng) -> io::Result<u64> {
    if start >= end {
        return Ok(0);
    }
    let mut bytes = read_up_to(file, start, end - start)?;
    for (at, byte) in bytes.iter_mut().enumerate() {
        let (old, new) = (*byte, new.get(at).copied());
        let mut garbage: u8 = rng.random();
        // At most two steps: two values are ruled out.
        while garbage == old || Some(garbage) == new {
            garbage = garbage.wrapping_add(1);
        }
        *byte = garbage;
    }
    file.write_all_at(&bytes, start)?;
    Ok(bytes.len() as u64)
}

/// Puts the synced content back into `block_start + old_from ..` of one
/// block, within `size`: the pre-image where there is one, zeros beyond it
/// (a block that did not exist at the sync, under a size that survived).
fn write_old(
    file: &File,
    block_start: u64,
    pre_image: Option<&[u8]>,
    old_from: u64,
    size: u64,
) -> io::Result<()> {
    let start = block_start + old_from;
    let end = (block_start + BLOCK_BYTES).min(size);
    if start >= end {
        return Ok(());
    }
    let mut old = vec![0; (end - start) as usize];
    if let Some(pre_image) = pre_image {
        let tail = pre_image.get(old_from as usize..).unwrap_or(&[]);
        let n = tail.len().min(old.len());
        old[..n].copy_from_slice(&tail[..n]);
    }
    file.write_all_at(&old, start)
}

/// Undoes one namespace change; false if the state it undoes is no longer
/// there (a later, durable change moved it on).
fn undo_change(state: &mut State, change: &Change) -> Result<bool, PowerCutError> {
    match change {
        Change::Created { path } => {
            let backing = state.backing(path);
            let removed = match fs::symlink_metadata(&backing) {
                Ok(meta) if meta.is_dir() => fs::remove_dir_all(&backing),
                Ok(_) => fs::remove_file(&backing),
                Err(e) => Err(e),
            };
            match removed {
                Ok(()) => {
                    state.inodes.mark_gone(path);
                    Ok(true)
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
                Err(e) => Err(io_error("undo the creation of", &backing)(e)),
            }
        }
        Change::Removed { path, stashed } => move_back(state, stashed, path),
        Change::Renamed { from, to, replaced } => {
            let moved = move_back(state, to, from)?;
            if let Some(replaced) = replaced {
                move_back(state, replaced, to)?;
            }
            Ok(moved)
        }
    }
}

/// Renames `from` back to `to` (both relative), unless `to` is taken.
fn move_back(state: &mut State, from: &Path, to: &Path) -> Result<bool, PowerCutError> {
    let from_backing = state.backing(from);
    let to_backing = state.backing(to);
    if fs::symlink_metadata(&to_backing).is_ok() {
        tracing::warn!(path = %to.display(), "not undoing a change: its path is taken again");
        return Ok(false);
    }
    match fs::rename(&from_backing, &to_backing) {
        Ok(()) => {
            state.inodes.move_path(from, to);
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_error("undo a namespace change back to", &to_backing)(e)),
    }
}

/// After the cut everything is durable: no undo state, an empty stash,
/// nothing armed.
fn reboot(state: &mut State) -> Result<(), PowerCutError> {
    state.injection.disarm();
    let stash = state.backing(Path::new(STASH_DIR));
    state
        .empty_stash()
        .map_err(io_error("empty the stash", &stash))?;
    state.inodes.mark_gone(Path::new(STASH_DIR));
    let handles = &state.handles;
    state.inodes.prune(|ino| {
        handles
            .values()
            .any(|h| matches!(h, Handle::File { ino: i, .. } if *i == ino))
    });
    Ok(())
}
