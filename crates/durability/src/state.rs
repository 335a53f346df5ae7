//! Read-only views of what each capability holds in an object's database,
//! for dashboards, `durability inspect` and admin tools.
//!
//! [`read`] takes any [`Sql`] (a read-only connection to an object's file
//! is enough: the host's `inspect::read_object` gives one), so a running
//! application and an offline tool see the same figures without
//! constructing the object. It only reads; every list is capped by a
//! `LIMIT`, and a capability whose tables do not exist is `None`.
//!
//! The queries of all capabilities are kept together here rather than in
//! each store module: they are the one place that turns the tables into a
//! picture, and a schema change that breaks them fails the dashboard's
//! tests. They are not on any hot path: the counts here (`count(*)` per
//! target or status) scan a backlog, which a dashboard refreshing every few
//! seconds can afford and a delivery pass could not.

use std::collections::BTreeMap;

use durability_platform::{EpochMs, Sql, StorageError, params};
use serde::Serialize;

/// Lists (parked deliveries, upcoming alarms, failed operations) show at
/// most this many entries.
pub const MAX_LISTED: usize = 20;

/// What the capabilities of one object hold.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CapabilityState {
    /// Fanout deliveries, if the object has a fanout.
    pub fanout: Option<FanoutState>,
    /// Durable operations, if the object has them.
    pub operations: Option<OperationsState>,
    /// Named alarms, if the object has them.
    pub alarms: Option<AlarmsState>,
    /// The retained log, if the object has one.
    pub log: Option<LogState>,
}

/// A fanout's backlog per target and its parked dead letters.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FanoutState {
    /// Messages accepted and not yet settled by every target.
    pub messages: u64,
    /// One entry per target with deliveries owed or parked.
    pub targets: Vec<TargetState>,
    /// The most recently parked deliveries (newest first).
    pub parked: Vec<ParkedDelivery>,
}

/// One fanout target's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TargetState {
    /// The target's name.
    pub target: String,
    /// Deliveries owed (first delivery, retry or dead-letter write pending).
    pub backlog: u64,
    /// Of those, deliveries that failed at least once and wait for a retry.
    pub retrying: u64,
    /// Of those, deliveries waiting for their dead-letter queue write.
    pub dead_lettering: u64,
    /// Deliveries parked in the object (dead-lettered without a DLQ).
    pub parked: u64,
    /// The last error of an owed delivery that failed, if any.
    pub last_error: Option<String>,
}

/// A parked dead letter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParkedDelivery {
    /// The parked entry's id (what `redrive_parked`/`purge_parked` take).
    pub id: String,
    /// The message's id.
    pub message_id: String,
    /// The target it was for.
    pub target: String,
    /// Attempts made.
    pub attempts: u32,
    /// `explicit` (the consumer dead-lettered it) or `exhausted`.
    pub reason: String,
    /// The last error, `Name: message`.
    pub error: Option<String>,
    /// When it was parked, epoch ms.
    pub parked_at: EpochMs,
}

/// Durable operations by status.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OperationsState {
    /// Count per status (`pending`, `completed`, `failed`).
    pub by_status: BTreeMap<String, u64>,
    /// Count per operation name and status.
    pub by_operation: Vec<OperationCount>,
    /// The most recent failures (newest first).
    pub failed: Vec<FailedOperation>,
}

/// How many operations of one name have one status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OperationCount {
    /// The operation's name.
    pub operation: String,
    /// `pending`, `completed` or `failed`.
    pub status: String,
    /// How many.
    pub count: u64,
}

/// An operation that failed for good.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FailedOperation {
    /// The operation's id.
    pub id: String,
    /// The operation's name.
    pub operation: String,
    /// Attempts made.
    pub attempts: u32,
    /// The last error, `Name: message`.
    pub error: Option<String>,
    /// When it failed, epoch ms.
    pub failed_at: Option<EpochMs>,
}

/// Named alarms, the next ones first.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AlarmsState {
    /// How many named alarms are pending.
    pub pending: u64,
    /// How many failed for good.
    pub failed: u64,
    /// The pending alarms that run next, soonest first.
    pub upcoming: Vec<UpcomingAlarm>,
}

/// A pending named alarm.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UpcomingAlarm {
    /// The alarm's name.
    pub name: String,
    /// The time it was scheduled for, epoch ms.
    pub scheduled_at: EpochMs,
    /// When its next attempt runs (later than `scheduled_at` after a
    /// failure), epoch ms.
    pub next_attempt_at: EpochMs,
    /// Attempts made so far.
    pub attempts: u32,
    /// The last attempt's error, `Name: message`.
    pub last_error: Option<String>,
}

