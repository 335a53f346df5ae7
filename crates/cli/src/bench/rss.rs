//! Resident memory, open file descriptors and CPU time of this process,
//! for the per-object and per-operation figures of the host scenarios.
//!
//! Memory and descriptors are read from `/proc/self`, so only on Linux;
//! elsewhere the figures are left out rather than guessed.

use std::fs;
use std::time::Duration;

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

/// CPU time this process has used so far, every thread's: user, system.
#[cfg(unix)]
pub fn cpu_time() -> Option<(Duration, Duration)> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the pointer it is given,
    // which points to a zeroed value of that type.
    let usage = unsafe {
        if libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) != 0 {
            return None;
        }
        usage.assume_init()
    };
    let time = |t: libc::timeval| {
        Some(
            Duration::from_secs(u64::try_from(t.tv_sec).ok()?)
                + Duration::from_micros(u64::try_from(t.tv_usec).ok()?),
        )
    };
    Some((time(usage.ru_utime)?, time(usage.ru_stime)?))
}

#[cfg(not(unix))]
pub fn cpu_time() -> Option<(Duration, Duration)> {
    None
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
