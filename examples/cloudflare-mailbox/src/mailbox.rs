//! The mailbox Durable Object: one shard of the mailbox service, every
//! capability on one shared scheduler, the shape of `durability demo`'s shard.
//!
//! - **Fanout** delivers each accepted mail to `inbox` (a consumer writing
//!   the recipient's inbox table; mail to a `.invalid` address is
//!   dead-lettered) and to `archive` (a storage target appending the mail to
//!   the log, keyed by its message id so a repeated write is one record).
//!   Dead letters go to a DLQ table keyed by delivery, written once.
//! - The **log** is the archive, with the `digest` consumer's cursor.
//! - A **named alarm**, `cleanup`, trims the inbox to its newest rows; it is
//!   scheduled once per instance when mail is accepted.
//! - A **durable operation**, `digest`, reads the archive from the digest
//!   cursor, counts what it finds and commits the cursor; `stamp`, a trivial
//!   operation, is what the benchmark registers in bulk.
//!
//! Routes (called by the front Worker, never by the public):
//! `POST /push` (a JSON array of mails), `POST /stamp` (`{"ids": [..]}`),
//! `POST /digest` (`{"id": ".."}`), `GET /stats`.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use durability::fanout::{
    EnqueueOptions, Fanout, FanoutInput, FanoutMessage, StoredMessage, Target,
};
use durability::log::{AppendRecord, Read};
use durability::retry::Delay;
use durability::scheduler::MIN_ALARM_MIN_DELAY;
use durability::{
    AlarmCall, Alarms, DurableCall, HandlerError, Log, OperationResult, Operations, Scheduler,
};
use durability_cloudflare::{AlarmInfo, CloudflareContext, DurableObject};
use durability_platform::{Context, params};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use worker::{Env, Method, Request, Response};

/// One mail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mail {
    /// The message id: enqueueing the same id again is a no-op.
    pub id: String,
    /// The customer, which the front Worker routes by.
    pub customer: String,
    pub to: String,
    pub subject: String,
}

const INBOX: &str = "inbox";
const ARCHIVE: &str = "archive";
const CLEANUP: &str = "cleanup";
const DIGEST: &str = "digest";
const STAMP: &str = "stamp";
/// The log consumer whose cursor the digest advances.
const DIGEST_CONSUMER: &str = "digest";
/// Inbox rows kept per shard; older mail lives in the archive (the log).
const INBOX_KEEP_ROWS: i64 = 1_000;
const CLEANUP_PERIOD_MS: i64 = 1_000;
/// Most messages one target gets in one batch (one claim transaction).
const DELIVERY_BATCH: usize = 100;
/// How long `POST /digest` waits for its operation.
const DIGEST_WAIT: Duration = Duration::from_secs(10);

const SCHEMA_SQL: &str = "
    CREATE TABLE IF NOT EXISTS mailbox_inbox (
        seq INTEGER PRIMARY KEY,
        message_id TEXT NOT NULL UNIQUE,
        recipient TEXT NOT NULL,
        subject TEXT NOT NULL
    );
    CREATE TABLE IF NOT EXISTS mailbox_dlq (
        delivery_id TEXT PRIMARY KEY,
        entry TEXT NOT NULL
    );
    CREATE TABLE IF NOT EXISTS mailbox_stamps (
        id TEXT PRIMARY KEY,
        at_ms INTEGER NOT NULL
    );";

/// One mailbox shard.
pub struct Mailbox {
    ctx: Rc<CloudflareContext>,
    scheduler: Scheduler,
    mail: Fanout<Mail>,
    archive: Log<Mail>,
    operations: Operations,
    alarms: Alarms,
    cleanup_scheduled: Cell<bool>,
}

fn rust_error(error: impl std::fmt::Display) -> worker::Error {
    worker::Error::RustError(error.to_string())
}

