//! Fixtures of the routing tests: a clock on paused tokio time, snapshots,
//! a scripted shard caller (the test says what each call replies), a
//! simulated set of shards with a backlog that drains at a per-shard rate,
//! and real mailbox objects (fanout on SQLite) on an inline host with the
//! caller an application would write over their namespace.

#![allow(dead_code)] // each routing test binary uses a different part

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durability::fanout::{
    EnqueueOptions, EnqueueResult, FanoutError, FanoutInput, FanoutMessage, Target,
};
use durability::load::{LOAD_WINDOW_MS, LoadSnapshot, OutboundProcessing, Processing};
use durability::platform::EpochMs;
use durability::routing::{CallContext, RoutingTarget, ShardCaller};
use durability::{Fanout, HandlerError, Load, Scheduler};
use durability_host::{
    AlarmInfo, BoxError, CallError, DurableObject, Host, Namespace, ObjectContext,
};

/// Where paused clocks start (epoch ms).
pub const START_MS: EpochMs = 1_000_000;

/// A clock that reads paused tokio time: `START_MS` plus the time advanced
/// since it was made.
pub fn paused_clock() -> impl Fn() -> EpochMs + Send + Sync + Clone + 'static {
    let origin = tokio::time::Instant::now();
    move || START_MS + EpochMs::try_from(origin.elapsed().as_millis()).unwrap_or(EpochMs::MAX)
}

/// Moves paused time forward by `ms`.
pub async fn advance_ms(ms: u64) {
    tokio::time::advance(Duration::from_millis(ms)).await;
}

/// A snapshot taken at `observed_at` reporting `pending` deliveries owed
/// and nothing in flight.
pub fn snapshot(observed_at: EpochMs, pending: u64) -> LoadSnapshot {
    LoadSnapshot {
        observed_at,
        window_ms: LOAD_WINDOW_MS,
        inbound: Processing {
            in_flight: 0,
            completed: 1,
            average_processing_ms: Some(1.0),
        },
        outbound: OutboundProcessing {
            in_flight: 0,
            completed: 0,
            average_processing_ms: None,
            pending_deliveries: pending,
        },
    }
}

/// The error a scripted call fails with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("scripted failure {0}")]
pub struct ScriptedError(pub u32);

/// One call a [`Scripted`] caller received.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedCall {
    pub target: RoutingTarget,
    pub input: u64,
    pub context: CallContext,
}

/// What a scripted call replies.
pub enum Reply {
    /// This snapshot.
    Load(LoadSnapshot),
    /// A snapshot taken now (by the caller's clock) with this backlog.
    Backlog(u64),
    /// A reply that carries no snapshot.
    Nothing,
    /// A failed call.
    Fail(ScriptedError),
}

/// A shard caller whose replies the test queues (default when the queue is
/// empty: a fresh snapshot with no backlog), and which records every call.
/// Cloning shares it.
#[derive(Clone)]
pub struct Scripted {
    clock: Arc<dyn Fn() -> EpochMs + Send + Sync>,
    replies: Arc<Mutex<VecDeque<Reply>>>,
    calls: Arc<Mutex<Vec<ReceivedCall>>>,
    /// The backlog an unscripted reply reports, by shard key.
    otherwise: Arc<Mutex<BacklogFn>>,
}

type BacklogFn = Box<dyn Fn(&str) -> u64 + Send>;

impl Scripted {
    pub fn new(clock: impl Fn() -> EpochMs + Send + Sync + 'static) -> Self {
        Scripted {
            clock: Arc::new(clock),
            replies: Arc::default(),
            calls: Arc::default(),
            otherwise: Arc::new(Mutex::new(Box::new(|_: &str| 0))),
        }
    }

    /// Makes unscripted replies report `backlog(shard)` (default: 0).
    pub fn otherwise(&self, backlog: impl Fn(&str) -> u64 + Send + 'static) {
        *self.otherwise.lock().expect("otherwise") = Box::new(backlog);
    }

