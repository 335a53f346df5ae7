//! The host's testing API (feature `testing`): what a test kit needs to
//! drive objects the way the platform would, and a little more.
//!
//! - [`Stub::fire_alarm`] runs an object's alarm now, with chosen
//!   [`AlarmInfo`], and says whether one was armed (Cloudflare's
//!   `runDurableObjectAlarm`).
//! - [`Stub::run_local`] runs a closure inside an object and returns a
//!   result that need not be `Send` (inline hosts, on the test's thread).
//! - [`Host::restart`] stops the host abruptly and opens a new one on the
//!   same directory: a simulated crash, memory gone, storage kept.
//! - [`Host::query_object`] reads an object's tables without waking it.
//! - [`Stub::fail_next_commit`] makes an object's next commit fail.
//!
//! Eviction ([`Host::evict`]) is part of the ordinary API. None of this is
//! compiled into production builds: enable the `testing` feature in
//! `[dev-dependencies]` only.

use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use durability_platform::{AlarmInfo, EpochMs, ObjectId, Row, StorageError, Value};
use rusqlite::{Connection, OpenFlags};
use tokio::sync::oneshot;

use super::{Host, Namespace, Stub};
use crate::error::storage_error;
use crate::executor::testing::{Forced, on_this_thread};
use crate::executor::{self, Executor, Reply};
use crate::id::executor_of;
use crate::storage::ALARM_TABLE;
use crate::{CallError, DurableObject, HostError};

/// How [`Stub::fire_alarm`] went.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FiredAlarm {
    /// The object had no alarm armed; nothing ran.
    NotArmed,
    /// The object's alarm handler was already running; no second run was
    /// started.
    AlreadyRunning,
    /// The handler returned `Ok`: the alarm was cleared, unless the
    /// handler set a new one.
    Ran,
    /// The handler returned an error (its text here). The host retries it
    /// with backoff, as it would a timed delivery; a
    /// [`NoAlarmHandler`](crate::NoAlarmHandler) error keeps the alarm
    /// armed and is not retried.
    Failed {
        /// The handler's error, as text.
        message: String,
    },
    /// The run was dropped before it ended (the object was evicted or the
    /// host stopped); the alarm is still armed and is delivered again.
    Aborted,
}

impl<T: DurableObject> Stub<T> {
    /// Runs the object's alarm handler now with `info`, if its alarm is
    /// armed (constructing the object first if it is not in memory), and
    /// waits for the handler to end. The run replaces the timed delivery
    /// and ends like one: the alarm is cleared after `Ok` unless the
    /// handler set a new one, and retried with backoff after an error
    /// (counting retries from `info.retry_count`).
    pub async fn fire_alarm(&self, info: AlarmInfo) -> Result<FiredAlarm, CallError> {
        let core = &self.host.shared.core;
        if core.shutting_down.load(Ordering::SeqCst) {
            return Err(CallError::ShuttingDown);
        }
        let guard = core.work.begin();
        let (tx, rx) = oneshot::channel();
        let id = self.id.clone();
        let namespace = Arc::clone(&self.namespace);
        let name = Arc::clone(&self.name);
        self.host
            .send(
                &self.id,
                Box::new(move |e| e.fire_now(id, namespace, name, info, tx)),
            )
            .map_err(|_| CallError::ShuttingDown)?;
        let forced = rx.await.unwrap_or_else(|_| {
            Err(CallError::Aborted {
                id: self.id.to_string(),
            })
        })?;
        let outcome = match forced {
            Forced::NotArmed => FiredAlarm::NotArmed,
            Forced::AlreadyRunning => FiredAlarm::AlreadyRunning,
            Forced::Started(outcome) => match outcome.await {
                Ok(Ok(())) => FiredAlarm::Ran,
                Ok(Err(message)) => FiredAlarm::Failed { message },
                Err(_) => FiredAlarm::Aborted,
            },
        };
        drop(guard);
        Ok(outcome)
    }

    /// Runs `f` inside the object, like [`Stub::call`], but neither `f`
    /// nor its result need be `Send`: the result comes back on this
    /// thread. Only an inline host (`threads(0)`) driven by this thread can
    /// do that; any other host answers [`CallError::NotOnThisThread`].
    pub async fn run_local<F, Fut, R>(&self, f: F) -> Result<R, CallError>
    where
        F: FnOnce(Rc<T>) -> Fut + 'static,
        Fut: Future<Output = R> + 'static,
        R: 'static,
    {
        let core = &self.host.shared.core;
        if core.shutting_down.load(Ordering::SeqCst) {
            return Err(CallError::ShuttingDown);
        }
        let executor = self.local_executor()?;
        let guard = core.work.begin();
        let (tx, rx) = oneshot::channel();
        executor.call::<T, F, Fut, R, _>(
            self.id.clone(),
            Arc::clone(&self.namespace),
            Arc::clone(&self.name),
            executor::current_object(),
            f,
            move |reply| {
                let _ = tx.send(reply);
            },
            guard,
            tracing::info_span!(
                parent: tracing::Span::current(),
                "call",
                object = %self.id,
                namespace = %self.namespace,
                name = %self.name,
            ),
        );
        let Ok(Reply { result, after }) = rx.await else {
            return Err(CallError::Aborted {
                id: self.id.to_string(),
            });
        };
        // The output gate, as for `Stub::call`.
        if let Some(group) = &core.group
            && let Err(reason) = group.gate(&after).await
        {
            return Err(CallError::NotDurable {
                id: self.id.to_string(),
                message: reason.to_string(),
            });
        }
        result
    }

