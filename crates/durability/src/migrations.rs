//! Schema migrations (§10): one history table shared by every capability,
//! each row remembering the script that reverts it.
//!
//! A capability (`operations`, `namedAlarms`, `memos`, ...) owns an ordered
//! list of [`Migration`]s. [`migrate`] brings the object's schema to a target
//! in that list: the latest, a named one, or none at all. Each history row
//! stores its `down` script, so an *older* version of the library can revert
//! migrations it has never heard of; it does so for at most
//! [`MAX_AUTO_REVERTED_MIGRATIONS`] of them and refuses beyond that, because
//! a long revert chain written by a much newer version is more likely to lose
//! data than to help.
//!
//! Guard against a second run: the up scripts that rebuild a table (the
//! two 0004 migrations) are not safe to run twice: a second run would give
//! every existing row a new generation and `created_at`. A history can lack
//! their row while the schema has their columns (a 3.x history table that
//! records 0004 only as the 2.x combined row, a history table restored from
//! an older backup). So before running such a script, its effect is looked
//! up in the schema (`REBUILD_GUARDS`); when it is already there the row
//! is recorded without running the script, and not reported as applied:
//! a report names only the scripts that ran. Every
//! other up script only creates tables, indexes and their first rows: a
//! second run fails on the existing table with [`MigrationError::Script`]
//! and its batch changes nothing.
//!
//! Crash safety: the history upkeep, the revert of unknown migrations and the
//! planned batch are each one transaction, so a crash leaves the schema
//! before or after a batch, never in between.
//!
//! This module owns the `durability_migrations` table and the migration
//! lists of the capabilities in this crate. It touches another capability's
//! tables only by running that capability's own scripts.
//!
//! ```no_run
//! use durability::migrations::{migrate, MigrationTarget, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS};
//! # fn run(storage: &dyn durability::platform::Storage) -> Result<(), durability::migrations::MigrationError> {
//! let report = migrate(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS, MigrationTarget::Latest)?;
//! println!("applied {:?}", report.applied);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::fmt;

use durability_platform::{Sql, Storage, StorageError, StorageExt};
use thiserror::Error;

/// The history table shared by every capability.
pub const HISTORY_TABLE: &str = "durability_migrations";

/// How many migrations of a newer version a call reverts on its own before
/// it refuses.
pub const MAX_AUTO_REVERTED_MIGRATIONS: usize = 2;

/// The capability name of durable operations.
pub const OPERATIONS_CAPABILITY: &str = "operations";
/// The capability name of named alarms.
pub const NAMED_ALARMS_CAPABILITY: &str = "namedAlarms";
/// The capability name of memos.
pub const MEMOS_CAPABILITY: &str = "memos";
/// The capability name of fanout.
pub const FANOUT_CAPABILITY: &str = "fanout";
/// The capability name of the retained log.
pub const LOG_CAPABILITY: &str = "log";
/// The capability name of the retained log's consumer leases.
pub const LOG_LEASES_CAPABILITY: &str = "logLeases";

/// One schema change and the script that undoes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// Unique across every capability; recorded in the history table.
    pub name: &'static str,
    /// Applies the change (one or more statements).
    pub up: &'static str,
    /// Reverts it; stored with the history row at apply time.
    pub down: &'static str,
}

/// Where [`migrate`] takes a capability's schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigrationTarget {
    /// The last migration of the list (none if the list is empty).
    Latest,
    /// The migration of this name: everything up to it applied, everything
    /// after it reverted.
    Named(String),
    /// No migration: everything of the capability reverted.
    None,
}

/// What a [`migrate`] call changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrationReport {
    /// Migrations whose up script ran in this call, in list order. A history
    /// row recorded without running its script (a table rebuild already in
    /// the schema, such as the split 0004 rows standing for the 2.x combined
    /// row) is bookkeeping and is not listed.
    pub applied: Vec<String>,
    /// Migrations reverted: unknown newer ones first (newest first), then
    /// known ones after the target (newest first).
    pub rolled_back: Vec<String>,
}

/// Which script of a migration failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// The `up` script.
    Up,
    /// The `down` script.
    Down,
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::Up => "up",
            Direction::Down => "down",
        })
    }
}

/// Why a migration call failed. A failed batch left nothing of itself.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum MigrationError {
    /// The named target is not in the capability's list.
    #[error("Unknown durability migration target \"{name}\"")]
    UnknownTarget { name: String },
    /// A newer version applied more unknown migrations than this one will
    /// revert.
    #[error(
        "Durability {capability} schema is {count} migrations ahead of this version; refusing to revert more than {MAX_AUTO_REVERTED_MIGRATIONS}"
    )]
    TooFarAhead { capability: String, count: usize },
    /// An unknown migration whose history row has no revert script.
    #[error("Migration \"{name}\" has no stored down script")]
    MissingDown { name: String },
    /// A migration script failed; its whole batch was rolled back.
    #[error("migration \"{name}\" failed running its {direction} script: {source}")]
    Script {
        name: String,
        direction: Direction,
        #[source]
        source: StorageError,
    },
    /// The history table could not be read or written.
    #[error(transparent)]
    Storage(#[from] StorageError),
}

