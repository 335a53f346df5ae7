//! `fanout-backlog`: whether a fanout's cost per message grows with its
//! backlog.
//!
//! The same delivery run as `fanout` (one live consumer target acking on
//! return) on two objects: one with an empty table, one holding a backlog
//! of pending deliveries for a *paused* target (a target removed from the
//! configuration, its rows kept and not due). Every query a pass or an
//! enqueue runs is a range of an index, so the two rates should match:
//! `backlog_ratio` = deliveries/s with the backlog ÷ deliveries/s without.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durability_host::Host;

use super::fanout::{ENQUEUE_BATCH, MailConfig, MailObject, enqueue, produce_and_drain};
use super::{BenchEnv, BenchError, Figure, Latency, Measurement, ScenarioReport};

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "fanout-backlog";

/// Backlog messages per enqueue call while seeding.
const SEED_BATCH: u64 = 10_000;
/// The paused target's rows are first due at the next multiple of this
/// batch delay, centuries away, so they are never due during the run.
const FAR_FUTURE_BATCH_DELAY: Duration = Duration::from_millis(10_000_000_000_000);
/// Ids of the backlog start here, far from the measured messages'.
const BACKLOG_FIRST_ID: u64 = 1_000_000_000;

/// Runs the `fanout-backlog` scenario.
pub fn run(env: &BenchEnv) -> Result<ScenarioReport, BenchError> {
    let messages = env.size(100_000, 2_000);
    let backlog = env.size(1_000_000, 20_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| BenchError::Runtime { source })?;
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
        ],
    };
    let mut rates = Vec::new();
    for pending in [0, backlog] {
        let (delivered, enqueued) = runtime.block_on(measure(env, messages, pending))?;
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

/// Seeds `pending` paused deliveries, then measures a delivery run.
async fn measure(
    env: &BenchEnv,
    messages: u64,
    pending: u64,
) -> Result<(Measurement, Measurement), BenchError> {
    let dir = env.subdir(&format!("fanout-backlog-{pending}"))?;
    let host = Host::builder(&dir).threads(1).build()?;
    let delivered = Arc::new(AtomicU64::new(0));
    let config = Arc::new(Mutex::new(MailConfig {
        ack_on_return: true,
        targets: vec!["live", "paused"],
        batch_delay: FAR_FUTURE_BATCH_DELAY,
        delivered: Arc::clone(&delivered),
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
    let outcome = async {
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
        // Construct the object and count its backlog once, outside the
        // measured run (an instance counts it once, then keeps it).
        let counted = stub
            .call(|object: std::rc::Rc<MailObject>| async move {
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
        produce_and_drain(
            env,
            &format!("backlog {pending}"),
            &stub,
            &delivered,
            0,
            messages,
            messages,
            None,
        )
        .await
    }
    .await;
    host.shutdown().await;
    let drained = outcome?;
    let delivered = Measurement::new(
        format!("backlog-{pending}/deliveries"),
        "1 message acked by the live target",
        messages,
        drained.elapsed,
        &Latency::new()?,
    )
    .with("pending_paused", pending);
    let enqueued = Measurement::new(
        format!("backlog-{pending}/enqueue"),
        format!("1 enqueue call of {ENQUEUE_BATCH} messages"),
        drained.enqueue_latency.len(),
        drained.enqueue_elapsed,
        &drained.enqueue_latency,
    )
    .with("pending_paused", pending);
    Ok((delivered, enqueued))
}
