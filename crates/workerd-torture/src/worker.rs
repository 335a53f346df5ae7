//! The torture worker's Durable Object: operations, named and recurring
//! alarms, a fanout to two targets and a log, over one scheduler, with
//! handlers that follow the failure script of [`protocol::fate`] and log
//! every run in the object's own database ([`protocol::SCHEMA`]).
//!
//! The attempt log is the runner's only source of what ran: a row written
//! by the handler in the same database as the capability's claim commits
//! after it (SQLite keeps a prefix of the commits), so a begun attempt
//! that the log shows was claimed durably. The worker judges nothing.

use std::rc::Rc;
use std::time::Duration;

use durability::fanout::{
    EnqueueOptions, EnqueueResult, Fanout, FanoutInput, FanoutMessage, Target,
};
use durability::log::{AppendRecord, Read};
use durability::retry::Delay;
use durability::scheduler::MIN_ALARM_MIN_DELAY;
use durability::{
    AlarmCall, Alarms, DurableCall, HandlerError, Log, MissedTicks, Operations, Recurrence,
    Registration, Scheduler,
};
use durability_cloudflare::{AlarmInfo, CloudflareContext, DurableObject, durable_object};
use durability_platform::{Context, StorageError, StorageExt, params};
use serde_json::{Value, json};
use worker::{Env, Request, Response, event};

use crate::protocol::{
    self, ALARM_NAMES, ATTEMPT_TIMEOUT, Command, LOG_CONSUMER, LOG_PAGE_RECORDS, MAX_ATTEMPTS,
    OPERATION, Outcome, Policy, RETRY_DELAY_MS, SCHEDULES, TARGETS,
};

/// One handler run as the attempt log stores it.
struct Run {
    kind: &'static str,
    key: String,
    generation: String,
    attempt: u32,
    scheduled: Option<i64>,
    missed: Option<u64>,
}

/// Writes the attempt log. Cloning is one reference-count increment.
#[derive(Clone)]
struct Recorder {
    ctx: Rc<dyn Context>,
    /// This object instance's random id: a restart makes a new instance,
    /// so two runs of one record under one instance overlapped in time.
    instance: Rc<str>,
}

impl Recorder {
    fn record(&self, run: &Run, outcome: Option<Outcome>) -> Result<(), StorageError> {
        let optional =
            |value: Option<i64>| value.map_or(durability_platform::Value::Null, Into::into);
        let missed = run
            .missed
            .map(|m| i64::try_from(m).unwrap_or(i64::MAX >> 11));
        self.ctx.storage().execute(
            "INSERT INTO torture_runs (kind, key, generation, attempt, instance, scheduled, missed, outcome, at_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            &[
                run.kind.into(),
                run.key.as_str().into(),
                run.generation.as_str().into(),
                run.attempt.into(),
                (&*self.instance).into(),
                optional(run.scheduled),
                optional(missed),
                outcome.map_or(durability_platform::Value::Null, |o| o.as_str().into()),
                self.ctx.now_ms().into(),
            ],
        )?;
        Ok(())
    }

    /// One scripted attempt: logs its start, takes its scripted time, logs
    /// its outcome (the script of `script_key`), then returns it.
    async fn attempt(&self, run: Run, script_key: &str) -> Result<(), HandlerError> {
        self.record(&run, None)?;
        self.ctx
            .sleep(Duration::from_millis(protocol::attempt_ms(
                script_key,
                run.attempt,
            )))
            .await;
        let outcome = protocol::fate(script_key, run.attempt);
        self.record(&run, Some(outcome))?;
        match outcome {
            Outcome::Ok => Ok(()),
            Outcome::Transient => Err(HandlerError::new("scripted transient failure")),
            Outcome::Permanent => Err(HandlerError::non_retryable("scripted permanent failure")),
        }
    }
}

struct Torture {
    ctx: Rc<dyn Context>,
    scheduler: Scheduler,
    operations: Operations,
    alarms: Alarms,
    fanout: Fanout<Value>,
    log: Log<Value>,
}

fn config(error: impl std::fmt::Display) -> worker::Error {
    worker::Error::RustError(error.to_string())
}