    /// Queues the reply of the next call.
    pub fn then(&self, reply: Reply) -> &Self {
        self.replies.lock().expect("replies").push_back(reply);
        self
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<ReceivedCall> {
        self.calls.lock().expect("calls").clone()
    }

    /// The shard keys called, in order.
    pub fn shards(&self) -> Vec<String> {
        self.calls()
            .into_iter()
            .map(|call| call.target.shard)
            .collect()
    }
}

impl ShardCaller for Scripted {
    type Input = u64;
    type Output = (u64, Option<LoadSnapshot>);
    type Error = ScriptedError;

    fn call(
        &self,
        target: &RoutingTarget,
        input: u64,
        context: &CallContext,
    ) -> impl Future<Output = Result<Self::Output, ScriptedError>> + Send {
        self.calls.lock().expect("calls").push(ReceivedCall {
            target: target.clone(),
            input,
            context: context.clone(),
        });
        let reply = self.replies.lock().expect("replies").pop_front();
        let now = (self.clock)();
        let reply = reply.unwrap_or_else(|| {
            Reply::Backlog((self.otherwise.lock().expect("otherwise"))(&target.shard))
        });
        let result = match reply {
            Reply::Load(load) => Ok((input, Some(load))),
            Reply::Backlog(pending) => Ok((input, Some(snapshot(now, pending)))),
            Reply::Nothing => Ok((input, None)),
            Reply::Fail(error) => Err(error),
        };
        std::future::ready(result)
    }
}

/// Simulated objects: each shard has a backlog that a push adds its batch
/// to and that drains continuously at the shard's own rate. Replies are
/// snapshots taken at the call. Cloning shares the shards.
#[derive(Clone)]
pub struct SimShards {
    clock: Arc<dyn Fn() -> EpochMs + Send + Sync>,
    state: Arc<Mutex<SimState>>,
}

struct SimState {
    /// Messages each shard drains per second, by shard key.
    rates: HashMap<String, u64>,
    default_rate: u64,
    shards: HashMap<String, SimShard>,
}

#[derive(Default, Clone, Copy)]
struct SimShard {
    /// Backlog in thousandths of a message, so slow drains are exact.
    backlog_milli: u64,
    drained_at: EpochMs,
    pushes: u64,
}

impl SimShards {
    /// Shards that drain `default_rate` messages a second unless `rates`
    /// says otherwise.
    pub fn new(
        clock: impl Fn() -> EpochMs + Send + Sync + 'static,
        default_rate: u64,
        rates: HashMap<String, u64>,
    ) -> Self {
        SimShards {
            clock: Arc::new(clock),
            state: Arc::new(Mutex::new(SimState {
                rates,
                default_rate,
                shards: HashMap::new(),
            })),
        }
    }

    /// Every shard's backlog now (whole messages), drained up to now.
    pub fn backlogs(&self) -> HashMap<String, u64> {
        let now = (self.clock)();
        let mut state = self.state.lock().expect("sim state");
        let keys: Vec<String> = state.shards.keys().cloned().collect();
        keys.into_iter()
            .map(|key| {
                let backlog = state.drain(&key, now);
                (key, backlog)
            })
            .collect()
    }

    /// How many pushes each shard received.
    pub fn pushes(&self) -> HashMap<String, u64> {
        let state = self.state.lock().expect("sim state");
        state
            .shards
            .iter()
            .map(|(key, shard)| (key.clone(), shard.pushes))
            .collect()
    }
}

impl SimState {
    fn drain(&mut self, key: &str, now: EpochMs) -> u64 {
        let rate = self.rates.get(key).copied().unwrap_or(self.default_rate);
        let shard = self.shards.entry(key.to_owned()).or_insert(SimShard {
            drained_at: now,
            ..SimShard::default()
        });
        let elapsed_ms = u64::try_from(now - shard.drained_at).unwrap_or(0);
        // rate messages per second = rate thousandths per millisecond.
        shard.backlog_milli = shard.backlog_milli.saturating_sub(elapsed_ms * rate);
        shard.drained_at = now;
        shard.backlog_milli.div_ceil(1_000)
    }
}

impl ShardCaller for SimShards {
    type Input = u64;
    type Output = LoadSnapshot;
    type Error = ScriptedError;

