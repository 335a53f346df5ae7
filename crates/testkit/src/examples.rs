//! One complete, runnable test per capability, each of a user's own
//! object: the object type and its factory as production would write
//! them, then a test through the kit. They run as doc tests under
//! `cargo test --workspace`.
//!
//! Every example follows the same shape: the factory builds the scheduler
//! and the capability, `DurableObject::alarm` delegates to the scheduler,
//! and the test never installs anything into a running object.

pub mod operation_handler {
    //! A durable operation whose handler fails on its first attempt: the
    //! test sees the stored error, crashes the host while the retry waits,
    //! lets time pass and finds the operation completed by its second
    //! attempt, run by the host's alarm after the restart.
    //!
    //! ```
    //! use std::rc::Rc;
    //! use std::time::Duration;
    //!
    //! use durability::{DurableCall, HandlerError, OperationResult, Operations, Scheduler};
    //! use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext};
    //! use durability_test::{block_on, TestHost};
    //!
    //! struct Payments {
    //!     scheduler: Scheduler,
    //!     operations: Operations,
    //! }
    //!
    //! impl DurableObject for Payments {
    //!     async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
    //!         Ok(self.scheduler.alarm(Some(info)).await?)
    //!     }
    //! }
    //!
    //! fn payments(ctx: ObjectContext) -> Result<Payments, BoxError> {
    //!     let scheduler = Scheduler::new(ctx.into_dyn())?;
    //!     let operations = Operations::builder(&scheduler)
    //!         .handler("charge", |call: DurableCall<u64>| async move {
    //!             if call.attempt == 1 {
    //!                 return Err(HandlerError::new("card network down"));
    //!             }
    //!             Ok(format!("receipt for {} cents", call.payload))
    //!         })
    //!         .build()?;
    //!     Ok(Payments { scheduler, operations })
    //! }
    //!
    //! # fn main() -> Result<(), Box<dyn std::error::Error>> {
    //! block_on(async {
    //!     let kit = TestHost::start()?;
    //!     let shop = kit.namespace("payments", payments)?.object("shop-1")?;
    //!
    //!     shop.run(|p: Rc<Payments>| async move {
    //!         p.operations.start("charge", "order-17", &1_250_u64).await
    //!     })
    //!     .await??;
    //!     kit.settle().await; // the eager first attempt runs and fails
    //!     let state = shop
    //!         .run(|p: Rc<Payments>| async move {
    //!             p.operations.result::<String>("charge", "order-17")
    //!         })
    //!         .await??;
    //!     let OperationResult::Pending { attempt, last_error, .. } = state else {
    //!         panic!("expected a pending retry, got {state:?}");
    //!     };
    //!     assert_eq!((attempt, last_error.as_deref()), (1, Some("card network down")));
    //!
    //!     // A crash while the retry waits: only the row and the alarm remain.
    //!     kit.restart().await?;
    //!     kit.advance(Duration::from_secs(60)).await;
    //!
    //!     let done = shop
    //!         .run(|p: Rc<Payments>| async move {
    //!             p.operations.result::<String>("charge", "order-17")
    //!         })
    //!         .await??;
    //!     assert_eq!(done, OperationResult::Completed { result: "receipt for 1250 cents".into() });
    //!     assert_eq!(shop.stored_alarm()?, None, "nothing left to run");
    //!     kit.shutdown().await;
    //!     Ok::<_, Box<dyn std::error::Error>>(())
    //! })??;
    //! # Ok(())
    //! # }
    //! ```
}