fn recurrence(spec: &protocol::ScheduleSpec) -> Result<Recurrence, durability::RecurrenceError> {
    let policy = match spec.policy {
        Policy::Skip => MissedTicks::Skip,
        Policy::RunOnce => MissedTicks::RunOnce,
        Policy::CatchUp(max) => MissedTicks::CatchUp { max },
    };
    let interval = Duration::from_millis(spec.interval_ms.unsigned_abs());
    Ok(Recurrence::every(interval)?.missed_ticks(policy))
}

impl Torture {
    fn build(ctx: Rc<dyn Context>) -> Result<Self, worker::Error> {
        ctx.storage()
            .execute_script(protocol::SCHEMA)
            .map_err(config)?;
        let mut instance = [0_u8; 8];
        ctx.random_bytes(&mut instance);
        let recorder = Recorder {
            ctx: Rc::clone(&ctx),
            instance: instance
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
                .into(),
        };
        let scheduler = Scheduler::builder(Rc::clone(&ctx))
            .alarm_min_delay(MIN_ALARM_MIN_DELAY)
            .build()
            .map_err(config)?;
        let retry = Delay::Fixed {
            ms: RETRY_DELAY_MS as f64,
        };
        let operations = Operations::builder(&scheduler)
            .max_attempts(MAX_ATTEMPTS)
            .attempt_timeout(ATTEMPT_TIMEOUT)
            .retry_delay(retry.clone())
            .handler(OPERATION, {
                let recorder = recorder.clone();
                move |call: DurableCall<Value>| {
                    let recorder = recorder.clone();
                    let run = Run {
                        kind: "op",
                        key: call.id.clone(),
                        generation: call.memo.attempt().generation.clone(),
                        attempt: call.attempt,
                        scheduled: None,
                        missed: None,
                    };
                    async move {
                        let key = run.key.clone();
                        recorder.attempt(run, &key).await?;
                        Ok::<_, HandlerError>(Value::Null)
                    }
                }
            })
            .build()
            .map_err(config)?;
        let mut alarms = Alarms::builder(&scheduler)
            .max_attempts(MAX_ATTEMPTS)
            .attempt_timeout(ATTEMPT_TIMEOUT)
            .retry_delay(retry.clone());
        let names = ALARM_NAMES
            .iter()
            .map(|name| (*name, "alarm"))
            .chain(SCHEDULES.iter().map(|spec| (spec.name, "tick")));
        for (name, kind) in names {
            let recorder = recorder.clone();
            alarms = alarms.handler(name, move |call: AlarmCall| {
                let recorder = recorder.clone();
                let script_key = format!("{}@{}", call.name, call.scheduled_time);
                let run = Run {
                    kind,
                    key: call.name,
                    generation: call.idempotency_key,
                    attempt: call.attempt,
                    scheduled: Some(call.scheduled_time),
                    missed: (kind == "tick").then_some(call.missed),
                };
                async move { recorder.attempt(run, &script_key).await }
            });
        }
        let alarms = alarms.build().map_err(config)?;
        let inbox = Target::consumer({
            let recorder = recorder.clone();
            move |batch: Vec<FanoutMessage<Value>>| {
                let recorder = recorder.clone();
                async move { inbox(&recorder, batch).await }
            }
        });
        let archive = Target::consumer({
            let recorder = recorder.clone();
            move |batch: Vec<FanoutMessage<Value>>| {
                let recorder = recorder.clone();
                async move { archive(&recorder, batch).await }
            }
        })
        .ack_on_return(true);
        let fanout = Fanout::<Value>::builder(&scheduler)
            .target(TARGETS[0], inbox)
            .target(TARGETS[1], archive)
            .max_attempts(MAX_ATTEMPTS)
            .attempt_timeout(ATTEMPT_TIMEOUT)
            .max_batch_size(10)
            .retry_delay(retry)
            .build()
            .map_err(config)?;
        let log = Log::builder(&scheduler).build().map_err(config)?;
        Ok(Torture {
            ctx,
            scheduler,
            operations,
            alarms,
            fanout,
            log,
        })
    }

