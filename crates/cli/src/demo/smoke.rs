//! The demo's workload until the mailbox service exists: a smoke run of the
//! object host. It creates a few `notebook` objects, writes rows in each,
//! sets each object's alarm a moment ahead in the same transaction as the
//! row that remembers it, waits until every alarm has fired, and reads the
//! counts back.

use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use durability_host::{BoxError, DurableObject, Host, ObjectContext};
use durability_platform::{AlarmInfo, Context, EpochMs, StorageError, StorageExt, params};
use tokio::sync::mpsc;

use super::{DemoError, Summary};

const NAMESPACE: &str = "notebooks";

/// Rows each object writes per run, in one transaction.
const NOTES_PER_OBJECT: i64 = 5;

/// The first alarm is due this long after it is set; each further object's
/// is [`ALARM_STAGGER_MS`] later, so the alarms fire one after another.
const ALARM_DELAY_MS: EpochMs = 200;
const ALARM_STAGGER_MS: EpochMs = 50;

/// How long the demo waits for its alarms beyond the last one's due time.
const ALARM_WAIT_SLACK: Duration = Duration::from_secs(30);

/// The migration each notebook runs when it is constructed.
const SCHEMA_SQL: &str = "
    CREATE TABLE IF NOT EXISTS notes (
        id INTEGER PRIMARY KEY,
        written_at_ms INTEGER NOT NULL,
        body TEXT NOT NULL
    );
    CREATE TABLE IF NOT EXISTS reminder (
        slot INTEGER PRIMARY KEY CHECK (slot = 0),
        due_at_ms INTEGER NOT NULL
    );
    CREATE TABLE IF NOT EXISTS alarm_runs (
        id INTEGER PRIMARY KEY,
        due_at_ms INTEGER NOT NULL,
        fired_at_ms INTEGER NOT NULL,
        retry_count INTEGER NOT NULL
    );";

/// An alarm that fired, as the notebook reports it to the demo.
#[derive(Debug)]
struct Fired {
    name: String,
    due_at_ms: EpochMs,
    fired_at_ms: EpochMs,
}

/// A small object with notes, one reminder and a log of its alarm runs.
struct Notebook {
    ctx: ObjectContext,
    fired: mpsc::UnboundedSender<Fired>,
}

impl Notebook {
    /// Writes this run's notes and sets the reminder; the alarm and the
    /// reminder row commit together, so the handler always finds the row.
    async fn write_and_remind(&self, due_at_ms: EpochMs) -> Result<(), StorageError> {
        let now_ms = self.ctx.now_ms();
        self.ctx
            .storage()
            .transaction(|txn| {
                for n in 0..NOTES_PER_OBJECT {
                    txn.execute(
                        "INSERT INTO notes (written_at_ms, body) VALUES (?1, ?2)",
                        &params![now_ms, format!("note {n}")],
                    )?;
                }
                txn.execute(
                    "INSERT OR REPLACE INTO reminder (slot, due_at_ms) VALUES (0, ?1)",
                    &params![due_at_ms],
                )?;
                txn.set_alarm(due_at_ms)
            })
            .await
    }

    /// (notes stored, alarm runs logged), over every run on this directory.
    fn counts(&self) -> Result<(i64, i64), StorageError> {
        let storage = self.ctx.storage();
        let count = |sql| -> Result<i64, StorageError> {
            storage.query_row(sql, &[])?.map_or(Ok(0), |row| row.get(0))
        };
        Ok((
            count("SELECT count(*) FROM notes")?,
            count("SELECT count(*) FROM alarm_runs")?,
        ))
    }
}