pub mod fanout_consumer {
    //! A fanout consumer that dead-letters what it cannot handle. The test
    //! takes the consumer's in-memory record out of the object (no statics,
    //! no `Send`), checks the parked dead letter, and injects a commit
    //! failure to see that a failed enqueue accepts nothing.
    //!
    //! ```
    //! use std::cell::RefCell;
    //! use std::rc::Rc;
    //! use std::time::Duration;
    //!
    //! use durability::fanout::{EnqueueOptions, Fanout, FanoutInput, FanoutMessage, Target};
    //! use durability::{HandlerError, Scheduler};
    //! use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext};
    //! use durability_test::{block_on, TestHost};
    //!
    //! struct Inbox {
    //!     scheduler: Scheduler,
    //!     mail: Fanout<String>,
    //!     /// What the consumer delivered, in order (memory only).
    //!     delivered: Rc<RefCell<Vec<String>>>,
    //! }
    //!
    //! impl DurableObject for Inbox {
    //!     async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
    //!         Ok(self.scheduler.alarm(Some(info)).await?)
    //!     }
    //! }
    //!
    //! fn inbox(ctx: ObjectContext) -> Result<Inbox, BoxError> {
    //!     let scheduler = Scheduler::new(ctx.into_dyn())?;
    //!     let delivered = Rc::new(RefCell::new(Vec::new()));
    //!     let seen = Rc::clone(&delivered);
    //!     let consumer = Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
    //!         let seen = Rc::clone(&seen);
    //!         async move {
    //!             for message in &batch {
    //!                 if message.body.starts_with("spam") {
    //!                     message.dead_letter().await?;
    //!                 } else {
    //!                     seen.borrow_mut().push(message.body.clone());
    //!                 }
    //!             }
    //!             Ok::<_, HandlerError>(())
    //!         }
    //!     });
    //!     let mail = Fanout::builder(&scheduler)
    //!         .target("inbox", consumer.ack_on_return(true))
    //!         .build()?;
    //!     Ok(Inbox { scheduler, mail, delivered })
    //! }
    //!
    //! fn batch(bodies: &[&str]) -> Vec<FanoutInput<String>> {
    //!     bodies.iter().map(|b| FanoutInput::new((*b).to_owned())).collect()
    //! }
    //!
    //! # fn main() -> Result<(), Box<dyn std::error::Error>> {
    //! block_on(async {
    //!     let kit = TestHost::start()?;
    //!     let alice = kit.namespace("inbox", inbox)?.object("alice")?;
    //!
    //!     // A commit that fails: the enqueue errs and nothing is accepted.
    //!     alice.fail_next_commit().await?;
    //!     let failed = alice
    //!         .run(|i: Rc<Inbox>| async move {
    //!             i.mail.enqueue(batch(&["lost?"]), &EnqueueOptions::all()).await
    //!         })
    //!         .await?;
    //!     assert!(failed.is_err());
    //!     assert_eq!(alice.count("durability_fanout_messages")?, 0);
    //!
    //!     let accepted = alice
    //!         .run(|i: Rc<Inbox>| async move {
    //!             i.mail.enqueue(batch(&["hello", "spam: win", "bye"]), &EnqueueOptions::all()).await
    //!         })
    //!         .await??;
    //!     assert!(accepted.is_accepted());
    //!     kit.advance(Duration::from_secs(1)).await;
    //!
    //!     let (delivered, parked) = alice
    //!         .run(|i: Rc<Inbox>| async move {
    //!             let delivered = i.delivered.borrow().clone();
    //!             (delivered, i.mail.parked(None, 10))
    //!         })
    //!         .await?;
    //!     assert_eq!(delivered, ["hello", "bye"]);
    //!     let parked = parked?;
    //!     assert_eq!(parked.len(), 1);
    //!     assert_eq!(parked[0].body, "spam: win");
    //!     kit.shutdown().await;
    //!     Ok::<_, Box<dyn std::error::Error>>(())
    //! })??;
    //! # Ok(())
    //! # }
    //! ```
}

pub mod named_alarm {
    //! A named alarm due in an hour, delivered by the host's physical alarm
    //! after the object was evicted (its in-memory timer is gone with it):
    //! the factory builds the object again with its scheduler, and the
    //! handler sees the platform's [`AlarmInfo`](crate::AlarmInfo). Firing
    //! the alarm early runs nothing early, and once the work is done no
    //! alarm is left armed.
    //!
    //! ```
    //! use std::rc::Rc;
    //! use std::time::Duration;
    //!
    //! use durability::{AlarmCall, Alarms, HandlerError, Scheduler};
    //! use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext};
    //! use durability_platform::{Context, params};
    //! use durability_test::{block_on, FiredAlarm, TestHost};
    //!
    //! struct Reminders {
    //!     scheduler: Scheduler,
    //!     alarms: Alarms,
    //! }
    //!
    //! impl DurableObject for Reminders {
    //!     async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
    //!         Ok(self.scheduler.alarm(Some(info)).await?)
    //!     }
    //! }
    //!
    //! fn reminders(ctx: ObjectContext) -> Result<Reminders, BoxError> {
    //!     ctx.storage().execute_script(
    //!         "CREATE TABLE IF NOT EXISTS sent (key TEXT PRIMARY KEY, platform_retry INTEGER)",
    //!     )?;
    //!     let ctx = ctx.into_dyn();
    //!     let scheduler = Scheduler::new(Rc::clone(&ctx))?;
    //!     let alarms = Alarms::builder(&scheduler)
    //!         .handler("nightly", move |call: AlarmCall| {
    //!             let ctx = Rc::clone(&ctx);
    //!             async move {
    //!                 // Keyed by the idempotency key: a repeated run sends once.
    //!                 ctx.storage().execute(
    //!                     "INSERT OR IGNORE INTO sent (key, platform_retry) VALUES (?1, ?2)",
    //!                     &params![call.idempotency_key, call.platform.map(|p| p.retry_count)],
    //!                 )?;
    //!                 Ok::<_, HandlerError>(())
    //!             }
    //!         })
    //!         .build()?;
    //!     Ok(Reminders { scheduler, alarms })
    //! }
    //!
    //! # fn main() -> Result<(), Box<dyn std::error::Error>> {
    //! block_on(async {
    //!     let kit = TestHost::start()?;
    //!     let bob = kit.namespace("reminders", reminders)?.object("bob")?;
    //!     let due = kit.now_ms() + 3_600_000;
    //!     bob.run(move |r: Rc<Reminders>| async move { r.alarms.schedule("nightly", due).await })
    //!         .await??;
    //!     assert!(bob.stored_alarm()?.is_some());
    //!
    //!     // Fired early, the scheduler finds nothing due and re-arms.
    //!     assert_eq!(bob.fire_alarm().await?, FiredAlarm::Ran);
    //!     assert_eq!(bob.count("sent")?, 0);
    //!     assert!(bob.stored_alarm()?.is_some());
    //!
    //!     bob.evict().await?;
    //!     kit.advance_to(due + 1_000).await;
    //!     let sent = bob.query("SELECT platform_retry FROM sent", &[])?;
    //!     assert_eq!(sent.len(), 1);
    //!     assert_eq!(sent[0].get::<Option<i64>>(0)?, Some(0), "run by the physical alarm");
    //!     assert_eq!(bob.fire_alarm().await?, FiredAlarm::NotArmed);
    //!     kit.shutdown().await;
    //!     Ok::<_, Box<dyn std::error::Error>>(())
    //! })??;
    //! # Ok(())
    //! # }
    //! ```
}