impl DurableObject for Mailbox {
    fn new(ctx: Rc<CloudflareContext>, _env: Env) -> worker::Result<Self> {
        let dyn_ctx: Rc<dyn Context> = ctx.clone();
        dyn_ctx
            .storage()
            .execute_script(SCHEMA_SQL)
            .map_err(rust_error)?;
        let scheduler = Scheduler::builder(Rc::clone(&dyn_ctx))
            .alarm_min_delay(MIN_ALARM_MIN_DELAY)
            .build()
            .map_err(rust_error)?;
        let archive = Log::<Mail>::builder(&scheduler)
            .build()
            .map_err(rust_error)?;
        let mail = Fanout::<Mail>::builder(&scheduler)
            .target(INBOX, inbox(Rc::clone(&dyn_ctx)).ack_on_return(true))
            .target(ARCHIVE, {
                let archive = archive.clone();
                Target::storage(move |stored: StoredMessage<Mail>| {
                    let archive = archive.clone();
                    async move {
                        // Keyed by message id: a repeated write is one record.
                        let key = stored.message_id.clone();
                        archive
                            .append(vec![AppendRecord::keyed(key, stored.body)])
                            .await
                            .map_err(|e| HandlerError::new(e.to_string()))?;
                        Ok(())
                    }
                })
            })
            .dlq({
                let ctx = Rc::clone(&dyn_ctx);
                move |stored: StoredMessage<Mail>| {
                    let ctx = Rc::clone(&ctx);
                    async move {
                        let entry = serde_json::to_string(&stored)?;
                        ctx.storage().execute(
                            "INSERT OR IGNORE INTO mailbox_dlq (delivery_id, entry) VALUES (?, ?)",
                            &params![stored.id.as_str(), entry],
                        )?;
                        Ok(())
                    }
                }
            })
            .max_batch_size(DELIVERY_BATCH)
            .retry_delay(Delay::Exponential {
                initial_ms: 100.0,
                max_ms: 1_000.0,
            })
            .build()
            .map_err(rust_error)?;
        let operations = Operations::builder(&scheduler)
            .handler(DIGEST, {
                let archive = archive.clone();
                move |_call: DurableCall<Value>| {
                    let archive = archive.clone();
                    async move { digest(&archive).await }
                }
            })
            .handler(STAMP, {
                let ctx = Rc::clone(&dyn_ctx);
                move |call: DurableCall<Value>| {
                    let ctx = Rc::clone(&ctx);
                    async move {
                        ctx.storage().execute(
                            "INSERT OR IGNORE INTO mailbox_stamps (id, at_ms) VALUES (?, ?)",
                            &params![call.id.as_str(), ctx.now_ms()],
                        )?;
                        Ok::<_, HandlerError>(json!(null))
                    }
                }
            })
            .build()
            .map_err(rust_error)?;
        let alarms = Alarms::builder(&scheduler)
            .handler(CLEANUP, {
                let ctx = Rc::clone(&dyn_ctx);
                move |_call: AlarmCall| {
                    let ctx = Rc::clone(&ctx);
                    async move {
                        ctx.storage().execute(
                            "DELETE FROM mailbox_inbox WHERE seq <= (SELECT MAX(seq) FROM mailbox_inbox) - ?",
                            &params![INBOX_KEEP_ROWS],
                        )?;
                        Ok(())
                    }
                }
            })
            .build()
            .map_err(rust_error)?;
        Ok(Mailbox {
            ctx,
            scheduler,
            mail,
            archive,
            operations,
            alarms,
            cleanup_scheduled: Cell::new(false),
        })
    }

