//! A power-cut filesystem for durability's crash tests.
//!
//! [`PowerCutFs`] mounts a FUSE passthrough over a backing directory, in
//! the manner of LazyFS: every change reaches the backing directory at
//! once, and the filesystem keeps an undo record of what no
//! `fsync`/`fdatasync` (for data and size) or directory `fsync` (for
//! creates, unlinks and renames) has made durable yet. [`PowerCutFs::cut`]
//! then takes that away, as a power loss would, in one of the ways
//! [`Fault`] names, and everything left counts as durable.
//!
//! ```no_run
//! use durability_powercut::{Fault, PowerCutFs};
//! use std::io::Write;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let (backing, mnt) = (dir.path().join("backing"), dir.path().join("mnt"));
//! std::fs::create_dir(&backing)?;
//! std::fs::create_dir(&mnt)?;
//! let fs = PowerCutFs::mount(&backing, &mnt)?;
//!
//! let mut file = std::fs::File::create(mnt.join("log"))?;
//! file.write_all(b"synced")?;
//! file.sync_all()?;
//! file.write_all(b" and lost")?;
//! drop(file);
//!
//! fs.cut(Fault::Drop, 7)?;
//! assert_eq!(std::fs::read(mnt.join("log"))?, b"synced");
//! fs.unmount()?;
//! # Ok(())
//! # }
//! ```
//!
//! Mounting needs root (fuser mounts with mount(2) directly; there is no
//! `fusermount` here) and `/dev/fuse`.
//!
//! What the kernel does not forward cannot be modelled: `syncfs(2)` and
//! `sync(2)` reach no FUSE request, so they make nothing durable here
//! (a crash test should rely on `fsync`, as a database does).

mod cut;
mod fs;
mod inject;
mod inode;
mod state;
mod undo;

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use fuser::{BackgroundSession, Config, INodeNo, MountOption};

use crate::fs::PowerCutFilesystem;
use crate::state::{State, lock};

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
    /// As [`Fault::Drop`], and every unsynced write that overwrote bytes a
    /// sync had made durable was torn as it wrote them: each of those
    /// bytes reads back as garbage, neither its synced nor its new value,
    /// even where the two were equal (a disk's model of a power loss
    /// during a write: what it was writing is undefined, and SQLite's
    /// without powersafe overwrite). Bytes no unsynced write covered, and
    /// writes beyond the synced size, are left as [`Fault::Drop`] leaves
    /// them.
    TornOverwrite,
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
    /// Synced bytes that unsynced writes overwrote, garbled
    /// ([`Fault::TornOverwrite`]).
    pub bytes_garbled: u64,
    /// Namespace changes undone ([`Fault::Metadata`]).
    pub undone: usize,
    /// Namespace changes no directory sync had covered when the power
    /// went: the most [`Fault::Metadata`] could undo.
    pub namespace_pending: usize,
}

/// Why the filesystem could not be mounted, cut or unmounted.
#[derive(Debug, thiserror::Error)]
pub enum PowerCutError {
    /// A filesystem call on `path` failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The backing directory lies inside the mountpoint, so the mount
    /// would hide (and recurse into) its own files.
    #[error(
        "backing directory {} is inside mountpoint {}",
        backing.display(),
        mountpoint.display()
    )]
    BackingInsideMountpoint {
        backing: PathBuf,
        mountpoint: PathBuf,
    },
}

/// A mounted power-cut filesystem. Dropping it unmounts.
///
/// The FUSE requests are served on one background thread; the handle
/// shares the filesystem's state with it behind a mutex, held by each
/// request and by a whole [`PowerCutFs::cut`].
pub struct PowerCutFs {
    mountpoint: PathBuf,
    state: Arc<Mutex<State>>,
    /// `None` once unmounted.
    session: Option<BackgroundSession>,
}

impl std::fmt::Debug for PowerCutFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PowerCutFs")
            .field("mountpoint", &self.mountpoint)
            .field("mounted", &self.session.is_some())
            .finish()
    }
}

