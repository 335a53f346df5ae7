//! The demo's producer: batches of mail pushed through a routing client to
//! the mailbox shard of their customer, and journaled once accepted.
//!
//! A batch belongs to one customer and a customer to one shard (custom
//! sharding by a stable hash), so a batch that a resumed run pushes again
//! reaches the shard that may have accepted it already, where its message
//! ids deduplicate it while it is still being delivered.

use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use durability::fanout::{EnqueueResult, FanoutError, FanoutInput};
use durability::routing::{CallContext, RoutingClient, RoutingTarget, ShardCaller};
use durability_host::{CallError, Host, HostError, Namespace};
use tokio::task::JoinSet;

use super::DemoError;
use super::facts::{AcceptedFact, Plan};
use super::mailbox::{Mail, Mailbox, stable_hash};
use super::progress::Counters;
use crate::bench::Latency;
use crate::torture::journal::Journal;

/// Producer tasks pushing at once.
const PRODUCERS: usize = 8;
/// Customers per shard: enough that hashing spreads them evenly.
const CUSTOMERS_PER_SHARD: u64 = 16;
/// Distinct recipients the mail goes to.
const RECIPIENTS: u64 = 5_000;

/// The name of shard `n`.
pub fn shard_name(n: u64) -> String {
    format!("mailbox-{n}")
}

/// What one push carries: one customer's batch of mail.
#[derive(Debug)]
pub struct Batch {
    customer: String,
    mails: Vec<FanoutInput<Mail>>,
}

/// Batch `number` of `plan`: its customer and its mail, the same in every
/// run that makes it.
fn batch(plan: &Plan, number: u64) -> Batch {
    let customers = u64::from(plan.shards)
        .saturating_mul(CUSTOMERS_PER_SHARD)
        .max(1);
    let customer = format!("customer-{}", number % customers);
    let mails = plan
        .batch_range(number)
        .map(|n| {
            let id = plan.message_id(n);
            let mail = Mail {
                run: plan.run,
                to: format!("user-{}@example.test", stable_hash(&id) % RECIPIENTS),
                subject: format!("Your order {n} has shipped"),
                text: format!(
                    "Hello, the parcel of order {n} for {customer} left our warehouse today \
                     and should reach you within three working days."
                ),
            };
            FanoutInput::new(mail).id(id)
        })
        .collect();
    Batch { customer, mails }
}

/// The shard of `customer` among `shards`.
fn shard_of(customer: &str, shards: u32) -> String {
    shard_name(stable_hash(customer) % u64::from(shards.max(1)))
}

/// Why a push failed. The shard may or may not have accepted the batch.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error("the host refused the call")]
    Host(#[from] HostError),
    #[error("the call did not complete")]
    Call(#[from] CallError),
    #[error("the mailbox failed")]
    Fanout(#[from] FanoutError),
}

/// Reaches mailbox shards by name: one stub call per push.
#[derive(Clone)]
pub struct Mailboxes(pub Namespace<Mailbox>);

impl ShardCaller for Mailboxes {
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
            let stub = stub?;
            let mails = batch.mails;
            let reply = stub
                .call(move |mailbox: Rc<Mailbox>| async move { mailbox.accept(mails).await })
                .await??;
            Ok(reply)
        }
    }
}

/// The producer's routing client: each batch goes to its customer's shard.
pub type Client = RoutingClient<Mailboxes>;

/// A client over `namespace` with `shards` shards, on the host's clock.
pub fn client(
    namespace: Namespace<Mailbox>,
    host: &Host,
    shards: u32,
) -> Result<Client, DemoError> {
    let clock = host.clone();
    RoutingClient::builder(Mailboxes(namespace), move || clock.now_ms())
        .sharding(move |batch: &Batch, _, _| {
            Ok(RoutingTarget::new(shard_of(&batch.customer, shards)))
        })
        .build()
        .map_err(|source| DemoError::Config {
            what: "the routing client",
            source,
        })
}

