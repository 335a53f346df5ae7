//! Fixtures shared by the host's integration tests: a small object type
//! built through the public API only.

#![allow(dead_code)] // each test binary uses a different part of the support module

pub mod s3;

use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;

use durability_host::{AlarmInfo, BoxError, DurableObject, Host, Namespace, ObjectContext};
use durability_platform::{Context, StorageError, StorageExt, params};

/// An object with a `notes` table and a log of the alarms it received.
pub struct Notes {
    pub ctx: ObjectContext,
    pub alarms: RefCell<Vec<AlarmInfo>>,
    /// How many of the next alarm deliveries fail.
    pub failing_alarms: RefCell<u32>,
}

impl DurableObject for Notes {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        self.alarms.borrow_mut().push(info);
        let at = self.ctx.now_ms();
        self.ctx.storage().execute(
            "INSERT INTO alarm_log (at_ms, retry_count) VALUES (?1, ?2)",
            &params![at, info.retry_count],
        )?;
        let mut failing = self.failing_alarms.borrow_mut();
        if *failing > 0 {
            *failing -= 1;
            return Err("alarm handler failed on purpose".into());
        }
        Ok(())
    }
}

impl Notes {
    pub fn add(&self, text: &str) -> Result<(), StorageError> {
        self.ctx
            .storage()
            .execute("INSERT INTO notes (text) VALUES (?1)", &params![text])
            .map(|_| ())
    }

    pub fn texts(&self) -> Result<Vec<String>, StorageError> {
        self.ctx
            .storage()
            .query("SELECT text FROM notes ORDER BY rowid", &[])?
            .iter()
            .map(|row| row.get::<String>(0))
            .collect()
    }

    /// Fired alarms as persisted: (time, retry count).
    pub fn alarm_log(&self) -> Result<Vec<(i64, i64)>, StorageError> {
        self.ctx
            .storage()
            .query(
                "SELECT at_ms, retry_count FROM alarm_log ORDER BY rowid",
                &[],
            )?
            .iter()
            .map(|row| Ok((row.get::<i64>(0)?, row.get::<i64>(1)?)))
            .collect()
    }

    pub async fn alarm(&self) -> Result<Option<i64>, StorageError> {
        self.ctx.storage().get_alarm().await
    }

    /// Adds a note and sets the alarm in one transaction.
    pub async fn add_with_alarm(&self, text: &str, at_ms: i64) -> Result<(), StorageError> {
        let text = text.to_owned();
        self.ctx
            .storage()
            .transaction(move |txn| {
                txn.execute("INSERT INTO notes (text) VALUES (?1)", &params![text])?;
                txn.set_alarm(at_ms)
            })
            .await
    }
}

/// Registers the `notes` namespace.
pub fn notes(host: &Host) -> Namespace<Notes> {
    host.namespace("notes", |ctx: ObjectContext| {
        ctx.storage().execute_script(
            "CREATE TABLE IF NOT EXISTS notes (text TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS alarm_log (at_ms INTEGER NOT NULL, retry_count INTEGER NOT NULL);",
        )?;
        Ok(Notes {
            ctx,
            alarms: RefCell::new(Vec::new()),
            failing_alarms: RefCell::new(0),
        })
    })
    .expect("the notes namespace registers once per host")
}

/// Runs `test` inside a `LocalSet` on the current (paused) runtime, as
/// inline hosts require.
pub async fn local<F: Future>(test: F) -> F::Output {
    tokio::task::LocalSet::new().run_until(test).await
}

/// Builds an inline host on `dir`.
pub fn inline_host(dir: &std::path::Path) -> Host {
    Host::builder(dir)
        .threads(0)
        .build()
        .expect("an inline host builds inside a LocalSet")
}

pub type Shared<T> = Rc<RefCell<T>>;

/// A runtime of two worker threads, for a threaded host outside
/// `#[tokio::test]`.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Milliseconds since the Unix epoch by the system clock.
pub fn epoch_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// The id of the object named `name` in the `notes` namespace of data
/// directory `dir`, read without a host.
pub fn object_named(dir: &std::path::Path, name: &str) -> durability_host::ObjectId {
    durability_host::inspect::list_objects(dir)
        .unwrap()
        .into_iter()
        .find(|o| o.name.as_deref() == Some(name))
        .map(|o| durability_host::ObjectId::new(o.id))
        .unwrap_or_else(|| panic!("{} holds no object named {name}", dir.display()))
}

/// The notes of object `id` in `dir`, in insertion order, read without a
/// host as a dashboard reads them (none if it has no `notes` table yet).
pub fn notes_in(dir: &std::path::Path, id: &durability_host::ObjectId) -> Vec<String> {
    durability_host::inspect::read_object(dir, id.as_str(), |sql| {
        sql.query("SELECT text FROM notes ORDER BY rowid", &[])
            .unwrap()
            .iter()
            .map(|row| row.get::<String>(0).unwrap())
            .collect::<Vec<_>>()
    })
    .unwrap()
    .unwrap_or_default()
}

/// The notes of object `id` in `dir` as numbers (see [`notes_in`]).
pub fn numbered_notes(dir: &std::path::Path, id: &durability_host::ObjectId) -> Vec<u64> {
    notes_in(dir, id)
        .iter()
        .map(|text| text.parse::<u64>().unwrap())
        .collect()
}

/// The notes of the object named `name` in `dir` as numbers.
pub fn numbered_notes_of(dir: &std::path::Path, name: &str) -> Vec<u64> {
    numbered_notes(dir, &object_named(dir, name))
}

/// Adds note `text` to the object named `object` and waits for the reply
/// (released once the note is durable in the default mode).
pub async fn add_note(notes: &Namespace<Notes>, object: &str, text: impl Into<String>) {
    let text = text.into();
    notes
        .stub(object)
        .unwrap()
        .call(move |o: Rc<Notes>| async move { o.add(&text) })
        .await
        .unwrap()
        .unwrap();
}
