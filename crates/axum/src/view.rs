//! What the page and the JSON endpoints show: every object of a data
//! directory with its capabilities' state, read without constructing any.

use std::path::Path;

use durability::state::{self, CapabilityState};
use durability_host::inspect::{self, ObjectSummary};
use serde::Serialize;

/// One object: where it lives and what its capabilities hold.
#[derive(Debug, Clone, Serialize)]
pub struct ObjectView {
    /// The object id (its file's name).
    pub id: String,
    /// The namespace recorded in its file.
    pub namespace: Option<String>,
    /// The object's name, if recorded.
    pub name: Option<String>,
    /// Its alarm, epoch ms, if set.
    pub alarm_ms: Option<i64>,
    /// Bytes on disk (database and write-ahead log).
    pub file_bytes: u64,
    /// What each capability holds (a capability the object does not use is
    /// `null`).
    pub capabilities: CapabilityState,
    /// Why the file (or a capability's tables) could not be read.
    pub error: Option<String>,
}

/// Totals over every object, for the page's header.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Overview {
    /// Objects in the data directory.
    pub objects: usize,
    /// Fanout deliveries owed, all targets.
    pub backlog: u64,
    /// Deliveries waiting for a retry.
    pub retrying: u64,
    /// Parked dead letters.
    pub parked: u64,
    /// Operations pending.
    pub operations_pending: u64,
    /// Operations failed for good.
    pub operations_failed: u64,
    /// Named alarms pending.
    pub alarms_pending: u64,
    /// The largest lag of any log consumer.
    pub max_consumer_lag: u64,
    /// Objects whose file could not be read.
    pub unreadable: usize,
}

/// Lists every object of `data_dir` with its state (blocking file reads).
pub fn objects(data_dir: &Path) -> Result<Vec<ObjectView>, String> {
    let summaries = inspect::list_objects(data_dir).map_err(|e| e.to_string())?;
    Ok(summaries
        .into_iter()
        .map(|summary| view(data_dir, summary))
        .collect())
}

fn view(data_dir: &Path, summary: ObjectSummary) -> ObjectView {
    let mut error = summary.error;
    let mut capabilities = CapabilityState::default();
    if error.is_none() {
        match inspect::read_object(data_dir, &summary.id, state::read) {
            Ok(Some(Ok(state))) => capabilities = state,
            Ok(Some(Err(e))) | Err(e) => error = Some(e.to_string()),
            Ok(None) => error = Some("the object's file disappeared".into()),
        }
    }
    ObjectView {
        id: summary.id,
        namespace: summary.namespace,
        name: summary.name,
        alarm_ms: summary.alarm_ms,
        file_bytes: summary.file_bytes,
        capabilities,
        error,
    }
}

/// Totals over `objects`.
pub fn overview(objects: &[ObjectView]) -> Overview {
    let mut o = Overview {
        objects: objects.len(),
        ..Overview::default()
    };
    for object in objects {
        if object.error.is_some() {
            o.unreadable += 1;
        }
        let c = &object.capabilities;
        if let Some(fanout) = &c.fanout {
            for t in &fanout.targets {
                o.backlog += t.backlog;
                o.retrying += t.retrying;
                o.parked += t.parked;
            }
        }
        if let Some(ops) = &c.operations {
            o.operations_pending += ops.by_status.get("pending").copied().unwrap_or(0);
            o.operations_failed += ops.by_status.get("failed").copied().unwrap_or(0);
        }
        if let Some(alarms) = &c.alarms {
            o.alarms_pending += alarms.pending;
        }
        if let Some(log) = &c.log {
            for consumer in &log.consumers {
                o.max_consumer_lag = o.max_consumer_lag.max(consumer.lag);
            }
        }
    }
    o
}
