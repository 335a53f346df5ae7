//! `log`: the retained log on the real host.
//!
//! One object holds one log of ~100-byte records. Measured:
//! - appends in batches of 1 and of 100 (unkeyed, and keyed so that every
//!   record is also looked up for deduplication), by concurrent callers,
//!   divided by the raw SQLite floor of the same shape of commit (one row
//!   pair per transaction, or 100 per transaction) measured in the same run;
//! - reading the whole log in pages of 100 from the hot table;
//! - a trim that flushes everything but the last page to cold segments in
//!   a directory (one file per 100 records, fsynced);
//! - reading it all back from those cold segments.

use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use durability::Scheduler;
use durability::log::{AppendRecord, ColdError, ColdStorage, Log, Read, Retention, Segment};
use durability::platform::LocalBoxFuture;
use durability_host::{BoxError, DurableObject, Host, ObjectContext, Stub};

use super::host_calls::{count, drive};
use super::sqlite_floor::{self, FloorSizes, SyncMode};
use super::{BenchEnv, BenchError, Latency, Measurement, ScenarioReport};

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "log";

/// Appends in flight at once: enough to keep the object's thread busy.
const CALLERS: usize = 16;

/// Records per batched append, per read page and per cold segment.
const BATCH: u32 = 100;

/// A body of this many characters is stored as about 100 bytes
/// (`{"kind":"value","value":"…"}`).
const BODY_CHARS: usize = 75;

/// Segments in a directory, one fsynced file each.
struct DirectoryCold {
    dir: PathBuf,
}

