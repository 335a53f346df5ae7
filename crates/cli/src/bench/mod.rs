//! `durability bench SCENARIO`: a registry of named scenarios, the
//! environment they run in (a data directory, the quick switch, progress
//! bars) and how their results are shown (a summary table) and saved (JSON).
//!
//! Speed is measured here and only here; tests never assert timing. Every
//! scenario runs on real time and real files. Scenarios that exercise the
//! host divide their rates by the raw SQLite floor ([`sqlite_floor`])
//! measured in the same run, so a figure reads "x % of what the disk allows"
//! rather than a number that only means something on this machine.

mod alarms;
mod backup;
mod fanout;
mod fanout_backlog;
mod host_calls;
mod index_rebuild;
mod latency;
mod log;
mod operations;
mod report;
mod routing;
mod rss;
mod sqlite_floor;

use std::fs;
use std::path::PathBuf;

use clap::builder::{PossibleValue, PossibleValuesParser};
use indicatif::{ProgressBar, ProgressStyle};

pub use latency::Latency;
pub use report::{Figure, Measurement, ScenarioReport};

/// What `durability bench --help` says after the scenario list.
pub const AFTER_HELP: &str = "\
Durability modes. The host's default is group commit with output gates: a
commit returns at memory speed, a host-wide flusher makes every pending
commit of every object durable with one fdatasync of the host journal, and
a call's reply is released once the commits before it are on disk. `full`
syncs each commit; `normal` never waits for a sync (no promise at power
loss). Scenarios name their measurements by mode: default/...,
default-walfiles/... (one fdatasync per dirty WAL per flush instead of the
journal), default-syncfs/... (one syncfs per flush), full/..., normal/....

  operations   end-to-end no-op ops/s (first registration to last committed
               completion) with 1 and 64 callers, on one object and across
               100, per mode (with default-walfiles); p50/p99 = one
               registration as its caller waits.
               Top-level ops_per_sec = default/100-objects/64-callers;
               top-level floor_ratio = that / full/write (the FULL 1-row
               commit rate of raw SQLite, same run); cpu_us_per_op = the
               process's CPU time per operation (user + system).
  host-calls   64 callers over 1 and 1,000 objects, each call one commit, per
               mode (with default-walfiles and default-syncfs): ops_per_sec = replies/s,
               commits_per_sec = commits returned inside the objects.
  fanout       deliveries/s with ack_on_return (one commit per batch) and
               without (ack-each, one commit per delivery) in the default
               mode, and ack-each again in full mode: the figure
               ack_each_gain_over_full is the gain.

Every rate is also divided by a raw-SQLite floor measured in the same run
(floor_ratio, the ÷ floor column). On a machine shared with other work,
quote figures with their floor ratio: absolute rates move with the load.";

/// Arguments of `durability bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// The scenario to run.
    #[arg(value_parser = PossibleValuesParser::new(SCENARIOS.iter().map(Scenario::possible_value)))]
    scenario: String,
    /// Also write the results to FILE as one JSON object (fields `scenario`,
    /// `ops_per_sec`, `p50_us`, `p99_us`, `floor_ratio` of the headline,
    /// then every measurement).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Shrink every size so that the run takes seconds (smoke runs, CI).
    #[arg(long)]
    quick: bool,
    /// Where the scenario puts its databases. Default: a fresh temporary
    /// directory, removed afterwards. Give a directory on the disk you care
    /// about: the figures are mostly the cost of its fsync.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
}

