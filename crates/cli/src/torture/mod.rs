//! `durability torture`: crash torture of the capabilities on the real host.
//!
//! For each workload the supervisor ([`supervisor`]) runs the same binary as
//! a child (`durability torture-child`, hidden) on one data directory, kills
//! it with SIGKILL at seeded random moments, restarts it, and finally lets
//! one life finish and wait until all accepted work is settled. The child
//! ([`child`]) runs a workload's producer, handlers and consumers on the
//! thread-mode host, and journals what they saw in fsync'd files
//! ([`journal`]). The workload's checker then compares those facts with the
//! final databases, opened read-only, and the [`verdict`] says whether every
//! guarantee held.
//!
//! The module owns the command's arguments, the registry of workloads and
//! the run's directory; each workload is one module implementing
//! [`workload::Workload`]. It must not touch a database the child has open:
//! the checker runs only after the final child exited.
//!
//! With `--power-cut` every death is also a power cut ([`power_cut`]): the
//! data directory is a power-cut filesystem that drops what was not made
//! durable, and the checker allows what the durability mode (`--mode`)
//! lets a power loss undo ([`verdict::Allowance`]). Every run, cut or not,
//! checks each object's database with `PRAGMA integrity_check`
//! ([`integrity`]).
//!
//! With `--backup-during` the supervisor also backs up the data directory
//! with `durability backup` while lives serve it, restores each backup with
//! `durability restore`, and the checker requires every item accepted
//! before its object was copied to be in the restored copy ([`backups`]).

mod alarms;
mod attempts;
mod backups;
mod child;
mod fanout;
mod integrity;
pub(crate) mod journal;
mod log;
mod operations;
mod power_cut;
mod recurring;
mod supervisor;
mod verdict;
mod workload;

use std::cell::Cell;
use std::fs;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::builder::{PossibleValue, PossibleValuesParser};
use durability_host::FlushMethod;

use crate::modes::Mode;
use power_cut::FaultKind;
pub use verdict::Verdict;
use verdict::{Allowance, Tally, Violation, WorkloadReport};
use workload::{Files, Finished, Life, Workload};

/// `--workload all` runs every registered workload, in registry order.
const ALL: &str = "all";

/// Arguments of `durability torture`.
#[derive(Debug, clap::Args)]
pub struct TortureArgs {
    /// The workload to torture, or `all` for every one.
    #[arg(long, default_value = ALL, value_parser = workload_names())]
    workload: String,
    /// How many times each workload's process is killed with SIGKILL before
    /// its final life.
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    kills: u32,
    /// Where the runs put their databases and journals (one sub-directory per
    /// workload, kept afterwards). Default: a temporary directory, removed.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Seed of the kill moments and of the handlers' failures. Default: a
    /// random one, printed with the verdict so a run can be repeated.
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// The child host's durability mode.
    #[arg(long, value_name = "MODE", default_value = "default")]
    mode: Mode,
    /// Make every death a power cut: the host's data directory is a
    /// power-cut filesystem (FUSE; needs root and /dev/fuse) that, after
    /// each kill, drops what was not made durable. The checker then allows
    /// what --mode lets a power loss undo (docs/guarantees.md).
    #[arg(long)]
    power_cut: bool,
    /// With --power-cut, the faults the cuts draw from (comma-separated):
    /// each death draws one, from the seed.
    #[arg(long, value_name = "LIST", value_delimiter = ',', requires = "power_cut",
          default_values = ["drop", "reorder", "metadata", "eio", "enospc", "torn-overwrite"])]
    faults: Vec<FaultKind>,
    /// While lives serve the data directory, back it up with `durability
    /// backup` (another process, as an operator would: in every killed
    /// life whose host started, at its kill moment, the kill waiting for
    /// the backup; and once in the final life), restore each backup with
    /// `durability restore` into the run directory, and check each
    /// restored copy: every object passes integrity_check, and every item
    /// accepted before its object was copied is in it, in whatever state.
    /// A failed backup or restore, or a missing item, fails the run.
    #[arg(long)]
    backup_during: bool,
    /// Print the verdict as one JSON object (`power_cut`, `mode`, `kills`,
    /// `cuts`, `faults`, `accepted`, `completed`, `lost`, `lost_allowed`,
    /// `over_attempts`, `over_attempts_allowed`, `stale_settlements`,
    /// `corrupt`, `refused_starts`, `backups` (taken during the run and
    /// restored, with --backup-during), `backup_items_checked` (items
    /// accepted before their object was copied), `backup_items_missing`
    /// (of those, not in the restored copy: violations), `violations`,
    /// per-workload detail) instead of a table.
    #[arg(long)]
    json: bool,
    /// Check the run already in --data-dir again instead of running one
    /// (after a failure, or after looking at its files).
    #[arg(long, requires = "data_dir")]
    recheck: bool,
}

