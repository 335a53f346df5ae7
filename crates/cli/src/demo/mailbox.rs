//! The demo's object: one shard of a mailbox service, and every capability
//! it uses on one shared scheduler.
//!
//! - **Fanout** delivers each accepted mail to two targets: `inbox`, a
//!   consumer that hands mail to the recipient's inbox (a table of the
//!   object) and fails some messages on purpose, and `archive`, a storage
//!   target writing one file per mail. Dead letters go to a DLQ directory.
//! - A **named alarm**, `cleanup`, runs every second while mail is owed: it
//!   trims the inbox table to its newest rows and purges digests and parked
//!   entries past their retention.
//! - A **durable operation**, `digest`, writes a shard's digest of the run
//!   once its mail is delivered; registering it twice (a resumed run) runs
//!   it once.
//!
//! Which messages fail is a function of the message id alone, so a resumed
//! run fails the same ones. Every target writes its fact to disk before it
//! reports success (a journal line, an archive or DLQ file), which is what
//! the demo's accounting reads back.

use std::cell::{Cell, OnceCell};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use durability::fanout::{
    EnqueueOptions, EnqueueResult, Fanout, FanoutError, FanoutInput, FanoutMessage, StoredMessage,
    Target,
};
use durability::retry::Delay;
use durability::scheduler::MIN_ALARM_MIN_DELAY;
use durability::{
    AlarmCall, Alarms, DurabilityError, DurableCall, HandlerError, OperationResult, Operations,
    Scheduler,
};
use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext};
use durability_platform::{Context as _, EpochMs, StorageError, StorageExt as _, params};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::facts::{self, InboxFact, RunPaths};
use super::progress::Counters;
use crate::torture::journal::Journal;

/// The namespace of the mailbox shards.
pub const NAMESPACE: &str = "mailbox";
/// The consumer target.
pub const INBOX: &str = "inbox";
/// The storage target.
pub const ARCHIVE: &str = "archive";
/// Every target; each mail is enqueued for all of them.
pub const TARGETS: [&str; 2] = [INBOX, ARCHIVE];

/// The digest operation's name.
const DIGEST: &str = "digest";
/// The cleanup alarm's name.
const CLEANUP: &str = "cleanup";

/// Most messages a target gets in one batch (one claim transaction).
const DELIVERY_BATCH: usize = 100;
/// Attempts per delivery, the first included.
pub const MAX_ATTEMPTS: u32 = 5;
/// How long a target has for one batch. Also how long a batch claimed by a
/// killed process waits before it is delivered again: short, so a resumed
/// run does not wait long.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);
/// The delay a transient failure asks for.
const TRANSIENT_RETRY: Duration = Duration::from_millis(200);
/// The retry policy's delay (exponential with jitter) for failures that
/// leave the delay to it.
const RETRY_INITIAL_MS: f64 = 100.0;
const RETRY_MAX_MS: f64 = 1_000.0;

/// How often the cleanup alarm runs while mail is owed.
const CLEANUP_PERIOD_MS: EpochMs = 1_000;
/// Inbox rows each shard keeps; older mail lives in the archive.
const INBOX_KEEP_ROWS: i64 = 1_000;
/// How long digests and parked dead letters are kept.
const RETENTION_MS: EpochMs = 7 * 24 * 3_600 * 1_000;
/// How long a shard waits for its digest to complete.
const DIGEST_WAIT: Duration = Duration::from_secs(30);

/// The object's own tables (the capabilities migrate theirs).
const SCHEMA_SQL: &str = "
    CREATE TABLE IF NOT EXISTS mailbox_inbox (
        seq INTEGER PRIMARY KEY,
        message_id TEXT NOT NULL UNIQUE,
        recipient TEXT NOT NULL,
        subject TEXT NOT NULL,
        delivered_at_ms INTEGER NOT NULL
    );
    CREATE TABLE IF NOT EXISTS mailbox_cleanup (
        slot INTEGER PRIMARY KEY CHECK (slot = 0),
        runs INTEGER NOT NULL,
        trimmed INTEGER NOT NULL
    );";

