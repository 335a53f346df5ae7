//! The SQLite VFS of a host journal: the platform's own VFS (`unix`),
//! with every write and truncation of a WAL file under the data directory
//! also appended to the journal, and a WAL sync (SQLite asks for one only
//! before a checkpoint) also syncing the journal.
//!
//! A shim file is the platform's file with one word in front of it: SQLite
//! allocates `szOsFile` bytes per open file, here a [`ShimFile`] followed
//! by the platform's file, and every method but `xWrite`, `xTruncate`,
//! `xSync` and `xClose` goes straight to the platform's.
//!
//! A commit's frames reach a WAL file as one write: SQLite writes each
//! frame as two (its 24-byte header, then its page), so a commit of two
//! pages cost four `pwrite`s. The shim holds the writes that append to the
//! log and hands them to the platform's file, and to the journal, once the
//! commit frame's page is in (its header carries the database size, which
//! only a commit frame does), or before anything else touches the file.
//! A write anywhere but the log's end (a spilled page written again in
//! place, the checksums SQLite rewrites after such a commit's last frame)
//! goes through at once, after what is held. A commit that returned has
//! therefore written all of it, as before; and the journal holds no record
//! of bytes the file was not given.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::{Arc, Weak};

use rusqlite::ffi;

use super::{Journal, Wal};

/// What a registered VFS knows: the platform's VFS and its journal.
struct VfsData {
    root: *mut ffi::sqlite3_vfs,
    journal: Weak<Journal>,
}

/// One open file: SQLite's header (our methods) and, for a WAL under the
/// data directory, its name in the journal. The platform's file follows at
/// [`REAL_OFFSET`].
#[repr(C)]
struct ShimFile {
    base: ffi::sqlite3_file,
    wal: Option<WalLog>,
}

/// A journaled WAL: where its writes go.
struct WalLog {
    journal: Arc<Journal>,
    wal: Arc<Wal>,
    /// Writes held back until their commit ends (see the module docs).
    held: Held,
}

/// Contiguous writes of one WAL not yet handed to its file.
#[derive(Default)]
struct Held {
    /// Where `bytes` start in the file.
    offset: u64,
    bytes: Vec<u8>,
    /// The last write was a commit frame's header: its page ends the commit.
    commit_next: bool,
    /// The end of the log as written (or held) so far: only writes there,
    /// which append frames, are held. `None` until the first write.
    end: Option<u64>,
}

/// A WAL frame's header (SQLite's `WAL_FRAME_HDRSIZE`); no other write to
/// a WAL has this size (its own header is 32 bytes, pages at least 512).
const FRAME_HEADER: usize = 24;

/// Held writes beyond this are written at once, commit or not: a large
/// transaction does not hold its whole WAL growth in memory.
const HOLD_AT_MOST: usize = 256 << 10;

/// The most bytes one write hands to the platform's file.
const WRITE_AT_MOST: usize = 64 << 10;

/// Where the platform's file starts, aligned for any of its fields.
const REAL_OFFSET: usize = std::mem::size_of::<ShimFile>().next_multiple_of(16);

/// A VFS registered for one journal. It stays registered (and its memory
/// alive) until the journal is dropped; then it is unregistered, and its
/// memory is left allocated, since a connection of another owner could in
/// principle still name it (opening a file through it then fails cleanly).
pub(super) struct Registration {
    vfs: *mut ffi::sqlite3_vfs,
    name: CString,
}

// The pointers are only handed to SQLite, which is thread-safe here.
unsafe impl Send for Registration {}
unsafe impl Sync for Registration {}

