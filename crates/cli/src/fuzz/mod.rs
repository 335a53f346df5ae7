//! `durability fuzz --cases N [--seed S] [--json FILE] [--jobs N]`: random
//! and adversarial inputs against the public API of every capability
//! (operations, named alarms and their recurring schedules, fanout and
//! `redrive_parked`, the log and its cold storage, routing, load) and
//! malformed rows written straight into their tables, on hosts in each
//! commit mode (the default group commit, FULL, NORMAL); see [`cases`]
//! for what each case checks.
//!
//! Speed: the object files live in /dev/shm when there is one; most cases
//! start from a copy of a migrated file (one in 16 runs every migration
//! itself); `--jobs N` runs N children at once on contiguous ranges of
//! cases (the report, failures sorted by case, is the same as one job's).
//!
//! The supervisor (this module) runs the cases in a child process (the
//! same binary, hidden `fuzz-child`), which prints a line when each case
//! begins and ends. A panic anywhere in a case is caught in the child (its
//! panic hook) and fails that case; a child that dies (abort, stack
//! overflow, any signal) or makes no progress for `--hang-timeout-s`
//! seconds of its CPU time, or twelve times that of wall time (killed),
//! fails the case it was in, and a new child goes on with
//! the next case. The inputs of such a case are recovered by running it
//! again alone in trace mode, where the child prints each input before
//! using it. Exit code: non-zero when any case failed.
//!
//! Case `i` of seed `S` draws its inputs from a generator seeded by
//! `(S, i)` only: `--seed S --from i --cases 1` runs it again alone.
//! Times matter too (where an interval's ticks or a cron's fall relative
//! to now), so the hosts' clocks start at an origin drawn from the seed,
//! never at the system time, and each case reports the clock it began at
//! (`clock_ms`); `--clock-ms T` starts a replay there. (A range run again
//! does not meet the same clocks: the virtual time of the cases before a
//! case adds up to its clock, and a retry storm ends after a budget of
//! CPU time, at whatever virtual time it reached. The reported clock is
//! what replays a case.) After the run,
//! every failed case runs once more alone at its clock, and the report
//! says whether it failed again (`reproduces_alone`): a case that passes
//! alone depends on the cases before it in its child, or on timing.
//!
//! **Retry storms are not hangs.** Options a user may set (a retry delay
//! of 0 ms with 2e9 attempts, a handler that always fails) ask for a storm
//! of attempts, each committed (attempt count, stored error): the work is
//! visibly retrying, and other calls of the object still interleave. On
//! paused time such a storm never lets virtual time move, so the case's
//! own waits would never end. The child therefore counts every handler
//! call; a case still running after half the hang timeout of CPU time
//! whose handlers were called (or attempts settled) at least 100 times
//! since it began ends
//! there and passes, with a `retry storm` line in its trace. A case that
//! makes no attempts for the whole hang timeout is still a hang (a hot
//! loop that commits nothing, like the damaged rows the scheduler's stall
//! guard now backs off from).

mod cases;
mod child;
mod inputs;

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::Serialize;

pub use child::{ChildArgs, run_child};

