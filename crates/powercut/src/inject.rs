//! Injected I/O failures: the armed `EIO` of a sync and the disk that
//! fills up.
//!
//! Owns only the counters; the FUSE operations ask it whether the request
//! at hand fails. A cut disarms everything, as a reboot would.

/// The failures armed by [`crate::PowerCutFs::fail_fsync`] and
/// [`crate::PowerCutFs::fill_at_write`].
#[derive(Debug, Default)]
pub(crate) struct Injection {
    /// Syncs still to succeed before the failing one, plus one.
    failing_sync_in: Option<u64>,
    /// Writes still to succeed before the disk is full, plus one.
    full_in: Option<u64>,
    /// Every write fails with `ENOSPC` until the next cut.
    full: bool,
    /// Failures handed to a caller since the last cut.
    delivered: u64,
}

impl Injection {
    pub(crate) fn arm_sync_failure(&mut self, nth: u64) {
        self.failing_sync_in = Some(nth.max(1));
    }

    pub(crate) fn arm_full_disk(&mut self, nth: u64) {
        self.full_in = Some(nth.max(1));
    }

    /// Counts one file sync; true if it is the one that fails.
    pub(crate) fn sync_fails(&mut self) -> bool {
        match self.failing_sync_in {
            Some(1) => {
                self.failing_sync_in = None;
                self.delivered += 1;
                true
            }
            Some(n) => {
                self.failing_sync_in = Some(n - 1);
                false
            }
            None => false,
        }
    }

    /// Counts one write; true if the disk is full for it.
    pub(crate) fn write_fails(&mut self) -> bool {
        match self.full_in {
            Some(1) => {
                self.full_in = None;
                self.full = true;
            }
            Some(n) => self.full_in = Some(n - 1),
            None => {}
        }
        if self.full {
            self.delivered += 1;
        }
        self.full
    }

    /// Whether growing a file fails (not counted as a write).
    pub(crate) fn is_full(&mut self) -> bool {
        if self.full {
            self.delivered += 1;
        }
        self.full
    }

    /// Failures (`EIO` of a sync, `ENOSPC` of a write or a growth) handed
    /// to a caller since the last cut.
    pub(crate) fn delivered(&self) -> u64 {
        self.delivered
    }

    /// The reboot of a cut: nothing stays armed.
    pub(crate) fn disarm(&mut self) {
        *self = Injection::default();
    }
}
