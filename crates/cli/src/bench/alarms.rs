//! `alarms`: named alarms firing on the real host.
//!
//! Objects each hold a set of named alarms. Two measurements, each run with
//! live timers off (the default: the in-memory timer covers only the
//! physical alarm's minimum delay) and on:
//! - *spread*: alarms due evenly over a window; lateness = time the handler
//!   ran − scheduled time;
//! - *storm*: every alarm due at the same instant; fired per second from the
//!   due time to the last handler.
//!
//! A named alarm's fire is a claim and a delete, each a commit, so the rate is
//! compared with the raw SQLite claim + complete floor of the same run.

use std::rc::Rc;
use std::time::{Duration, Instant};

use durability::{AlarmCall, Alarms, HandlerError, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, ObjectContext, Stub};
use durability_platform::EpochMs;
use tokio::sync::mpsc;

use super::host_calls::count;
use super::sqlite_floor::{self, FloorSizes, SyncMode};
use super::{BenchEnv, BenchError, Latency, Measurement, ScenarioReport};

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "alarms";

/// Time between scheduling and the first due alarm, so every schedule call
/// has committed before anything is due.
const LEAD_MS: EpochMs = 1_000;

/// How long the run waits past the last due time before it gives up.
const FIRE_WAIT: Duration = Duration::from_secs(120);

/// An object whose named alarms `slot-0`, `slot-1`, ... report their
/// lateness in milliseconds when they fire.
struct AlarmObject {
    scheduler: Scheduler,
    alarms: Alarms,
}

impl AlarmObject {
    fn construct(
        ctx: ObjectContext,
        slots: usize,
        live_timers: bool,
        fired: mpsc::UnboundedSender<EpochMs>,
    ) -> Result<Self, BoxError> {
        let scheduler = Scheduler::builder(ctx.into_dyn())
            .live_timers(live_timers)
            .build()?;
        let mut builder = Alarms::builder(&scheduler);
        for slot in 0..slots {
            let fired = fired.clone();
            let clock = scheduler.clone();
            builder = builder.handler(&slot_name(slot), move |call: AlarmCall| {
                let _ = fired.send(clock.now_ms() - call.scheduled_time);
                async { Ok::<_, HandlerError>(()) }
            });
        }
        let alarms = builder.build()?;
        Ok(AlarmObject { scheduler, alarms })
    }
}