    async fn handle(&self, command: Command) -> Result<Value, String> {
        let text = |e: &dyn std::fmt::Display| e.to_string();
        let storage = self.ctx.storage();
        Ok(match command {
            Command::Hello { name } => {
                storage
                    .execute(
                        "INSERT INTO torture_meta (id, name) VALUES (1, ?) \
                         ON CONFLICT(id) DO UPDATE SET name = excluded.name",
                        &params![name],
                    )
                    .map_err(|e| text(&e))?;
                for spec in &SCHEDULES {
                    let recurrence = recurrence(spec).map_err(|e| text(&e))?;
                    self.alarms
                        .schedule_recurring(spec.name, &recurrence, &())
                        .await
                        .map_err(|e| text(&e))?;
                }
                json!({ "now": self.ctx.now_ms() })
            }
            Command::OpStart { id } => {
                let registration = self
                    .operations
                    .start(OPERATION, &id, &json!({}))
                    .await
                    .map_err(|e| text(&e))?;
                json!(registration == Registration::Created)
            }
            Command::AlarmSchedule { name, at_ms } => {
                self.alarms
                    .schedule(&name, at_ms)
                    .await
                    .map_err(|e| text(&e))?;
                json!(at_ms)
            }
            Command::FanoutEnqueue { ids } => {
                let inputs = ids
                    .into_iter()
                    .map(|id| FanoutInput::new(Value::Null).id(id))
                    .collect();
                match self
                    .fanout
                    .enqueue(inputs, &EnqueueOptions::all())
                    .await
                    .map_err(|e| text(&e))?
                {
                    EnqueueResult::Accepted { .. } => json!("accepted"),
                    EnqueueResult::Rejected { error, .. } => {
                        return Err(format!("rejected: {error}"));
                    }
                }
            }
            Command::LogAppend { keys } => {
                let records = keys
                    .into_iter()
                    .map(|key| {
                        let body = json!({ "key": key });
                        AppendRecord::keyed(key, body)
                    })
                    .collect();
                let appended = self.log.append(records).await.map_err(|e| text(&e))?;
                match appended.offsets() {
                    Some(offsets) => json!(offsets),
                    None => return Err(format!("rejected: {appended:?}")),
                }
            }
            Command::LogConsume => {
                let from = self
                    .log
                    .cursor(LOG_CONSUMER)
                    .await
                    .map_err(|e| text(&e))?
                    .unwrap_or(0);
                let page = self
                    .log
                    .read(Read::from_offset(from).limit(LOG_PAGE_RECORDS))
                    .await
                    .map_err(|e| text(&e))?;
                storage
                    .transaction_sync(|sql| {
                        for record in &page.records {
                            let offset = i64::try_from(record.offset)
                                .map_err(|_| StorageError::UnsafeInteger { value: i64::MAX })?;
                            sql.execute(
                                "INSERT INTO torture_consumed (\"offset\", times) VALUES (?, 1) \
                                 ON CONFLICT(\"offset\") DO UPDATE SET times = times + 1",
                                &params![offset],
                            )?;
                        }
                        Ok::<_, StorageError>(())
                    })
                    .map_err(|e| text(&e))?;
                if page.next_offset > from {
                    self.log
                        .commit(LOG_CONSUMER, page.next_offset)
                        .await
                        .map_err(|e| text(&e))?;
                }
                json!({ "from": from, "next": page.next_offset })
            }
            Command::Pending => {
                let count = |sql: &str| -> Result<i64, String> {
                    storage
                        .query_row(sql, &[])
                        .map_err(|e| text(&e))?
                        .map_or(Ok(0), |row| row.get::<i64>(0))
                        .map_err(|e| text(&e))
                };
                let ops = count("SELECT count(*) FROM durability_calls WHERE status = 'pending'")?;
                let alarms = count(
                    "SELECT count(*) FROM durability_alarms WHERE status = 'pending' \
                     AND name NOT IN (SELECT name FROM durability_alarm_schedules)",
                )?;
                let owed = self
                    .fanout
                    .load()
                    .map_err(|e| text(&e))?
                    .outbound
                    .pending_deliveries;
                let bounds = self.log.bounds().await.map_err(|e| text(&e))?;
                let cursor = self
                    .log
                    .cursor(LOG_CONSUMER)
                    .await
                    .map_err(|e| text(&e))?
                    .unwrap_or(0);
                json!({
                    "ops": ops,
                    "alarms": alarms,
                    "owed": owed,
                    "log_end": bounds.next_offset,
                    "cursor": cursor,
                })
            }
        })
    }
}