/// One mail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mail {
    /// The run that sent it: its facts go to that run's directory.
    pub run: u32,
    pub to: String,
    pub subject: String,
    pub text: String,
}

/// What the inbox does with a message, decided by its id alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Delivered on the first attempt.
    Deliver,
    /// Fails its first `failures` attempts (the mail server is busy), then
    /// is delivered.
    Transient { failures: u32 },
    /// The recipient has no mailbox: dead-lettered at once.
    Bounce,
    /// Fails every attempt: dead-lettered when its attempts are used up.
    Unreachable,
}

/// The fate of message `id`: 5 % transient, 0.2 % bounce, 0.1 % unreachable.
pub fn fate(id: &str) -> Fate {
    match stable_hash(id) % 10_000 {
        0..20 => Fate::Bounce,
        20..30 => Fate::Unreachable,
        n @ 30..530 => Fate::Transient {
            failures: 1 + u32::from(n % 2 == 1),
        },
        _ => Fate::Deliver,
    }
}

/// A hash of `text` that is the same in every build, so the fate of a
/// message and the shard of a customer survive an upgrade between runs.
pub fn stable_hash(text: &str) -> u64 {
    let digest = Sha256::digest(text.as_bytes());
    let mut first = [0_u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// The request of the digest operation.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct DigestRequest {
    run: u32,
}

/// What a shard's digest found, stored as the operation's result and
/// written to the run's `digests/` directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Digest {
    pub run: u32,
    pub shard: String,
    pub archived_mails: u64,
    pub archived_bytes: u64,
}

/// What the cleanup alarm did on one shard, over all runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CleanupStats {
    pub runs: u64,
    pub trimmed: u64,
}

/// What every mailbox of the host shares, across executor threads: where
/// files go, the inbox journals, and the counters the progress bars read.
pub struct Shared {
    data_dir: PathBuf,
    /// The inbox journal of each run, opened on first use. A std `Mutex`:
    /// held only to look up or insert, never across an await.
    journals: Mutex<HashMap<u32, Journal>>,
    pub counters: Arc<Counters>,
}

impl Shared {
    pub fn new(data_dir: &Path, counters: Arc<Counters>) -> Self {
        Shared {
            data_dir: data_dir.to_path_buf(),
            journals: Mutex::new(HashMap::new()),
            counters,
        }
    }

    fn run(&self, run: u32) -> RunPaths {
        RunPaths::of(&self.data_dir, run)
    }

    fn inbox_journal(&self, run: u32) -> Result<Journal, HandlerError> {
        let mut journals = self.journals.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(journal) = journals.get(&run) {
            return Ok(journal.clone());
        }
        let journal = Journal::open(&self.run(run).inbox())?;
        journals.insert(run, journal.clone());
        Ok(journal)
    }

    /// Writes the archive entry of `stored` (blocking).
    fn archive(&self, shard: &str, stored: &StoredMessage<Mail>) -> Result<(), HandlerError> {
        let path = self
            .run(stored.body.run)
            .archive_entry(shard, &stored.message_id);
        if facts::write_once(&path, &serde_json::to_vec_pretty(stored)?)? {
            self.counters.archived();
        }
        Ok(())
    }

    /// Writes the dead letter `stored` (blocking).
    fn dead_letter(&self, stored: &StoredMessage<Mail>) -> Result<(), HandlerError> {
        let path = self
            .run(stored.body.run)
            .dlq_entry(&stored.message_id, &stored.target);
        if facts::write_once(&path, &serde_json::to_vec_pretty(stored)?)? {
            self.counters.dead_lettered(&stored.message_id);
        }
        Ok(())
    }

