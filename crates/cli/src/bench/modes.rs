//! The host's durability modes, as the scenarios that compare them run
//! them: the default (group commit with output gates, each flush an
//! `fdatasync` of every dirty WAL), the same with one `syncfs` per flush
//! (Linux only: which of the two is cheaper is measured, not assumed),
//! `synchronous=FULL` and `synchronous=NORMAL`.

use std::path::Path;

use durability_host::{FlushMethod, HostBuilder, Synchronous};

/// One durability mode of the host.
#[derive(Debug, Clone, Copy)]
pub struct Mode {
    /// The key in measurement names: `default`, `default-syncfs`, `full`,
    /// `normal`.
    pub key: &'static str,
    synchronous: Synchronous,
    flush: FlushMethod,
}

impl Mode {
    /// The new default: group commit, per-WAL syncs.
    pub const DEFAULT: Mode = Mode {
        key: "default",
        synchronous: Synchronous::Batched,
        flush: FlushMethod::WalFiles,
    };
    /// Group commit, one `syncfs` per flush.
    pub const DEFAULT_SYNCFS: Mode = Mode {
        key: "default-syncfs",
        synchronous: Synchronous::Batched,
        flush: FlushMethod::Syncfs,
    };
    /// One fsync per commit.
    pub const FULL: Mode = Mode {
        key: "full",
        synchronous: Synchronous::Full,
        flush: FlushMethod::WalFiles,
    };
    /// No sync on commit, no promise at power loss.
    pub const NORMAL: Mode = Mode {
        key: "normal",
        synchronous: Synchronous::Normal,
        flush: FlushMethod::WalFiles,
    };

    /// A host builder on `dir` in this mode.
    pub fn builder(self, dir: &Path) -> HostBuilder {
        durability_host::Host::builder(dir)
            .synchronous(self.synchronous)
            .flush_method(self.flush)
    }
}

/// The default, FULL and NORMAL: the modes a user chooses between.
pub const MODES: [Mode; 3] = [Mode::DEFAULT, Mode::FULL, Mode::NORMAL];

/// [`MODES`] plus the default with `syncfs`, where the platform has it.
pub fn with_syncfs() -> Vec<Mode> {
    let mut modes = vec![Mode::DEFAULT];
    if cfg!(target_os = "linux") {
        modes.push(Mode::DEFAULT_SYNCFS);
    }
    modes.extend([Mode::FULL, Mode::NORMAL]);
    modes
}