/// The inbox: logs every message of the batch, takes a moment, then settles
/// each as scripted (ack, retry, dead letter), logging each decision before
/// it acts on it.
async fn inbox(recorder: &Recorder, batch: Vec<FanoutMessage<Value>>) -> Result<(), HandlerError> {
    let runs: Vec<Run> = batch.iter().map(delivery_run).collect();
    for run in &runs {
        recorder.record(run, None)?;
    }
    let first = runs.first().map_or("", |run| run.key.as_str());
    let attempt = runs.first().map_or(1, |run| run.attempt);
    recorder
        .ctx
        .sleep(Duration::from_millis(protocol::attempt_ms(first, attempt)))
        .await;
    for (message, run) in batch.iter().zip(&runs) {
        let outcome = protocol::fate(&run.key, run.attempt);
        recorder.record(run, Some(outcome))?;
        let settled = match outcome {
            Outcome::Ok => message.ack().await,
            Outcome::Transient => message.retry().await,
            Outcome::Permanent => message.dead_letter().await,
        };
        // A refused settlement (the attempt lost its claim) leaves the
        // delivery to its claim deadline; the checker sees its next attempt.
        if settled.is_err() {
            continue;
        }
    }
    Ok(())
}

/// The archive: acks on return; 15 % of its batches fail whole.
async fn archive(
    recorder: &Recorder,
    batch: Vec<FanoutMessage<Value>>,
) -> Result<(), HandlerError> {
    let runs: Vec<Run> = batch.iter().map(delivery_run).collect();
    for run in &runs {
        recorder.record(run, None)?;
    }
    let (first, attempt) = runs
        .first()
        .map_or(("", 1), |run| (run.generation.as_str(), run.attempt));
    recorder
        .ctx
        .sleep(Duration::from_millis(protocol::attempt_ms(first, attempt)))
        .await;
    let outcome = if protocol::archive_fails(first, attempt) {
        Outcome::Transient
    } else {
        Outcome::Ok
    };
    for run in &runs {
        recorder.record(run, Some(outcome))?;
    }
    match outcome {
        Outcome::Ok => Ok(()),
        _ => Err(HandlerError::new("scripted archive batch failure")),
    }
}

/// The attempt log's run of one fanout delivery: keyed `<message>@<target>`,
/// its generation the delivery identity.
fn delivery_run(message: &FanoutMessage<Value>) -> Run {
    Run {
        kind: if message.target == TARGETS[0] {
            "inbox"
        } else {
            "archive"
        },
        key: format!("{}@{}", message.id, message.target),
        generation: message.delivery_id.clone(),
        attempt: message.attempt,
        scheduled: None,
        missed: None,
    }
}

impl DurableObject for Torture {
    fn new(ctx: Rc<CloudflareContext>, _env: Env) -> worker::Result<Self> {
        let ctx: Rc<dyn Context> = ctx;
        Torture::build(ctx)
    }

    async fn fetch(&self, mut req: Request) -> worker::Result<Response> {
        // Parsed in Rust: JSON.parse would round integers beyond 2^53.
        let text = req.text().await?;
        let command: Command = match serde_json::from_str(&text) {
            Ok(command) => command,
            Err(error) => {
                return Response::from_json(&json!({ "error": format!("bad command: {error}") }))
                    .map(|r| r.with_status(400));
            }
        };
        match self.handle(command).await {
            Ok(value) => Response::from_json(&json!({ "ok": value })),
            Err(error) => {
                Response::from_json(&json!({ "error": error })).map(|r| r.with_status(500))
            }
        }
    }

    async fn alarm(&self, info: AlarmInfo) -> worker::Result<()> {
        self.scheduler.alarm(Some(info)).await.map_err(config)
    }
}

durable_object!(TortureObject, Torture);

#[event(fetch)]
async fn fetch(req: Request, env: Env, _ctx: worker::Context) -> worker::Result<Response> {
    let path = req.path();
    let Some(name) = path.strip_prefix("/object/").filter(|n| !n.is_empty()) else {
        return Response::error("POST /object/<name> with a JSON command", 404);
    };
    let stub = env.durable_object("TORTURE")?.get_by_name(name)?;
    stub.fetch_with_request(req).await
}
