//! Resident memory and open file descriptors of this process, for the
//! per-object figures of the host scenarios.
//!
//! Read from `/proc/self`, so only on Linux; elsewhere the figures are left
//! out rather than guessed.

use std::fs;

/// Resident set size in bytes, after giving freed heap back to the system
/// so that memory the host released is not counted as still in use.
pub fn resident_bytes() -> Option<u64> {
    release_free_heap();
    let statm = fs::read_to_string("/proc/self/statm").ok()?;
    let resident_pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(resident_pages * page_size_bytes()?)
}

/// How many file descriptors this process has open.
pub fn open_fds() -> Option<u64> {
    let entries = fs::read_dir("/proc/self/fd").ok()?;
    u64::try_from(entries.count()).ok()
}

fn page_size_bytes() -> Option<u64> {
    // SAFETY: sysconf has no preconditions and only reads a constant.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|&size| size > 0)
}

/// glibc keeps freed small allocations in its arenas, so without this an
/// evicted object's memory would still count as resident.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn release_free_heap() {
    // SAFETY: malloc_trim only returns unused arena pages to the kernel; it
    // does not touch live allocations.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release_free_heap() {}