impl DurableObject for AlarmObject {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

fn slot_name(slot: usize) -> String {
    format!("slot-{slot}")
}

struct Sizes {
    objects: usize,
    slots: usize,
    window_ms: EpochMs,
}

/// Runs the `alarms` scenario.
pub fn run(env: &BenchEnv) -> Result<ScenarioReport, BenchError> {
    let threads = std::thread::available_parallelism().map_or(2, usize::from);
    let sizes = Sizes {
        objects: env.size(10, 4),
        slots: env.size(200, 25),
        window_ms: env.size(10_000, 1_000),
    };
    let floor_ops = env.size(5_000, 200);
    let floor = sqlite_floor::measure(
        env,
        SyncMode::Full,
        FloorSizes {
            single_ops: floor_ops,
            batched_messages: env.size(1_000, 200),
        },
    )?;
    let floor = Measurement {
        name: "full/claim+complete".into(),
        what: "raw SQLite: the two commits of one fire".into(),
        ops: floor_ops,
        elapsed: floor.claim.elapsed + floor.complete.elapsed,
        latency: None,
        floor_ratio: None,
        extra: serde_json::Map::new(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|source| BenchError::Runtime { source })?;
    let total = sizes.objects * sizes.slots;
    let mut report = ScenarioReport {
        scenario: NAME,
        quick: env.quick(),
        headline: "storm/live-timers-off".into(),
        measurements: vec![floor.clone()],
        figures: Vec::new(),
        notes: vec![
            format!(
                "host: {threads} executor threads; {} objects x {} named alarms = {total} alarms",
                sizes.objects, sizes.slots
            ),
            format!(
                "spread: due evenly over {} ms; lateness = handler start - scheduled time (ms resolution)",
                sizes.window_ms
            ),
        ],
    };
    runtime.block_on(async {
        for live_timers in [false, true] {
            let mode = if live_timers {
                "live-timers-on"
            } else {
                "live-timers-off"
            };
            let dir = env.subdir(&format!("alarms-{mode}"))?;
            let host = Host::builder(&dir).threads(threads).build()?;
            let (fired_tx, fired_rx) = mpsc::unbounded_channel();
            let slots = sizes.slots;
            let ns = host.namespace::<AlarmObject>("alarms", move |ctx| {
                AlarmObject::construct(ctx, slots, live_timers, fired_tx.clone())
            })?;
            let stubs: Vec<Stub<AlarmObject>> = (0..sizes.objects)
                .map(|i| ns.stub(&format!("alarms-{i}")))
                .collect::<Result<_, _>>()?;
            let measured = measure(env, mode, &host, &stubs, &sizes, fired_rx, &floor).await;
            host.shutdown().await;
            report.measurements.extend(measured?);
        }
        Ok::<_, BenchError>(())
    })?;
    Ok(report)
}

async fn measure(
    env: &BenchEnv,
    mode: &str,
    host: &Host,
    stubs: &[Stub<AlarmObject>],
    sizes: &Sizes,
    mut fired: mpsc::UnboundedReceiver<EpochMs>,
    floor: &Measurement,
) -> Result<Vec<Measurement>, BenchError> {
    let total = stubs.len() * sizes.slots;
    let mut measured = Vec::new();
    for storm in [false, true] {
        let first_due = host.now_ms() + LEAD_MS;
        let step = if storm {
            0
        } else {
            sizes.window_ms / EpochMs::try_from(total.max(1)).unwrap_or(1)
        };
        let mut n: EpochMs = 0;
        for stub in stubs {
            let times: Vec<EpochMs> = (0..sizes.slots)
                .map(|_| {
                    n += 1;
                    first_due + step * n
                })
                .collect();
            stub.call(move |object: Rc<AlarmObject>| async move {
                for (slot, at) in times.into_iter().enumerate() {
                    object.alarms.schedule(&slot_name(slot), at).await?;
                }
                Ok::<_, durability::DurabilityError>(())
            })
            .await?
            .map_err(|error| BenchError::Task {
                message: error.to_string(),
            })?;
        }
        let name = format!("{}/{mode}", if storm { "storm" } else { "spread" });
        let bar = env.progress(&name, count(total));
        let mut lateness = Latency::new()?;
        let wait = Duration::from_millis(u64::try_from(LEAD_MS + sizes.window_ms).unwrap_or(0))
            + FIRE_WAIT;
        let deadline = Instant::now() + wait;
        let mut received = 0;
        while received < total {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, fired.recv()).await {
                Ok(Some(late_ms)) => {
                    lateness.record(Duration::from_millis(u64::try_from(late_ms).unwrap_or(0)));
                    received += 1;
                    bar.inc(1);
                }
                _ => {
                    return Err(BenchError::AlarmsMissing {
                        fired: received,
                        armed: total,
                    });
                }
            }
        }
        bar.finish_and_clear();
        // Rate from the first due time to the last fire.
        let elapsed_ms = host.now_ms() - first_due;
        let elapsed = Duration::from_millis(u64::try_from(elapsed_ms.max(1)).unwrap_or(1));
        let mut measurement = Measurement::new(
            name,
            if storm {
                "one named alarm fired (all due at once); latency = lateness"
            } else {
                "one named alarm fired (due evenly spread); latency = lateness"
            },
            count(total),
            elapsed,
            &lateness,
        )
        .with("live_timers", mode == "live-timers-on");
        // A spread run's rate is the schedule's, not the host's capacity.
        if storm {
            measurement.compare_with_floor(floor);
        }
        measured.push(measurement);
    }
    Ok(measured)
}