/// The combined 0004 row written by the 2.x library, which migrated calls and
/// alarms in one step. 3.x split it per capability.
const LEGACY_COMBINED_0004: &str = "durability_0004_generation_and_created_at";
const CALLS_0004: &str = "durability_0004_calls_generation_and_created_at";
const ALARMS_0004: &str = "durability_0004_alarms_generation_and_created_at";

/// The migrations whose up script rebuilds a table, each with the table and
/// a column its rebuild adds: when the column is already there, the script
/// has run and must not run again.
const REBUILD_GUARDS: &[(&str, &str, &str)] = &[
    (CALLS_0004, "durability_calls", "generation_id"),
    (ALARMS_0004, "durability_alarms", "created_at"),
];

/// Brings `capability`'s schema to `target` (§10.2).
///
/// In order: resolve the target (an unknown name fails before any statement
/// runs); make sure the history table and its `capability` and `down`
/// columns exist, translate the 2.x combined row (when upgrading a 2.x
/// table) and claim unowned rows of this list (one transaction); revert up to two migrations of this
/// capability that the list does not know, using their stored `down`
/// (one transaction; more than two is an error); then revert what lies after
/// the target, apply what is missing up to it and refresh stale stored
/// `down` scripts (one transaction). The history table is dropped in that
/// last transaction when no row of any capability remains. The report names
/// the scripts that ran, not the history rows that were merely recorded.
pub fn migrate(
    storage: &dyn Storage,
    capability: &str,
    list: &[Migration],
    target: MigrationTarget,
) -> Result<MigrationReport, MigrationError> {
    // How many leading migrations of the list the target keeps applied.
    let keep = match &target {
        MigrationTarget::Latest => list.len(),
        MigrationTarget::None => 0,
        MigrationTarget::Named(name) => {
            match list.iter().position(|migration| migration.name == name) {
                Some(index) => index + 1,
                None => return Err(MigrationError::UnknownTarget { name: name.clone() }),
            }
        }
    };

    let recorded = storage.transaction_sync(|sql| -> Result<_, MigrationError> {
        if ensure_history_table(sql)? {
            translate_legacy_rows(sql)?;
        }
        for migration in list {
            sql.execute(
                "UPDATE durability_migrations SET capability = ? \
                 WHERE name = ? AND capability IS NULL",
                &[capability.into(), migration.name.into()],
            )?;
        }
        Ok(recorded_rows(sql, capability)?)
    })?;

    let mut future: Vec<&(String, Option<String>)> = recorded
        .iter()
        .filter(|(name, _)| !list.iter().any(|migration| migration.name == name))
        .collect();
    future.reverse();
    if future.len() > MAX_AUTO_REVERTED_MIGRATIONS {
        return Err(MigrationError::TooFarAhead {
            capability: capability.to_owned(),
            count: future.len(),
        });
    }
    let mut report = MigrationReport::default();
    if !future.is_empty() {
        storage.transaction_sync(|sql| -> Result<(), MigrationError> {
            for (name, down) in &future {
                let down = down
                    .as_deref()
                    .ok_or_else(|| MigrationError::MissingDown { name: name.clone() })?;
                run_script(sql, name, Direction::Down, down)?;
                sql.execute(
                    "DELETE FROM durability_migrations WHERE name = ?",
                    &[name.into()],
                )?;
            }
            Ok(())
        })?;
        report
            .rolled_back
            .extend(future.iter().map(|(name, _)| name.clone()));
    }

    let applied: HashMap<&str, Option<&str>> = recorded
        .iter()
        .filter(|(name, _)| list.iter().any(|migration| migration.name == name))
        .map(|(name, down)| (name.as_str(), down.as_deref()))
        .collect();
    let (kept, after) = list.split_at(keep);
    let to_revert: Vec<&Migration> = after
        .iter()
        .rev()
        .filter(|migration| applied.contains_key(migration.name))
        .collect();
    let to_apply: Vec<&Migration> = kept
        .iter()
        .filter(|migration| !applied.contains_key(migration.name))
        .collect();
    let to_refresh: Vec<&Migration> = kept
        .iter()
        .filter(|migration| {
            applied
                .get(migration.name)
                .is_some_and(|down| *down != Some(migration.down))
        })
        .collect();

    // Only the migrations whose up script runs here are reported: a rebuild
    // already in the schema is recorded without running, and naming it would
    // tell the caller a table was rebuilt when none was.
    let ran = storage.transaction_sync(|sql| -> Result<Vec<String>, MigrationError> {
        let mut ran = Vec::new();
        for migration in &to_revert {
            run_script(sql, migration.name, Direction::Down, migration.down)?;
            sql.execute(
                "DELETE FROM durability_migrations WHERE name = ?",
                &[migration.name.into()],
            )?;
        }
        for migration in &to_apply {
            if already_in_schema(sql, migration.name)? {
                tracing::warn!(
                    event = "durability.migration.already_in_schema",
                    migration = migration.name,
                    capability,
                    "the schema already has this migration's change; recorded without running it again"
                );
            } else {
                run_script(sql, migration.name, Direction::Up, migration.up)?;
                ran.push(migration.name.to_owned());
            }
            sql.execute(
                "INSERT INTO durability_migrations (name, capability, down) VALUES (?, ?, ?)",
                &[
                    migration.name.into(),
                    capability.into(),
                    migration.down.into(),
                ],
            )?;
        }
        for migration in &to_refresh {
            sql.execute(
                "UPDATE durability_migrations SET down = ? WHERE name = ?",
                &[migration.down.into(), migration.name.into()],
            )?;
        }
        let remaining = sql
            .query_row("SELECT COUNT(*) FROM durability_migrations", &[])?
            .map(|row| row.get::<i64>(0))
            .transpose()?
            .unwrap_or(0);
        if remaining == 0 {
            sql.execute_script("DROP TABLE durability_migrations")?;
        }
        Ok(ran)
    })?;

    report
        .rolled_back
        .extend(to_revert.iter().map(|migration| migration.name.to_owned()));
    report.applied = ran;
    Ok(report)
}

