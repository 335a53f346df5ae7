//! The FUSE operations: a passthrough to the backing directory that routes
//! every change through the undo record first.
//!
//! Each operation takes the state lock for its whole length; fuser serves
//! requests one at a time on one thread, so the lock is never contended by
//! another request, only by a cut (which is why a cut can wait for it).
//! Every reply carries a zero TTL: the kernel must ask again after a cut
//! rather than trust what it cached, and a negative lookup must reach us
//! (a cut drains the request queue with one).

use std::ffi::{CString, OsStr, OsString};
use std::fs::{self, File, FileTimes, Metadata, OpenOptions, Permissions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, BsdFileFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
    WriteFlags,
};

use crate::inode::ROOT_INO;
use crate::state::{Handle, STASH_DIR, State, lock};
use crate::undo::{BLOCK_BYTES, Change, read_up_to};

/// Nothing is cached by the kernel: see the module doc.
const TTL: Duration = Duration::ZERO;

/// The filesystem fuser serves; the same state is shared with
/// [`crate::PowerCutFs`] for cuts and injected failures.
pub(crate) struct PowerCutFilesystem {
    state: Arc<Mutex<State>>,
}

impl PowerCutFilesystem {
    pub(crate) fn new(state: Arc<Mutex<State>>) -> PowerCutFilesystem {
        PowerCutFilesystem { state }
    }
}

fn errno(e: io::Error) -> Errno {
    Errno::from(e)
}

/// Answers an operation that makes or finds a name.
fn answer_entry(reply: ReplyEntry, result: io::Result<FileAttr>) {
    match result {
        Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
        Err(e) => reply.error(errno(e)),
    }
}

/// Answers an operation with nothing to return but success.
fn answer_empty(reply: ReplyEmpty, result: io::Result<()>) {
    match result {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(e)),
    }
}

fn os_error(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

/// The stash lives in the root and is never seen through the mount.
fn hidden(parent: INodeNo, name: &OsStr) -> bool {
    parent.0 == ROOT_INO && name == STASH_DIR
}

fn system_time(secs: i64, nanos: i64) -> SystemTime {
    let nanos = u32::try_from(nanos).unwrap_or(0);
    let time = if secs >= 0 {
        UNIX_EPOCH.checked_add(Duration::new(secs.unsigned_abs(), nanos))
    } else {
        UNIX_EPOCH
            .checked_sub(Duration::from_secs(secs.unsigned_abs()))
            .and_then(|t| t.checked_add(Duration::from_nanos(u64::from(nanos))))
    };
    time.unwrap_or(UNIX_EPOCH)
}

fn attr_of(ino: u64, meta: &Metadata) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: meta.size(),
        blocks: meta.blocks(),
        atime: system_time(meta.atime(), meta.atime_nsec()),
        mtime: system_time(meta.mtime(), meta.mtime_nsec()),
        ctime: system_time(meta.ctime(), meta.ctime_nsec()),
        crtime: UNIX_EPOCH,
        kind: FileType::from_std(meta.file_type()).unwrap_or(FileType::RegularFile),
        perm: (meta.mode() & 0o7777) as u16,
        nlink: u32::try_from(meta.nlink()).unwrap_or(u32::MAX),
        uid: meta.uid(),
        gid: meta.gid(),
        rdev: u32::try_from(meta.rdev()).unwrap_or(0),
        blksize: BLOCK_BYTES as u32,
        flags: 0,
    }
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| os_error(libc::EINVAL))
}

/// Opens a backing file read-write whatever the caller asked: the undo
/// record reads pre-images through the handle a write comes on (the
/// kernel's own mode checks already hold the caller to its access mode).
/// Flags such as `O_DIRECT`, `O_SYNC` or `O_APPEND` are not passed on: the
/// kernel sends every write with its offset, and durability is what this
/// filesystem models, not what it asks of the backing one.
fn open_backing(path: &Path, flags: i32, create_mode: Option<u32>) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).write(true);
    if let Some(mode) = create_mode {
        options.create_new(true).mode(mode);
    }
    match options.open(path) {
        Err(e) if create_mode.is_none() && flags & libc::O_ACCMODE == libc::O_RDONLY => {
            tracing::debug!(path = %path.display(), error = %e, "read-write open refused, opening read-only");
            File::open(path)
        }
        other => other,
    }
}

