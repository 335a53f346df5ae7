//! `fanout`: durable batch acceptance and delivery to two targets, against a
//! floor of raw rusqlite doing the same row writes.
//!
//! One object on the real host (one executor thread, real time, the
//! default durability mode) owns a fanout with two consumer targets that ack every
//! message at once. A producer enqueues the messages in calls of
//! [`ENQUEUE_BATCH`] while the object delivers them in batches of
//! [`DELIVERY_BATCH`]; the run ends when every (message, target) was acked.
//! It runs with `ack_on_return` (one commit acks a whole batch; 100,000
//! messages) and without (the consumer acks each message, one commit each;
//! 20,000 messages, as each costs a commit of its own). The ack-each part
//! runs again with the host in FULL mode (a sync per commit): the gain of
//! group commit where every delivery commits on its own.
//!
//! Each part runs three rounds, the floor and the fanout taking turns, and
//! keeps each one's best round: a machine busy with something else for a
//! while then slows a round, not the figure.
//!
//! The floor does the fanout's row writes and reads in the same
//! transactions (a batch's manifests and delivery rows, a claim per batch,
//! the acks) on one bare connection with the fanout's own schema, and
//! nothing else: no alarm, no scheduler, no host. `floor_ratio` is the
//! fanout's deliveries/s divided by the floor's.

use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use durability::fanout::{EnqueueOptions, Fanout, FanoutInput, FanoutMessage, Target};
use durability::memo::MEMO_MIGRATIONS;
use durability::migrations::FANOUT_MIGRATIONS;
use durability::{HandlerError, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext, Stub};
use rusqlite::{Connection, OptionalExtension, params};

use super::modes::Mode;
use super::{BenchEnv, BenchError, Figure, Latency, Measurement, ScenarioReport};

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "fanout";

/// Messages per `enqueue` call.
pub const ENQUEUE_BATCH: u64 = 100;
/// Most messages per delivery batch (the fanout's `max_batch_size`).
pub const DELIVERY_BATCH: usize = 100;
/// The two targets every message goes to.
pub const TARGETS: [&str; 2] = ["inbox", "audit"];
/// The longest a run waits for its last delivery before it gives up.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(1_800);
/// How often the producer looks whether everything was delivered.
const DRAIN_POLL: Duration = Duration::from_millis(2);

/// A body of a typical small message (about 64 bytes stored).
pub fn body(n: u64) -> String {
    format!("message {n:>10} to a mailbox, about sixty bytes")
}

/// The benchmark's object: a scheduler and its fanout. Its alarm runs the
/// scheduler, as an application object's does.
pub struct MailObject {
    scheduler: Scheduler,
    /// The object's fanout.
    pub fanout: Fanout<String>,
}

impl DurableObject for MailObject {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        self.scheduler
            .alarm(Some(info))
            .await
            .map_err(|e| Box::new(e) as BoxError)
    }
}

/// How the object's targets behave.
#[derive(Debug, Clone)]
pub struct MailConfig {
    /// Ack on return (one commit per batch) or ack each message.
    pub ack_on_return: bool,
    /// The configured targets (a subset of a previous configuration pauses
    /// the others).
    pub targets: Vec<&'static str>,
    /// The fanout's batch delay.
    pub batch_delay: Duration,
    /// Counts every acked delivery.
    pub delivered: Arc<AtomicU64>,
}

impl MailObject {
    /// Builds the object's scheduler and fanout: consumers that ack at once.
    pub fn build(ctx: ObjectContext, config: &MailConfig) -> Result<MailObject, BoxError> {
        let scheduler = Scheduler::new(ctx.into_dyn())?;
        let mut builder = Fanout::<String>::builder(&scheduler)
            .max_batch_size(DELIVERY_BATCH)
            .batch_delay(config.batch_delay);
        for id in &config.targets {
            let delivered = Arc::clone(&config.delivered);
            let target = if config.ack_on_return {
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    delivered.fetch_add(count(batch.len()), Ordering::Relaxed);
                    async { Ok::<_, HandlerError>(()) }
                })
                .ack_on_return(true)
            } else {
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    let delivered = Arc::clone(&delivered);
                    async move {
                        for message in &batch {
                            message
                                .ack()
                                .await
                                .map_err(|e| HandlerError::new(e.to_string()))?;
                            delivered.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok::<_, HandlerError>(())
                    }
                })
            };
            builder = builder.target(*id, target);
        }
        let fanout = builder.build()?;
        Ok(MailObject { scheduler, fanout })
    }
}

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn task_error(error: impl std::fmt::Display) -> BenchError {
    BenchError::Task {
        message: error.to_string(),
    }
}

