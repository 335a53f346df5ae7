//! The reference's email queue (queues.md §7.1): routing + fanout + a
//! storage target + a DLQ, over many delivery objects on the real host.
//!
//! ```text
//! cargo run -p durability --example email_queue [-- DIR]
//! ```
//!
//! - Each `EmailDelivery` object owns a fanout with two targets: `email`, a
//!   consumer that forwards each batch to an upstream mail API, and
//!   `archive`, a storage target; dead letters go to a DLQ. Archive and DLQ
//!   are prefixes of one "bucket" (a directory): `email-archive/` and
//!   `email-dlq/`, one file per delivery identity, never overwritten.
//! - The upstream answers 200 (ack), 400 (dead letter), 429 (retry after a
//!   pause) or 500 (left unsettled: the retry policy decides, and
//!   exhaustion dead-letters this target only). Each send carries the
//!   message id as its idempotency key, so a repeated send is harmless.
//! - Producers push through a routing client: the shard is
//!   `context.lane` or `customer-<customer of the first email>`, with the
//!   first email's region as the location hint. VIP traffic goes through a
//!   `lane` context layer and a 5 s timeout layer. Newsletters go through
//!   a second client with the default adaptive sharding, which widens over
//!   `shard-N` objects under backlog.
//! - Finally the DLQ is redriven once the upstream is fixed: each entry is
//!   pushed again, for its one target, keyed by its delivery identity, and
//!   deleted only once accepted.

use std::collections::{BTreeMap, HashMap};
use std::error::Error;
use std::fs::OpenOptions;
use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use durability::fanout::{
    EnqueueOptions, EnqueueResult, Fanout, FanoutError, FanoutInput, FanoutMessage, StoredMessage,
    Target,
};
use durability::routing::{
    CallContext, ContextLayer, Push, RoutingClient, RoutingTarget, Service, ServiceBuilder,
    ServiceExt, ShardCaller, ShardingError, TimeoutLayer,
};
use durability::{HandlerError, Load, Scheduler};
use durability_host::{
    AlarmInfo, BoxError, CallError, DurableObject, Host, HostError, Namespace, ObjectContext,
};
use serde::{Deserialize, Serialize};

/// The reference waits 30 s after a 429; the example waits less so that it
/// ends in seconds.
const RATE_LIMITED_PAUSE: Duration = Duration::from_millis(300);
/// How long the upstream takes for a batch of bulk mail: slower than the
/// newsletter producer, so one object falls behind.
const BULK_BATCH_LATENCY: Duration = Duration::from_millis(100);
/// How long the example waits for every delivery to settle.
const DRAIN_DEADLINE: Duration = Duration::from_secs(60);

/// One email.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Email {
    id: String,
    customer_id: String,
    region: String,
    to: String,
    subject: String,
}

// ------------------------------------------------------------ upstream

/// The upstream mail API (the reference's `EmailConsumer` calls one over
/// HTTP). It keeps what it sent by idempotency key, so a repeated send is
/// counted once. Shared by every object thread.
#[derive(Default)]
struct Upstream {
    sent: Mutex<BTreeMap<String, String>>,
    seen_flaky: Mutex<HashMap<String, u32>>,
    /// Once set, addresses that bounced are deliverable (the "fix" that a
    /// redrive follows).
    fixed: AtomicBool,
}