fn is_empty_dir(path: &Path) -> io::Result<bool> {
    Ok(fs::read_dir(path)?.next().is_none())
}

impl PowerCutFilesystem {
    fn child(state: &State, parent: INodeNo, name: &OsStr) -> io::Result<PathBuf> {
        let parent = state
            .inodes
            .path(parent.0)
            .ok_or_else(|| os_error(libc::ENOENT))?;
        Ok(parent.join(name))
    }

    fn entry(state: &mut State, relative: &Path) -> io::Result<FileAttr> {
        let meta = fs::symlink_metadata(state.backing(relative))?;
        let ino = state.inodes.look_up(relative);
        Ok(attr_of(ino, &meta))
    }

    fn do_lookup(&self, parent: INodeNo, name: &OsStr) -> io::Result<FileAttr> {
        if hidden(parent, name) {
            return Err(os_error(libc::ENOENT));
        }
        let mut state = lock(&self.state);
        let relative = Self::child(&state, parent, name)?;
        Self::entry(&mut state, &relative)
    }

    fn do_getattr(&self, ino: INodeNo, fh: Option<FileHandle>) -> io::Result<FileAttr> {
        let state = lock(&self.state);
        Self::attr_now(&state, ino.0, fh)
    }

    /// Prefers the open handle: an unlinked file may have no path left.
    fn attr_now(state: &State, ino: u64, fh: Option<FileHandle>) -> io::Result<FileAttr> {
        let meta = match fh.and_then(|fh| state.file(fh.0).ok()) {
            Some(file) => file.metadata()?,
            None => fs::symlink_metadata(state.backing_of(ino)?)?,
        };
        Ok(attr_of(ino, &meta))
    }

    #[allow(clippy::too_many_arguments)] // one per attribute the kernel may set
    fn do_setattr(
        &self,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        fh: Option<FileHandle>,
    ) -> io::Result<FileAttr> {
        let mut state = lock(&self.state);
        let ino = ino.0;
        // The open handle when the kernel names one (ftruncate, fchmod):
        // an unlinked file may have no path left.
        let open = fh.and_then(|fh| state.file(fh.0).ok());
        let path = state.backing_of(ino);
        let path = || -> io::Result<&Path> {
            path.as_deref()
                .map_err(|e| os_error(e.raw_os_error().unwrap_or(libc::ENOENT)))
        };
        let target = |open: &Option<Arc<File>>| -> io::Result<Arc<File>> {
            match open {
                Some(file) => Ok(Arc::clone(file)),
                None => Ok(Arc::new(open_backing(path()?, libc::O_RDWR, None)?)),
            }
        };
        if let Some(size) = size {
            let file = target(&open)?;
            state.set_size(ino, &file, size)?;
        }
        if let Some(mode) = mode {
            let permissions = Permissions::from_mode(mode & 0o7777);
            match &open {
                Some(file) => file.set_permissions(permissions)?,
                None => fs::set_permissions(path()?, permissions)?,
            }
        }
        if uid.is_some() || gid.is_some() {
            match &open {
                Some(file) => std::os::unix::fs::fchown(file.as_ref(), uid, gid)?,
                None => std::os::unix::fs::lchown(path()?, uid, gid)?,
            }
        }
        if atime.is_some() || mtime.is_some() {
            let time = |t: TimeOrNow| match t {
                TimeOrNow::SpecificTime(t) => t,
                TimeOrNow::Now => SystemTime::now(),
            };
            let mut times = FileTimes::new();
            if let Some(t) = atime {
                times = times.set_accessed(time(t));
            }
            if let Some(t) = mtime {
                times = times.set_modified(time(t));
            }
            let file = match &open {
                Some(file) => Arc::clone(file),
                None => Arc::new(File::open(path()?)?),
            };
            file.set_times(times)?;
        }
        Self::attr_now(&state, ino, fh)
    }

