//! `operations`: durable operations end to end on the real host.
//!
//! No-op operations are registered by 64 concurrent callers, run eagerly (or
//! from the timer when every permit is busy) and completed; a lifecycle hook
//! reports each completion after its commit. Measured on one object and
//! across many: registration latency (one call that commits the row and the
//! alarm) and end-to-end throughput (registration to committed completion),
//! divided by the raw SQLite floor of the same three commits (enqueue,
//! claim, complete) measured in the same run.

use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use durability::lifecycle::{LifecycleEvent, LifecycleHook, Outcome};
use durability::{DurableCall, HandlerError, Operations, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, ObjectContext, Stub};
use tokio::sync::mpsc;

use super::host_calls::{count, drive};
use super::sqlite_floor::{self, FloorSizes, SyncMode};
use super::{BenchEnv, BenchError, Measurement, ScenarioReport};

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "operations";

/// Registrations in flight at once.
const CALLERS: usize = 64;

/// How long the run waits for the last completion before it gives up.
const COMPLETION_WAIT: Duration = Duration::from_secs(300);

/// An object with a scheduler and one no-op operation.
struct OpsObject {
    scheduler: Scheduler,
    operations: Operations,
}

impl OpsObject {
    fn construct(ctx: ObjectContext, done: mpsc::UnboundedSender<()>) -> Result<Self, BoxError> {
        let scheduler = Scheduler::new(ctx.into_dyn())?;
        let hook: LifecycleHook = Rc::new(move |event: &LifecycleEvent| {
            if let LifecycleEvent::AttemptSettled {
                outcome: Outcome::Completed { .. },
                ..
            } = event
            {
                let _ = done.send(());
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
    let total = env.size(20_000_u64, 500);
    let objects = env.size(100_usize, 10);
    let floor = operation_floor(env)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|source| BenchError::Runtime { source })?;
    let mut report = ScenarioReport {
        scenario: NAME,
        quick: env.quick(),
        headline: "one-object/end-to-end".into(),
        measurements: vec![floor.clone()],
        figures: Vec::new(),
        notes: vec![
            format!("host: {threads} executor threads, synchronous FULL, default scheduler options"),
            format!("{CALLERS} callers register no-op operations; end-to-end = until the last completion committed"),
            "÷ floor: ops/s divided by raw SQLite doing enqueue + claim + complete, one transaction each".into(),
        ],
    };
    runtime.block_on(async {
        for (label, objects) in [("one-object", 1), (&*format!("{objects}-objects"), objects)] {
            let dir = env.subdir(&format!("operations-{label}"))?;
            let host = Host::builder(&dir).threads(threads).build()?;
            let (done_tx, done_rx) = mpsc::unbounded_channel();
            let ns = host.namespace::<OpsObject>("ops", move |ctx| {
                OpsObject::construct(ctx, done_tx.clone())
            })?;
            let stubs: Vec<Stub<OpsObject>> = (0..objects)
                .map(|i| ns.stub(&format!("ops-{i}")))
                .collect::<Result<_, _>>()?;
            let measured = measure(env, label, stubs, total, done_rx, &floor).await;
            host.shutdown().await;
            report.measurements.extend(measured?);
        }
        Ok::<_, BenchError>(())
    })?;
    Ok(report)
}

/// Registers `total` operations over `stubs` and waits for every completion.
async fn measure(
    env: &BenchEnv,
    label: &str,
    stubs: Vec<Stub<OpsObject>>,
    total: u64,
    mut done: mpsc::UnboundedReceiver<()>,
    floor: &Measurement,
) -> Result<Vec<Measurement>, BenchError> {
    // Construct every object first, so the figures are steady state.
    for stub in &stubs {
        stub.call(|_: Rc<OpsObject>| async {}).await?;
    }
    let stubs = Arc::new(stubs);
    // One caller first: the latency of a registration itself, not of the
    // queue 64 callers build in front of one object's commits.
    let sequential = (total / 10).clamp(1, 1_000);
    let calls = Arc::clone(&stubs);
    let register_one = drive(
        env,
        &format!("{label}/register-1-caller"),
        "1 call = register one operation, one caller",
        sequential,
        1,
        move |i| register(Arc::clone(&calls), format!("seq-{i}"), i),
    )
    .await?;
    wait_for_completions(env, &format!("{label}/drain"), sequential, &mut done).await?;
    let started = Instant::now();
    let calls = Arc::clone(&stubs);
    let concurrent = drive(
        env,
        &format!("{label}/register"),
        "1 call = register one operation (row + alarm committed)",
        total,
        CALLERS,
        move |i| register(Arc::clone(&calls), format!("op-{i}"), i),
    )
    .await?;
    wait_for_completions(env, &format!("{label}/complete"), total, &mut done).await?;
    let mut end_to_end = Measurement {
        name: format!("{label}/end-to-end"),
        what: format!(
            "register, run and complete one no-op operation ({} objects)",
            stubs.len()
        ),
        ops: total,
        elapsed: started.elapsed(),
        latency: None,
        floor_ratio: None,
        extra: serde_json::Map::new(),
    }
    .with("objects", count(stubs.len()));
    end_to_end.compare_with_floor(floor);
    Ok(vec![register_one, concurrent, end_to_end])
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

/// Waits for `n` committed completions.
async fn wait_for_completions(
    env: &BenchEnv,
    phase: &str,
    n: u64,
    done: &mut mpsc::UnboundedReceiver<()>,
) -> Result<(), BenchError> {
    let bar = env.progress(phase, n);
    for completed in 0..n {
        match tokio::time::timeout(COMPLETION_WAIT, done.recv()).await {
            Ok(Some(())) => bar.inc(1),
            _ => {
                return Err(BenchError::Task {
                    message: format!("only {completed} of {n} operations completed"),
                });
            }
        }
    }
    bar.finish_and_clear();
    Ok(())
}

/// The floor of one operation: its three commits done by raw SQLite, one
/// transaction each, as one combined rate.
fn operation_floor(env: &BenchEnv) -> Result<Measurement, BenchError> {
    let ops = env.size(5_000, 200);
    let floor = sqlite_floor::measure(
        env,
        SyncMode::Full,
        FloorSizes {
            single_ops: ops,
            batched_messages: env.size(1_000, 200),
        },
    )?;
    Ok(Measurement {
        name: "full/enqueue+claim+complete".into(),
        what: "raw SQLite: the three commits of one operation".into(),
        ops,
        elapsed: floor.enqueue.elapsed + floor.claim.elapsed + floor.complete.elapsed,
        latency: None,
        floor_ratio: None,
        extra: serde_json::Map::new(),
    })
}