/// What one production phase did.
pub struct Produced {
    /// Enqueue latency of every accepted push.
    pub latency: Latency,
    /// Messages accepted by this phase.
    pub messages: u64,
    /// Stopped by `--pause-after-batches` before the plan was done.
    pub paused: bool,
}

/// What every producer task shares.
struct Work {
    client: Client,
    plan: Plan,
    /// The batches still to push, taken in order by whichever task is free.
    todo: Vec<u64>,
    next: AtomicUsize,
    journal: Journal,
    counters: Arc<Counters>,
    accepted_batches: AtomicU64,
    accepted_messages: AtomicU64,
    pause_after: Option<u64>,
}

impl Work {
    fn paused(&self) -> bool {
        self.pause_after
            .is_some_and(|limit| self.accepted_batches.load(Ordering::SeqCst) >= limit)
    }
}

/// Pushes every batch of `todo` with [`PRODUCERS`] tasks and journals each
/// accepted one before its task takes the next. Stops early after
/// `pause_after` accepted batches (a test hook). The first failure ends
/// the phase; batches in flight then may or may not be accepted, and a
/// later run pushes them again.
pub async fn produce(
    client: Client,
    plan: &Plan,
    todo: Vec<u64>,
    journal: Journal,
    counters: Arc<Counters>,
    pause_after: Option<u64>,
) -> Result<Produced, DemoError> {
    let tasks = PRODUCERS.min(todo.len());
    let work = Arc::new(Work {
        client,
        plan: plan.clone(),
        todo,
        next: AtomicUsize::new(0),
        journal,
        counters,
        accepted_batches: AtomicU64::new(0),
        accepted_messages: AtomicU64::new(0),
        pause_after,
    });
    // Dropping the set (a failure, Ctrl-C) aborts the other tasks.
    let mut producers = JoinSet::new();
    for _ in 0..tasks {
        producers.spawn(push_batches(Arc::clone(&work)));
    }
    let mut latency = Latency::new().map_err(|source| DemoError::Latency { source })?;
    while let Some(joined) = producers.join_next().await {
        let task_latency = joined.map_err(|error| DemoError::Task {
            message: error.to_string(),
        })??;
        latency
            .merge(&task_latency)
            .map_err(|source| DemoError::Latency { source })?;
    }
    let done = work.next.load(Ordering::SeqCst) >= work.todo.len();
    Ok(Produced {
        latency,
        messages: work.accepted_messages.load(Ordering::SeqCst),
        paused: work.paused() && !done,
    })
}

/// One producer task: takes the next batch until none is left.
async fn push_batches(work: Arc<Work>) -> Result<Latency, DemoError> {
    let mut latency = Latency::new().map_err(|source| DemoError::Latency { source })?;
    loop {
        if work.paused() {
            return Ok(latency);
        }
        let Some(&number) = work.todo.get(work.next.fetch_add(1, Ordering::SeqCst)) else {
            return Ok(latency);
        };
        let batch = batch(&work.plan, number);
        let shard = shard_of(&batch.customer, work.plan.shards);
        let count = batch.mails.len() as u64;
        let started = Instant::now();
        let reply = work
            .client
            .push(batch, CallContext::new())
            .await
            .map_err(|source| DemoError::Push {
                batch: number,
                source: Box::new(source),
            })?;
        latency.record(started.elapsed());
        if let EnqueueResult::Rejected { error, .. } = reply {
            return Err(DemoError::Rejected {
                batch: number,
                reason: error.to_string(),
            });
        }
        // Journaled (and synced) before this task pushes again: the
        // journal is what the accounting calls accepted.
        let journal = work.journal.clone();
        let fact = AcceptedFact {
            batch: number,
            shard,
            count,
        };
        tokio::task::spawn_blocking(move || journal.append(&fact))
            .await
            .map_err(|error| DemoError::Task {
                message: error.to_string(),
            })??;
        work.counters.accepted(count);
        work.accepted_batches.fetch_add(1, Ordering::SeqCst);
        work.accepted_messages.fetch_add(count, Ordering::SeqCst);
    }
}
