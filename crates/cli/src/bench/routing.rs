//! `routing`: the routing client on the real host, two threads.
//!
//! 1. **Pushes/s to 1, 16 and 256 objects.** Custom sharding spreads pushes
//!    round-robin over N objects; every reply's load is recorded. Two kinds
//!    of object: an in-memory one (counts the push in a `Load` and replies
//!    with its snapshot: the cost of the client plus one host call, compared
//!    with the same call made on a stub directly), and a fanout object (a
//!    one-message enqueue, one commit per push, synchronous FULL).
//! 2. **Spread of backlog under a skewed producer.** Producers push batches
//!    whose customer is drawn from a Zipf distribution and whose size is
//!    skewed (mostly single messages, now and then 200) to fanout objects
//!    that deliver nothing during the run, so each object's backlog is
//!    exactly what was routed to it. The default adaptive client is
//!    compared with the natural alternative, hashing the customer over the
//!    same number of objects.

use std::future::Future;
use std::hash::{Hash, Hasher};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use durability::fanout::{
    EnqueueOptions, EnqueueResult, Fanout, FanoutInput, FanoutMessage, Target,
};
use durability::load::{Direction, LoadSnapshot};
use durability::routing::{CallContext, RoutingClient, RoutingTarget, ShardCaller, shard_key};
use durability::{HandlerError, Load, Scheduler};
use durability_host::{
    AlarmInfo, BoxError, CallError, DurableObject, Host, HostError, Namespace, ObjectContext,
};
use rand::SeedableRng;
use rand::distr::Distribution;
use rand::distr::weighted::WeightedIndex;
use rand::rngs::SmallRng;

use super::host_calls::{count, drive};
use super::{BenchEnv, BenchError, Figure, ScenarioReport};

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "routing";

/// Pushes in flight at once.
const CALLERS: usize = 64;
/// Object counts of part 1.
const OBJECT_COUNTS: [usize; 3] = [1, 16, 256];
/// Customers of the skewed producer, and the Zipf exponent of their
/// popularity.
const CUSTOMERS: usize = 64;
const ZIPF_EXPONENT: f64 = 1.2;
/// Batch sizes of the skewed producer and how often each is drawn.
const BATCH_SIZES: [(u64, f64); 5] = [(1, 60.0), (2, 20.0), (10, 12.0), (50, 6.0), (200, 2.0)];
/// Producers of part 2.
const PRODUCERS: usize = 8;
/// First deliveries wait for the next multiple of this (centuries away), so
/// a backlog object delivers nothing and its backlog is what it was sent.
const FAR_FUTURE_BATCH_DELAY: Duration = Duration::from_millis(10_000_000_000_000);

/// Runs the `routing` scenario.
pub fn run(env: &BenchEnv) -> Result<ScenarioReport, BenchError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| BenchError::Runtime { source })?;
    let spread_seconds = env.size(15_u64, 3);
    let mut report = ScenarioReport {
        scenario: NAME,
        quick: env.quick(),
        headline: "memory-16/push".into(),
        measurements: Vec::new(),
        figures: Vec::new(),
        notes: vec![
            format!(
                "host: 2 executor threads; callers on a 2-worker tokio runtime; {CALLERS} pushes in flight"
            ),
            "memory-N: an in-memory object (Load + counter) per shard; stub-N: the same call on a stub made per call, without the client; rate_vs_stub in the JSON".into(),
            "fanout-N: a one-message fanout enqueue per push (one commit, synchronous FULL)".into(),
            format!(
                "spread: {PRODUCERS} producers for {spread_seconds} s; customers Zipf(s={ZIPF_EXPONENT}) over {CUSTOMERS}; batch sizes 1/2/10/50/200 drawn 60/20/12/6/2 %; nothing delivered during the run"
            ),
        ],
    };
    runtime.block_on(async {
        throughput(env, &mut report).await?;
        spread(env, spread_seconds, &mut report).await
    })?;
    Ok(report)
}

// ------------------------------------------------------------- objects

/// An object that only counts what it is pushed, in a `Load` like a real
/// capability, and replies with its snapshot.
struct MemoryObject {
    load: Load,
    accepted: std::cell::Cell<u64>,
}

impl DurableObject for MemoryObject {}

impl MemoryObject {
    fn push(&self, messages: u64) -> LoadSnapshot {
        let _inbound = self.load.begin(Direction::Inbound);
        self.accepted.set(self.accepted.get() + messages);
        self.load.snapshot(self.accepted.get())
    }
}

/// A fanout object whose one target never receives anything during a run.
struct BacklogObject {
    scheduler: Scheduler,
    fanout: Fanout<u64>,
}

