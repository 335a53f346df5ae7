//! The `log` workload: a retained log per partition object, appended in
//! keyed batches by a producer and read by two consumers that commit their
//! cursors after each page, all killed at random moments.
//!
//! A record is accepted once its `append` returned `Accepted` and the
//! producer journaled its offset; after a kill the producer appends the
//! unjournaled items again under the same keys, which must return their
//! original offsets. A consumer journals each page it handled before it
//! commits, and each commit after it returned. The checker verifies from
//! both journals and the final `durability_log_*` rows:
//! - every accepted record is readable at its journaled offset with its key
//!   and body, and was handled by every consumer (else it is lost);
//! - a key keeps one offset, and offsets are dense from 0 to the end;
//! - a page starts at the consumer's cursor and never skips an offset;
//! - cursors never go back: no page starts below a journaled commit, and no
//!   stored cursor is behind one (except where a power cut may undo a
//!   commit whose reply was seen, `normal` mode; a regression counts as a stale
//!   settlement).
//!
//! A third consumer, `leased`, takes ranges with `lease`, then acks, nacks
//! or abandons them (waiting past the lease and leasing the range again, so
//! its late ack must be fenced). It journals each lease, its intent to
//! settle and the settlement with the cursor right after it. The checker
//! verifies that no range is handed out while an overlapping one is live
//! and unsettled, that no offset is acked by two batches, that a fenced
//! batch's ack is refused, and that the cursor never passes an offset no
//! ack was attempted for.
//!
//! The producer also trims after every append, with a small retention and
//! cold segments in a directory, so kills land between a segment's write,
//! its index row and the hot delete. The checker reads the hot table and
//! every indexed segment file together: each offset from 0 to the end must
//! be readable in one of them, copies of an offset (hot and cold after a
//! kill before the delete) must agree, and a key must never be stored at
//! two offsets.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Duration;

use durability::Scheduler;
use durability::log::{
    AppendRecord, Appended, ColdError, ColdStorage, Lease, Leases, Log, LogError, Read, Retention,
    Segment,
};
use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext, Stub};
use durability_platform::{Context as _, EpochMs, LocalBoxFuture};
use rand::Rng as _;
use serde::{Deserialize, Serialize};

use super::TortureError;
use super::backups::{BackupCopy, Presence};
use super::journal::{self, Journal};
use super::verdict::{Tally, Violation};
use super::workload::{Finished, HandlerEnv, Life, Objects, Workload, system_now_ms};

/// Consecutive items that go to one partition, so a batch has several.
const ITEMS_PER_BLOCK: u64 = 5;

/// The most records one append carries.
const MAX_BATCH: u64 = 5;

/// The longest a consumer takes to handle a page, in milliseconds.
const HANDLE_MAX_MS: u64 = 10;

/// The consumers of every partition and their page sizes: different, so
/// their cursors move at different paces.
const CONSUMERS: [(&str, u32); 2] = [("reader-a", 7), ("reader-b", 3)];

/// The consumer that shares its name between leased ranges.
const LEASED_CONSUMER: &str = "leased";

/// How long a leased range is held, in milliseconds: short, so ranges a
/// kill abandoned come back soon and abandoning one in a pass is cheap.
const LEASE_MS: u64 = 40;

/// Ranges of the leased consumer live at once.
const MAX_LIVE_RANGES: u32 = 3;

/// Ranges the leased consumer takes per object and pass.
const RANGES_PER_PASS: usize = 2;

/// Records per leased range.
const LEASE_LIMIT_RECORDS: u32 = 4;

/// Per cent of leased ranges abandoned past their lease (then reclaimed,
/// and the stale ack tried), and per cent nacked.
const ABANDON_PERCENT: u64 = 15;
const NACK_PERCENT: u64 = 15;

/// The log's largest batch (append and read page), in records: above
/// [`MAX_BATCH`] so every append fits.
const LOG_MAX_BATCH_RECORDS: u32 = 8;

/// Records that stay hot: small, so nearly every append is followed by a
/// trim that flushes a segment, and consumers read from cold segments.
const RETAINED_HOT_RECORDS: u64 = 6;

/// Cold segments as files in one directory per object, the way the
/// `log_cold` example keeps them: named by both offsets, an existing file
/// kept (a rewrite after a kill between write and index is harmless), and a
/// file appears only whole (temporary name, fsync, rename).
struct DirectoryCold {
    dir: PathBuf,
}

/// The file name of a segment, also its locator.
fn segment_file(first_offset: u64, last_offset: u64) -> String {
    format!("{first_offset:020}-{last_offset:020}.json")
}

impl ColdStorage for DirectoryCold {
    fn write<'a>(&'a self, segment: &'a Segment) -> LocalBoxFuture<'a, Result<String, ColdError>> {
        Box::pin(async move {
            let locator = segment_file(segment.first_offset, segment.last_offset);
            let path = self.dir.join(&locator);
            if !path.exists() {
                std::fs::create_dir_all(&self.dir)?;
                let temporary = self.dir.join(format!("{locator}.tmp"));
                std::fs::write(&temporary, segment.to_json()?)?;
                std::fs::File::open(&temporary)?.sync_all()?;
                std::fs::rename(&temporary, &path)?;
                // The rename is durable only once the directory is synced;
                // the index row that follows must never point at nothing.
                std::fs::File::open(&self.dir)?.sync_all()?;
            }
            Ok(locator)
        })
    }

    fn read<'a>(
        &'a self,
        locator: &'a str,
    ) -> LocalBoxFuture<'a, Result<Option<Segment>, ColdError>> {
        Box::pin(async move {
            match std::fs::read(self.dir.join(locator)) {
                Ok(bytes) => Segment::from_json(&bytes).map(Some),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(error) => Err(error.into()),
            }
        })
    }
}

pub struct LogWorkload;

/// One partition: its log.
pub struct Partition {
    scheduler: Scheduler,
    log: Log<Body>,
}

impl DurableObject for Partition {
    // The log has no due work of its own; delegating keeps the object right
    // if a capability with due work joins it.
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

/// A record's body: the item it carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Body {
    item: u64,
}