/// Arguments of `durability torture-child`, the process the supervisor
/// kills. Not for people: the supervisor passes all of them.
#[derive(Debug, clap::Args)]
pub struct ChildArgs {
    #[arg(long, value_parser = PossibleValuesParser::new(WORKLOADS.iter().map(|w| w.name)))]
    workload: String,
    /// The workload's run directory.
    #[arg(long)]
    dir: PathBuf,
    #[arg(long)]
    seed: u64,
    /// Which life this is, from 0.
    #[arg(long)]
    life: u32,
    /// Items of the whole run.
    #[arg(long)]
    items: u64,
    /// The host's durability mode.
    #[arg(long)]
    mode: Mode,
    /// The final life: finish production, wait until everything accepted is
    /// settled, exit.
    #[arg(long = "final")]
    is_final: bool,
}

/// Why a torture run could not be carried out. Violations of guarantees are
/// not errors: they are the verdict.
#[derive(Debug, thiserror::Error)]
pub enum TortureError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} already exists and is not a torture run directory; remove it or pick another --data-dir", path.display())]
    NotARunDirectory { path: PathBuf },
    #[error("cannot start the child process {}: {source}", program.display())]
    Spawn {
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot encode {what} as JSON: {source}")]
    Encode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot decode {}: {source}", path.display())]
    Decode {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("a thread panicked while appending to the journal {}", path.display())]
    JournalPoisoned { path: PathBuf },
    #[error("cannot read the database {}: {source}", path.display())]
    Database {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("cannot start the child's tokio runtime: {source}")]
    Runtime {
        #[source]
        source: std::io::Error,
    },
    #[error("the object host failed: {source}")]
    Host {
        #[from]
        source: durability_host::HostError,
    },
    #[error("a call to a torture object failed: {source}")]
    Call {
        #[from]
        source: durability_host::CallError,
    },
    #[error("a torture object's storage failed: {source}")]
    Storage {
        #[from]
        source: durability_platform::StorageError,
    },
    #[error("the capability refused a call: {source}")]
    Durability {
        #[from]
        source: durability::DurabilityError,
    },
    #[error("the log refused a call: {source}")]
    Log {
        #[from]
        source: durability::LogError,
    },
    #[error("the fanout refused a call: {message}")]
    Fanout { message: String },
    #[error("no object {index} in the workload")]
    NoObject { index: u64 },
    #[error("the child was not killed within {seconds} s; the supervisor must be gone")]
    Orphaned { seconds: u64 },
    #[error("unknown workload {name:?}")]
    UnknownWorkload { name: String },
    #[error("the power-cut filesystem failed: {source}")]
    PowerCut {
        #[source]
        source: durability_powercut::PowerCutError,
    },
    #[error(
        "--mode {mode} cannot be tested with --power-cut: the kernel does not forward syncfs(2) \
         to a FUSE server, so a cut cannot see what a syncfs makes durable; \
         use --mode default, default-walfiles, full or normal"
    )]
    SyncfsUnderPowerCut { mode: &'static str },
    #[error("{} records durability mode {key:?}, which this build does not know", path.display())]
    UnknownMode { key: String, path: PathBuf },
}

/// One registered workload: its name and its two halves, the child's life
/// and the checker, monomorphized from its [`Workload`] implementation.
struct Entry {
    name: &'static str,
    about: &'static str,
    life: fn(&Life) -> Result<child::Ending, TortureError>,
    check: fn(&Finished) -> Result<Tally, TortureError>,
    check_copy: fn(&backups::BackupCopy) -> Result<backups::Presence, TortureError>,
}

const fn entry<W: Workload>() -> Entry {
    Entry {
        name: W::NAME,
        about: W::ABOUT,
        life: child::live::<W>,
        check: W::check,
        check_copy: W::check_copy,
    }
}

/// Every workload, in the order `--workload all` runs them.
const WORKLOADS: &[Entry] = &[
    entry::<operations::OperationsWorkload>(),
    entry::<alarms::AlarmsWorkload>(),
    entry::<log::LogWorkload>(),
    entry::<fanout::FanoutWorkload>(),
    entry::<recurring::RecurringWorkload>(),
];

fn workload_names() -> PossibleValuesParser {
    let mut values = vec![PossibleValue::new(ALL).help("every workload below, one after another")];
    values.extend(
        WORKLOADS
            .iter()
            .map(|w| PossibleValue::new(w.name).help(w.about)),
    );
    PossibleValuesParser::new(values)
}