/// Enqueues messages `first..first + n` (ids `m<n>`) to `targets` in one
/// call; fails unless accepted.
pub async fn enqueue(
    stub: &Stub<MailObject>,
    first: u64,
    n: u64,
    targets: Option<Vec<String>>,
) -> Result<(), BenchError> {
    let accepted = stub
        .call(move |object: Rc<MailObject>| async move {
            let batch = (first..first + n)
                .map(|i| FanoutInput::new(body(i)).id(format!("m{i}")))
                .collect();
            let options = EnqueueOptions { targets };
            match object.fanout.enqueue(batch, &options).await {
                Ok(result) => result.accepted().map(|_| ()).map_err(|e| e.to_string()),
                Err(error) => Err(error.to_string()),
            }
        })
        .await?;
    accepted.map_err(task_error)
}

/// What one produce-and-drain run measured.
pub struct Drained {
    /// The latency of each enqueue call.
    pub enqueue_latency: Latency,
    /// From the first enqueue call to the return of the last one.
    pub enqueue_elapsed: Duration,
    /// From the first enqueue call to the last ack.
    pub elapsed: Duration,
}

/// Produces `messages` in calls of [`ENQUEUE_BATCH`] to `targets` (all when
/// `None`) and waits until `deliveries` more were acked.
#[allow(clippy::too_many_arguments)] // one call site per scenario, each argument named there
pub async fn produce_and_drain(
    env: &BenchEnv,
    phase: &str,
    stub: &Stub<MailObject>,
    delivered: &AtomicU64,
    first_id: u64,
    messages: u64,
    deliveries: u64,
    targets: Option<Vec<String>>,
) -> Result<Drained, BenchError> {
    let progress = env.progress(phase, deliveries);
    let mut latency = Latency::new()?;
    let before = delivered.load(Ordering::Relaxed);
    let started = Instant::now();
    let mut next = first_id;
    while next < first_id + messages {
        let n = ENQUEUE_BATCH.min(first_id + messages - next);
        let call = Instant::now();
        enqueue(stub, next, n, targets.clone()).await?;
        latency.record(call.elapsed());
        next += n;
        progress.set_position(delivered.load(Ordering::Relaxed) - before);
    }
    let enqueue_elapsed = started.elapsed();
    while delivered.load(Ordering::Relaxed) - before < deliveries {
        if started.elapsed() > DRAIN_TIMEOUT {
            return Err(task_error(format!(
                "{phase}: only {} of {deliveries} deliveries after {} s",
                delivered.load(Ordering::Relaxed) - before,
                DRAIN_TIMEOUT.as_secs()
            )));
        }
        tokio::time::sleep(DRAIN_POLL).await;
        progress.set_position(delivered.load(Ordering::Relaxed) - before);
    }
    let elapsed = started.elapsed();
    progress.finish_and_clear();
    Ok(Drained {
        enqueue_latency: latency,
        enqueue_elapsed,
        elapsed,
    })
}

/// Runs the `fanout` scenario.
pub fn run(env: &BenchEnv) -> Result<ScenarioReport, BenchError> {
    let rounds = env.size(3, 1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| BenchError::Runtime { source })?;
    let mut report = ScenarioReport {
        scenario: NAME,
        quick: env.quick(),
        headline: "ack-on-return/deliveries".into(),
        measurements: Vec::new(),
        figures: Vec::new(),
        notes: vec![
            format!(
                "{} targets; enqueue calls of {ENQUEUE_BATCH}, delivery batches of {DELIVERY_BATCH}; one object, host in its default mode (group commit with output gates); ack-each-full: the host with synchronous=FULL",
                TARGETS.len()
            ),
            "deliveries: (message, target) pairs acked per second, from the first enqueue to the last ack; enqueue: one call of 100 messages, as its caller waits for it".into(),
            "÷ floor: deliveries/s divided by raw rusqlite doing the same row writes in the same transactions (floor/…)".into(),
            format!(
                "best of {rounds} rounds each, floor and fanout taking turns; ack-each commits once per delivery, so it runs a fifth of the messages"
            ),
        ],
    };
    let mut ack_each_rates = Vec::new();
    for (ack_on_return, host_mode) in [
        (true, Mode::DEFAULT),
        (false, Mode::DEFAULT),
        (false, Mode::FULL),
    ] {
        let (mode, messages) = match (ack_on_return, host_mode.key) {
            (true, _) => ("ack-on-return", env.size(100_000, 2_000)),
            (false, "full") => ("ack-each-full", env.size(20_000, 500)),
            (false, _) => ("ack-each", env.size(20_000, 500)),
        };
        let deliveries = messages * count(TARGETS.len());
        let mut best_floor: Option<Measurement> = None;
        let mut best_fanout: Option<Drained> = None;
        for _ in 0..rounds {
            let floor = floor(env, mode, messages, ack_on_return)?;
            if best_floor
                .as_ref()
                .is_none_or(|best| floor.elapsed < best.elapsed)
            {
                best_floor = Some(floor);
            }
            let drained =
                runtime.block_on(fanout_run(env, mode, messages, ack_on_return, host_mode))?;
            if best_fanout
                .as_ref()
                .is_none_or(|best| drained.elapsed < best.elapsed)
            {
                best_fanout = Some(drained);
            }
        }
        let (Some(floor), Some(drained)) = (best_floor, best_fanout) else {
            continue;
        };
        let mut delivered = Measurement::new(
            format!("{mode}/deliveries"),
            "1 (message, target) acked",
            deliveries,
            drained.elapsed,
            &Latency::new()?,
        )
        .with("messages", messages);
        delivered.compare_with_floor(&floor);
        let enqueue = Measurement::new(
            format!("{mode}/enqueue"),
            format!("1 enqueue call of {ENQUEUE_BATCH} messages"),
            drained.enqueue_latency.len(),
            drained.enqueue_elapsed,
            &drained.enqueue_latency,
        );
        if !ack_on_return {
            ack_each_rates.push(delivered.ops_per_sec());
        }
        report.measurements.push(delivered);
        report.measurements.push(enqueue);
        report.measurements.push(floor);
    }
    if let [default, full] = ack_each_rates[..]
        && full > 0.0
    {
        report.figures.push(Figure {
            key: "ack_each_gain_over_full",
            label: "ack-each deliveries/s, default mode ÷ FULL".into(),
            value: default / full,
            unit: "×",
        });
    }
    Ok(report)
}