/// The producer's journal: an accepted append (one line per batch, the
/// batch being atomic) or a rejected one.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "fact", rename_all = "snake_case")]
enum Produced {
    Appended {
        object: String,
        records: Vec<AcceptedRecord>,
        /// The log's end just before the append: a record returned below it
        /// was deduplicated by its key.
        end_before: u64,
        /// When `append` returned (system clock); absent from journals
        /// older than `--backup-during`.
        #[serde(default)]
        acked_ms: Option<EpochMs>,
    },
    Rejected {
        object: String,
        items: Vec<u64>,
        error: String,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct AcceptedRecord {
    item: u64,
    key: String,
    offset: u64,
}

/// The consumers' journal.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "fact", rename_all = "snake_case")]
enum Handled {
    /// A page read from the consumer's cursor `from`, handled, not yet
    /// committed.
    Page {
        object: String,
        consumer: String,
        from: u64,
        /// (offset, key) of each record, in page order.
        records: Vec<(u64, String)>,
        next: u64,
        life: u32,
    },
    /// The commit of `offset` returned.
    Committed {
        object: String,
        consumer: String,
        offset: u64,
        life: u32,
    },
    /// The leased consumer got a range (stored before it was returned).
    Leased {
        object: String,
        batch_id: String,
        first: u64,
        last: u64,
        attempt: u32,
        expires_at: EpochMs,
        /// (offset, key) of each record, in range order.
        records: Vec<(u64, String)>,
        life: u32,
    },
    /// The leased consumer is about to ack (or nack) a range: journaled
    /// before the call, so a kill after the ack committed cannot hide it.
    Settling {
        object: String,
        batch_id: String,
        first: u64,
        last: u64,
        ack: bool,
        life: u32,
    },
    /// The ack (or nack) returned: `held` is false when it was refused as
    /// fenced; `cursor` is the consumer's cursor read in the same call.
    Settled {
        object: String,
        batch_id: String,
        first: u64,
        last: u64,
        ack: bool,
        held: bool,
        cursor: u64,
        life: u32,
    },
}

/// What the leased consumer keeps of a lease to settle it.
#[derive(Debug, Clone)]
struct Held {
    batch_id: String,
    first: u64,
    last: u64,
}

/// Leases the next range of `stub`'s log and journals it.
async fn lease_range(
    stub: &Stub<Partition>,
    handled: &Journal,
    life: u32,
) -> Result<Option<Held>, TortureError> {
    let lease = stub
        .call(|partition: Rc<Partition>| async move {
            partition
                .log
                .lease(LEASED_CONSUMER, Some(LEASE_LIMIT_RECORDS))
                .await
        })
        .await??;
    let Some(lease): Option<Lease<Body>> = lease else {
        return Ok(None);
    };
    handled.append(&Handled::Leased {
        object: stub.id().to_string(),
        batch_id: lease.batch_id.clone(),
        first: lease.first_offset,
        last: lease.last_offset,
        attempt: lease.attempt,
        expires_at: lease.expires_at,
        records: lease
            .records
            .iter()
            .map(|r| (r.offset, r.key.clone()))
            .collect(),
        life,
    })?;
    Ok(Some(Held {
        batch_id: lease.batch_id,
        first: lease.first_offset,
        last: lease.last_offset,
    }))
}

/// Acks or nacks `held`, journaling the intent before and the outcome (with
/// the cursor) after.
async fn settle_range(
    stub: &Stub<Partition>,
    handled: &Journal,
    held: &Held,
    ack: bool,
    life: u32,
) -> Result<(), TortureError> {
    let object = stub.id().to_string();
    handled.append(&Handled::Settling {
        object: object.clone(),
        batch_id: held.batch_id.clone(),
        first: held.first,
        last: held.last,
        ack,
        life,
    })?;
    let batch_id = held.batch_id.clone();
    let (is_held, cursor) = stub
        .call(move |partition: Rc<Partition>| async move {
            let settled = if ack {
                partition.log.ack(LEASED_CONSUMER, &batch_id).await
            } else {
                partition.log.nack(LEASED_CONSUMER, &batch_id).await
            };
            let is_held = match settled {
                Ok(()) => true,
                Err(LogError::LeaseNotHeld { .. }) => false,
                Err(error) => return Err(error),
            };
            let cursor = partition.log.cursor(LEASED_CONSUMER).await?.unwrap_or(0);
            Ok::<_, LogError>((is_held, cursor))
        })
        .await??;
    handled.append(&Handled::Settled {
        object,
        batch_id: held.batch_id.clone(),
        first: held.first,
        last: held.last,
        ack,
        held: is_held,
        cursor,
        life,
    })?;
    Ok(())
}

/// One pass of the leased consumer over `stub`'s log; returns whether it
/// leased anything.
async fn consume_leased(
    stub: &Stub<Partition>,
    handled: &Journal,
    life: &Life,
    rng: &mut rand::rngs::StdRng,
) -> Result<bool, TortureError> {
    let mut leases = Vec::with_capacity(RANGES_PER_PASS);
    for _ in 0..RANGES_PER_PASS {
        match lease_range(stub, handled, life.index).await? {
            Some(held) => leases.push(held),
            None => break,
        }
    }
    let worked = !leases.is_empty();
    for held in leases {
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..=HANDLE_MAX_MS))).await;
        let roll = rng.random_range(0..100_u64);
        if roll < ABANDON_PERCENT {
            // Past the lease the range is owed redelivery; leasing again
            // reclaims it under a new batch id, which must fence this one.
            tokio::time::sleep(Duration::from_millis(LEASE_MS + 5)).await;
            let again = lease_range(stub, handled, life.index).await?;
            settle_range(stub, handled, &held, true, life.index).await?;
            if let Some(again) = again {
                settle_range(stub, handled, &again, true, life.index).await?;
            }
        } else {
            let ack = roll >= ABANDON_PERCENT + NACK_PERCENT;
            settle_range(stub, handled, &held, ack, life.index).await?;
        }
    }
    Ok(worked)
}

fn key_of(item: u64) -> String {
    format!("rec-{item}")
}

/// The partition (object number, modulo the count) item `item` goes to.
fn block_of(item: u64) -> u64 {
    item / ITEMS_PER_BLOCK
}

impl Workload for LogWorkload {
    const NAME: &'static str = "log";
    const ABOUT: &'static str = "retained log: keyed batch appends, trims to cold segments, two consumers with cursors, dense offsets";
    type Object = Partition;

    fn construct(ctx: ObjectContext, env: &HandlerEnv) -> Result<Partition, BoxError> {
        let cold = DirectoryCold {
            dir: env.files.cold().join(ctx.id().to_string()),
        };
        let scheduler = Scheduler::new(ctx.into_dyn())?;
        let log = Log::<Body>::builder(&scheduler)
            .max_batch_size(LOG_MAX_BATCH_RECORDS)
            .retention(Retention::new().max_records(RETAINED_HOT_RECORDS))
            .cold(Rc::new(cold))
            .leases(
                Leases::new()
                    .lease_for(Duration::from_millis(LEASE_MS))
                    .max_parallelism(MAX_LIVE_RANGES),
            )
            .build()?;
        Ok(Partition { scheduler, log })
    }

