//! `operations`: durable operations end to end on the real host.
//!
//! No-op operations are registered by 1 and by 64 concurrent callers, run
//! eagerly (or from the timer when every permit is busy) and completed; a
//! lifecycle hook reports each completion after its commit. Measured in
//! each durability mode (the default with output gates and its journal,
//! the same with per-WAL syncs, FULL, NORMAL), on
//! one object and across 100: end-to-end throughput (first registration to
//! last committed completion) with the registration latency of its callers
//! (one call that commits the row and the alarm and, in the default mode,
//! waits for its gate), divided by the FULL 1-row commit floor measured in
//! the same run. The JSON's top-level `ops_per_sec` and `floor_ratio` are
//! those of the default mode with 64 callers across 100 objects.
//!
//! Each end-to-end figure also carries the CPU time the whole process
//! spent per operation (`cpu_us_per_op`, split into user and system): on
//! a machine whose cores the run saturates, throughput is that figure's
//! inverse, and it shows what each mode's syncing costs.

use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use durability::lifecycle::{LifecycleEvent, LifecycleHook, Outcome};
use durability::{DurableCall, HandlerError, Operations, Scheduler};
use durability_host::archive::ArchiveConfig;
use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext, Stub};
use tokio::sync::Notify;

use super::host_calls::{count, drive};
use super::rss;
use super::sqlite_floor::{self, SyncMode};
use super::{BenchEnv, BenchError, Figure, Measurement, ScenarioReport};
use crate::modes::MODES;

/// The key of the default mode with a continuous archive.
const ARCHIVED: &str = "default-archived";

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "operations";

/// Paired rounds of the archive's cost (default against default-archived).
const ARCHIVE_COST_ROUNDS: usize = 5;

/// Registrations in flight at once.
const CALLERS: usize = 64;

/// How long the run waits for the next completion before it gives up.
const COMPLETION_WAIT: Duration = Duration::from_secs(300);

/// How often the progress bar shows the completions so far.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// Completions committed so far, counted by the objects' lifecycle hooks.
/// The waiter is woken once, when the count reaches its target: a
/// message per completion would wake the bench's own thread once per
/// operation and charge that to the host.
#[derive(Default)]
struct Completions {
    count: AtomicU64,
    target: AtomicU64,
    reached: Notify,
}

impl Completions {
    fn completed(&self) {
        let count = self.count.fetch_add(1, Ordering::AcqRel) + 1;
        if count == self.target.load(Ordering::Acquire) {
            self.reached.notify_one();
        }
    }

    /// Expects `n` more completions; returns the count that ends them.
    fn expect(&self, n: u64) -> (u64, u64) {
        let start = self.count.load(Ordering::Acquire);
        self.target.store(start + n, Ordering::Release);
        (start, start + n)
    }
}

/// An object with a scheduler and one no-op operation.
struct OpsObject {
    scheduler: Scheduler,
    operations: Operations,
}

impl OpsObject {
    fn construct(ctx: ObjectContext, done: Arc<Completions>) -> Result<Self, BoxError> {
        let scheduler = Scheduler::new(ctx.into_dyn())?;
        let hook: LifecycleHook = Rc::new(move |event: &LifecycleEvent| {
            if let LifecycleEvent::AttemptSettled {
                outcome: Outcome::Completed { .. },
                ..
            } = event
            {
                done.completed();
            }
            None
        });
        let operations = Operations::builder(&scheduler)
            .handler("noop", |_: DurableCall<()>| async {
                Ok::<_, HandlerError>(())
            })
            .on_lifecycle_event(hook)
            .build()?;
        Ok(OpsObject {
            scheduler,
            operations,
        })
    }
}