/// Whether `capability`'s recorded history is exactly `list`: every
/// migration applied with the same stored `down` script, and nothing else.
/// A helper's constructor checks this first so that a current schema costs
/// a few reads instead of a migration. It never writes.
pub fn is_schema_current(
    sql: &dyn Sql,
    capability: &str,
    list: &[Migration],
) -> Result<bool, StorageError> {
    let exists = sql
        .query_row(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'durability_migrations'",
            &[],
        )?
        .is_some();
    if !exists {
        return Ok(list.is_empty());
    }
    let columns = history_columns(sql)?;
    if !columns.iter().any(|c| c == "capability") || !columns.iter().any(|c| c == "down") {
        return Ok(false);
    }
    let recorded = recorded_rows(sql, capability)?;
    Ok(recorded.len() == list.len()
        && list.iter().all(|migration| {
            recorded.iter().any(|(name, down)| {
                name == migration.name && down.as_deref() == Some(migration.down)
            })
        }))
}

/// Creates the history table or upgrades a 2.x one. Returns whether it was
/// a 2.x table (it lacked the `capability` column).
fn ensure_history_table(sql: &dyn Sql) -> Result<bool, StorageError> {
    sql.execute_script(
        "CREATE TABLE IF NOT EXISTS durability_migrations (\
         id INTEGER PRIMARY KEY AUTOINCREMENT, \
         name TEXT UNIQUE, \
         applied_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP, \
         capability TEXT, \
         down TEXT)",
    )?;
    // A history table written by the 2.x library lacks both columns.
    let columns = history_columns(sql)?;
    let from_2x = !columns.iter().any(|c| c == "capability");
    if from_2x {
        sql.execute_script("ALTER TABLE durability_migrations ADD COLUMN capability TEXT")?;
    }
    if !columns.iter().any(|c| c == "down") {
        sql.execute_script("ALTER TABLE durability_migrations ADD COLUMN down TEXT")?;
    }
    Ok(from_2x)
}

/// Whether `name` is a table rebuild whose column is already in the schema.
fn already_in_schema(sql: &dyn Sql, name: &str) -> Result<bool, StorageError> {
    let Some((_, table, column)) = REBUILD_GUARDS.iter().find(|(guarded, ..)| *guarded == name)
    else {
        return Ok(false);
    };
    // A PRAGMA takes no bound table name; the names are this module's own
    // constants.
    let columns = sql.query(&format!("PRAGMA table_info({table})"), &[])?;
    for row in columns.iter() {
        if row.get_named::<String>("name")? == *column {
            return Ok(true);
        }
    }
    Ok(false)
}

fn history_columns(sql: &dyn Sql) -> Result<Vec<String>, StorageError> {
    sql.query("PRAGMA table_info(durability_migrations)", &[])?
        .iter()
        .map(|row| row.get_named::<String>("name"))
        .collect()
}

/// Inserts the split 0004 rows when the 2.x combined row exists. The combined
/// row stays, so a 2.x deployment still sees its complete history.
///
/// Runs only while upgrading a 2.x history table, not on every call as the
/// reference describes: the combined row is never removed, so translating
/// again after a capability reverted its split row would resurrect that row,
/// and the next migrate would take 0004 as applied on a table that lacks its
/// columns.
fn translate_legacy_rows(sql: &dyn Sql) -> Result<(), StorageError> {
    for split in [CALLS_0004, ALARMS_0004] {
        sql.execute(
            "INSERT OR IGNORE INTO durability_migrations (name, capability, down) \
             SELECT ?, NULL, NULL \
             WHERE EXISTS (SELECT 1 FROM durability_migrations WHERE name = ?)",
            &[split.into(), LEGACY_COMBINED_0004.into()],
        )?;
    }
    Ok(())
}

/// This capability's rows, oldest first.
fn recorded_rows(
    sql: &dyn Sql,
    capability: &str,
) -> Result<Vec<(String, Option<String>)>, StorageError> {
    sql.query(
        "SELECT name, down FROM durability_migrations WHERE capability = ? ORDER BY id",
        &[capability.into()],
    )?
    .iter()
    .map(|row| Ok((row.get::<String>(0)?, row.get::<Option<String>>(1)?)))
    .collect()
}