    async fn fetch(&self, mut req: Request) -> worker::Result<Response> {
        match (req.method(), req.path().as_str()) {
            (Method::Post, "/push") => {
                let mails: Vec<Mail> = req.json().await?;
                let inputs = mails
                    .into_iter()
                    .map(|mail| FanoutInput::new(mail.clone()).id(mail.id))
                    .collect();
                let result = self
                    .mail
                    .enqueue(inputs, &EnqueueOptions::all())
                    .await
                    .map_err(rust_error)?;
                if result.is_accepted() && !self.cleanup_scheduled.replace(true) {
                    let at = self.scheduler.now_ms() + CLEANUP_PERIOD_MS;
                    if let Err(error) = self.alarms.schedule(CLEANUP, at).await {
                        self.cleanup_scheduled.set(false);
                        worker::console_warn!("cannot schedule cleanup: {error}");
                    }
                }
                // The reference library's shape: {success, value | error, load}.
                Response::from_json(&result)
            }
            (Method::Post, "/stamp") => {
                let body: Value = req.json().await?;
                let ids = body["ids"].as_array().cloned().unwrap_or_default();
                let mut created = 0_u64;
                for id in ids.iter().filter_map(Value::as_str) {
                    if self
                        .operations
                        .start(STAMP, id, &json!({}))
                        .await
                        .map_err(rust_error)?
                        == durability::Registration::Created
                    {
                        created += 1;
                    }
                }
                Response::from_json(&json!({ "created": created }))
            }
            (Method::Post, "/digest") => {
                let body: Value = req.json().await?;
                let Some(id) = body["id"].as_str() else {
                    return Response::error("body: {\"id\": string} required", 400);
                };
                self.operations
                    .start(DIGEST, id, &json!({}))
                    .await
                    .map_err(rust_error)?;
                match self
                    .operations
                    .wait::<Value>(DIGEST, id, DIGEST_WAIT)
                    .await
                    .map_err(rust_error)?
                {
                    OperationResult::Completed { result } => Response::from_json(&result),
                    other => Response::from_json(&json!({ "pending": format!("{other:?}") })),
                }
            }
            (Method::Get, "/stats") => Response::from_json(&self.stats().await?),
            _ => Response::error("not found", 404),
        }
    }

    async fn alarm(&self, info: AlarmInfo) -> worker::Result<()> {
        // The one alarm runs every capability's due work.
        self.scheduler.alarm(Some(info)).await.map_err(rust_error)
    }
}

impl Mailbox {
    async fn stats(&self) -> worker::Result<Value> {
        let storage = self.ctx.storage();
        let count = |sql: &str| -> worker::Result<i64> {
            storage
                .query_row(sql, &[])
                .map_err(rust_error)?
                .map_or(Ok(0), |row| row.get(0))
                .map_err(rust_error)
        };
        let bounds = self.archive.bounds().await.map_err(rust_error)?;
        Ok(json!({
            "inbox": count("SELECT COUNT(*) FROM mailbox_inbox")?,
            "dead_letters": count("SELECT COUNT(*) FROM mailbox_dlq")?,
            "stamps": count("SELECT COUNT(*) FROM mailbox_stamps")?,
            "archived": bounds,
            "owed": self.mail.load().map_err(rust_error)?.outbound.pending_deliveries,
        }))
    }
}

/// The inbox target: one row per mail, dead letters for `.invalid` addresses.
fn inbox(ctx: Rc<dyn Context>) -> Target<Mail> {
    Target::consumer(move |batch: Vec<FanoutMessage<Mail>>| {
        let ctx = Rc::clone(&ctx);
        async move {
            for message in &batch {
                if message.body.to.ends_with(".invalid") {
                    // Settled explicitly; the rest are acked on return.
                    let _ = message.dead_letter().await;
                    continue;
                }
                ctx.storage().execute(
                    "INSERT OR IGNORE INTO mailbox_inbox (message_id, recipient, subject) VALUES (?, ?, ?)",
                    &params![message.id.as_str(), message.body.to.as_str(), message.body.subject.as_str()],
                )?;
            }
            Ok::<_, HandlerError>(())
        }
    })
}

/// Reads the archive from the digest cursor, counts it and commits the
/// cursor: a retried digest starts where the last one committed.
async fn digest(archive: &Log<Mail>) -> Result<Value, HandlerError> {
    let from = archive
        .cursor(DIGEST_CONSUMER)
        .await
        .map_err(|e| HandlerError::new(e.to_string()))?;
    let page = archive
        .read(Read::from_offset(from.unwrap_or(0)))
        .await
        .map_err(|e| HandlerError::new(e.to_string()))?;
    archive
        .commit(DIGEST_CONSUMER, page.next_offset)
        .await
        .map_err(|e| HandlerError::new(e.to_string()))?;
    Ok(json!({ "read": page.records.len(), "next_offset": page.next_offset, "lag": page.lag }))
}