impl Registration {
    /// Registers a VFS named `name` that journals into `journal`.
    pub(super) fn register(name: &str, journal: Weak<Journal>) -> Result<Self, String> {
        let name = CString::new(name).map_err(|e| e.to_string())?;
        // SAFETY: `sqlite3_vfs_find(NULL)` returns the default VFS, which
        // SQLite keeps registered for the life of the process.
        let root = unsafe { ffi::sqlite3_vfs_find(std::ptr::null()) };
        if root.is_null() {
            return Err("SQLite has no default VFS".into());
        }
        // SAFETY: `root` is a live, registered VFS.
        let mut vfs = unsafe { *root };
        let real_size = usize::try_from(vfs.szOsFile).map_err(|e| e.to_string())?;
        vfs.szOsFile = c_int::try_from(REAL_OFFSET + real_size).map_err(|e| e.to_string())?;
        vfs.pNext = std::ptr::null_mut();
        vfs.zName = name.as_ptr();
        // The other methods are the platform's own: the `unix` VFS's ignore
        // the VFS pointer they are given (only its `xOpen` reads its
        // `pAppData`, and ours passes the platform's VFS on).
        vfs.pAppData = Box::into_raw(Box::new(VfsData { root, journal })).cast();
        vfs.xOpen = Some(shim_open);
        vfs.xDelete = Some(shim_delete);
        let vfs = Box::into_raw(Box::new(vfs));
        // SAFETY: `vfs` is a valid VFS whose memory is never freed.
        let rc = unsafe { ffi::sqlite3_vfs_register(vfs, 0) };
        if rc != ffi::SQLITE_OK {
            return Err(format!("sqlite3_vfs_register failed with code {rc}"));
        }
        Ok(Registration { vfs, name })
    }

    pub(super) fn name(&self) -> &str {
        self.name.to_str().unwrap_or_default()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: `vfs` was registered by `register`. Its memory (and the
        // name's, which SQLite may still compare against) is leaked on
        // purpose: see the type's comment.
        unsafe {
            ffi::sqlite3_vfs_unregister(self.vfs);
        }
        std::mem::forget(std::mem::take(&mut self.name));
    }
}

/// The platform's file inside a shim file.
///
/// # Safety
/// `file` must point to a shim file allocated with our `szOsFile`.
unsafe fn real(file: *mut ffi::sqlite3_file) -> *mut ffi::sqlite3_file {
    // SAFETY: per the contract, the allocation extends past REAL_OFFSET.
    unsafe { file.cast::<u8>().add(REAL_OFFSET).cast() }
}

/// The platform file's methods, or `None` for a file it failed to open.
///
/// # Safety
/// As for [`real`].
unsafe fn methods<'a>(file: *mut ffi::sqlite3_file) -> Option<&'a ffi::sqlite3_io_methods> {
    // SAFETY: the real file's header is initialised by its xOpen.
    unsafe { (*real(file)).pMethods.as_ref() }
}

/// Calls the platform file's method `$name` with the real file and the
/// remaining arguments; a missing method is an I/O error.
macro_rules! forward {
    ($file:expr, $name:ident $(, $arg:expr)*) => {{
        // SAFETY: SQLite hands us files our xOpen opened.
        match unsafe { methods($file) }.and_then(|m| m.$name) {
            // SAFETY: the platform's method, called with its own file.
            Some(method) => unsafe { method(real($file) $(, $arg)*) },
            None => ffi::SQLITE_IOERR,
        }
    }};
}

unsafe extern "C" fn shim_open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let shim = file.cast::<ShimFile>();
    // SAFETY: SQLite passes our VFS and a block of our szOsFile bytes.
    unsafe {
        std::ptr::addr_of_mut!((*shim).base.pMethods).write(std::ptr::null());
        std::ptr::addr_of_mut!((*shim).wal).write(None);
    }
    // SAFETY: pAppData was set by `register` and is never freed.
    let data = unsafe { &*(*vfs).pAppData.cast::<VfsData>() };
    // SAFETY: the platform's VFS, on the file that follows ours.
    let Some(open) = (unsafe { (*data.root).xOpen }) else {
        return ffi::SQLITE_CANTOPEN;
    };
    let rc = unsafe { open(data.root, name, real(file), flags, out_flags) };
    if rc != ffi::SQLITE_OK {
        return rc;
    }
    if flags & ffi::SQLITE_OPEN_WAL != 0 {
        let path = if name.is_null() {
            None
        } else {
            // SAFETY: SQLite names a WAL with a NUL-terminated path.
            Some(unsafe { CStr::from_ptr(name as *const c_char) }.to_bytes())
        };
        let wal = data.journal.upgrade().and_then(|journal| {
            let wal = journal.wal(path?)?;
            Some(WalLog {
                journal,
                wal,
                held: Held::default(),
            })
        });
        match wal {
            Some(wal) => {
                // SAFETY: initialised to `None` above.
                unsafe { (*shim).wal = Some(wal) };
            }
            None => {
                tracing::error!(
                    path = %path.map(String::from_utf8_lossy).unwrap_or_default(),
                    "a WAL outside the journal's data directory (or of a dropped journal) cannot be journaled"
                );
                forward!(file, xClose);
                return ffi::SQLITE_CANTOPEN;
            }
        }
    }
    // SAFETY: the platform's file is open: route SQLite through ours.
    unsafe { (*shim).base.pMethods = &SHIM_METHODS };
    ffi::SQLITE_OK
}