impl ColdStorage for DirectoryCold {
    fn write<'a>(&'a self, segment: &'a Segment) -> LocalBoxFuture<'a, Result<String, ColdError>> {
        Box::pin(async move {
            let locator = format!("{:020}-{:020}", segment.first_offset, segment.last_offset);
            let path = self.dir.join(&locator);
            if !path.exists() {
                let temporary = self.dir.join(format!("{locator}.tmp"));
                std::fs::write(&temporary, segment.to_json()?)?;
                std::fs::File::open(&temporary)?.sync_all()?;
                std::fs::rename(&temporary, &path)?;
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

/// The benchmark's object: one log that keeps only its last page hot when
/// trimmed.
struct LogObject {
    log: Log<String>,
}

impl LogObject {
    fn construct(ctx: ObjectContext, cold: PathBuf) -> Result<Self, BoxError> {
        let scheduler = Scheduler::new(ctx.into_dyn())?;
        let log = Log::<String>::builder(&scheduler)
            .max_batch_size(BATCH)
            .retention(Retention::new().max_records(u64::from(BATCH)))
            .cold(Rc::new(DirectoryCold { dir: cold }))
            .build()?;
        Ok(LogObject { log })
    }
}

impl DurableObject for LogObject {}

/// A ~100-byte body, different per record.
fn body(i: u64) -> String {
    let mut text = format!("event {i} ");
    text.extend(std::iter::repeat_n(
        'x',
        BODY_CHARS.saturating_sub(text.len()),
    ));
    text
}

fn task_error(error: impl std::fmt::Display) -> BenchError {
    BenchError::Task {
        message: error.to_string(),
    }
}

/// How many records each part uses.
struct Sizes {
    floor_single: u64,
    floor_batched: u64,
    single_appends: u64,
    batched_records: u64,
}

impl Sizes {
    fn for_env(env: &BenchEnv) -> Self {
        Sizes {
            floor_single: env.size(3_000, 200),
            floor_batched: env.size(100_000, 2_000),
            single_appends: env.size(3_000, 200),
            batched_records: env.size(100_000, 2_000),
        }
    }
}

/// Runs the `log` scenario.
pub fn run(env: &BenchEnv) -> Result<ScenarioReport, BenchError> {
    let sizes = Sizes::for_env(env);
    let threads = std::thread::available_parallelism().map_or(2, usize::from);
    let floor = sqlite_floor::measure(
        env,
        SyncMode::Full,
        FloorSizes {
            single_ops: sizes.floor_single,
            batched_messages: sizes.floor_batched,
        },
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|source| BenchError::Runtime { source })?;
    let mut report = ScenarioReport {
        scenario: NAME,
        quick: env.quick(),
        headline: "append-batch100".into(),
        measurements: vec![floor.enqueue.clone(), floor.enqueue_batch.clone()],
        figures: Vec::new(),
        notes: vec![
            format!("host: {threads} executor threads, synchronous FULL; one object, one log"),
            format!("records: ~100 B stored payload; {CALLERS} concurrent appenders"),
            format!(
                "÷ floor: batch of 1 vs {} (a row pair per txn); batch of {BATCH} vs {} ({BATCH} per txn)",
                floor.enqueue.name, floor.enqueue_batch.name
            ),
            "batched rows: ops/s counts records, latencies are per append call (one txn)".into(),
            format!("reads: pages of {BATCH}, one call each; cold = one segment file per page"),
        ],
    };
    runtime.block_on(async {
        let dir = env.subdir("log")?;
        let cold = dir.join("cold");
        std::fs::create_dir_all(&cold).map_err(|source| BenchError::Io {
            what: "cannot create the cold segment directory",
            path: cold.clone(),
            source,
        })?;
        let host = Host::builder(dir.join("objects"))
            .threads(threads)
            .build()?;
        let ns = host
            .namespace::<LogObject>("logs", move |ctx| LogObject::construct(ctx, cold.clone()))?;
        let stub = ns.stub("bench")?;
        let measured = measure(env, &sizes, &stub, &floor).await;
        host.shutdown().await;
        report.measurements.extend(measured?);
        Ok::<_, BenchError>(())
    })?;
    Ok(report)
}

async fn measure(
    env: &BenchEnv,
    sizes: &Sizes,
    stub: &Stub<LogObject>,
    floor: &sqlite_floor::Floor,
) -> Result<Vec<Measurement>, BenchError> {
    // Construct the object first, so the figures are steady state.
    stub.call(|_: Rc<LogObject>| async {}).await?;
    let stub = Arc::new(stub.clone());
    let mut out = Vec::new();

    let calls = Arc::clone(&stub);
    let mut single = drive(
        env,
        "append-batch1",
        "append 1 record, 1 call, 1 txn",
        sizes.single_appends,
        CALLERS,
        move |i| {
            let calls = Arc::clone(&calls);
            async move { append(&calls, i, 1, false).await }
        },
    )
    .await?;
    single.compare_with_floor(&floor.enqueue);
    out.push(single);

    let mut next = sizes.single_appends;
    for (name, keyed) in [("append-batch100", false), ("append-batch100-keyed", true)] {
        let first = next;
        let calls = Arc::clone(&stub);
        let batches = sizes.batched_records / u64::from(BATCH);
        let mut batched = drive(
            env,
            name,
            if keyed {
                "append 1 keyed record in a batch of 100 (1 call, 1 txn)"
            } else {
                "append 1 record in a batch of 100 (1 call, 1 txn)"
            },
            batches,
            CALLERS,
            move |batch| {
                let calls = Arc::clone(&calls);
                let from = first + batch * u64::from(BATCH);
                async move { append(&calls, from, BATCH, keyed).await }
            },
        )
        .await?;
        batched.ops = batches * u64::from(BATCH);
        batched = batched.with("batch_size", BATCH);
        batched.compare_with_floor(&floor.enqueue_batch);
        out.push(batched);
        next += batches * u64::from(BATCH);
    }

    out.push(
        read_all(
            env,
            &stub,
            "read-hot",
            "read 1 record from the hot table, pages of 100",
        )
        .await?,
    );

    let started = Instant::now();
    let flushed =
        stub.call(|object: Rc<LogObject>| async move {
            object.log.trim().await.map_err(|e| e.to_string())
        })
        .await?
        .map_err(task_error)?;
    let trim = Measurement {
        name: "trim-to-cold".into(),
        what: "flush 1 record: segment file written and fsynced, indexed, deleted".into(),
        ops: flushed,
        elapsed: started.elapsed(),
        latency: None,
        floor_ratio: None,
        extra: serde_json::Map::new(),
    };
    out.push(trim);

    out.push(
        read_all(
            env,
            &stub,
            "read-cold",
            "read 1 record from cold segment files, pages of 100",
        )
        .await?,
    );
    Ok(out)
}

/// Appends `n` records numbered from `from`.
async fn append(stub: &Stub<LogObject>, from: u64, n: u32, keyed: bool) -> Result<(), BenchError> {
    stub.call(move |object: Rc<LogObject>| async move {
        let records = (from..from + u64::from(n))
            .map(|i| {
                if keyed {
                    AppendRecord::keyed(format!("record-{i}"), body(i))
                } else {
                    AppendRecord::new(body(i))
                }
            })
            .collect();
        match object.log.append(records).await {
            Ok(appended) if appended.offsets().is_some() => Ok(()),
            Ok(appended) => Err(format!("append rejected: {:?}", appended.rejection())),
            Err(error) => Err(error.to_string()),
        }
    })
    .await?
    .map_err(task_error)
}

/// Reads from the oldest offset to the end in pages, one call per page, up
/// to the hot offset when reading cold (the hot tail is not cold).
async fn read_all(
    env: &BenchEnv,
    stub: &Stub<LogObject>,
    name: &str,
    what: &str,
) -> Result<Measurement, BenchError> {
    let bounds = stub
        .call(|object: Rc<LogObject>| async move {
            object.log.bounds().await.map_err(|e| e.to_string())
        })
        .await?
        .map_err(task_error)?;
    let cold = bounds.hot_offset > bounds.oldest_offset;
    let end = if cold {
        bounds.hot_offset
    } else {
        bounds.next_offset
    };
    let bar = env.progress(name, end - bounds.oldest_offset);
    let mut latency = Latency::new()?;
    let mut from = bounds.oldest_offset;
    let mut records = 0;
    let started = Instant::now();
    while from < end {
        let page_started = Instant::now();
        let (read, next) = stub
            .call(move |object: Rc<LogObject>| async move {
                let page = object
                    .log
                    .read(Read::from_offset(from).limit(BATCH))
                    .await
                    .map_err(|e| e.to_string())?;
                // Touch every body, as a consumer would.
                let bytes: usize = page.records.iter().map(|r| r.body.len()).sum();
                std::hint::black_box(bytes);
                Ok::<_, String>((page.records.len(), page.next_offset))
            })
            .await?
            .map_err(task_error)?;
        latency.record(page_started.elapsed());
        if read == 0 {
            break;
        }
        records += count(read);
        bar.inc(count(read));
        from = next;
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    Ok(Measurement::new(name, what, records, elapsed, &latency).with("page_size", BATCH))
}