/// Arguments of `durability fuzz`.
#[derive(Debug, clap::Args)]
pub struct FuzzArgs {
    /// How many cases to run.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    cases: u64,
    /// The run's seed; each case's inputs depend on it and the case number
    /// only. Default: from the clock (printed, and in the JSON).
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// Also write the results as one JSON object (`cases`, `failures`,
    /// each failure with its `input` and `error`).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// The first case number (to run one case again: `--from i --cases 1`).
    #[arg(long, value_name = "I", default_value_t = 0)]
    from: u64,
    /// Where the cases' object files go. Default: a fresh directory in
    /// /dev/shm when there is one (the harness tests logic, not fsync),
    /// else the temporary directory; removed afterwards.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// A case that uses this much CPU time without ending, or twelve times
    /// this of wall time, is a hang; a retry storm ends as visibly
    /// retrying after half of it (see the module docs).
    #[arg(long, value_name = "SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    hang_timeout_s: u64,
    /// Run the cases in this many child processes at once, each a
    /// contiguous range of them.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    jobs: u16,
    /// Test hook: make case I panic, abort, hang in a hot loop or wait
    /// for what nothing wakes (`panic@I`, `abort@I`, `hang@I`, `wait@I`),
    /// to show the harness catches each, or a retry storm (`storm@I`), to
    /// show it is not taken for a hang.
    #[arg(long, hide = true, value_name = "KIND@I")]
    inject: Option<String>,
    /// Start the first case at this host clock (epoch ms) instead of at
    /// the seed's origin: a failure's `clock_ms`, to replay it exactly
    /// (`--seed S --from i --cases 1 --clock-ms T`).
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(i64).range(0..=9_007_199_254_740_991))]
    clock_ms: Option<i64>,
    /// Run only the cases of this kind (repeat for several: `--kind
    /// malformed-rows --kind log`); the others are skipped, counted in
    /// `skipped`. Case `i` draws the same inputs with or without the
    /// filter (its clock differs: it follows from the cases run before it).
    #[arg(long, value_name = "KIND")]
    kind: Vec<String>,
}

/// Why the fuzz run could not run (a failing case is not an error: it is
/// reported, and the exit code says so).
#[derive(Debug, thiserror::Error)]
pub enum FuzzError {
    #[error("{what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the fuzz child process")]
    Spawn {
        #[source]
        source: std::io::Error,
    },
    #[error("the fuzz child printed a line the supervisor cannot read: {line:?}")]
    Protocol { line: String },
    #[error("cannot encode the results as JSON")]
    Json {
        #[source]
        source: serde_json::Error,
    },
    #[error("--inject must be panic@I, abort@I, hang@I, wait@I or storm@I, got {value:?}")]
    Inject { value: String },
    #[error("--kind must be one of {known}, got {value:?}")]
    Kind { value: String, known: String },
    #[error("cannot start the fuzz child's runtime or host: {message}")]
    Setup { message: String },
}

/// One failed case.
#[derive(Debug, Clone, Serialize)]
pub struct CaseFailure {
    pub case: u64,
    pub capability: String,
    /// What went wrong.
    pub error: String,
    /// The case's inputs and steps, in order.
    pub input: Vec<String>,
    /// The host clock (epoch ms) when the case began: `--clock-ms` replays
    /// the case at it.
    pub clock_ms: Option<i64>,
    /// Whether the case, run again alone at the same clock, failed again
    /// (`false`: it depends on the cases before it in its child, or on
    /// timing); `None` when the replay could not run.
    pub reproduces_alone: Option<bool>,
}

/// What a run found.
#[derive(Debug, Serialize)]
pub struct FuzzReport {
    pub cases: u64,
    pub seed: u64,
    pub from: u64,
    /// Cases ran in this many child processes at once (`--jobs`).
    pub jobs: u64,
    pub failed: usize,
    pub failures: Vec<CaseFailure>,
    pub by_capability: BTreeMap<String, u64>,
    /// Cases of the range not run because `--kind` left them out.
    pub skipped: u64,
    /// The kinds `--kind` kept; empty when every kind ran.
    pub kinds: Vec<String>,
    /// Child processes started (one more after each abort or hang).
    pub child_processes: u64,
    pub elapsed_s: f64,
    pub cases_per_sec: f64,
}