/// SQLite deletes a WAL when its last connection closes, after a
/// checkpoint that copied every frame into the database file: the
/// journal's records of it are settled.
unsafe extern "C" fn shim_delete(
    vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    sync_dir: c_int,
) -> c_int {
    // SAFETY: pAppData was set by `register` and is never freed.
    let data = unsafe { &*(*vfs).pAppData.cast::<VfsData>() };
    // SAFETY: the platform's VFS.
    let Some(delete) = (unsafe { (*data.root).xDelete }) else {
        return ffi::SQLITE_IOERR_DELETE;
    };
    // SAFETY: the platform's method with its own VFS and SQLite's name.
    let rc = unsafe { delete(data.root, name, sync_dir) };
    if (rc == ffi::SQLITE_OK || rc == ffi::SQLITE_IOERR_DELETE_NOENT)
        && !name.is_null()
        && let Some(journal) = data.journal.upgrade()
    {
        // SAFETY: SQLite names the file with a NUL-terminated path.
        journal.deleted(unsafe { CStr::from_ptr(name) }.to_bytes());
    }
    rc
}

/// The journal of a shim file, if it is a journaled WAL.
///
/// # Safety
/// `file` must be a shim file opened by [`shim_open`].
unsafe fn wal_of<'a>(file: *mut ffi::sqlite3_file) -> Option<&'a WalLog> {
    // SAFETY: per the contract.
    unsafe { (*file.cast::<ShimFile>()).wal.as_ref() }
}

/// The journaled WAL of a shim file, for a method that changes what it
/// holds back. SQLite calls one file's methods from one thread at a time.
///
/// # Safety
/// As for [`wal_of`], and no other reference to the file's `WalLog` may
/// be alive.
unsafe fn wal_of_mut<'a>(file: *mut ffi::sqlite3_file) -> Option<&'a mut WalLog> {
    // SAFETY: per the contract.
    unsafe { (*file.cast::<ShimFile>()).wal.as_mut() }
}

/// Hands the held writes of `file` to its platform file, then to the
/// journal. Every method but `xWrite` calls this first, so that the file
/// is whole whenever anything looks at it.
///
/// # Safety
/// `file` must be a shim file opened by [`shim_open`].
unsafe fn release(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: per the contract; the reference ends with this function.
    let Some(wal) = (unsafe { wal_of_mut(file) }) else {
        return ffi::SQLITE_OK;
    };
    let held = &mut wal.held;
    held.commit_next = false;
    if held.bytes.is_empty() {
        return ffi::SQLITE_OK;
    }
    // The platform's `xWrite` takes at most 128 KiB less one byte at a
    // time (`unix` masks larger counts and reports a full disk).
    let mut rc = ffi::SQLITE_OK;
    let mut offset = held.offset;
    for chunk in held.bytes.chunks(WRITE_AT_MOST) {
        let (Ok(amount), Ok(at)) = (c_int::try_from(chunk.len()), i64::try_from(offset)) else {
            rc = ffi::SQLITE_IOERR_WRITE;
            break;
        };
        rc = forward!(file, xWrite, chunk.as_ptr().cast(), amount, at);
        if rc != ffi::SQLITE_OK {
            break;
        }
        offset += chunk.len() as u64;
    }
    if rc == ffi::SQLITE_OK {
        wal.journal.wrote(&wal.wal, held.offset, &held.bytes);
    }
    // Written or failed, the bytes are SQLite's to write again: a failed
    // write fails the commit, which writes its frames anew.
    held.bytes.clear();
    if held.bytes.capacity() > HOLD_AT_MOST {
        held.bytes.shrink_to(HOLD_AT_MOST);
    }
    rc
}

/// Runs `$body` once the held writes of `$file` are written; a failure to
/// write them is the method's error.
macro_rules! released {
    ($file:expr, $body:expr) => {{
        // SAFETY: SQLite hands us files our xOpen opened.
        match unsafe { release($file) } {
            ffi::SQLITE_OK => $body,
            rc => rc,
        }
    }};
}

