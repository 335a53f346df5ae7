//! `sqlite-floor`: raw rusqlite doing the row writes a capability needs, with
//! no logic around them. It is the physical floor: no host, no capability
//! can commit faster than this on the same disk, so other scenarios divide
//! their rates by it ([`measure`] is called again inside them, in the same
//! run, so both figures see the same disk at the same moment).
//!
//! The rows are those of a durable queue: a message row and a due-index row
//! (what the object's alarm is computed from) are written together, then the
//! message is claimed (its generation bumped, a lease deadline indexed) and
//! completed (settled for the generation it claimed, its due-index row
//! removed). Each step is timed as one transaction, then again with
//! [`BATCH_SIZE`] messages per transaction, the way the capabilities commit.

use std::path::Path;
use std::time::Instant;

use rusqlite::{Connection, TransactionBehavior, params};

use super::{BenchEnv, BenchError, Latency, Measurement, ScenarioReport, timed};

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "sqlite-floor";

/// Messages per transaction in the batched measurements: the batch size the
/// reference library commits a fanout batch with.
pub const BATCH_SIZE: usize = 100;

/// A payload about the size of a small queued message.
const PAYLOAD_BYTES: usize = 64;

/// How far ahead a freshly enqueued message is indexed as due, and how long a
/// claim's lease lasts. The values do not matter to SQLite; they are here so
/// the rows look like a capability's.
const DUE_AFTER_MS: i64 = 30_000;

/// The table of [`WRITE_SQL`]; host scenarios create the same one inside
/// their objects so both sides write identical rows.
pub const WRITES_TABLE_SQL: &str = "
    CREATE TABLE IF NOT EXISTS writes (
        id INTEGER PRIMARY KEY,
        at_ms INTEGER NOT NULL,
        value TEXT NOT NULL
    );";

/// One small row: the write of the `write` floor and of a host call.
pub const WRITE_SQL: &str = "INSERT INTO writes (at_ms, value) VALUES (?1, ?2)";

/// The value [`WRITE_SQL`] stores.
pub const WRITE_VALUE: &str = "a small value";

const QUEUE_SCHEMA: &str = "
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        generation INTEGER NOT NULL,
        state INTEGER NOT NULL, -- 0 pending, 1 claimed, 2 done
        attempts INTEGER NOT NULL,
        available_at_ms INTEGER NOT NULL,
        payload BLOB NOT NULL
    );
    CREATE INDEX messages_by_state_due ON messages (state, available_at_ms);
    CREATE TABLE due_index (
        message_id INTEGER PRIMARY KEY,
        due_at_ms INTEGER NOT NULL
    );
    CREATE INDEX due_index_by_time ON due_index (due_at_ms);
";

const ENQUEUE_MESSAGE_SQL: &str = "INSERT INTO messages (id, generation, state, attempts, available_at_ms, payload) VALUES (?1, 1, 0, 0, ?2, ?3)";
const ENQUEUE_DUE_SQL: &str = "INSERT INTO due_index (message_id, due_at_ms) VALUES (?1, ?2)";
const CLAIM_MESSAGE_SQL: &str = "UPDATE messages SET state = 1, generation = generation + 1, attempts = attempts + 1 WHERE id = ?1 AND state = 0";
const CLAIM_DUE_SQL: &str = "UPDATE due_index SET due_at_ms = ?2 WHERE message_id = ?1";
// Settles only the generation the claim produced (1 + 1), as a capability does.
const COMPLETE_MESSAGE_SQL: &str =
    "UPDATE messages SET state = 2 WHERE id = ?1 AND generation = 2 AND state = 1";
const COMPLETE_DUE_SQL: &str = "DELETE FROM due_index WHERE message_id = ?1";

/// SQLite's `synchronous` setting, as the host offers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMode {
    /// fsync on every commit: a committed transaction survives power loss.
    /// The host's default.
    Full,
    /// fsync at checkpoints only: survives a process crash, may lose the
    /// last commits on power loss.
    Normal,
}

impl SyncMode {
    /// The name used in measurement keys and the pragma.
    pub fn key(self) -> &'static str {
        match self {
            SyncMode::Full => "full",
            SyncMode::Normal => "normal",
        }
    }
}

/// How many operations each measurement runs.
#[derive(Debug, Clone, Copy)]
pub struct FloorSizes {
    /// Operations of each single-transaction measurement.
    pub single_ops: u64,
    /// Messages of each batched measurement.
    pub batched_messages: u64,
}

impl FloorSizes {
    /// The scenario's own sizes: large enough for stable percentiles, or a
    /// few hundred operations under `--quick`.
    pub fn for_env(env: &BenchEnv) -> Self {
        FloorSizes {
            single_ops: env.size(10_000, 200),
            batched_messages: env.size(200_000, 2_000),
        }
    }
}

