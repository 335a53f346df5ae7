//! The host's durability modes, as the scenarios that compare them run
//! them: the default (group commit with output gates, each flush one
//! `fdatasync` of the host journal), the same with the other flush
//! methods (an `fdatasync` of every dirty WAL; one `syncfs`, Linux only:
//! which is cheaper is measured, not assumed), `synchronous=FULL` and
//! `synchronous=NORMAL`.

use std::path::Path;

use durability_host::{FlushMethod, HostBuilder, Synchronous};

/// One durability mode of the host.
#[derive(Debug, Clone, Copy)]
pub struct Mode {
    /// The key in measurement names: `default`, `default-walfiles`,
    /// `default-syncfs`, `full`, `normal`.
    pub key: &'static str,
    synchronous: Synchronous,
    flush: FlushMethod,
}

impl Mode {
    /// The default: group commit, one journal sync per flush.
    pub const DEFAULT: Mode = Mode {
        key: "default",
        synchronous: Synchronous::Batched,
        flush: FlushMethod::Journal,
    };
    /// Group commit, per-WAL syncs.
    pub const DEFAULT_WAL_FILES: Mode = Mode {
        key: "default-walfiles",
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

/// The default (and its per-WAL flush method, for comparison), FULL and
/// NORMAL: the modes a user chooses between.
pub const MODES: [Mode; 4] = [
    Mode::DEFAULT,
    Mode::DEFAULT_WAL_FILES,
    Mode::FULL,
    Mode::NORMAL,
];

/// [`MODES`] plus the default with `syncfs`, where the platform has it.
pub fn with_syncfs() -> Vec<Mode> {
    let mut modes = vec![Mode::DEFAULT, Mode::DEFAULT_WAL_FILES];
    if cfg!(target_os = "linux") {
        modes.push(Mode::DEFAULT_SYNCFS);
    }
    modes.extend([Mode::FULL, Mode::NORMAL]);
    modes
}
