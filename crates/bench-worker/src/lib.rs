//! The benchmark worker of `scripts/workerd-bench`, in the shape the
//! reference library is measured in: one request starts a loop inside one
//! Durable Object and answers with its timings, so a figure is the object's
//! own work, not HTTP round trips.
//!
//! `POST /run/<object>` with a JSON scenario goes to the object named
//! `<object>` (a fresh name per run: one scenario per object):
//!
//! - `{"scenario": "fanout", "messages", "enqueue_batch", "delivery_batch"}`:
//!   `messages` enqueued in batches of `enqueue_batch` to two consumer
//!   targets that ack on return, delivered `delivery_batch` at a time; timed
//!   from the first enqueue until every delivery is acked. With
//!   `"paused_enqueue": true` both targets are paused while enqueueing, so
//!   acceptance and delivery are timed apart (the profile, not the figure).
//! - `{"scenario": "operations", "operations", "callers"}`: no-op durable
//!   operations, each started and awaited to its result; `callers` loops
//!   run concurrently inside the object (one request), each sequential.
//! - `{"scenario": "calibrate", "inserts", "crossings"}`: what one SQL
//!   statement and one wasm-to-JavaScript call cost here, for the profile.
//!
//! Every timed scenario ends with its floor, measured in the same request:
//! the same number of items, one `INSERT` through the contract's
//! `Sql::execute` per item. Counts come from the adapter
//! ([`CloudflareStorage::counts`](durability_cloudflare::CloudflareStorage::counts)).
//!
//! Timing: inside workerd `Date.now()` stands still while code runs and
//! moves only when the event loop turns (a guard against timing attacks),
//! so every reading here first yields to a zero-delay timer
//! ([`Bench::fresh_now`]); a loop without awaits is timed from outside it.
//!
//! Only the wasm32 build has content.
#![cfg(target_arch = "wasm32")]

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use durability::fanout::{EnqueueOptions, Fanout, FanoutInput, FanoutMessage, Target};
use durability::{DurableCall, HandlerError, OperationResult, Operations, Scheduler};
use durability_cloudflare::{
    AlarmInfo, CloudflareContext, DurableObject, SqlCounts, durable_object,
};
use durability_platform::{Context, EpochMs, params};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use worker::{Env, Request, Response, event};

durable_object!(BenchObject, Bench);

/// The Durable Object binding of the benchmark's workerd config.
const BINDING: &str = "BENCH";
/// The two fanout targets; both ack on return.
const TARGETS: [&str; 2] = ["a", "b"];
/// The no-op operation.
const NOOP: &str = "noop";
/// How long one operation may take before the run is declared stuck.
const OPERATION_WAIT: Duration = Duration::from_secs(60);

const SCHEMA_SQL: &str = "
    CREATE TABLE IF NOT EXISTS bench_floor (
        id INTEGER PRIMARY KEY,
        n INTEGER NOT NULL
    );";

/// A fanout message body: small, as in the reference's benchmark.
#[derive(Serialize, Deserialize)]
struct Item {
    n: u64,
}

#[derive(Deserialize)]
#[serde(tag = "scenario", rename_all = "snake_case")]
enum Scenario {
    Fanout {
        messages: u64,
        enqueue_batch: u64,
        delivery_batch: usize,
        #[serde(default)]
        paused_enqueue: bool,
    },
    Operations {
        operations: u64,
        callers: u64,
    },
    Calibrate {
        inserts: u64,
        crossings: u64,
    },
}

/// What the two fanout targets have been handed, and a wake-up for the
/// request waiting for all of it.
#[derive(Default)]
struct Delivered {
    messages: Cell<u64>,
    batches: Cell<u64>,
    expected: Cell<u64>,
    done: tokio::sync::Notify,
}

/// The capability a run built: one per object, on first use.
enum Built {
    Fanout(Fanout<Item>, Rc<Delivered>),
    Operations(Operations),
}

/// One benchmark object.
pub struct Bench {
    ctx: Rc<CloudflareContext>,
    scheduler: Scheduler,
    built: RefCell<Option<Built>>,
}

fn rust_error(error: impl std::fmt::Display) -> worker::Error {
    worker::Error::RustError(error.to_string())
}

