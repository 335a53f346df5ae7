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
//! A third part, `ack-on-return-failing`, is the first with one message in
//! 100 failing its first attempt (the consumer retries it; it is acked on
//! its second): `failing_ratio` is its deliveries/s ÷ the clean run's.
//!
//! A fourth part, `ack-on-return-limited` (issue 14), is the clean run
//! with the `audit` target rate limited to [`LIMITED_PER_SECOND`]
//! deliveries a second (flow control) and `inbox` unlimited; it ends when
//! `inbox` has every message. `limited_ratio` is inbox's deliveries/s ÷
//! the clean run's per-target rate (its deliveries/s ÷ 2): a limited
//! target must not slow another (goal ≥ 0.9). `limited_rate` is what
//! `audit` got meanwhile (at most its limit, plus its first burst).
//!
//! Each part runs three rounds, the floors and the fanout taking turns, and
//! keeps each one's best round: a machine busy with something else for a
//! while then slows a round, not the figure.
//!
//! Two floors, each on one bare connection with nothing else (no alarm, no
//! scheduler, no host), doing a layout's row writes and reads in the
//! fanout's transactions:
//! - `floor/<mode>` (the cursor layout of migration 0013): per enqueue call
//!   its messages, a span per target and the sequence; per batch and
//!   target a cursor claim and a cursor advance with the range delete (and
//!   with ack-each, a tombstone per ack). `floor_ratio` is against it.
//! - `old-floor/<mode>` (the layout before 0013, migrations 0005 and 0009):
//!   a batch's manifests and delivery rows, a claim per row, a delete and a
//!   manifest update per ack. `old_layout_ratio` is against it.
//!
//! `rows_per_delivery` is SQLite's own count of rows inserted, updated and
//! deleted on the object's connection (`total_changes()`, read before and
//! after the run), divided by the deliveries: every write of the run, the
//! host's alarm row included. It counts table rows, not index entries.

use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use durability::fanout::{EnqueueOptions, Fanout, FanoutInput, FanoutMessage, FlowControl, Target};
use durability::memo::MEMO_MIGRATIONS;
use durability::migrations::FANOUT_MIGRATIONS;
use durability::platform::Context;
use durability::retry::Delay;
use durability::{HandlerError, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext, Stub};
use rusqlite::{Connection, OptionalExtension, params};

use super::{BenchEnv, BenchError, Figure, Latency, Measurement, ScenarioReport};
use crate::modes::Mode;

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "fanout";

/// Messages per `enqueue` call.
pub const ENQUEUE_BATCH: u64 = 100;
/// Most messages per delivery batch (the fanout's `max_batch_size`).
pub const DELIVERY_BATCH: usize = 100;
/// In the failing run, one message in this many fails its first attempt.
pub const FAIL_ONE_IN: u64 = 100;
/// The two targets every message goes to.
pub const TARGETS: [&str; 2] = ["inbox", "audit"];
/// The rate limit of `audit` in the limited run (deliveries a second).
pub const LIMITED_PER_SECOND: usize = 1_000;
/// The limited target of the limited run.
pub const LIMITED_TARGET: &str = "audit";
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
    ctx: Rc<dyn Context>,
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
    /// Every message whose number is a multiple of this fails its first
    /// attempt (the consumer retries it). `None`: none fails.
    pub fail_one_in: Option<u64>,
    /// Rate limits [`LIMITED_TARGET`] to [`LIMITED_PER_SECOND`] and counts
    /// its deliveries here instead of in `delivered`. `None`: no limit.
    pub limited: Option<Arc<AtomicU64>>,
}

/// The retry delay of the failing run: short, so the run measures the cost
/// of the failures rather than the wait for the last retry.
const FAILING_RETRY_DELAY_MS: f64 = 10.0;

/// The message number of a benchmark id `m<n>`.
fn number(id: &str) -> u64 {
    id.trim_start_matches('m').parse().unwrap_or(1)
}

