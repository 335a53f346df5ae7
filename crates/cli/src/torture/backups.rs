//! `--backup-during`: backups of a workload's data directory taken while a
//! life serves it, restored, and checked against the producer's journal.
//!
//! The supervisor takes each backup the way an operator would: it runs
//! `durability backup DATA_DIR DEST` (this same binary, another process
//! than the child's host) while the child is producing, and once the life
//! is over `durability restore DEST RESTORED` into a fresh directory. The
//! checker then reads every restored object like a finished run's
//! database: each passes `PRAGMA integrity_check`, and every item the
//! producer journaled as accepted *before its object was copied* (its
//! `acked_ms` below the object's `copied_ms` in the backup's manifest) is
//! recorded in the copy, in whatever state. A copy is one moment of the
//! run, so nothing in it need have ended. Items accepted after their
//! object's copy began are not checked: the copy may or may not hold them.
//!
//! A backup or a restore that fails is a violation (`backup_failures`),
//! never a skip: an operator's backup of a live directory must work. The
//! one exception is a backup of a disk that `--power-cut`'s eio or enospc
//! fault had just broken ([`Taken::excused_by_fault`]).
//!
//! The module owns the run directory's `backups/` and `restored/`; it never
//! writes the data directory (the backup command itself records
//! `last-backup.json` there, as it does for any operator).

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use durability_platform::EpochMs;
use serde::{Deserialize, Serialize};

use super::TortureError;
use super::integrity;
use super::verdict::{Tally, Violation};
use super::workload::{Files, Finished};

/// The verdict's name for backups and restores that failed.
pub const BACKUP_FAILURES: &str = "backup_failures";

/// The verdict's name (among the allowed findings) for backups that failed
/// after the life's injected eio or enospc fault had fired.
pub const BACKUPS_FAILED_BY_FAULT: &str = "backups_failed_by_fault";

/// The verdict's name (among the allowed findings) for items missing from
/// a copy that a power cut before the copy's life may have lost, in a mode
/// that lets a cut lose an acknowledged item (`normal`).
pub const BACKUP_ITEMS_LOST_ALLOWED: &str = "backup_items_lost_allowed";

/// How long a life may take to start its host before the supervisor gives
/// up backing it up: far above a start's tens of milliseconds, so only a
/// host that refused to start (a failure the supervisor reports anyway)
/// goes without a backup.
const START_WAIT: Duration = Duration::from_secs(20);

/// How often the supervisor looks whether the life's host has started.
const START_POLL: Duration = Duration::from_millis(2);

/// Lines of a failed command's stderr quoted in the violation.
const STDERR_LINES: usize = 6;

/// One backup taken during a run, saved with the supervisor's record so
/// `--recheck` checks the same copies again. The backup and its restored
/// copy are in the run directory ([`Files::backup`], [`Files::restored`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Taken {
    /// The life that was serving the directory.
    pub life: u32,
    /// When the supervisor started that life (system clock): every item
    /// acknowledged before it was acknowledged in an earlier life, with
    /// that life's death (a power cut, with `--power-cut`) between it and
    /// the copy.
    #[serde(default)]
    pub life_started_ms: Option<EpochMs>,
    /// Why the backup or its restore failed; `None` when both worked.
    pub failure: Option<String>,
    /// Why the backup failed when the life's injected eio or enospc fault
    /// had fired by its end ([`Taken::excused_by_fault`]): allowed, not a
    /// failure.
    #[serde(default)]
    pub fault: Option<String>,
}

impl Taken {
    /// A backup that ended after the life's injected eio or enospc fault
    /// had fired (`--power-cut`): if it failed, the failure is the fault's.
    /// Reading a WAL database writes its WAL index (`-shm`): the backup
    /// maps and may extend it beside a live host, and rebuilds it as the
    /// first process to open an object once a fault ended the host; on the
    /// disk the fault filled, either fails. Seen with `--kills 20`: "disk
    /// I/O error" on a full disk, once with the host still running (its
    /// replies withheld), once after it exited. A backup on a disk no
    /// fault touched is never excused.
    pub fn excused_by_fault(self) -> Taken {
        match self.failure {
            Some(failure) => Taken {
                failure: None,
                fault: Some(failure),
                ..self
            },
            None => self,
        }
    }
}