async fn fanout_run(
    env: &BenchEnv,
    mode: &str,
    messages: u64,
    ack_on_return: bool,
    host_mode: Mode,
) -> Result<Drained, BenchError> {
    let dir = env.subdir(&format!("fanout-{mode}"))?;
    let host = host_mode.builder(&dir).threads(1).build()?;
    let delivered = Arc::new(AtomicU64::new(0));
    let config = MailConfig {
        ack_on_return,
        targets: TARGETS.to_vec(),
        batch_delay: Duration::ZERO,
        delivered: Arc::clone(&delivered),
    };
    let objects = host.namespace("mail", move |ctx| MailObject::build(ctx, &config))?;
    let stub = objects.stub("mailbox")?;
    let outcome = produce_and_drain(
        env,
        &format!("fanout {mode}"),
        &stub,
        &delivered,
        0,
        messages,
        messages * count(TARGETS.len()),
        None,
    )
    .await;
    host.shutdown().await;
    outcome
}

/// The floor: the fanout's row writes and reads, in the fanout's
/// transactions, on one bare connection with the fanout's own schema.
fn floor(
    env: &BenchEnv,
    mode: &str,
    messages: u64,
    ack_on_return: bool,
) -> Result<Measurement, BenchError> {
    let sqlite = |what| move |source| BenchError::Sqlite { what, source };
    let dir = env.subdir(&format!("fanout-floor-{mode}"))?;
    let mut conn = Connection::open(dir.join("floor.sqlite"))
        .map_err(sqlite("cannot open the floor database"))?;
    conn.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get::<_, String>(0))
        .map_err(sqlite("cannot switch the floor database to WAL"))?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(sqlite("cannot set synchronous on the floor database"))?;
    for migration in FANOUT_MIGRATIONS.iter().chain(MEMO_MIGRATIONS) {
        conn.execute_batch(migration.up)
            .map_err(sqlite("cannot create the floor schema"))?;
    }
    let deliveries = messages * count(TARGETS.len());
    let progress = env.progress(&format!("floor {mode}"), deliveries);
    let started = Instant::now();
    let mut next = 0;
    while next < messages {
        let n = ENQUEUE_BATCH.min(messages - next);
        floor_batch(&mut conn, next, n, ack_on_return)
            .map_err(sqlite("a floor transaction failed"))?;
        next += n;
        progress.set_position(next * count(TARGETS.len()));
    }
    let elapsed = started.elapsed();
    progress.finish_and_clear();
    Ok(Measurement::new(
        format!("floor/{mode}"),
        "1 (message, target): its rows, raw rusqlite",
        deliveries,
        elapsed,
        &Latency::new()?,
    ))
}

const READ_MANIFEST: &str = "SELECT key, id, payload, targets, remaining, seq, created_at, generation_id \
     FROM durability_fanout_messages WHERE key = ?1";
const NEXT_SEQ: &str =
    "UPDATE durability_fanout_seq SET next_seq = next_seq + 1 WHERE id = 1 RETURNING next_seq - 1";
const INSERT_MANIFEST: &str = "INSERT INTO durability_fanout_messages \
     (key, id, payload, targets, remaining, seq, created_at, generation_id) \
     VALUES (?1, ?1, ?2, ?3, ?4, ?5, ?6, ?7)";
