//! Power cuts of a torture run (`--power-cut`): the host's data directory
//! as the mountpoint of a [`PowerCutFs`], the fault each death draws, and
//! what the cuts did.
//!
//! A SIGKILL keeps the page cache, so a kill alone never shows what a
//! durability mode fails to sync; a cut drops (or reorders, or undoes the
//! namespace changes of) everything not made durable, as a power loss
//! does. The supervisor mounts the filesystem for a workload's whole run
//! and cuts after every death; a child only ever sees an ordinary
//! directory. What the checker trusts (the journals, the manifest, the
//! cold segments, the children's log) stays outside the mount: it is the
//! observer's record, not the system under test.
//!
//! This module must not cut while a process has files of the mount open:
//! [`PowerCuts::cut`] is called only once the child is reaped.

use std::collections::BTreeMap;
use std::fs;

use durability_powercut::{Fault, PowerCutFs};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde::{Deserialize, Serialize};

use super::TortureError;
use super::workload::{Files, roll};

/// The largest `n` of an armed `fail_fsync(n)`: small enough that the
/// failing sync usually comes within a life of a few hundred milliseconds.
const EIO_NTH_FSYNC_MAX: u64 = 200;

/// The largest `n` of an armed `fill_at_write(n)`: a life writes a few
/// thousand times, so the disk usually fills within it.
const ENOSPC_NTH_WRITE_MAX: u64 = 2_000;

/// A fault a death may draw (`--faults`). The variants' comments are the
/// `--help` lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum FaultKind {
    /// Writes no fsync covered vanish.
    Drop,
    /// Unsynced 4 KiB blocks survive in any subset, one write torn at a sector.
    Reorder,
    /// As drop, and creates, renames and unlinks no directory fsync covered
    /// are undone.
    Metadata,
    /// An fsync during the life fails with EIO; then as drop.
    Eio,
    /// The disk fills during the life (ENOSPC); then as drop.
    Enospc,
    /// As drop, and unsynced writes over synced bytes were torn: those
    /// bytes read back as garbage, even where rewritten unchanged.
    TornOverwrite,
}

impl FaultKind {
    /// Every fault, the default of `--faults`.
    pub const ALL: [FaultKind; 6] = [
        FaultKind::Drop,
        FaultKind::Reorder,
        FaultKind::Metadata,
        FaultKind::Eio,
        FaultKind::Enospc,
        FaultKind::TornOverwrite,
    ];

    /// Its name on the command line and in the verdict.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Drop => "drop",
            FaultKind::Reorder => "reorder",
            FaultKind::Metadata => "metadata",
            FaultKind::Eio => "eio",
            FaultKind::Enospc => "enospc",
            FaultKind::TornOverwrite => "torn-overwrite",
        }
    }

    /// The cut that ends a life with this fault.
    fn cut(self) -> Fault {
        match self {
            FaultKind::Reorder => Fault::Reorder,
            FaultKind::Metadata => Fault::Metadata,
            FaultKind::TornOverwrite => Fault::TornOverwrite,
            FaultKind::Drop | FaultKind::Eio | FaultKind::Enospc => Fault::Drop,
        }
    }
}

/// The fault one life drew, armed before it started.
#[derive(Debug, Clone, Copy)]
pub struct Armed {
    kind: FaultKind,
}

impl Armed {
    /// Whether the life may end by itself: after a failed sync or a full
    /// disk the host refuses to go on (`CallError::NotDurable`, storage
    /// errors), and the child exits with its error.
    pub fn may_end_by_itself(self) -> bool {
        matches!(self.kind, FaultKind::Eio | FaultKind::Enospc)
    }

    pub fn kind(self) -> FaultKind {
        self.kind
    }
}

/// What the cuts of one workload's run did, summed over the cuts (from
/// their `CutReport`s), so a reader sees a run whose cuts dropped nothing.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CutsDone {
    /// Cuts applied, by fault name.
    pub by_fault: BTreeMap<String, u32>,
    /// Files that had unsynced data at a cut.
    pub files: u64,
    pub blocks_dropped: u64,
    pub blocks_kept: u64,
    pub blocks_torn: u64,
    /// Synced bytes that torn overwrites garbled.
    #[serde(default)]
    pub bytes_garbled: u64,
    /// Namespace changes undone.
    pub undone: u64,
}