fn run_script(
    sql: &dyn Sql,
    name: &str,
    direction: Direction,
    script: &str,
) -> Result<(), MigrationError> {
    sql.execute_script(script)
        .map_err(|source| MigrationError::Script {
            name: name.to_owned(),
            direction,
            source,
        })
}

/// The columns of `durability_calls` before 0004, shared by its scripts.
macro_rules! calls_columns {
    () => {
        "id, operation, payload, status, result, attempt, next_attempt_at, last_error, last_error_name, completed_at"
    };
}

/// The original `durability_calls` table body.
macro_rules! calls_0001_body {
    () => {
        "(
  id TEXT PRIMARY KEY,
  operation TEXT NOT NULL,
  payload TEXT NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending', 'completed', 'failed')),
  result TEXT,
  attempt INTEGER NOT NULL DEFAULT 0,
  next_attempt_at INTEGER NOT NULL,
  last_error TEXT,
  last_error_name TEXT,
  completed_at INTEGER
)"
    };
}

/// The current time in milliseconds, in SQL that every SQLite version runs
/// (`unixepoch('subsec')` needs 3.42). Only backfills rows that existed
/// before 0004; the library always writes `created_at` itself.
macro_rules! sql_now_ms {
    () => {
        "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"
    };
}

/// The migrations of durable operations (`durability_calls`, §7.3). Names
/// follow the reference library; 0003 belongs to named alarms.
pub const OPERATIONS_MIGRATIONS: &[Migration] = &[
    Migration {
        name: "durability_0001_create_calls",
        up: concat!("CREATE TABLE durability_calls ", calls_0001_body!(), ";"),
        down: "DROP TABLE durability_calls;",
    },
    Migration {
        name: "durability_0002_pending_index",
        up: "CREATE INDEX durability_calls_pending_idx ON durability_calls (status, next_attempt_at);",
        down: "DROP INDEX durability_calls_pending_idx;",
    },
    Migration {
        name: CALLS_0004,
        // SQLite cannot add a NOT NULL column without a constant default, so
        // the table is rebuilt. Existing rows get a generation of their own
        // ('legacy:' || id) and the migration time as created_at.
        up: concat!(
            "CREATE TABLE durability_calls_0004 (
  id TEXT PRIMARY KEY,
  operation TEXT NOT NULL,
  payload TEXT NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending', 'completed', 'failed')),
  result TEXT,
  attempt INTEGER NOT NULL DEFAULT 0,
  next_attempt_at INTEGER NOT NULL,
  last_error TEXT,
  last_error_name TEXT,
  completed_at INTEGER,
  generation_id TEXT NOT NULL DEFAULT 'legacy',
  created_at INTEGER NOT NULL DEFAULT (",
            sql_now_ms!(),
            ")
);
INSERT INTO durability_calls_0004 (",
            calls_columns!(),
            ", generation_id, created_at)
SELECT ",
            calls_columns!(),
            ", 'legacy:' || id, ",
            sql_now_ms!(),
            " FROM durability_calls;
DROP TABLE durability_calls;
ALTER TABLE durability_calls_0004 RENAME TO durability_calls;
CREATE INDEX durability_calls_pending_idx ON durability_calls (status, next_attempt_at);
CREATE INDEX durability_calls_created_idx ON durability_calls (created_at);"
        ),
        down: concat!(
            "CREATE TABLE durability_calls_0001 ",
            calls_0001_body!(),
            ";
INSERT INTO durability_calls_0001 (",
            calls_columns!(),
            ")
SELECT ",
            calls_columns!(),
            " FROM durability_calls;
DROP TABLE durability_calls;
ALTER TABLE durability_calls_0001 RENAME TO durability_calls;
CREATE INDEX durability_calls_pending_idx ON durability_calls (status, next_attempt_at);"
        ),
    },
];

/// The columns of `durability_alarms` before 0004.
macro_rules! alarms_columns {
    () => {
        "name, generation_id, status, scheduled_at, next_attempt_at, attempt, last_error, last_error_name"
    };
}

/// The original `durability_alarms` table body.
macro_rules! alarms_0003_body {
    () => {
        "(
  name TEXT PRIMARY KEY,
  generation_id TEXT NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending', 'failed')),
  scheduled_at INTEGER NOT NULL,
  next_attempt_at INTEGER NOT NULL,
  attempt INTEGER NOT NULL DEFAULT 0,
  last_error TEXT,
  last_error_name TEXT
)"
    };
}

/// The migrations of named alarms (`durability_alarms`, §8.3).
pub const NAMED_ALARMS_MIGRATIONS: &[Migration] = &[
    Migration {
        name: "durability_0003_create_alarms",
        up: concat!(
            "CREATE TABLE durability_alarms ",
            alarms_0003_body!(),
            ";
CREATE INDEX durability_alarms_pending_idx ON durability_alarms (status, next_attempt_at);"
        ),
        down: "DROP INDEX durability_alarms_pending_idx;
DROP TABLE durability_alarms;",
    },
    Migration {
        name: ALARMS_0004,
        up: concat!(
            "CREATE TABLE durability_alarms_0004 (
  name TEXT PRIMARY KEY,
  generation_id TEXT NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending', 'failed')),
  scheduled_at INTEGER NOT NULL,
  next_attempt_at INTEGER NOT NULL,
  attempt INTEGER NOT NULL DEFAULT 0,
  last_error TEXT,
  last_error_name TEXT,
  created_at INTEGER NOT NULL DEFAULT (",
            sql_now_ms!(),
            ")
);
INSERT INTO durability_alarms_0004 (",
            alarms_columns!(),
            ", created_at)
SELECT ",
            alarms_columns!(),
            ", ",
            sql_now_ms!(),
            " FROM durability_alarms;
DROP TABLE durability_alarms;
ALTER TABLE durability_alarms_0004 RENAME TO durability_alarms;
CREATE INDEX durability_alarms_pending_idx ON durability_alarms (status, next_attempt_at);
CREATE INDEX durability_alarms_created_idx ON durability_alarms (created_at);"
        ),
        down: concat!(
            "CREATE TABLE durability_alarms_0003 ",
            alarms_0003_body!(),
            ";
INSERT INTO durability_alarms_0003 (",
            alarms_columns!(),
            ")
SELECT ",
            alarms_columns!(),
            " FROM durability_alarms;
DROP TABLE durability_alarms;
ALTER TABLE durability_alarms_0003 RENAME TO durability_alarms;
CREATE INDEX durability_alarms_pending_idx ON durability_alarms (status, next_attempt_at);"
        ),
    },
    // Recurring schedules (issue 14), beside the reference's table rather
    // than inside it: `durability_alarms` keeps its shape (and its status
    // CHECK), and holds the one pending occurrence of each schedule as an
    // ordinary row. A database stays readable by the reference library,
    // which sees a one-shot alarm per schedule.
    Migration {
        name: "durability_0014_create_alarm_schedules",
        up: "CREATE TABLE durability_alarm_schedules (
  name TEXT PRIMARY KEY,
  recurrence TEXT NOT NULL,
  payload TEXT,
  paused INTEGER NOT NULL DEFAULT 0,
  missed INTEGER NOT NULL DEFAULT 0,
  placed INTEGER NOT NULL DEFAULT 0,
  runs INTEGER NOT NULL DEFAULT 0,
  last_tick INTEGER,
  created_at INTEGER NOT NULL
);",
        down: "DROP TABLE durability_alarm_schedules;",
    },
];

/// The migrations of fanout (`durability_fanout_*`, queues.md §3.4).
///
/// 0005 creates the reference's three tables with its column names, so a
/// database stays readable by the reference library, but with indexes chosen
/// for this port's queries (see `fanout::store`): the due work of one target
/// is two partial indexes that split the rows in two, first deliveries
/// (`phase = 'delivery' AND attempt = 0`) and everything claimed at least
/// once (`attempt > 0`, dead-letter intent included), each ordered by due
/// time within the target. A pass therefore reads only rows that are due,
/// whatever the backlog, and each row lives in one of the two at a time. The
/// `(status, next_attempt_at)` index answers the scheduler's "earliest
/// pending time". The reference's `created_at` index is left out: nothing of
/// fanout searches by creation time.
///
/// 0009 is this port's departure: terminal deliveries without a DLQ are
/// parked in the object's own table instead of dropped (issue 4). It is a
/// separate migration so that the reference library, which does not know it,
/// sees a schema one migration ahead of it (and may revert it) rather than a
/// different 0005.
pub const FANOUT_MIGRATIONS: &[Migration] = &[
    Migration {
        name: "durability_0005_create_fanout",
        up: "CREATE TABLE durability_fanout_messages (
  key TEXT PRIMARY KEY,
  id TEXT NOT NULL,
  payload TEXT NOT NULL,
  targets TEXT NOT NULL,
  remaining INTEGER NOT NULL,
  seq INTEGER NOT NULL,
  created_at INTEGER NOT NULL,
  generation_id TEXT NOT NULL
);
CREATE TABLE durability_fanout_deliveries (
  id TEXT PRIMARY KEY,
  message_key TEXT NOT NULL,
  target_id TEXT NOT NULL,
  seq INTEGER NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending')),
  phase TEXT NOT NULL CHECK (phase IN ('delivery', 'dead_letter')),
  attempt INTEGER NOT NULL DEFAULT 0,
  next_attempt_at INTEGER NOT NULL,
  last_error TEXT,
  last_error_name TEXT,
  created_at INTEGER NOT NULL,
  generation_id TEXT NOT NULL,
  dead_lettered_at INTEGER,
  dead_letter_reason TEXT CHECK (dead_letter_reason IN ('explicit', 'exhausted'))
);
CREATE INDEX durability_fanout_deliveries_due_idx ON durability_fanout_deliveries (target_id, next_attempt_at, seq) WHERE phase = 'delivery' AND attempt = 0;
CREATE INDEX durability_fanout_deliveries_retry_idx ON durability_fanout_deliveries (target_id, next_attempt_at) WHERE attempt > 0;
CREATE INDEX durability_fanout_deliveries_pending_idx ON durability_fanout_deliveries (status, next_attempt_at);
CREATE TABLE durability_fanout_seq (
  id INTEGER PRIMARY KEY CHECK (id = 1),
  next_seq INTEGER NOT NULL
);
INSERT INTO durability_fanout_seq (id, next_seq) VALUES (1, 0);",
        down: "DROP INDEX durability_fanout_deliveries_pending_idx;
DROP INDEX durability_fanout_deliveries_retry_idx;
DROP INDEX durability_fanout_deliveries_due_idx;
DROP TABLE durability_fanout_deliveries;
DROP TABLE durability_fanout_messages;
DROP TABLE durability_fanout_seq;",
    },
    Migration {
        name: "durability_0009_create_fanout_parked",
        up: "CREATE TABLE durability_fanout_parked (
  id TEXT PRIMARY KEY,
  message_id TEXT NOT NULL,
  message_key TEXT NOT NULL,
  target_id TEXT NOT NULL,
  payload TEXT NOT NULL,
  enqueued_at INTEGER NOT NULL,
  parked_at INTEGER NOT NULL,
  attempts INTEGER NOT NULL,
  reason TEXT NOT NULL CHECK (reason IN ('explicit', 'exhausted')),
  error_name TEXT,
  error_message TEXT
);
CREATE INDEX durability_fanout_parked_at_idx ON durability_fanout_parked (parked_at, id);",
        down: "DROP INDEX durability_fanout_parked_at_idx;
DROP TABLE durability_fanout_parked;",
    },
    Migration {
        name: "durability_0013_fanout_cursors",
        up: FANOUT_CURSORS_UP,
        down: FANOUT_CURSORS_DOWN,
    },
    // Issue 14: a target's durable pause (flow control). A paused target's
    // cursor, claims and exception rows stay as they are; nothing of it is
    // claimed and it arms no alarm until it is resumed.
    Migration {
        name: "durability_0015_fanout_paused_targets",
        up: "ALTER TABLE durability_fanout_cursors ADD COLUMN paused INTEGER NOT NULL DEFAULT 0;",
        down: "ALTER TABLE durability_fanout_cursors DROP COLUMN paused;",
    },
];