impl DurableObject for BacklogObject {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

impl BacklogObject {
    fn build(ctx: ObjectContext, batch_delay: Duration) -> Result<Self, BoxError> {
        let ctx = ctx.into_dyn();
        let scheduler = Scheduler::new(Rc::clone(&ctx))?;
        let fanout = Fanout::<u64>::builder(&scheduler)
            .target(
                "sink",
                Target::consumer(|_: Vec<FanoutMessage<u64>>| async { Ok::<_, HandlerError>(()) })
                    .ack_on_return(true),
            )
            .batch_delay(batch_delay)
            .routing(Load::for_context(&ctx))
            .build()?;
        Ok(BacklogObject { scheduler, fanout })
    }

    async fn push(&self, messages: u64) -> Result<EnqueueResult<Vec<String>>, String> {
        let batch = (0..messages).map(FanoutInput::new).collect();
        self.fanout
            .enqueue(batch, &EnqueueOptions::all())
            .await
            .map_err(|e| e.to_string())
    }

    fn backlog(&self) -> Result<u64, String> {
        self.fanout
            .load()
            .map(|load| load.outbound.pending_deliveries)
            .map_err(|e| e.to_string())
    }
}

// -------------------------------------------------------------- callers

/// Why a benchmark push failed.
#[derive(Debug, thiserror::Error)]
enum PushError {
    #[error("the host refused the call")]
    Host(#[from] HostError),
    #[error("the call did not complete")]
    Call(#[from] CallError),
    #[error("the object failed: {0}")]
    Object(String),
}

/// A push: how many messages, and the index or customer that custom
/// sharding reads.
#[derive(Debug, Clone, Copy)]
struct Batch {
    key: u64,
    messages: u64,
}

struct MemoryCaller(Namespace<MemoryObject>);

impl ShardCaller for MemoryCaller {
    type Input = Batch;
    type Output = LoadSnapshot;
    type Error = PushError;

    fn call(
        &self,
        target: &RoutingTarget,
        batch: Batch,
        _: &CallContext,
    ) -> impl Future<Output = Result<LoadSnapshot, PushError>> + Send {
        let stub = self.0.stub(&target.shard);
        async move {
            Ok(stub?
                .call(move |object: Rc<MemoryObject>| async move { object.push(batch.messages) })
                .await?)
        }
    }
}

struct BacklogCaller(Namespace<BacklogObject>);

impl ShardCaller for BacklogCaller {
    type Input = Batch;
    type Output = EnqueueResult<Vec<String>>;
    type Error = PushError;

    fn call(
        &self,
        target: &RoutingTarget,
        batch: Batch,
        _: &CallContext,
    ) -> impl Future<Output = Result<Self::Output, PushError>> + Send {
        let stub = self.0.stub(&target.shard);
        async move {
            stub?
                .call(move |object: Rc<BacklogObject>| async move {
                    object.push(batch.messages).await
                })
                .await?
                .map_err(PushError::Object)
        }
    }
}

fn task_error(error: impl std::fmt::Display) -> BenchError {
    BenchError::Task {
        message: error.to_string(),
    }
}

fn object_name(i: u64, objects: usize) -> String {
    format!("object-{}", i % count(objects).max(1))
}

// ----------------------------------------------------------- throughput

async fn throughput(env: &BenchEnv, report: &mut ScenarioReport) -> Result<(), BenchError> {
    let memory_pushes = env.size(200_000_u64, 4_000);
    let fanout_pushes = env.size(6_000_u64, 300);
    for objects in OBJECT_COUNTS {
        let dir = env.subdir(&format!("routing-memory-{objects}"))?;
        let host = Host::builder(&dir).threads(2).build()?;
        let namespace = host.namespace("memory", |ctx| {
            Ok(MemoryObject {
                load: Load::for_context(&ctx.into_dyn()),
                accepted: std::cell::Cell::new(0),
            })
        })?;
        for i in 0..count(objects) {
            let name = object_name(i, objects);
            namespace
                .stub(&name)?
                .call(|_: Rc<MemoryObject>| async {})
                .await?;
        }
        let clock = host.clone();
        let client =
            RoutingClient::builder(MemoryCaller(namespace.clone()), move || clock.now_ms())
                .sharding(move |batch, _, _| Ok(object_name(batch.key, objects).into()))
                .build()
                .map_err(task_error)?;
        let pushed = drive(
            env,
            &format!("memory-{objects}/push"),
            "1 push = choose, one host call to an in-memory object, record its load",
            memory_pushes,
            CALLERS,
            move |i| {
                let client = client.clone();
                async move {
                    client
                        .push(
                            Batch {
                                key: i,
                                messages: 1,
                            },
                            CallContext::new(),
                        )
                        .await
                        .map(|_| ())
                        .map_err(task_error)
                }
            },
        )
        .await?
        .with("objects", count(objects));
        let direct_namespace = namespace.clone();
        let direct = drive(
            env,
            &format!("stub-{objects}/call"),
            "1 call = the same host call on a stub made per call (as the caller does), no client",
            memory_pushes,
            CALLERS,
            move |i| {
                let stub = direct_namespace.stub(&object_name(i, objects));
                async move {
                    stub?
                        .call(|object: Rc<MemoryObject>| async move { object.push(1) })
                        .await
                        .map(|_| ())
                        .map_err(BenchError::from)
                }
            },
        )
        .await?
        .with("objects", count(objects));
        let overhead = pushed.ops_per_sec() / direct.ops_per_sec().max(f64::MIN_POSITIVE);
        report
            .measurements
            .push(pushed.with("rate_vs_stub", round(overhead)));
        report.measurements.push(direct);
        host.shutdown().await;
    }
    for objects in OBJECT_COUNTS {
        let dir = env.subdir(&format!("routing-fanout-{objects}"))?;
        let host = Host::builder(&dir).threads(2).build()?;
        let namespace = host.namespace("fanout", |ctx| {
            BacklogObject::build(ctx, Duration::from_secs(3_600))
        })?;
        for i in 0..count(objects) {
            let name = object_name(i, objects);
            namespace
                .stub(&name)?
                .call(|_: Rc<BacklogObject>| async {})
                .await?;
        }
        let clock = host.clone();
        let client =
            RoutingClient::builder(BacklogCaller(namespace.clone()), move || clock.now_ms())
                .sharding(move |batch, _, _| Ok(object_name(batch.key, objects).into()))
                .build()
                .map_err(task_error)?;
        let pushed = drive(
            env,
            &format!("fanout-{objects}/push"),
            "1 push = choose, one host call enqueueing one message (one commit), record its load",
            fanout_pushes,
            CALLERS,
            move |i| {
                let client = client.clone();
                async move {
                    let reply = client
                        .push(
                            Batch {
                                key: i,
                                messages: 1,
                            },
                            CallContext::new(),
                        )
                        .await
                        .map_err(task_error)?;
                    if reply.is_accepted() {
                        Ok(())
                    } else {
                        Err(task_error("a benchmark enqueue was rejected"))
                    }
                }
            },
        )
        .await?
        .with("objects", count(objects));
        report.measurements.push(pushed);
        host.shutdown().await;
    }
    Ok(())
}

// --------------------------------------------------------------- spread

/// The skewed producer: customers by Zipf popularity, sizes by weight.
struct SkewedProducer {
    rng: SmallRng,
    customers: WeightedIndex<f64>,
    sizes: WeightedIndex<f64>,
}

impl SkewedProducer {
    fn new(seed: u64) -> Result<Self, BenchError> {
        let popularity = (1..=CUSTOMERS).map(|rank| 1.0 / (rank as f64).powf(ZIPF_EXPONENT));
        Ok(SkewedProducer {
            rng: SmallRng::seed_from_u64(seed),
            customers: WeightedIndex::new(popularity).map_err(task_error)?,
            sizes: WeightedIndex::new(BATCH_SIZES.iter().map(|(_, weight)| *weight))
                .map_err(task_error)?,
        })
    }

    fn next(&mut self) -> Batch {
        let customer = self.customers.sample(&mut self.rng);
        let size = BATCH_SIZES
            .get(self.sizes.sample(&mut self.rng))
            .map_or(1, |(size, _)| *size);
        Batch {
            key: count(customer),
            messages: size,
        }
    }
}

/// Per-object backlogs and what they say about the spread.
struct Spread {
    backlogs: Vec<u64>,
}

impl Spread {
    fn total(&self) -> u64 {
        self.backlogs.iter().sum()
    }

    fn mean(&self) -> f64 {
        self.total() as f64 / self.backlogs.len().max(1) as f64
    }

    fn max_over_mean(&self) -> f64 {
        let max = self.backlogs.iter().copied().max().unwrap_or(0) as f64;
        max / self.mean().max(f64::MIN_POSITIVE)
    }

    /// Standard deviation over mean.
    fn variation(&self) -> f64 {
        let mean = self.mean();
        let variance = self
            .backlogs
            .iter()
            .map(|b| (*b as f64 - mean).powi(2))
            .sum::<f64>()
            / self.backlogs.len().max(1) as f64;
        variance.sqrt() / mean.max(f64::MIN_POSITIVE)
    }

    fn describe(&self) -> String {
        let mut sorted = self.backlogs.clone();
        sorted.sort_unstable();
        let at = |q: usize| {
            sorted
                .get(q * (sorted.len().max(1) - 1) / 100)
                .copied()
                .unwrap_or(0)
        };
        format!(
            "{} objects, {} messages: min {} / median {} / max {} (max÷mean {:.2}, cv {:.2})",
            sorted.len(),
            self.total(),
            at(0),
            at(50),
            at(100),
            self.max_over_mean(),
            self.variation()
        )
    }
}

async fn spread(
    env: &BenchEnv,
    seconds: u64,
    report: &mut ScenarioReport,
) -> Result<(), BenchError> {
    // The adaptive client first: its final width is the object count the
    // hashed producer gets.
    let (adaptive, width, pushes) = produce(env, "adaptive", seconds, None).await?;
    let (hashed, _, _) = produce(env, "hashed", seconds, Some(width)).await?;
    report.figures.extend([
        Figure {
            key: "adaptive_width",
            label: format!("adaptive: width after {seconds} s of skewed production"),
            value: width as f64,
            unit: "objects",
        },
        Figure {
            key: "adaptive_backlog_max_over_mean",
            label: "adaptive: deepest object's backlog ÷ mean".into(),
            value: adaptive.max_over_mean(),
            unit: "×",
        },
        Figure {
            key: "adaptive_backlog_cv",
            label: "adaptive: backlog std dev ÷ mean".into(),
            value: adaptive.variation(),
            unit: "",
        },
        Figure {
            key: "hashed_backlog_max_over_mean",
            label: "customer hash, same objects: deepest backlog ÷ mean".into(),
            value: hashed.max_over_mean(),
            unit: "×",
        },
        Figure {
            key: "hashed_backlog_cv",
            label: "customer hash, same objects: backlog std dev ÷ mean".into(),
            value: hashed.variation(),
            unit: "",
        },
        Figure {
            key: "adaptive_pushes",
            label: "adaptive: pushes during the spread run".into(),
            value: pushes as f64,
            unit: "pushes",
        },
    ]);
    report
        .notes
        .push(format!("spread, adaptive: {}", adaptive.describe()));
    report
        .notes
        .push(format!("spread, customer hash: {}", hashed.describe()));
    Ok(())
}

/// Runs the skewed producers for `seconds` through the adaptive client
/// (`hash_over: None`) or through customer hashing over `hash_over`
/// objects, and reads every object's backlog.
async fn produce(
    env: &BenchEnv,
    label: &str,
    seconds: u64,
    hash_over: Option<u64>,
) -> Result<(Spread, u64, u64), BenchError> {
    let dir = env.subdir(&format!("routing-spread-{label}"))?;
    let host = Host::builder(&dir).threads(2).build()?;
    let namespace = host.namespace("backlog", |ctx| {
        BacklogObject::build(ctx, FAR_FUTURE_BATCH_DELAY)
    })?;
    let clock = host.clone();
    let builder = RoutingClient::builder(BacklogCaller(namespace.clone()), move || clock.now_ms());
    let client = match hash_over {
        None => builder.seed(2024).build(),
        Some(objects) => {
            builder
                .sharding(move |batch, _, _| {
                    // SipHash with fixed keys: the same placement every run.
                    let mut state = std::hash::DefaultHasher::new();
                    batch.key.hash(&mut state);
                    let hash = state.finish();
                    Ok(shard_key(hash % objects.max(1)).into())
                })
                .build()
        }
    }
    .map_err(task_error)?;
    let bar = env.progress(&format!("spread/{label}"), seconds);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let pushes = Arc::new(AtomicU64::new(0));
    let mut producers = tokio::task::JoinSet::new();
    for producer in 0..PRODUCERS {
        let client = client.clone();
        let pushes = Arc::clone(&pushes);
        let mut skewed = SkewedProducer::new(count(producer))?;
        producers.spawn(async move {
            while Instant::now() < deadline {
                let reply = client
                    .push(skewed.next(), CallContext::new())
                    .await
                    .map_err(task_error)?;
                if !reply.is_accepted() {
                    return Err(task_error("a benchmark enqueue was rejected"));
                }
                pushes.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, BenchError>(())
        });
    }
    let ticker = async {
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_secs(1)).await;
            bar.inc(1);
        }
    };
    let ((), joined) = tokio::join!(ticker, async {
        let mut outcome = Ok(());
        while let Some(result) = producers.join_next().await {
            if let Err(error) = result.map_err(task_error).and_then(|r| r) {
                outcome = Err(error);
            }
        }
        outcome
    });
    joined?;
    bar.finish_and_clear();
    let width = match hash_over {
        Some(objects) => objects,
        None => client.width(),
    };
    let mut backlogs = Vec::new();
    for n in 0..width {
        let backlog = namespace
            .stub(&shard_key(n))?
            .call(|object: Rc<BacklogObject>| async move { object.backlog() })
            .await?
            .map_err(task_error)?;
        backlogs.push(backlog);
    }
    host.shutdown().await;
    Ok((Spread { backlogs }, width, pushes.load(Ordering::Relaxed)))
}

fn round(value: f64) -> f64 {
    (value * 1_000.0).round() / 1_000.0
}