/// A retained log's bounds and its consumers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LogState {
    /// The oldest readable offset (hot or cold).
    pub oldest_offset: u64,
    /// The offset the next append gets.
    pub next_offset: u64,
    /// Records in the hot table.
    pub hot_records: u64,
    /// Cold segments indexed.
    pub cold_segments: u64,
    /// Every consumer, with how far behind the end it is.
    pub consumers: Vec<ConsumerState>,
}

/// A log consumer's cursor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConsumerState {
    /// The consumer's name.
    pub consumer: String,
    /// Its committed offset (the next it reads).
    pub offset: u64,
    /// `next_offset - offset`: records it has not committed yet.
    pub lag: u64,
}

/// Reads what every capability of the object behind `sql` holds.
pub fn read(sql: &dyn Sql) -> Result<CapabilityState, StorageError> {
    let tables: Vec<String> = sql
        .query(
            "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') \
             AND name LIKE 'durability\\_%' ESCAPE '\\'",
            &[],
        )?
        .iter()
        .map(|row| row.get::<String>(0))
        .collect::<Result<_, _>>()?;
    // Views count: since migration 0013, durability_fanout_deliveries is a
    // view of the owed deliveries over the cursor layout.
    let has = |table: &str| tables.iter().any(|t| t == table);
    Ok(CapabilityState {
        fanout: if has("durability_fanout_deliveries") {
            Some(fanout(sql, has("durability_fanout_parked"))?)
        } else {
            None
        },
        operations: if has("durability_calls") {
            Some(operations(sql)?)
        } else {
            None
        },
        alarms: if has("durability_alarms") {
            Some(alarms(sql)?)
        } else {
            None
        },
        log: if has("durability_log_seq") {
            Some(log(sql)?)
        } else {
            None
        },
    })
}

fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

fn error_text(name: Option<String>, message: Option<String>) -> Option<String> {
    match (name, message) {
        (Some(name), Some(message)) => Some(format!("{name}: {message}")),
        (None, Some(message)) => Some(message),
        (Some(name), None) => Some(name),
        (None, None) => None,
    }
}

fn fanout(sql: &dyn Sql, has_parked: bool) -> Result<FanoutState, StorageError> {
    let mut targets: BTreeMap<String, TargetState> = BTreeMap::new();
    for row in sql.query(
        "SELECT target_id, count(*), \
                sum(CASE WHEN attempt > 0 AND phase = 'delivery' THEN 1 ELSE 0 END), \
                sum(CASE WHEN phase = 'dead_letter' THEN 1 ELSE 0 END) \
         FROM durability_fanout_deliveries GROUP BY target_id",
        &[],
    )? {
        let target: String = row.get(0)?;
        targets.insert(
            target.clone(),
            TargetState {
                target,
                backlog: count(row.get(1)?),
                retrying: count(row.get::<Option<i64>>(2)?.unwrap_or(0)),
                dead_lettering: count(row.get::<Option<i64>>(3)?.unwrap_or(0)),
                ..TargetState::default()
            },
        );
    }
    for target in targets.values_mut() {
        // The newest error among the target's owed deliveries.
        let row = sql.query_row(
            "SELECT last_error_name, last_error FROM durability_fanout_deliveries \
             WHERE target_id = ? AND last_error IS NOT NULL \
             ORDER BY next_attempt_at DESC LIMIT 1",
            &params![target.target.as_str()],
        )?;
        if let Some(row) = row {
            target.last_error = error_text(row.get(0)?, row.get(1)?);
        }
    }
    let mut parked = Vec::new();
    if has_parked {
        for row in sql.query(
            "SELECT target_id, count(*) FROM durability_fanout_parked GROUP BY target_id",
            &[],
        )? {
            let target: String = row.get(0)?;
            targets
                .entry(target.clone())
                .or_insert_with(|| TargetState {
                    target,
                    ..TargetState::default()
                })
                .parked = count(row.get(1)?);
        }
        // Newest first through durability_fanout_parked_at_idx.
        for row in sql.query(
            "SELECT id, message_id, target_id, attempts, reason, error_name, error_message, parked_at \
             FROM durability_fanout_parked ORDER BY parked_at DESC, id DESC LIMIT ?",
            &params![MAX_LISTED as i64],
        )? {
            parked.push(ParkedDelivery {
                id: row.get(0)?,
                message_id: row.get(1)?,
                target: row.get(2)?,
                attempts: u32::try_from(row.get::<i64>(3)?).unwrap_or(0),
                reason: row.get(4)?,
                error: error_text(row.get(5)?, row.get(6)?),
                parked_at: row.get(7)?,
            });
        }
    }
    let messages = sql
        .query_row("SELECT count(*) FROM durability_fanout_messages", &[])?
        .map_or(Ok(0), |row| row.get::<i64>(0))?;
    Ok(FanoutState {
        messages: count(messages),
        targets: targets.into_values().collect(),
        parked,
    })
}

