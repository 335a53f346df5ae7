//! Host-neutral conformance scenarios: one scenario body, two platforms.
//!
//! The same [`Fixture`] object (scheduler, operations, named alarms and a
//! log over the platform contract) runs in the embedded host and inside a
//! Cloudflare Durable Object under `workerd`. The scenarios in [`scenarios`]
//! drive it only through a [`Driver`](scenarios::Driver): send a
//! [`Command`] to an object by name, sleep, restart the platform. The
//! embedded host's test (`tests/host.rs`) and the workerd runner
//! (`durability-conformance-worker`) each implement the driver, so every
//! scenario here is checked on both platforms.
//!
//! Each scenario works on objects of its own name, so it also checks the
//! capabilities' migrations on a fresh object.

pub mod scenarios;

use std::rc::Rc;
use std::time::Duration;

use durability::fanout::{
    EnqueueOptions, EnqueueResult, Fanout, FanoutInput, FanoutMessage, Target,
};
use durability::log::{AppendRecord, Read};
use durability::retry::Delay;
use durability::{
    Alarms, DurableCall, HandlerError, Log, OperationResult, Operations, Registration, Scheduler,
};
use durability_platform::{AlarmInfo, Context, MAX_SAFE_INTEGER, StorageError, StorageExt, params};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The delay between attempts of the `flaky` operation.
pub const RETRY_DELAY_MS: u64 = 1_000;

/// The scheduler's `alarm_min_delay` in the fixture.
pub const ALARM_MIN_DELAY: Duration = Duration::from_secs(1);

/// One request to a [`Fixture`], as JSON over HTTP under workerd.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// The tables of the object's database.
    Tables,
    /// Starts operation `flaky` under `id`; it fails `fail_times` times.
    OpStart { id: String, fail_times: u32 },
    /// The state of operation `flaky` under `id`.
    OpResult { id: String },
    /// Schedules the named alarm `reminder` `in_ms` from now.
    AlarmSchedule { in_ms: i64 },
    /// Every firing of the named alarm `reminder`.
    Fired,
    /// Every delivery of the object's physical alarm, with its info.
    AlarmRuns,
    /// Makes the next `count` deliveries of the physical alarm fail.
    FailNextAlarms { count: u32 },
    /// Appends `bodies` to the log, each with the matching key if given.
    LogAppend {
        bodies: Vec<Value>,
        keys: Vec<Option<String>>,
    },
    /// Reads the log from `from`.
    LogRead { from: u64 },
    /// Commits `consumer`'s cursor at `offset`.
    LogCommit { consumer: String, offset: u64 },
    /// `consumer`'s cursor.
    LogCursor { consumer: String },
    /// A transaction that inserts a row and sets the alarm `alarm_in_ms`
    /// from now, then fails: it must leave neither.
    RolledBackWrite { alarm_in_ms: i64 },
    /// Rows the rolled-back write would have left.
    Rows,
    /// Stores and reads back `value` in an INTEGER column.
    IntegerRoundTrip { value: i64 },
    /// Stores `value` in a REAL column and reads it back as `f64`.
    RealRoundTrip { value: f64 },
    /// Enqueues one batch to both fanout targets; `a` acks every message,
    /// `b` fails a message's first `fail_b` attempts and dead-letters it
    /// (parked: the fanout has no DLQ) when `poison`.
    FanoutEnqueue { messages: Vec<FanoutSpec> },
    /// Every delivery the targets recorded, as `"<target>:<id>@<attempt>"`.
    Deliveries,
    /// Every parked dead letter, as `"<target>:<id>"`.
    Parked,
    /// Deliveries the fanout still owes.
    Owed,
    /// The object's clock.
    Now,
}

/// One fanout message of [`Command::FanoutEnqueue`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FanoutSpec {
    pub id: String,
    pub fail_b: u32,
    pub poison: bool,
}

/// The object every scenario talks to.
pub struct Fixture {
    ctx: Rc<dyn Context>,
    scheduler: Scheduler,
    operations: Operations,
    alarms: Alarms,
    log: Log<Value>,
    fanout: Fanout<FanoutSpec>,
}

/// The fixture's own tables (the capabilities create theirs).
const SCHEMA: &str = "\
CREATE TABLE IF NOT EXISTS conformance_fired (seq INTEGER PRIMARY KEY AUTOINCREMENT, at_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS conformance_alarm_runs (seq INTEGER PRIMARY KEY AUTOINCREMENT, at_ms INTEGER NOT NULL, retry_count INTEGER NOT NULL, is_retry INTEGER NOT NULL, failed INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS conformance_settings (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS conformance_rows (id INTEGER PRIMARY KEY);
CREATE TABLE IF NOT EXISTS conformance_values (id INTEGER PRIMARY KEY, i INTEGER, r REAL);
CREATE TABLE IF NOT EXISTS conformance_deliveries (delivery TEXT PRIMARY KEY);
";