    async fn produce(
        objects: &Objects<Partition>,
        produced: &Journal,
        life: &Life,
    ) -> Result<(), TortureError> {
        let journaled = journal::read::<Produced>(&life.files.produced())?;
        let mut accepted = HashSet::new();
        for fact in &journaled.lines {
            if let Produced::Appended { records, .. } = fact {
                accepted.extend(records.iter().map(|r| r.item));
            }
        }
        let missing: Vec<u64> = (0..life.quota())
            .filter(|item| !accepted.contains(item))
            .collect();
        let mut rng = life.rng("produce log");
        let mut rest = missing.as_slice();
        while let Some(&first) = rest.first() {
            let size = usize::try_from(rng.random_range(1..=MAX_BATCH)).unwrap_or(1);
            let batch: Vec<u64> = rest
                .iter()
                .take(size)
                .take_while(|&&item| block_of(item) == block_of(first))
                .copied()
                .collect();
            rest = rest.get(batch.len().max(1)..).unwrap_or_default();
            let stub = objects.get(block_of(first))?;
            let records: Vec<AppendRecord<Body>> = batch
                .iter()
                .map(|&item| AppendRecord::keyed(key_of(item), Body { item }))
                .collect();
            let (end_before, appended) = stub
                .call(move |partition: Rc<Partition>| async move {
                    // Nothing else of the object runs between the two: the
                    // bounds read does not yield to another append.
                    let end_before = partition.log.bounds().await?.next_offset;
                    let appended = partition.log.append(records).await?;
                    Ok::<_, durability::LogError>((end_before, appended))
                })
                .await??;
            let object = stub.id().to_string();
            let fact = match appended {
                Appended::Accepted { offsets, .. } => Produced::Appended {
                    object,
                    end_before,
                    acked_ms: Some(system_now_ms()),
                    records: batch
                        .iter()
                        .zip(offsets)
                        .map(|(&item, offset)| AcceptedRecord {
                            item,
                            key: key_of(item),
                            offset,
                        })
                        .collect(),
                },
                Appended::Rejected { error, .. } => Produced::Rejected {
                    object,
                    items: batch,
                    error: error.to_string(),
                },
            };
            produced.append(&fact)?;
            // A separate call: a kill may land before, inside (between the
            // segment write, its index row and the hot delete) or after it.
            stub.call(|partition: Rc<Partition>| async move { partition.log.trim().await })
                .await??;
            Life::pace(&mut rng).await;
        }
        Ok(())
    }

    async fn consume(
        objects: &Objects<Partition>,
        handled: &Journal,
        life: &Life,
    ) -> Result<bool, TortureError> {
        let mut worked = false;
        let mut rng = life.pass_rng("consume log");
        for stub in objects.all() {
            for (consumer, limit) in CONSUMERS {
                let (from, records, next) = stub
                    .call(move |partition: Rc<Partition>| async move {
                        let from = partition.log.cursor(consumer).await?.unwrap_or(0);
                        let page = partition
                            .log
                            .read(Read::from_offset(from).limit(limit))
                            .await?;
                        let records: Vec<(u64, String)> = page
                            .records
                            .into_iter()
                            .map(|r| (r.offset, r.key))
                            .collect();
                        Ok::<_, durability::LogError>((from, records, page.next_offset))
                    })
                    .await??;
                if records.is_empty() {
                    continue;
                }
                let object = stub.id().to_string();
                handled.append(&Handled::Page {
                    object: object.clone(),
                    consumer: consumer.to_owned(),
                    from,
                    records,
                    next,
                    life: life.index,
                })?;
                // Handling takes a moment, and a kill in it makes the next
                // life read the page again from the committed cursor.
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..=HANDLE_MAX_MS)))
                    .await;
                stub.call(move |partition: Rc<Partition>| async move {
                    partition.log.commit(consumer, next).await
                })
                .await??;
                handled.append(&Handled::Committed {
                    object,
                    consumer: consumer.to_owned(),
                    offset: next,
                    life: life.index,
                })?;
                worked = true;
            }
            worked |= consume_leased(stub, handled, life, &mut rng).await?;
        }
        Ok(worked)
    }

    async fn unsettled(objects: &Objects<Partition>) -> Result<u64, TortureError> {
        let mut behind = 0;
        for stub in objects.all() {
            behind += stub
                .call(|partition: Rc<Partition>| async move {
                    let end = partition.log.bounds().await?.next_offset;
                    let cursors = partition.log.cursors().await?;
                    Ok::<_, durability::LogError>(
                        CONSUMERS
                            .iter()
                            .map(|(c, _)| *c)
                            .chain([LEASED_CONSUMER])
                            .map(|c| end.saturating_sub(cursors.get(c).copied().unwrap_or(0)))
                            .sum::<u64>(),
                    )
                })
                .await??;
        }
        Ok(behind)
    }

    fn check(run: &Finished) -> Result<Tally, TortureError> {
        let produced = journal::read::<Produced>(&run.files.produced())?;
        let handled = journal::read::<Handled>(&run.files.handled())?;
        let mut stored = BTreeMap::new();
        for entry in run.manifest.objects.values() {
            let records = run.rows(
                entry,
                "durability_log_records",
                "SELECT \"offset\", dedup_key, payload FROM durability_log_records ORDER BY \"offset\"",
                |row| Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?, row.get::<_, String>(2)?)),
            )?;
            let next = run.rows(
                entry,
                "durability_log_seq",
                "SELECT next_offset FROM durability_log_seq",
                |row| row.get::<_, i64>(0),
            )?;
            let cursors = run.rows(
                entry,
                "durability_log_cursors",
                "SELECT consumer, \"offset\" FROM durability_log_cursors",
                |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)),
            )?;
            let segments = run.rows(
                entry,
                "durability_log_segments",
                "SELECT first_offset, last_offset, locator FROM durability_log_segments ORDER BY first_offset",
                |row| Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)?, row.get::<_, String>(2)?)),
            )?;
            let (cold, cold_problems) = read_segments(&run.files.cold().join(&entry.id), &segments);
            stored.insert(
                entry.id.clone(),
                StoredLog {
                    records: records
                        .into_iter()
                        .map(|(offset, key, payload)| StoredRecord {
                            offset: u64::try_from(offset).unwrap_or(u64::MAX),
                            key,
                            item: durability::codec::decode_as::<Body>(&payload)
                                .ok()
                                .map(|b| b.item),
                        })
                        .collect(),
                    next_offset: next.first().map(|&n| u64::try_from(n).unwrap_or(u64::MAX)),
                    cursors: cursors
                        .into_iter()
                        .map(|(c, o)| (c, u64::try_from(o).unwrap_or(u64::MAX)))
                        .collect(),
                    cold,
                    cold_problems,
                },
            );
        }
        let mut tally = run.tally();
        tally.detail("torn_journal_lines", produced.torn + handled.torn);
        Ok(check_facts(&produced.lines, &handled.lines, &stored, tally))
    }

    /// An accepted record is recorded in the copy hot, at its offset with
    /// its key, or cold: inside a segment the copy's index lists (the
    /// segment files live outside the database, in the run's cold
    /// directory, so the copy's part is the index row).
    fn check_copy(copy: &BackupCopy) -> Result<Presence, TortureError> {
        let produced = journal::read::<Produced>(&copy.run.files.produced())?;
        let mut stored: HashMap<String, CopiedLog> = HashMap::new();
        for entry in copy.run.manifest.objects.values() {
            let hot = copy.run.rows(
                entry,
                "durability_log_records",
                "SELECT \"offset\", dedup_key FROM durability_log_records",
                |row| Ok((row.get::<_, i64>(0)?, row.get::<_, String>(1)?)),
            )?;
            let segments = copy.run.rows(
                entry,
                "durability_log_segments",
                "SELECT first_offset, last_offset FROM durability_log_segments",
                |row| Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)?)),
            )?;
            stored.insert(
                entry.id.clone(),
                CopiedLog {
                    hot: hot
                        .into_iter()
                        .map(|(offset, key)| (u64::try_from(offset).unwrap_or(u64::MAX), key))
                        .collect(),
                    segments: segments
                        .into_iter()
                        .map(|(first, last)| {
                            (
                                u64::try_from(first).unwrap_or(u64::MAX),
                                u64::try_from(last).unwrap_or(0),
                            )
                        })
                        .collect(),
                },
            );
        }
        Ok(copy_presence(copy, &produced.lines, &stored))
    }
}

