//! Event topics on the retained log: one object per `topic:partition`, the
//! partition chosen by hashing the event's key, consumer groups that pull
//! pages and commit their cursor after processing (at least once), and
//! retention driven by a named alarm (the log never trims by itself).
//!
//! Run with `cargo run -p durability --example log_topics`.

use std::cell::{Cell, OnceCell};
use std::collections::BTreeMap;
use std::error::Error;
use std::rc::Rc;
use std::time::Duration;

use durability::log::{AppendRecord, Log, LogError, Read, Retention};
use durability::{AlarmCall, Alarms, HandlerError, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, ObjectContext};
use serde::{Deserialize, Serialize};

const PARTITIONS: u32 = 8;
const RETENTION_ALARM: &str = "enforceRetention";
/// How often a partition applies its retention while it holds records.
const RETENTION_PERIOD_MS: i64 = 1_000;
const PAGE: u32 = 100;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Event {
    user: String,
    action: String,
}

/// The partition of `key`: 32-bit FNV-1a over UTF-16 code units with
/// JavaScript's `Math.imul` wrap-around, then `|hash| mod partitions`, so
/// producers written against the reference library route identically.
fn partition_of(key: &str, partitions: u32) -> u32 {
    const OFFSET_BASIS: u32 = 2_166_136_261;
    let mut hash: Option<i32> = None;
    for unit in key.encode_utf16() {
        let current = hash.unwrap_or(OFFSET_BASIS as i32);
        hash = Some((current ^ i32::from(unit)).wrapping_mul(16_777_619));
    }
    // JavaScript never converts the basis to int32 for an empty key.
    let magnitude = hash.map_or(i64::from(OFFSET_BASIS), |h| i64::from(h).abs());
    (magnitude % i64::from(partitions)) as u32
}

/// One partition of one topic: a log and the alarm that trims it.
struct Partition {
    scheduler: Scheduler,
    log: Log<Event>,
    alarms: Rc<OnceCell<Alarms>>,
    // In memory only: after an eviction the next append arms it again,
    // which at worst postpones retention by one period.
    retention_armed: Cell<bool>,
}

impl Partition {
    fn new(ctx: ObjectContext) -> Result<Self, BoxError> {
        let scheduler = Scheduler::builder(ctx.into_dyn())
            .alarm_min_delay(Duration::from_secs(1))
            .build()?;
        let log = Log::<Event>::builder(&scheduler)
            .retention(
                Retention::new()
                    .max_records(50)
                    .max_age(Duration::from_secs(7 * 24 * 3_600)),
            )
            .build()?;
        let alarms: Rc<OnceCell<Alarms>> = Rc::default();
        let built = Alarms::builder(&scheduler)
            .handler(RETENTION_ALARM, {
                let (log, alarms, scheduler) = (log.clone(), Rc::clone(&alarms), scheduler.clone());
                move |_call: AlarmCall| {
                    let (log, alarms, scheduler) =
                        (log.clone(), Rc::clone(&alarms), scheduler.clone());
                    async move {
                        let removed = log.trim().await?;
                        let bounds = log.bounds().await?;
                        println!(
                            "  retention: trimmed {removed}, hot {}..{}",
                            bounds.hot_offset, bounds.next_offset
                        );
                        // Re-arm only while records are hot. (Testing
                        // oldest_offset instead would loop for ever once
                        // cold segments keep it low.)
                        if bounds.hot_offset < bounds.next_offset
                            && let Some(alarms) = alarms.get()
                        {
                            let at = scheduler.now_ms() + RETENTION_PERIOD_MS;
                            alarms.schedule(RETENTION_ALARM, at).await?;
                        }
                        Ok::<_, HandlerError>(())
                    }
                }
            })
            .build()?;
        let _ = alarms.set(built);
        Ok(Partition {
            scheduler,
            log,
            alarms,
            retention_armed: Cell::new(false),
        })
    }

    async fn publish(&self, events: Vec<(String, Event)>) -> Result<Vec<u64>, Box<dyn Error>> {
        let records = events
            .into_iter()
            .map(|(id, event)| AppendRecord::keyed(id, event))
            .collect();
        let appended = self.log.append(records).await?;
        let Some(offsets) = appended.offsets() else {
            return Err(format!("rejected: {:?}", appended.rejection()).into());
        };
        // Arm retention once; re-scheduling on every append would replace
        // the pending time and postpone it for as long as appends come.
        if !self.retention_armed.replace(true)
            && let Some(alarms) = self.alarms.get()
        {
            let at = self.scheduler.now_ms() + RETENTION_PERIOD_MS;
            alarms.schedule(RETENTION_ALARM, at).await?;
        }
        Ok(offsets.to_vec())
    }

