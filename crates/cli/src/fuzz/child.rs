//! `durability fuzz-child`: runs cases `--from..--to` of one seed, one
//! fresh object each, on an inline host over paused tokio time, and prints
//! one line per case event on stdout (flushed): `B <case> <kind> <clock_ms>`
//! when it begins, `O <case> <kind>` when it passed, `F <json>` when it failed,
//! `S <case>` when `--kind` left it out, and in trace mode `T <input>`
//! before each input is used.

use std::cell::RefCell;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durability_host::{AlarmInfo, BoxError, DurableObject, Host, Namespace, Synchronous};
use serde::{Deserialize, Serialize};

use super::FuzzError;
use super::cases::{self, KINDS, Stage};
use super::inputs::Fx;

/// Arguments of the hidden `durability fuzz-child`.
#[derive(Debug, clap::Args)]
pub struct ChildArgs {
    #[arg(long)]
    seed: u64,
    #[arg(long)]
    from: u64,
    #[arg(long)]
    to: u64,
    #[arg(long)]
    data_dir: PathBuf,
    #[arg(long)]
    trace: bool,
    #[arg(long)]
    inject: Option<String>,
    /// A case still running after this many milliseconds of CPU time while its
    /// handlers keep being called is a retry storm its options asked for:
    /// it ends there and passes (see the module docs of `fuzz`).
    #[arg(long, default_value_t = 30_000)]
    storm_after_ms: u64,
    /// Start the first case at this host clock (epoch ms) instead of at
    /// the seed's origin: replays a case at the time it first ran.
    #[arg(long)]
    clock_ms: Option<i64>,
    /// Run only the cases of these kinds; print `S <case>` for the others.
    #[arg(long)]
    kind: Vec<String>,
}

/// 2026-01-01T00:00:00Z. The hosts' clocks start at it plus an offset
/// drawn from the seed, never at the system time: a case's times (and so
/// where an interval's or a cron's ticks fall) repeat with its seed, and
/// every case reports the clock it started at (`B` line, `clock at start`
/// input), which `--clock-ms` replays.
const FUZZ_EPOCH_MS: i64 = 1_767_225_600_000;

/// The span the seed's offset is drawn from: a leap year and a bit, so
/// runs of different seeds start at every time of day and of the year.
const ORIGIN_SPAN_MS: u64 = 400 * 86_400_000;

/// A replayed case's hosts start this long before its clock, then time is
/// advanced to it (the template's migrations run in between).
const REPLAY_LEAD_MS: i64 = 3_600_000;

/// Where the hosts' clocks start.
fn clock_origin(seed: u64, replay_at: Option<i64>) -> i64 {
    match replay_at {
        Some(at) => at.saturating_sub(REPLAY_LEAD_MS).max(0),
        None => FUZZ_EPOCH_MS.saturating_add(
            i64::try_from(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) % ORIGIN_SPAN_MS).unwrap_or(0),
        ),
    }
}

/// Handler calls a case must make after its real-time budget to count as
/// a retry storm rather than a hang.
const STORM_ATTEMPTS: u64 = 100;

/// A failed case as the child reports it.
#[derive(Debug, Serialize, Deserialize)]
pub struct FailureLine {
    pub case: u64,
    pub kind: String,
    /// The host clock when the case began.
    pub clock_ms: i64,
    pub error: String,
    pub input: Vec<String>,
}

/// What `--inject` makes a case do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Inject {
    Panic,
    Abort,
    Hang,
    /// Case I becomes a retry storm of named alarms (always failing,
    /// 0 ms apart, 2e9 attempts), which must pass.
    Storm,
    /// Case I awaits what nothing wakes: a virtual-time hang.
    Wait,
}

/// `panic@I`, `abort@I`, `hang@I`, `wait@I` or `storm@I`.
pub(super) fn parse_inject(value: &str) -> Result<(u64, &'static str), FuzzError> {
    let bad = || FuzzError::Inject {
        value: value.to_owned(),
    };
    let (kind, case) = value.split_once('@').ok_or_else(bad)?;
    let case = case.parse().map_err(|_| bad())?;
    let kind = match kind {
        "panic" => "panic",
        "abort" => "abort",
        "hang" => "hang",
        "storm" => "storm",
        "wait" => "wait",
        _ => return Err(bad()),
    };
    Ok((case, kind))
}