impl DurableObject for OpsObject {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

/// Runs the `operations` scenario.
pub fn run(env: &BenchEnv) -> Result<ScenarioReport, BenchError> {
    let threads = std::thread::available_parallelism().map_or(2, usize::from);
    let many = env.size(100_usize, 10);
    let floor = sqlite_floor::measure_write(env, SyncMode::Full, env.size(5_000, 200))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|source| BenchError::Runtime { source })?;
    let mut report = ScenarioReport {
        scenario: NAME,
        quick: env.quick(),
        headline: format!("default/{many}-objects/{CALLERS}-callers"),
        measurements: vec![floor.clone()],
        figures: Vec::new(),
        notes: vec![
            format!("host: {threads} executor threads, default scheduler options; modes: default (group commit with output gates, one fdatasync of the host journal per flush), default-walfiles (the same, an fdatasync of each dirty WAL per flush), full, normal, and {ARCHIVED} (the default with HostBuilder::archive to a file:// directory on the same disk: a base, then every synced pass shipped each second)"),
            format!("1 or {CALLERS} callers register no-op operations; ops/s = end to end, from the first registration until the last completion committed; p50/p99 = one registration call as its caller waits for it (the reply is released once durable in the default mode)"),
            "÷ floor: end-to-end ops/s divided by full/write, raw SQLite committing one row per transaction with synchronous=FULL, measured in the same run".into(),
            "cpu_us_per_op (JSON): CPU time of the whole process (every thread: host, flusher, callers) from the first registration to the last completion, per operation".into(),
            format!("archive_cost_percent (JSON): how many fewer ops/s {ARCHIVED} makes than default at the headline's placement, the median of {ARCHIVE_COST_ROUNDS} paired rounds (archive-cost-N/... rows, 60,000 operations each) run back to back in alternating order (min and max beside it); the other {ARCHIVED} rows ran once, after the other modes"),
        ],
    };
    let phases = [(1, env.size(2_000, 100)), (CALLERS, env.size(20_000, 500))];
    runtime.block_on(async {
        // The default mode once more with a continuous archive to a local
        // directory (a base, then every synced journal pass).
        let variants = MODES
            .iter()
            .map(|mode| (*mode, mode.key, false))
            .chain([(MODES[0], ARCHIVED, true)]);
        for (mode, key, archived) in variants {
            for (placement, objects) in [
                ("one-object".to_owned(), 1),
                (format!("{many}-objects"), many),
            ] {
                let label = format!("{key}/{placement}");
                let measured = run_on_host(
                    env,
                    Placement {
                        mode,
                        label: &label,
                        archived,
                        objects,
                        threads,
                    },
                    &phases,
                    &floor,
                )
                .await?;
                report.measurements.extend(measured);
            }
        }
        // The archive's cost, paired: the headline's placement without and
        // with the archive, back to back in alternating order (A B, B A,
        // ...), so a shared machine's drift falls on both; the figure is
        // the median of the rounds' ratios.
        let rounds = if env.quick() { 1 } else { ARCHIVE_COST_ROUNDS };
        // Longer than the headline's run, so the base an archived host
        // copies at its start weighs like a daily base, not a tenth of it.
        let paired = (CALLERS, env.size(60_000, 500));
        let mut costs = Vec::new();
        for round in 0..rounds {
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            let mut rates = [0.0f64; 2];
            for archived in order {
                let key = if archived { ARCHIVED } else { MODES[0].key };
                let label = format!("archive-cost-{round}/{key}/{many}-objects");
                let measured = run_on_host(
                    env,
                    Placement {
                        mode: MODES[0],
                        label: &label,
                        archived,
                        objects: many,
                        threads,
                    },
                    &[paired],
                    &floor,
                )
                .await?;
                rates[usize::from(archived)] =
                    measured.iter().map(Measurement::ops_per_sec).sum::<f64>();
                report.measurements.extend(measured);
            }
            if rates[0] > 0.0 {
                costs.push(100.0 * (1.0 - rates[1] / rates[0]));
            }
        }
        costs.sort_by(f64::total_cmp);
        if let (Some(low), Some(high)) = (costs.first(), costs.last()) {
            let median = costs[costs.len() / 2];
            for (key, label, value) in [
                (
                    "archive_cost_percent",
                    "archive cost: fewer ops/s than default (median of paired rounds)",
                    median,
                ),
                (
                    "archive_cost_min_percent",
                    "archive cost, lowest round",
                    *low,
                ),
                (
                    "archive_cost_max_percent",
                    "archive cost, highest round",
                    *high,
                ),
            ] {
                report.figures.push(Figure {
                    key,
                    label: format!("{label}, {many} objects, {CALLERS} callers"),
                    value: tenths(value),
                    unit: "%",
                });
            }
        }
        Ok::<_, BenchError>(())
    })?;
    Ok(report)
}

/// Where one measurement runs: a host of `mode` (with an archive when
/// `archived`) over `objects` objects.
struct Placement<'a> {
    mode: crate::modes::Mode,
    label: &'a str,
    archived: bool,
    objects: usize,
    threads: usize,
}