/// Whether the life's host serves the data directory: waits until it wrote
/// its `started` mark, and says no if the child ended first (a host that
/// refused to start, or a life a fault ended).
pub fn serving(child: &mut Child, files: &Files) -> Result<bool, TortureError> {
    let deadline = Instant::now() + START_WAIT;
    loop {
        let exited = child
            .try_wait()
            .map_err(|source| TortureError::Io {
                what: "cannot wait for the child of",
                path: files.dir().to_path_buf(),
                source,
            })?
            .is_some();
        if exited {
            return Ok(false);
        }
        if files.started().exists() {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(START_POLL);
    }
}

/// Backs up the data directory with `durability backup`, as an operator
/// would, while life `life` (started at `life_started_ms`) serves it.
pub fn back_up(files: &Files, life: u32, life_started_ms: EpochMs) -> Result<Taken, TortureError> {
    let dest = files.backup(life);
    create_parent(&dest)?;
    let output = durability(&[
        "backup".as_ref(),
        files.data().as_os_str(),
        dest.as_os_str(),
        "--json".as_ref(),
    ])?;
    Ok(Taken {
        life,
        life_started_ms: Some(life_started_ms),
        failure: failure("backup", life, &output),
        fault: None,
    })
}

/// Restores a backup with `durability restore` into a fresh directory.
/// The restore verifies every copy against the manifest before it writes.
pub fn restore(files: &Files, taken: Taken) -> Result<Taken, TortureError> {
    if taken.failure.is_some() || taken.fault.is_some() {
        return Ok(taken);
    }
    let dest = files.restored(taken.life);
    create_parent(&dest)?;
    let output = durability(&[
        "restore".as_ref(),
        files.backup(taken.life).as_os_str(),
        dest.as_os_str(),
        "--json".as_ref(),
    ])?;
    Ok(Taken {
        failure: failure("restore", taken.life, &output),
        ..taken
    })
}

fn create_parent(path: &Path) -> Result<(), TortureError> {
    let Some(parent) = path.parent() else {
        return Ok(());
    };
    fs::create_dir_all(parent).map_err(|source| TortureError::Io {
        what: "cannot create the backups' directory",
        path: parent.to_path_buf(),
        source,
    })
}

/// Runs this binary with `args` to its end.
fn durability(args: &[&std::ffi::OsStr]) -> Result<Output, TortureError> {
    let program = std::env::current_exe().map_err(|source| TortureError::Spawn {
        program: "the current executable".into(),
        source,
    })?;
    Command::new(&program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| TortureError::Spawn { program, source })
}

/// The violation's message when the command failed.
fn failure(command: &str, life: u32, output: &Output) -> Option<String> {
    if output.status.success() {
        return None;
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines
        .get(lines.len().saturating_sub(STDERR_LINES)..)
        .unwrap_or_default()
        .join(" | ");
    Some(format!(
        "`durability {command}` of the backup taken during life {life} failed ({}): {tail}",
        output.status
    ))
}

/// A restored backup, as a workload's [`super::workload::Workload::check_copy`]
/// reads it.
pub struct BackupCopy {
    /// The copy's databases, read like a finished run's: `databases` is
    /// the restored data directory, the manifest the run's own.
    pub run: Finished,
    /// The life that was serving the directory, for messages.
    pub life: u32,
    /// When each object's copy was taken (the backup manifest's
    /// `copied_ms`), by object id.
    copied_ms: BTreeMap<String, EpochMs>,
    /// When the backup began, before it listed the objects.
    started_ms: EpochMs,
}

impl BackupCopy {
    /// Whether the copy must record an item the producer saw accepted on
    /// `object` at `acked_ms`: the acceptance returned strictly before the
    /// object's copy began (both clocks are this machine's system clock;
    /// the item's moment is taken after the call returned, the copy's
    /// before its read transaction began, so `<` is safe at millisecond
    /// resolution). An object the backup does not list must have been in
    /// it when an item of it was accepted before the backup began. A
    /// journal line without its moment (written by an older build) is not
    /// checked. Returns the item's moment when the copy must hold it.
    pub fn must_hold(&self, object: &str, acked_ms: Option<EpochMs>) -> Option<EpochMs> {
        let acked_ms = acked_ms?;
        let before = match self.copied_ms.get(object) {
            Some(&copied_ms) => acked_ms < copied_ms,
            None => acked_ms < self.started_ms,
        };
        before.then_some(acked_ms)
    }

    /// How the copy of `object` was taken, for a message.
    pub fn describe(&self, object: &str) -> String {
        let short = object.get(..12).unwrap_or(object);
        match self.copied_ms.get(object) {
            Some(copied_ms) => format!(
                "object {short} (copied at {copied_ms} during life {})",
                self.life
            ),
            None => format!(
                "object {short} (not in the backup begun at {} during life {})",
                self.started_ms, self.life
            ),
        }
    }
}

/// What a workload found in one copy.
#[derive(Debug, Default)]
pub struct Presence {
    /// Items the copy had to record.
    pub checked: u64,
    /// The items it did not.
    pub missing: Vec<Missing>,
}

/// An item a copy had to record and does not.
#[derive(Debug)]
pub struct Missing {
    /// When it was acknowledged.
    pub acked_ms: EpochMs,
    /// What it is, in which object, and what the copy holds instead.
    pub message: String,
}

impl Presence {
    /// Counts one item acknowledged at `acked_ms` that the copy had to
    /// record; `message` says why it is not there, built only if it is not.
    pub fn item(&mut self, present: bool, acked_ms: EpochMs, message: impl FnOnce() -> String) {
        self.checked += 1;
        if !present {
            self.missing.push(Missing {
                acked_ms,
                message: message(),
            });
        }
    }
}

/// Checks every backup the run took: each was taken and restored, each
/// restored object passes `integrity_check`, and each copy records every
/// item accepted before its object was copied. `requested` is whether the
/// run was asked to take backups: then a workload with none fails too.
pub fn check(
    check_copy: fn(&BackupCopy) -> Result<Presence, TortureError>,
    run: &Finished,
    taken: &[Taken],
    requested: bool,
    tally: &mut Tally,
) -> Result<(), TortureError> {
    if requested && taken.is_empty() {
        tally.flag(
            Violation::Broken(BACKUP_FAILURES),
            "--backup-during took no backup: no life's host served long enough",
        );
    }
    let mut integrity_checked = 0_u64;
    for taken in taken {
        if let Some(failure) = &taken.fault {
            tally.flag_or_allow(
                true,
                BACKUPS_FAILED_BY_FAULT,
                Violation::Broken(BACKUP_FAILURES),
                format!("after the life's injected eio or enospc fault fired: {failure}"),
            );
            continue;
        }
        if let Some(failure) = &taken.failure {
            tally.flag(Violation::Broken(BACKUP_FAILURES), failure.clone());
            continue;
        }
        let backup = run.files.backup(taken.life);
        let manifest = match durability_host::backup::read_manifest(&backup) {
            Ok(manifest) => manifest,
            Err(error) => {
                tally.flag(
                    Violation::Broken(BACKUP_FAILURES),
                    format!(
                        "the backup taken during life {} cannot be read: {error}",
                        taken.life
                    ),
                );
                continue;
            }
        };
        let copy = BackupCopy {
            run: Finished {
                files: run.files.clone(),
                manifest: run.manifest.clone(),
                databases: run.files.restored(taken.life),
                allowance: run.allowance,
            },
            life: taken.life,
            copied_ms: manifest
                .objects
                .iter()
                .map(|object| (object.id.clone(), object.copied_ms))
                .collect(),
            started_ms: manifest.started_ms,
        };
        tally.backups += 1;
        let (checked, damaged) = integrity::problems(&copy.run);
        integrity_checked += checked;
        for damage in &damaged {
            tally.flag(
                Violation::Corrupt,
                format!(
                    "the restored copy of {} from the backup of life {} ({}) fails integrity_check: {}",
                    damage.name,
                    taken.life,
                    damage.path.display(),
                    damage.problem
                ),
            );
        }
        match check_copy(&copy) {
            Ok(presence) => {
                tally.backup_items_checked += presence.checked;
                for missing in presence.missing {
                    // What the final check allows (`lost_allowed`), the
                    // copy may lack too: an item acknowledged before a cut
                    // in a mode that lets a cut lose it. Items acknowledged
                    // in the copy's own life had no cut before the copy.
                    let lost_to_a_cut = run.allowance.lost
                        && taken
                            .life_started_ms
                            .is_some_and(|started| missing.acked_ms < started);
                    tally.flag_or_allow(
                        lost_to_a_cut,
                        BACKUP_ITEMS_LOST_ALLOWED,
                        Violation::MissingFromBackup,
                        missing.message,
                    );
                }
            }
            // A copy the checker cannot read is damaged; counted once if
            // integrity_check already found it.
            Err(TortureError::Database { path, source }) => {
                if !damaged.iter().any(|damage| damage.path == path) {
                    tally.flag(
                        Violation::Corrupt,
                        format!(
                            "the restored copy {} from the backup of life {} cannot be read: {source}",
                            path.display(),
                            taken.life
                        ),
                    );
                }
            }
            Err(error) => return Err(error),
        }
    }
    tally.detail("backup_integrity_checked", integrity_checked);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torture::workload::Manifest;

    fn finished(dir: &Path) -> Finished {
        let files = Files::new(dir.to_path_buf());
        Finished {
            databases: files.data(),
            files,
            manifest: Manifest::default(),
            allowance: Default::default(),
        }
    }

    fn nothing_to_check(_: &BackupCopy) -> Result<Presence, TortureError> {
        Ok(Presence::default())
    }

    #[test]
    fn a_copy_must_hold_what_was_acknowledged_strictly_before_its_object_was_copied() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let copy = BackupCopy {
            run: finished(dir.path()),
            life: 0,
            copied_ms: BTreeMap::from([("listed".to_owned(), 1_000)]),
            started_ms: 900,
        };
        assert_eq!(copy.must_hold("listed", Some(999)), Some(999));
        assert_eq!(
            copy.must_hold("listed", Some(1_000)),
            None,
            "same millisecond"
        );
        assert_eq!(
            copy.must_hold("listed", None),
            None,
            "an undated journal line"
        );
        assert_eq!(copy.must_hold("unlisted", Some(899)), Some(899));
        assert_eq!(copy.must_hold("unlisted", Some(900)), None);
    }

    #[test]
    fn a_failed_backup_fails_the_run_and_one_an_injected_fault_ended_is_allowed() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let failed = Taken {
            life: 3,
            life_started_ms: None,
            failure: Some("`durability backup` ... failed".into()),
            fault: None,
        };
        let mut tally = Tally::default();
        check(
            nothing_to_check,
            &finished(dir.path()),
            std::slice::from_ref(&failed),
            true,
            &mut tally,
        )
        .unwrap_or_else(|e| panic!("check: {e}"));
        assert_eq!(tally.broken.get(BACKUP_FAILURES), Some(&1));
        assert_eq!((tally.backups, tally.violations()), (0, 1));

        let mut tally = Tally::default();
        check(
            nothing_to_check,
            &finished(dir.path()),
            &[failed.excused_by_fault()],
            true,
            &mut tally,
        )
        .unwrap_or_else(|e| panic!("check: {e}"));
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!(tally.allowed.get(BACKUPS_FAILED_BY_FAULT), Some(&1));
    }

    #[test]
    fn a_run_asked_for_backups_that_took_none_fails() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let mut tally = Tally::default();
        check(
            nothing_to_check,
            &finished(dir.path()),
            &[],
            true,
            &mut tally,
        )
        .unwrap_or_else(|e| panic!("check: {e}"));
        assert_eq!(tally.broken.get(BACKUP_FAILURES), Some(&1));
        let mut tally = Tally::default();
        check(
            nothing_to_check,
            &finished(dir.path()),
            &[],
            false,
            &mut tally,
        )
        .unwrap_or_else(|e| panic!("check: {e}"));
        assert_eq!(tally.violations(), 0);
    }

    #[test]
    fn a_backup_that_is_not_there_fails_the_run() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let taken = Taken {
            life: 0,
            life_started_ms: None,
            failure: None,
            fault: None,
        };
        let mut tally = Tally::default();
        check(
            nothing_to_check,
            &finished(dir.path()),
            &[taken],
            true,
            &mut tally,
        )
        .unwrap_or_else(|e| panic!("check: {e}"));
        assert_eq!(tally.broken.get(BACKUP_FAILURES), Some(&1));
        assert!(
            tally.examples()[0].contains("cannot be read"),
            "{:?}",
            tally.examples()
        );
    }

    /// Two items missing from a real (empty) backup's copy: one
    /// acknowledged at 5, before the copy's life began at 10, one at 15,
    /// in it.
    fn two_missing(_: &BackupCopy) -> Result<Presence, TortureError> {
        let mut presence = Presence::default();
        presence.item(false, 5, || "op-1 from an earlier life".into());
        presence.item(false, 15, || "op-2 from the copy's life".into());
        Ok(presence)
    }

    #[test]
    fn a_missing_item_fails_the_run_unless_the_mode_lets_a_cut_before_the_copy_lose_it() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let mut run = finished(dir.path());
        std::fs::create_dir_all(run.files.data()).unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir_all(run.files.dir().join("backups")).unwrap_or_else(|e| panic!("{e}"));
        durability_host::backup_dir(run.files.data(), run.files.backup(2))
            .unwrap_or_else(|e| panic!("backup: {e}"));
        let taken = Taken {
            life: 2,
            life_started_ms: Some(10),
            failure: None,
            fault: None,
        };

        let mut tally = Tally::default();
        check(
            two_missing,
            &run,
            std::slice::from_ref(&taken),
            true,
            &mut tally,
        )
        .unwrap_or_else(|e| panic!("check: {e}"));
        assert_eq!((tally.backups, tally.backup_items_checked), (1, 2));
        assert_eq!(tally.backup_items_missing, 2);
        assert_eq!(tally.violations(), 2, "{:?}", tally.examples());

        run.allowance.lost = true;
        let mut tally = Tally::default();
        check(two_missing, &run, &[taken], true, &mut tally)
            .unwrap_or_else(|e| panic!("check: {e}"));
        assert_eq!(tally.backup_items_missing, 1, "{:?}", tally.examples());
        assert!(
            tally.examples()[0].contains("op-2"),
            "{:?}",
            tally.examples()
        );
        assert_eq!(tally.allowed.get(BACKUP_ITEMS_LOST_ALLOWED), Some(&1));
    }
}