/// Panics seen since the last case ended (the hook records, never prints).
static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The object every case runs on: its context, and the scheduler its
/// alarm delegates to (installed by the case).
struct FuzzObject {
    stage: Rc<Stage>,
}

impl DurableObject for FuzzObject {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        let scheduler = self.stage.scheduler.borrow().clone();
        match scheduler {
            Some(scheduler) => scheduler
                .alarm(Some(info))
                .await
                .map_err(|e| Box::new(e) as BoxError),
            None => Ok(()),
        }
    }
}

/// Runs the child; the exit code is 0 when it ran every case (passed or
/// not: the supervisor counts failures from the lines).
pub fn run_child(args: &ChildArgs) -> Result<ExitCode, FuzzError> {
    let inject = match &args.inject {
        Some(value) => {
            let (case, kind) = parse_inject(value)?;
            let kind = match kind {
                "panic" => Inject::Panic,
                "abort" => Inject::Abort,
                "storm" => Inject::Storm,
                "wait" => Inject::Wait,
                _ => Inject::Hang,
            };
            Some((case, kind))
        }
        None => None,
    };
    std::panic::set_hook(Box::new(|info| {
        if let Ok(mut panics) = PANICS.lock() {
            panics.push(info.to_string());
        }
    }));
    let setup = |message: String| FuzzError::Setup { message };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| setup(e.to_string()))?;
    // Wakes the storm watch of the running case four times a second of
    // real time (paused virtual time does not move during a storm).
    let tick = Arc::new(tokio::sync::Notify::new());
    {
        let tick = Arc::clone(&tick);
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(250));
                tick.notify_one();
            }
        });
    }
    let storm_after = Duration::from_millis(args.storm_after_ms);
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async {
        // One host per commit mode, each over a directory of its own: case
        // `i` runs on mode `i % 3`, so the group commit of the default
        // mode (output gates, the flusher) is fuzzed beside FULL and
        // NORMAL.
        let mut hosts = Vec::new();
        let origin = clock_origin(args.seed, args.clock_ms);
        for (mode, name) in HOST_MODES {
            let host = Host::builder(args.data_dir.join(name))
                .threads(0)
                .synchronous(mode)
                .clock_start_ms(origin)
                .idle_timeout(Duration::from_secs(400 * 86_400))
                .build()
                .map_err(|e| setup(e.to_string()))?;
            let objects = host
                .namespace("fuzz", |ctx| {
                    Ok(FuzzObject {
                        stage: Rc::new(Stage {
                            ctx,
                            scheduler: RefCell::new(None),
                        }),
                    })
                })
                .map_err(|e| setup(e.to_string()))?;
            hosts.push((host, objects, name));
        }
        let Some((first_host, first_objects, _)) = hosts.first() else {
            return Err(setup("no host".into()));
        };
        let template = match Template::make(first_host, first_objects, &args.data_dir).await {
            Ok(template) => template,
            Err(message) => return Err(setup(message)),
        };
        if let Some(at) = args.clock_ms {
            let ahead = at.saturating_sub(first_host.now_ms());
            if ahead > 0 {
                tokio::time::advance(Duration::from_millis(u64::try_from(ahead).unwrap_or(0)))
                    .await;
            }
        }
        for case in args.from..args.to {
            let injected = inject.and_then(|(at, kind)| (at == case).then_some(kind));
            let storm = Storm {
                after: storm_after,
                tick: Arc::clone(&tick),
            };
            let index = usize::try_from(case % HOST_MODES.len() as u64).unwrap_or(0);
            let Some((host, objects, mode)) = hosts.get(index) else {
                continue;
            };
            let run = CaseRun {
                host,
                objects,
                mode,
                seed: args.seed,
                case,
                trace: args.trace,
                inject: injected,
                template: &template,
                only: &args.kind,
            };
            run_case(run, storm).await;
        }
        for (host, _, _) in hosts {
            host.shutdown().await;
        }
        Ok::<(), FuzzError>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

fn emit(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// One case in this many starts from an empty file and runs every
/// migration itself; the others start from a copy of a migrated file.
const FRESH_FILE_EVERY: u64 = 16;

/// A migrated object file (every capability's tables, no host identity,
/// no alarm): copying it is far cheaper than running every migration per
/// case, which was a third of a case's time.
struct Template {
    path: PathBuf,
}

impl Template {
    async fn make(
        host: &Host,
        objects: &Namespace<FuzzObject>,
        dir: &std::path::Path,
    ) -> Result<Template, String> {
        let stub = objects.stub("template").map_err(|e| e.to_string())?;
        stub.call(|o: Rc<FuzzObject>| async move {
            cases::migrate_everything(Rc::clone(&o.stage)).await
        })
        .await
        .map_err(|e| e.to_string())??;
        host.evict(stub.id()).await.map_err(|e| e.to_string())?;
        let file = host.object_file(stub.id());
        let path = dir.join("template.sqlite");
        std::fs::copy(&file, &path).map_err(|e| format!("cannot copy {}: {e}", file.display()))?;
        remove_object_file(&file);
        // The host writes its identity and alarm into each file it opens:
        // the copy starts with neither.
        let conn = rusqlite::Connection::open(&path).map_err(|e| e.to_string())?;
        conn.execute_batch(
            "DELETE FROM _durability_host_meta; DELETE FROM _durability_host_alarm;",
        )
        .map_err(|e| e.to_string())?;
        conn.close().map_err(|(_, e)| e.to_string())?;
        Ok(Template { path })
    }

    /// Puts a copy at `file`, the object file of a case about to start.
    fn copy_to(&self, file: &std::path::Path) {
        if let Some(parent) = file.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = std::fs::copy(&self.path, file);
    }
}

/// Removes an object file with its WAL and shared-memory files.
fn remove_object_file(file: &std::path::Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut path = file.to_path_buf().into_os_string();
        path.push(suffix);
        let _ = std::fs::remove_file(PathBuf::from(path));
    }
}

/// The real-time budget after which a case whose handlers keep being
/// called ends as a retry storm, and the wake-ups that check it.
struct Storm {
    after: Duration,
    tick: Arc<tokio::sync::Notify>,
}

/// The CPU time this process has used so far (like the supervisor, the
/// storm budget counts CPU time, so a child starved by other work on the
/// machine does not end a slow case early).
pub(super) fn cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    let read = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut now) };
    if read != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(now.tv_sec).unwrap_or(0),
        u32::try_from(now.tv_nsec).unwrap_or(0),
    )
}

