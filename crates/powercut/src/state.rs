//! The state the FUSE operations and the cut share, behind one lock.
//!
//! It owns the backing directory (only this filesystem changes it while
//! mounted), the inode table, the open handles, the undo record and the
//! injected failures. Every change to a file's data goes through
//! [`State::write`] or [`State::set_size`], which capture the pre-image
//! first: that is what lets the undo record say "not yet captured" means
//! "still the synced content".

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use fuser::FileType;

use crate::inject::Injection;
use crate::inode::InodeTable;
use crate::undo::{Change, DirId, FileUndo, NamespaceLog};

/// The hidden directory, inside the backing root so that a rename into it
/// is atomic and cheap, where unlinked and replaced files wait until their
/// removal is durable (or a cut brings them back).
pub(crate) const STASH_DIR: &str = ".powercut-stash";

/// An open file or directory of the mount.
#[derive(Debug)]
pub(crate) enum Handle {
    /// The backing file, shared so an operation can use it while it
    /// changes the rest of the state.
    File { ino: u64, file: Arc<File> },
    /// The entries of the directory when it was opened, so offsets stay
    /// meaningful while it changes.
    Dir {
        entries: Vec<(u64, FileType, OsString)>,
    },
}

/// Everything behind the lock.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) root: PathBuf,
    pub(crate) inodes: InodeTable,
    /// Unsynced data per inode; ordered, so a seeded cut visits the files
    /// in the same order every time.
    pub(crate) files: BTreeMap<u64, FileUndo>,
    pub(crate) namespace: NamespaceLog,
    pub(crate) handles: HashMap<u64, Handle>,
    next_handle: u64,
    pub(crate) injection: Injection,
    next_stash: u64,
}

/// Takes the lock. A panic while it was held (none is expected on a
/// request path) leaves a state no worse than a torn request, so the
/// poison is ignored rather than turned into a second panic.
pub(crate) fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl State {
    /// The state of a fresh mount of `root` (canonical), with an empty
    /// stash: what a previous mount left there was never visible.
    pub(crate) fn new(root: PathBuf) -> io::Result<State> {
        let state = State {
            root,
            inodes: InodeTable::new(),
            files: BTreeMap::new(),
            namespace: NamespaceLog::default(),
            handles: HashMap::new(),
            next_handle: 1,
            injection: Injection::default(),
            next_stash: 0,
        };
        state.empty_stash()?;
        Ok(state)
    }

    /// The backing path of a path relative to the root.
    pub(crate) fn backing(&self, relative: &Path) -> PathBuf {
        self.root.join(relative)
    }

    /// The backing path of inode `ino`.
    pub(crate) fn backing_of(&self, ino: u64) -> io::Result<PathBuf> {
        self.inodes
            .path(ino)
            .map(|relative| self.backing(relative))
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))
    }

    /// Deletes whatever the stash holds and leaves it empty.
    pub(crate) fn empty_stash(&self) -> io::Result<()> {
        let stash = self.root.join(STASH_DIR);
        match fs::remove_dir_all(&stash) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        fs::create_dir(&stash)
    }

    /// A fresh name in the stash, relative to the root.
    pub(crate) fn stash_slot(&mut self) -> PathBuf {
        self.next_stash += 1;
        Path::new(STASH_DIR).join(self.next_stash.to_string())
    }

    /// The identity a directory sync is matched against.
    pub(crate) fn dir_id(&self, relative: &Path) -> io::Result<DirId> {
        Ok(fs::symlink_metadata(self.backing(relative))?.ino())
    }

    pub(crate) fn add_handle(&mut self, handle: Handle) -> u64 {
        let fh = self.next_handle;
        self.next_handle += 1;
        self.handles.insert(fh, handle);
        fh
    }

    /// The open backing file of handle `fh`.
    pub(crate) fn file(&self, fh: u64) -> io::Result<Arc<File>> {
        match self.handles.get(&fh) {
            Some(Handle::File { file, .. }) => Ok(Arc::clone(file)),
            _ => Err(io::Error::from_raw_os_error(libc::EBADF)),
        }
    }

    /// Whether the node `ino` must stay in the table although the kernel
    /// forgot it: its undo state or an open handle still follows it.
    pub(crate) fn needs_node(&self, ino: u64) -> bool {
        self.files.contains_key(&ino)
            || self
                .handles
                .values()
                .any(|h| matches!(h, Handle::File { ino: i, .. } if *i == ino))
    }

    fn file_undo(&mut self, ino: u64, file: &File) -> io::Result<&mut FileUndo> {
        use std::collections::btree_map::Entry;
        match self.files.entry(ino) {
            Entry::Occupied(entry) => Ok(entry.into_mut()),
            // No record means nothing changed since the last sync: the
            // size now is the synced size.
            Entry::Vacant(entry) => Ok(entry.insert(FileUndo::new(file.metadata()?.len()))),
        }
    }

    /// Writes `data` at `offset` of inode `ino` (open as `file`), keeping
    /// what it overwrites.
    pub(crate) fn write(
        &mut self,
        ino: u64,
        file: &File,
        offset: u64,
        data: &[u8],
    ) -> io::Result<()> {
        if self.injection.write_fails() {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let end = offset + data.len() as u64;
        let undo = self.file_undo(ino, file)?;
        undo.capture(file, offset, end)?;
        undo.overwrite(offset, end);
        file.write_all_at(data, offset)
    }

    /// Truncates or extends inode `ino` (open as `file`) to `size`,
    /// keeping the blocks a shrink removes.
    pub(crate) fn set_size(&mut self, ino: u64, file: &File, size: u64) -> io::Result<()> {
        let current = file.metadata()?.len();
        if size == current {
            return Ok(());
        }
        if size > current && self.injection.is_full() {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let undo = self.file_undo(ino, file)?;
        // Growing changes no existing byte; shrinking removes the tail
        // (and zeroes the rest of the block it ends in).
        undo.capture(file, size, current)?;
        file.set_len(size)
    }

    /// Logs a namespace change made in the directories `dirs` (relative).
    pub(crate) fn record(&mut self, change: Change, dirs: &[&Path]) -> io::Result<()> {
        let ids = dirs
            .iter()
            .map(|dir| self.dir_id(dir))
            .collect::<io::Result<Vec<_>>>()?;
        self.namespace.record(change, ids);
        Ok(())
    }

    /// Directory `relative` was synced: deletes the stashed files whose
    /// removal that made durable.
    pub(crate) fn dir_synced(&mut self, relative: &Path) -> io::Result<()> {
        let id = self.dir_id(relative)?;
        for change in self.namespace.dir_synced(id) {
            let stashed = match change {
                Change::Removed { stashed, .. } => stashed,
                Change::Renamed {
                    replaced: Some(stashed),
                    ..
                } => stashed,
                _ => continue,
            };
            let backing = self.backing(&stashed);
            let removed = match fs::symlink_metadata(&backing) {
                Ok(meta) if meta.is_dir() => fs::remove_dir_all(&backing),
                Ok(_) => fs::remove_file(&backing),
                Err(e) => Err(e),
            };
            match removed {
                Ok(()) => self.inodes.mark_gone(&stashed),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}