impl Upstream {
    /// The HTTP status of sending `email` with `idempotency_key`.
    fn send(&self, email: &Email, idempotency_key: &str) -> u16 {
        let domain = email.to.rsplit('@').next().unwrap_or_default();
        let status = match domain {
            "bounce.test" if !self.fixed.load(Ordering::SeqCst) => 400,
            "busy.test" | "flaky.test" => {
                let mut seen = lock(&self.seen_flaky);
                let tries = seen.entry(idempotency_key.to_owned()).or_default();
                *tries += 1;
                match (domain, *tries) {
                    ("busy.test", 1) => 429,
                    ("flaky.test", 1 | 2) => 500,
                    _ => 200,
                }
            }
            _ => 200,
        };
        if status == 200 {
            lock(&self.sent).insert(idempotency_key.to_owned(), email.to.clone());
        }
        status
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

// -------------------------------------------------------------- bucket

/// The bucket the archive and the DLQ write to: a directory, one file per
/// delivery identity under a prefix, created only if absent (the
/// conditional put of the reference).
#[derive(Clone)]
struct Bucket(PathBuf);

const ARCHIVE_PREFIX: &str = "email-archive";
const DLQ_PREFIX: &str = "email-dlq";

impl Bucket {
    fn open(dir: &Path) -> std::io::Result<Self> {
        for prefix in [ARCHIVE_PREFIX, DLQ_PREFIX] {
            std::fs::create_dir_all(dir.join(prefix))?;
        }
        Ok(Bucket(dir.to_path_buf()))
    }

    /// Writes `stored` under `prefix` unless an entry with its identity
    /// exists: a retried write after a crash or a timeout changes nothing.
    fn put_once(&self, prefix: &str, stored: &StoredMessage<Email>) -> Result<(), HandlerError> {
        let path = self.0.join(prefix).join(key_of(&stored.id));
        let text = serde_json::to_vec_pretty(stored)?;
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(mut file) => {
                file.write_all(&text)?;
                file.sync_all()?;
                Ok(())
            }
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            Err(error) => Err(error.into()),
        }
    }

    /// The entries under `prefix`, by key.
    fn list(&self, prefix: &str) -> std::io::Result<Vec<PathBuf>> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(self.0.join(prefix))?
            .map(|entry| entry.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        paths.sort();
        Ok(paths)
    }
}

/// An object key for a delivery identity (`["<generation>","<target>"]`):
/// its bytes in hex, so no identity ever becomes a path of its own.
fn key_of(delivery_id: &str) -> String {
    let hex: String = delivery_id.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{hex}.json")
}

// ------------------------------------------------------------- objects

/// The delivery object: a scheduler, a load its fanout counts into, and
/// the fanout.
struct EmailDelivery {
    scheduler: Scheduler,
    fanout: Fanout<Email>,
}

impl EmailDelivery {
    fn new(ctx: ObjectContext, upstream: Arc<Upstream>, bucket: Bucket) -> Result<Self, BoxError> {
        let ctx = ctx.into_dyn();
        let scheduler = Scheduler::new(Rc::clone(&ctx))?;
        let routing = Load::for_context(&ctx);
        let (archive, dlq) = (bucket.clone(), bucket);
        let fanout = Fanout::<Email>::builder(&scheduler)
            .target(
                "email",
                Target::consumer(move |batch: Vec<FanoutMessage<Email>>| {
                    let upstream = Arc::clone(&upstream);
                    async move {
                        // A slow upstream: each bulk batch takes a while.
                        if batch.iter().any(|m| m.body.to.ends_with("@bulk.test")) {
                            tokio::time::sleep(BULK_BATCH_LATENCY).await;
                        }
                        for message in batch {
                            match upstream.send(&message.body, &message.id) {
                                200 => drop(message.ack()),
                                400 => drop(message.dead_letter()),
                                429 => drop(message.retry_after(RATE_LIMITED_PAUSE)),
                                // Left unsettled: the retry policy decides.
                                _ => {}
                            }
                        }
                        Ok::<_, HandlerError>(())
                    }
                }),
            )
            .target(
                "archive",
                Target::storage(move |stored: StoredMessage<Email>| {
                    let written = archive.put_once(ARCHIVE_PREFIX, &stored);
                    async move { written }
                }),
            )
            .dlq(move |stored: StoredMessage<Email>| {
                let written = dlq.put_once(DLQ_PREFIX, &stored);
                async move { written }
            })
            .max_batch_size(25)
            .attempt_timeout(Duration::from_secs(30))
            .max_attempts(5)
            .retry_delay(durability::retry::Delay::Fixed { ms: 200.0 })
            .routing(routing)
            .build()?;
        Ok(EmailDelivery { scheduler, fanout })
    }

    /// The application's RPC: accept a batch for delivery.
    async fn push(&self, batch: EmailBatch) -> Result<EnqueueResult<Vec<String>>, FanoutError> {
        let messages = batch
            .emails
            .into_iter()
            .map(|email| {
                let input = FanoutInput::new(email.clone()).id(email.id);
                match &batch.deduplication_key {
                    Some(key) => input.deduplication_key(key.clone()),
                    None => input,
                }
            })
            .collect();
        self.fanout.enqueue(messages, &batch.targets).await
    }