impl Fixture {
    /// Builds the fixture over `ctx` (runs every migration).
    pub fn new(ctx: Rc<dyn Context>) -> Result<Self, String> {
        ctx.storage()
            .execute_script(SCHEMA)
            .map_err(|e| e.to_string())?;
        // The physical alarm may be set 1 s out (the smallest allowed), so
        // work due a second or more ahead runs from the platform's alarm,
        // which is what the scenarios observe.
        let scheduler = Scheduler::builder(Rc::clone(&ctx))
            .alarm_min_delay(ALARM_MIN_DELAY)
            .build()
            .map_err(|e| e.to_string())?;
        let operations = Operations::builder(&scheduler)
            .max_attempts(5)
            .retry_delay(Delay::Fixed {
                ms: RETRY_DELAY_MS as f64,
            })
            .handler("flaky", {
                let ctx = Rc::clone(&ctx);
                move |call: DurableCall<Value>| {
                    let ctx = Rc::clone(&ctx);
                    async move {
                        let fail_times = call.payload["fail_times"].as_u64().unwrap_or(0);
                        if u64::from(call.attempt) <= fail_times {
                            return Err(HandlerError::new(format!(
                                "attempt {} fails",
                                call.attempt
                            )));
                        }
                        Ok::<_, HandlerError>(
                            json!({ "attempt": call.attempt, "at_ms": ctx.now_ms() }),
                        )
                    }
                }
            })
            .build()
            .map_err(|e| e.to_string())?;
        let alarms = Alarms::builder(&scheduler)
            .handler("reminder", {
                let ctx = Rc::clone(&ctx);
                move |_call| {
                    let ctx = Rc::clone(&ctx);
                    async move {
                        ctx.storage().execute(
                            "INSERT INTO conformance_fired (at_ms) VALUES (?)",
                            &params![ctx.now_ms()],
                        )?;
                        Ok::<_, HandlerError>(())
                    }
                }
            })
            .build()
            .map_err(|e| e.to_string())?;
        let log = Log::builder(&scheduler)
            .build()
            .map_err(|e| e.to_string())?;
        let fanout = Fanout::<FanoutSpec>::builder(&scheduler)
            .target("a", recording_target(Rc::clone(&ctx)))
            .target("b", recording_target(Rc::clone(&ctx)))
            .max_attempts(5)
            .retry_delay(Delay::Fixed { ms: 200.0 })
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Fixture {
            ctx,
            scheduler,
            operations,
            alarms,
            log,
            fanout,
        })
    }

    /// One delivery of the physical alarm: recorded with its info, failed
    /// on request (to make the platform retry it), else run by the scheduler.
    pub async fn alarm(&self, info: AlarmInfo) -> Result<(), String> {
        let storage = self.ctx.storage();
        let now = self.ctx.now_ms();
        let fail = storage
            .transaction_sync(|sql| {
                let left: i64 = sql
                    .query_row("SELECT value FROM conformance_settings WHERE name = 'fail_alarms'", &[])?
                    .map_or(Ok(0), |row| row.get(0))?;
                if left > 0 {
                    sql.execute(
                        "UPDATE conformance_settings SET value = value - 1 WHERE name = 'fail_alarms'",
                        &[],
                    )?;
                }
                sql.execute(
                    "INSERT INTO conformance_alarm_runs (at_ms, retry_count, is_retry, failed) VALUES (?, ?, ?, ?)",
                    &params![now, info.retry_count, info.is_retry, left > 0],
                )?;
                Ok::<_, StorageError>(left > 0)
            })
            .map_err(|e| e.to_string())?;
        if fail {
            return Err("this delivery fails on request (FailNextAlarms)".into());
        }
        self.scheduler
            .alarm(Some(info))
            .await
            .map_err(|e| e.to_string())
    }

    /// Runs one command.
    pub async fn handle(&self, command: Command) -> Result<Value, String> {
        let storage = self.ctx.storage();
        let text = |e: &dyn std::fmt::Display| e.to_string();
        Ok(match command {
            Command::Tables => {
                let rows = storage
                    .query(
                        "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name",
                        &[],
                    )
                    .map_err(|e| text(&e))?;
                let names = rows
                    .iter()
                    .map(|row| row.get::<String>(0))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| text(&e))?;
                json!(names)
            }
            Command::OpStart { id, fail_times } => {
                let registration = self
                    .operations
                    .start("flaky", &id, &json!({ "fail_times": fail_times }))
                    .await
                    .map_err(|e| text(&e))?;
                json!(match registration {
                    Registration::Created => "created",
                    Registration::Existing => "existing",
                })
            }
            Command::OpResult { id } => {
                match self
                    .operations
                    .result::<Value>("flaky", &id)
                    .map_err(|e| text(&e))?
                {
                    OperationResult::NotFound => json!({ "state": "not_found" }),
                    OperationResult::Pending { attempt, .. } => {
                        json!({ "state": "pending", "attempt": attempt })
                    }
                    OperationResult::Failed { attempt, error } => {
                        json!({ "state": "failed", "attempt": attempt, "error": error.message })
                    }
                    OperationResult::Completed { result } => {
                        json!({ "state": "completed", "result": result })
                    }
                }
            }
            Command::AlarmSchedule { in_ms } => {
                self.alarms
                    .schedule("reminder", self.ctx.now_ms() + in_ms)
                    .await
                    .map_err(|e| text(&e))?;
                json!(null)
            }
            Command::Fired => {
                let rows = storage
                    .query("SELECT at_ms FROM conformance_fired ORDER BY seq", &[])
                    .map_err(|e| text(&e))?;
                let at = rows
                    .iter()
                    .map(|row| row.get::<i64>(0))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| text(&e))?;
                json!(at)
            }
            Command::AlarmRuns => {
                let rows = storage
                    .query(
                        "SELECT at_ms, retry_count, is_retry, failed FROM conformance_alarm_runs ORDER BY seq",
                        &[],
                    )
                    .map_err(|e| text(&e))?;
                let mut runs = Vec::new();
                for row in rows {
                    runs.push(json!({
                        "at_ms": row.get::<i64>(0).map_err(|e| text(&e))?,
                        "retry_count": row.get::<u32>(1).map_err(|e| text(&e))?,
                        "is_retry": row.get::<bool>(2).map_err(|e| text(&e))?,
                        "failed": row.get::<bool>(3).map_err(|e| text(&e))?,
                    }));
                }
                json!(runs)
            }
            Command::FailNextAlarms { count } => {
                storage
                    .execute(
                        "INSERT INTO conformance_settings (name, value) VALUES ('fail_alarms', ?) \
                         ON CONFLICT(name) DO UPDATE SET value = excluded.value",
                        &params![count],
                    )
                    .map_err(|e| text(&e))?;
                json!(null)
            }
            Command::LogAppend { bodies, keys } => {
                let records = bodies
                    .into_iter()
                    .enumerate()
                    .map(|(index, body)| match keys.get(index).cloned().flatten() {
                        Some(key) => AppendRecord::keyed(key, body),
                        None => AppendRecord::new(body),
                    })
                    .collect();
                let appended = self.log.append(records).await.map_err(|e| text(&e))?;
                match appended.offsets() {
                    Some(offsets) => json!({ "offsets": offsets }),
                    None => json!({ "rejected": format!("{appended:?}") }),
                }
            }
            Command::LogRead { from } => {
                let page = self
                    .log
                    .read(Read::from_offset(from))
                    .await
                    .map_err(|e| text(&e))?;
                json!({
                    "offsets": page.records.iter().map(|r| r.offset).collect::<Vec<_>>(),
                    "bodies": page.records.iter().map(|r| r.body.clone()).collect::<Vec<_>>(),
                    "next_offset": page.next_offset,
                })
            }
            Command::LogCommit { consumer, offset } => {
                self.log
                    .commit(&consumer, offset)
                    .await
                    .map_err(|e| text(&e))?;
                json!(null)
            }
            Command::LogCursor { consumer } => {
                json!(self.log.cursor(&consumer).await.map_err(|e| text(&e))?)
            }
            Command::RolledBackWrite { alarm_in_ms } => {
                let at = self.ctx.now_ms() + alarm_in_ms;
                let outcome: Result<(), BodyError> = storage
                    .transaction(move |txn| {
                        txn.execute("INSERT INTO conformance_rows (id) VALUES (1)", &[])?;
                        txn.set_alarm(at)?;
                        Err(BodyError::Failed)
                    })
                    .await;
                let outcome = match outcome {
                    Err(BodyError::Failed) => Err("the body fails after writing".to_owned()),
                    Err(BodyError::Storage(e)) => return Err(text(&e)),
                    Ok(()) => Ok(()),
                };
                json!({ "error": outcome.err() })
            }
            Command::Rows => {
                let count: i64 = storage
                    .query_row("SELECT COUNT(*) FROM conformance_rows", &[])
                    .map_err(|e| text(&e))?
                    .map_or(Ok(0), |row| row.get(0))
                    .map_err(|e| text(&e))?;
                json!(count)
            }
            Command::IntegerRoundTrip { value } => {
                let written = storage.execute(
                    "INSERT OR REPLACE INTO conformance_values (id, i) VALUES (1, ?)",
                    &params![value],
                );
                match written {
                    Err(StorageError::UnsafeInteger { value }) => json!({ "refused": value }),
                    Err(e) => return Err(text(&e)),
                    Ok(_) => {
                        let back = storage
                            .query_row(
                                "SELECT i, typeof(i) FROM conformance_values WHERE id = 1",
                                &[],
                            )
                            .map_err(|e| text(&e))?
                            .ok_or("the row is gone")?;
                        json!({
                            "stored": back.get::<durability_platform::Value>(0).map(|v| format!("{v:?}")).map_err(|e| text(&e))?,
                            "sqlite_type": back.get::<String>(1).map_err(|e| text(&e))?,
                        })
                    }
                }
            }
            Command::RealRoundTrip { value } => {
                storage
                    .execute(
                        "INSERT OR REPLACE INTO conformance_values (id, r) VALUES (2, ?)",
                        &params![value],
                    )
                    .map_err(|e| text(&e))?;
                let back = storage
                    .query_row("SELECT r FROM conformance_values WHERE id = 2", &[])
                    .map_err(|e| text(&e))?
                    .ok_or("the row is gone")?;
                json!(back.get::<f64>(0).map_err(|e| text(&e))?)
            }
            Command::FanoutEnqueue { messages } => {
                let inputs = messages
                    .into_iter()
                    .map(|spec| FanoutInput::new(spec.clone()).id(spec.id))
                    .collect();
                match self
                    .fanout
                    .enqueue(inputs, &EnqueueOptions::all())
                    .await
                    .map_err(|e| text(&e))?
                {
                    EnqueueResult::Accepted { value, .. } => json!({ "accepted": value }),
                    EnqueueResult::Rejected { error, .. } => {
                        json!({ "rejected": error.to_string() })
                    }
                }
            }
            Command::Deliveries => {
                let rows = storage
                    .query(
                        "SELECT delivery FROM conformance_deliveries ORDER BY delivery",
                        &[],
                    )
                    .map_err(|e| text(&e))?;
                let all = rows
                    .iter()
                    .map(|row| row.get::<String>(0))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| text(&e))?;
                json!(all)
            }
            Command::Parked => {
                let parked = self.fanout.parked(None, 1_000).map_err(|e| text(&e))?;
                json!(
                    parked
                        .iter()
                        .map(|p| format!("{}:{}", p.target, p.message_id))
                        .collect::<Vec<_>>()
                )
            }
            Command::Owed => json!(
                self.fanout
                    .load()
                    .map_err(|e| text(&e))?
                    .outbound
                    .pending_deliveries
            ),
            Command::Now => json!(self.ctx.now_ms()),
        })
    }
}