/// Why a benchmark could not run or could not save its results.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{what}")]
    Sqlite {
        what: &'static str,
        #[source]
        source: rusqlite::Error,
    },
    #[error("{what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot set up the archive: {message}")]
    Archive { message: String },
    #[error("cannot build a latency histogram: {message}")]
    Histogram { message: String },
    #[error("cannot write JSON results to {}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot start the benchmark's tokio runtime")]
    Runtime {
        #[source]
        source: std::io::Error,
    },
    #[error("the object host failed")]
    Host {
        #[from]
        source: durability_host::HostError,
    },
    #[error("a call to a benchmark object failed")]
    Call {
        #[from]
        source: durability_host::CallError,
    },
    #[error("a benchmark object's storage failed")]
    Storage {
        #[from]
        source: durability_platform::StorageError,
    },
    #[error("a backup failed")]
    Backup {
        #[from]
        source: durability_host::backup::BackupError,
    },
    #[error("a benchmark caller task failed: {message}")]
    Task { message: String },
    #[error("only {fired} of {armed} alarms fired before the run gave up waiting")]
    AlarmsMissing { fired: usize, armed: usize },
    #[error("unknown scenario {name:?}; known: {known}")]
    UnknownScenario { name: String, known: String },
}

/// One registered scenario.
struct Scenario {
    name: &'static str,
    about: &'static str,
    run: fn(&BenchEnv) -> Result<ScenarioReport, BenchError>,
}

impl Scenario {
    fn possible_value(&self) -> PossibleValue {
        PossibleValue::new(self.name).help(self.about)
    }
}

/// Every scenario `durability bench` knows, in the order `--help` lists them.
const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: sqlite_floor::NAME,
        about: "raw rusqlite doing a capability's row writes with no logic: the floor",
        run: sqlite_floor::run,
    },
    Scenario {
        name: fanout::NAME,
        about: "fanout: 2 targets acking at once, ack on return on and off (and off in full mode), against a raw-SQLite floor",
        run: fanout::run,
    },
    Scenario {
        name: fanout_backlog::NAME,
        about: "fanout: deliveries/s with no backlog and with a large paused backlog",
        run: fanout_backlog::run,
    },
    Scenario {
        name: host_calls::NAME,
        about: "the object host: replies/s and commits/s per durability mode, open time, memory per object, alarm lateness",
        run: host_calls::run,
    },
    Scenario {
        name: index_rebuild::NAME,
        about: "the object host: start-up time when the alarm index is rebuilt from 10,000 object files",
        run: index_rebuild::run,
    },
    Scenario {
        name: backup::NAME,
        about: "backup: objects/s and MB/s of Host::backup of 10,000 objects while the host serves them, against SQLite's backup API in a bare loop",
        run: backup::run,
    },
    Scenario {
        name: operations::NAME,
        about: "durable operations end to end per durability mode: ops/s with 1 and 64 callers on 1 and 100 objects, registration p50/p99",
        run: operations::run,
    },
    Scenario {
        name: log::NAME,
        about: "retained log: appends/s in batches of 1 and 100, hot and cold reads, trim to cold",
        run: log::run,
    },
    Scenario {
        name: alarms::NAME,
        about: "named alarms: fired/s and lateness, live timers off and on",
        run: alarms::run,
    },
    Scenario {
        name: routing::NAME,
        about: "routing client: pushes/s to 1, 16, 256 objects; backlog spread under a skewed producer",
        run: routing::run,
    },
];

/// What a scenario runs in: where to put files, how big to go, and how to
/// show progress.
pub struct BenchEnv {
    dir: PathBuf,
    quick: bool,
}

impl BenchEnv {
    /// Whether to shrink sizes so the run takes seconds.
    pub fn quick(&self) -> bool {
        self.quick
    }

    /// `full` normally, `quick` under `--quick`.
    pub fn size<T>(&self, full: T, quick: T) -> T {
        if self.quick { quick } else { full }
    }

    /// A fresh sub-directory of the run's directory for one part of a
    /// scenario, so parts never see each other's files.
    pub fn subdir(&self, name: &str) -> Result<PathBuf, BenchError> {
        let path = self.dir.join(name);
        if path.exists() {
            fs::remove_dir_all(&path).map_err(|source| BenchError::Io {
                what: "cannot clear the benchmark directory",
                path: path.clone(),
                source,
            })?;
        }
        fs::create_dir_all(&path).map_err(|source| BenchError::Io {
            what: "cannot create the benchmark directory",
            path: path.clone(),
            source,
        })?;
        Ok(path)
    }

    /// A progress bar for a phase of `total` operations (see
    /// [`progress_bar`]).
    pub fn progress(&self, phase: &str, total: u64) -> ProgressBar {
        progress_bar(phase, total)
    }
}