unsafe extern "C" fn shim_close(file: *mut ffi::sqlite3_file) -> c_int {
    // A failed write of held bytes is reported; the file closes anyway.
    // SAFETY: opened by shim_open.
    let released = unsafe { release(file) };
    let rc = forward!(file, xClose);
    let rc = if released == ffi::SQLITE_OK {
        rc
    } else {
        released
    };
    // SAFETY: opened by shim_open; SQLite closes a file once.
    unsafe {
        (*file.cast::<ShimFile>()).wal = None;
    }
    rc
}

unsafe extern "C" fn shim_read(
    file: *mut ffi::sqlite3_file,
    buf: *mut c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    released!(file, forward!(file, xRead, buf, amount, offset))
}

unsafe extern "C" fn shim_write(
    file: *mut ffi::sqlite3_file,
    buf: *const c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    let len = usize::try_from(amount).unwrap_or(0);
    let Ok(start) = u64::try_from(offset) else {
        return ffi::SQLITE_IOERR_WRITE;
    };
    // SAFETY: opened by shim_open; the reference ends in this block.
    let appends = match unsafe { wal_of_mut(file) } {
        None => return forward!(file, xWrite, buf, amount, offset),
        Some(wal) => {
            let held = &mut wal.held;
            if start == 0 && held.bytes.is_empty() {
                // A new WAL header: the log starts over.
                held.end = Some(0);
            }
            held.end.is_none_or(|end| end == start)
        }
    };
    let bytes = if len == 0 || buf.is_null() {
        &[][..]
    } else {
        // SAFETY: SQLite passes `amount` readable bytes at `buf`.
        unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) }
    };
    if !appends {
        // Written again in place: what is held goes first, then this.
        // SAFETY: opened by shim_open; no reference to its WalLog lives.
        let rc = unsafe { release(file) };
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        let rc = forward!(file, xWrite, buf, amount, offset);
        // SAFETY: as above; `release` is done with its reference.
        if rc == ffi::SQLITE_OK
            && let Some(wal) = unsafe { wal_of_mut(file) }
        {
            wal.journal.wrote(&wal.wal, start, bytes);
            let end = start + bytes.len() as u64;
            wal.held.end = Some(match wal.held.end {
                // A header while writes were held (they went first): the
                // log starts over.
                _ if start == 0 => end,
                Some(known) => known.max(end),
                None => end,
            });
        }
        return rc;
    }
    // SAFETY: as above.
    let Some(wal) = (unsafe { wal_of_mut(file) }) else {
        return ffi::SQLITE_IOERR_WRITE;
    };
    let held = &mut wal.held;
    let ends_commit = held.commit_next;
    if held.bytes.is_empty() {
        held.offset = start;
    }
    held.bytes.extend_from_slice(bytes);
    held.end = Some(start + bytes.len() as u64);
    // A frame header's bytes 4..8 hold the database size after a commit
    // frame, and zero in any other frame.
    held.commit_next = bytes.len() == FRAME_HEADER && bytes[4..8] != [0; 4];
    if ends_commit || held.bytes.len() > HOLD_AT_MOST {
        // SAFETY: opened by shim_open; `held` is not used past here.
        return unsafe { release(file) };
    }
    ffi::SQLITE_OK
}

unsafe extern "C" fn shim_truncate(
    file: *mut ffi::sqlite3_file,
    size: ffi::sqlite3_int64,
) -> c_int {
    let rc = released!(file, forward!(file, xTruncate, size));
    // SAFETY: opened by shim_open; `release` is done with its reference.
    if let Some(wal) = unsafe { wal_of_mut(file) } {
        // The next write says where the log goes on.
        wal.held.end = None;
    }
    // SAFETY: opened by shim_open.
    if rc == ffi::SQLITE_OK
        && let Some(wal) = unsafe { wal_of(file) }
    {
        wal.journal.truncated(&wal.wal, size as u64);
    }
    rc
}