fn io_error(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> PowerCutError {
    let path = path.to_path_buf();
    move |source| PowerCutError::Io { what, path, source }
}

impl PowerCutFs {
    /// Mounts a filesystem at `mountpoint` whose files are those of
    /// `backing` (an existing directory, not under `mountpoint`).
    ///
    /// It keeps a hidden directory, `.powercut-stash`, in `backing` for
    /// files whose removal is not durable yet; whatever it holds from an
    /// earlier mount is deleted.
    pub fn mount(backing: &Path, mountpoint: &Path) -> Result<PowerCutFs, PowerCutError> {
        let root = backing
            .canonicalize()
            .map_err(io_error("resolve the backing directory", backing))?;
        if !root.is_dir() {
            return Err(io_error("use as the backing directory", backing)(
                io::Error::from_raw_os_error(libc::ENOTDIR),
            ));
        }
        let mount_root = mountpoint
            .canonicalize()
            .map_err(io_error("resolve the mountpoint", mountpoint))?;
        if root.starts_with(&mount_root) {
            return Err(PowerCutError::BackingInsideMountpoint {
                backing: root,
                mountpoint: mount_root,
            });
        }
        let state = State::new(root.clone()).map_err(io_error("prepare the stash in", &root))?;
        let state = Arc::new(Mutex::new(state));

        let mut config = Config::default();
        // No AutoUnmount: it needs fusermount, which this machine lacks.
        // No writeback cache is negotiated (fuser does not ask for it), so
        // the kernel sends every write(2) to us before it returns.
        config.mount_options = vec![MountOption::FSName("durability-powercut".to_owned())];
        // One thread serves requests in order: `cut` relies on it to know
        // that every earlier request has been answered.
        config.n_threads = Some(1);
        let session = fuser::spawn_mount(
            PowerCutFilesystem::new(Arc::clone(&state)),
            &mount_root,
            &config,
        )
        .map_err(io_error("mount the power-cut filesystem at", &mount_root))?;
        tracing::info!(backing = %root.display(), mountpoint = %mount_root.display(), "mounted");
        Ok(PowerCutFs {
            mountpoint: mount_root,
            state,
            session: Some(session),
        })
    }

    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Cuts the power: applies `fault`, seeded by `seed`, to everything not
    /// durable. Call it once no process has files of the mount open (the
    /// writer killed and reaped); afterwards everything is durable, as after
    /// a reboot, and the failures armed by [`PowerCutFs::fail_fsync`] and
    /// [`PowerCutFs::fill_at_write`] are disarmed.
    pub fn cut(&self, fault: Fault, seed: u64) -> Result<CutReport, PowerCutError> {
        let span =
            tracing::info_span!("cut", ?fault, seed, mountpoint = %self.mountpoint.display());
        let _entered = span.enter();
        self.write_back_page_cache()?;
        self.drain()?;
        let (report, inodes) = {
            let mut state = lock(&self.state);
            let report = cut::apply(&mut state, fault, seed)?;
            (report, state.inodes.known())
        };
        self.invalidate_kernel_caches(&inodes);
        Ok(report)
    }

    /// Pages a dead writer dirtied through a shared mapping may still sit
    /// in the kernel's page cache; they reach us as writes only when
    /// written back, so write them back now, before they count as gone
    /// (and not after the cut, when they would come back to life). A page
    /// the write-back cannot write (a full disk armed by
    /// [`PowerCutFs::fill_at_write`], say) is lost, as at a real power
    /// cut: that failure is no failure of the cut.
    fn write_back_page_cache(&self) -> Result<(), PowerCutError> {
        let root = File::open(&self.mountpoint)
            .map_err(io_error("open the mountpoint", &self.mountpoint))?;
        // SAFETY: syncfs only reads the descriptor, which `root` keeps open.
        if unsafe { libc::syncfs(root.as_raw_fd()) } != 0 {
            let error = io::Error::last_os_error();
            tracing::debug!(%error, "dirty pages of the dead writer were not written back; they are lost with the cut");
        }
        Ok(())
    }

    /// Waits until every request sent before now has been served: a
    /// request of the killed writer may still be in the queue. The session
    /// serves requests one at a time in order, so once a lookup of a name
    /// that does not exist is answered, everything before it was.
    fn drain(&self) -> Result<(), PowerCutError> {
        let probe = self
            .mountpoint
            .join(format!(".powercut-drain-{:016x}", rand::random::<u64>()));
        match std::fs::symlink_metadata(&probe) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_error("drain the requests of", &self.mountpoint)(e)),
        }
    }

    /// Tells the kernel that what it cached of every inode may be stale.
    /// Done after the state lock is released: an invalidation may make the
    /// kernel send us requests.
    fn invalidate_kernel_caches(&self, inodes: &[u64]) {
        let Some(session) = &self.session else {
            return;
        };
        let notifier = session.notifier();
        for &ino in inodes {
            // ENOENT: the kernel holds no such inode any more, nothing to do.
            if let Err(e) = notifier.inval_inode(INodeNo(ino), 0, 0)
                && e.raw_os_error() != Some(libc::ENOENT)
            {
                tracing::debug!(ino, error = %e, "invalidating a cached inode failed");
            }
        }
    }

    /// Makes the `nth` `fsync`/`fdatasync` from now (1: the next) fail with
    /// `EIO`. What it should have made durable stays undurable, and later
    /// syncs do not cover it (Linux after a writeback error) unless it is
    /// written again. Syncs of directories are not counted.
    pub fn fail_fsync(&self, nth: u64) {
        lock(&self.state).injection.arm_sync_failure(nth);
    }

    /// Makes the `nth` write from now (1: the next), and every write after
    /// it until the next cut, fail with `ENOSPC`, writing nothing. From
    /// then on, truncations that grow a file fail likewise.
    pub fn fill_at_write(&self, nth: u64) {
        lock(&self.state).injection.arm_full_disk(nth);
    }

    /// How many injected failures (`EIO` of a sync, `ENOSPC` of a write)
    /// callers have been handed since the last cut: 0 means an armed fault
    /// has not fired yet, so it cannot explain what a process did.
    pub fn injected_failures(&self) -> u64 {
        lock(&self.state).injection.delivered()
    }

    /// Unmounts (what is not durable stays as it is in the backing
    /// directory).
    pub fn unmount(mut self) -> Result<(), PowerCutError> {
        self.unmount_now()
    }

    fn unmount_now(&mut self) -> Result<(), PowerCutError> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        match session.umount_and_join() {
            Ok(()) => Ok(()),
            Err(e) => {
                // Busy (a file still open): detach it lazily rather than
                // leave a mount behind whose server is gone with us.
                self.detach();
                Err(io_error("unmount", &self.mountpoint)(e))
            }
        }
    }

    fn detach(&self) {
        let Ok(path) = std::ffi::CString::new(self.mountpoint.as_os_str().as_bytes()) else {
            return;
        };
        // SAFETY: `path` is a valid NUL-terminated string for the call.
        if unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) } != 0 {
            tracing::warn!(
                mountpoint = %self.mountpoint.display(),
                error = %io::Error::last_os_error(),
                "lazy unmount failed"
            );
        }
    }
}

impl Drop for PowerCutFs {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_now() {
            tracing::warn!(error = %e, "unmounting the power-cut filesystem failed");
        }
    }
}