/// One partition's log in a restored copy: hot keys by offset, and the
/// offset ranges of the indexed cold segments.
#[derive(Debug, Default)]
struct CopiedLog {
    hot: HashMap<u64, String>,
    segments: Vec<(u64, u64)>,
}

impl CopiedLog {
    fn holds(&self, record: &AcceptedRecord) -> bool {
        self.hot.get(&record.offset) == Some(&record.key)
            || self
                .segments
                .iter()
                .any(|&(first, last)| (first..=last).contains(&record.offset))
    }
}

/// Which accepted records a copy must hold and does not, from each
/// partition's copied log by object id.
fn copy_presence(
    copy: &BackupCopy,
    produced: &[Produced],
    stored: &HashMap<String, CopiedLog>,
) -> Presence {
    let mut presence = Presence::default();
    let mut seen = HashSet::new();
    for fact in produced {
        let Produced::Appended {
            object,
            records,
            acked_ms,
            ..
        } = fact
        else {
            continue;
        };
        let Some(acked_ms) = copy.must_hold(object, *acked_ms) else {
            continue;
        };
        let log = stored.get(object);
        for record in records {
            if !seen.insert((object.as_str(), record.key.as_str())) {
                continue;
            }
            presence.item(log.is_some_and(|log| log.holds(record)), acked_ms, || {
                format!(
                    "{} at offset {} was accepted at {acked_ms} but is neither hot nor in an indexed segment in the restored copy of {}",
                    record.key,
                    record.offset,
                    copy.describe(object)
                )
            });
        }
    }
    presence
}

/// One partition's log as the checker reads it.
#[derive(Debug, Default)]
struct StoredLog {
    /// The hot records, ascending by offset.
    records: Vec<StoredRecord>,
    next_offset: Option<u64>,
    cursors: HashMap<String, u64>,
    /// The records of every indexed cold segment, as their files hold them.
    cold: Vec<StoredRecord>,
    /// Indexed segments that cannot be read or do not match their index row.
    cold_problems: Vec<String>,
}

/// Reads every indexed segment `(first, last, locator)` from `dir`: their
/// records, and what is wrong with any that is missing, unreadable or does
/// not hold exactly the offsets its index row says.
fn read_segments(
    dir: &std::path::Path,
    index: &[(i64, i64, String)],
) -> (Vec<StoredRecord>, Vec<String>) {
    let mut records = Vec::new();
    let mut problems = Vec::new();
    for (first, last, locator) in index {
        let segment = std::fs::read(dir.join(locator))
            .map_err(|e| e.to_string())
            .and_then(|bytes| Segment::from_json(&bytes).map_err(|e| e.to_string()));
        let segment = match segment {
            Ok(segment) => segment,
            Err(error) => {
                problems.push(format!(
                    "segment {locator} ({first}..={last}) cannot be read: {error}"
                ));
                continue;
            }
        };
        let offsets: Vec<u64> = segment.records.iter().map(|r| r.offset).collect();
        let expected: Vec<u64> = (segment.first_offset..=segment.last_offset).collect();
        let indexed = i64::try_from(segment.first_offset).ok() == Some(*first)
            && i64::try_from(segment.last_offset).ok() == Some(*last);
        if offsets != expected || !indexed {
            problems.push(format!(
                "segment {locator} is indexed as {first}..={last} but holds offsets {offsets:?}"
            ));
        }
        records.extend(segment.records.into_iter().map(|r| StoredRecord {
            offset: r.offset,
            key: r.deduplication_key,
            item: serde_json::from_value::<Body>(r.body).ok().map(|b| b.item),
        }));
    }
    (records, problems)
}

#[derive(Debug)]
struct StoredRecord {
    offset: u64,
    key: String,
    /// `None` when the body does not decode.
    item: Option<u64>,
}