    /// Counts the shard's archive of `run` and writes its digest (blocking).
    fn digest(&self, run: u32, shard: &str) -> Result<Digest, HandlerError> {
        let paths = self.run(run);
        let mut digest = Digest {
            run,
            shard: shard.to_owned(),
            archived_mails: 0,
            archived_bytes: 0,
        };
        match std::fs::read_dir(paths.archive_of(shard)) {
            Ok(entries) => {
                for entry in entries {
                    let entry = entry?;
                    if entry.file_name().to_string_lossy().ends_with(".json") {
                        digest.archived_mails += 1;
                        digest.archived_bytes += entry.metadata()?.len();
                    }
                }
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(error.into()),
        }
        // A repeated attempt keeps the digest the first one wrote.
        facts::write_once(&paths.digest(shard), &serde_json::to_vec_pretty(&digest)?)?;
        Ok(digest)
    }
}

/// One mailbox shard.
pub struct Mailbox {
    ctx: ObjectContext,
    scheduler: Scheduler,
    mail: Fanout<Mail>,
    operations: Operations,
    alarms: Alarms,
    /// Whether this instance has the cleanup alarm scheduled. In memory
    /// only: after an eviction or a restart the next accepted batch
    /// schedules it again (and a pending occurrence fires anyway).
    cleanup_scheduled: Rc<Cell<bool>>,
}

impl DurableObject for Mailbox {
    // The object's one alarm runs the scheduler, which runs every
    // capability's due work: that is how delivery resumes after a restart.
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

impl Mailbox {
    /// Builds a shard: its tables, its scheduler and every capability.
    pub fn new(ctx: ObjectContext, shared: Arc<Shared>) -> Result<Self, BoxError> {
        ctx.storage().execute_script(SCHEMA_SQL)?;
        let shard = ctx.name().unwrap_or_default().to_owned();
        let scheduler = Scheduler::builder(ctx.clone().into_dyn())
            .alarm_min_delay(MIN_ALARM_MIN_DELAY)
            .build()?;
        let mail = Fanout::<Mail>::builder(&scheduler)
            .target(INBOX, inbox(&ctx, &shared, &shard).ack_on_return(true))
            .target(ARCHIVE, archive(&shared, &shard))
            .dlq({
                let shared = Arc::clone(&shared);
                move |stored: StoredMessage<Mail>| {
                    let shared = Arc::clone(&shared);
                    async move {
                        tokio::task::spawn_blocking(move || shared.dead_letter(&stored)).await?
                    }
                }
            })
            .max_batch_size(DELIVERY_BATCH)
            .max_attempts(MAX_ATTEMPTS)
            .attempt_timeout(ATTEMPT_TIMEOUT)
            .retry_delay(Delay::Exponential {
                initial_ms: RETRY_INITIAL_MS,
                max_ms: RETRY_MAX_MS,
            })
            .build()?;
        let operations = Operations::builder(&scheduler)
            .handler(DIGEST, {
                let (shared, shard) = (Arc::clone(&shared), shard.clone());
                move |call: DurableCall<DigestRequest>| {
                    let (shared, shard) = (Arc::clone(&shared), shard.clone());
                    async move {
                        let run = call.payload.run;
                        tokio::task::spawn_blocking(move || shared.digest(run, &shard)).await?
                    }
                }
            })
            .build()?;
        let cleanup_scheduled = Rc::new(Cell::new(false));
        // The cleanup handler re-arms itself through the `Alarms` it is
        // part of, which exists only once the builder returns.
        let alarms: Rc<OnceCell<Alarms>> = Rc::default();
        let built = Alarms::builder(&scheduler)
            .handler(CLEANUP, {
                let cleanup = Cleanup {
                    ctx: ctx.clone(),
                    scheduler: scheduler.clone(),
                    mail: mail.clone(),
                    operations: operations.clone(),
                    alarms: Rc::clone(&alarms),
                    scheduled: Rc::clone(&cleanup_scheduled),
                };
                let cleanup = Rc::new(cleanup);
                move |_call: AlarmCall| {
                    let cleanup = Rc::clone(&cleanup);
                    async move { cleanup.run().await }
                }
            })
            .build()?;
        let _ = alarms.set(built.clone());
        Ok(Mailbox {
            ctx,
            scheduler,
            mail,
            operations,
            alarms: built,
            cleanup_scheduled,
        })
    }