/// `after - before`, field by field.
fn counted(before: SqlCounts, after: SqlCounts) -> SqlCounts {
    SqlCounts {
        statements: after.statements - before.statements,
        parameters: after.parameters - before.parameters,
        rows: after.rows - before.rows,
        transactions: after.transactions - before.transactions,
    }
}

/// Items per second over `ms` (at least one millisecond, the clock's step).
fn per_sec(items: u64, ms: EpochMs) -> f64 {
    items as f64 * 1_000.0 / ms.max(1) as f64
}

/// The counts of a run, per item.
fn per_item(counts: SqlCounts, items: u64) -> Value {
    let items = items.max(1) as f64;
    json!({
        "statements": counts.statements as f64 / items,
        "parameters": counts.parameters as f64 / items,
        "rows_read": counts.rows as f64 / items,
        "transactions": counts.transactions as f64 / items,
    })
}

impl DurableObject for Bench {
    fn new(ctx: Rc<CloudflareContext>, _env: Env) -> worker::Result<Self> {
        let dyn_ctx: Rc<dyn Context> = ctx.clone();
        dyn_ctx
            .storage()
            .execute_script(SCHEMA_SQL)
            .map_err(rust_error)?;
        let scheduler = Scheduler::new(dyn_ctx).map_err(rust_error)?;
        Ok(Bench {
            ctx,
            scheduler,
            built: RefCell::new(None),
        })
    }

    async fn fetch(&self, mut req: Request) -> worker::Result<Response> {
        let text = req.text().await?;
        let scenario: Scenario = match serde_json::from_str(&text) {
            Ok(scenario) => scenario,
            Err(error) => return Response::error(format!("bad scenario: {error}"), 400),
        };
        let report = match scenario {
            Scenario::Fanout {
                messages,
                enqueue_batch,
                delivery_batch,
                paused_enqueue,
            } => {
                self.fanout(messages, enqueue_batch, delivery_batch, paused_enqueue)
                    .await?
            }
            Scenario::Operations {
                operations,
                callers,
            } => self.operations(operations, callers).await?,
            Scenario::Calibrate { inserts, crossings } => {
                self.calibrate(inserts, crossings).await?
            }
        };
        Response::from_json(&report)
    }

    async fn alarm(&self, info: AlarmInfo) -> worker::Result<()> {
        self.scheduler.alarm(Some(info)).await.map_err(rust_error)
    }
}

impl Bench {
    /// The clock after the event loop has turned: `Date.now()` inside
    /// workerd is the time of the last turn, not of this instruction.
    async fn fresh_now(&self) -> EpochMs {
        self.ctx.sleep(Duration::ZERO).await;
        self.ctx.now_ms()
    }

    fn counts(&self) -> SqlCounts {
        self.ctx.cloudflare_storage().counts()
    }

    fn build_fanout(&self, delivery_batch: usize) -> worker::Result<(Fanout<Item>, Rc<Delivered>)> {
        let mut built = self.built.borrow_mut();
        match &*built {
            Some(Built::Fanout(fanout, delivered)) => {
                return Ok((fanout.clone(), Rc::clone(delivered)));
            }
            Some(Built::Operations(_)) => return Err(rust_error("one scenario per object")),
            None => {}
        }
        let delivered = Rc::new(Delivered::default());
        let mut builder = Fanout::<Item>::builder(&self.scheduler).max_batch_size(delivery_batch);
        for target in TARGETS {
            let delivered = Rc::clone(&delivered);
            builder = builder.target(
                target,
                Target::consumer(move |batch: Vec<FanoutMessage<Item>>| {
                    let delivered = Rc::clone(&delivered);
                    async move {
                        delivered.batches.set(delivered.batches.get() + 1);
                        let total = delivered.messages.get() + batch.len() as u64;
                        delivered.messages.set(total);
                        if total >= delivered.expected.get() {
                            delivered.done.notify_one();
                        }
                        Ok::<_, HandlerError>(())
                    }
                })
                .ack_on_return(true),
            );
        }
        let fanout = builder.build().map_err(rust_error)?;
        *built = Some(Built::Fanout(fanout.clone(), Rc::clone(&delivered)));
        Ok((fanout, delivered))
    }