fn check_facts(
    produced: &[Produced],
    handled: &[Handled],
    stored: &BTreeMap<String, StoredLog>,
    mut tally: Tally,
) -> Tally {
    // Accepted records by (object, key); a key must keep its offset.
    let mut accepted: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    // Records an append returned at an offset below the log's end before
    // it: appended again after a kill cut off their journal line, and
    // deduplicated by key.
    let mut deduplicated = 0_u64;
    for fact in produced {
        match fact {
            Produced::Appended {
                object,
                records,
                end_before,
                ..
            } => {
                deduplicated += records.iter().filter(|r| r.offset < *end_before).count() as u64;
                for record in records {
                    let slot = (object.clone(), record.key.clone());
                    match accepted.get(&slot) {
                        Some(&(_, offset)) if offset != record.offset => tally.flag(
                            Violation::Broken("key_offset_changes"),
                            format!(
                                "{} was accepted at offset {offset} and again at {}",
                                record.key, record.offset
                            ),
                        ),
                        Some(_) => {}
                        None => {
                            accepted.insert(slot, (record.item, record.offset));
                        }
                    }
                }
            }
            Produced::Rejected { items, error, .. } => tally.flag(
                Violation::Broken("rejected_appends"),
                format!("the append of items {items:?} was rejected: {error}"),
            ),
        }
    }
    tally.accepted = u64::try_from(accepted.len()).unwrap_or(u64::MAX);
    tally.detail("deduplicated_reappends", deduplicated);

    // Pages and commits per (object, consumer), in journal order.
    let mut delivered: HashMap<(String, String), BTreeSet<u64>> = HashMap::new();
    let mut committed: HashMap<(String, String), u64> = HashMap::new();
    let mut pages = 0_u64;
    let mut redelivered = 0_u64;
    for fact in handled {
        match fact {
            Handled::Page {
                object,
                consumer,
                from,
                records,
                next,
                life,
            } => {
                pages += 1;
                let slot = (object.clone(), consumer.clone());
                let last = committed.get(&slot).copied().unwrap_or(0);
                if *from < last {
                    tally.flag_or_allow(
                        tally.allowance().undone_settlements,
                        "undone_cursor_commits",
                        Violation::StaleSettlement,
                        format!(
                            "{consumer} read from {from} in life {life} after committing {last}: its cursor went back"
                        ),
                    );
                }
                let offsets: Vec<u64> = records.iter().map(|(offset, _)| *offset).collect();
                let expected: Vec<u64> = (*from..*from + offsets.len() as u64).collect();
                if offsets != expected || *next != *from + offsets.len() as u64 {
                    tally.flag(
                        Violation::Broken("skipping_reads"),
                        format!("{consumer} read {offsets:?} from {from} with next {next}"),
                    );
                }
                let seen = delivered.entry(slot).or_default();
                for offset in offsets {
                    if !seen.insert(offset) {
                        redelivered += 1;
                    }
                }
                for (offset, key) in records {
                    let journaled = accepted
                        .get(&(object.clone(), key.clone()))
                        .map(|&(_, offset)| offset);
                    if journaled.is_some_and(|journaled| journaled != *offset) {
                        tally.flag(
                            Violation::Broken("key_offset_changes"),
                            format!("{consumer} read {key} at {offset}, accepted at {journaled:?}"),
                        );
                    }
                }
            }
            Handled::Committed {
                object,
                consumer,
                offset,
                life,
            } => {
                let last = committed
                    .entry((object.clone(), consumer.clone()))
                    .or_insert(0);
                if *offset < *last {
                    tally.flag_or_allow(
                        tally.allowance().undone_settlements,
                        "undone_cursor_commits",
                        Violation::StaleSettlement,
                        format!("{consumer} committed {offset} in life {life} after {last}"),
                    );
                }
                *last = (*last).max(*offset);
            }
            Handled::Leased { .. } | Handled::Settling { .. } | Handled::Settled { .. } => {}
        }
    }
    let attempted = check_leases(handled, &accepted, stored, &mut tally);
    tally.detail("pages", pages);
    tally.detail("redelivered_records", redelivered);

    // The final logs: dense, holding every accepted record, cursors at the
    // end and never behind a journaled commit.
    let mut records_stored = 0_u64;
    let mut records_cold = 0_u64;
    let mut hot_and_cold = 0_u64;
    // Every readable copy of each offset, hot or cold, by object.
    let mut readable: BTreeMap<&str, BTreeMap<u64, Vec<&StoredRecord>>> = BTreeMap::new();
    for (object, log) in stored {
        let copies = readable.entry(object.as_str()).or_default();
        for record in log.records.iter().chain(&log.cold) {
            copies.entry(record.offset).or_default().push(record);
        }
        records_stored += copies.len() as u64;
        records_cold += log.cold.len() as u64;
        for problem in &log.cold_problems {
            tally.flag(
                Violation::Broken("unreadable_cold_segments"),
                format!("{}: {problem}", short(object)),
            );
        }
        // Offsets are dense over hot and cold together: 0 .. end, each
        // readable somewhere (nothing is ever forgotten in this workload).
        for (index, &offset) in copies.keys().enumerate() {
            if offset != index as u64 {
                tally.flag(
                    Violation::Broken("offset_gaps"),
                    format!(
                        "{}: offset {offset} is stored where {index} belongs",
                        short(object)
                    ),
                );
                break;
            }
        }
        // A kill between a segment's index row and the hot delete leaves
        // both copies; they must be the same record.
        let mut offset_of_key: HashMap<&str, u64> = HashMap::new();
        for (&offset, versions) in copies.iter() {
            if versions.len() > 1 {
                hot_and_cold += 1;
            }
            if let Some(first) = versions.first() {
                if versions
                    .iter()
                    .any(|v| v.key != first.key || v.item != first.item)
                {
                    tally.flag(
                        Violation::Broken("duplicated_records"),
                        format!(
                            "{}: offset {offset} is stored as different records: {versions:?}",
                            short(object)
                        ),
                    );
                }
                if let Some(other) = offset_of_key.insert(first.key.as_str(), offset) {
                    tally.flag(
                        Violation::Broken("duplicated_records"),
                        format!(
                            "{}: {} is stored at offsets {other} and {offset}",
                            short(object),
                            first.key
                        ),
                    );
                }
            }
        }
        let end = copies.len() as u64;
        if log.next_offset != Some(end) && !(log.next_offset.is_none() && end == 0) {
            tally.flag(
                Violation::Broken("offset_gaps"),
                format!(
                    "{}: the log ends at {:?} but holds {end} records",
                    short(object),
                    log.next_offset
                ),
            );
        }
        for (consumer, _) in CONSUMERS {
            let cursor = log.cursors.get(consumer).copied().unwrap_or(0);
            let last = committed
                .get(&(object.clone(), consumer.to_owned()))
                .copied()
                .unwrap_or(0);
            if cursor < last {
                tally.flag_or_allow(
                    tally.allowance().undone_settlements,
                    "undone_cursor_commits",
                    Violation::StaleSettlement,
                    format!("{consumer} on {}: stored cursor {cursor} is behind its journaled commit {last}", short(object)),
                );
            }
        }
        for record in log.records.iter().chain(&log.cold) {
            if !accepted.contains_key(&(object.clone(), record.key.clone())) {
                tally.flag(
                    Violation::Broken("unaccounted_records"),
                    format!(
                        "{}: {} at {} was never journaled as accepted",
                        short(object),
                        record.key,
                        record.offset
                    ),
                );
            }
        }
    }
    tally.detail("records_stored", records_stored);
    tally.detail("records_cold", records_cold);
    tally.detail("records_hot_and_cold", hot_and_cold);

    let mut completed = 0_u64;
    for ((object, key), &(item, offset)) in &accepted {
        let record = readable
            .get(object.as_str())
            .and_then(|copies| copies.get(&offset))
            .and_then(|versions| versions.first());
        let is_readable =
            record.is_some_and(|r| r.offset == offset && &r.key == key && r.item == Some(item));
        if !is_readable {
            tally.flag(
                Violation::Lost,
                format!("{key} (item {item}) is not readable at its offset {offset}: {record:?}"),
            );
            continue;
        }
        let mut missed: Vec<&str> = CONSUMERS
            .iter()
            .filter(|(consumer, _)| {
                !delivered
                    .get(&(object.clone(), (*consumer).to_owned()))
                    .is_some_and(|seen| seen.contains(&offset))
            })
            .map(|(consumer, _)| *consumer)
            .collect();
        // The leased consumer handled a record once its final cursor passed
        // it and an ack of it was attempted (a kill may have cut off the
        // journal line of an ack that committed).
        let leased_cursor = stored
            .get(object)
            .and_then(|log| log.cursors.get(LEASED_CONSUMER).copied())
            .unwrap_or(0);
        let acked = attempted
            .get(object.as_str())
            .is_some_and(|offsets| offsets.contains(&offset));
        if offset >= leased_cursor || !acked {
            missed.push(LEASED_CONSUMER);
        }
        if missed.is_empty() {
            completed += 1;
        } else {
            tally.flag(
                Violation::Lost,
                format!("{key} at {offset} was never handled by {missed:?}"),
            );
        }
    }
    tally.completed = completed;
    tally
}