/// The floor for one synchronous mode: one measurement per kind of write.
pub struct Floor {
    /// One small row inserted in its own transaction: what a host call that
    /// does one SQL write costs at least.
    pub write: Measurement,
    /// A message row and its due-index row, one transaction per message.
    pub enqueue: Measurement,
    /// Claim (generation bump, lease indexed), one transaction per message.
    pub claim: Measurement,
    /// Complete (settle the claimed generation, unindex), one per message.
    pub complete: Measurement,
    /// Enqueue, [`BATCH_SIZE`] messages per transaction.
    pub enqueue_batch: Measurement,
    /// Claim, [`BATCH_SIZE`] messages per transaction.
    pub claim_batch: Measurement,
    /// Complete, [`BATCH_SIZE`] messages per transaction.
    pub complete_batch: Measurement,
}

impl Floor {
    fn into_measurements(self) -> Vec<Measurement> {
        vec![
            self.write,
            self.enqueue,
            self.claim,
            self.complete,
            self.enqueue_batch,
            self.claim_batch,
            self.complete_batch,
        ]
    }
}

/// Runs the `sqlite-floor` scenario: the floor under FULL (the host's
/// default, the headline) and under NORMAL.
pub fn run(env: &BenchEnv) -> Result<ScenarioReport, BenchError> {
    let sizes = FloorSizes::for_env(env);
    let full = measure(env, SyncMode::Full, sizes)?;
    let normal = measure(env, SyncMode::Normal, sizes)?;
    let headline = full.enqueue.name.clone();
    let mut measurements = full.into_measurements();
    measurements.extend(normal.into_measurements());
    Ok(ScenarioReport {
        scenario: NAME,
        quick: env.quick(),
        headline,
        measurements,
        figures: Vec::new(),
        notes: vec![
            "one bare rusqlite connection per mode, bundled SQLite, WAL; no host, no logic".into(),
            format!(
                "batched rows: ops/s counts messages, latencies are per transaction of {BATCH_SIZE}"
            ),
        ],
    })
}

/// Measures the floor for one synchronous mode in a fresh database under
/// the run's directory. Other scenarios call this to compute `floor_ratio`.
pub fn measure(env: &BenchEnv, mode: SyncMode, sizes: FloorSizes) -> Result<Floor, BenchError> {
    let write = measure_write(env, mode, sizes.single_ops)?;

    let dir = env.subdir(&format!("sqlite-floor-{}", mode.key()))?;
    let mut db = FloorDb::create(&dir.join("floor.sqlite"), mode)?;
    let prefix = mode.key();

    let first = db.next_message;
    let enqueue = db.measure_single_txn(
        env,
        &format!("{prefix}/enqueue"),
        "insert message + due row, 1 txn",
        first,
        sizes.single_ops,
        enqueue_one,
    )?;
    let claim = db.measure_single_txn(
        env,
        &format!("{prefix}/claim"),
        "update message + due row, 1 txn",
        first,
        sizes.single_ops,
        claim_one,
    )?;
    let complete = db.measure_single_txn(
        env,
        &format!("{prefix}/complete"),
        "update message, delete due row, 1 txn",
        first,
        sizes.single_ops,
        complete_one,
    )?;
    db.next_message = first + as_i64(sizes.single_ops);

    let first = db.next_message;
    let enqueue_batch = db.measure_batched(
        env,
        &format!("{prefix}/enqueue-batch{BATCH_SIZE}"),
        "enqueue 1 message in a batch txn",
        first,
        sizes.batched_messages,
        enqueue_one,
    )?;
    let claim_batch = db.measure_batched(
        env,
        &format!("{prefix}/claim-batch{BATCH_SIZE}"),
        "claim 1 message in a batch txn",
        first,
        sizes.batched_messages,
        claim_one,
    )?;
    let complete_batch = db.measure_batched(
        env,
        &format!("{prefix}/complete-batch{BATCH_SIZE}"),
        "complete 1 message in a batch txn",
        first,
        sizes.batched_messages,
        complete_one,
    )?;
    db.next_message = first + as_i64(sizes.batched_messages);

    Ok(Floor {
        write,
        enqueue,
        claim,
        complete,
        enqueue_batch,
        claim_batch,
        complete_batch,
    })
}

/// Measures only the cheapest durable write: one small row inserted and
/// committed on its own, `ops` times, in a fresh database. This is the floor
/// of a host call that does one SQL write.
pub fn measure_write(env: &BenchEnv, mode: SyncMode, ops: u64) -> Result<Measurement, BenchError> {
    let dir = env.subdir(&format!("sqlite-floor-{}-write", mode.key()))?;
    let mut db = FloorDb::create(&dir.join("floor.sqlite"), mode)?;
    db.measure_single(
        env,
        &format!("{}/write", mode.key()),
        "insert 1 row, own txn",
        ops,
        |conn, id| {
            conn.prepare_cached(WRITE_SQL)?
                .execute(params![id, WRITE_VALUE])?;
            Ok(())
        },
    )
}

/// One row-writing step on one message, run inside a transaction the caller
/// opened.
type Step = fn(&Connection, i64) -> rusqlite::Result<()>;

fn enqueue_one(conn: &Connection, id: i64) -> rusqlite::Result<()> {
    let now_ms = id; // any monotone value; SQLite does not care
    conn.prepare_cached(ENQUEUE_MESSAGE_SQL)?.execute(params![
        id,
        now_ms,
        &[7_u8; PAYLOAD_BYTES][..]
    ])?;
    conn.prepare_cached(ENQUEUE_DUE_SQL)?
        .execute(params![id, now_ms + DUE_AFTER_MS])?;
    Ok(())
}