/// A fanout target that records each delivery it keeps; target `b` follows
/// the message's `fail_b` and `poison`.
fn recording_target(ctx: Rc<dyn Context>) -> Target<FanoutSpec> {
    Target::consumer(move |batch: Vec<FanoutMessage<FanoutSpec>>| {
        let ctx = Rc::clone(&ctx);
        async move {
            for message in &batch {
                if message.target == "b" {
                    if message.body.poison {
                        message
                            .dead_letter()
                            .await
                            .map_err(|e| HandlerError::new(e.to_string()))?;
                        continue;
                    }
                    if message.attempt <= message.body.fail_b {
                        message
                            .retry()
                            .await
                            .map_err(|e| HandlerError::new(e.to_string()))?;
                        continue;
                    }
                }
                ctx.storage().execute(
                    "INSERT OR IGNORE INTO conformance_deliveries (delivery) VALUES (?)",
                    &params![format!(
                        "{}:{}@{}",
                        message.target, message.id, message.attempt
                    )],
                )?;
            }
            Ok::<_, HandlerError>(())
        }
    })
    .ack_on_return(true)
}

/// A transaction body's own failure, or the storage's.
enum BodyError {
    Storage(StorageError),
    Failed,
}

impl From<StorageError> for BodyError {
    fn from(error: StorageError) -> Self {
        BodyError::Storage(error)
    }
}

/// Whether `value` is an integer every platform stores exactly.
pub fn is_safe_integer(value: i64) -> bool {
    (-MAX_SAFE_INTEGER..=MAX_SAFE_INTEGER).contains(&value)
}

/// How long scenarios wait for work that is due: generous, since CI shares
/// two cores with builds.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);
