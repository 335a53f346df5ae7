//! The supervising side of a torture run: starts each life of a workload as
//! a child process of this same binary, kills every ordinary life with
//! SIGKILL at a seeded random moment, and lets the final life finish.
//!
//! Lives never overlap: a killed child is reaped before the next one starts,
//! so two processes never serve the same data directory. With power cuts
//! the supervisor also holds the power-cut filesystem for the whole run:
//! it arms the life's fault before the life starts and cuts once the child
//! is reaped, so no process has a file of the mount open during a cut.
//!
//! With `--backup-during` ([`super::backups`]) a killed life whose host
//! started is backed up at its kill moment and killed once the backup
//! returned, so the backup reads a directory a live host is writing; the
//! final life is backed up once, a seeded moment after its host started.
//! The backup process has ended before the kill, so it never has a file
//! of the mount open during a cut either. Restores read only the backup
//! and write only the run directory, after the life.

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde::{Deserialize, Serialize};

use super::TortureError;
use super::backups::{self, Taken};
use super::child::{EXIT_UNSETTLED, SETTLE_TIMEOUT};
use super::power_cut::{CutsDone, FaultKind, PowerCuts};
use super::verdict::{Tally, Violation};
use super::workload::{Files, ITEMS_PER_LIFE, Manifest, roll, system_now_ms};
use crate::modes::Mode;

/// The earliest moment after its start that a life is killed, in
/// milliseconds: before its host has even opened a file.
const KILL_DELAY_MIN_MS: u64 = 5;
/// The latest moment a life is killed, in milliseconds: well into
/// production, handler runs and retries.
const KILL_DELAY_MAX_MS: u64 = 300;

/// What the final life may take on top of its settle timeout: start-up,
/// the rest of production, shutdown.
const FINAL_LIFE_SLACK: Duration = Duration::from_secs(60);

/// How often the supervisor looks whether the final life has ended.
const POLL: Duration = Duration::from_millis(10);

/// Lines of the children's stderr quoted when a life failed.
const STDERR_TAIL_LINES: usize = 4;

/// The exit code of a child whose life ended with an error (`main`'s
/// failure code); a panic exits with 101 and a signal with none.
const EXIT_ERROR: i32 = 1;

/// How one workload is tortured.
pub struct Plan<'a> {
    pub workload: &'static str,
    pub seed: u64,
    /// Lives killed before the final one.
    pub kills: u32,
    /// The child host's durability mode.
    pub mode: Mode,
    /// With power cuts, the faults the cuts draw from.
    pub faults: Option<&'a [FaultKind]>,
    /// Back the data directory up while lives serve it.
    pub backup_during: bool,
}

/// What happened to the lives of one workload, beyond what the journals
/// say. Saved in the run directory so `--recheck` can report it again.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Supervised {
    /// The run's seed.
    pub seed: u64,
    /// Lives killed with SIGKILL.
    pub kills: u32,
    /// Whether every death was a power cut.
    #[serde(default)]
    pub power_cut: bool,
    /// The child host's durability mode, by key.
    #[serde(default = "default_mode_key")]
    mode: String,
    /// What the power cuts did.
    #[serde(default)]
    pub cuts: CutsDone,
    /// Lives that ended by themselves with an error after their eio or
    /// enospc fault was armed: the host refusing to go on, as it must.
    #[serde(default)]
    ended_by_fault: Vec<String>,
    /// Lives whose host failed to start (never wrote its `started` mark)
    /// while no injected fault had fired: after a kill or a cut, every
    /// start must succeed, so each one is a failure of the run.
    #[serde(default)]
    refused_starts: Vec<String>,
    /// Lives that ended in a way they must not: an ordinary life that exited
    /// by itself, a final life that failed or never ended.
    failures: Vec<String>,
    /// The final life's work did not settle within its timeout.
    unsettled: bool,
    final_life_ms: u64,
    /// Whether the run was asked to back up during its lives.
    #[serde(default)]
    pub backup_during: bool,
    /// The backups taken during the lives, in order.
    #[serde(default)]
    pub backups: Vec<Taken>,
}

impl Supervised {
    /// Adds the harness's own findings to the checker's tally.
    pub fn add_to(&self, tally: &mut Tally) {
        for failure in &self.failures {
            tally.flag(Violation::Broken("child_failures"), failure.clone());
        }
        for refusal in &self.refused_starts {
            tally.flag(Violation::Broken(REFUSED_STARTS), refusal.clone());
        }
        if self.unsettled {
            tally.flag(
                Violation::Broken("settle_timeouts"),
                format!(
                    "accepted work was still unsettled {} s after the final life's production ended",
                    SETTLE_TIMEOUT.as_secs()
                ),
            );
        }
        tally.detail("final_life_ms", self.final_life_ms);
        if self.power_cut {
            let cuts = &self.cuts;
            tally.detail("cut_files", cuts.files);
            tally.detail("cut_blocks_dropped", cuts.blocks_dropped);
            tally.detail("cut_blocks_kept", cuts.blocks_kept);
            tally.detail("cut_blocks_torn", cuts.blocks_torn);
            tally.detail("cut_bytes_garbled", cuts.bytes_garbled);
            tally.detail("cut_namespace_changes_undone", cuts.undone);
            tally.detail(
                "lives_ended_by_fault",
                u64::try_from(self.ended_by_fault.len()).unwrap_or(u64::MAX),
            );
        }
    }