/// One lease as the checker follows it through the journal.
#[derive(Debug)]
struct Tracked {
    first: u64,
    last: u64,
    expires_at: EpochMs,
    /// An ack or nack of it was attempted (or it was refused).
    released: bool,
    /// A later lease overlapped it: its holder is fenced.
    reclaimed_by: Option<String>,
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 <= b.1 && b.0 <= a.1
}

/// The leased consumer's checks, in journal order (one consumer task per
/// life, so the journal order is the order of the calls):
/// - a range is never handed out while an overlapping lease is live (its
///   expiry not reached) and not released: two live holders;
/// - a range's records are its offsets, in order, with their accepted keys;
/// - an ack of a fenced batch is never accepted, and no offset is acked by
///   two batches;
/// - the cursor never passes an offset no ack was attempted for, and never
///   goes back.
///
/// Returns, per object, the offsets an ack was attempted for.
fn check_leases<'a>(
    handled: &'a [Handled],
    accepted: &BTreeMap<(String, String), (u64, u64)>,
    stored: &BTreeMap<String, StoredLog>,
    tally: &mut Tally,
) -> HashMap<&'a str, BTreeSet<u64>> {
    let mut leases: HashMap<&str, BTreeMap<&str, Tracked>> = HashMap::new();
    let mut attempted: HashMap<&str, BTreeSet<u64>> = HashMap::new();
    let mut acked_by: HashMap<(&str, u64), &str> = HashMap::new();
    let mut cursors: HashMap<&str, u64> = HashMap::new();
    let (mut leased, mut fenced, mut redelivered) = (0_u64, 0_u64, 0_u64);
    let lease_ms = i64::try_from(LEASE_MS).unwrap_or(i64::MAX);
    let passed_unsettled = |tally: &mut Tally,
                            attempted: &HashMap<&str, BTreeSet<u64>>,
                            object: &str,
                            cursor: u64,
                            when: &str| {
        let tried = attempted.get(object);
        if let Some(offset) = (0..cursor).find(|o| !tried.is_some_and(|t| t.contains(o))) {
            tally.flag(
                Violation::Broken("cursor_passed_unsettled"),
                format!(
                    "{LEASED_CONSUMER} on {}: cursor {cursor} {when} passed offset {offset}, never acked",
                    short(object)
                ),
            );
        }
    };
    for fact in handled {
        match fact {
            Handled::Leased {
                object,
                batch_id,
                first,
                last,
                attempt,
                expires_at,
                records,
                life,
            } => {
                leased += 1;
                if *attempt > 1 {
                    redelivered += 1;
                }
                let offsets: Vec<u64> = records.iter().map(|(o, _)| *o).collect();
                let expected: Vec<u64> = (*first..=*last).collect();
                if offsets != expected {
                    tally.flag(
                        Violation::Broken("skipping_reads"),
                        format!("{LEASED_CONSUMER} leased {first}..={last} holding {offsets:?}"),
                    );
                }
                for (offset, key) in records {
                    let journaled = accepted.get(&(object.clone(), key.clone())).map(|a| a.1);
                    if journaled.is_some_and(|journaled| journaled != *offset) {
                        tally.flag(
                            Violation::Broken("key_offset_changes"),
                            format!("{LEASED_CONSUMER} leased {key} at {offset}, accepted at {journaled:?}"),
                        );
                    }
                }
                let leased_at = expires_at.saturating_sub(lease_ms);
                let held = leases.entry(object.as_str()).or_default();
                for (other, tracked) in held.iter_mut() {
                    if !overlaps((tracked.first, tracked.last), (*first, *last)) {
                        continue;
                    }
                    if !tracked.released && leased_at < tracked.expires_at {
                        // `normal`: a cut may undo the lease's commit, whose
                        // reply was seen, and the range is leased again.
                        tally.flag_or_allow(
                            tally.allowance().undone_settlements,
                            "undone_leases",
                            Violation::Broken("two_live_holders"),
                            format!(
                                "{LEASED_CONSUMER} on {}: {first}..={last} leased as {batch_id} in life {life} while {other} held {}..={} until {}",
                                short(object),
                                tracked.first,
                                tracked.last,
                                tracked.expires_at
                            ),
                        );
                    }
                    tracked.reclaimed_by.get_or_insert_with(|| batch_id.clone());
                }
                held.insert(
                    batch_id.as_str(),
                    Tracked {
                        first: *first,
                        last: *last,
                        expires_at: *expires_at,
                        released: false,
                        reclaimed_by: None,
                    },
                );
            }
            Handled::Settling {
                object,
                batch_id,
                first,
                last,
                ack,
                ..
            } => {
                if let Some(tracked) = leases
                    .get_mut(object.as_str())
                    .and_then(|held| held.get_mut(batch_id.as_str()))
                {
                    tracked.released = true;
                }
                if *ack {
                    attempted
                        .entry(object.as_str())
                        .or_default()
                        .extend(*first..=*last);
                }
            }
            Handled::Settled {
                object,
                batch_id,
                first,
                last,
                ack,
                held,
                cursor,
                life,
            } => {
                let reclaimed = leases
                    .get(object.as_str())
                    .and_then(|h| h.get(batch_id.as_str()))
                    .and_then(|t| t.reclaimed_by.clone());
                if !held {
                    fenced += 1;
                } else if let Some(by) = reclaimed {
                    tally.flag(
                        Violation::Broken("fenced_ack_accepted"),
                        format!(
                            "{LEASED_CONSUMER} on {}: {batch_id} ({first}..={last}) settled in life {life} after {by} reclaimed it",
                            short(object)
                        ),
                    );
                }
                if *held && *ack {
                    for offset in *first..=*last {
                        if let Some(other) = acked_by.insert((object.as_str(), offset), batch_id) {
                            // An ack undone by a cut leaves its range to be
                            // leased and acked again.
                            tally.flag_or_allow(
                                tally.allowance().undone_settlements,
                                "undone_acks",
                                Violation::Broken("acked_twice"),
                                format!(
                                    "{LEASED_CONSUMER} on {}: offset {offset} acked by {other} and {batch_id}",
                                    short(object)
                                ),
                            );
                        }
                    }
                }
                let last_cursor = cursors.entry(object.as_str()).or_insert(0);
                if *cursor < *last_cursor {
                    tally.flag_or_allow(
                        tally.allowance().undone_settlements,
                        "undone_cursor_commits",
                        Violation::StaleSettlement,
                        format!(
                            "{LEASED_CONSUMER} on {}: cursor {cursor} in life {life} after {last_cursor}",
                            short(object)
                        ),
                    );
                }
                *last_cursor = (*last_cursor).max(*cursor);
                passed_unsettled(tally, &attempted, object, *cursor, "after an ack");
            }
            Handled::Page { .. } | Handled::Committed { .. } => {}
        }
    }
    for (object, log) in stored {
        let cursor = log.cursors.get(LEASED_CONSUMER).copied().unwrap_or(0);
        passed_unsettled(tally, &attempted, object, cursor, "(stored)");
        let last = cursors.get(object.as_str()).copied().unwrap_or(0);
        if cursor < last {
            tally.flag_or_allow(
                tally.allowance().undone_settlements,
                "undone_cursor_commits",
                Violation::StaleSettlement,
                format!(
                    "{LEASED_CONSUMER} on {}: stored cursor {cursor} is behind {last}",
                    short(object)
                ),
            );
        }
    }
    tally.detail("leases", leased);
    tally.detail("lease_redeliveries", redelivered);
    tally.detail("fenced_acks", fenced);
    attempted
}