/// The owed deliveries of the cursor layout, in the columns of the table it
/// replaced (`durability_fanout_deliveries`, a view from 0013 on): every
/// pending exception row, and every message of a target's spans at or after
/// its cursor that has no exception row. Readers (tools, tests, the memo
/// ownership check, the down script) see the reference layout; nothing
/// writes through it.
macro_rules! fanout_owed_view {
    () => {
        "CREATE VIEW durability_fanout_deliveries AS
SELECT id, message_key, target_id, seq, status, phase, attempt, next_attempt_at, last_error,
  last_error_name, created_at, generation_id, dead_lettered_at, dead_letter_reason
FROM durability_fanout_exceptions WHERE status = 'pending'
UNION ALL
SELECT json_array(m.key, s.target_id), m.key, s.target_id, m.seq, 'pending', 'delivery',
  CASE WHEN c.claim_end IS NOT NULL AND m.seq < c.claim_end THEN c.claim_attempt ELSE 0 END,
  CASE WHEN c.claim_end IS NOT NULL AND m.seq < c.claim_end THEN c.claim_deadline
    ELSE max(s.due_at, c.paused_until) END,
  NULL, NULL, m.created_at, m.generation_id, NULL, NULL
FROM durability_fanout_spans s
JOIN durability_fanout_cursors c ON c.target_id = s.target_id
JOIN durability_fanout_messages m ON m.seq >= max(s.first_seq, c.next_seq) AND m.seq <= s.last_seq
WHERE NOT EXISTS (SELECT 1 FROM durability_fanout_exceptions e
  WHERE e.seq = m.seq AND e.target_id = s.target_id);"
    };
}