    /// The application's RPC: accept a batch of mail for every target.
    /// `Accepted` means durably accepted, not delivered.
    pub async fn accept(
        &self,
        mails: Vec<FanoutInput<Mail>>,
    ) -> Result<EnqueueResult<Vec<String>>, FanoutError> {
        let result = self.mail.enqueue(mails, &EnqueueOptions::all()).await?;
        // Scheduled once, not on every batch: scheduling again replaces the
        // pending occurrence, which would postpone the cleanup for as long
        // as mail keeps coming.
        if result.is_accepted() && !self.cleanup_scheduled.replace(true) {
            let at = self.scheduler.now_ms() + CLEANUP_PERIOD_MS;
            if let Err(error) = self.alarms.schedule(CLEANUP, at).await {
                self.cleanup_scheduled.set(false);
                tracing::warn!(%error, "cannot schedule the cleanup alarm; the next batch tries again");
            }
        }
        Ok(result)
    }

    /// Deliveries still owed by this shard (first deliveries, retries and
    /// dead letters not yet written).
    pub fn owed(&self) -> Result<u64, FanoutError> {
        Ok(self.mail.load()?.outbound.pending_deliveries)
    }

    /// Every parked dead letter, as (message id, target).
    pub fn parked(&self) -> Result<Vec<(String, String)>, FanoutError> {
        const PAGE: usize = 1_000;
        let mut parked = Vec::new();
        let mut after = None;
        loop {
            let page = self.mail.parked(after.as_ref(), PAGE)?;
            let full = page.len() == PAGE;
            parked.extend(
                page.iter()
                    .map(|entry| (entry.message_id.clone(), entry.target.clone())),
            );
            after = page.into_iter().last();
            if !full {
                return Ok(parked);
            }
        }
    }

    /// Registers the digest of `run` (once: the id is the run) and waits
    /// for it.
    pub async fn digest(&self, run: u32) -> Result<OperationResult<Digest>, DurabilityError> {
        let id = format!("digest-r{run}");
        self.operations
            .start(DIGEST, &id, &DigestRequest { run })
            .await?;
        self.operations.wait(DIGEST, &id, DIGEST_WAIT).await
    }