    fn pending(&self) -> Result<u64, FanoutError> {
        Ok(self.fanout.load()?.outbound.pending_deliveries)
    }
}

impl DurableObject for EmailDelivery {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

// -------------------------------------------------------------- client

/// What one push carries.
#[derive(Debug, Clone)]
struct EmailBatch {
    emails: Vec<Email>,
    targets: EnqueueOptions,
    /// Set by redrive: the DLQ entry's identity, so the redriven delivery
    /// is new work that cannot collide with the original message.
    deduplication_key: Option<String>,
}

impl EmailBatch {
    fn new(emails: Vec<Email>) -> Self {
        EmailBatch {
            emails,
            targets: EnqueueOptions::all(),
            deduplication_key: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum DeliveryError {
    #[error("the host refused the call")]
    Host(#[from] HostError),
    #[error("the call did not complete")]
    Call(#[from] CallError),
    #[error("the delivery object failed")]
    Fanout(#[from] FanoutError),
}

/// Reaches `EmailDelivery` objects by shard key: one stub call per push.
#[derive(Clone)]
struct Deliveries(Namespace<EmailDelivery>);

impl ShardCaller for Deliveries {
    type Input = EmailBatch;
    type Output = EnqueueResult<Vec<String>>;
    type Error = DeliveryError;

    fn call(
        &self,
        target: &RoutingTarget,
        batch: EmailBatch,
        _: &CallContext,
    ) -> impl Future<Output = Result<Self::Output, DeliveryError>> + Send {
        // The embedded host has one location: the hint is not used here.
        let stub = self.0.stub(&target.shard);
        async move {
            let stub = stub?;
            let reply = stub
                .call(move |delivery: Rc<EmailDelivery>| async move { delivery.push(batch).await })
                .await??;
            Ok(reply)
        }
    }
}

/// The reference's client sharding: the lane if the context names one,
/// else the first email's customer; the first email's region as the hint.
fn by_lane_or_customer(
    batch: &EmailBatch,
    context: &CallContext,
    _: &durability::routing::Observations<'_>,
) -> Result<RoutingTarget, ShardingError> {
    let first = batch
        .emails
        .first()
        .ok_or_else(|| ShardingError::new("an empty batch has no customer"))?;
    let shard = match context.get_str("lane") {
        Some(lane) => lane.to_owned(),
        None => format!("customer-{}", first.customer_id),
    };
    Ok(RoutingTarget::new(shard).location_hint(first.region.clone()))
}

fn email(n: usize, customer: &str, to: &str, subject: &str) -> Email {
    Email {
        id: format!("mail-{customer}-{n}"),
        customer_id: customer.to_owned(),
        region: if n.is_multiple_of(2) { "weur" } else { "enam" }.to_owned(),
        to: to.to_owned(),
        subject: subject.to_owned(),
    }
}

// ---------------------------------------------------------------- main

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn Error>> {
    let temporary = tempfile::tempdir()?;
    let dir = std::env::args_os()
        .nth(1)
        .map_or_else(|| temporary.path().to_path_buf(), PathBuf::from);
    println!("data directory: {}", dir.display());
    let bucket = Bucket::open(&dir.join("bucket"))?;
    let upstream = Arc::new(Upstream::default());

    let host = Host::builder(dir.join("objects")).threads(2).build()?;
    let namespace = host.namespace("email-delivery", {
        let (upstream, bucket) = (Arc::clone(&upstream), bucket.clone());
        move |ctx| EmailDelivery::new(ctx, Arc::clone(&upstream), bucket.clone())
    })?;
    let clock = host.clone();
    let client = RoutingClient::builder(Deliveries(namespace.clone()), move || clock.now_ms())
        .sharding(by_lane_or_customer)
        .build()?;

    // Transactional mail, keyed by customer: affinity per customer.
    let mut shards = BTreeMap::new();
    for (customer, to) in [
        ("acme", "ada@example.test"),
        ("globex", "grace@bounce.test"),
        ("initech", "ivan@busy.test"),
        ("umbrella", "uma@flaky.test"),
    ] {
        let batch: Vec<Email> = (0..5)
            .map(|n| email(n, customer, to, "Your receipt"))
            .collect();
        let reply = client
            .push(EmailBatch::new(batch), CallContext::new())
            .await?;
        let status = if reply.is_accepted() { 202 } else { 409 };
        *shards.entry(format!("customer-{customer}")).or_insert(0) += 5;
        println!("POST /send customer={customer}: {status}");
    }

    // VIP traffic: the `lane` layer routes it to its own object, and the
    // timeout layer stops waiting after 5 s (it does not cancel the call).
    let mut vip = ServiceBuilder::new()
        .layer(ContextLayer::new(CallContext::new().with("lane", "vip")))
        .layer(TimeoutLayer::new(
            Duration::from_secs(5),
            tokio::time::sleep,
        )?)
        .service(client.clone());
    let batch = (0..3)
        .map(|n| email(n, "acme-vip", "ceo@example.test", "Contract"))
        .collect();
    let reply = vip
        .ready()
        .await?
        .call(Push::new(EmailBatch::new(batch)))
        .await?;
    shards.insert("vip".to_owned(), 3);
    println!(
        "POST /send lane=vip: {}",
        if reply.is_accepted() { 202 } else { 409 }
    );

    // Newsletters: no affinity needed, so the default adaptive sharding
    // spreads them and widens under backlog (here above 100 owed deliveries
    // per object, one more object a second at most). The upstream is slow
    // for bulk mail, so one object cannot keep up.
    let clock = host.clone();
    let newsletters = RoutingClient::builder(Deliveries(namespace.clone()), move || clock.now_ms())
        .soft_backlog_limit(100)
        .build()?;
    let started = Instant::now();
    let mut sent = 0;
    while started.elapsed() < Duration::from_secs(3) {
        let batch = (0..25)
            .map(|n| email(sent + n, "newsletter", "reader@bulk.test", "News"))
            .collect();
        sent += 25;
        newsletters
            .push(EmailBatch::new(batch), CallContext::new())
            .await?;
    }
    println!(
        "newsletters: {sent} emails in 3 s, spread over {} shard(s) (width {})",
        newsletters.observations().len(),
        newsletters.width()
    );
    for shard in newsletters.observations().into_keys() {
        shards.insert(shard, 0);
    }

    drain(&namespace, shards.keys()).await?;
    let archived = bucket.list(ARCHIVE_PREFIX)?.len();
    let dead = bucket.list(DLQ_PREFIX)?;
    println!(
        "settled: {} email(s) sent upstream, {archived} archived, {} dead letter(s)",
        lock(&upstream.sent).len(),
        dead.len()
    );

    // Redrive after the fix: every DLQ entry goes back to its one target.
    upstream.fixed.store(true, Ordering::SeqCst);
    redrive(&client, &bucket).await?;
    drain(&namespace, shards.keys()).await?;
    println!(
        "after redrive: {} email(s) sent upstream, {} dead letter(s) left",
        lock(&upstream.sent).len(),
        bucket.list(DLQ_PREFIX)?.len()
    );

    host.shutdown().await;
    Ok(())
}

/// Pushes every DLQ entry again, for its one target, keyed by its delivery
/// identity, and deletes it only once the push was accepted (a crash in
/// between redrives it again: at least once).
async fn redrive(
    client: &RoutingClient<Deliveries>,
    bucket: &Bucket,
) -> Result<(), Box<dyn Error>> {
    for path in bucket.list(DLQ_PREFIX)? {
        let entry: StoredMessage<Email> = serde_json::from_slice(&std::fs::read(&path)?)?;
        let batch = EmailBatch {
            emails: vec![entry.body.clone()],
            targets: EnqueueOptions::to([entry.target.clone()]),
            deduplication_key: Some(entry.id.clone()),
        };
        let reply = client.push(batch, CallContext::new()).await?;
        if reply.is_accepted() {
            std::fs::remove_file(&path)?;
            println!("redriven {} to {}", entry.message_id, entry.target);
        } else {
            println!("redrive of {} rejected; entry kept", entry.message_id);
        }
    }
    Ok(())
}

/// Waits until no delivery is owed by the given objects.
async fn drain<'a>(
    namespace: &Namespace<EmailDelivery>,
    shards: impl Iterator<Item = &'a String> + Clone,
) -> Result<(), Box<dyn Error>> {
    let started = Instant::now();
    loop {
        let mut owed = 0;
        for shard in shards.clone() {
            owed += namespace
                .stub(shard)?
                .call(|delivery: Rc<EmailDelivery>| async move { delivery.pending() })
                .await??;
        }
        if owed == 0 {
            return Ok(());
        }
        if started.elapsed() > DRAIN_DEADLINE {
            return Err(format!("{owed} deliveries still owed after {DRAIN_DEADLINE:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