/// Resolves when the case has run `storm.after` of CPU time and its
/// handlers were called at least [`STORM_ATTEMPTS`] times meanwhile: a
/// retry storm (for example 2e9 attempts 0 ms apart), which on paused time
/// never lets virtual time move, so the case's own waits never end. Its
/// attempts are its progress; it never resolves for a case that makes
/// none, which the supervisor then reports as a hang.
async fn storm_watch(storm: Storm, steps: Arc<Mutex<Vec<String>>>) {
    let started = cpu_time();
    let attempts_at_start = cases::ATTEMPTS.load(std::sync::atomic::Ordering::Relaxed);
    loop {
        storm.tick.notified().await;
        let spent = cpu_time().saturating_sub(started);
        if spent < storm.after {
            continue;
        }
        let attempts = cases::ATTEMPTS
            .load(std::sync::atomic::Ordering::Relaxed)
            .saturating_sub(attempts_at_start);
        if attempts >= STORM_ATTEMPTS {
            if let Ok(mut steps) = steps.lock() {
                steps.push(format!(
                    "retry storm: {attempts} handler calls in {:.1} s of CPU time; ended by the storm budget",
                    spent.as_secs_f64()
                ));
            }
            return;
        }
    }
}

/// The host commit modes a case may run on, with their directory names.
const HOST_MODES: [(Synchronous, &str); 3] = [
    (Synchronous::Normal, "normal"),
    (Synchronous::Batched, "batched"),
    (Synchronous::Full, "full"),
];