/// Builds the host of `at` in a fresh directory, measures `phases` on it
/// and shuts it down.
async fn run_on_host(
    env: &BenchEnv,
    at: Placement<'_>,
    phases: &[(usize, u64)],
    floor: &Measurement,
) -> Result<Vec<Measurement>, BenchError> {
    let dir_name = at.label.replace('/', "-");
    let dir = env.subdir(&format!("operations-{dir_name}"))?;
    let mut builder = at.mode.builder(&dir).threads(at.threads);
    if at.archived {
        let archive = env.subdir(&format!("operations-{dir_name}-archive"))?;
        let config =
            ArchiveConfig::new(&format!("file://{}", archive.display())).map_err(|error| {
                BenchError::Archive {
                    message: error.to_string(),
                }
            })?;
        builder = builder.archive(config);
    }
    let host = builder.build()?;
    let done = Arc::new(Completions::default());
    let hooks = Arc::clone(&done);
    let ns = host.namespace::<OpsObject>("ops", move |ctx| {
        OpsObject::construct(ctx, Arc::clone(&hooks))
    })?;
    let stubs: Vec<Stub<OpsObject>> = (0..at.objects)
        .map(|i| ns.stub(&format!("ops-{i}")))
        .collect::<Result<_, _>>()?;
    let measured = measure(env, at.label, stubs, &done, phases, floor).await;
    host.shutdown().await;
    measured
}

/// Registers operations over `stubs` with each `(callers, total)` of
/// `phases` in turn, each time waiting for every completion.
async fn measure(
    env: &BenchEnv,
    label: &str,
    stubs: Vec<Stub<OpsObject>>,
    done: &Completions,
    phases: &[(usize, u64)],
    floor: &Measurement,
) -> Result<Vec<Measurement>, BenchError> {
    // Construct every object first, so the figures are steady state.
    for stub in &stubs {
        stub.call(|_: Rc<OpsObject>| async {}).await?;
    }
    let objects = stubs.len();
    let stubs = Arc::new(stubs);
    let mut measured = Vec::new();
    for &(callers, total) in phases {
        let name = format!("{label}/{callers}-callers");
        let expected = done.expect(total);
        let cpu_before = rss::cpu_time();
        let started = Instant::now();
        let calls = Arc::clone(&stubs);
        let prefix = format!("{callers}-");
        let registered = drive(
            env,
            &format!("{name}/register"),
            "1 call = register one operation",
            total,
            callers,
            move |i| register(Arc::clone(&calls), format!("{prefix}{i}"), i),
        )
        .await?;
        wait_for_completions(env, &format!("{name}/complete"), expected, done).await?;
        let cpu = cpu_before.zip(rss::cpu_time());
        let mut end_to_end = Measurement {
            name,
            what: format!(
                "register, run and complete one no-op operation ({objects} objects, {callers} callers)"
            ),
            ops: total,
            elapsed: started.elapsed(),
            latency: registered.latency,
            floor_ratio: None,
            extra: serde_json::Map::new(),
        }
        .with("objects", count(objects))
        .with("callers", count(callers))
        .with(
            "register_ops_per_sec",
            tenths(registered.ops_per_sec()),
        );
        if let Some(((user_before, sys_before), (user, sys))) = cpu {
            let per_op = |spent: Duration| tenths(spent.as_secs_f64() * 1e6 / total.max(1) as f64);
            let user = user.saturating_sub(user_before);
            let sys = sys.saturating_sub(sys_before);
            end_to_end = end_to_end
                .with("cpu_us_per_op", per_op(user + sys))
                .with("cpu_user_us_per_op", per_op(user))
                .with("cpu_sys_us_per_op", per_op(sys));
        }
        end_to_end.compare_with_floor(floor);
        measured.push(end_to_end);
    }
    Ok(measured)
}

/// `x` rounded to one decimal, for the JSON.
fn tenths(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Registers operation `id` on the stub that `i` picks.
async fn register(stubs: Arc<Vec<Stub<OpsObject>>>, id: String, i: u64) -> Result<(), BenchError> {
    let stub = &stubs[usize::try_from(i).unwrap_or(0) % stubs.len().max(1)];
    stub.call(move |object: Rc<OpsObject>| async move {
        object
            .operations
            .start("noop", &id, &())
            .await
            .map(|_| ())
            .map_err(|error| error.to_string())
    })
    .await?
    .map_err(|message| BenchError::Task { message })
}

/// Waits until the completions reach `end` (from `start`).
async fn wait_for_completions(
    env: &BenchEnv,
    phase: &str,
    (start, end): (u64, u64),
    done: &Completions,
) -> Result<(), BenchError> {
    let bar = env.progress(phase, end - start);
    let mut seen = done.count.load(Ordering::Acquire);
    let mut last_progress = Instant::now();
    while seen < end {
        // Woken at the target, or looking every PROGRESS_EVERY.
        let _ = tokio::time::timeout(PROGRESS_EVERY, done.reached.notified()).await;
        let now = done.count.load(Ordering::Acquire);
        if now > seen {
            bar.inc(now - seen);
            seen = now;
            last_progress = Instant::now();
        } else if last_progress.elapsed() > COMPLETION_WAIT {
            return Err(BenchError::Task {
                message: format!(
                    "only {} of {} operations completed",
                    seen - start,
                    end - start
                ),
            });
        }
    }
    bar.finish_and_clear();
    Ok(())
}