/// Runs `durability fuzz`; returns what to print and whether every case
/// passed.
pub fn run(args: &FuzzArgs) -> Result<(String, bool), FuzzError> {
    if let Some(inject) = &args.inject {
        child::parse_inject(inject)?;
    }
    for kind in &args.kind {
        if !cases::KINDS.contains(&kind.as_str()) {
            return Err(FuzzError::Kind {
                value: kind.clone(),
                known: cases::KINDS.join(", "),
            });
        }
    }
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let temporary;
    let dir = match &args.data_dir {
        Some(dir) => dir.clone(),
        None => {
            let shm = Path::new("/dev/shm");
            let base = if shm.is_dir() {
                shm.to_path_buf()
            } else {
                std::env::temp_dir()
            };
            temporary = tempfile::Builder::new()
                .prefix("durability-fuzz-")
                .tempdir_in(&base)
                .map_err(|source| FuzzError::Io {
                    what: "cannot create a directory in",
                    path: base,
                    source,
                })?;
            temporary.path().to_path_buf()
        }
    };
    let started = Instant::now();
    let bar = crate::bench::progress_bar("fuzz cases", args.cases);
    let end = args.from.saturating_add(args.cases);
    let hang = Duration::from_secs(args.hang_timeout_s);
    // Contiguous ranges, one per job, each run by children of its own.
    let jobs = u64::from(args.jobs).min(args.cases).max(1);
    let per_job = args.cases.div_ceil(jobs);
    let ranges: Vec<(u64, u64)> = (0..jobs)
        .map(|job| {
            let from = args.from.saturating_add(job * per_job);
            (from, from.saturating_add(per_job).min(end))
        })
        .filter(|(from, end)| from < end)
        .collect();
    let tallies: Vec<Result<Tally, FuzzError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranges
            .iter()
            .enumerate()
            .map(|(job, &(from, end))| {
                let job_dir = dir.join(format!("job-{job}"));
                let bar = &bar;
                scope.spawn(move || run_range(args, seed, from, end, &job_dir, hang, bar))
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle.join().unwrap_or_else(|_| {
                    Err(FuzzError::Setup {
                        message: "a job's supervisor thread panicked".into(),
                    })
                })
            })
            .collect()
    });
    let mut report = FuzzReport {
        cases: 0,
        seed,
        from: args.from,
        jobs,
        failed: 0,
        failures: Vec::new(),
        by_capability: BTreeMap::new(),
        skipped: 0,
        kinds: args.kind.clone(),
        child_processes: 0,
        elapsed_s: 0.0,
        cases_per_sec: 0.0,
    };
    for tally in tallies {
        let tally = tally?;
        report.cases += tally.cases;
        report.skipped += tally.skipped;
        report.child_processes += tally.child_processes;
        report.failures.extend(tally.failures);
        for (kind, n) in tally.by_capability {
            *report.by_capability.entry(kind).or_default() += n;
        }
    }
    report.failures.sort_by_key(|failure| failure.case);
    bar.finish_and_clear();
    report.failed = report.failures.len();
    report.elapsed_s = started.elapsed().as_secs_f64();
    report.cases_per_sec = if report.elapsed_s > 0.0 {
        (report.cases as f64 / report.elapsed_s).round()
    } else {
        0.0
    };
    if let Some(path) = &args.json {
        let text =
            serde_json::to_string_pretty(&report).map_err(|source| FuzzError::Json { source })?;
        std::fs::write(path, text + "\n").map_err(|source| FuzzError::Io {
            what: "cannot write JSON results to",
            path: path.clone(),
            source,
        })?;
    }
    Ok((render(&report), report.failures.is_empty()))
}

/// What the children of one job found.
#[derive(Default)]
struct Tally {
    cases: u64,
    skipped: u64,
    failures: Vec<CaseFailure>,
    by_capability: BTreeMap<String, u64>,
    child_processes: u64,
}