    fn call(
        &self,
        target: &RoutingTarget,
        batch: u64,
        _: &CallContext,
    ) -> impl Future<Output = Result<LoadSnapshot, ScriptedError>> + Send {
        let now = (self.clock)();
        let mut state = self.state.lock().expect("sim state");
        state.drain(&target.shard, now);
        let backlog = state.shards.get_mut(&target.shard).map_or(0, |shard| {
            shard.backlog_milli += batch * 1_000;
            shard.pushes += 1;
            shard.backlog_milli.div_ceil(1_000)
        });
        std::future::ready(Ok(snapshot(now, backlog)))
    }
}

/// A real mailbox object: a scheduler, a fanout with an `inbox` consumer
/// and a load shared with the fanout, which is what its `push` reports.
/// Its consumer acks only when the test opens `deliver` (a shared switch),
/// so the backlog stays as long as the test wants.
pub struct Mailbox {
    pub ctx: ObjectContext,
    pub scheduler: Scheduler,
    pub fanout: Fanout<String>,
    pub load: Load,
}

/// The namespace of [`Mailbox`] objects.
pub const MAILBOXES: &str = "mailboxes";

/// How long a mailbox holds first deliveries: long enough that no test
/// sees one unless it advances past it.
pub const MAILBOX_BATCH_DELAY: Duration = Duration::from_secs(3_600);

impl Mailbox {
    fn new(ctx: ObjectContext) -> Result<Self, BoxError> {
        let scheduler = Scheduler::new(ctx.clone().into_dyn())?;
        let load = Load::for_context(&ctx.clone().into_dyn());
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "inbox",
                Target::consumer(|batch: Vec<FanoutMessage<String>>| async move {
                    for message in batch {
                        message
                            .ack()
                            .await
                            .map_err(|e| HandlerError::new(e.to_string()))?;
                    }
                    Ok::<_, HandlerError>(())
                }),
            )
            .batch_delay(MAILBOX_BATCH_DELAY)
            .routing(load.clone())
            .build()?;
        Ok(Mailbox {
            ctx,
            scheduler,
            fanout,
            load,
        })
    }

    /// The application's method: enqueue a batch to every target.
    pub async fn push(
        &self,
        bodies: Vec<String>,
        targets: EnqueueOptions,
    ) -> Result<EnqueueResult<Vec<String>>, FanoutError> {
        let batch = bodies.into_iter().map(FanoutInput::new).collect();
        self.fanout.enqueue(batch, &targets).await
    }
}

impl DurableObject for Mailbox {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

/// Registers the mailbox namespace on `host`.
pub fn mailboxes(host: &Host) -> Namespace<Mailbox> {
    host.namespace(MAILBOXES, Mailbox::new).expect("namespace")
}

/// Why a call to a mailbox failed.
#[derive(Debug, thiserror::Error)]
pub enum MailboxError {
    #[error("the host refused the call")]
    Host(#[from] durability_host::HostError),
    #[error("the call did not complete")]
    Call(#[from] CallError),
    #[error("the mailbox's fanout failed")]
    Fanout(#[from] FanoutError),
}

/// A push to a mailbox: the bodies and the targets.
#[derive(Debug, Clone)]
pub struct Letters {
    pub bodies: Vec<String>,
    pub targets: EnqueueOptions,
}

impl Letters {
    /// `n` letters for every target.
    pub fn many(n: usize) -> Self {
        Letters {
            bodies: (0..n).map(|i| format!("letter {i}")).collect(),
            targets: EnqueueOptions::all(),
        }
    }
}

/// The caller an application writes over its namespace: one stub call per
/// push, running the mailbox's `push` on the object's thread.
#[derive(Clone)]
pub struct Mailboxes(pub Namespace<Mailbox>);

impl ShardCaller for Mailboxes {
    type Input = Letters;
    type Output = EnqueueResult<Vec<String>>;
    type Error = MailboxError;

    fn call(
        &self,
        target: &RoutingTarget,
        letters: Letters,
        _: &CallContext,
    ) -> impl Future<Output = Result<Self::Output, MailboxError>> + Send {
        let stub = self.0.stub(&target.shard);
        async move {
            let stub = stub?;
            let reply = stub
                .call(move |mailbox: Rc<Mailbox>| async move {
                    mailbox.push(letters.bodies, letters.targets).await
                })
                .await??;
            Ok(reply)
        }
    }
}
