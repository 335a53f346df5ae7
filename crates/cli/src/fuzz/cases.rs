//! One fuzz case per capability: random options, random calls, then the
//! checks. Every case runs on its own fresh object (one SQLite file) of an
//! inline host on paused tokio time, so retries hours apart take no real
//! time.
//!
//! The checks, for every call of the public API:
//! - a rejection (typed error, `Rejected`, `Existing`) wrote nothing: every
//!   table of the object (the host's alarm included) is the same after;
//! - an `Err` that is a storage failure on a fresh, healthy object is a
//!   failure (an input reached SQLite unvalidated);
//! - accepted work ends visibly: operations and named alarms reach a final
//!   status, fanout deliveries are delivered, stored, dead-lettered or
//!   parked with nothing pending, log records read back equal. Work still
//!   pending when the case's virtual time is up passes only if it is
//!   visibly waiting (due later) or visibly retrying (an attempt ran and
//!   its error is stored);
//! - malformed rows written straight into a capability's tables (wrong
//!   types, NULLs, bad JSON, foreign generations) make its calls fail with
//!   typed errors or be ignored, never panic or hang;
//! - `log-cold`: records trimmed to a cold store (which fails its first
//!   writes, and sometimes loses a segment) read back equal one by one and
//!   in pages across segments, or fail typed (`Truncated`) for a lost one;
//! - `fanout-redrive`: deliveries that failed for good park (no DLQ);
//!   `redrive_parked` of some of them (unknown and repeated ids too) is
//!   either rejected with nothing written or delivered in full;
//! - `recurring`: interval and cron schedules (bad expressions and time
//!   zones too), missed-tick policies, pause, resume and cancel: a refused
//!   schedule writes nothing, an accepted one shows in `get` and runs
//!   within the budget unless paused, a cancelled one is gone.
//!
//! Panics anywhere (library code, background tasks) are caught by the
//! child's panic hook and fail the case; aborts and hangs are caught by the
//! supervisor process.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use durability::fanout::{EnqueueOptions, EnqueueResult, FanoutInput, FanoutMessage, Target};
use durability::load::Direction;
use durability::log::{AppendRecord, Leases, Read, Retention};
use durability::platform::{Context, Value as Sql, params};
use durability::routing::{
    CallContext, ReportsLoad, RoutingClient, RoutingTarget, ShardCaller, ShardingError,
};
use durability::{
    Alarms, DurabilityError, DurableCall, Fanout, HandlerError, Load, LoadSnapshot, Log,
    OperationResult, Operations, Registration, Scheduler,
};
use durability_host::ObjectContext;
use serde_json::{Value, json};

use super::inputs::{Fx, drop_flat, fingerprint, shown_str};

/// Handler calls and settled attempts of every case so far (operations,
/// named alarms, fanout targets): the child's retry-storm watch reads it
/// (see `child::storm_watch`).
pub static ATTEMPTS: AtomicU64 = AtomicU64::new(0);

/// What every case may advance virtual time by while it waits for its
/// accepted work to end.
const VIRTUAL_BUDGET: Duration = Duration::from_secs(2 * 86_400);

/// Attempts after which work that keeps failing counts as visibly
/// retrying (its error is stored), so the case stops waiting for it.
const VISIBLE_AFTER_ATTEMPTS: i64 = 3;

/// Where accepted work is while a case waits for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Progress {
    /// Not ended yet.
    Waiting,
    /// Retried often enough, with its error stored: visibly failing.
    Retrying,
    /// Ended (final status, delivered, parked, ...).
    Ended,
}

/// The capabilities a case can exercise.
pub const KINDS: &[&str] = &[
    "operations",
    "alarms",
    "fanout",
    "log",
    "routing",
    "load",
    "malformed-rows",
    "log-cold",
    "fanout-redrive",
    "recurring",
];

/// What the object hands a case: its context and the scheduler slot its
/// alarm delegates to.
pub struct Stage {
    pub ctx: ObjectContext,
    pub scheduler: RefCell<Option<Scheduler>>,
}

/// A case's failure: what went wrong.
pub type Failed = String;

/// Every table of an object, row by row.
type Snapshot = Vec<(String, Vec<Vec<Sql>>)>;

/// A named alarm's row: status, next attempt, attempt, last error.
type AlarmRow = (String, i64, i64, Option<String>);

/// A fanout delivery's row: message key, target, phase, attempt, next
/// attempt, last error.
type DeliveryState = (String, String, String, i64, i64, Option<String>);

struct Cx {
    fx: Fx,
    ctx: Rc<dyn Context>,
    stage: Rc<Stage>,
    /// Malformed rows were written: errors of any kind are expected.
    malformed: bool,
}