/// SQLite syncs a WAL (at `synchronous=NORMAL`) only before it copies the
/// WAL's pages into the database at a checkpoint. The journal must hold
/// every write of the WAL before that: a replay after a power cut must not
/// bring back a shorter WAL over a database that already holds more. The
/// journal's sync is the WAL's: the file itself is left to the page cache.
unsafe extern "C" fn shim_sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    // SAFETY: opened by shim_open.
    let rc = unsafe { release(file) };
    if rc != ffi::SQLITE_OK {
        return rc;
    }
    // SAFETY: opened by shim_open.
    match unsafe { wal_of(file) } {
        Some(wal) => match wal.journal.sync() {
            Ok(()) => ffi::SQLITE_OK,
            Err(error) => {
                tracing::error!(%error, "the journal could not be synced before a checkpoint");
                ffi::SQLITE_IOERR_FSYNC
            }
        },
        None => forward!(file, xSync, flags),
    }
}

unsafe extern "C" fn shim_file_size(
    file: *mut ffi::sqlite3_file,
    size: *mut ffi::sqlite3_int64,
) -> c_int {
    released!(file, forward!(file, xFileSize, size))
}

unsafe extern "C" fn shim_lock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    forward!(file, xLock, level)
}

unsafe extern "C" fn shim_unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    forward!(file, xUnlock, level)
}

unsafe extern "C" fn shim_check_reserved_lock(
    file: *mut ffi::sqlite3_file,
    out: *mut c_int,
) -> c_int {
    forward!(file, xCheckReservedLock, out)
}

unsafe extern "C" fn shim_file_control(
    file: *mut ffi::sqlite3_file,
    op: c_int,
    arg: *mut c_void,
) -> c_int {
    released!(file, forward!(file, xFileControl, op, arg))
}

unsafe extern "C" fn shim_sector_size(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: opened by shim_open.
    match unsafe { methods(file) }.and_then(|m| m.xSectorSize) {
        // SAFETY: the platform's method on its own file.
        Some(method) => unsafe { method(real(file)) },
        None => 4096,
    }
}

unsafe extern "C" fn shim_device_characteristics(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: opened by shim_open.
    match unsafe { methods(file) }.and_then(|m| m.xDeviceCharacteristics) {
        // SAFETY: the platform's method on its own file.
        Some(method) => unsafe { method(real(file)) },
        None => 0,
    }
}

unsafe extern "C" fn shim_shm_map(
    file: *mut ffi::sqlite3_file,
    page: c_int,
    page_size: c_int,
    extend: c_int,
    out: *mut *mut c_void,
) -> c_int {
    forward!(file, xShmMap, page, page_size, extend, out)
}

unsafe extern "C" fn shim_shm_lock(
    file: *mut ffi::sqlite3_file,
    offset: c_int,
    n: c_int,
    flags: c_int,
) -> c_int {
    forward!(file, xShmLock, offset, n, flags)
}

unsafe extern "C" fn shim_shm_barrier(file: *mut ffi::sqlite3_file) {
    // SAFETY: opened by shim_open.
    if let Some(method) = unsafe { methods(file) }.and_then(|m| m.xShmBarrier) {
        // SAFETY: the platform's method on its own file.
        unsafe { method(real(file)) }
    }
}

unsafe extern "C" fn shim_shm_unmap(file: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    forward!(file, xShmUnmap, delete)
}

unsafe extern "C" fn shim_fetch(
    file: *mut ffi::sqlite3_file,
    offset: ffi::sqlite3_int64,
    amount: c_int,
    out: *mut *mut c_void,
) -> c_int {
    released!(file, forward!(file, xFetch, offset, amount, out))
}

unsafe extern "C" fn shim_unfetch(
    file: *mut ffi::sqlite3_file,
    offset: ffi::sqlite3_int64,
    page: *mut c_void,
) -> c_int {
    forward!(file, xUnfetch, offset, page)
}

static SHIM_METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(shim_close),
    xRead: Some(shim_read),
    xWrite: Some(shim_write),
    xTruncate: Some(shim_truncate),
    xSync: Some(shim_sync),
    xFileSize: Some(shim_file_size),
    xLock: Some(shim_lock),
    xUnlock: Some(shim_unlock),
    xCheckReservedLock: Some(shim_check_reserved_lock),
    xFileControl: Some(shim_file_control),
    xSectorSize: Some(shim_sector_size),
    xDeviceCharacteristics: Some(shim_device_characteristics),
    xShmMap: Some(shim_shm_map),
    xShmLock: Some(shim_shm_lock),
    xShmBarrier: Some(shim_shm_barrier),
    xShmUnmap: Some(shim_shm_unmap),
    xFetch: Some(shim_fetch),
    xUnfetch: Some(shim_unfetch),
};