const INSERT_DELIVERY: &str = "INSERT INTO durability_fanout_deliveries \
     (id, message_key, target_id, seq, status, phase, attempt, next_attempt_at, created_at, generation_id) \
     VALUES (?1, ?2, ?3, ?4, 'pending', 'delivery', 0, ?5, ?5, ?6) ON CONFLICT(id) DO NOTHING";
const FIRST_DUE: &str = "SELECT id, message_key, generation_id FROM durability_fanout_deliveries \
     WHERE target_id = ?1 AND phase = 'delivery' AND attempt = 0 AND next_attempt_at <= ?2 \
     ORDER BY next_attempt_at, seq LIMIT ?3";
const CLAIM: &str = "UPDATE durability_fanout_deliveries SET attempt = attempt + 1, next_attempt_at = ?1 \
     WHERE id = ?2 AND generation_id = ?3 AND status = 'pending' AND attempt < 5 RETURNING attempt";
const DELETE_DELIVERY: &str = "DELETE FROM durability_fanout_deliveries \
     WHERE id = ?1 AND generation_id = ?2 AND status = 'pending' AND attempt = 1";
const DELETE_MEMOS: &str = "DELETE FROM durability_memos WHERE record_table = 'durability_fanout_deliveries' AND record_key = ?1";
const RELEASE_MANIFEST: &str = "UPDATE durability_fanout_messages SET remaining = remaining - 1 \
     WHERE key = ?1 RETURNING remaining";
const DELETE_MANIFEST: &str = "DELETE FROM durability_fanout_messages WHERE key = ?1";

/// One enqueue transaction of `n` messages, then for each target one claim
/// transaction and its acks (one transaction, or one per message).
fn floor_batch(
    conn: &mut Connection,
    first: u64,
    n: u64,
    ack_on_return: bool,
) -> rusqlite::Result<()> {
    let now = i64::try_from(first).unwrap_or(0);
    let targets_json = serde_json::to_string(&TARGETS).unwrap_or_default();
    let tx = conn.transaction()?;
    for i in first..first + n {
        let key = format!("m{i}");
        let existing: Option<String> = tx
            .prepare_cached(READ_MANIFEST)?
            .query_row(params![key], |row| row.get(1))
            .optional()?;
        if existing.is_some() {
            continue;
        }
        let seq: i64 = tx
            .prepare_cached(NEXT_SEQ)?
            .query_row([], |row| row.get(0))?;
        let generation = format!("{i:032x}");
        tx.prepare_cached(INSERT_MANIFEST)?.execute(params![
            key,
            format!("{{\"kind\":\"value\",\"value\":\"{}\"}}", body(i)),
            targets_json,
            2,
            seq,
            now,
            generation
        ])?;
        for target in TARGETS {
            let id = serde_json::to_string(&[key.as_str(), target]).unwrap_or_default();
            tx.prepare_cached(INSERT_DELIVERY)?
                .execute(params![id, key, target, seq, now, generation])?;
        }
    }
    tx.commit()?;
    for target in TARGETS {
        let due: Vec<(String, String, String)> = conn
            .prepare_cached(FIRST_DUE)?
            .query_map(
                params![target, now, i64::try_from(DELIVERY_BATCH).unwrap_or(100)],
                |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)),
            )?
            .collect::<rusqlite::Result<_>>()?;
        let tx = conn.transaction()?;
        for (id, key, generation) in &due {
            tx.prepare_cached(READ_MANIFEST)?
                .query_row(params![key], |row| row.get::<_, String>(1))?;
            tx.prepare_cached(CLAIM)?
                .query_row(params![now + 300_000, id, generation], |row| {
                    row.get::<_, i64>(0)
                })?;
        }
        tx.commit()?;
        if ack_on_return {
            let tx = conn.transaction()?;
            for (id, key, generation) in &due {
                ack(&tx, id, key, generation)?;
            }
            tx.commit()?;
        } else {
            for (id, key, generation) in &due {
                let tx = conn.transaction()?;
                ack(&tx, id, key, generation)?;
                tx.commit()?;
            }
        }
    }
    Ok(())
}

fn ack(conn: &Connection, id: &str, key: &str, generation: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(DELETE_DELIVERY)?
        .execute(params![id, generation])?;
    conn.prepare_cached(DELETE_MEMOS)?.execute(params![id])?;
    let remaining: i64 = conn
        .prepare_cached(RELEASE_MANIFEST)?
        .query_row(params![key], |row| row.get(0))?;
    if remaining <= 0 {
        conn.prepare_cached(DELETE_MANIFEST)?
            .execute(params![key])?;
    }
    Ok(())
}