    fn do_mknod(
        &self,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
    ) -> io::Result<FileAttr> {
        // Only regular files: neither SQLite nor the host makes devices,
        // fifos or sockets, and their undo would need a kind of its own.
        if mode & libc::S_IFMT != libc::S_IFREG {
            return Err(os_error(libc::EPERM));
        }
        if hidden(parent, name) {
            return Err(os_error(libc::EPERM));
        }
        let mut state = lock(&self.state);
        let relative = Self::child(&state, parent, name)?;
        let parent_path = relative.parent().map(Path::to_path_buf).unwrap_or_default();
        open_backing(
            &state.backing(&relative),
            libc::O_RDWR,
            Some(mode & !umask & 0o7777),
        )?;
        state.record(
            Change::Created {
                path: relative.clone(),
            },
            &[&parent_path],
        )?;
        Self::entry(&mut state, &relative)
    }

    /// A second name for a file (the host makes an object's file from a
    /// synced template this way). The new name is a namespace change like
    /// a creation: undone, it goes, and the first name stays.
    fn do_link(&self, ino: INodeNo, parent: INodeNo, name: &OsStr) -> io::Result<FileAttr> {
        if hidden(parent, name) {
            return Err(os_error(libc::EPERM));
        }
        let mut state = lock(&self.state);
        let existing = state.backing_of(ino.0)?;
        let relative = Self::child(&state, parent, name)?;
        let parent_path = relative.parent().map(Path::to_path_buf).unwrap_or_default();
        fs::hard_link(&existing, state.backing(&relative))?;
        state.record(
            Change::Created {
                path: relative.clone(),
            },
            &[&parent_path],
        )?;
        Self::entry(&mut state, &relative)
    }

    fn do_mkdir(
        &self,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
    ) -> io::Result<FileAttr> {
        if hidden(parent, name) {
            return Err(os_error(libc::EPERM));
        }
        let mut state = lock(&self.state);
        let relative = Self::child(&state, parent, name)?;
        let parent_path = relative.parent().map(Path::to_path_buf).unwrap_or_default();
        fs::DirBuilder::new()
            .mode(mode & !umask & 0o7777)
            .create(state.backing(&relative))?;
        state.record(
            Change::Created {
                path: relative.clone(),
            },
            &[&parent_path],
        )?;
        Self::entry(&mut state, &relative)
    }

    /// Unlink and rmdir: the entry moves into the stash, so that a cut
    /// can bring it back until a sync of its directory makes it durable.
    fn remove(&self, parent: INodeNo, name: &OsStr, directory: bool) -> io::Result<()> {
        if hidden(parent, name) {
            return Err(os_error(libc::ENOENT));
        }
        let mut state = lock(&self.state);
        let relative = Self::child(&state, parent, name)?;
        let parent_path = relative.parent().map(Path::to_path_buf).unwrap_or_default();
        let backing = state.backing(&relative);
        let meta = fs::symlink_metadata(&backing)?;
        match (directory, meta.is_dir()) {
            (false, true) => return Err(os_error(libc::EISDIR)),
            (true, false) => return Err(os_error(libc::ENOTDIR)),
            (true, true) if !is_empty_dir(&backing)? => return Err(os_error(libc::ENOTEMPTY)),
            _ => {}
        }
        let stashed = state.stash_slot();
        fs::rename(&backing, state.backing(&stashed))?;
        state.inodes.move_path(&relative, &stashed);
        state.record(
            Change::Removed {
                path: relative,
                stashed,
            },
            &[&parent_path],
        )
    }

