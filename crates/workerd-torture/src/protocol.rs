//! What the torture worker and its runner agree on: the commands the runner
//! sends over HTTP, the capabilities' settings the checker judges against,
//! the attempt log's table, and the handlers' failure script.
//!
//! Compiled into both: the worker (`src/worker.rs`, wasm32) and the runner
//! (`src/main.rs`, `#[path]`-included). It touches nothing but serde.

use serde::{Deserialize, Serialize};

/// Attempts of one record (operation, alarm occurrence, fanout delivery),
/// the first included: room for the scripted failures and a few attempts
/// that kills use up.
pub const MAX_ATTEMPTS: u32 = 5;

/// The delay between two attempts: short, so retries happen within a life
/// as well as across kills.
pub const RETRY_DELAY_MS: u64 = 100;

/// How long an attempt may run; a kill's in-flight attempt (a fanout
/// batch above all, whose claim stays until this deadline) comes back after
/// it. The handlers take 20 ms at most, so only kills reach it; the default
/// (5 minutes) would make every drain wait that long.
pub const ATTEMPT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// The workload's one operation.
pub const OPERATION: &str = "work";

/// The named one-shot alarms of every object; each is scheduled again and
/// again, so a schedule often replaces a pending occurrence.
pub const ALARM_NAMES: [&str; 3] = ["remind-0", "remind-1", "remind-2"];

/// The fanout targets: `inbox` settles each message by the script (ack,
/// retry, dead letter), `archive` acks on return and fails whole batches.
/// The fanout has no DLQ, so a dead letter is parked in the object's table.
pub const TARGETS: [&str; 2] = ["inbox", "archive"];

/// The log consumer the runner drives page by page.
pub const LOG_CONSUMER: &str = "reader";

/// Records per page the consumer reads.
pub const LOG_PAGE_RECORDS: u32 = 50;

/// A recurring schedule's missed-tick policy (the worker maps it to
/// `durability::MissedTicks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Skip,
    RunOnce,
    CatchUp(u32),
}

/// One recurring schedule of every object: a fixed interval, so every tick
/// is a multiple of it.
#[derive(Debug, Clone, Copy)]
pub struct ScheduleSpec {
    pub name: &'static str,
    pub interval_ms: i64,
    pub policy: Policy,
}

/// Every policy, each ticking a few times a second so that kills land in
/// the middle of ticks and the downtime of a restart misses some.
pub const SCHEDULES: [ScheduleSpec; 3] = [
    ScheduleSpec {
        name: "tick-catch-up",
        interval_ms: 700,
        policy: Policy::CatchUp(3),
    },
    ScheduleSpec {
        name: "tick-skip",
        interval_ms: 500,
        policy: Policy::Skip,
    },
    ScheduleSpec {
        name: "tick-run-once",
        interval_ms: 600,
        policy: Policy::RunOnce,
    },
];

/// One request to an object, as JSON (`POST /object/<name>`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// Stores the object's name in its database (so the checker can tell
    /// the files apart) and registers the recurring schedules (a no-op once
    /// stored). Sent to every object at the start of every life.
    Hello { name: String },
    /// Starts operation [`OPERATION`] under `id`.
    OpStart { id: String },
    /// Schedules the named alarm `name` at `at_ms` (epoch ms).
    AlarmSchedule { name: String, at_ms: i64 },
    /// Enqueues one batch of messages with these ids to both targets.
    FanoutEnqueue { ids: Vec<String> },
    /// Appends one record per key, its body `{"key": key}`.
    LogAppend { keys: Vec<String> },
    /// Reads a page from [`LOG_CONSUMER`]'s cursor, records its offsets as
    /// consumed and commits the cursor past them.
    LogConsume,
    /// What the object still owes: pending operations and one-shot alarms,
    /// fanout deliveries, the log's end and the consumer's cursor.
    Pending,
}

/// The attempt log: one row when a handler begins (`outcome` NULL) and one
/// just before it returns, written by the handler itself in the object's
/// own database. `kind` is `op`, `alarm`, `tick`, `inbox` or `archive`;
/// `generation` is the operation's generation, the alarm occurrence's
/// idempotency key or the fanout delivery id; `instance` is a random id of
/// the object instance that ran it (a new one after every restart).
pub const SCHEMA: &str = "\
CREATE TABLE IF NOT EXISTS torture_meta (id INTEGER PRIMARY KEY CHECK (id = 1), name TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS torture_runs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  kind TEXT NOT NULL,
  key TEXT NOT NULL,
  generation TEXT NOT NULL,
  attempt INTEGER NOT NULL,
  instance TEXT NOT NULL,
  scheduled INTEGER,
  missed INTEGER,
  outcome TEXT,
  at_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS torture_consumed (\"offset\" INTEGER PRIMARY KEY, times INTEGER NOT NULL);
";

/// How one handler attempt ends, by the script.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Returns `Ok` (a fanout inbox acks).
    Ok,
    /// Fails and may be retried (a fanout inbox asks for a retry).
    Transient,
    /// Fails for good (a fanout inbox dead-letters).
    Permanent,
}

impl Outcome {
    /// The attempt log's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Transient => "transient",
            Outcome::Permanent => "permanent",
        }
    }

    /// The attempt log's spelling read back.
    pub fn parse(text: &str) -> Option<Outcome> {
        match text {
            "ok" => Some(Outcome::Ok),
            "transient" => Some(Outcome::Transient),
            "permanent" => Some(Outcome::Permanent),
            _ => None,
        }
    }
}

/// The script of record `key`'s attempt `attempt`: a pure function of
/// both, so a retry after a kill follows the same script. About 6 % of
/// keys fail permanently, 6 % fail every attempt (and run out of them), the
/// rest fail their first zero to two attempts and then succeed.
pub fn fate(key: &str, attempt: u32) -> Outcome {
    let per_key = hash(key.as_bytes(), 0);
    match per_key % 100 {
        0..6 => Outcome::Permanent,
        6..12 => Outcome::Transient,
        _ if u64::from(attempt) > (per_key / 100) % 3 => Outcome::Ok,
        _ => Outcome::Transient,
    }
}

/// Whether the archive fails the whole batch whose first delivery is
/// `delivery_id` at `attempt` (15 %).
pub fn archive_fails(delivery_id: &str, attempt: u32) -> bool {
    hash(delivery_id.as_bytes(), u64::from(attempt)) % 100 < 15
}

/// How long an attempt takes, 1 to 20 ms, so kills land inside handlers.
pub fn attempt_ms(key: &str, attempt: u32) -> u64 {
    1 + hash(key.as_bytes(), u64::from(attempt) + 1) % 20
}

/// FNV-1a over `bytes` and `salt`: the same on wasm32 and the host (the
/// standard hasher promises no stability across builds).
fn hash(bytes: &[u8], salt: u64) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes.iter().chain(salt.to_le_bytes().iter()) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}