    fn build_operations(&self) -> worker::Result<Operations> {
        let mut built = self.built.borrow_mut();
        match &*built {
            Some(Built::Operations(operations)) => return Ok(operations.clone()),
            Some(Built::Fanout(..)) => return Err(rust_error("one scenario per object")),
            None => {}
        }
        let operations = Operations::builder(&self.scheduler)
            .handler(NOOP, |_call: DurableCall<Value>| async {
                Ok::<_, HandlerError>(Value::Null)
            })
            .build()
            .map_err(rust_error)?;
        *built = Some(Built::Operations(operations.clone()));
        Ok(operations)
    }

    async fn fanout(
        &self,
        messages: u64,
        enqueue_batch: u64,
        delivery_batch: usize,
        paused_enqueue: bool,
    ) -> worker::Result<Value> {
        let (fanout, delivered) = self.build_fanout(delivery_batch)?;
        let deliveries = messages * TARGETS.len() as u64;
        delivered
            .expected
            .set(delivered.messages.get() + deliveries);
        if paused_enqueue {
            for target in TARGETS {
                fanout.pause_target(target).await.map_err(rust_error)?;
            }
        }
        let before = self.counts();
        let batches_before = delivered.batches.get();
        let started = self.fresh_now().await;
        let mut enqueue_counts = SqlCounts::default();
        let mut n = 0;
        while n < messages {
            let end = (n + enqueue_batch).min(messages);
            let batch: Vec<FanoutInput<Item>> =
                (n..end).map(|n| FanoutInput::new(Item { n })).collect();
            let counts_before = self.counts();
            let result = fanout
                .enqueue(batch, &EnqueueOptions::all())
                .await
                .map_err(rust_error)?;
            if !result.is_accepted() {
                return Err(rust_error(format!("enqueue rejected at message {n}")));
            }
            // Approximate while delivery runs: a pass may run at an await
            // inside the enqueue.
            let spent = counted(counts_before, self.counts());
            enqueue_counts.statements += spent.statements;
            enqueue_counts.parameters += spent.parameters;
            enqueue_counts.rows += spent.rows;
            enqueue_counts.transactions += spent.transactions;
            n = end;
        }
        let enqueued = self.fresh_now().await;
        let delivery_started = if paused_enqueue {
            for target in TARGETS {
                fanout.resume_target(target).await.map_err(rust_error)?;
            }
            self.fresh_now().await
        } else {
            started
        };
        // The handlers have seen every message; then every ack committed.
        while delivered.messages.get() < delivered.expected.get() {
            delivered.done.notified().await;
        }
        while fanout
            .load()
            .map_err(rust_error)?
            .outbound
            .pending_deliveries
            > 0
        {
            self.ctx.sleep(Duration::ZERO).await;
        }
        let finished = self.fresh_now().await;
        let counts = counted(before, self.counts());
        let floor = self.floor(deliveries).await?;
        Ok(json!({
            "messages": messages,
            "deliveries": deliveries,
            "enqueue_batch": enqueue_batch,
            "delivery_batch": delivery_batch,
            "paused_enqueue": paused_enqueue,
            "seconds": (finished - started) as f64 / 1_000.0,
            "enqueue_seconds": (enqueued - started) as f64 / 1_000.0,
            "delivery_seconds": (finished - delivery_started) as f64 / 1_000.0,
            "deliveries_per_sec": per_sec(deliveries, finished - started),
            "handler_batches": delivered.batches.get() - batches_before,
            "per_delivery": per_item(counts, deliveries),
            "enqueue_per_message": per_item(enqueue_counts, messages),
            "delivery_per_delivery": per_item(counted(enqueue_counts, counts), deliveries),
            "floor": floor,
            "floor_per_sec": floor["per_sec"],
        }))
    }