    /// One consumer-group step: read a page from the group's cursor,
    /// "process" it, then commit. Returns how many events it processed, or
    /// `None` once the group has caught up.
    async fn consume(&self, group: &str) -> Result<Option<usize>, LogError> {
        let from = match self.log.cursor(group).await? {
            Some(cursor) => cursor,
            None => self.log.bounds().await?.oldest_offset,
        };
        let page = match self.log.read(Read::from_offset(from).limit(PAGE)).await {
            Ok(page) => page,
            Err(LogError::Truncated { requested, oldest }) => {
                // Retention outran this group: say so, then move on.
                println!(
                    "  {group}: offsets {requested}..{oldest} were trimmed before it read them"
                );
                self.log.commit(group, oldest).await?;
                return Ok(Some(0));
            }
            Err(error) => return Err(error),
        };
        if page.records.is_empty() {
            return Ok(None);
        }
        let paid = page
            .records
            .iter()
            .filter(|r| r.body.action == "paid")
            .count();
        tracing::debug!(group, paid, "processed a page");
        // Commit only after processing: a crash in between re-reads the page.
        self.log.commit(group, page.next_offset).await?;
        Ok(Some(page.records.len()))
    }
}

impl DurableObject for Partition {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

/// The consumer loop of one group on one partition: step until caught up.
async fn drain(
    topic: &durability_host::Namespace<Partition>,
    partition: u32,
    group: &'static str,
) -> Result<usize, Box<dyn Error>> {
    let stub = topic.stub(&format!("orders:{partition}"))?;
    let mut total = 0;
    loop {
        let step = stub
            .call(move |p: Rc<Partition>| async move {
                p.consume(group).await.map_err(|e| e.to_string())
            })
            .await??;
        match step {
            Some(processed) => total += processed,
            None => return Ok(total),
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let host = Host::builder(dir.path()).threads(2).build()?;
    let topic = host.namespace("orders", Partition::new)?;

    // Produce: 600 events of 40 users, routed by user so that each user's
    // events stay in order in one partition.
    let mut by_partition: BTreeMap<u32, Vec<(String, Event)>> = BTreeMap::new();
    for i in 0..600 {
        let user = format!("user-{}", i % 40);
        let event = Event {
            user: user.clone(),
            action: if i % 3 == 0 { "paid" } else { "viewed" }.to_owned(),
        };
        by_partition
            .entry(partition_of(&user, PARTITIONS))
            .or_default()
            .push((format!("event-{i}"), event));
    }
    for (partition, events) in by_partition {
        let stub = topic.stub(&format!("orders:{partition}"))?;
        for chunk in events.chunks(PAGE as usize) {
            let chunk = chunk.to_vec();
            let offsets = stub
                .call(move |p: Rc<Partition>| async move {
                    p.publish(chunk).await.map_err(|e| e.to_string())
                })
                .await??;
            println!(
                "orders:{partition} appended offsets {}..={}",
                offsets.first().copied().unwrap_or(0),
                offsets.last().copied().unwrap_or(0)
            );
        }
    }

    // Consume: the "billing" group drains every partition now.
    let mut total = 0;
    for partition in 0..PARTITIONS {
        total += drain(&topic, partition, "billing").await?;
    }
    println!("billing processed {total} events");

    // The "audit" group registered at offset 0 of one partition but reads
    // only after the retention alarms ran: it finds the oldest records gone
    // and is told so, instead of skipping them silently.
    let partition = partition_of("user-0", PARTITIONS);
    topic
        .stub(&format!("orders:{partition}"))?
        .call(|p: Rc<Partition>| async move {
            p.log.commit("audit", 0).await.map_err(|e| e.to_string())
        })
        .await??;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let audited = drain(&topic, partition, "audit").await?;
    println!("audit processed {audited} events of orders:{partition} (the partition of user-0)");
    assert_eq!(
        partition_of("", PARTITIONS),
        5,
        "the reference's empty-key edge"
    );
    host.shutdown().await;
    Ok(())
}