    fn do_rename(
        &self,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
    ) -> io::Result<()> {
        if flags.intersects(RenameFlags::RENAME_EXCHANGE | RenameFlags::RENAME_WHITEOUT) {
            return Err(os_error(libc::EINVAL));
        }
        if hidden(parent, name) {
            return Err(os_error(libc::ENOENT));
        }
        if hidden(newparent, newname) {
            return Err(os_error(libc::EPERM));
        }
        let mut state = lock(&self.state);
        let from = Self::child(&state, parent, name)?;
        let to = Self::child(&state, newparent, newname)?;
        let from_meta = fs::symlink_metadata(state.backing(&from))?;
        if from == to {
            return Ok(());
        }
        if to.starts_with(&from) {
            return Err(os_error(libc::EINVAL));
        }
        let to_backing = state.backing(&to);
        let replaced = match fs::symlink_metadata(&to_backing) {
            Ok(to_meta) => {
                if flags.contains(RenameFlags::RENAME_NOREPLACE) {
                    return Err(os_error(libc::EEXIST));
                }
                match (from_meta.is_dir(), to_meta.is_dir()) {
                    (true, false) => return Err(os_error(libc::ENOTDIR)),
                    (false, true) => return Err(os_error(libc::EISDIR)),
                    (true, true) if !is_empty_dir(&to_backing)? => {
                        return Err(os_error(libc::ENOTEMPTY));
                    }
                    _ => {}
                }
                let slot = state.stash_slot();
                fs::rename(&to_backing, state.backing(&slot))?;
                state.inodes.move_path(&to, &slot);
                Some(slot)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        if let Err(e) = fs::rename(state.backing(&from), &to_backing) {
            // Put the replaced file back: the rename did not happen.
            if let Some(slot) = &replaced {
                fs::rename(state.backing(slot), &to_backing)?;
                state.inodes.move_path(slot, &to);
            }
            return Err(e);
        }
        state.inodes.move_path(&from, &to);
        let from_dir = from.parent().map(Path::to_path_buf).unwrap_or_default();
        let to_dir = to.parent().map(Path::to_path_buf).unwrap_or_default();
        state.record(
            Change::Renamed { from, to, replaced },
            &[&from_dir, &to_dir],
        )
    }

    fn do_open(&self, ino: INodeNo, flags: OpenFlags) -> io::Result<u64> {
        let mut state = lock(&self.state);
        let file = Arc::new(open_backing(&state.backing_of(ino.0)?, flags.0, None)?);
        // The kernel truncates through setattr, but a kernel that passes
        // O_TRUNC through open must still get an undoable truncation.
        if flags.0 & libc::O_TRUNC != 0 && flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            state.set_size(ino.0, &file, 0)?;
        }
        Ok(state.add_handle(Handle::File { ino: ino.0, file }))
    }

    fn do_create(
        &self,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
    ) -> io::Result<(FileAttr, u64)> {
        if hidden(parent, name) {
            return Err(os_error(libc::EPERM));
        }
        let mut state = lock(&self.state);
        let relative = Self::child(&state, parent, name)?;
        let parent_path = relative.parent().map(Path::to_path_buf).unwrap_or_default();
        let backing = state.backing(&relative);
        let created = match open_backing(&backing, flags, Some(mode & !umask & 0o7777)) {
            Ok(file) => {
                state.record(
                    Change::Created {
                        path: relative.clone(),
                    },
                    &[&parent_path],
                )?;
                Some(file)
            }
            // The kernel asks to create only what it did not find, so this
            // is an existing file opened with O_CREAT but not O_EXCL.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) && flags & libc::O_EXCL == 0 => None,
            Err(e) => return Err(e),
        };
        let attr = Self::entry(&mut state, &relative)?;
        let ino = attr.ino.0;
        let file = match created {
            Some(file) => Arc::new(file),
            None => {
                let file = Arc::new(open_backing(&backing, flags, None)?);
                if flags & libc::O_TRUNC != 0 {
                    state.set_size(ino, &file, 0)?;
                }
                file
            }
        };
        let attr = attr_of(ino, &file.metadata()?);
        let fh = state.add_handle(Handle::File { ino, file });
        Ok((attr, fh))
    }

    fn do_read(&self, fh: FileHandle, offset: u64, size: u32) -> io::Result<Vec<u8>> {
        let file = lock(&self.state).file(fh.0)?;
        read_up_to(&file, offset, u64::from(size))
    }

    fn do_write(&self, ino: INodeNo, fh: FileHandle, offset: u64, data: &[u8]) -> io::Result<u32> {
        let mut state = lock(&self.state);
        let file = state.file(fh.0)?;
        state.write(ino.0, &file, offset, data)?;
        u32::try_from(data.len()).map_err(|_| os_error(libc::EINVAL))
    }

    fn do_fsync(&self, ino: INodeNo, fh: FileHandle) -> io::Result<()> {
        let mut state = lock(&self.state);
        let ino = ino.0;
        if state.injection.sync_fails() {
            if let Some(undo) = state.files.get_mut(&ino) {
                undo.poison();
            }
            return Err(os_error(libc::EIO));
        }
        if state.files.contains_key(&ino) {
            let size = match state.file(fh.0) {
                Ok(file) => file.metadata()?.len(),
                Err(_) => fs::metadata(state.backing_of(ino)?)?.len(),
            };
            if state
                .files
                .get_mut(&ino)
                .is_some_and(|undo| undo.synced(size))
            {
                state.files.remove(&ino);
            }
        }
        Ok(())
    }

    fn do_opendir(&self, ino: INodeNo) -> io::Result<u64> {
        let mut state = lock(&self.state);
        let relative = state
            .inodes
            .path(ino.0)
            .map(Path::to_path_buf)
            .ok_or_else(|| os_error(libc::ENOENT))?;
        let parent_ino = relative
            .parent()
            .and_then(|p| state.inodes.ino_of(p))
            .unwrap_or(ROOT_INO);
        let mut entries = vec![
            (ino.0, FileType::Directory, OsString::from(".")),
            (parent_ino, FileType::Directory, OsString::from("..")),
        ];
        for entry in fs::read_dir(state.backing(&relative))? {
            let entry = entry?;
            let name = entry.file_name();
            if ino.0 == ROOT_INO && name == STASH_DIR {
                continue;
            }
            let meta = entry.metadata()?;
            let child_ino = state
                .inodes
                .ino_of(&relative.join(&name))
                .unwrap_or(meta.ino());
            let kind = FileType::from_std(meta.file_type()).unwrap_or(FileType::RegularFile);
            entries.push((child_ino, kind, name));
        }
        Ok(state.add_handle(Handle::Dir { entries }))
    }

    fn do_fsyncdir(&self, ino: INodeNo) -> io::Result<()> {
        let mut state = lock(&self.state);
        let relative = state
            .inodes
            .path(ino.0)
            .map(Path::to_path_buf)
            .ok_or_else(|| os_error(libc::ENOENT))?;
        state.dir_synced(&relative)
    }

    fn do_statfs(&self) -> io::Result<libc::statvfs> {
        let root = c_path(&lock(&self.state).root)?;
        let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: `root` is a valid NUL-terminated path and `stat` points to
        // writable memory of the right type, initialized on success.
        let rc = unsafe { libc::statvfs(root.as_ptr(), stat.as_mut_ptr()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: statvfs returned 0, so it filled `stat`.
        Ok(unsafe { stat.assume_init() })
    }

    fn do_access(&self, ino: INodeNo, mask: AccessFlags) -> io::Result<()> {
        let path = c_path(&lock(&self.state).backing_of(ino.0)?)?;
        // SAFETY: `path` is a valid NUL-terminated string for the call.
        let rc = unsafe { libc::access(path.as_ptr(), mask.bits()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Filesystem for PowerCutFilesystem {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        answer_entry(reply, self.do_lookup(parent, name));
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let mut state = lock(&self.state);
        let keep = state.needs_node(ino.0);
        state.inodes.forget(ino.0, nlookup, keep);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.do_getattr(ino, fh) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        match self.do_setattr(ino, mode, uid, gid, size, atime, mtime, fh) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let target = lock(&self.state).backing_of(ino.0).and_then(fs::read_link);
        match target {
            Ok(target) => reply.data(target.as_os_str().as_bytes()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mknod(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        answer_entry(reply, self.do_mknod(parent, name, mode, umask));
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        answer_entry(reply, self.do_mkdir(parent, name, mode, umask));
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        answer_entry(reply, self.do_link(ino, newparent, newname));
    }

    /// No extended attributes. `ENOSYS` (fuser's default, without its
    /// warning) tells the kernel once, and it stops asking on every write.
    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: fuser::ReplyXattr,
    ) {
        reply.error(Errno::ENOSYS);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        answer_empty(reply, self.remove(parent, name, false));
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        answer_empty(reply, self.remove(parent, name, true));
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        answer_empty(
            reply,
            self.do_rename(parent, name, newparent, newname, flags),
        );
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        // No FOPEN_DIRECT_IO: shared writable mmap (SQLite's -shm) needs
        // the page cache; the kernel still sends every write, since no
        // writeback cache is negotiated.
        //
        // FOPEN_KEEP_CACHE: without it every open drops the file's page
        // cache, writing back what a live process changed through a shared
        // mapping and discarding the pages. Once the disk is full
        // (`fill_at_write`) those writes fail, so another process opening
        // a -shm would wipe a running SQLite's WAL index: its readers then
        // miss committed frames, a state no local filesystem shows before
        // the power goes. Keeping the cache is safe: every change to a
        // file's data comes through us (write(2) and the write-back of
        // mapped pages alike), and a cut invalidates every inode's cache
        // itself.
        match self.do_open(ino, flags) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.do_read(fh, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.do_write(ino, fh, offset, data) {
            Ok(written) => reply.written(written),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        lock(&self.state).handles.remove(&fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // fdatasync makes data and size durable exactly as fsync does:
        // the size is the metadata a database's durability depends on.
        answer_empty(reply, self.do_fsync(ino, fh));
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.do_opendir(ino) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let state = lock(&self.state);
        let Some(Handle::Dir { entries }) = state.handles.get(&fh.0) else {
            reply.error(Errno::EBADF);
            return;
        };
        let skip = usize::try_from(offset).unwrap_or(usize::MAX);
        for (index, (ino, kind, name)) in entries.iter().enumerate().skip(skip) {
            if reply.add(INodeNo(*ino), index as u64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        lock(&self.state).handles.remove(&fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Not counted by `fail_fsync`: the injected EIO models a data
        // writeback error, and directory syncs have no pages to lose.
        answer_empty(reply, self.do_fsyncdir(ino));
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.do_statfs() {
            Ok(s) => reply.statfs(
                s.f_blocks,
                s.f_bfree,
                s.f_bavail,
                s.f_files,
                s.f_ffree,
                u32::try_from(s.f_bsize).unwrap_or(BLOCK_BYTES as u32),
                u32::try_from(s.f_namemax).unwrap_or(255),
                u32::try_from(s.f_frsize).unwrap_or(BLOCK_BYTES as u32),
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn access(&self, _req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        answer_empty(reply, self.do_access(ino, mask));
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        match self.do_create(parent, name, mode, umask, flags) {
            Ok((attr, fh)) => reply.created(
                &TTL,
                &attr,
                Generation(0),
                FileHandle(fh),
                FopenFlags::empty(),
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _length: u64,
        _mode: i32,
        reply: ReplyEmpty,
    ) {
        // Preallocation would be a size change the undo record does not
        // model; SQLite and glibc's posix_fallocate fall back to writes.
        reply.error(Errno::EOPNOTSUPP);
    }
}