/// A progress bar for a phase of `total` operations, in the style of every
/// bar of the binary (the demo's too). It draws on stderr only when stderr
/// is a terminal, so piped and test runs stay clean.
/// Objects a set-up makes at a time: each chunk is evicted once made, so
/// setting up 10,000 objects never holds 10,000 files open.
pub(crate) const SETUP_CHUNK: usize = 500;

/// Makes `objects` objects of `ns`, named `name(i)`, [`SETUP_CHUNK`] at a
/// time: each runs the call `set_up(i)` gives, and each chunk is evicted
/// once its calls are done. `bar` ticks once per object.
pub(crate) async fn set_up_objects<T, C, Fut>(
    host: &durability_host::Host,
    ns: &durability_host::Namespace<T>,
    objects: usize,
    bar: &ProgressBar,
    name: impl Fn(usize) -> String,
    set_up: impl Fn(usize) -> C,
) -> Result<(), BenchError>
where
    T: durability_host::DurableObject,
    C: FnOnce(std::rc::Rc<T>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), durability_platform::StorageError>> + 'static,
{
    for start in (0..objects).step_by(SETUP_CHUNK) {
        let end = (start + SETUP_CHUNK).min(objects);
        let mut calls = tokio::task::JoinSet::new();
        let mut stubs = Vec::new();
        for i in start..end {
            let stub = ns.stub(&name(i))?;
            stubs.push(stub.clone());
            let call = set_up(i);
            calls.spawn(async move { stub.call(call).await });
        }
        while let Some(joined) = calls.join_next().await {
            joined
                .map_err(|e| BenchError::Task {
                    message: e.to_string(),
                })??
                .map_err(BenchError::from)?;
            bar.inc(1);
        }
        for stub in &stubs {
            host.evict(stub.id()).await?;
        }
    }
    Ok(())
}

pub(crate) fn progress_bar(phase: &str, total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template(
        "{prefix:>28} [{bar:30}] {pos:>7}/{len:7} {per_sec:>12} {elapsed:>4}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(phase.to_owned());
    bar
}

/// Runs `durability bench`, writes the JSON file if asked, and returns the
/// summary table to print.
pub fn run(args: &BenchArgs) -> Result<String, BenchError> {
    let scenario = SCENARIOS
        .iter()
        .find(|s| s.name == args.scenario)
        .ok_or_else(|| BenchError::UnknownScenario {
            name: args.scenario.clone(),
            known: SCENARIOS
                .iter()
                .map(|s| s.name)
                .collect::<Vec<_>>()
                .join(", "),
        })?;

    // The temporary directory lives until the end of this function, so the
    // scenario's files are removed even when it fails.
    let temporary;
    let dir = match &args.data_dir {
        Some(dir) => {
            fs::create_dir_all(dir).map_err(|source| BenchError::Io {
                what: "cannot create the benchmark directory",
                path: dir.clone(),
                source,
            })?;
            dir.clone()
        }
        None => {
            temporary = tempfile::Builder::new()
                .prefix("durability-bench-")
                .tempdir()
                .map_err(|source| BenchError::Io {
                    what: "cannot create a temporary directory in",
                    path: std::env::temp_dir(),
                    source,
                })?;
            temporary.path().to_path_buf()
        }
    };
    let env = BenchEnv {
        dir,
        quick: args.quick,
    };

    let report = (scenario.run)(&env)?;

    if let Some(path) = &args.json {
        let text =
            serde_json::to_string_pretty(&report.to_json()).map_err(|source| BenchError::Json {
                path: path.clone(),
                source,
            })?;
        fs::write(path, text + "\n").map_err(|source| BenchError::Io {
            what: "cannot write JSON results to",
            path: path.clone(),
            source,
        })?;
    }
    Ok(report.render())
}

/// Times `op` once and records its latency.
pub fn timed<T, E>(latency: &mut Latency, op: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    let started = std::time::Instant::now();
    let value = op()?;
    latency.record(started.elapsed());
    Ok(value)
}