/// Runs `durability torture` and returns its verdict.
pub fn run(args: &TortureArgs) -> Result<Verdict, TortureError> {
    let started = Instant::now();
    if args.power_cut && !args.recheck && args.mode.flush_method() == FlushMethod::Syncfs {
        return Err(TortureError::SyncfsUnderPowerCut {
            mode: args.mode.key,
        });
    }
    let mut seed = args.seed.unwrap_or_else(rand::random);
    let (mut power_cut, mut mode) = (args.power_cut, args.mode);
    let selected: Vec<&Entry> = if args.workload == ALL {
        WORKLOADS.iter().collect()
    } else {
        let entry = WORKLOADS
            .iter()
            .find(|w| w.name == args.workload)
            .ok_or_else(|| TortureError::UnknownWorkload {
                name: args.workload.clone(),
            })?;
        vec![entry]
    };

    // The temporary directory lives until the end of this function, so its
    // files are removed even when a run fails.
    let temporary;
    let root = match &args.data_dir {
        Some(dir) => dir.clone(),
        None => {
            temporary = tempfile::Builder::new()
                .prefix("durability-torture-")
                .tempdir()
                .map_err(|source| TortureError::Io {
                    what: "cannot create a temporary directory in",
                    path: std::env::temp_dir(),
                    source,
                })?;
            temporary.path().to_path_buf()
        }
    };

    let mut reports = Vec::with_capacity(selected.len());
    for entry in selected {
        let began = Instant::now();
        let (files, supervised) = if args.recheck {
            let files = Files::new(root.join(entry.name));
            let supervised = supervisor::Supervised::load(&files)?;
            seed = supervised.seed;
            (files, supervised)
        } else {
            let files = prepare(root.join(entry.name))?;
            let plan = supervisor::Plan {
                workload: entry.name,
                seed,
                kills: args.kills,
                mode,
                faults: power_cut.then_some(args.faults.as_slice()),
                backup_during: args.backup_during,
            };
            let supervised = supervisor::supervise(&plan, &files)?;
            supervised.save(&files)?;
            (files, supervised)
        };
        // A recheck reports how the run it checks was made.
        (power_cut, mode) = (supervised.power_cut, supervised.mode(&files)?);
        let manifest = supervisor::read_manifest(&files)?;
        let finished = Finished {
            databases: if power_cut {
                files.disk()
            } else {
                files.data()
            },
            files,
            manifest,
            allowance: Allowance::for_run(power_cut, mode),
        };
        let mut tally = check(entry, &finished)?;
        backups::check(
            entry.check_copy,
            &finished,
            &supervised.backups,
            supervised.backup_during,
            &mut tally,
        )?;
        supervised.add_to(&mut tally);
        reports.push(WorkloadReport {
            workload: entry.name,
            kills: supervised.kills,
            faults: supervised.cuts.by_fault.clone(),
            elapsed: began.elapsed(),
            tally,
        });
    }
    Ok(Verdict {
        seed,
        power_cut,
        mode,
        reports,
        elapsed: started.elapsed(),
    })
}

/// Runs the integrity check and the workload's checker on a finished run.
/// A database the workload's checker cannot read is a `corrupt` object,
/// not an error of the run (the workload's other checks are then missing,
/// and the verdict fails).
fn check(entry: &Entry, finished: &Finished) -> Result<Tally, TortureError> {
    let (mut tally, unreadable) = match (entry.check)(finished) {
        Ok(tally) => (tally, None),
        Err(TortureError::Database { path, source }) => (finished.tally(), Some((path, source))),
        Err(error) => return Err(error),
    };
    let corrupt = integrity::check(finished, &mut tally);
    if let Some((path, source)) = unreadable {
        let message = format!(
            "the {} checker cannot read {}: {source}; its other checks did not run",
            entry.name,
            path.display()
        );
        if corrupt.contains(&path) {
            tally.flag(Violation::Broken("unchecked_workloads"), message);
        } else {
            tally.flag(Violation::Corrupt, message);
        }
    }
    Ok(tally)
}

/// Renders a verdict as `--json` asks; also returns whether it passed (the
/// command fails on any violation).
pub fn report(verdict: &Verdict, args: &TortureArgs) -> Result<(String, bool), TortureError> {
    let text = if args.json {
        serde_json::to_string_pretty(&verdict.to_json()).map_err(|source| TortureError::Encode {
            what: "the verdict",
            source,
        })?
    } else {
        verdict.render()
    };
    Ok((text, verdict.passed()))
}

/// Runs one life of `durability torture-child` and returns its exit code.
pub fn run_child(args: &ChildArgs) -> Result<ExitCode, TortureError> {
    let entry = WORKLOADS
        .iter()
        .find(|w| w.name == args.workload)
        .ok_or_else(|| TortureError::UnknownWorkload {
            name: args.workload.clone(),
        })?;
    let life = Life {
        files: Files::new(args.dir.clone()),
        seed: args.seed,
        index: args.life,
        is_final: args.is_final,
        items: args.items,
        mode: args.mode,
        passes: Cell::new(0),
    };
    Ok((entry.life)(&life)?.exit_code())
}

/// Makes `dir` a fresh run directory: a previous run's directory (it holds
/// the marker) is cleared, anything else that is not empty is refused.
fn prepare(dir: PathBuf) -> Result<Files, TortureError> {
    let files = Files::new(dir.clone());
    let io = |what, source| TortureError::Io {
        what,
        path: dir.clone(),
        source,
    };
    if dir.exists() {
        let empty = fs::read_dir(&dir)
            .map_err(|e| io("cannot read the run directory", e))?
            .next()
            .is_none();
        if !empty && !files.marker().exists() {
            return Err(TortureError::NotARunDirectory { path: dir });
        }
        fs::remove_dir_all(&dir).map_err(|e| io("cannot clear the previous run in", e))?;
    }
    fs::create_dir_all(&dir).map_err(|e| io("cannot create the run directory", e))?;
    fs::write(files.marker(), b"durability torture run directory\n")
        .map_err(|e| io("cannot mark the run directory", e))?;
    Ok(files)
}
