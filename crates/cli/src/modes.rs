//! The host's durability modes, by the keys the benchmarks name their
//! measurements with and `durability torture --mode` takes: the default
//! (group commit with output gates, each flush one `fdatasync` of the host
//! journal), the same with the other flush
//! methods (an `fdatasync` of every dirty WAL; one `syncfs`, Linux only:
//! which is cheaper is measured, not assumed), `synchronous=FULL` and
//! `synchronous=NORMAL`.
//!
//! One table for every subcommand, so a benchmark's `full/...` and a
//! torture run's `--mode full` are the same host.

use std::path::Path;

use clap::builder::PossibleValue;
use durability_host::{FlushMethod, HostBuilder, Synchronous};

/// One durability mode of the host.
#[derive(Debug, Clone, Copy)]
pub struct Mode {
    /// The key in measurement names: `default`, `default-walfiles`,
    /// `default-syncfs`, `full`, `normal`.
    pub key: &'static str,
    /// One line for `--help`.
    about: &'static str,
    synchronous: Synchronous,
    flush: FlushMethod,
}

impl Mode {
    /// The default: group commit, one journal sync per flush.
    pub const DEFAULT: Mode = Mode {
        key: "default",
        about: "group commit with output gates, one fdatasync of the host journal per flush",
        synchronous: Synchronous::Batched,
        flush: FlushMethod::Journal,
    };
    /// Group commit, per-WAL syncs.
    pub const DEFAULT_WAL_FILES: Mode = Mode {
        key: "default-walfiles",
        about: "group commit, an fdatasync of each dirty WAL per flush",
        synchronous: Synchronous::Batched,
        flush: FlushMethod::WalFiles,
    };
    /// Group commit, one `syncfs` per flush.
    pub const DEFAULT_SYNCFS: Mode = Mode {
        key: "default-syncfs",
        about: "group commit, one syncfs of the data directory per flush (Linux)",
        synchronous: Synchronous::Batched,
        flush: FlushMethod::Syncfs,
    };
    /// One fsync per commit.
    pub const FULL: Mode = Mode {
        key: "full",
        about: "synchronous=FULL: one sync per commit",
        synchronous: Synchronous::Full,
        flush: FlushMethod::WalFiles,
    };
    /// No sync on commit, no promise at power loss.
    pub const NORMAL: Mode = Mode {
        key: "normal",
        about: "synchronous=NORMAL: no sync on commit, no promise at power loss",
        synchronous: Synchronous::Normal,
        flush: FlushMethod::WalFiles,
    };

    /// Every mode, in the order `--help` lists them.
    pub const ALL: [Mode; 5] = [
        Mode::DEFAULT,
        Mode::DEFAULT_WAL_FILES,
        Mode::DEFAULT_SYNCFS,
        Mode::FULL,
        Mode::NORMAL,
    ];

    /// When a commit is synced.
    pub fn synchronous(self) -> Synchronous {
        self.synchronous
    }

    /// How a group-commit flush syncs.
    pub fn flush_method(self) -> FlushMethod {
        self.flush
    }

    /// A host builder on `dir` in this mode.
    pub fn builder(self, dir: &Path) -> HostBuilder {
        durability_host::Host::builder(dir)
            .synchronous(self.synchronous)
            .flush_method(self.flush)
    }
}

/// `--mode KEY` on the command line.
impl clap::ValueEnum for Mode {
    fn value_variants<'a>() -> &'a [Self] {
        &Mode::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.key).help(self.about))
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