    /// What the cleanup alarm did on this shard so far.
    pub fn cleanup_stats(&self) -> Result<CleanupStats, StorageError> {
        let Some(row) = self.ctx.storage().query_row(
            "SELECT runs, trimmed FROM mailbox_cleanup WHERE slot = 0",
            &[],
        )?
        else {
            return Ok(CleanupStats::default());
        };
        Ok(CleanupStats {
            runs: row.get(0)?,
            trimmed: row.get(1)?,
        })
    }
}

/// The inbox consumer: hands each message to the recipient's inbox or
/// fails it as its [`fate`] says, journals what it did, and returns; the
/// messages it did not settle are acked on return, in one transaction.
fn inbox(ctx: &ObjectContext, shared: &Arc<Shared>, shard: &str) -> Target<Mail> {
    let (ctx, shared, shard) = (ctx.clone(), Arc::clone(shared), shard.to_owned());
    Target::consumer(move |batch: Vec<FanoutMessage<Mail>>| {
        let (ctx, shared, shard) = (ctx.clone(), Arc::clone(&shared), shard.clone());
        async move { deliver(&ctx, &shared, shard, batch).await }
    })
}

async fn deliver(
    ctx: &ObjectContext,
    shared: &Arc<Shared>,
    shard: String,
    batch: Vec<FanoutMessage<Mail>>,
) -> Result<(), HandlerError> {
    // A run starts only once the previous one has nothing owed, so one
    // batch never mixes runs.
    let Some(run) = batch.first().map(|message| message.body.run) else {
        return Ok(());
    };
    let mut fact = InboxFact {
        shard,
        ..InboxFact::default()
    };
    let mut delivered = Vec::with_capacity(batch.len());
    for message in &batch {
        // A settlement runs whether or not it is awaited; the fanout waits
        // for all of them before it acks the rest.
        match fate(&message.id) {
            Fate::Bounce => {
                drop(message.dead_letter());
                fact.bounced.push(message.id.clone());
            }
            Fate::Unreachable => {
                drop(message.retry());
                fact.retried.push(message.id.clone());
            }
            Fate::Transient { failures } if message.attempt <= failures => {
                drop(message.retry_after(TRANSIENT_RETRY));
                fact.retried.push(message.id.clone());
            }
            Fate::Transient { .. } | Fate::Deliver => delivered.push(message),
        }
    }
    let delivered_at_ms = ctx.now_ms();
    // The recipients' inbox: one transaction for the batch. A message
    // delivered again after a crash finds its row and changes nothing.
    ctx.storage()
        .transaction_sync(|sql| -> Result<(), StorageError> {
            for message in &delivered {
                sql.execute(
                    "INSERT INTO mailbox_inbox (message_id, recipient, subject, delivered_at_ms) \
                     VALUES (?1, ?2, ?3, ?4) ON CONFLICT(message_id) DO NOTHING",
                    &params![
                        message.id.as_str(),
                        message.body.to.as_str(),
                        message.body.subject.as_str(),
                        delivered_at_ms
                    ],
                )?;
            }
            Ok(())
        })?;
    fact.delivered = delivered.iter().map(|message| message.id.clone()).collect();
    // The fact is on disk before the consumer returns, and so before the
    // delivered messages are acked: a crash in between delivers them again
    // (at least once), never acks one the journal does not know.
    let journal = shared.inbox_journal(run)?;
    let fact = tokio::task::spawn_blocking(move || journal.append(&fact).map(|()| fact)).await??;
    shared
        .counters
        .inbox_handled(&fact.delivered, &fact.retried);
    Ok(())
}

/// The archive: a storage target writing each mail once, as a file.
fn archive(shared: &Arc<Shared>, shard: &str) -> Target<Mail> {
    let (shared, shard) = (Arc::clone(shared), shard.to_owned());
    Target::storage(move |stored: StoredMessage<Mail>| {
        let (shared, shard) = (Arc::clone(&shared), shard.clone());
        async move { tokio::task::spawn_blocking(move || shared.archive(&shard, &stored)).await? }
    })
}

/// The cleanup alarm's handler and what it needs.
struct Cleanup {
    ctx: ObjectContext,
    scheduler: Scheduler,
    mail: Fanout<Mail>,
    operations: Operations,
    alarms: Rc<OnceCell<Alarms>>,
    scheduled: Rc<Cell<bool>>,
}

impl Cleanup {
    /// Trims the inbox to its newest rows, purges what is past retention,
    /// and comes back in a second while mail is owed.
    async fn run(&self) -> Result<(), HandlerError> {
        // The trim and its count commit together.
        self.ctx
            .storage()
            .transaction_sync(|sql| -> Result<(), StorageError> {
                // A range of the primary key: no sort, no scan of the kept rows.
                let trimmed = sql.execute(
                    "DELETE FROM mailbox_inbox \
                     WHERE seq <= (SELECT max(seq) FROM mailbox_inbox) - ?1",
                    &params![INBOX_KEEP_ROWS],
                )?;
                sql.execute(
                    "INSERT INTO mailbox_cleanup (slot, runs, trimmed) VALUES (0, 1, ?1) \
                     ON CONFLICT(slot) DO UPDATE SET runs = runs + 1, \
                     trimmed = trimmed + excluded.trimmed",
                    &params![i64::try_from(trimmed).unwrap_or(i64::MAX)],
                )?;
                Ok(())
            })?;
        let now = self.scheduler.now_ms();
        let before = now.saturating_sub(RETENTION_MS).max(0);
        self.operations.purge_before(before).await?;
        self.mail.purge_parked_before(before)?;
        let owed = self.mail.load()?.outbound.pending_deliveries;
        match self.alarms.get() {
            Some(alarms) if owed > 0 => {
                alarms.schedule(CLEANUP, now + CLEANUP_PERIOD_MS).await?;
            }
            _ => self.scheduled.set(false),
        }
        Ok(())
    }
}