    fn local_executor(&self) -> Result<Rc<Executor>, CallError> {
        let shared = &self.host.shared;
        let core = Arc::as_ptr(&shared.core) as usize;
        on_this_thread(core, executor_of(&self.id, shared.executors.len())).ok_or_else(|| {
            CallError::NotOnThisThread {
                id: self.id.to_string(),
            }
        })
    }
}

impl Host {
    /// Stops this host abruptly and opens a new one on the same directory
    /// with the same settings and namespaces: a simulated crash. Every
    /// object is dropped at once (in-flight calls, alarm runs, timers and
    /// `wait_until` work are aborted at their current await, as a process
    /// death would stop them); storage and alarms stay. The new host's
    /// clock continues from this one's, and it wakes every object whose
    /// alarm is due.
    ///
    /// Handles of this host ([`Namespace`], [`Stub`]) stop working; get
    /// new ones from the returned host ([`Host::registered_namespace`]).
    /// With `threads(0)`, call it inside the `LocalSet` that runs the host.
    pub async fn restart(&self) -> Result<Host, HostError> {
        let shared = &self.shared;
        shared.core.shutting_down.store(true, Ordering::SeqCst);
        self.close_executors().await;
        if let Ok(mut lock) = shared.core.lock.lock() {
            lock.take();
        }
        let builder = shared.builder.clone().clock_start_ms(self.now_ms());
        let host = builder.build()?;
        let namespaces: Vec<(String, super::Constructor)> = shared
            .core
            .namespaces
            .read()
            .map_err(|_| HostError::ShutDown)?
            .iter()
            .map(|(name, constructor)| (name.clone(), Arc::clone(constructor)))
            .collect();
        for (name, constructor) in namespaces {
            host.register(&name, constructor)?;
        }
        Ok(host)
    }

    /// A handle to namespace `name`, registered earlier on this host (or
    /// carried over by [`Host::restart`]). `T` must be the type it was
    /// registered with; calls through a handle of another type fail with
    /// [`CallError::WrongType`].
    pub fn registered_namespace<T: DurableObject>(
        &self,
        name: &str,
    ) -> Result<Namespace<T>, HostError> {
        let registered = self
            .shared
            .core
            .namespaces
            .read()
            .map_err(|_| HostError::ShutDown)?
            .contains_key(name);
        if !registered {
            return Err(HostError::UnknownNamespace {
                name: name.to_owned(),
            });
        }
        Ok(Namespace {
            host: self.clone(),
            name: Arc::from(name),
            _object: std::marker::PhantomData,
        })
    }

    /// Runs the read-only statement `sql` on object `id`'s database
    /// through a connection of its own: the object is not constructed or
    /// woken, and what it sees is what has been committed. A statement
    /// that writes fails (the connection is read-only); an object that was
    /// never created fails with [`StorageError::Unavailable`].
    pub fn query_object(
        &self,
        id: &ObjectId,
        sql: &str,
        params: &[Value],
    ) -> Result<Vec<Row>, HostError> {
        let path = self.object_file(id);
        if !path.exists() {
            return Err(HostError::Storage(StorageError::Unavailable {
                message: format!("object {id} has no database file at {}", path.display()),
            }));
        }
        let conn = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(storage_error)?;
        Ok(crate::storage::query(&conn, sql, params).map_err(storage_error)?)
    }

    /// Object `id`'s alarm as committed in its file (`None`: none armed,
    /// or the object was never created), read like [`Host::query_object`]
    /// without waking the object. A delivered alarm is cleared only when
    /// its run ends, so a running alarm still shows here.
    pub fn stored_alarm(&self, id: &ObjectId) -> Result<Option<EpochMs>, HostError> {
        if !self.object_file(id).exists() {
            return Ok(None);
        }
        let rows = self.query_object(
            id,
            &format!("SELECT at_ms FROM {ALARM_TABLE} WHERE slot = 0"),
            &[],
        )?;
        match rows.first() {
            Some(row) => Ok(Some(row.get::<EpochMs>(0)?)),
            None => Ok(None),
        }
    }
}

impl<T: DurableObject> Stub<T> {
    /// Makes the object's next commit fail with `error` and roll back, as a
    /// full disk or an I/O error would: the transaction's rows and alarm
    /// change are not written. The object is constructed first if it is
    /// not live (its factory's commits are not the ones hit). Armed once;
    /// later commits succeed. Statements outside a transaction are not
    /// commits and are not hit. An eviction keeps the armed failure (the
    /// next construction's first commit takes it), a restart drops it.
    pub async fn fail_next_commit(&self, error: StorageError) -> Result<(), CallError> {
        let (tx, rx) = oneshot::channel();
        let id = self.id.clone();
        let namespace = Arc::clone(&self.namespace);
        let name = Arc::clone(&self.name);
        self.host
            .send(
                &self.id,
                Box::new(move |e| e.inject_failure(id, namespace, name, error, tx)),
            )
            .map_err(|_| CallError::ShuttingDown)?;
        rx.await.unwrap_or_else(|_| {
            Err(CallError::Aborted {
                id: self.id.to_string(),
            })
        })
    }
}