/// 0013 (issue 13): per-target cursors, rows only for exceptions. Every
/// delivery row of the old layout (first deliveries, retries, dead-letter
/// intent) becomes an exception row with its attempt, due time, errors and
/// generation unchanged, so nothing is delivered twice or lost; the
/// messages keep their keys, sequences and generations; parked entries and
/// memos are untouched (the memos' `record_table` is the view's name, and
/// each owed delivery keeps its id). Old rows then drain through the retry
/// lane, after new first deliveries; each target's cursor starts behind
/// every carried message, so none of them is handed over twice.
///
/// It rebuilds `durability_fanout_messages`, but a second run cannot: its
/// first statement creates `durability_fanout_exceptions`, which fails on
/// the existing table before any row is touched.
const FANOUT_CURSORS_UP: &str = concat!(
    "CREATE TABLE durability_fanout_exceptions (
  id TEXT PRIMARY KEY,
  message_key TEXT NOT NULL,
  target_id TEXT NOT NULL,
  seq INTEGER NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending', 'settled')),
  phase TEXT NOT NULL CHECK (phase IN ('delivery', 'dead_letter')),
  attempt INTEGER NOT NULL DEFAULT 0,
  next_attempt_at INTEGER NOT NULL,
  last_error TEXT,
  last_error_name TEXT,
  created_at INTEGER NOT NULL,
  generation_id TEXT NOT NULL,
  dead_lettered_at INTEGER,
  dead_letter_reason TEXT CHECK (dead_letter_reason IN ('explicit', 'exhausted'))
);
INSERT INTO durability_fanout_exceptions (id, message_key, target_id, seq, status, phase, attempt,
  next_attempt_at, last_error, last_error_name, created_at, generation_id, dead_lettered_at,
  dead_letter_reason)