/// The first digits of an object id, enough to tell objects apart.
fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn appended(records: &[(u64, u64)]) -> Produced {
        Produced::Appended {
            object: "o".into(),
            end_before: 0,
            acked_ms: None,
            records: records
                .iter()
                .map(|&(item, offset)| AcceptedRecord {
                    item,
                    key: key_of(item),
                    offset,
                })
                .collect(),
        }
    }

    fn page(consumer: &str, from: u64, items: &[u64]) -> Handled {
        Handled::Page {
            object: "o".into(),
            consumer: consumer.into(),
            from,
            records: items
                .iter()
                .enumerate()
                .map(|(i, &item)| (from + i as u64, key_of(item)))
                .collect(),
            next: from + items.len() as u64,
            life: 0,
        }
    }

    fn commit(consumer: &str, offset: u64) -> Handled {
        Handled::Committed {
            object: "o".into(),
            consumer: consumer.into(),
            offset,
            life: 0,
        }
    }

    fn log_of(items: &[u64], cursor: u64) -> BTreeMap<String, StoredLog> {
        let log = StoredLog {
            records: items
                .iter()
                .enumerate()
                .map(|(offset, &item)| StoredRecord {
                    offset: offset as u64,
                    key: key_of(item),
                    item: Some(item),
                })
                .collect(),
            next_offset: Some(items.len() as u64),
            cursors: CONSUMERS
                .iter()
                .map(|(c, _)| *c)
                .chain([LEASED_CONSUMER])
                .map(|c| (c.to_owned(), cursor))
                .collect(),
            cold: Vec::new(),
            cold_problems: Vec::new(),
        };
        BTreeMap::from([("o".to_owned(), log)])
    }

    fn leased(batch_id: &str, from: u64, items: &[u64], expires_at: EpochMs) -> Handled {
        Handled::Leased {
            object: "o".into(),
            batch_id: batch_id.into(),
            first: from,
            last: from + items.len() as u64 - 1,
            attempt: 1,
            expires_at,
            records: items
                .iter()
                .enumerate()
                .map(|(i, &item)| (from + i as u64, key_of(item)))
                .collect(),
            life: 0,
        }
    }

    fn settling(batch_id: &str, from: u64, count: u64) -> Handled {
        Handled::Settling {
            object: "o".into(),
            batch_id: batch_id.into(),
            first: from,
            last: from + count - 1,
            ack: true,
            life: 0,
        }
    }

    fn settled(batch_id: &str, from: u64, count: u64, held: bool, cursor: u64) -> Handled {
        Handled::Settled {
            object: "o".into(),
            batch_id: batch_id.into(),
            first: from,
            last: from + count - 1,
            ack: true,
            held,
            cursor,
            life: 0,
        }
    }

    /// Both cursor consumers read and commit `items` from `from`, and the
    /// leased consumer leases and acks them as one range.
    fn both_read(from: u64, items: &[u64]) -> Vec<Handled> {
        let count = items.len() as u64;
        let next = from + count;
        let mut facts: Vec<Handled> = CONSUMERS
            .iter()
            .flat_map(|(c, _)| [page(c, from, items), commit(c, next)])
            .collect();
        facts.extend([
            leased("b", from, items, 1_000),
            settling("b", from, count),
            settled("b", from, count, true, next),
        ]);
        facts
    }

    #[test]
    fn a_log_read_to_the_end_by_both_consumers_passes() {
        let produced = [appended(&[(0, 0), (1, 1)])];
        let tally = check_facts(
            &produced,
            &both_read(0, &[0, 1]),
            &log_of(&[0, 1], 2),
            Tally::default(),
        );
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!((tally.accepted, tally.completed), (2, 2));
    }

    #[test]
    fn a_record_a_consumer_never_handled_is_lost() {
        let produced = [appended(&[(0, 0), (1, 1)])];
        let handled = vec![
            page("reader-a", 0, &[0, 1]),
            page("reader-b", 0, &[0]),
            leased("b", 0, &[0, 1], 1_000),
            settling("b", 0, 2),
            settled("b", 0, 2, true, 2),
        ];
        let tally = check_facts(&produced, &handled, &log_of(&[0, 1], 2), Tally::default());
        assert_eq!(tally.lost, 1);
    }

    #[test]
    fn a_read_below_a_journaled_commit_is_a_cursor_regression() {
        let produced = [appended(&[(0, 0), (1, 1)])];
        let mut handled = both_read(0, &[0, 1]);
        handled.push(page("reader-a", 1, &[1]));
        let tally = check_facts(&produced, &handled, &log_of(&[0, 1], 2), Tally::default());
        assert_eq!(tally.stale_settlements, 1);
    }

    #[test]
    fn a_hole_in_the_offsets_is_an_offset_gap() {
        let produced = [appended(&[(0, 0), (1, 2)])];
        let mut stored = log_of(&[0, 1], 2);
        if let Some(log) = stored.get_mut("o")
            && let Some(record) = log.records.get_mut(1)
        {
            record.offset = 2;
        }
        let tally = check_facts(&produced, &both_read(0, &[0]), &stored, Tally::default());
        assert!(
            tally.broken.contains_key("offset_gaps"),
            "{:?}",
            tally.examples()
        );
        assert!(tally.lost >= 1);
    }

    /// Moves the records below `hot_from` of the one log to cold storage,
    /// keeping `overlap` of them hot as well (a kill before the delete).
    fn trimmed(
        mut stored: BTreeMap<String, StoredLog>,
        hot_from: u64,
        overlap: u64,
    ) -> BTreeMap<String, StoredLog> {
        if let Some(log) = stored.get_mut("o") {
            let records = std::mem::take(&mut log.records);
            for record in records {
                if record.offset < hot_from {
                    if record.offset + overlap >= hot_from {
                        log.records.push(StoredRecord {
                            offset: record.offset,
                            key: record.key.clone(),
                            item: record.item,
                        });
                    }
                    log.cold.push(record);
                } else {
                    log.records.push(record);
                }
            }
            log.records.sort_by_key(|r| r.offset);
        }
        stored
    }

    #[test]
    fn records_trimmed_to_cold_segments_stay_readable() {
        let produced = [appended(&[(0, 0), (1, 1), (2, 2)])];
        let stored = trimmed(log_of(&[0, 1, 2], 3), 2, 1);
        let tally = check_facts(
            &produced,
            &both_read(0, &[0, 1, 2]),
            &stored,
            Tally::default(),
        );
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!(tally.completed, 3);
    }

    #[test]
    fn a_record_neither_hot_nor_cold_is_lost() {
        let produced = [appended(&[(0, 0), (1, 1), (2, 2)])];
        let mut stored = trimmed(log_of(&[0, 1, 2], 3), 2, 0);
        if let Some(log) = stored.get_mut("o") {
            log.cold.retain(|r| r.offset != 1);
        }
        let tally = check_facts(
            &produced,
            &both_read(0, &[0, 1, 2]),
            &stored,
            Tally::default(),
        );
        assert_eq!(tally.lost, 1, "{:?}", tally.examples());
        assert!(tally.broken.contains_key("offset_gaps"));
    }

    #[test]
    fn a_cold_copy_that_differs_from_the_hot_one_is_a_duplicated_record() {
        let produced = [appended(&[(0, 0), (1, 1)])];
        let mut stored = trimmed(log_of(&[0, 1], 2), 1, 1);
        if let Some(log) = stored.get_mut("o")
            && let Some(record) = log.cold.first_mut()
        {
            record.key = key_of(7);
        }
        let tally = check_facts(&produced, &both_read(0, &[0, 1]), &stored, Tally::default());
        assert!(
            tally.broken.contains_key("duplicated_records"),
            "{:?}",
            tally.examples()
        );
    }

    #[test]
    fn a_key_stored_at_two_offsets_is_a_duplicated_record() {
        let produced = [appended(&[(0, 0), (1, 1)])];
        let mut stored = trimmed(log_of(&[0, 1], 2), 1, 0);
        if let Some(log) = stored.get_mut("o")
            && let Some(record) = log.records.first_mut()
        {
            record.key = key_of(0);
            record.item = Some(0);
        }
        let tally = check_facts(&produced, &both_read(0, &[0, 1]), &stored, Tally::default());
        assert!(
            tally.broken.contains_key("duplicated_records"),
            "{:?}",
            tally.examples()
        );
    }

    #[test]
    fn an_indexed_segment_that_cannot_be_read_is_flagged() {
        let dir = std::env::temp_dir().join("durability-torture-no-such-segments");
        let (records, problems) = read_segments(&dir, &[(0, 4, segment_file(0, 4))]);
        assert!(records.is_empty());
        assert_eq!(problems.len(), 1, "{problems:?}");
        let produced = [appended(&[(0, 0)])];
        let mut stored = log_of(&[0], 1);
        if let Some(log) = stored.get_mut("o") {
            log.cold_problems = problems;
        }
        let tally = check_facts(&produced, &both_read(0, &[0]), &stored, Tally::default());
        assert_eq!(tally.broken.get("unreadable_cold_segments"), Some(&1));
    }

    #[test]
    fn a_range_leased_while_an_overlapping_lease_is_live_has_two_live_holders() {
        let produced = [appended(&[(0, 0), (1, 1)])];
        let mut handled = both_read(0, &[0, 1]);
        // "x" holds 0..=1 until 500; "y" gets 1..=1 at 501 - LEASE_MS.
        let lease_ms = i64::try_from(LEASE_MS).unwrap_or(0);
        handled.insert(0, leased("x", 0, &[0, 1], 500));
        handled.insert(1, leased("y", 1, &[1], 501));
        let tally = check_facts(&produced, &handled, &log_of(&[0, 1], 2), Tally::default());
        assert_eq!(
            tally.broken.get("two_live_holders"),
            Some(&1),
            "{:?}",
            tally.examples()
        );
        // Leased once "x" expired, the same range is a legitimate redelivery.
        let mut handled = both_read(0, &[0, 1]);
        handled.insert(0, leased("x", 0, &[0, 1], 500));
        handled.insert(1, leased("y", 1, &[1], 500 + lease_ms));
        let tally = check_facts(&produced, &handled, &log_of(&[0, 1], 2), Tally::default());
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
    }

    #[test]
    fn an_ack_of_a_fenced_batch_that_is_accepted_is_flagged() {
        let produced = [appended(&[(0, 0), (1, 1)])];
        let lease_ms = i64::try_from(LEASE_MS).unwrap_or(0);
        let mut handled = both_read(0, &[0, 1]);
        handled.splice(
            0..0,
            [
                leased("x", 0, &[0], 100),
                leased("y", 0, &[0], 100 + lease_ms),
                settling("x", 0, 1),
                settled("x", 0, 1, true, 1),
            ],
        );
        let tally = check_facts(&produced, &handled, &log_of(&[0, 1], 2), Tally::default());
        assert_eq!(
            tally.broken.get("fenced_ack_accepted"),
            Some(&1),
            "{:?}",
            tally.examples()
        );
        // The same offset was then acked again by "b": two acks.
        assert_eq!(tally.broken.get("acked_twice"), Some(&1));
    }

    #[test]
    fn a_leased_cursor_past_an_offset_never_acked_passed_an_unsettled_range() {
        let produced = [appended(&[(0, 0), (1, 1), (2, 2)])];
        let mut handled: Vec<Handled> = both_read(0, &[0, 1, 2])
            .into_iter()
            .filter(|fact| {
                !matches!(
                    fact,
                    Handled::Leased { .. } | Handled::Settling { .. } | Handled::Settled { .. }
                )
            })
            .collect();
        // Only 2..=2 was acked, yet the cursor moved to 3.
        handled.extend([
            leased("c", 2, &[2], 1_000),
            settling("c", 2, 1),
            settled("c", 2, 1, true, 3),
        ]);
        let tally = check_facts(
            &produced,
            &handled,
            &log_of(&[0, 1, 2], 3),
            Tally::default(),
        );
        assert!(
            tally.broken.contains_key("cursor_passed_unsettled"),
            "{:?}",
            tally.examples()
        );
        assert_eq!(tally.lost, 2);
    }

    #[test]
    fn a_key_accepted_at_two_offsets_is_flagged() {
        let produced = [appended(&[(0, 0)]), appended(&[(0, 1)])];
        let tally = check_facts(
            &produced,
            &both_read(0, &[0]),
            &log_of(&[0], 1),
            Tally::default(),
        );
        assert_eq!(tally.broken.get("key_offset_changes"), Some(&1));
    }
}