/// Runs cases `from..end` in children one after the other (a new child
/// after each abort or hang), under `dir`; then runs every failed case
/// again alone, at the clock it began at.
fn run_range(
    args: &FuzzArgs,
    seed: u64,
    from: u64,
    end: u64,
    dir: &Path,
    hang: Duration,
    bar: &indicatif::ProgressBar,
) -> Result<Tally, FuzzError> {
    let mut tally = Tally::default();
    let mut next = from;
    while next < end {
        tally.child_processes += 1;
        let child_dir = dir.join(format!("child-{}", tally.child_processes));
        // `--clock-ms` is the clock of the run's first case only.
        let clock = args.clock_ms.filter(|_| next == args.from);
        let mut began_at = None;
        let outcome = supervise(
            args,
            seed,
            next,
            end,
            &child_dir,
            hang,
            false,
            clock,
            &mut |line| match line {
                Line::Ended {
                    case,
                    kind,
                    failure,
                } => {
                    tally.cases += 1;
                    *tally.by_capability.entry(kind.clone()).or_default() += 1;
                    if let Some(failure) = failure {
                        tally.failures.push(CaseFailure {
                            case,
                            capability: kind,
                            error: failure.error,
                            input: failure.input,
                            clock_ms: Some(failure.clock_ms),
                            reproduces_alone: None,
                        });
                    }
                    bar.inc(1);
                }
                Line::Begun { clock_ms, .. } => began_at = clock_ms,
                Line::Skipped => {
                    tally.skipped += 1;
                    bar.inc(1);
                }
                Line::Trace(_) => {}
            },
        )?;
        let _ = std::fs::remove_dir_all(&child_dir);
        match outcome {
            Stopped::Finished => break,
            Stopped::Died { case, why } => {
                // Its inputs: the same case again, alone, at the same
                // clock, printing each one.
                let (input, kind, again) = replay(args, seed, case, began_at, dir, hang, true)?;
                tally.cases += 1;
                *tally.by_capability.entry(kind.clone()).or_default() += 1;
                tally.failures.push(CaseFailure {
                    case,
                    capability: kind,
                    error: why,
                    input,
                    clock_ms: began_at,
                    reproduces_alone: Some(again),
                });
                bar.inc(1);
                next = case + 1;
            }
        }
    }
    for failure in &mut tally.failures {
        if failure.reproduces_alone.is_none() {
            let (_, _, again) =
                replay(args, seed, failure.case, failure.clock_ms, dir, hang, false)?;
            failure.reproduces_alone = Some(again);
        }
    }
    Ok(tally)
}

/// Runs case `case` again alone in a fresh child, starting at `clock_ms`;
/// returns its trace (in trace mode), its kind, and whether it failed
/// again (an abort or a hang counts).
fn replay(
    args: &FuzzArgs,
    seed: u64,
    case: u64,
    clock_ms: Option<i64>,
    dir: &Path,
    hang: Duration,
    trace: bool,
) -> Result<(Vec<String>, String, bool), FuzzError> {
    let replay_dir = dir.join(format!("replay-{case}"));
    let mut input = Vec::new();
    let mut kind = String::from("?");
    let mut failed = false;
    let stopped = supervise(
        args,
        seed,
        case,
        case + 1,
        &replay_dir,
        hang,
        trace,
        clock_ms,
        &mut |line| match line {
            Line::Trace(text) => input.push(text),
            Line::Begun { kind: k, .. } => kind = k,
            Line::Ended { failure, .. } => failed = failure.is_some(),
            Line::Skipped => {}
        },
    )?;
    let _ = std::fs::remove_dir_all(&replay_dir);
    Ok((
        input,
        kind,
        failed || matches!(stopped, Stopped::Died { .. }),
    ))
}