/// Writes a boot id no earlier boot had: after a cut the host must see a
/// reboot, as after a real power loss (it then rebuilds its alarm index,
/// whose entries a cut may take back while it keeps the objects' commits).
fn new_boot(files: &Files) -> Result<(), TortureError> {
    let path = files.boot_id();
    fs::write(
        &path,
        format!("torture-boot-{:032x}\n", rand::random::<u128>()),
    )
    .map_err(|source| TortureError::Io {
        what: "cannot write the boot id",
        path,
        source,
    })
}

/// The power-cut filesystem of one workload's run and the faults it draws
/// from. Dropping it unmounts (on error paths too).
pub struct PowerCuts {
    files: Files,
    fs: PowerCutFs,
    faults: Vec<FaultKind>,
    seed: u64,
    workload: &'static str,
    done: CutsDone,
}

impl PowerCuts {
    /// Mounts the filesystem over `files.disk()` at `files.data()`,
    /// creating both.
    pub fn mount(
        files: &Files,
        faults: &[FaultKind],
        seed: u64,
        workload: &'static str,
    ) -> Result<PowerCuts, TortureError> {
        for dir in [files.disk(), files.data()] {
            fs::create_dir_all(&dir).map_err(|source| TortureError::Io {
                what: "cannot create the power-cut directory",
                path: dir.clone(),
                source,
            })?;
        }
        let fs = PowerCutFs::mount(&files.disk(), &files.data())
            .map_err(|source| TortureError::PowerCut { source })?;
        new_boot(files)?;
        let faults = if faults.is_empty() {
            FaultKind::ALL.to_vec()
        } else {
            faults.to_vec()
        };
        Ok(PowerCuts {
            files: files.clone(),
            fs,
            faults,
            seed,
            workload,
            done: CutsDone::default(),
        })
    }

    /// Draws life `life`'s fault from the list and arms what must happen
    /// during the life (a failing sync, a full disk).
    pub fn arm(&self, life: u32) -> Armed {
        let mut rng = StdRng::seed_from_u64(roll(
            self.seed,
            "power-cut faults",
            self.workload,
            u64::from(life),
        ));
        let index = rng.random_range(0..self.faults.len().max(1));
        let kind = self.faults.get(index).copied().unwrap_or(FaultKind::Drop);
        match kind {
            FaultKind::Eio => self.fs.fail_fsync(rng.random_range(1..=EIO_NTH_FSYNC_MAX)),
            FaultKind::Enospc => self
                .fs
                .fill_at_write(rng.random_range(1..=ENOSPC_NTH_WRITE_MAX)),
            FaultKind::Drop
            | FaultKind::Reorder
            | FaultKind::Metadata
            | FaultKind::TornOverwrite => {}
        }
        Armed { kind }
    }

    /// Whether an armed fault has handed a failure to the child since the
    /// last cut (read before the next one): only then can it explain how
    /// the life ended.
    pub fn fault_fired(&self) -> bool {
        self.fs.injected_failures() > 0
    }

    /// Cuts the power after life `life` died and was reaped.
    pub fn cut(&mut self, armed: Armed, life: u32) -> Result<(), TortureError> {
        let seed = roll(self.seed, "power cut", self.workload, u64::from(life));
        let report = self
            .fs
            .cut(armed.kind.cut(), seed)
            .map_err(|source| TortureError::PowerCut { source })?;
        new_boot(&self.files)?;
        tracing::debug!(
            workload = self.workload,
            life,
            fault = armed.kind.name(),
            files = report.files,
            blocks_dropped = report.blocks_dropped,
            blocks_kept = report.blocks_kept,
            blocks_torn = report.blocks_torn,
            bytes_garbled = report.bytes_garbled,
            undone = report.undone,
            "power cut"
        );
        let done = &mut self.done;
        *done
            .by_fault
            .entry(armed.kind.name().to_owned())
            .or_default() += 1;
        done.files += u64::try_from(report.files).unwrap_or(u64::MAX);
        done.blocks_dropped += report.blocks_dropped;
        done.blocks_kept += report.blocks_kept;
        done.blocks_torn += report.blocks_torn;
        done.bytes_garbled += report.bytes_garbled;
        done.undone += u64::try_from(report.undone).unwrap_or(u64::MAX);
        Ok(())
    }

    /// Unmounts, once the final life exited; returns what the cuts did.
    pub fn unmount(self) -> Result<CutsDone, TortureError> {
        self.fs
            .unmount()
            .map_err(|source| TortureError::PowerCut { source })?;
        Ok(self.done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fault_has_the_name_the_command_line_takes() {
        use clap::ValueEnum as _;
        for kind in FaultKind::ALL {
            let parsed = FaultKind::from_str(kind.name(), false);
            assert_eq!(parsed, Ok(kind));
        }
    }
}