impl MailObject {
    /// Builds the object's scheduler and fanout: consumers that ack at once.
    pub fn build(ctx: ObjectContext, config: &MailConfig) -> Result<MailObject, BoxError> {
        let ctx = ctx.into_dyn();
        let scheduler = Scheduler::new(Rc::clone(&ctx))?;
        let mut builder = Fanout::<String>::builder(&scheduler)
            .max_batch_size(DELIVERY_BATCH)
            .batch_delay(config.batch_delay);
        if config.fail_one_in.is_some() {
            builder = builder.retry_delay(Delay::Fixed {
                ms: FAILING_RETRY_DELAY_MS,
            });
        }
        for id in &config.targets {
            let delivered = match &config.limited {
                Some(limited) if *id == LIMITED_TARGET => {
                    builder = builder.flow_control(
                        *id,
                        FlowControl::new().rate_limit(LIMITED_PER_SECOND, Duration::from_secs(1)),
                    );
                    Arc::clone(limited)
                }
                _ => Arc::clone(&config.delivered),
            };
            let fail_one_in = config.fail_one_in;
            let target = if config.ack_on_return {
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    let mut acked = batch.len();
                    if let Some(every) = fail_one_in {
                        for message in &batch {
                            if message.attempt == 1 && number(&message.id).is_multiple_of(every) {
                                // Started at once; an explicit retry wins
                                // over the ack on return.
                                drop(message.retry());
                                acked -= 1;
                            }
                        }
                    }
                    delivered.fetch_add(count(acked), Ordering::Relaxed);
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
        Ok(MailObject {
            ctx,
            scheduler,
            fanout,
        })
    }
}

/// Rows inserted, updated and deleted on the object's connection so far.
async fn total_changes(stub: &Stub<MailObject>) -> Result<u64, BenchError> {
    let changes = stub
        .call(|object: Rc<MailObject>| async move {
            object
                .ctx
                .storage()
                .query_row("SELECT total_changes()", &[])
                .map_err(|e| e.to_string())?
                .map_or(Ok(0), |row| row.get::<u64>(0).map_err(|e| e.to_string()))
        })
        .await?;
    changes.map_err(task_error)
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
    /// Rows written on the object's connection during the run, when
    /// measured.
    pub rows_written: Option<u64>,
    /// In the limited run, what the limited target had got when the other
    /// one had every message.
    pub limited_delivered: Option<u64>,
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
        rows_written: None,
        limited_delivered: None,
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
    let mut clean_rate = None;
    let mut ack_each_rates = Vec::new();
    for (mode, ack_on_return, fail_one_in, host_mode) in [
        ("ack-on-return", true, None, Mode::DEFAULT),
        ("ack-each", false, None, Mode::DEFAULT),
        ("ack-each-full", false, None, Mode::FULL),
        (
            "ack-on-return-failing",
            true,
            Some(FAIL_ONE_IN),
            Mode::DEFAULT,
        ),
    ] {
        if mode == "ack-each" {
            // Right after the clean run it compares with.
            let messages = env.size(100_000, 2_000);
            report
                .measurements
                .push(limited_part(env, &runtime, rounds, messages, clean_rate)?);
        }
        let messages = if ack_on_return {
            env.size(100_000, 2_000)
        } else {
            env.size(20_000, 500)
        };
        let deliveries = messages * count(TARGETS.len());
        let mut best_floor: Option<Measurement> = None;
        let mut best_old_floor: Option<Measurement> = None;
        let mut best_fanout: Option<Drained> = None;
        let keep = |best: &mut Option<Measurement>, round: Measurement| {
            if best.as_ref().is_none_or(|b| round.elapsed < b.elapsed) {
                *best = Some(round);
            }
        };
        for _ in 0..rounds {
            // The failing run compares with the clean one; its floors are
            // the clean run's.
            if fail_one_in.is_none() {
                keep(&mut best_floor, floor(env, mode, messages, ack_on_return)?);
                keep(
                    &mut best_old_floor,
                    old_floor(env, mode, messages, ack_on_return)?,
                );
            }
            let drained = runtime.block_on(fanout_run(
                env,
                mode,
                messages,
                ack_on_return,
                fail_one_in,
                host_mode,
            ))?;
            if best_fanout
                .as_ref()
                .is_none_or(|best| drained.elapsed < best.elapsed)
            {
                best_fanout = Some(drained);
            }
        }
        let Some(drained) = best_fanout else {
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
        if let Some(rows) = drained.rows_written {
            delivered = delivered.with("rows_per_delivery", rows as f64 / deliveries as f64);
        }
        let rate = delivered.ops_per_sec();
        if let Some(every) = fail_one_in {
            delivered = delivered.with("failing_one_in", every);
            if let Some(clean) = clean_rate {
                delivered = delivered.with("failing_ratio", rate / clean);
            }
        } else {
            if ack_on_return {
                clean_rate = Some(rate);
            }
            if let Some(floor) = &best_floor {
                delivered.compare_with_floor(floor);
            }
            if let Some(old) = &best_old_floor
                && old.ops_per_sec() > 0.0
            {
                delivered = delivered
                    .with("old_layout_ratio", rate / old.ops_per_sec())
                    .with("old_floor", old.name.clone());
            }
        }
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
        report.measurements.extend(best_floor);
        report.measurements.extend(best_old_floor);
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

/// The limited part: best of `rounds`, `inbox`'s rate against the clean
/// run's per-target rate (`clean_rate` is its deliveries/s, both targets).
fn limited_part(
    env: &BenchEnv,
    runtime: &tokio::runtime::Runtime,
    rounds: u64,
    messages: u64,
    clean_rate: Option<f64>,
) -> Result<Measurement, BenchError> {
    let mode = "ack-on-return-limited";
    let mut best: Option<Drained> = None;
    for _ in 0..rounds {
        let limited = Arc::new(AtomicU64::new(0));
        let drained = runtime.block_on(fanout_run_with(
            env,
            mode,
            messages,
            true,
            None,
            // The host mode of the clean run it compares with.
            Mode::DEFAULT,
            Some(limited),
        ))?;
        if best
            .as_ref()
            .is_none_or(|best| drained.elapsed < best.elapsed)
        {
            best = Some(drained);
        }
    }
    let Some(drained) = best else {
        return Err(task_error("the limited run ran no round"));
    };
    let limited = drained.limited_delivered.unwrap_or(0);
    let mut measurement = Measurement::new(
        format!("{mode}/unlimited-deliveries"),
        "1 message acked by the unlimited target (inbox)",
        messages,
        drained.elapsed,
        &Latency::new()?,
    )
    .with("messages", messages)
    .with("limited_target", LIMITED_TARGET)
    .with("limited_per_second", count(LIMITED_PER_SECOND));
    let rate = measurement.ops_per_sec();
    let seconds = drained.elapsed.as_secs_f64();
    if seconds > 0.0 {
        measurement = measurement.with("limited_rate", limited as f64 / seconds);
    }
    if let Some(clean) = clean_rate.filter(|clean| *clean > 0.0) {
        let per_target = clean / TARGETS.len() as f64;
        measurement = measurement
            .with("clean_per_target_rate", per_target)
            .with("limited_ratio", rate / per_target);
    }
    Ok(measurement)
}

async fn fanout_run(
    env: &BenchEnv,
    mode: &str,
    messages: u64,
    ack_on_return: bool,
    fail_one_in: Option<u64>,
    host_mode: Mode,
) -> Result<Drained, BenchError> {
    fanout_run_with(
        env,
        mode,
        messages,
        ack_on_return,
        fail_one_in,
        host_mode,
        None,
    )
    .await
}

/// One run; with `limited`, [`LIMITED_TARGET`] is rate limited, counted
/// there, and the run ends when the other target has every message.
async fn fanout_run_with(
    env: &BenchEnv,
    mode: &str,
    messages: u64,
    ack_on_return: bool,
    fail_one_in: Option<u64>,
    host_mode: Mode,
    limited: Option<Arc<AtomicU64>>,
) -> Result<Drained, BenchError> {
    let dir = env.subdir(&format!("fanout-{mode}"))?;
    let host = host_mode.builder(&dir).threads(1).build()?;
    let delivered = Arc::new(AtomicU64::new(0));
    let awaited = if limited.is_some() {
        messages * count(TARGETS.len() - 1)
    } else {
        messages * count(TARGETS.len())
    };
    let config = MailConfig {
        ack_on_return,
        targets: TARGETS.to_vec(),
        batch_delay: Duration::ZERO,
        delivered: Arc::clone(&delivered),
        fail_one_in,
        limited: limited.clone(),
    };
    let objects = host.namespace("mail", move |ctx| MailObject::build(ctx, &config))?;
    let stub = objects.stub("mailbox")?;
    let before = total_changes(&stub).await;
    let outcome = produce_and_drain(
        env,
        &format!("fanout {mode}"),
        &stub,
        &delivered,
        0,
        messages,
        awaited,
        None,
    )
    .await;
    let limited_delivered = limited.map(|limited| limited.load(Ordering::Relaxed));
    let after = total_changes(&stub).await;
    host.shutdown().await;
    let mut drained = outcome?;
    drained.rows_written = Some(after?.saturating_sub(before?));
    drained.limited_delivered = limited_delivered;
    Ok(drained)
}

/// One floor transaction group: an enqueue call of `n` messages from
/// `first`, then each target's claim and acks.
type FloorBatch = fn(&mut Connection, u64, u64, bool) -> rusqlite::Result<()>;

/// The floor of the cursor layout (migration 0013, the fanout's own).
fn floor(
    env: &BenchEnv,
    mode: &str,
    messages: u64,
    ack_on_return: bool,
) -> Result<Measurement, BenchError> {
    layout_floor(
        env,
        "floor",
        mode,
        messages,
        ack_on_return,
        FANOUT_MIGRATIONS,
        cursor_floor_batch,
    )
}

/// The floor of the layout before 0013: one row per (message, target).
fn old_floor(
    env: &BenchEnv,
    mode: &str,
    messages: u64,
    ack_on_return: bool,
) -> Result<Measurement, BenchError> {
    let before_cursors = FANOUT_MIGRATIONS
        .iter()
        .position(|m| m.name == "durability_0013_fanout_cursors")
        .unwrap_or(FANOUT_MIGRATIONS.len());
    layout_floor(
        env,
        "old-floor",
        mode,
        messages,
        ack_on_return,
        &FANOUT_MIGRATIONS[..before_cursors],
        floor_batch,
    )
}

/// A layout's row writes and reads, in the fanout's transactions, on one
/// bare connection with that layout's schema.
fn layout_floor(
    env: &BenchEnv,
    name: &str,
    mode: &str,
    messages: u64,
    ack_on_return: bool,
    migrations: &[durability::migrations::Migration],
    batch: FloorBatch,
) -> Result<Measurement, BenchError> {
    let sqlite = |what| move |source| BenchError::Sqlite { what, source };
    let dir = env.subdir(&format!("fanout-{name}-{mode}"))?;
    let mut conn = Connection::open(dir.join("floor.sqlite"))
        .map_err(sqlite("cannot open the floor database"))?;
    conn.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get::<_, String>(0))
        .map_err(sqlite("cannot switch the floor database to WAL"))?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(sqlite("cannot set synchronous on the floor database"))?;
    for migration in migrations.iter().chain(MEMO_MIGRATIONS) {
        conn.execute_batch(migration.up)
            .map_err(sqlite("cannot create the floor schema"))?;
    }
    let deliveries = messages * count(TARGETS.len());
    let progress = env.progress(&format!("{name} {mode}"), deliveries);
    let started = Instant::now();
    let mut next = 0;
    while next < messages {
        let n = ENQUEUE_BATCH.min(messages - next);
        batch(&mut conn, next, n, ack_on_return).map_err(sqlite("a floor transaction failed"))?;
        next += n;
        progress.set_position(next * count(TARGETS.len()));
    }
    let elapsed = started.elapsed();
    progress.finish_and_clear();
    Ok(Measurement::new(
        format!("{name}/{mode}"),
        "1 (message, target): its rows, raw rusqlite",
        deliveries,
        elapsed,
        &Latency::new()?,
    ))
}

const CURSOR_READ_MESSAGE: &str = "SELECT key, id, payload, targets, seq, created_at, generation_id \
     FROM durability_fanout_messages WHERE key = ?1";
const CURSOR_READ_SEQ: &str = "SELECT next_seq FROM durability_fanout_seq WHERE id = 1";
const CURSOR_STORE_SEQ: &str = "UPDATE durability_fanout_seq SET next_seq = ?1 WHERE id = 1";
const CURSOR_INSERT_MESSAGE: &str = "INSERT INTO durability_fanout_messages \
     (seq, key, id, payload, targets, created_at, generation_id) VALUES (?1, ?2, ?2, ?3, ?4, ?5, ?6)";
const CURSOR_ENSURE: &str = "INSERT INTO durability_fanout_cursors (target_id, next_seq) \
     VALUES (?1, 0) ON CONFLICT(target_id) DO NOTHING";
const CURSOR_INSERT_SPAN: &str = "INSERT INTO durability_fanout_spans \
     (target_id, first_seq, last_seq, due_at) VALUES (?1, ?2, ?3, ?4)";
const CURSOR_READ: &str = "SELECT next_seq, claim_end, claim_attempt, claim_deadline, paused_until \
     FROM durability_fanout_cursors WHERE target_id = ?1";
const CURSOR_SPANS: &str = "SELECT first_seq, last_seq, due_at FROM durability_fanout_spans \
     WHERE target_id = ?1 ORDER BY first_seq LIMIT 64";
const CURSOR_MESSAGES: &str = "SELECT m.key, m.id, m.payload, m.targets, m.seq, m.created_at, \
     m.generation_id, e.seq IS NOT NULL \
     FROM durability_fanout_messages m LEFT JOIN durability_fanout_exceptions e \
     ON e.seq = m.seq AND e.target_id = ?1 \
     WHERE m.seq >= ?2 AND m.seq <= ?3 \
     AND (SELECT s.last_seq FROM durability_fanout_spans s WHERE s.target_id = ?1 \
          AND s.first_seq <= m.seq ORDER BY s.first_seq DESC LIMIT 1) >= m.seq \
     ORDER BY m.seq LIMIT ?4";
const CURSOR_CLAIM: &str = "UPDATE durability_fanout_cursors SET next_seq = ?1, claim_end = ?2, \
     claim_attempt = 1, claim_deadline = ?3 WHERE target_id = ?4 AND next_seq = ?5 AND claim_attempt = 0";
const CURSOR_TOMBSTONE: &str = "INSERT INTO durability_fanout_exceptions \
     (id, message_key, target_id, seq, status, phase, attempt, next_attempt_at, created_at, generation_id) \
     SELECT ?1, ?2, ?3, ?4, 'settled', 'delivery', 1, 0, m.created_at, m.generation_id \
     FROM durability_fanout_messages m WHERE m.seq = ?4 \
     AND EXISTS (SELECT 1 FROM durability_fanout_cursors c WHERE c.target_id = ?3 \
       AND c.claim_attempt = 1 AND c.next_seq <= ?4 AND c.claim_end > ?4) \
     ON CONFLICT(id) DO NOTHING";
const CURSOR_ADVANCE: &str = "UPDATE durability_fanout_cursors SET next_seq = ?1, claim_end = NULL, \
     claim_attempt = 0, claim_deadline = NULL WHERE target_id = ?2 AND next_seq = ?3 AND claim_attempt = 1";
const CURSOR_DROP_TOMBSTONES: &str = "DELETE FROM durability_fanout_exceptions WHERE seq >= ?1 \
     AND seq < ?2 AND target_id = ?3 AND status = 'settled'";
const CURSOR_DROP_SPANS: &str = "DELETE FROM durability_fanout_spans WHERE target_id = ?1 \
     AND last_seq < ?2 AND first_seq < ?2 RETURNING first_seq, last_seq";
const CURSOR_SPAN_LEFT: &str = "SELECT 1 FROM durability_fanout_spans WHERE first_seq = ?1 LIMIT 1";
const CURSOR_RELEASE: &str = "DELETE FROM durability_fanout_messages WHERE seq >= ?1 AND seq <= ?2 \
     AND NOT EXISTS (SELECT 1 FROM durability_fanout_exceptions e \
     WHERE e.seq = durability_fanout_messages.seq)";

/// The cursor layout: one enqueue transaction of `n` messages (a span per
/// target), then for each target one claim transaction (one cursor write)
/// and the acks: with ack on return one advance of the cursor with its
/// range delete; with ack-each a tombstone per message, each its own
/// transaction, then the advance.
fn cursor_floor_batch(
    conn: &mut Connection,
    first: u64,
    n: u64,
    ack_on_return: bool,
) -> rusqlite::Result<()> {
    let now = i64::try_from(first).unwrap_or(0);
    let targets_json = serde_json::to_string(&TARGETS).unwrap_or_default();
    let tx = conn.transaction()?;
    let first_seq: i64 = tx
        .prepare_cached(CURSOR_READ_SEQ)?
        .query_row([], |row| row.get(0))?;
    let mut seq = first_seq;
    for i in first..first + n {
        let key = format!("m{i}");
        let existing: Option<String> = tx
            .prepare_cached(CURSOR_READ_MESSAGE)?
            .query_row(params![key], |row| row.get(1))
            .optional()?;
        if existing.is_some() {
            continue;
        }
        tx.prepare_cached(CURSOR_INSERT_MESSAGE)?.execute(params![
            seq,
            key,
            format!("{{\"kind\":\"value\",\"value\":\"{}\"}}", body(i)),
            targets_json,
            now,
            format!("{i:032x}")
        ])?;
        seq += 1;
    }
    for target in TARGETS {
        tx.prepare_cached(CURSOR_ENSURE)?.execute(params![target])?;
        tx.prepare_cached(CURSOR_INSERT_SPAN)?
            .execute(params![target, first_seq, seq - 1, now])?;
    }
    tx.prepare_cached(CURSOR_STORE_SEQ)?.execute(params![seq])?;
    tx.commit()?;
    for target in TARGETS {
        let tx = conn.transaction()?;
        let next_seq: i64 = tx
            .prepare_cached(CURSOR_READ)?
            .query_row(params![target], |row| row.get(0))?;
        let spans: Vec<(i64, i64)> = tx
            .prepare_cached(CURSOR_SPANS)?
            .query_map(params![target], |row| Ok((row.get(0)?, row.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?;
        let (Some(first_span), Some(last_span)) = (spans.first(), spans.last()) else {
            continue;
        };
        let from = first_span.0.max(next_seq);
        let due: Vec<(String, i64)> = tx
            .prepare_cached(CURSOR_MESSAGES)?
            .query_map(
                params![
                    target,
                    from,
                    last_span.1,
                    i64::try_from(DELIVERY_BATCH).unwrap_or(100)
                ],
                |row| Ok((row.get(0)?, row.get(4)?)),
            )?
            .collect::<rusqlite::Result<_>>()?;
        let end = due.last().map_or(from, |(_, seq)| seq + 1);
        tx.prepare_cached(CURSOR_CLAIM)?.execute(params![
            from,
            end,
            now + 300_000,
            target,
            next_seq
        ])?;
        tx.commit()?;
        if !ack_on_return {
            for (key, seq) in &due {
                let tx = conn.transaction()?;
                let id = serde_json::to_string(&[key.as_str(), target]).unwrap_or_default();
                tx.prepare_cached(CURSOR_TOMBSTONE)?
                    .execute(params![id, key, target, seq])?;
                tx.prepare_cached(DELETE_MEMOS)?.execute(params![id])?;
                tx.commit()?;
            }
        }
        let tx = conn.transaction()?;
        tx.prepare_cached(CURSOR_ADVANCE)?
            .execute(params![end, target, from])?;
        tx.prepare_cached(CURSOR_DROP_TOMBSTONES)?
            .execute(params![from, end, target])?;
        let passed: Vec<(i64, i64)> = tx
            .prepare_cached(CURSOR_DROP_SPANS)?
            .query_map(params![target, end], |row| Ok((row.get(0)?, row.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?;
        for (first, last) in passed {
            let left = tx
                .prepare_cached(CURSOR_SPAN_LEFT)?
                .query_row(params![first], |_| Ok(()))
                .optional()?;
            if left.is_none() {
                tx.prepare_cached(CURSOR_RELEASE)?
                    .execute(params![first, last])?;
            }
        }
        tx.commit()?;
    }
    Ok(())
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

/// The layout before 0013: one enqueue transaction of `n` messages, then
/// for each target one claim transaction and its acks (one transaction, or
/// one per message).
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