fn render(report: &FuzzReport) -> String {
    let mut text = format!(
        "fuzz: {} cases from {} (seed {}, {} jobs), {} failed, {:.0} cases/s, {:.1} s, {} child processes\nby capability: {}",
        report.cases,
        report.from,
        report.seed,
        report.jobs,
        report.failed,
        report.cases_per_sec,
        report.elapsed_s,
        report.child_processes,
        report
            .by_capability
            .iter()
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if !report.kinds.is_empty() {
        text.push_str(&format!(
            "\nonly --kind {}: {} other cases skipped",
            report.kinds.join(", "),
            report.skipped
        ));
    }
    for failure in report.failures.iter().take(20) {
        text.push_str(&format!(
            "\nFAILED case {} ({}): {}\n  rerun: durability fuzz --seed {} --from {} --cases 1{}\n  alone: {}\n  input:",
            failure.case,
            failure.capability,
            failure.error,
            report.seed,
            failure.case,
            failure
                .clock_ms
                .map(|ms| format!(" --clock-ms {ms}"))
                .unwrap_or_default(),
            match failure.reproduces_alone {
                Some(true) => "fails again when run alone at the same clock",
                Some(false) =>
                    "passes when run alone at the same clock (depends on the cases before it, or on timing)",
                None => "not run again",
            }
        ));
        for line in failure.input.iter().take(40) {
            text.push_str(&format!("\n    {line}"));
        }
    }
    if report.failed > 20 {
        text.push_str(&format!(
            "\n... and {} more failures (see --json)",
            report.failed - 20
        ));
    }
    text
}

/// A line of the child's protocol.
enum Line {
    Begun {
        case: u64,
        kind: String,
        clock_ms: Option<i64>,
    },
    Ended {
        case: u64,
        kind: String,
        failure: Option<ChildFailure>,
    },
    /// A case `--kind` left out.
    Skipped,
    Trace(String),
}

/// What a child said of a failed case.
struct ChildFailure {
    error: String,
    input: Vec<String>,
    clock_ms: i64,
}

/// How a child stopped.
enum Stopped {
    Finished,
    Died { case: u64, why: String },
}

/// Runs cases `from..end` in one child and reports its lines; returns when
/// it finished, died or hung (then it is killed).
#[allow(clippy::too_many_arguments)] // each is one setting of the child run
fn supervise(
    args: &FuzzArgs,
    seed: u64,
    from: u64,
    end: u64,
    dir: &Path,
    hang: Duration,
    trace: bool,
    clock_ms: Option<i64>,
    on_line: &mut dyn FnMut(Line),
) -> Result<Stopped, FuzzError> {
    let exe = std::env::current_exe().map_err(|source| FuzzError::Spawn { source })?;
    let mut command = Command::new(exe);
    command
        .arg("fuzz-child")
        .args(["--seed", &seed.to_string()])
        .args(["--from", &from.to_string()])
        .args(["--to", &end.to_string()])
        .arg("--data-dir")
        .arg(dir)
        .args([
            "--storm-after-ms",
            &(hang.as_millis() / 2).max(1).to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if trace {
        command.arg("--trace");
    }
    if let Some(inject) = &args.inject {
        command.args(["--inject", inject]);
    }
    if let Some(clock_ms) = clock_ms {
        command.args(["--clock-ms", &clock_ms.to_string()]);
    }
    for kind in &args.kind {
        command.args(["--kind", kind]);
    }
    let mut child = command
        .spawn()
        .map_err(|source| FuzzError::Spawn { source })?;
    let stdout = child.stdout.take().ok_or_else(|| FuzzError::Spawn {
        source: std::io::Error::other("no stdout pipe"),
    })?;
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut in_flight: Option<u64> = None;
    let pid = child.id();
    let mut since_line = Progress::now(pid);
    let stopped = loop {
        let received = rx.recv_timeout(POLL);
        if received.is_ok() {
            since_line = Progress::now(pid);
        } else if matches!(received, Err(mpsc::RecvTimeoutError::Timeout))
            && !since_line.hung(pid, hang)
        {
            continue;
        }
        match received {
            Ok(line) => match parse(&line)? {
                begun @ Line::Begun { case, .. } => {
                    in_flight = Some(case);
                    on_line(begun);
                }
                ended @ Line::Ended { .. } => {
                    in_flight = None;
                    on_line(ended);
                }
                trace_line => on_line(trace_line),
            },
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let status = child.wait();
                break match in_flight {
                    Some(case) => Stopped::Died {
                        case,
                        why: format!(
                            "hang: no progress for {} s of CPU time or {} s of wall time (killed; {})",
                            hang.as_secs(),
                            hang.as_secs() * u64::from(IDLE_HANG_FACTOR),
                            describe(status.ok())
                        ),
                    },
                    None => Stopped::Died {
                        case: from,
                        why: format!("hang: the child printed nothing for {} s", hang.as_secs()),
                    },
                };
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = child.wait().ok();
                break match (in_flight, status) {
                    (Some(case), status) => Stopped::Died {
                        case,
                        why: format!("the process died during the case: {}", describe(status)),
                    },
                    (None, Some(status)) if status.success() => Stopped::Finished,
                    (None, status) => Stopped::Died {
                        case: from,
                        why: format!("the child failed between cases: {}", describe(status)),
                    },
                };
            }
        }
    };
    reap(&mut child);
    let _ = reader.join();
    Ok(stopped)
}

/// How often the supervisor looks at a silent child.
const POLL: Duration = Duration::from_millis(250);

/// A silent child is hung after this many hang timeouts of wall time even
/// when it uses no CPU (blocked for good, not busy).
const IDLE_HANG_FACTOR: u32 = 12;

/// Where a child stood when it last printed a line: the wall clock and
/// its CPU time.
struct Progress {
    at: Instant,
    cpu: Option<Duration>,
}

impl Progress {
    fn now(pid: u32) -> Progress {
        Progress {
            at: Instant::now(),
            cpu: child_cpu_time(pid),
        }
    }

    /// Hung: the child spent `hang` of CPU time without printing a line
    /// (a loop), or `IDLE_HANG_FACTOR` times that of wall time (blocked).
    /// CPU time, not wall time, decides the first, so a child starved by
    /// other work on the machine (a `nice -n 19` run beside benchmarks) is
    /// never taken for a hung one.
    fn hung(&self, pid: u32, hang: Duration) -> bool {
        let wall = self.at.elapsed();
        match (self.cpu, child_cpu_time(pid)) {
            (Some(before), Some(now)) => {
                now.saturating_sub(before) >= hang || wall >= hang * IDLE_HANG_FACTOR
            }
            _ => wall >= hang,
        }
    }
}

/// The CPU time (user and system) process `pid` has used so far, from
/// `/proc/<pid>/stat`; `None` where that cannot be read.
fn child_cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which may hold spaces: state is
    // the first, utime the 12th and stime the 13th.
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = u64::try_from(ticks).ok().filter(|t| *t > 0)?;
    Some(Duration::from_millis((utime + stime) * 1_000 / ticks))
}

fn reap(child: &mut Child) {
    if matches!(child.try_wait(), Ok(None)) {
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn describe(status: Option<ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match status {
        Some(status) => match status.signal() {
            Some(signal) => format!(
                "killed by signal {signal}{}",
                match signal {
                    6 => " (SIGABRT: abort, e.g. a stack overflow or a panic while panicking)",
                    11 => " (SIGSEGV)",
                    9 => " (SIGKILL)",
                    _ => "",
                }
            ),
            None => format!("exit code {}", status.code().unwrap_or(-1)),
        },
        None => "status unknown".into(),
    }
}

fn parse(line: &str) -> Result<Line, FuzzError> {
    let bad = || FuzzError::Protocol {
        line: line.chars().take(200).collect(),
    };
    let (tag, rest) = line.split_once(' ').ok_or_else(bad)?;
    match tag {
        "T" => Ok(Line::Trace(rest.to_owned())),
        "S" => Ok(Line::Skipped),
        "B" => {
            let mut fields = rest.split(' ');
            let (Some(case), Some(kind), clock) = (fields.next(), fields.next(), fields.next())
            else {
                return Err(bad());
            };
            Ok(Line::Begun {
                case: case.parse().map_err(|_| bad())?,
                kind: kind.to_owned(),
                clock_ms: clock.map(str::parse).transpose().map_err(|_| bad())?,
            })
        }
        "O" => {
            let (case, kind) = rest.split_once(' ').ok_or_else(bad)?;
            Ok(Line::Ended {
                case: case.parse().map_err(|_| bad())?,
                kind: kind.to_owned(),
                failure: None,
            })
        }
        "F" => {
            let failure: child::FailureLine = serde_json::from_str(rest).map_err(|_| bad())?;
            Ok(Line::Ended {
                case: failure.case,
                kind: failure.kind,
                failure: Some(ChildFailure {
                    error: failure.error,
                    input: failure.input,
                    clock_ms: failure.clock_ms,
                }),
            })
        }
        _ => Err(bad()),
    }
}