/// Builds every capability with its defaults on `stage`, so its file
/// holds every table at its latest migration: the child copies that file
/// as the starting point of most cases (see `child::Template`).
pub async fn migrate_everything(stage: Rc<Stage>) -> Result<(), Failed> {
    let ctx = stage.ctx.clone().into_dyn();
    let scheduler = Scheduler::new(Rc::clone(&ctx)).map_err(|e| e.to_string())?;
    Operations::builder(&scheduler)
        .handler("echo", |call: DurableCall<Value>| async move {
            Ok::<_, HandlerError>(call.payload)
        })
        .build()
        .map_err(|e| e.to_string())?;
    Alarms::builder(&scheduler)
        .handler("tick", |_call| async { Ok::<_, HandlerError>(()) })
        .build()
        .map_err(|e| e.to_string())?;
    Fanout::<Value>::builder(&scheduler)
        .target(
            "inbox",
            Target::consumer(|_batch: Vec<FanoutMessage<Value>>| async { Ok(()) }),
        )
        .build()
        .map_err(|e| e.to_string())?;
    Log::<Value>::builder(&scheduler)
        .leases(Leases::new())
        .build()
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// A retry storm its options ask for: a named alarm whose handler always
/// fails, retried 0 ms apart up to 2e9 times, then waited for (the wait
/// never ends on paused time: the child's storm watch ends the case).
pub async fn storm(stage: Rc<Stage>) -> Result<(), Failed> {
    let ctx = stage.ctx.clone().into_dyn();
    let scheduler = Scheduler::new(Rc::clone(&ctx)).map_err(|e| e.to_string())?;
    *stage.scheduler.borrow_mut() = Some(scheduler.clone());
    let alarms = Alarms::builder(&scheduler)
        .handler("tick", |call| async move {
            behave(2, call.attempt, json!(null)).await.map(|_| ())
        })
        .max_attempts(2_000_000_000)
        .retry_delay(durability::retry::Delay::Fixed { ms: 0.0 })
        .build()
        .map_err(|e| e.to_string())?;
    alarms
        .schedule("tick", ctx.now_ms())
        .await
        .map_err(|e| e.to_string())?;
    tokio::time::sleep(VIRTUAL_BUDGET).await;
    Err("the storm ended on its own".into())
}

/// Runs case `kind` on `stage` and returns its verdict (its trace is in
/// the generator's shared trace).
pub async fn run(stage: Rc<Stage>, kind: usize, fx: Fx) -> Result<(), Failed> {
    let ctx = stage.ctx.clone().into_dyn();
    let mut cx = Cx {
        fx,
        ctx,
        stage,
        malformed: false,
    };
    within_budget(cx.run(kind)).await
}

/// `--inject wait@I`: a case that notes a step, then awaits what nothing
/// ever wakes, as the unexplained malformed-rows hangs did; it must fail
/// as a virtual-time hang with that step last in its input.
pub async fn wait_forever(mut fx: Fx) -> Result<(), Failed> {
    within_budget(async move {
        fx.note("injected: awaits a future nothing wakes (--inject wait)");
        std::future::pending::<Result<(), Failed>>().await
    })
    .await
}

/// A case's verdict, or a hang once it has waited longer than any case
/// may advance virtual time.
async fn within_budget(case: impl Future<Output = Result<(), Failed>>) -> Result<(), Failed> {
    // Each of a case's (at most 6) waits may spend the budget.
    let limit = VIRTUAL_BUDGET * 8;
    let cpu_before = super::child::cpu_time();
    let attempts_before = ATTEMPTS.load(Ordering::Relaxed);
    match tokio::time::timeout(limit, case).await {
        Ok(verdict) => verdict,
        // What it spent tells a wait that never ends (little CPU, few
        // attempts) from work that kept virtual time moving.
        Err(_) => Err(format!(
            "hang: the case did not finish within {} virtual days ({:.3} s of CPU time, {} handler calls meanwhile)",
            limit.as_secs() / 86_400,
            super::child::cpu_time()
                .saturating_sub(cpu_before)
                .as_secs_f64(),
            ATTEMPTS
                .load(Ordering::Relaxed)
                .saturating_sub(attempts_before)
        )),
    }
}

impl Cx {
    async fn run(&mut self, kind: usize) -> Result<(), Failed> {
        match kind {
            0 => self.operations().await,
            1 => self.alarms().await,
            2 => self.fanout().await,
            3 => self.log().await,
            4 => self.routing().await,
            5 => self.load(),
            6 => self.malformed_rows().await,
            7 => self.log_cold().await,
            8 => self.fanout_redrive().await,
            _ => self.recurring().await,
        }
    }

    fn now(&self) -> i64 {
        self.ctx.now_ms()
    }

    /// Every table of the object but the host's meta and alarm tables,
    /// row by row. The physical alarm is left out: every transaction of a
    /// capability reconciles it with the pending work (seed 11, case
    /// 19915: a start that found its id `Existing` re-armed an alarm an
    /// earlier run had moved), which writes no input of the call.
    fn snapshot(&self) -> Result<Snapshot, Failed> {
        let sql = self.ctx.storage();
        let tables = sql
            .query(
                "SELECT name FROM sqlite_master WHERE type = 'table' \
                 AND name NOT IN ('_durability_host_meta', '_durability_host_alarm') ORDER BY name",
                &[],
            )
            .map_err(|e| format!("cannot list tables: {e}"))?;
        let mut snapshot = Vec::new();
        for row in tables.iter() {
            let name: String = row.get(0).map_err(|e| format!("table name: {e}"))?;
            let rows = sql
                .query(
                    &format!("SELECT * FROM \"{}\"", name.replace('"', "\"\"")),
                    &[],
                )
                .map_err(|e| format!("cannot read {name}: {e}"))?;
            snapshot.push((name, rows.iter().map(|r| r.values().to_vec()).collect()));
        }
        Ok(snapshot)
    }

    /// A rejection must have written nothing.
    fn unchanged(&self, before: &[(String, Vec<Vec<Sql>>)], what: &str) -> Result<(), Failed> {
        let after = self.snapshot()?;
        if after.as_slice() != before {
            let changed: Vec<&str> = after
                .iter()
                .filter(|table| !before.contains(table))
                .map(|(name, _)| name.as_str())
                .collect();
            return Err(format!("{what} was rejected but wrote to {changed:?}"));
        }
        Ok(())
    }

    /// A storage failure on a healthy object means an input reached SQLite
    /// unvalidated (or the library broke its own rows).
    fn typed(
        &self,
        what: &str,
        error: &dyn std::fmt::Display,
        storage: bool,
    ) -> Result<(), Failed> {
        if storage && !self.malformed {
            return Err(format!("{what} failed with a storage error: {error}"));
        }
        Ok(())
    }

    /// A scheduler with random options, installed as the object's alarm
    /// handler; `None` when its options were (rightly) refused.
    fn scheduler(&mut self) -> Option<Scheduler> {
        let mut builder = Scheduler::builder(Rc::clone(&self.ctx));
        if self.fx.chance(0.3) {
            builder = builder.alarm_concurrency(self.fx.count_usize("scheduler.alarm_concurrency"));
        }
        if self.fx.chance(0.3) {
            builder = builder.alarm_min_delay(self.fx.duration("scheduler.alarm_min_delay"));
        }
        if self.fx.chance(0.3) {
            builder = builder.alarm_handoff(self.fx.duration("scheduler.alarm_handoff"));
        }
        if self.fx.chance(0.5) {
            let on = self.fx.chance(0.5);
            self.fx.note(format!("scheduler.live_timers = {on}"));
            builder = builder.live_timers(on);
        }
        match builder.build() {
            Ok(scheduler) => {
                *self.stage.scheduler.borrow_mut() = Some(scheduler.clone());
                Some(scheduler)
            }
            Err(error) => {
                self.fx.note(format!("scheduler refused: {error}"));
                None
            }
        }
    }

    /// Sleeps in growing virtual steps until `progress` says the work
    /// ended or is visibly retrying, or the budget is spent; returns
    /// whether it stopped before the budget.
    async fn drive(
        &mut self,
        mut progress: impl FnMut(&mut Self) -> Result<Progress, Failed>,
    ) -> Result<bool, Failed> {
        let mut step = Duration::from_millis(1);
        let mut spent = Duration::ZERO;
        loop {
            if progress(self)? != Progress::Waiting {
                return Ok(true);
            }
            if spent >= VIRTUAL_BUDGET {
                return Ok(false);
            }
            tokio::time::sleep(step).await;
            spent += step;
            step = (step * 4).min(Duration::from_secs(6 * 3_600));
        }
    }

    /// A pending row at the end of the budget: fine if due later or
    /// visibly retrying, a failure if due, never attempted.
    fn visibly_waiting(
        &self,
        what: &str,
        next_at: i64,
        attempt: i64,
        last_error: Option<String>,
    ) -> Result<(), Failed> {
        if next_at > self.now() || (attempt >= 1 && last_error.is_some()) {
            return Ok(());
        }
        Err(format!(
            "{what} was accepted but neither ended nor ran: pending, due at {next_at} (now {}), attempt {attempt}, no error stored",
            self.now()
        ))
    }

    async fn operations(&mut self) -> Result<(), Failed> {
        let Some(scheduler) = self.scheduler() else {
            return Ok(());
        };
        let mode = self.fx.below(6);
        self.fx
            .note(format!("handler behaviour: {}", BEHAVIOURS[mode]));
        #[derive(serde::Deserialize, serde::Serialize)]
        struct Typed {
            n: u32,
        }
        let mut builder = Operations::builder(&scheduler)
            .handler("echo", move |call: DurableCall<Value>| {
                behave(mode, call.attempt, json!("done"))
            })
            .handler("typed", move |call: DurableCall<Typed>| {
                behave(mode, call.attempt, json!(call.payload.n))
            });
        builder = builder.on_lifecycle_event(count_attempts());
        if self.fx.chance(0.3) {
            builder = builder.max_attempts(self.fx.count_u32("operations.max_attempts"));
        }
        if self.fx.chance(0.3) {
            builder = builder.attempt_timeout(self.fx.duration("operations.attempt_timeout"));
        }
        if self.fx.chance(0.3) {
            builder = builder.retry_delay(self.fx.delay("operations.retry_delay"));
        }
        if self.fx.chance(0.2) {
            let name = self.fx.pick(&["echo", "typed", "other"]);
            let policy = self.fx.method_policy(&format!("operations.method[{name}]"));
            builder = builder.method(name, policy);
        }
        let ops = match builder.build() {
            Ok(ops) => ops,
            Err(error) => {
                self.fx.note(format!("operations refused: {error}"));
                return Ok(());
            }
        };
        for _ in 0..self.fx.range_u64(1, 3) {
            let operation = if self.fx.chance(0.8) {
                self.fx.pick(&["echo", "typed"]).to_owned()
            } else {
                self.fx.name("operation")
            };
            let id = self.fx.name("id");
            let payload = self.fx.body("payload");
            let before = self.snapshot()?;
            let started = ops.start(&operation, &id, &payload).await;
            drop_flat(payload);
            self.fx.note(format!("start -> {}", short(&started)));
            match started {
                Ok(Registration::Created) => {
                    let ended = self
                        .drive(|cx| match ops.result::<Value>(&operation, &id) {
                            Ok(OperationResult::Pending {
                                attempt,
                                last_error,
                                ..
                            }) if i64::from(attempt) >= VISIBLE_AFTER_ATTEMPTS
                                && last_error.is_some() =>
                            {
                                Ok(Progress::Retrying)
                            }
                            Ok(OperationResult::Pending {
                                next_attempt_at, ..
                            }) if next_attempt_at > beyond_budget(cx.now()) => {
                                Ok(Progress::Retrying)
                            }
                            Ok(OperationResult::Pending { .. }) => Ok(Progress::Waiting),
                            Ok(_) => Ok(Progress::Ended),
                            Err(error) => Err(format!(
                                "the result of an accepted operation cannot be read: {error}"
                            )),
                        })
                        .await?;
                    if !ended
                        && let Ok(OperationResult::Pending {
                            attempt,
                            next_attempt_at,
                            last_error,
                        }) = ops.result::<Value>(&operation, &id)
                    {
                        self.visibly_waiting(
                            "operation",
                            next_attempt_at,
                            i64::from(attempt),
                            last_error,
                        )?;
                    }
                }
                Ok(Registration::Existing) => self.unchanged(&before, "start (Existing)")?,
                Err(error) => {
                    self.typed(
                        "start",
                        &error,
                        matches!(error, DurabilityError::Storage(_)),
                    )?;
                    self.unchanged(&before, "start")?;
                }
            }
            if self.fx.chance(0.2) {
                let before_ts = self.fx.timestamp("purge_before", self.now());
                let purged = ops.purge_before(before_ts).await;
                self.fx.note(format!("purge_before -> {}", short(&purged)));
                if let Err(error) = purged {
                    self.typed(
                        "purge_before",
                        &error,
                        matches!(error, DurabilityError::Storage(_)),
                    )?;
                }
            }
        }
        Ok(())
    }

    async fn alarms(&mut self) -> Result<(), Failed> {
        let Some(scheduler) = self.scheduler() else {
            return Ok(());
        };
        let mode = self.fx.below(6);
        self.fx
            .note(format!("handler behaviour: {}", BEHAVIOURS[mode]));
        let mut builder = Alarms::builder(&scheduler).handler("tick", move |call| {
            let attempt = call.attempt;
            async move { behave(mode, attempt, json!(null)).await.map(|_| ()) }
        });
        builder = builder.on_lifecycle_event(count_attempts());
        if self.fx.chance(0.3) {
            builder = builder.max_attempts(self.fx.count_u32("alarms.max_attempts"));
        }
        if self.fx.chance(0.3) {
            builder = builder.attempt_timeout(self.fx.duration("alarms.attempt_timeout"));
        }
        if self.fx.chance(0.3) {
            builder = builder.retry_delay(self.fx.delay("alarms.retry_delay"));
        }
        if self.fx.chance(0.2) {
            let policy = self.fx.method_policy("alarms.method[tick]");
            builder = builder.method("tick", policy);
        }
        let alarms = match builder.build() {
            Ok(alarms) => alarms,
            Err(error) => {
                self.fx.note(format!("alarms refused: {error}"));
                return Ok(());
            }
        };
        for _ in 0..self.fx.range_u64(1, 3) {
            let name = if self.fx.chance(0.8) {
                "tick".to_owned()
            } else {
                self.fx.name("alarm name")
            };
            let at = self.fx.timestamp("scheduled_time", self.now());
            let before = self.snapshot()?;
            let scheduled = alarms.schedule(&name, at).await;
            self.fx.note(format!("schedule -> {}", short(&scheduled)));
            match scheduled {
                Ok(()) => {
                    let row = |cx: &Self| -> Result<Option<AlarmRow>, Failed> {
                        let row = cx
                            .ctx
                            .storage()
                            .query_row(
                                "SELECT status, next_attempt_at, attempt, last_error \
                                 FROM durability_alarms WHERE name = ?",
                                &params![name.as_str()],
                            )
                            .map_err(|e| format!("cannot read the alarm row: {e}"))?;
                        row.map(|r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                            .transpose()
                            .map_err(|e: durability::platform::StorageError| {
                                format!("the alarm row does not decode: {e}")
                            })
                    };
                    let ended = self
                        .drive(|cx| {
                            Ok(match row(cx)? {
                                Some((status, next_at, ..))
                                    if status == "pending" && next_at > beyond_budget(cx.now()) =>
                                {
                                    Progress::Retrying
                                }
                                Some((status, ..)) if status == "pending" => Progress::Waiting,
                                _ => Progress::Ended,
                            })
                            .map(|progress| match row(cx) {
                                Ok(Some((_, _, attempt, Some(_))))
                                    if progress == Progress::Waiting
                                        && attempt >= VISIBLE_AFTER_ATTEMPTS =>
                                {
                                    Progress::Retrying
                                }
                                _ => progress,
                            })
                        })
                        .await?;
                    if !ended && let Some((_, next_at, attempt, last_error)) = row(self)? {
                        self.visibly_waiting("named alarm", next_at, attempt, last_error)?;
                    }
                }
                Err(error) => {
                    self.typed(
                        "schedule",
                        &error,
                        matches!(error, DurabilityError::Storage(_)),
                    )?;
                    self.unchanged(&before, "schedule")?;
                }
            }
        }
        Ok(())
    }

    async fn fanout(&mut self) -> Result<(), Failed> {
        let Some(scheduler) = self.scheduler() else {
            return Ok(());
        };
        let seen = Rc::new(RefCell::new(Ends::default()));
        let mode = self.fx.below(6);
        let ack_on_return = self.fx.chance(0.5);
        self.fx.note(format!(
            "inbox behaviour: {}, ack_on_return {ack_on_return}",
            BEHAVIOURS[mode]
        ));
        let inbox = {
            let seen = Rc::clone(&seen);
            Target::consumer(move |batch: Vec<FanoutMessage<Value>>| {
                let seen = Rc::clone(&seen);
                async move { consume(mode, ack_on_return, batch, &seen).await }
            })
            .ack_on_return(ack_on_return)
        };
        let archive_fails = self.fx.chance(0.3);
        let archive = {
            let seen = Rc::clone(&seen);
            Target::storage(move |message: durability::fanout::StoredMessage<Value>| {
                let seen = Rc::clone(&seen);
                async move {
                    *seen
                        .borrow_mut()
                        .tries
                        .entry(message.message_id.clone())
                        .or_default() += 1;
                    ATTEMPTS.fetch_add(1, Ordering::Relaxed);
                    if archive_fails && message.attempts < 2 {
                        return Err(HandlerError::new("archive write failed"));
                    }
                    seen.borrow_mut()
                        .ended
                        .insert((message.message_id, message.target));
                    Ok(())
                }
            })
        };
        let mut builder = Fanout::<Value>::builder(&scheduler)
            .target("inbox", inbox)
            .target("archive", archive)
            .on_lifecycle_event(count_attempts());
        if self.fx.chance(0.1) {
            let id = self.fx.name("extra target id");
            builder = builder.target(
                id,
                Target::consumer(|_batch: Vec<FanoutMessage<Value>>| async { Ok(()) }),
            );
        }
        if self.fx.chance(0.5) {
            self.fx.note("dlq: recorded");
            let seen = Rc::clone(&seen);
            builder = builder.dlq(move |message: durability::fanout::StoredMessage<Value>| {
                let seen = Rc::clone(&seen);
                async move {
                    seen.borrow_mut()
                        .ended
                        .insert((message.message_id, message.target));
                    Ok(())
                }
            });
        }
        if self.fx.chance(0.3) {
            builder = builder.max_batch_size(self.fx.count_usize("fanout.max_batch_size"));
        }
        if self.fx.chance(0.3) {
            builder = builder.batch_delay(self.fx.duration("fanout.batch_delay"));
        }
        if self.fx.chance(0.3) {
            builder = builder.max_body_bytes(self.fx.count_usize("fanout.max_body_bytes"));
        }
        if self.fx.chance(0.3) {
            builder = builder.max_attempts(self.fx.count_u32("fanout.max_attempts"));
        }
        if self.fx.chance(0.3) {
            builder = builder.attempt_timeout(self.fx.duration("fanout.attempt_timeout"));
        }
        if self.fx.chance(0.3) {
            builder = builder.retry_delay(self.fx.delay("fanout.retry_delay"));
        }
        let fanout = match builder.build() {
            Ok(fanout) => fanout,
            Err(error) => {
                self.fx.note(format!("fanout refused: {error}"));
                return Ok(());
            }
        };
        let mut accepted: Vec<(String, Vec<String>)> = Vec::new();
        for _ in 0..self.fx.range_u64(1, 3) {
            let count = if self.fx.chance(0.05) {
                self.fx.range_u64(100, 1_200)
            } else {
                self.fx.range_u64(0, 4)
            };
            self.fx.note(format!("enqueue of {count} messages"));
            let mut messages = Vec::new();
            for i in 0..count {
                let body = if count > 10 {
                    json!({"n": i})
                } else {
                    self.fx.body("body")
                };
                let mut input = FanoutInput::new(body);
                if self.fx.chance(0.5) {
                    input = input.id(self.fx.name("message id"));
                }
                if self.fx.chance(0.3) {
                    input = input.deduplication_key(self.fx.name("deduplication key"));
                }
                messages.push(input);
            }
            let targets: Vec<String> = match self.fx.below(4) {
                0 => vec!["inbox".into(), "archive".into()],
                1 => vec!["archive".into()],
                2 => vec![],
                _ if self.fx.chance(0.5) => vec!["inbox".into(), "inbox".into()],
                _ => vec![self.fx.name("target")],
            };
            let options = if self.fx.chance(0.5) {
                self.fx.note("targets: all");
                EnqueueOptions::all()
            } else {
                self.fx.note(format!("targets: {targets:?}"));
                EnqueueOptions::to(targets.clone())
            };
            let frozen = options
                .targets
                .clone()
                .unwrap_or_else(|| vec!["inbox".into(), "archive".into()]);
            let before = self.snapshot()?;
            let enqueued = fanout.enqueue(messages, &options).await;
            self.fx
                .note(format!("enqueue -> {}", short_enqueue(&enqueued)));
            match enqueued {
                Ok(EnqueueResult::Accepted { value, .. }) => {
                    // A reused id may name a new message (its first one
                    // ended): its tries start again, or the tries of the
                    // old one would count it as visibly retrying at once
                    // (seed 11, case 590819).
                    for id in &value {
                        seen.borrow_mut().tries.remove(id);
                    }
                    accepted.extend(value.into_iter().map(|id| (id, frozen.clone())));
                    self.fanout_ends(&fanout, &seen, &accepted).await?;
                }
                Ok(EnqueueResult::Rejected { .. }) => self.unchanged(&before, "enqueue")?,
                Err(error) => {
                    self.typed("enqueue", &error, true)?;
                    self.unchanged(&before, "enqueue")?;
                }
            }
        }
        Ok(())
    }

    /// Every accepted (message, target) ends: delivered, stored,
    /// dead-lettered or parked, with nothing pending.
    async fn fanout_ends(
        &mut self,
        fanout: &Fanout<Value>,
        seen: &Rc<RefCell<Ends>>,
        accepted: &[(String, Vec<String>)],
    ) -> Result<(), Failed> {
        let pending = |cx: &Self| -> Result<u64, Failed> {
            fanout
                .load()
                .map(|load: LoadSnapshot| load.outbound.pending_deliveries)
                .map_err(|e| {
                    let _ = cx;
                    format!("load of an accepted fanout failed: {e}")
                })
        };
        let retrying = |seen: &Ends| {
            accepted
                .iter()
                .all(|(id, _)| seen.tries.get(id).copied().unwrap_or(0) >= VISIBLE_AFTER_ATTEMPTS)
        };
        let mut owed = 1;
        self.drive(|cx| {
            owed = pending(cx)?;
            Ok(if owed == 0 {
                Progress::Ended
            } else if retrying(&seen.borrow()) {
                Progress::Retrying
            } else {
                Progress::Waiting
            })
        })
        .await?;
        if owed > 0 {
            // Every delivery still owed must be visibly waiting (due later),
            // retrying (an attempt failed and its error is stored), or
            // dead-lettered with its DLQ write still owed.
            let rows = self
                .ctx
                .storage()
                .query(
                    "SELECT message_key, target_id, phase, attempt, next_attempt_at, last_error \
                     FROM durability_fanout_deliveries",
                    &[],
                )
                .map_err(|e| format!("cannot read the deliveries: {e}"))?;
            for row in rows.iter() {
                let read = || -> Result<DeliveryState, durability::platform::StorageError> {
                    Ok((
                        row.get(0)?,
                        row.get(1)?,
                        row.get(2)?,
                        row.get(3)?,
                        row.get(4)?,
                        row.get(5)?,
                    ))
                };
                let (key, target, phase, attempt, next_at, last_error) =
                    read().map_err(|e| format!("a delivery row does not decode: {e}"))?;
                if phase != "dead_letter" {
                    self.visibly_waiting(
                        &format!(
                            "fanout delivery of {} to {}",
                            shown_str(&key),
                            shown_str(&target)
                        ),
                        next_at,
                        attempt,
                        last_error,
                    )?;
                }
            }
            return Ok(());
        }
        let parked: HashSet<(String, String)> = fanout
            .parked(None, 100_000)
            .map_err(|e| format!("parked() failed: {e}"))?
            .into_iter()
            .map(|entry| (entry.message_id, entry.target))
            .collect();
        let seen = seen.borrow();
        for (id, targets) in accepted {
            for target in targets {
                let key = (id.clone(), target.clone());
                if !seen.ended.contains(&key) && !parked.contains(&key) {
                    return Err(format!(
                        "fanout message {} for {target} was accepted and nothing is pending, \
                         but it was neither delivered, stored, dead-lettered nor parked",
                        shown_str(id)
                    ));
                }
            }
        }
        Ok(())
    }

    async fn log(&mut self) -> Result<(), Failed> {
        let Some(scheduler) = self.scheduler() else {
            return Ok(());
        };
        let mut builder = Log::<Value>::builder(&scheduler);
        if self.fx.chance(0.3) {
            builder = builder.max_batch_size(self.fx.count_u32("log.max_batch_size"));
        }
        if self.fx.chance(0.3) {
            let mut retention = Retention::new();
            if self.fx.chance(0.5) {
                retention = retention.max_age(self.fx.duration("retention.max_age"));
            }
            if self.fx.chance(0.5) {
                retention = retention.max_records(self.fx.count_u64("retention.max_records"));
            }
            if self.fx.chance(0.5) {
                retention = retention.max_bytes(self.fx.count_u64("retention.max_bytes"));
            }
            builder = builder.retention(retention);
        }
        let leased = self.fx.chance(0.4);
        if leased {
            let mut leases = Leases::new();
            if self.fx.chance(0.5) {
                leases = leases.lease_for(self.fx.duration("leases.lease_for"));
            }
            if self.fx.chance(0.5) {
                leases = leases.max_parallelism(self.fx.count_u32("leases.max_parallelism"));
            }
            if self.fx.chance(0.5) {
                leases = leases.max_attempts(self.fx.count_u32("leases.max_attempts"));
            }
            builder = builder.leases(leases);
        }
        let log = match builder.build() {
            Ok(log) => log,
            Err(error) => {
                self.fx.note(format!("log refused: {error}"));
                return Ok(());
            }
        };
        let storage = |e: &durability::LogError| matches!(e, durability::LogError::Storage(_));
        let mut batches = Vec::new();
        for _ in 0..self.fx.range_u64(1, 6) {
            match self.fx.below(6) {
                0..=2 => {
                    let count = if self.fx.chance(0.05) {
                        self.fx.range_u64(500, 12_000)
                    } else {
                        self.fx.range_u64(0, 4)
                    };
                    self.fx.note(format!("append of {count} records"));
                    let mut records = Vec::new();
                    let mut bodies = Vec::new();
                    for i in 0..count {
                        let body = if count > 10 {
                            json!(i)
                        } else {
                            self.fx.body("body")
                        };
                        bodies.push(fingerprint(&body));
                        records.push(if self.fx.chance(0.3) {
                            AppendRecord::keyed(self.fx.name("key"), body)
                        } else {
                            AppendRecord::new(body)
                        });
                    }
                    let before = self.snapshot()?;
                    let appended = log.append(records).await;
                    self.fx.note(format!(
                        "append -> {}",
                        short(&appended.as_ref().map(|a| a.offsets().map(<[u64]>::len)))
                    ));
                    match appended {
                        Ok(appended) => match appended.offsets() {
                            Some(offsets) => {
                                for (offset, body) in offsets.iter().zip(bodies) {
                                    batches.push((*offset, body));
                                }
                            }
                            None => self.unchanged(&before, "append")?,
                        },
                        Err(error) => {
                            self.typed("append", &error, storage(&error))?;
                            self.unchanged(&before, "append")?;
                        }
                    }
                }
                3 => {
                    let from = if self.fx.chance(0.5) {
                        self.fx.range_u64(0, 10)
                    } else {
                        self.fx.count_u64("read.from")
                    };
                    let mut read = Read::from_offset(from);
                    if self.fx.chance(0.5) {
                        read = read.limit(self.fx.count_u32("read.limit"));
                    }
                    if self.fx.chance(0.3) {
                        read = read.max_bytes(self.fx.count_u64("read.max_bytes"));
                    }
                    let page = log.read(read).await;
                    self.fx.note(format!(
                        "read from {from} -> {}",
                        short(&page.as_ref().map(|p| p.records.len()))
                    ));
                    if let Err(error) = page {
                        self.typed("read", &error, storage(&error))?;
                    }
                }
                4 => {
                    let consumer = self.fx.name("consumer");
                    let offset = if self.fx.chance(0.5) {
                        self.fx.range_u64(0, 10)
                    } else {
                        self.fx.count_u64("commit.offset")
                    };
                    let committed = log.commit(&consumer, offset).await;
                    self.fx.note(format!("commit -> {}", short(&committed)));
                    if let Err(error) = committed {
                        self.typed("commit", &error, storage(&error))?;
                    }
                }
                _ => {
                    let consumer = self.fx.name("consumer");
                    let limit = self
                        .fx
                        .chance(0.5)
                        .then(|| self.fx.count_u32("lease.limit"));
                    let leased_range = log.lease(&consumer, limit).await;
                    self.fx.note(format!(
                        "lease -> {}",
                        short(
                            &leased_range
                                .as_ref()
                                .map(|l| l.as_ref().map(|l| (l.first_offset, l.last_offset)))
                        )
                    ));
                    match leased_range {
                        Ok(Some(lease)) => {
                            let settled = if self.fx.chance(0.5) {
                                log.ack(&consumer, &lease.batch_id).await
                            } else {
                                log.nack(&consumer, &lease.batch_id).await
                            };
                            if let Err(error) = settled {
                                self.typed("ack/nack", &error, storage(&error))?;
                            }
                        }
                        Ok(None) => {}
                        Err(error) => self.typed("lease", &error, storage(&error))?,
                    }
                    let bogus = self.fx.name("batch id");
                    if let Err(error) = log.ack(&consumer, &bogus).await {
                        self.typed("ack of a bogus batch", &error, storage(&error))?;
                    }
                }
            }
        }
        // Every accepted record reads back, equal.
        for (offset, body) in batches {
            let page = log
                .read(Read::from_offset(offset).limit(1))
                .await
                .map_err(|e| format!("accepted record {offset} does not read back: {e}"))?;
            match page.records.first() {
                Some(record) if record.offset == offset && fingerprint(&record.body) == body => {}
                Some(record) => {
                    return Err(format!(
                        "accepted record {offset} reads back as offset {} with another body: {} instead of {}",
                        record.offset,
                        shown_str(&fingerprint(&record.body)),
                        shown_str(&body)
                    ));
                }
                None => return Err(format!("accepted record {offset} is missing")),
            }
        }
        if let Err(error) = log.trim().await {
            self.typed("trim", &error, storage(&error))?;
        }
        Ok(())
    }

    async fn routing(&mut self) -> Result<(), Failed> {
        let replies: Vec<Option<LoadSnapshot>> = (0..8)
            .map(|_| {
                if self.fx.chance(0.3) {
                    None
                } else {
                    Some(self.snapshot_value())
                }
            })
            .collect();
        let fails = self.fx.chance(0.2);
        let caller = MemCaller { replies, fails };
        let mut builder = RoutingClient::builder(caller, {
            let start = self.now();
            move || start
        });
        if self.fx.chance(0.4) {
            let shards: Vec<String> = (0..3).map(|_| self.fx.name("shard")).collect();
            let refuses = self.fx.chance(0.2);
            builder = builder.sharding(move |input: &Value, _context, observations| {
                if refuses {
                    return Err(ShardingError::new("refused"));
                }
                let n = input.as_u64().unwrap_or(0) as usize + observations.len();
                Ok(RoutingTarget::new(shards[n % shards.len()].clone()))
            });
        }
        if self.fx.chance(0.4) {
            builder = builder.soft_backlog_limit(self.fx.count_u64("routing.soft_backlog_limit"));
        }
        if self.fx.chance(0.4) {
            builder = builder.max_width(self.fx.count_u64("routing.max_width"));
        }
        if self.fx.chance(0.4) {
            builder = builder.seed(self.fx.any_u64());
        }
        let client = match builder.build() {
            Ok(client) => client,
            Err(error) => {
                self.fx.note(format!("routing client refused: {error}"));
                return Ok(());
            }
        };
        for i in 0..self.fx.range_u64(1, 50) {
            let mut context = CallContext::new();
            if self.fx.chance(0.3) {
                context.insert(self.fx.name("context key"), json!(i));
            }
            let pushed = client.push(json!(i), context).await;
            if i < 3 {
                self.fx
                    .note(format!("push {i} -> {}", short(&pushed.map(|_| ()))));
            }
            let _ = client.width();
            let _ = client.observations();
        }
        Ok(())
    }

    fn snapshot_value(&mut self) -> LoadSnapshot {
        let load = Load::new(|| 0);
        let mut snapshot = load.snapshot(self.fx.count_u64("reply pending_deliveries"));
        snapshot.observed_at = self.fx.timestamp("reply observed_at", 0);
        snapshot.outbound.in_flight = self.fx.count_u64("reply outbound in_flight");
        snapshot.outbound.average_processing_ms = Some(self.fx.pick(&[f64::NAN, -1.0, 1e300, 5.0]));
        snapshot
    }

    fn load(&mut self) -> Result<(), Failed> {
        let clock = Rc::new(std::cell::Cell::new(self.now()));
        let load = {
            let clock = Rc::clone(&clock);
            Load::new(move || clock.get())
        };
        let mut in_flight = Vec::new();
        for _ in 0..self.fx.range_u64(1, 40) {
            match self.fx.below(4) {
                0 => in_flight.push(load.begin(if self.fx.chance(0.5) {
                    Direction::Inbound
                } else {
                    Direction::Outbound
                })),
                1 => {
                    if !in_flight.is_empty() {
                        let i = self.fx.below(in_flight.len());
                        in_flight.swap_remove(i).finish();
                    }
                }
                2 => {
                    let now = self.fx.timestamp("clock", clock.get());
                    clock.set(now);
                }
                _ => {
                    let snapshot = load.snapshot(self.fx.count_u64("pending"));
                    for average in [
                        snapshot.inbound.average_processing_ms,
                        snapshot.outbound.average_processing_ms,
                    ]
                    .into_iter()
                    .flatten()
                    {
                        if !average.is_finite() || average < 0.0 {
                            return Err(format!(
                                "a load snapshot has average_processing_ms {average}"
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The log's cold storage: records trimmed by a small retention move
    /// to a cold store (one that fails some writes, and sometimes loses a
    /// segment); every accepted record still reads back equal, from hot or
    /// cold, across segments, unless its segment was lost, which must be
    /// a typed `Truncated` error, never a wrong body.
    async fn log_cold(&mut self) -> Result<(), Failed> {
        let Some(scheduler) = self.scheduler() else {
            return Ok(());
        };
        let failing_writes = self.fx.range_u64(0, 3);
        let loses = self.fx.chance(0.1);
        self.fx.note(format!(
            "cold store: first {failing_writes} writes fail, loses a segment: {loses}"
        ));
        let cold = Rc::new(MemCold {
            segments: RefCell::new(std::collections::BTreeMap::new()),
            failing_writes: std::cell::Cell::new(failing_writes),
        });
        let mut retention = Retention::new().max_records(self.fx.range_u64(0, 8));
        if self.fx.chance(0.3) {
            retention = retention.max_bytes(self.fx.count_u64("retention.max_bytes"));
        }
        let mut builder = Log::<Value>::builder(&scheduler)
            .retention(retention)
            .cold(Rc::clone(&cold) as Rc<dyn durability::log::ColdStorage>);
        if self.fx.chance(0.5) {
            builder = builder.max_batch_size(self.fx.count_u32("log.max_batch_size"));
        }
        let log = match builder.build() {
            Ok(log) => log,
            Err(error) => {
                self.fx.note(format!("log refused: {error}"));
                return Ok(());
            }
        };
        let storage = |e: &durability::LogError| matches!(e, durability::LogError::Storage(_));
        let mut accepted = Vec::new();
        for _ in 0..self.fx.range_u64(1, 5) {
            let count = self.fx.range_u64(1, 30);
            let bodies: Vec<Value> = (0..count)
                .map(|i| {
                    if self.fx.chance(0.2) {
                        self.fx.body("body")
                    } else {
                        json!({"n": i})
                    }
                })
                .collect();
            let prints: Vec<String> = bodies.iter().map(fingerprint).collect();
            let appended = log
                .append(bodies.into_iter().map(AppendRecord::new).collect())
                .await;
            self.fx.note(format!(
                "append of {count} -> {}",
                short(&appended.as_ref().map(|a| a.offsets().map(<[u64]>::len)))
            ));
            match appended {
                Ok(appended) => {
                    if let Some(offsets) = appended.offsets() {
                        accepted.extend(offsets.iter().copied().zip(prints));
                    }
                }
                Err(error) => self.typed("append", &error, storage(&error))?,
            }
            let trimmed = log.trim().await;
            self.fx.note(format!("trim -> {}", short(&trimmed)));
            if let Err(error) = trimmed {
                self.typed("trim", &error, storage(&error))?;
            }
        }
        let first_segment = cold.segments.borrow().keys().next().cloned();
        if loses && let Some(key) = first_segment {
            self.fx.note(format!("segment {key} lost"));
            cold.segments.borrow_mut().remove(&key);
        }
        // Every record reads back, one at a time and in pages across
        // segments.
        for (offset, print) in &accepted {
            match log.read(Read::from_offset(*offset).limit(1)).await {
                Ok(page) => match page.records.first() {
                    Some(record)
                        if record.offset == *offset && &fingerprint(&record.body) == print => {}
                    other => {
                        return Err(format!(
                            "accepted record {offset} reads back as {:?}",
                            other.map(|r| (r.offset, shown_str(&fingerprint(&r.body))))
                        ));
                    }
                },
                Err(durability::LogError::Truncated { .. }) if loses => {}
                Err(error) => {
                    return Err(format!(
                        "accepted record {offset} does not read back: {error}"
                    ));
                }
            }
        }
        let mut from = 0;
        let mut pages = 0;
        while pages < 200 {
            pages += 1;
            match log.read(Read::from_offset(from).limit(7)).await {
                Ok(page) if page.records.is_empty() => break,
                Ok(page) => {
                    for record in &page.records {
                        if record.offset < from {
                            return Err(format!(
                                "a page from {from} holds offset {}",
                                record.offset
                            ));
                        }
                    }
                    from = page.records.last().map_or(from, |r| r.offset + 1);
                }
                Err(durability::LogError::Truncated { .. }) if loses => from += 1,
                Err(error) => return Err(format!("a page read from {from} failed: {error}")),
            }
        }
        Ok(())
    }

    /// Parked fanout deliveries brought back with `redrive_parked`: a
    /// consumer that fails until the redrive, no DLQ, so terminal
    /// deliveries park; then some parked ids (and unknown ones) redriven.
    /// A rejected redrive writes nothing; an accepted one ends visibly
    /// again (the consumer now succeeds).
    async fn fanout_redrive(&mut self) -> Result<(), Failed> {
        let Some(scheduler) = self.scheduler() else {
            return Ok(());
        };
        let healed = Rc::new(std::cell::Cell::new(false));
        let delivered = Rc::new(RefCell::new(HashSet::<String>::new()));
        let inbox = {
            let (healed, delivered) = (Rc::clone(&healed), Rc::clone(&delivered));
            Target::consumer(move |batch: Vec<FanoutMessage<Value>>| {
                let (healed, delivered) = (Rc::clone(&healed), Rc::clone(&delivered));
                async move {
                    ATTEMPTS.fetch_add(1, Ordering::Relaxed);
                    if !healed.get() {
                        return Err(HandlerError::non_retryable("down until the redrive"));
                    }
                    for message in &batch {
                        delivered.borrow_mut().insert(message.id.clone());
                    }
                    Ok(())
                }
            })
            .ack_on_return(true)
        };
        let mut builder = Fanout::<Value>::builder(&scheduler)
            .target("inbox", inbox)
            .on_lifecycle_event(count_attempts());
        if self.fx.chance(0.3) {
            builder =
                builder.max_enqueue_messages(self.fx.count_usize("fanout.max_enqueue_messages"));
        }
        let fanout = match builder.build() {
            Ok(fanout) => fanout,
            Err(error) => {
                self.fx.note(format!("fanout refused: {error}"));
                return Ok(());
            }
        };
        let count = self.fx.range_u64(1, 6);
        let messages: Vec<FanoutInput<Value>> = (0..count)
            .map(|i| FanoutInput::new(json!({"n": i})))
            .collect();
        let enqueued = fanout.enqueue(messages, &EnqueueOptions::all()).await;
        self.fx
            .note(format!("enqueue -> {}", short_enqueue(&enqueued)));
        if !matches!(enqueued, Ok(EnqueueResult::Accepted { .. })) {
            return Ok(());
        }
        let parked_count = |fanout: &Fanout<Value>| {
            fanout
                .parked(None, 1_000)
                .map(|entries| entries.len())
                .map_err(|e| format!("parked() failed: {e}"))
        };
        self.drive(|_| {
            Ok(if parked_count(&fanout)? as u64 >= count {
                Progress::Ended
            } else {
                Progress::Waiting
            })
        })
        .await?;
        let parked = fanout
            .parked(None, 1_000)
            .map_err(|e| format!("parked() failed: {e}"))?;
        if parked.len() as u64 != count {
            return Err(format!(
                "{count} messages failed for good without a DLQ but {} are parked",
                parked.len()
            ));
        }
        healed.set(true);
        let mut ids: Vec<String> = parked
            .iter()
            .filter(|_| self.fx.chance(0.7))
            .map(|entry| entry.id.clone())
            .collect();
        if self.fx.chance(0.3) {
            ids.push(self.fx.name("parked id"));
        }
        if self.fx.chance(0.1) {
            ids.push(ids.first().cloned().unwrap_or_default());
        }
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let before = self.snapshot()?;
        let redriven = fanout.redrive_parked(&refs).await;
        self.fx.note(format!(
            "redrive_parked of {} ids -> {}",
            ids.len(),
            short_enqueue(&redriven)
        ));
        match redriven {
            Ok(EnqueueResult::Accepted { value, .. }) => {
                let wanted: HashSet<String> = value.into_iter().collect();
                self.drive(|_| {
                    Ok(if wanted.iter().all(|id| delivered.borrow().contains(id)) {
                        Progress::Ended
                    } else {
                        Progress::Waiting
                    })
                })
                .await?;
                let missing: Vec<&String> = wanted
                    .iter()
                    .filter(|id| !delivered.borrow().contains(*id))
                    .collect();
                if !missing.is_empty() {
                    return Err(format!(
                        "redriven messages {missing:?} were accepted but never delivered"
                    ));
                }
            }
            Ok(EnqueueResult::Rejected { .. }) => self.unchanged(&before, "redrive_parked")?,
            Err(error) => {
                self.typed("redrive_parked", &error, true)?;
                self.unchanged(&before, "redrive_parked")?;
            }
        }
        Ok(())
    }

    /// Recurring named alarms: random intervals and cron expressions (bad
    /// ones and bad time zones too), missed-tick policies, pause, resume
    /// and cancel. A refused schedule writes nothing; an accepted one
    /// whose period fits the budget runs, and `list` shows it.
    async fn recurring(&mut self) -> Result<(), Failed> {
        let Some(scheduler) = self.scheduler() else {
            return Ok(());
        };
        let mode = self.fx.below(4);
        self.fx
            .note(format!("handler behaviour: {}", BEHAVIOURS[mode]));
        let runs = Rc::new(std::cell::Cell::new(0u64));
        let alarms = {
            let runs = Rc::clone(&runs);
            Alarms::builder(&scheduler)
                .handler("tick", move |call| {
                    let runs = Rc::clone(&runs);
                    let attempt = call.attempt;
                    async move {
                        runs.set(runs.get() + 1);
                        behave(mode, attempt, json!(null)).await.map(|_| ())
                    }
                })
                .on_lifecycle_event(count_attempts())
                .build()
        };
        let alarms = match alarms {
            Ok(alarms) => alarms,
            Err(error) => {
                self.fx.note(format!("alarms refused: {error}"));
                return Ok(());
            }
        };
        // The steps below sleep at most 50 ticks of an interval schedule:
        // a 1 ms schedule slept through for hours is a storm of millions
        // of ticks (a legitimate one, but it costs the run half its hang
        // timeout of CPU per case).
        let mut max_step_ms: u64 = 7_200_000;
        let recurrence = if self.fx.chance(0.5) {
            let every = self.fx.duration("every");
            let every_ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX);
            max_step_ms = max_step_ms.min(every_ms.saturating_mul(50)).max(1);
            durability::alarms::Recurrence::every(every)
        } else {
            let expression = self.fx.pick(&[
                "* * * * *",
                "*/5 * * * *",
                "0 8 * * *",
                "30 2 * * *",
                "0 0 29 2 *",
                "*/7 * * * * *",
                "61 * * * *",
                "",
                "not a cron",
                "0 0 31 2 *",
            ]);
            let zone = self.fx.pick(&[
                "UTC",
                "Europe/Paris",
                "America/St_Johns",
                "Mars/Olympus",
                "",
            ]);
            self.fx.note(format!("cron {expression:?} in {zone:?}"));
            durability::alarms::Recurrence::cron(expression, zone)
        };
        let recurrence = match recurrence {
            Ok(recurrence) => recurrence,
            Err(error) => {
                self.fx.note(format!("recurrence refused: {error}"));
                return Ok(());
            }
        };
        let recurrence = match self.fx.below(3) {
            0 => recurrence.missed_ticks(durability::alarms::MissedTicks::Skip),
            1 => recurrence.missed_ticks(durability::alarms::MissedTicks::RunOnce),
            _ => recurrence.missed_ticks(durability::alarms::MissedTicks::CatchUp {
                max: self.fx.count_u32("catch_up.max"),
            }),
        };
        let recurrence = if self.fx.chance(0.3) {
            recurrence.misfire_grace(self.fx.duration("misfire_grace"))
        } else {
            recurrence
        };
        let name = if self.fx.chance(0.9) {
            "tick".to_owned()
        } else {
            self.fx.name("alarm name")
        };
        let payload = self.fx.body("payload");
        let before = self.snapshot()?;
        let scheduled = alarms
            .schedule_recurring(&name, &recurrence, &payload)
            .await;
        drop_flat(payload);
        self.fx
            .note(format!("schedule_recurring -> {}", short(&scheduled)));
        let first = match scheduled {
            Ok(first) => first,
            Err(error) => {
                self.typed(
                    "schedule_recurring",
                    &error,
                    matches!(error, DurabilityError::Storage(_)),
                )?;
                return self.unchanged(&before, "schedule_recurring");
            }
        };
        let listed = alarms
            .get(&name)
            .map_err(|e| format!("get of a scheduled alarm failed: {e}"))?;
        if listed.is_none() {
            return Err(format!(
                "schedule_recurring accepted {name:?} but get() finds nothing"
            ));
        }
        // When the pending tick is due: the first, or a resume's.
        let mut due = first;
        for _ in 0..self.fx.range_u64(0, 3) {
            let step = self.fx.below(3);
            let result = match step {
                0 => alarms.pause(&name).await.map(|p| format!("{p}")),
                1 => {
                    let resumed = alarms.resume(&name).await;
                    if let Ok(at) = resumed {
                        due = Some(at);
                    }
                    resumed.map(|at| format!("{at}"))
                }
                _ => {
                    let step = self.fx.range_u64(1, max_step_ms);
                    tokio::time::sleep(Duration::from_millis(step)).await;
                    Ok("slept".into())
                }
            };
            self.fx.note(format!("step {step} -> {}", short(&result)));
            if let Err(error) = result {
                self.typed(
                    "pause/resume",
                    &error,
                    matches!(error, DurabilityError::Storage(_)),
                )?;
            }
        }
        let paused = matches!(
            alarms.get(&name),
            Ok(Some(entry)) if entry.state == durability::alarms::AlarmState::Paused
        );
        // A tick due within the budget runs (unless paused). One that came
        // due during a sleep step has run already: the schedule's next
        // tick may then be weeks away (seeds 1000001 and 20261201, cases
        // 972087 and 197254: ticks 2^31 ms apart, the first slept past).
        let due_in_budget = due.is_some_and(|at| at <= beyond_budget(self.now()) - 86_400_000);
        if due_in_budget && !paused && runs.get() == 0 {
            self.drive(|_| {
                Ok(if runs.get() > 0 {
                    Progress::Ended
                } else {
                    Progress::Waiting
                })
            })
            .await?;
            if runs.get() == 0
                && matches!(alarms.get(&name), Ok(Some(entry)) if entry.state != durability::alarms::AlarmState::Paused)
            {
                return Err(format!(
                    "recurring alarm {name:?} due at {due:?} never ran within the budget (now {})",
                    self.now()
                ));
            }
        }
        if self.fx.chance(0.5) {
            let cancelled = alarms.cancel(&name).await;
            self.fx.note(format!("cancel -> {}", short(&cancelled)));
            if let Err(error) = &cancelled {
                self.typed(
                    "cancel",
                    error,
                    matches!(error, DurabilityError::Storage(_)),
                )?;
            }
            if matches!(alarms.get(&name), Ok(Some(_))) && matches!(cancelled, Ok(true)) {
                return Err(format!("{name:?} was cancelled but get() still finds it"));
            }
        }
        let _ = alarms.list().map_err(|e| format!("list failed: {e}"))?;
        Ok(())
    }

    /// Sets up a capability with some accepted work, writes malformed rows
    /// straight into its tables, then drives it and calls its readers.
    async fn malformed_rows(&mut self) -> Result<(), Failed> {
        let scheduler = match Scheduler::new(Rc::clone(&self.ctx)) {
            Ok(scheduler) => scheduler,
            Err(error) => return Err(format!("a default scheduler failed: {error}")),
        };
        *self.stage.scheduler.borrow_mut() = Some(scheduler.clone());
        let which = self.fx.below(4);
        self.fx.note(format!(
            "capability: {}",
            ["operations", "alarms", "fanout", "log"][which]
        ));
        let ops = Operations::builder(&scheduler)
            .handler("echo", |call: DurableCall<Value>| async move {
                Ok::<_, HandlerError>(call.payload)
            })
            .build()
            .map_err(|e| format!("default operations failed: {e}"))?;
        let alarms = Alarms::builder(&scheduler)
            .handler("tick", |_call| async { Ok::<_, HandlerError>(()) })
            .build()
            .map_err(|e| format!("default alarms failed: {e}"))?;
        let fanout = Fanout::<Value>::builder(&scheduler)
            .target(
                "inbox",
                Target::consumer(|_batch: Vec<FanoutMessage<Value>>| async { Ok(()) })
                    .ack_on_return(true),
            )
            .build()
            .map_err(|e| format!("default fanout failed: {e}"))?;
        let log = Log::<Value>::builder(&scheduler)
            .leases(Leases::new())
            .build()
            .map_err(|e| format!("default log failed: {e}"))?;
        // Accepted work, not yet run (time does not move here).
        let _ = ops.start("echo", "op-1", &json!({"n": 1})).await;
        let _ = alarms.schedule("tick", self.now() + 5_000).await;
        let _ = fanout
            .enqueue(
                vec![FanoutInput::new(json!({"n": 1})).id("m-1")],
                &EnqueueOptions::all(),
            )
            .await;
        let _ = log
            .append(vec![
                AppendRecord::new(json!(1)),
                AppendRecord::keyed("k", json!(2)),
            ])
            .await;
        let prefix = [
            "durability_calls",
            "durability_alarms",
            "durability_fanout",
            "durability_log",
        ][which];
        let sql = self.ctx.storage();
        let tables: Vec<String> = sql
            .query(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE ? ORDER BY name",
                &params![format!("{prefix}%")],
            )
            .map_err(|e| format!("cannot list tables: {e}"))?
            .iter()
            .filter_map(|row| row.get::<String>(0).ok())
            .collect();
        if tables.is_empty() {
            return Err(format!("no {prefix}* table to damage"));
        }
        self.malformed = true;
        for _ in 0..self.fx.range_u64(1, 4) {
            let table = self.fx.pick(&tables);
            let columns: Vec<String> = sql
                .query(
                    &format!("SELECT name FROM pragma_table_info('{table}')"),
                    &[],
                )
                .map_err(|e| format!("cannot list columns: {e}"))?
                .iter()
                .filter_map(|row| row.get::<String>(0).ok())
                .collect();
            if columns.is_empty() {
                continue;
            }
            if self.fx.chance(0.6) {
                let column = self.fx.pick(&columns);
                let value = self.fx.garbage();
                self.fx.note(format!(
                    "UPDATE {table} SET {column} = {}",
                    shown_str(&format!("{value:?}"))
                ));
                let _ = sql.execute(
                    &format!("UPDATE \"{table}\" SET \"{column}\" = ?"),
                    &[value],
                );
            } else {
                let values: Vec<Sql> = columns.iter().map(|_| self.fx.garbage()).collect();
                self.fx.note(format!(
                    "INSERT INTO {table} {}",
                    shown_str(&format!("{values:?}"))
                ));
                let marks = vec!["?"; columns.len()].join(", ");
                let _ = sql.execute(
                    &format!("INSERT INTO \"{table}\" VALUES ({marks})"),
                    &values,
                );
            }
        }
        // Drive the damaged capability and read it every way there is.
        // Each await is noted first: a case that hangs names the call it
        // hung in (seed 20261202 case 364445 hung here once, for 16
        // virtual days, and passed when replayed alone at its clock).
        for round in 0..6 {
            self.fx.note(format!("round {round}: scheduler alarm"));
            let _ = scheduler.alarm(None).await;
            let _ = ops.result::<Value>("echo", "op-1");
            self.fx.note(format!("round {round}: operation wait"));
            let _ = ops
                .wait::<Value>("echo", "op-1", Duration::from_millis(10))
                .await;
            let _ = fanout.parked(None, 100);
            let _ = fanout.load();
            self.fx.note(format!("round {round}: log reads"));
            let _ = log.read(Read::from_offset(0)).await;
            let _ = log.read(Read::from_offset(1)).await;
            let _ = log.bounds().await;
            let _ = log.cursors().await;
            self.fx.note(format!("round {round}: log lease"));
            if let Ok(Some(lease)) = log.lease("c", None).await {
                self.fx.note(format!("round {round}: log ack"));
                let _ = log.ack("c", &lease.batch_id).await;
            }
            self.fx.note(format!("round {round}: log trim"));
            let _ = log.trim().await;
            if round == 3 {
                self.fx.note("round 3: purges");
                let _ = ops.purge_before(self.now() + 1).await;
                let _ = alarms.purge_before(self.now() + 1).await;
                let _ = fanout.purge_parked_before(self.now() + 1);
            }
            self.fx.note(format!("round {round}: sleep"));
            tokio::time::sleep(Duration::from_secs(4u64.pow(round))).await;
        }
        Ok(())
    }
}

/// A time past which waiting for work is pointless: it is visibly
/// scheduled after the case's budget.
fn beyond_budget(now: i64) -> i64 {
    now.saturating_add(i64::try_from(VIRTUAL_BUDGET.as_millis()).unwrap_or(i64::MAX))
}

const BEHAVIOURS: [&str; 6] = [
    "succeeds",
    "fails once, then succeeds",
    "always fails (retryable)",
    "fails non-retryably",
    "sleeps 2 virtual hours (past timeouts)",
    "returns a result nested 200 levels deep",
];

/// A lifecycle hook counting every settled attempt into [`ATTEMPTS`],
/// those that fail before a handler runs (a payload that does not decode)
/// included.
fn count_attempts() -> durability::lifecycle::LifecycleHook {
    Rc::new(|event: &durability::lifecycle::LifecycleEvent| {
        if matches!(
            event,
            durability::lifecycle::LifecycleEvent::AttemptSettled { .. }
        ) {
            ATTEMPTS.fetch_add(1, Ordering::Relaxed);
        }
        None
    })
}

/// A handler doing what behaviour `mode` says.
async fn behave(mode: usize, attempt: u32, ok: Value) -> Result<Value, HandlerError> {
    ATTEMPTS.fetch_add(1, Ordering::Relaxed);
    match mode {
        0 => Ok(ok),
        1 if attempt < 2 => Err(HandlerError::new("transient failure")),
        1 => Ok(ok),
        2 => Err(HandlerError::new("always fails")),
        3 => Err(HandlerError::non_retryable("fails for good")),
        4 => {
            tokio::time::sleep(Duration::from_secs(2 * 3_600)).await;
            Ok(ok)
        }
        _ => {
            let mut value = json!(0);
            for _ in 0..200 {
                value = Value::Array(vec![value]);
            }
            Ok(value)
        }
    }
}

/// What the targets of a fanout case saw.
#[derive(Default)]
struct Ends {
    /// How often each message id was handed to a target.
    tries: HashMap<String, i64>,
    /// (message id, target) delivered, stored or dead-lettered.
    ended: HashSet<(String, String)>,
}

/// The inbox consumer.
async fn consume(
    mode: usize,
    ack_on_return: bool,
    batch: Vec<FanoutMessage<Value>>,
    seen: &RefCell<Ends>,
) -> Result<(), HandlerError> {
    ATTEMPTS.fetch_add(1, Ordering::Relaxed);
    for message in &batch {
        *seen
            .borrow_mut()
            .tries
            .entry(message.id.clone())
            .or_default() += 1;
    }
    let ended = |message: &FanoutMessage<Value>| {
        seen.borrow_mut()
            .ended
            .insert((message.id.clone(), message.target.clone()));
    };
    match mode {
        0 | 5 => {
            for message in &batch {
                if message.ack().await.is_ok() {
                    ended(message);
                }
            }
            Ok(())
        }
        1 if batch.iter().any(|m| m.attempt < 2) => Err(HandlerError::new("transient")),
        1 => {
            if ack_on_return {
                batch.iter().for_each(ended);
            } else {
                for message in &batch {
                    if message.ack().await.is_ok() {
                        ended(message);
                    }
                }
            }
            Ok(())
        }
        2 => Err(HandlerError::new("always fails")),
        3 => {
            for message in &batch {
                let _ = message.dead_letter().await;
            }
            Ok(())
        }
        _ => {
            for message in &batch {
                let _ = message.retry_after(Duration::from_millis(1_500)).await;
            }
            Ok(())
        }
    }
}

/// An in-memory cold store whose first writes fail.
struct MemCold {
    /// Ordered, so the segment a case loses is the same on a rerun.
    segments: RefCell<std::collections::BTreeMap<String, durability::log::Segment>>,
    failing_writes: std::cell::Cell<u64>,
}

impl durability::log::ColdStorage for MemCold {
    fn write<'a>(
        &'a self,
        segment: &'a durability::log::Segment,
    ) -> durability::platform::LocalBoxFuture<'a, Result<String, durability::log::ColdError>> {
        Box::pin(async move {
            if self.failing_writes.get() > 0 {
                self.failing_writes.set(self.failing_writes.get() - 1);
                return Err(durability::log::ColdError::new(std::io::Error::other(
                    "cold store unavailable",
                )));
            }
            let locator = format!("{}-{}", segment.first_offset, segment.last_offset);
            self.segments
                .borrow_mut()
                .insert(locator.clone(), segment.clone());
            Ok(locator)
        })
    }

    fn read<'a>(
        &'a self,
        locator: &'a str,
    ) -> durability::platform::LocalBoxFuture<
        'a,
        Result<Option<durability::log::Segment>, durability::log::ColdError>,
    > {
        Box::pin(async move { Ok(self.segments.borrow().get(locator).cloned()) })
    }
}

/// A shard caller that answers from a fixed list of replies.
struct MemCaller {
    replies: Vec<Option<LoadSnapshot>>,
    fails: bool,
}

struct Reply(Option<LoadSnapshot>);

impl ReportsLoad for Reply {
    fn load_snapshot(&self) -> Option<LoadSnapshot> {
        self.0
    }
}

impl ShardCaller for MemCaller {
    type Input = Value;
    type Output = Reply;
    type Error = std::io::Error;

    async fn call(
        &self,
        target: &RoutingTarget,
        _input: Value,
        _context: &CallContext,
    ) -> Result<Reply, std::io::Error> {
        if self.fails {
            return Err(std::io::Error::other("the shard is unreachable"));
        }
        let n = target.shard.len() % self.replies.len().max(1);
        Ok(Reply(self.replies.get(n).copied().flatten()))
    }
}

/// A result in a trace line.
fn short<T: std::fmt::Debug, E: std::fmt::Display>(result: &Result<T, E>) -> String {
    let text = match result {
        Ok(value) => format!("Ok({value:?})"),
        Err(error) => format!("Err({error})"),
    };
    shown_str(&text)
}

fn short_enqueue(
    result: &Result<EnqueueResult<Vec<String>>, durability::fanout::FanoutError>,
) -> String {
    match result {
        Ok(EnqueueResult::Accepted { value, .. }) => format!("Accepted({} ids)", value.len()),
        Ok(EnqueueResult::Rejected { error, .. }) => shown_str(&format!("Rejected({error})")),
        Err(error) => shown_str(&format!("Err({error})")),
    }
}

/// The kinds' names by index, for reports.
pub fn kind_name(kind: usize) -> &'static str {
    KINDS.get(kind).copied().unwrap_or("?")
}