    /// The run's durability mode.
    pub fn mode(&self, files: &Files) -> Result<Mode, TortureError> {
        Mode::ALL
            .into_iter()
            .find(|mode| mode.key == self.mode)
            .ok_or_else(|| TortureError::UnknownMode {
                key: self.mode.clone(),
                path: files.supervised(),
            })
    }

    /// Saves the record in the run directory.
    pub fn save(&self, files: &Files) -> Result<(), TortureError> {
        let text = serde_json::to_vec_pretty(self).map_err(|source| TortureError::Encode {
            what: "the supervisor's record",
            source,
        })?;
        let path = files.supervised();
        fs::write(&path, text).map_err(|source| TortureError::Io {
            what: "cannot write the supervisor's record",
            path,
            source,
        })
    }

    /// Loads the record a finished run saved.
    pub fn load(files: &Files) -> Result<Supervised, TortureError> {
        let path = files.supervised();
        let bytes = fs::read(&path).map_err(|source| TortureError::Io {
            what: "cannot read the supervisor's record (is this a finished run?)",
            path: path.clone(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|source| TortureError::Decode { path, source })
    }
}

/// The verdict's name for lives whose host refused to start.
pub const REFUSED_STARTS: &str = "refused_starts";

/// Removes the previous life's `started` mark before the next life starts.
fn clear_started(files: &Files) -> Result<(), TortureError> {
    match fs::remove_file(files.started()) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(TortureError::Io {
            what: "cannot remove the previous life's started mark",
            path: files.started(),
            source,
        }),
    }
}

fn default_mode_key() -> String {
    Mode::DEFAULT.key.to_owned()
}

/// Runs every life of the plan's workload in `files`: `kills` killed ones
/// (each followed by a power cut, with power cuts), then the final one.
pub fn supervise(plan: &Plan<'_>, files: &Files) -> Result<Supervised, TortureError> {
    let Plan {
        workload,
        seed,
        kills,
        mode,
        faults,
        backup_during,
    } = *plan;
    let items = ITEMS_PER_LIFE.saturating_mul(u64::from(kills) + 1);
    let mut moments = StdRng::seed_from_u64(roll(seed, "kill moments", workload, 0));
    // Drawn apart from the kill moments, so a run with --backup-during
    // kills at the same moments as one without.
    let mut backup_moments = StdRng::seed_from_u64(roll(seed, "backup moments", workload, 0));
    let mut supervised = Supervised {
        seed,
        power_cut: faults.is_some(),
        mode: mode.key.to_owned(),
        backup_during,
        ..Supervised::default()
    };
    // Mounted until the final life exited; dropped (unmounted) on every
    // error return too.
    let mut power = match faults {
        Some(faults) => Some(PowerCuts::mount(files, faults, seed, workload)?),
        None => None,
    };
    let life_of = |life, is_final| LifeArgs {
        workload,
        seed,
        life,
        items,
        mode,
        is_final,
    };
    for life in 0..kills {
        let armed = power.as_ref().map(|power| power.arm(life));
        clear_started(files)?;
        let life_started_ms = system_now_ms();
        let mut child = spawn(&life_of(life, false), files)?;
        let delay = moments.random_range(KILL_DELAY_MIN_MS..=KILL_DELAY_MAX_MS);
        std::thread::sleep(Duration::from_millis(delay));
        // The kill waits for the backup: it is taken while the host serves.
        let backup = if backup_during && backups::serving(&mut child, files)? {
            let taken = backups::back_up(files, life, life_started_ms)?;
            let broken_disk = armed.is_some_and(|a| a.may_end_by_itself())
                && power.as_ref().is_some_and(PowerCuts::fault_fired);
            Some(if broken_disk {
                taken.excused_by_fault()
            } else {
                taken
            })
        } else {
            None
        };
        // An error here means the child already exited; `wait` says how.
        let _ = child.kill();
        let status = wait(&mut child, files)?;
        let fault_fired = power.as_ref().is_some_and(PowerCuts::fault_fired);
        if killed(&status) {
            supervised.kills += 1;
        } else if !files.started().exists() && !fault_fired {
            supervised.refused_starts.push(format!(
                "life {life}'s host refused to start ({status}){}",
                stderr_tail(files)
            ));
        } else if armed.is_some_and(|a| a.may_end_by_itself()) && status.code() == Some(EXIT_ERROR)
        {
            supervised.ended_by_fault.push(format!(
                "life {life} ended by itself ({status}) after its {} fault{}",
                armed.map_or("", |a| a.kind().name()),
                stderr_tail(files)
            ));
        } else {
            supervised.failures.push(format!(
                "life {life} ended by itself ({status}) before it was killed{}",
                stderr_tail(files)
            ));
        }
        if let (Some(power), Some(armed)) = (power.as_mut(), armed) {
            power.cut(armed, life)?;
        }
        if let Some(taken) = backup {
            supervised.backups.push(backups::restore(files, taken)?);
        }
    }

    let started = Instant::now();
    clear_started(files)?;
    let life_started_ms = system_now_ms();
    let mut child = spawn(&life_of(kills, true), files)?;
    // A final life that ended before the backup's moment leaves a stopped
    // directory, which is backed up all the same: every run gets a backup.
    let backup = if backup_during && backups::serving(&mut child, files)? {
        let delay = backup_moments.random_range(KILL_DELAY_MIN_MS..=KILL_DELAY_MAX_MS);
        std::thread::sleep(Duration::from_millis(delay));
        Some(backups::back_up(files, kills, life_started_ms)?)
    } else {
        None
    };
    let deadline = started + SETTLE_TIMEOUT + FINAL_LIFE_SLACK;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() >= deadline => break None,
            Ok(None) => std::thread::sleep(POLL),
            Err(source) => {
                return Err(TortureError::Io {
                    what: "cannot wait for the child of",
                    path: files.dir().to_path_buf(),
                    source,
                });
            }
        }
    };
    supervised.final_life_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    match status {
        Some(status) if status.success() => {}
        Some(status) if status.code() == Some(i32::from(EXIT_UNSETTLED)) => {
            supervised.unsettled = true;
        }
        Some(status) if !files.started().exists() => supervised.refused_starts.push(format!(
            "the final life's host refused to start ({status}){}",
            stderr_tail(files)
        )),
        Some(status) => supervised.failures.push(format!(
            "the final life failed ({status}){}",
            stderr_tail(files)
        )),
        None => {
            let _ = child.kill();
            wait(&mut child, files)?;
            supervised.failures.push(format!(
                "the final life did not end within {} s and was killed{}",
                deadline.duration_since(started).as_secs(),
                stderr_tail(files)
            ));
        }
    }
    if let Some(power) = power.take() {
        supervised.cuts = power.unmount()?;
    }
    if let Some(taken) = backup {
        supervised.backups.push(backups::restore(files, taken)?);
    }
    Ok(supervised)
}

