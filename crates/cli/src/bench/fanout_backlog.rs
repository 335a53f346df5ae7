//! `fanout-backlog`: whether a fanout's cost per message grows with its
//! backlog.
//!
//! The same delivery run as `fanout` (one live consumer target acking on
//! return) on two objects: one with an empty table, one holding a backlog
//! of pending deliveries for a *paused* target (a target removed from the
//! configuration, its rows kept and not due). Every query a pass or an
//! enqueue runs is a range of an index, so the two rates should match:
//! `backlog_ratio` = deliveries/s with the backlog ÷ deliveries/s without.
//!
//! The backlog is seeded once; then the two objects take turns, a few
//! rounds each, and each keeps its best round. Taking turns and keeping the
//! best makes the ratio robust to a machine that is busy with something
//! else for part of the run (a slow round says nothing about the backlog).

use std::rc::Rc;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durability_host::{Host, Stub};

use super::fanout::{Drained, ENQUEUE_BATCH, MailConfig, MailObject, enqueue, produce_and_drain};
use super::{BenchEnv, BenchError, Figure, Latency, Measurement, ScenarioReport};

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "fanout-backlog";

/// Backlog messages per enqueue call while seeding (the fanout's default
/// `max_enqueue_messages`).
const SEED_BATCH: u64 = 1_000;
/// The paused target's rows are first due at the next multiple of this
/// batch delay, centuries away, so they are never due during the run.
const FAR_FUTURE_BATCH_DELAY: Duration = Duration::from_millis(10_000_000_000_000);
/// Ids of the backlog start here, far from the measured messages'.
const BACKLOG_FIRST_ID: u64 = 1_000_000_000;

/// One object of the comparison, with its host.
struct Side {
    host: Host,
    stub: Stub<MailObject>,
    delivered: Arc<AtomicU64>,
    pending: u64,
    best: Option<Drained>,
}

/// Runs the `fanout-backlog` scenario.
pub fn run(env: &BenchEnv) -> Result<ScenarioReport, BenchError> {
    let messages = env.size(100_000, 2_000);
    let backlog = env.size(1_000_000, 20_000);
    let rounds = env.size(3, 1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| BenchError::Runtime { source })?;
    let sides = runtime.block_on(compare(env, messages, backlog, rounds))?;
    let mut report = ScenarioReport {
        scenario: NAME,
        quick: env.quick(),
        headline: format!("backlog-{backlog}/deliveries"),
        measurements: Vec::new(),
        figures: Vec::new(),
        notes: vec![
            format!(
                "{messages} messages to one live target (ack on return), enqueue calls of {ENQUEUE_BATCH}; host synchronous FULL"
            ),
            format!(
                "the backlog: {backlog} pending deliveries of a paused target (removed from the configuration, not due)"
            ),
            format!("best of {rounds} rounds each, the two objects taking turns"),
        ],
    };
    let mut rates = Vec::new();
    for side in sides {
        let Some(best) = side.best else { continue };
        let pending = side.pending;
        let delivered = Measurement::new(
            format!("backlog-{pending}/deliveries"),
            "1 message acked by the live target",
            messages,
            best.elapsed,
            &Latency::new()?,
        )
        .with("pending_paused", pending);
        let enqueued = Measurement::new(
            format!("backlog-{pending}/enqueue"),
            format!("1 enqueue call of {ENQUEUE_BATCH} messages"),
            best.enqueue_latency.len(),
            best.enqueue_elapsed,
            &best.enqueue_latency,
        )
        .with("pending_paused", pending);
        rates.push(delivered.ops_per_sec());
        report.measurements.push(delivered);
        report.measurements.push(enqueued);
    }
    if let [empty, full] = rates[..]
        && empty > 0.0
    {
        report.figures.push(Figure {
            key: "backlog_ratio",
            label: format!("deliveries/s with {backlog} pending ÷ with none"),
            value: full / empty,
            unit: "ratio",
        });
    }
    Ok(report)
}

/// Seeds both objects, then lets them take turns.
async fn compare(
    env: &BenchEnv,
    messages: u64,
    backlog: u64,
    rounds: u64,
) -> Result<Vec<Side>, BenchError> {
    let mut sides = Vec::new();
    for pending in [0, backlog] {
        sides.push(open_seeded(env, pending).await?);
    }
    let mut outcome = Ok(());
    'rounds: for round in 0..rounds {
        for side in &mut sides {
            let run = produce_and_drain(
                env,
                &format!("backlog {} round {}", side.pending, round + 1),
                &side.stub,
                &side.delivered,
                round * messages,
                messages,
                messages,
                None,
            )
            .await;
            match run {
                Ok(drained) => {
                    let better = side
                        .best
                        .as_ref()
                        .is_none_or(|best| drained.elapsed < best.elapsed);
                    if better {
                        side.best = Some(drained);
                    }
                }
                Err(error) => {
                    outcome = Err(error);
                    break 'rounds;
                }
            }
        }
    }
    for side in &sides {
        side.host.shutdown().await;
    }
    outcome.map(|()| sides)
}

/// An object whose table holds `pending` deliveries of the paused target,
/// constructed and counted (an instance counts its backlog once, then
/// keeps the count) before any measured run.
async fn open_seeded(env: &BenchEnv, pending: u64) -> Result<Side, BenchError> {
    let dir = env.subdir(&format!("fanout-backlog-{pending}"))?;
    let host = Host::builder(&dir).threads(1).build()?;
    let delivered = Arc::new(AtomicU64::new(0));
    let config = Arc::new(Mutex::new(MailConfig {
        ack_on_return: true,
        targets: vec!["live", "paused"],
        batch_delay: FAR_FUTURE_BATCH_DELAY,
        delivered: Arc::clone(&delivered),
        fail_one_in: None,
        limited: None,
    }));
    let current = Arc::clone(&config);
    let objects = host.namespace("mail", move |ctx| {
        let config = current
            .lock()
            .map_err(|_| "the benchmark's configuration lock is poisoned")?
            .clone();
        MailObject::build(ctx, &config)
    })?;
    let stub = objects.stub("mailbox")?;
    let seeded = async {
        let seeding = env.progress("seeding the backlog", pending);
        let mut next = 0;
        while next < pending {
            let n = SEED_BATCH.min(pending - next);
            enqueue(
                &stub,
                BACKLOG_FIRST_ID + next,
                n,
                Some(vec!["paused".into()]),
            )
            .await?;
            next += n;
            seeding.set_position(next);
        }
        seeding.finish_and_clear();
        // The next construction drops "paused" from the configuration and
        // delivers at once.
        host.evict(stub.id()).await?;
        {
            let mut config = config.lock().map_err(|_| BenchError::Task {
                message: "the benchmark's configuration lock is poisoned".into(),
            })?;
            config.targets = vec!["live"];
            config.batch_delay = Duration::ZERO;
        }
        let counted = stub
            .call(|object: Rc<MailObject>| async move {
                object
                    .fanout
                    .load()
                    .map(|load| load.outbound.pending_deliveries)
                    .map_err(|e| e.to_string())
            })
            .await?
            .map_err(|message| BenchError::Task { message })?;
        if counted != pending {
            return Err(BenchError::Task {
                message: format!("seeded {pending} paused deliveries, found {counted}"),
            });
        }
        Ok(())
    }
    .await;
    if let Err(error) = seeded {
        host.shutdown().await;
        return Err(error);
    }
    Ok(Side {
        host,
        stub,
        delivered,
        pending,
        best: None,
    })
}