/// Where and how one case runs.
struct CaseRun<'a> {
    host: &'a Host,
    objects: &'a Namespace<FuzzObject>,
    mode: &'static str,
    seed: u64,
    case: u64,
    trace: bool,
    inject: Option<Inject>,
    template: &'a Template,
    /// `--kind`: the kinds to run; empty runs every kind.
    only: &'a [String],
}

async fn run_case(run: CaseRun<'_>, storm: Storm) {
    let CaseRun {
        host,
        objects,
        mode,
        seed,
        case,
        trace,
        inject,
        template,
        only,
    } = run;
    let mut fx = Fx::new(seed, case, trace);
    let kind = fx.below(KINDS.len());
    let kind_name = cases::kind_name(kind);
    if !only.is_empty() && !only.iter().any(|k| k == kind_name) {
        emit(&format!("S {case}"));
        return;
    }
    let clock_ms = host.now_ms();
    emit(&format!("B {case} {kind_name} {clock_ms}"));
    fx.note(format!("case kind: {kind_name}"));
    fx.note(format!("clock at start: {clock_ms} ms"));
    fx.note(format!("host commit mode: {mode}"));
    let steps: Arc<Mutex<Vec<String>>> = fx.shared_trace();
    let storm_steps = Arc::clone(&steps);
    match inject {
        Some(Inject::Abort) => std::process::abort(),
        // A hot loop, like the hangs the harness finds: it burns CPU time,
        // which is what the supervisor measures.
        Some(Inject::Hang) => loop {
            std::hint::spin_loop();
        },
        Some(Inject::Panic | Inject::Storm | Inject::Wait) | None => {}
    }
    let verdict = match objects.stub(&format!("case-{case}")) {
        Ok(stub) => {
            if !case.is_multiple_of(FRESH_FILE_EVERY) {
                template.copy_to(&host.object_file(stub.id()));
            }
            let called = stub
                .call(move |o: Rc<FuzzObject>| async move {
                    if inject == Some(Inject::Panic) {
                        panic!("injected panic (--inject)");
                    }
                    let case = async {
                        match inject {
                            Some(Inject::Storm) => cases::storm(Rc::clone(&o.stage)).await,
                            Some(Inject::Wait) => cases::wait_forever(fx).await,
                            _ => cases::run(Rc::clone(&o.stage), kind, fx).await,
                        }
                    };
                    let verdict = tokio::select! {
                        verdict = case => verdict,
                        () = storm_watch(storm, storm_steps) => Ok(()),
                    };
                    // The case is over: its alarms and timers go with it.
                    o.stage.scheduler.borrow_mut().take();
                    let _ = durability::platform::Context::storage(&o.stage.ctx)
                        .delete_alarm()
                        .await;
                    verdict
                })
                .await;
            let _ = host.evict(stub.id()).await;
            remove_object_file(&host.object_file(stub.id()));
            match called {
                Ok(verdict) => verdict,
                Err(error) => Err(format!("the case's call failed: {error}")),
            }
        }
        Err(error) => Err(format!("no object for the case: {error}")),
    };
    let panics: Vec<String> = PANICS
        .lock()
        .map(|mut panics| panics.drain(..).collect())
        .unwrap_or_default();
    let verdict = if panics.is_empty() {
        verdict
    } else {
        Err(format!("panic: {}", panics.join(" | ")))
    };
    match verdict {
        Ok(()) => emit(&format!("O {case} {kind_name}")),
        Err(error) => {
            let input = steps.lock().map(|s| s.clone()).unwrap_or_default();
            let line = FailureLine {
                case,
                kind: kind_name.to_owned(),
                clock_ms,
                error,
                input,
            };
            match serde_json::to_string(&line) {
                Ok(json) => emit(&format!("F {json}")),
                Err(_) => emit(&format!(
                    "F {{\"case\":{case},\"kind\":\"{kind_name}\",\"clock_ms\":{clock_ms},\"error\":\"unencodable\",\"input\":[]}}"
                )),
            }
        }
    }
}