SELECT id, message_key, target_id, seq, 'pending', phase, attempt, next_attempt_at, last_error,
  last_error_name, created_at, generation_id, dead_lettered_at, dead_letter_reason
FROM durability_fanout_deliveries;
CREATE INDEX durability_fanout_exceptions_due_idx ON durability_fanout_exceptions (target_id, next_attempt_at) WHERE status = 'pending';
CREATE INDEX durability_fanout_exceptions_next_idx ON durability_fanout_exceptions (next_attempt_at) WHERE status = 'pending';
CREATE INDEX durability_fanout_exceptions_seq_idx ON durability_fanout_exceptions (seq, target_id);
CREATE TABLE durability_fanout_cursors (
  target_id TEXT PRIMARY KEY,
  next_seq INTEGER NOT NULL,
  claim_end INTEGER,
  claim_attempt INTEGER NOT NULL DEFAULT 0,
  claim_deadline INTEGER,
  paused_until INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
INSERT INTO durability_fanout_cursors (target_id, next_seq)
SELECT DISTINCT target_id, (SELECT next_seq FROM durability_fanout_seq WHERE id = 1)
FROM durability_fanout_deliveries;
CREATE TABLE durability_fanout_spans (
  target_id TEXT NOT NULL,
  first_seq INTEGER NOT NULL,
  last_seq INTEGER NOT NULL,
  due_at INTEGER NOT NULL,
  PRIMARY KEY (target_id, first_seq)
) WITHOUT ROWID;
CREATE INDEX durability_fanout_spans_seq_idx ON durability_fanout_spans (first_seq);
CREATE TABLE durability_fanout_messages_0013 (
  seq INTEGER PRIMARY KEY,
  key TEXT NOT NULL UNIQUE,
  id TEXT NOT NULL,
  payload TEXT NOT NULL,
  targets TEXT NOT NULL,
  created_at INTEGER NOT NULL,
  generation_id TEXT NOT NULL
);
INSERT INTO durability_fanout_messages_0013 (seq, key, id, payload, targets, created_at, generation_id)
SELECT seq, key, id, payload, targets, created_at, generation_id FROM durability_fanout_messages;
DROP TABLE durability_fanout_messages;
ALTER TABLE durability_fanout_messages_0013 RENAME TO durability_fanout_messages;
DROP INDEX durability_fanout_deliveries_pending_idx;
DROP INDEX durability_fanout_deliveries_retry_idx;
DROP INDEX durability_fanout_deliveries_due_idx;
DROP TABLE durability_fanout_deliveries;
",
    fanout_owed_view!()
);

/// Back to one row per owed delivery: the view's rows become the table
/// (in-flight first deliveries keep their claimed attempt and deadline;
/// delivered ones waiting for their cursor are gone), and each message
/// still owed gets its `remaining` count; messages owed to nobody go.
const FANOUT_CURSORS_DOWN: &str = "CREATE TABLE durability_fanout_deliveries_0005 (
  id TEXT PRIMARY KEY,
  message_key TEXT NOT NULL,
  target_id TEXT NOT NULL,
  seq INTEGER NOT NULL,
  status TEXT NOT NULL CHECK (status IN ('pending')),
  phase TEXT NOT NULL CHECK (phase IN ('delivery', 'dead_letter')),
  attempt INTEGER NOT NULL DEFAULT 0,
  next_attempt_at INTEGER NOT NULL,
  last_error TEXT,
  last_error_name TEXT,
  created_at INTEGER NOT NULL,
  generation_id TEXT NOT NULL,
  dead_lettered_at INTEGER,
  dead_letter_reason TEXT CHECK (dead_letter_reason IN ('explicit', 'exhausted'))
);
INSERT INTO durability_fanout_deliveries_0005 (id, message_key, target_id, seq, status, phase,
  attempt, next_attempt_at, last_error, last_error_name, created_at, generation_id,
  dead_lettered_at, dead_letter_reason)
SELECT id, message_key, target_id, seq, status, phase, attempt, next_attempt_at, last_error,
  last_error_name, created_at, generation_id, dead_lettered_at, dead_letter_reason
FROM durability_fanout_deliveries;
CREATE TABLE durability_fanout_messages_0005 (
  key TEXT PRIMARY KEY,
  id TEXT NOT NULL,
  payload TEXT NOT NULL,
  targets TEXT NOT NULL,
  remaining INTEGER NOT NULL,
  seq INTEGER NOT NULL,
  created_at INTEGER NOT NULL,
  generation_id TEXT NOT NULL
);
INSERT INTO durability_fanout_messages_0005 (key, id, payload, targets, remaining, seq, created_at,
  generation_id)