fn operations(sql: &dyn Sql) -> Result<OperationsState, StorageError> {
    let mut state = OperationsState::default();
    for row in sql.query(
        "SELECT operation, status, count(*) FROM durability_calls \
         GROUP BY operation, status ORDER BY operation, status",
        &[],
    )? {
        let entry = OperationCount {
            operation: row.get(0)?,
            status: row.get(1)?,
            count: count(row.get(2)?),
        };
        *state.by_status.entry(entry.status.clone()).or_insert(0) += entry.count;
        state.by_operation.push(entry);
    }
    for row in sql.query(
        "SELECT id, operation, attempt, last_error_name, last_error, completed_at \
         FROM durability_calls WHERE status = 'failed' \
         ORDER BY completed_at DESC LIMIT ?",
        &params![MAX_LISTED as i64],
    )? {
        state.failed.push(FailedOperation {
            id: row.get(0)?,
            operation: row.get(1)?,
            attempts: u32::try_from(row.get::<i64>(2)?).unwrap_or(0),
            error: error_text(row.get(3)?, row.get(4)?),
            failed_at: row.get(5)?,
        });
    }
    Ok(state)
}

fn alarms(sql: &dyn Sql) -> Result<AlarmsState, StorageError> {
    let mut state = AlarmsState::default();
    for row in sql.query(
        "SELECT status, count(*) FROM durability_alarms GROUP BY status",
        &[],
    )? {
        let status: String = row.get(0)?;
        let n = count(row.get(1)?);
        match status.as_str() {
            "pending" => state.pending = n,
            _ => state.failed += n,
        }
    }
    // Covered by durability_alarms_pending_idx (status, next_attempt_at).
    for row in sql.query(
        "SELECT name, scheduled_at, next_attempt_at, attempt, last_error_name, last_error \
         FROM durability_alarms WHERE status = 'pending' \
         ORDER BY next_attempt_at ASC LIMIT ?",
        &params![MAX_LISTED as i64],
    )? {
        state.upcoming.push(UpcomingAlarm {
            name: row.get(0)?,
            scheduled_at: row.get(1)?,
            next_attempt_at: row.get(2)?,
            attempts: u32::try_from(row.get::<i64>(3)?).unwrap_or(0),
            last_error: error_text(row.get(4)?, row.get(5)?),
        });
    }
    Ok(state)
}

fn log(sql: &dyn Sql) -> Result<LogState, StorageError> {
    let next_offset = sql
        .query_row(
            "SELECT next_offset FROM durability_log_seq WHERE id = 1",
            &[],
        )?
        .map_or(Ok(0), |row| row.get::<i64>(0))?;
    let next_offset = count(next_offset);
    let hot = sql
        .query_row(
            "SELECT min(\"offset\"), count(*) FROM durability_log_records",
            &[],
        )?
        .map_or(Ok((None, 0)), |row| {
            Ok::<_, StorageError>((row.get::<Option<i64>>(0)?, row.get::<i64>(1)?))
        })?;
    let cold = sql
        .query_row(
            "SELECT min(first_offset), count(*) FROM durability_log_segments",
            &[],
        )?
        .map_or(Ok((None, 0)), |row| {
            Ok::<_, StorageError>((row.get::<Option<i64>>(0)?, row.get::<i64>(1)?))
        })?;
    let oldest = match (cold.0, hot.0) {
        (Some(cold), _) => count(cold),
        (None, Some(hot)) => count(hot),
        (None, None) => next_offset,
    };
    let mut consumers = Vec::new();
    for row in sql.query(
        "SELECT consumer, \"offset\" FROM durability_log_cursors ORDER BY consumer",
        &[],
    )? {
        let offset = count(row.get(1)?);
        consumers.push(ConsumerState {
            consumer: row.get(0)?,
            offset,
            lag: next_offset.saturating_sub(offset),
        });
    }
    Ok(LogState {
        oldest_offset: oldest,
        next_offset,
        hot_records: count(hot.1),
        cold_segments: count(cold.1),
        consumers,
    })
}