    async fn operations(&self, operations: u64, callers: u64) -> worker::Result<Value> {
        let ops = self.build_operations()?;
        let callers = callers.max(1);
        let before = self.counts();
        let started = self.fresh_now().await;
        let run = |caller: u64| {
            let ops = ops.clone();
            async move {
                let mut n = caller;
                while n < operations {
                    let id = format!("op-{n}");
                    ops.start(NOOP, &id, &Value::Null)
                        .await
                        .map_err(|e| format!("start {id}: {e}"))?;
                    match ops.wait::<Value>(NOOP, &id, OPERATION_WAIT).await {
                        Ok(OperationResult::Completed { .. }) => {}
                        Ok(other) => return Err(format!("{id}: {other:?}")),
                        Err(error) => return Err(format!("wait {id}: {error}")),
                    }
                    n += callers;
                }
                Ok(())
            }
        };
        let results = futures::future::join_all((0..callers).map(run)).await;
        if let Some(Err(error)) = results.into_iter().find(Result::is_err) {
            return Err(rust_error(error));
        }
        let finished = self.fresh_now().await;
        let counts = counted(before, self.counts());
        let floor = self.floor(operations).await?;
        Ok(json!({
            "operations": operations,
            "callers": callers,
            "concurrency": "callers are concurrent loops inside the object, in one request",
            "seconds": (finished - started) as f64 / 1_000.0,
            "ops_per_sec": per_sec(operations, finished - started),
            "per_operation": per_item(counts, operations),
            "floor": floor,
            "floor_per_sec": floor["per_sec"],
        }))
    }

    /// The floor of a scenario of `items` items: one `INSERT` through the
    /// contract's `execute` per item, in a loop with nothing else in it.
    /// Synchronous, so it is timed by fresh readings around it.
    async fn floor(&self, items: u64) -> worker::Result<Value> {
        let storage = self.ctx.storage();
        let before = self.counts();
        let started = self.fresh_now().await;
        for n in 0..items {
            storage
                .execute("INSERT INTO bench_floor (n) VALUES (?)", &params![n as i64])
                .map_err(rust_error)?;
        }
        let finished = self.fresh_now().await;
        let counts = counted(before, self.counts());
        Ok(json!({
            "what": "one INSERT through Sql::execute per item",
            "items": items,
            "seconds": (finished - started) as f64 / 1_000.0,
            "per_sec": per_sec(items, finished - started),
            "per_item": per_item(counts, items),
        }))
    }

    /// Per-unit costs in this runtime, each loop run twice in turn and the
    /// second round kept (the first pays for warming the code up).
    async fn calibrate(&self, inserts: u64, crossings: u64) -> worker::Result<Value> {
        let storage = self.ctx.storage();
        let insert = "INSERT INTO bench_floor (n) VALUES (?)";
        let returning = "INSERT INTO bench_floor (n) VALUES (?) RETURNING 1";
        let mut report = json!({});
        for _round in 0..2 {
            let started = self.fresh_now().await;
            for n in 0..inserts {
                storage
                    .execute(insert, &params![n as i64])
                    .map_err(rust_error)?;
            }
            let executed = self.fresh_now().await;
            for n in 0..inserts {
                // One statement: `query` reads the cursor and asks nothing more.
                storage
                    .query(insert, &params![n as i64])
                    .map_err(rust_error)?;
            }
            let queried = self.fresh_now().await;
            for n in 0..inserts {
                // One statement whose one row is the count `execute` asks
                // `changes()` for.
                storage
                    .query(returning, &params![n as i64])
                    .map_err(rust_error)?;
            }
            let returned = self.fresh_now().await;
            let mut sum = 0.0;
            for _ in 0..crossings {
                sum += worker::js_sys::Date::now();
            }
            let crossed = self.fresh_now().await;
            let mut text = 0;
            for n in 0..crossings {
                text += serde_json::to_string(&Item { n })
                    .map_err(rust_error)?
                    .len();
            }
            let encoded = self.fresh_now().await;
            let us = |ms: EpochMs, items: u64| ms as f64 * 1_000.0 / items.max(1) as f64;
            report = json!({
                "execute_insert_us": us(executed - started, inserts),
                "query_insert_us": us(queried - executed, inserts),
                "query_insert_returning_us": us(returned - queried, inserts),
                "js_call_us": us(crossed - returned, crossings),
                "json_encode_item_us": us(encoded - crossed, crossings),
                // Kept so the loops are not optimized away.
                "checksum": sum > 0.0 && text > 0,
            });
        }
        Ok(report)
    }
}

#[event(fetch)]
async fn fetch(req: Request, env: Env, _ctx: worker::Context) -> worker::Result<Response> {
    let path = req.path();
    let Some(name) = path.strip_prefix("/run/").filter(|n| !n.is_empty()) else {
        return Response::error("POST /run/<object> with a JSON scenario", 404);
    };
    let stub = env.durable_object(BINDING)?.get_by_name(name)?;
    stub.fetch_with_request(req).await
}