SELECT m.key, m.id, m.payload, m.targets, owed.n, m.seq, m.created_at, m.generation_id
FROM durability_fanout_messages m
JOIN (SELECT message_key, COUNT(*) AS n FROM durability_fanout_deliveries_0005
  GROUP BY message_key) owed ON owed.message_key = m.key;
DROP VIEW durability_fanout_deliveries;
DROP INDEX durability_fanout_spans_seq_idx;
DROP TABLE durability_fanout_spans;
DROP TABLE durability_fanout_cursors;
DROP INDEX durability_fanout_exceptions_seq_idx;
DROP INDEX durability_fanout_exceptions_next_idx;
DROP INDEX durability_fanout_exceptions_due_idx;
DROP TABLE durability_fanout_exceptions;
DROP TABLE durability_fanout_messages;
ALTER TABLE durability_fanout_messages_0005 RENAME TO durability_fanout_messages;
ALTER TABLE durability_fanout_deliveries_0005 RENAME TO durability_fanout_deliveries;
CREATE INDEX durability_fanout_deliveries_due_idx ON durability_fanout_deliveries (target_id, next_attempt_at, seq) WHERE phase = 'delivery' AND attempt = 0;
CREATE INDEX durability_fanout_deliveries_retry_idx ON durability_fanout_deliveries (target_id, next_attempt_at) WHERE attempt > 0;
CREATE INDEX durability_fanout_deliveries_pending_idx ON durability_fanout_deliveries (status, next_attempt_at);";

/// The migrations of the retained log (§5.4, capability `log`).
///
/// `durability_log_records` always holds one dense run of offsets (appends
/// add at the end, trims remove from the front), so its row count is
/// `next_offset - MIN("offset")` and is never counted. The reference's
/// `(appended_at, "offset")` index is left out: no query of this port
/// searches by time (trim walks the oldest offsets), so it would only cost a
/// write per record. `durability_log_cursors_offset_idx` answers the slowest
/// cursor (`load`) without scanning every consumer.
pub const LOG_MIGRATIONS: &[Migration] = &[Migration {
    name: "durability_0006_create_log",
    up: "CREATE TABLE durability_log_records (
  \"offset\" INTEGER PRIMARY KEY,
  dedup_key TEXT NOT NULL UNIQUE,
  payload TEXT NOT NULL,
  bytes INTEGER NOT NULL,
  appended_at INTEGER NOT NULL
);
CREATE TABLE durability_log_cursors (
  consumer TEXT PRIMARY KEY,
  \"offset\" INTEGER NOT NULL,
  committed_at INTEGER NOT NULL
);
CREATE INDEX durability_log_cursors_offset_idx ON durability_log_cursors (\"offset\");
CREATE TABLE durability_log_segments (
  first_offset INTEGER PRIMARY KEY,
  last_offset INTEGER NOT NULL,
  locator TEXT NOT NULL,
  bytes INTEGER NOT NULL,
  flushed_at INTEGER NOT NULL
);
CREATE TABLE durability_log_seq (
  id INTEGER PRIMARY KEY CHECK (id = 1),
  next_offset INTEGER NOT NULL,
  total_bytes INTEGER NOT NULL
);
INSERT INTO durability_log_seq (id, next_offset, total_bytes) VALUES (1, 0, 0);",
    down: "DROP TABLE durability_log_seq;
DROP TABLE durability_log_segments;
DROP INDEX durability_log_cursors_offset_idx;
DROP TABLE durability_log_cursors;
DROP TABLE durability_log_records;",
}];

/// The migrations of the log's consumer leases (§5.4, capability
/// `logLeases`), applied only when a log is built with leases.
///
/// A nacked range is stored as `pending` with `expires_at = 0`, so the
/// claim index returns a consumer's owed ranges already ordered by
/// `first_offset`.
pub const LOG_LEASES_MIGRATIONS: &[Migration] = &[Migration {
    name: "durability_0007_create_log_leases",
    up: "CREATE TABLE durability_log_leases (
  batch_id TEXT PRIMARY KEY,
  consumer TEXT NOT NULL,
  first_offset INTEGER NOT NULL,
  last_offset INTEGER NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('active', 'pending', 'acked', 'skipped')),
  attempt INTEGER NOT NULL CHECK (attempt >= 1),
  expires_at INTEGER NOT NULL,
  created_at INTEGER NOT NULL
);
CREATE INDEX durability_log_leases_claim_idx ON durability_log_leases (consumer, state, expires_at, first_offset);
CREATE INDEX durability_log_leases_order_idx ON durability_log_leases (consumer, first_offset);
CREATE TABLE durability_log_allocations (
  consumer TEXT PRIMARY KEY,
  allocated_offset INTEGER NOT NULL
);",
    down: "DROP TABLE durability_log_allocations;
DROP INDEX durability_log_leases_order_idx;
DROP INDEX durability_log_leases_claim_idx;
DROP TABLE durability_log_leases;",
}];