impl DurableObject for Notebook {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        let fired_at_ms = self.ctx.now_ms();
        let storage = self.ctx.storage();
        let Some(row) = storage.query_row("SELECT due_at_ms FROM reminder WHERE slot = 0", &[])?
        else {
            return Ok(());
        };
        let due_at_ms: EpochMs = row.get(0)?;
        storage.transaction_sync(|sql| -> Result<(), StorageError> {
            sql.execute("DELETE FROM reminder WHERE slot = 0", &[])?;
            sql.execute(
                "INSERT INTO alarm_runs (due_at_ms, fired_at_ms, retry_count) VALUES (?1, ?2, ?3)",
                &params![due_at_ms, fired_at_ms, info.retry_count],
            )?;
            Ok(())
        })?;
        // No receiver only when the demo already stopped waiting.
        let _ = self.fired.send(Fired {
            name: self.ctx.name().unwrap_or_default().to_owned(),
            due_at_ms,
            fired_at_ms,
        });
        Ok(())
    }
}

/// Runs the smoke workload on `objects` notebooks of `host`.
pub async fn run(host: &Host, objects: usize) -> Result<Summary, DemoError> {
    let started = Instant::now();
    let (fired_tx, mut fired_rx) = mpsc::unbounded_channel();
    let notebooks = host.namespace::<Notebook>(NAMESPACE, move |ctx| {
        ctx.storage().execute_script(SCHEMA_SQL)?;
        Ok(Notebook {
            ctx,
            fired: fired_tx.clone(),
        })
    })?;

    let mut expected: HashMap<String, EpochMs> = HashMap::new();
    let mut stubs = Vec::with_capacity(objects);
    let first_due_ms = host.now_ms() + ALARM_DELAY_MS;
    for i in 0..objects {
        let name = format!("notebook-{i}");
        let stub = notebooks.stub(&name)?;
        let due_at_ms = first_due_ms + ALARM_STAGGER_MS * i64::try_from(i).unwrap_or(0);
        stub.call(move |notebook: Rc<Notebook>| async move {
            notebook.write_and_remind(due_at_ms).await
        })
        .await??;
        expected.insert(name, due_at_ms);
        stubs.push(stub);
    }

    // Wait for this run's alarms. A reminder left by an interrupted earlier
    // run may fire too; it is logged but not waited for.
    let last_due_ms = expected.values().copied().max().unwrap_or(first_due_ms);
    let wait = Duration::from_millis(u64::try_from(last_due_ms - host.now_ms()).unwrap_or(0))
        + ALARM_WAIT_SLACK;
    let deadline = tokio::time::Instant::now() + wait;
    let mut fired = 0_usize;
    let mut lateness_max_ms: EpochMs = 0;
    while fired < objects {
        match tokio::time::timeout_at(deadline, fired_rx.recv()).await {
            Ok(Some(event)) => {
                if expected.get(&event.name) == Some(&event.due_at_ms) {
                    expected.remove(&event.name);
                    fired += 1;
                    lateness_max_ms = lateness_max_ms.max(event.fired_at_ms - event.due_at_ms);
                }
            }
            Ok(None) | Err(_) => {
                return Err(DemoError::AlarmsMissing {
                    fired,
                    expected: objects,
                    waited_s: wait.as_secs(),
                });
            }
        }
    }

    let mut notes_stored = 0;
    let mut alarm_runs = 0;
    for stub in &stubs {
        let (notes, runs) = stub
            .call(|notebook: Rc<Notebook>| async move { notebook.counts() })
            .await??;
        notes_stored += notes;
        alarm_runs += runs;
    }

    let mut summary = Summary::default();
    summary.field(
        "data_dir",
        "data directory",
        host.data_dir().display().to_string(),
    );
    summary.field("objects", "objects", objects);
    summary.field(
        "notes_written",
        "notes written this run",
        NOTES_PER_OBJECT * i64::try_from(objects).unwrap_or(0),
    );
    summary.field("notes_stored", "notes stored (all runs)", notes_stored);
    summary.field("alarms_set", "alarms set this run", objects);
    summary.field("alarms_fired", "alarms fired this run", fired);
    summary.field(
        "alarm_runs_stored",
        "alarm runs logged (all runs)",
        alarm_runs,
    );
    summary.field(
        "alarm_lateness_max_ms",
        "latest alarm, ms after due",
        lateness_max_ms,
    );
    summary.field(
        "elapsed_ms",
        "elapsed ms",
        u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    );
    Ok(summary)
}