pub mod log_consumer {
    //! A log consumer that indexes records into a table of its own and
    //! commits its cursor after each page. An injected commit failure makes
    //! one page fail; a crash follows; the consumer resumes at its cursor
    //! and every record is indexed exactly once.
    //!
    //! ```
    //! use std::rc::Rc;
    //!
    //! use durability::log::{AppendRecord, Log, Read};
    //! use durability::Scheduler;
    //! use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext};
    //! use durability_platform::{Context, StorageExt, params};
    //! use durability_test::{block_on, TestHost};
    //!
    //! struct Search {
    //!     ctx: ObjectContext,
    //!     scheduler: Scheduler,
    //!     log: Log<String>,
    //! }
    //!
    //! impl DurableObject for Search {
    //!     async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
    //!         Ok(self.scheduler.alarm(Some(info)).await?)
    //!     }
    //! }
    //!
    //! impl Search {
    //!     /// The consumer: indexes one page from its cursor, then commits.
    //!     /// Returns how many records it indexed.
    //!     async fn index_page(&self) -> Result<usize, BoxError> {
    //!         let from = self.log.cursor("indexer").await?.unwrap_or(0);
    //!         let page = self.log.read(Read::from_offset(from).limit(2)).await?;
    //!         let records = page.records.clone();
    //!         self.ctx.storage().transaction_sync(|sql| {
    //!             for record in &records {
    //!                 sql.execute(
    //!                     "INSERT INTO indexed (offset, body) VALUES (?1, ?2)",
    //!                     &params![record.offset as i64, record.body.clone()],
    //!                 )?;
    //!             }
    //!             Ok::<_, durability_platform::StorageError>(())
    //!         })?;
    //!         self.log.commit("indexer", page.next_offset).await?;
    //!         Ok(records.len())
    //!     }
    //! }
    //!
    //! fn search(ctx: ObjectContext) -> Result<Search, BoxError> {
    //!     ctx.storage().execute_script(
    //!         "CREATE TABLE IF NOT EXISTS indexed (offset INTEGER PRIMARY KEY, body TEXT NOT NULL)",
    //!     )?;
    //!     let scheduler = Scheduler::new(ctx.clone().into_dyn())?;
    //!     let log = Log::builder(&scheduler).build()?;
    //!     Ok(Search { ctx, scheduler, log })
    //! }
    //!
    //! # fn main() -> Result<(), Box<dyn std::error::Error>> {
    //! block_on(async {
    //!     let kit = TestHost::start()?;
    //!     let docs = kit.namespace("search", search)?.object("docs")?;
    //!     docs.run(|s: Rc<Search>| async move {
    //!         let records = ["a", "b", "c", "d", "e"].map(|b| AppendRecord::new(b.to_owned()));
    //!         s.log.append(records.into()).await
    //!     })
    //!     .await??;
    //!
    //!     let first = docs.run(|s: Rc<Search>| async move { s.index_page().await.map_err(|e| e.to_string()) });
    //!     assert_eq!(first.await??, 2);
    //!
    //!     // The next page's insert fails: nothing of it is written, the
    //!     // cursor stays, and the page is read again later.
    //!     docs.fail_next_commit().await?;
    //!     let failed = docs.run(|s: Rc<Search>| async move { s.index_page().await.map_err(|e| e.to_string()) });
    //!     assert!(failed.await?.is_err());
    //!     assert_eq!(docs.count("indexed")?, 2);
    //!
    //!     kit.restart().await?;
    //!     let mut indexed = 0;
    //!     loop {
    //!         let page = docs.run(|s: Rc<Search>| async move { s.index_page().await.map_err(|e| e.to_string()) });
    //!         match page.await?? {
    //!             0 => break,
    //!             n => indexed += n,
    //!         }
    //!     }
    //!     assert_eq!(indexed, 3);
    //!     let bodies: Vec<String> = docs
    //!         .table("indexed")?
    //!         .iter()
    //!         .map(|row| row.get::<String>(1))
    //!         .collect::<Result<_, _>>()?;
    //!     assert_eq!(bodies, ["a", "b", "c", "d", "e"]);
    //!     kit.shutdown().await;
    //!     Ok::<_, Box<dyn std::error::Error>>(())
    //! })??;
    //! # Ok(())
    //! # }
    //! ```
}