/// Reads the object manifest the lives wrote; none if no life got that far.
pub fn read_manifest(files: &Files) -> Result<Manifest, TortureError> {
    let path = files.manifest();
    match fs::read(&path) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map_err(|source| TortureError::Decode { path, source })
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(Manifest::default()),
        Err(source) => Err(TortureError::Io {
            what: "cannot read the object manifest",
            path,
            source,
        }),
    }
}

/// What one life's child is told (its `ChildArgs`).
struct LifeArgs {
    workload: &'static str,
    seed: u64,
    life: u32,
    items: u64,
    mode: Mode,
    is_final: bool,
}

/// Starts a life, its stderr appended to the run's children log under a
/// header naming the life.
fn spawn(args: &LifeArgs, files: &Files) -> Result<Child, TortureError> {
    let LifeArgs {
        workload,
        seed,
        life,
        items,
        mode,
        is_final,
    } = *args;
    let log_path = files.children_log();
    let io = |source| TortureError::Io {
        what: "cannot open the children's log",
        path: log_path.clone(),
        source,
    };
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(io)?;
    writeln!(
        log,
        "--- life {life}{} ---",
        if is_final { " (final)" } else { "" }
    )
    .map_err(io)?;
    let program = std::env::current_exe().map_err(|source| TortureError::Spawn {
        program: "the current executable".into(),
        source,
    })?;
    let mut command = Command::new(&program);
    command
        .arg("torture-child")
        .arg("--workload")
        .arg(workload)
        .arg("--dir")
        .arg(files.dir())
        .arg("--seed")
        .arg(seed.to_string())
        .arg("--life")
        .arg(life.to_string())
        .arg("--items")
        .arg(items.to_string())
        .arg("--mode")
        .arg(mode.key)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    if is_final {
        command.arg("--final");
    }
    command
        .spawn()
        .map_err(|source| TortureError::Spawn { program, source })
}

fn wait(child: &mut Child, files: &Files) -> Result<ExitStatus, TortureError> {
    child.wait().map_err(|source| TortureError::Io {
        what: "cannot wait for the child of",
        path: files.dir().to_path_buf(),
        source,
    })
}

/// Whether the child died of our SIGKILL (and not of anything else).
#[cfg(unix)]
fn killed(status: &ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt as _;
    status.signal() == Some(libc::SIGKILL)
}

/// Without signals, a killed child is one that did not exit successfully.
#[cfg(not(unix))]
fn killed(status: &ExitStatus) -> bool {
    !status.success()
}

/// The last lines of the children's stderr, to quote in a failure.
fn stderr_tail(files: &Files) -> String {
    let path = files.children_log();
    let Ok(text) = fs::read_to_string(&path) else {
        return String::new();
    };
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines
        .get(lines.len().saturating_sub(STDERR_TAIL_LINES)..)
        .unwrap_or_default()
        .join(" | ");
    format!("; stderr ({}): {tail}", path.display())
}