fn claim_one(conn: &Connection, id: i64) -> rusqlite::Result<()> {
    conn.prepare_cached(CLAIM_MESSAGE_SQL)?
        .execute(params![id])?;
    conn.prepare_cached(CLAIM_DUE_SQL)?
        .execute(params![id, id + DUE_AFTER_MS])?;
    Ok(())
}

fn complete_one(conn: &Connection, id: i64) -> rusqlite::Result<()> {
    conn.prepare_cached(COMPLETE_MESSAGE_SQL)?
        .execute(params![id])?;
    conn.prepare_cached(COMPLETE_DUE_SQL)?
        .execute(params![id])?;
    Ok(())
}

/// One bare connection configured like an object's database.
struct FloorDb {
    conn: Connection,
    mode: SyncMode,
    next_message: i64,
}

impl FloorDb {
    fn create(path: &Path, mode: SyncMode) -> Result<Self, BenchError> {
        let sqlite = |what| move |source| BenchError::Sqlite { what, source };
        let conn = Connection::open(path).map_err(sqlite("cannot open the floor database"))?;
        conn.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get::<_, String>(0))
            .map_err(sqlite("cannot switch the floor database to WAL"))?;
        conn.pragma_update(None, "synchronous", mode.key())
            .map_err(sqlite("cannot set synchronous on the floor database"))?;
        conn.execute_batch(WRITES_TABLE_SQL)
            .and_then(|()| conn.execute_batch(QUEUE_SCHEMA))
            .map_err(sqlite("cannot create the floor schema"))?;
        Ok(FloorDb {
            conn,
            mode,
            next_message: 1,
        })
    }

    /// `ops` statements, each committing on its own (autocommit).
    fn measure_single(
        &mut self,
        env: &BenchEnv,
        name: &str,
        what: &str,
        ops: u64,
        op: impl Fn(&Connection, i64) -> rusqlite::Result<()>,
    ) -> Result<Measurement, BenchError> {
        let bar = env.progress(name, ops);
        let mut latency = Latency::new()?;
        let started = Instant::now();
        for i in 0..as_i64(ops) {
            timed(&mut latency, || op(&self.conn, i)).map_err(|source| BenchError::Sqlite {
                what: "a floor write failed",
                source,
            })?;
            bar.inc(1);
        }
        let elapsed = started.elapsed();
        bar.finish_and_clear();
        Ok(self.measurement(name, what, ops, elapsed, &latency))
    }

    /// `ops` messages from `first`, one transaction each.
    fn measure_single_txn(
        &mut self,
        env: &BenchEnv,
        name: &str,
        what: &str,
        first: i64,
        ops: u64,
        step: Step,
    ) -> Result<Measurement, BenchError> {
        let bar = env.progress(name, ops);
        let mut latency = Latency::new()?;
        let started = Instant::now();
        for id in first..first + as_i64(ops) {
            timed(&mut latency, || {
                let txn = self
                    .conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)?;
                step(&txn, id)?;
                txn.commit()
            })
            .map_err(|source| BenchError::Sqlite {
                what: "a floor transaction failed",
                source,
            })?;
            bar.inc(1);
        }
        let elapsed = started.elapsed();
        bar.finish_and_clear();
        Ok(self.measurement(name, what, ops, elapsed, &latency))
    }

    /// `messages` messages from `first`, [`BATCH_SIZE`] per transaction; the
    /// latency is per transaction, the rate per message.
    fn measure_batched(
        &mut self,
        env: &BenchEnv,
        name: &str,
        what: &str,
        first: i64,
        messages: u64,
        step: Step,
    ) -> Result<Measurement, BenchError> {
        let bar = env.progress(name, messages);
        let mut latency = Latency::new()?;
        let end = first + as_i64(messages);
        let started = Instant::now();
        let mut batch_start = first;
        while batch_start < end {
            let batch_end = (batch_start + as_i64(BATCH_SIZE as u64)).min(end);
            timed(&mut latency, || {
                let txn = self
                    .conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)?;
                for id in batch_start..batch_end {
                    step(&txn, id)?;
                }
                txn.commit()
            })
            .map_err(|source| BenchError::Sqlite {
                what: "a batched floor transaction failed",
                source,
            })?;
            bar.inc(u64::try_from(batch_end - batch_start).unwrap_or(0));
            batch_start = batch_end;
        }
        let elapsed = started.elapsed();
        bar.finish_and_clear();
        Ok(self
            .measurement(name, what, messages, elapsed, &latency)
            .with("batch_size", BATCH_SIZE)
            .with("transactions", latency.len()))
    }

    fn measurement(
        &self,
        name: &str,
        what: &str,
        ops: u64,
        elapsed: std::time::Duration,
        latency: &Latency,
    ) -> Measurement {
        Measurement::new(name, what, ops, elapsed, latency).with("synchronous", self.mode.key())
    }
}

/// Sizes are small counts chosen by the scenario, far below `i64::MAX`.
fn as_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
