//! API skeleton (to be implemented): see the crate description.

use std::path::{Path, PathBuf};

/// What a cut does to the state that was not made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Every write not covered by a completed `fsync`/`fdatasync` of its
    /// file is dropped, and each file's size goes back to its last synced
    /// size. Namespace changes are kept.
    Drop,
    /// A seeded arbitrary subset of the unsynced 4 KiB blocks keeps its
    /// new content and the rest go back, whatever order they were written
    /// in; one unsynced write is torn at a 512-byte sector; an unsynced
    /// size change may stay or go. Namespace changes are kept.
    Reorder,
    /// As [`Fault::Drop`] for data, and the namespace changes (create,
    /// mkdir, unlink, rmdir, rename) that no `fsync` of their parent
    /// directory covered are undone: a seeded number of them, newest
    /// first, so the namespace is what it was at some moment after the
    /// last directory sync.
    Metadata,
}

/// What one cut changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CutReport {
    /// Files that had unsynced data.
    pub files: usize,
    /// Unsynced blocks that went back to their synced content.
    pub blocks_dropped: u64,
    /// Unsynced blocks that kept their new content ([`Fault::Reorder`]).
    pub blocks_kept: u64,
    /// Blocks torn at a sector ([`Fault::Reorder`]).
    pub blocks_torn: u64,
    /// Namespace changes undone ([`Fault::Metadata`]).
    pub undone: usize,
}

/// Why the filesystem could not be mounted, cut or unmounted.
#[derive(Debug, thiserror::Error)]
pub enum PowerCutError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A mounted power-cut filesystem. Dropping it unmounts.
pub struct PowerCutFs {
    mountpoint: PathBuf,
}

impl PowerCutFs {
    /// Mounts a filesystem at `mountpoint` whose files are those of
    /// `backing` (an existing directory, not under `mountpoint`).
    pub fn mount(backing: &Path, mountpoint: &Path) -> Result<PowerCutFs, PowerCutError> {
        let _ = backing;
        Ok(PowerCutFs {
            mountpoint: mountpoint.to_path_buf(),
        })
    }

    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Cuts the power: applies `fault`, seeded by `seed`, to everything not
    /// durable. Call it once no process has files of the mount open (the
    /// writer killed and reaped); afterwards everything is durable, as after
    /// a reboot.
    pub fn cut(&self, fault: Fault, seed: u64) -> Result<CutReport, PowerCutError> {
        let _ = (fault, seed);
        Ok(CutReport::default())
    }

    /// Makes the `nth` `fsync`/`fdatasync` from now (1: the next) fail with
    /// `EIO`. What it should have made durable stays undurable, and later
    /// syncs do not cover it (Linux after a writeback error).
    pub fn fail_fsync(&self, nth: u64) {
        let _ = nth;
    }

    /// Makes the `nth` write from now (1: the next), and every write after
    /// it until the next cut, fail with `ENOSPC`, writing nothing.
    pub fn fill_at_write(&self, nth: u64) {
        let _ = nth;
    }

    /// Unmounts (what is not durable stays as it is in the backing
    /// directory).
    pub fn unmount(self) -> Result<(), PowerCutError> {
        Ok(())
    }
}
