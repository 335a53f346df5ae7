//! `host-calls`: what the object host costs on top of SQLite.
//!
//! Runs the real host (multi-thread mode, real time) and measures, in this
//! order:
//! - in each durability mode (the default, group commit with output gates,
//!   with per-WAL syncs and with `syncfs`; FULL; NORMAL), each on a data
//!   directory of its own: 64 callers writing to one object and across
//!   1,000, each call one small SQL write committed on its own. Replies/s
//!   is calls whose reply the caller got; commits/s is commits returned
//!   inside the objects, until the last one (in the default mode a commit
//!   returns before its reply is released). Both are divided by the raw
//!   SQLite FULL floor of the same write measured in the same run;
//! - then, in the default mode on one data directory: one caller's round
//!   trip to one object;
//! - the time to open objects (a first call constructs the object: opens its
//!   file and runs its migration), on new files and on existing ones;
//! - resident memory per live object, and per evicted object with an armed
//!   alarm;
//! - alarm lateness (fire time − scheduled time) of probe alarms due at a
//!   steady rate while ten thousand other alarms are armed on evicted
//!   objects, the way sleeping objects wait for their next wake-up;
//! - how fast the host delivers a storm of alarms all due at once.

use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use durability_host::{BoxError, DurableObject, Host, Namespace, ObjectContext, Stub};
use durability_platform::{AlarmInfo, Context, EpochMs, StorageError, StorageExt, params};
use indicatif::ProgressBar;
use tokio::sync::mpsc;

use super::rss;
use super::sqlite_floor::{self, SyncMode, WRITE_SQL, WRITE_VALUE, WRITES_TABLE_SQL};
use super::{BenchEnv, BenchError, Figure, Latency, Measurement, ScenarioReport};
use crate::modes::{self, Mode};

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "host-calls";

/// Calls in flight at once in the concurrent measurements: enough to keep
/// every executor thread busy while callers wait for replies.
const CALLERS: usize = 64;

/// Objects opened (and evicted) together in the open measurements, so live
/// objects stay far below the file-descriptor limit (three descriptors per
/// live object: the database, its WAL and its shared-memory index).
const OPEN_CHUNK: usize = 1_000;

/// The host never evicts by itself during the run: the scenario evicts
/// explicitly, so memory figures are not disturbed by idle eviction.
const IDLE_TIMEOUT: Duration = Duration::from_secs(3_600);

/// How far ahead the armed-but-sleeping alarms are set: far enough never to
/// fire during the run; the host still holds each in its alarm schedule.
const SLEEPING_ALARM_AHEAD_MS: EpochMs = 3_600_000;

/// Extra time, after the last alarm is due, before the run gives up waiting.
const ALARM_WAIT_SLACK: Duration = Duration::from_secs(60);

const NAMESPACE: &str = "bench";

/// The migration every bench object runs when it is constructed.
const OBJECT_SCHEMA_SQL: &str = "
    CREATE TABLE IF NOT EXISTS armed (
        slot INTEGER PRIMARY KEY CHECK (slot = 0),
        at_ms INTEGER NOT NULL
    );
    CREATE TABLE IF NOT EXISTS lateness (
        id INTEGER PRIMARY KEY,
        scheduled_ms INTEGER NOT NULL,
        fired_ms INTEGER NOT NULL
    );";

/// How big each part of the run is.
struct Sizes {
    floor_ops: u64,
    sequential_calls: u64,
    one_object_calls: u64,
    many_objects: usize,
    many_object_calls: u64,
    /// Objects opened, made live for the memory figures, then armed: the
    /// sleeping alarms of the lateness measurement.
    open_objects: usize,
    live_objects: usize,
    probe_alarms: usize,
    /// Probes are due evenly over this window.
    probe_window: Duration,
    storm_alarms: usize,
}

impl Sizes {
    fn for_env(env: &BenchEnv) -> Self {
        Sizes {
            floor_ops: env.size(5_000, 200),
            sequential_calls: env.size(5_000, 200),
            one_object_calls: env.size(20_000, 500),
            many_objects: env.size(1_000, 100),
            many_object_calls: env.size(20_000, 500),
            open_objects: env.size(10_000, 300),
            live_objects: env.size(5_000, 200),
            probe_alarms: env.size(1_000, 50),
            probe_window: env.size(Duration::from_secs(10), Duration::from_millis(500)),
            storm_alarms: env.size(2_000, 50),
        }
    }
}

/// Commits made by the objects of one host, and when the last one returned.
#[derive(Default)]
struct Commits {
    count: AtomicU64,
    last: std::sync::Mutex<Option<Instant>>,
}

impl Commits {
    fn record(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut last) = self.last.lock() {
            *last = Some(Instant::now());
        }
    }

    /// (commits so far, when the last one returned).
    fn read(&self) -> (u64, Option<Instant>) {
        let last = self.last.lock().ok().and_then(|last| *last);
        (self.count.load(Ordering::Relaxed), last)
    }
}

/// The benchmark's object: a table of small writes, and the time its alarm
/// was armed for, so the alarm handler can measure its own lateness.
struct BenchObject {
    ctx: ObjectContext,
    lateness_ms: mpsc::UnboundedSender<EpochMs>,
    commits: Arc<Commits>,
}

impl BenchObject {
    fn construct(
        ctx: ObjectContext,
        lateness_ms: mpsc::UnboundedSender<EpochMs>,
        commits: Arc<Commits>,
    ) -> Result<Self, BoxError> {
        // One transaction: one commit for a new file's tables, as a
        // capability's migration does.
        ctx.storage()
            .transaction_sync(|sql| -> Result<(), StorageError> {
                sql.execute_script(WRITES_TABLE_SQL)?;
                sql.execute_script(OBJECT_SCHEMA_SQL)
            })?;
        Ok(BenchObject {
            ctx,
            lateness_ms,
            commits,
        })
    }

    /// One small write, committed on its own: the same row as the floor's.
    fn write(&self) -> Result<(), StorageError> {
        self.ctx
            .storage()
            .execute(WRITE_SQL, &params![self.ctx.now_ms(), WRITE_VALUE])?;
        self.commits.record();
        Ok(())
    }

    /// Records the scheduled time and sets the alarm in one transaction, so
    /// the handler never finds an alarm without its scheduled time.
    async fn arm(&self, at_ms: EpochMs) -> Result<(), StorageError> {
        self.ctx
            .storage()
            .transaction(|txn| {
                txn.execute(
                    "INSERT OR REPLACE INTO armed (slot, at_ms) VALUES (0, ?1)",
                    &params![at_ms],
                )?;
                txn.set_alarm(at_ms)
            })
            .await
    }
}

impl DurableObject for BenchObject {
    async fn alarm(&self, _info: AlarmInfo) -> Result<(), BoxError> {
        let fired_ms = self.ctx.now_ms();
        let storage = self.ctx.storage();
        let Some(row) = storage.query_row("SELECT at_ms FROM armed WHERE slot = 0", &[])? else {
            return Ok(());
        };
        let scheduled_ms: EpochMs = row.get(0)?;
        storage.transaction_sync(|sql| -> Result<(), StorageError> {
            sql.execute("DELETE FROM armed WHERE slot = 0", &[])?;
            sql.execute(
                "INSERT INTO lateness (scheduled_ms, fired_ms) VALUES (?1, ?2)",
                &params![scheduled_ms, fired_ms],
            )?;
            Ok(())
        })?;
        // The receiver is gone only if the run already gave up waiting.
        let _ = self.lateness_ms.send(fired_ms - scheduled_ms);
        Ok(())
    }
}

/// Runs the `host-calls` scenario.
pub fn run(env: &BenchEnv) -> Result<ScenarioReport, BenchError> {
    let sizes = Sizes::for_env(env);
    let threads = std::thread::available_parallelism().map_or(2, usize::from);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|source| BenchError::Runtime { source })?;

    // The floor first, on the same disk, so the ratios compare like with like.
    let floor = sqlite_floor::measure_write(env, SyncMode::Full, sizes.floor_ops)?;

    let mut report = ScenarioReport {
        scenario: NAME,
        quick: env.quick(),
        headline: "default/one-object/64-callers".into(),
        measurements: vec![floor.clone()],
        figures: Vec::new(),
        notes: vec![
            format!(
                "host: {threads} executor threads; each call inserts one small row in its own commit"
            ),
            "modes: default = group commit with output gates (one fdatasync of the host journal per flush), default-walfiles = the same with an fdatasync of each dirty WAL per flush, default-syncfs = the same with one syncfs per flush, full = a sync per commit, normal = no sync".into(),
            "ops/s = replies/s (calls whose reply was released); commits_per_sec = commits returned inside the objects, until the last one".into(),
            "÷ floor: replies/s divided by full/write, raw rusqlite inserting the same row on one connection with synchronous=FULL; above 1 when commits overlap".into(),
        ],
    };
    runtime.block_on(async move {
        for mode in modes::with_syncfs() {
            let measured = calls_in_mode(env, mode, threads, &sizes, &floor).await?;
            report.measurements.extend(measured);
        }
        let dir = env.subdir("host-calls")?;
        let host = Host::builder(&dir)
            .threads(threads)
            .idle_timeout(IDLE_TIMEOUT)
            .build()?;
        let (lateness_tx, lateness_rx) = mpsc::unbounded_channel();
        let commits = Arc::new(Commits::default());
        let ns = host.namespace::<BenchObject>(NAMESPACE, move |ctx| {
            BenchObject::construct(ctx, lateness_tx.clone(), Arc::clone(&commits))
        })?;
        let mut run = Run {
            env,
            sizes,
            host: host.clone(),
            ns,
            lateness_rx,
            floor,
            report,
        };
        let outcome = run.all().await;
        host.shutdown().await;
        outcome.map(|()| run.report)
    })
}

/// One run of the scenario on one host.
struct Run<'a> {
    env: &'a BenchEnv,
    sizes: Sizes,
    host: Host,
    ns: Namespace<BenchObject>,
    lateness_rx: mpsc::UnboundedReceiver<EpochMs>,
    floor: Measurement,
    report: ScenarioReport,
}

impl Run<'_> {
    async fn all(&mut self) -> Result<(), BenchError> {
        self.calls_to_one_object().await?;
        let opened = self.open_objects().await?;
        self.memory_and_sleeping_alarms(&opened).await?;
        self.alarm_probes().await?;
        self.alarm_storm().await
    }

    /// One object, one caller: the round trip of a call.
    async fn calls_to_one_object(&mut self) -> Result<(), BenchError> {
        let one = Arc::new(vec![self.ns.stub("one")?]);
        call_write(Arc::clone(&one), 0).await?;
        let stubs = Arc::clone(&one);
        let mut measured = drive(
            self.env,
            "default/one-object/sequential",
            "1 call = 1 row insert, 1 caller",
            self.sizes.sequential_calls,
            1,
            move |i| call_write(Arc::clone(&stubs), i),
        )
        .await?;
        measured.compare_with_floor(&self.floor);
        self.report.measurements.push(measured);
        self.host.evict(one[0].id()).await?;
        Ok(())
    }

    /// First calls to new objects (file created, migration run), then to
    /// the same objects again after eviction (file opened, migration a
    /// no-op). Returns the objects, evicted.
    async fn open_objects(&mut self) -> Result<Arc<Vec<Stub<BenchObject>>>, BenchError> {
        let n = self.sizes.open_objects;
        let stubs = Arc::new(stubs_for(&self.ns, "open", n)?);
        let created = self
            .open_in_chunks(
                &stubs,
                "open/new-files",
                "first call: create file + migrate",
            )
            .await?;
        let reopened = self
            .open_in_chunks(
                &stubs,
                "open/existing-files",
                "first call: open file + migrate",
            )
            .await?;
        self.report.figures.push(Figure {
            key: "create_objects_s",
            label: format!("time to create {n} new objects"),
            value: created.elapsed.as_secs_f64(),
            unit: "s",
        });
        self.report.figures.push(Figure {
            key: "open_objects_s",
            label: format!("time to open {n} existing objects"),
            value: reopened.elapsed.as_secs_f64(),
            unit: "s",
        });
        self.report.measurements.push(created);
        self.report.measurements.push(reopened);
        Ok(stubs)
    }

    /// First calls to every object, [`OPEN_CHUNK`] at a time; each chunk is
    /// evicted after it was timed, so its files close before the next opens.
    async fn open_in_chunks(
        &self,
        stubs: &[Stub<BenchObject>],
        name: &str,
        what: &str,
    ) -> Result<Measurement, BenchError> {
        let bar = self.env.progress(name, count(stubs.len()));
        let mut latency = Latency::new()?;
        let mut elapsed = Duration::ZERO;
        for chunk in stubs.chunks(OPEN_CHUNK) {
            let chunk = Arc::new(chunk.to_vec());
            let calls = Arc::clone(&chunk);
            let (chunk_elapsed, chunk_latency) =
                run_callers(count(chunk.len()), CALLERS, &bar, move |i| {
                    let calls = Arc::clone(&calls);
                    async move {
                        calls[index(i, calls.len())]
                            .call(|_: Rc<BenchObject>| async {})
                            .await?;
                        Ok(())
                    }
                })
                .await?;
            elapsed += chunk_elapsed;
            latency.merge(&chunk_latency)?;
            self.evict_all(&chunk).await?;
        }
        bar.finish_and_clear();
        Ok(
            Measurement::new(name, what, count(stubs.len()), elapsed, &latency)
                .with("callers", count(CALLERS)),
        )
    }

    /// Makes the first [`Sizes::live_objects`] of `opened` live, each arming
    /// an alarm an hour ahead, and reads the resident memory before, while
    /// live and after eviction. Then arms the rest the same way, so every
    /// opened object sleeps with an armed alarm for the lateness probes.
    async fn memory_and_sleeping_alarms(
        &mut self,
        opened: &Arc<Vec<Stub<BenchObject>>>,
    ) -> Result<(), BenchError> {
        let live_count = self.sizes.live_objects.min(opened.len());
        let live = Arc::new(opened[..live_count].to_vec());
        let rest = Arc::new(opened[live_count..].to_vec());
        let at_ms = self.host.now_ms() + SLEEPING_ALARM_AHEAD_MS;

        let before = (rss::resident_bytes(), rss::open_fds());
        self.arm(&live, "memory/live", move |_| at_ms, false)
            .await?;
        let when_live = (rss::resident_bytes(), rss::open_fds());
        self.evict_all(&live).await?;
        let after_evict = (rss::resident_bytes(), rss::open_fds());

        let n = live_count as f64;
        if let (Some(base), Some(live), Some(evicted)) = (before.0, when_live.0, after_evict.0) {
            self.report.figures.push(Figure {
                key: "memory_per_live_object_bytes",
                label: "memory per live object".into(),
                value: live.saturating_sub(base) as f64 / n,
                unit: "bytes",
            });
            self.report.figures.push(Figure {
                key: "memory_per_evicted_object_bytes",
                label: "memory per evicted object (alarm armed)".into(),
                value: evicted.saturating_sub(base) as f64 / n,
                unit: "bytes",
            });
        }
        if let (Some(base), Some(live)) = (before.1, when_live.1) {
            self.report.figures.push(Figure {
                key: "fds_per_live_object",
                label: "file descriptors per live object".into(),
                value: live.saturating_sub(base) as f64 / n,
                unit: "fds",
            });
        }
        self.report.notes.push(format!(
            "memory: resident set (after malloc_trim) before, with {live_count} objects live, and after evicting them"
        ));

        self.arm(&rest, "alarms/arm-sleeping", move |_| at_ms, true)
            .await?;
        Ok(())
    }

    /// Probe alarms due at a steady rate while every opened object sleeps
    /// with an armed alarm: the lateness of an ordinary wake-up.
    async fn alarm_probes(&mut self) -> Result<(), BenchError> {
        let n = self.sizes.probe_alarms;
        let stubs = Arc::new(stubs_for(&self.ns, "probe", n)?);
        let window_ms = millis(self.sizes.probe_window);
        let first_due_ms = self.host.now_ms() + self.arming_lead_ms(n);
        let armed_after_due = self
            .arm(
                &stubs,
                "alarms/arm-probes",
                move |i| first_due_ms + window_ms * as_ms(i) / as_ms(n).max(1),
                true,
            )
            .await?;
        let sleeping = self.sizes.open_objects;
        let (fired, lateness, window) = self
            .await_alarms(n, first_due_ms, "alarms/probes-fired")
            .await?;
        self.evict_all(&stubs).await?;
        self.report.measurements.push(
            Measurement::new(
                format!("alarms/lateness-{sleeping}-sleeping"),
                format!(
                    "1 probe alarm, {n} due over {:.0} s",
                    self.sizes.probe_window.as_secs_f64()
                ),
                count(fired),
                window,
                &lateness,
            )
            .with("armed_sleeping", count(sleeping))
            .with("armed_after_due", armed_after_due),
        );
        self.report.notes.push(format!(
            "alarms: lateness = fire − scheduled, 1 ms resolution; probes fire while {sleeping} other alarms are armed on evicted objects"
        ));
        Ok(())
    }

    /// Alarms on evicted objects all due at the same moment: how many the
    /// host delivers per second (each wakes, constructs and runs its object).
    async fn alarm_storm(&mut self) -> Result<(), BenchError> {
        let n = self.sizes.storm_alarms;
        let stubs = Arc::new(stubs_for(&self.ns, "storm", n)?);
        let due_ms = self.host.now_ms() + self.arming_lead_ms(n);
        let armed_after_due = self
            .arm(&stubs, "alarms/arm-storm", move |_| due_ms, true)
            .await?;
        let (fired, lateness, window) = self.await_alarms(n, due_ms, "alarms/storm-fired").await?;
        self.evict_all(&stubs).await?;
        self.report.measurements.push(
            Measurement::new(
                format!("alarms/storm-{n}-due-at-once"),
                "1 alarm delivered; ops/s = delivery rate",
                count(fired),
                window,
                &lateness,
            )
            .with("armed_after_due", armed_after_due),
        );
        Ok(())
    }

    /// How far ahead to schedule alarms on `n` new objects so that arming
    /// them all finishes before the first is due, or the lateness would
    /// include the arming: a generous multiple of the measured creation rate.
    fn arming_lead_ms(&self, n: usize) -> EpochMs {
        let create_s_per_object = self
            .report
            .figures
            .iter()
            .find(|f| f.key == "create_objects_s")
            .map_or(0.01, |f| f.value / self.sizes.open_objects.max(1) as f64);
        let lead_s = 1.0 + 4.0 * create_s_per_object * n as f64;
        (lead_s * 1_000.0) as EpochMs
    }

    /// Arms the alarm of every object (object `i` at `due_ms(i)`), 64
    /// callers at a time, evicting each right after if `evict` (an alarm
    /// should wake a sleeping object, as in service). Returns how many were
    /// armed only after they were due.
    async fn arm(
        &self,
        stubs: &Arc<Vec<Stub<BenchObject>>>,
        phase: &str,
        due_ms: impl Fn(usize) -> EpochMs + Clone + Send + Sync + 'static,
        evict: bool,
    ) -> Result<u64, BenchError> {
        let bar = self.env.progress(phase, count(stubs.len()));
        let late = Arc::new(AtomicU64::new(0));
        let (stubs, host, late_count) = (Arc::clone(stubs), self.host.clone(), Arc::clone(&late));
        run_callers(count(stubs.len()), CALLERS, &bar, move |i| {
            let (stubs, host, late, due_ms) = (
                Arc::clone(&stubs),
                host.clone(),
                Arc::clone(&late_count),
                due_ms.clone(),
            );
            async move {
                let i = index(i, stubs.len());
                let stub = &stubs[i];
                let at_ms = due_ms(i);
                stub.call(move |object: Rc<BenchObject>| async move { object.arm(at_ms).await })
                    .await??;
                if host.now_ms() >= at_ms {
                    late.fetch_add(1, Ordering::Relaxed);
                }
                if evict {
                    host.evict(stub.id()).await?;
                }
                Ok(())
            }
        })
        .await?;
        bar.finish_and_clear();
        Ok(late.load(Ordering::Relaxed))
    }

    /// Waits for `n` alarm handlers to report; returns how many did, their
    /// lateness, and the window from `first_due_ms` to the last report.
    async fn await_alarms(
        &mut self,
        n: usize,
        first_due_ms: EpochMs,
        phase: &str,
    ) -> Result<(usize, Latency, Duration), BenchError> {
        let bar = self.env.progress(phase, count(n));
        let ahead =
            Duration::from_millis(u64::try_from(first_due_ms - self.host.now_ms()).unwrap_or(0));
        let deadline =
            tokio::time::Instant::now() + ahead + self.sizes.probe_window + ALARM_WAIT_SLACK;
        let mut lateness = Latency::new()?;
        let mut fired = 0;
        let mut last_fired_ms = first_due_ms;
        while fired < n {
            match tokio::time::timeout_at(deadline, self.lateness_rx.recv()).await {
                Ok(Some(late_ms)) => {
                    // A negative lateness (an early fire) is recorded as zero;
                    // the host fires at or after the due time.
                    lateness.record(Duration::from_millis(u64::try_from(late_ms).unwrap_or(0)));
                    fired += 1;
                    last_fired_ms = self.host.now_ms();
                    bar.inc(1);
                }
                Ok(None) | Err(_) => break,
            }
        }
        bar.finish_and_clear();
        if fired < n {
            return Err(BenchError::AlarmsMissing { fired, armed: n });
        }
        let window =
            Duration::from_millis(u64::try_from(last_fired_ms - first_due_ms).unwrap_or(0));
        Ok((fired, lateness, window))
    }

    async fn evict_all(&self, stubs: &[Stub<BenchObject>]) -> Result<(), BenchError> {
        for stub in stubs {
            self.host.evict(stub.id()).await?;
        }
        Ok(())
    }
}

/// One call to `stubs[i mod len]` that inserts one row.
async fn call_write(stubs: Arc<Vec<Stub<BenchObject>>>, i: u64) -> Result<(), BenchError> {
    stubs[index(i, stubs.len())]
        .call(|object: Rc<BenchObject>| async move { object.write() })
        .await??;
    Ok(())
}

/// 64 callers writing to one object, then across many, on a host of its
/// own in `mode`: replies/s and commits/s.
async fn calls_in_mode(
    env: &BenchEnv,
    mode: Mode,
    threads: usize,
    sizes: &Sizes,
    floor: &Measurement,
) -> Result<Vec<Measurement>, BenchError> {
    let dir = env.subdir(&format!("host-calls-{}", mode.key))?;
    let host = mode
        .builder(&dir)
        .threads(threads)
        .idle_timeout(IDLE_TIMEOUT)
        .build()?;
    let commits = Arc::new(Commits::default());
    let made = Arc::clone(&commits);
    let (lateness_tx, _lateness_rx) = mpsc::unbounded_channel();
    let ns = host.namespace::<BenchObject>(NAMESPACE, move |ctx| {
        BenchObject::construct(ctx, lateness_tx.clone(), Arc::clone(&made))
    })?;
    let mut measured = Vec::new();
    let placements = [
        ("one-object".to_owned(), 1, sizes.one_object_calls),
        (
            format!("{}-objects", sizes.many_objects),
            sizes.many_objects,
            sizes.many_object_calls,
        ),
    ];
    let outcome = async {
        for (placement, n, calls) in placements {
            let stubs = Arc::new(stubs_for(&ns, &placement, n)?);
            // Every object is live and written once before the clock starts.
            for i in 0..stubs.len() {
                call_write(Arc::clone(&stubs), count(i)).await?;
            }
            let (commits_before, _) = commits.read();
            let started = Instant::now();
            let name = format!("{}/{placement}/64-callers", mode.key);
            let what = format!("1 call = 1 row insert, 64 callers over {n} objects");
            let calls_to = Arc::clone(&stubs);
            let mut replies = drive(env, &name, &what, calls, CALLERS, move |i| {
                call_write(Arc::clone(&calls_to), i)
            })
            .await?;
            replies.compare_with_floor(floor);
            let (commits_after, last) = commits.read();
            let committed = commits_after.saturating_sub(commits_before);
            let until_last = last.map_or(replies.elapsed, |last| last.duration_since(started));
            let commits_per_sec = if until_last.is_zero() {
                0.0
            } else {
                committed as f64 / until_last.as_secs_f64()
            };
            let replies_per_sec = replies.ops_per_sec().round();
            measured.push(
                replies
                    .with("objects", count(n))
                    .with("commits_per_sec", commits_per_sec.round())
                    .with("replies_per_sec", replies_per_sec),
            );
            for stub in stubs.iter() {
                host.evict(stub.id()).await?;
            }
        }
        Ok::<_, BenchError>(())
    }
    .await;
    host.shutdown().await;
    outcome.map(|()| measured)
}

/// Stubs for objects `prefix-0` .. `prefix-(n-1)`.
fn stubs_for(
    ns: &Namespace<BenchObject>,
    prefix: &str,
    n: usize,
) -> Result<Vec<Stub<BenchObject>>, BenchError> {
    (0..n)
        .map(|i| Ok(ns.stub(&format!("{prefix}-{i}"))?))
        .collect()
}

/// Runs `op(0..total)` with `callers` calls in flight and returns it as a
/// measurement named `name` whose one operation is `what`.
pub(super) async fn drive<F, Fut>(
    env: &BenchEnv,
    name: &str,
    what: &str,
    total: u64,
    callers: usize,
    op: F,
) -> Result<Measurement, BenchError>
where
    F: Fn(u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BenchError>> + Send + 'static,
{
    let bar = env.progress(name, total);
    let (elapsed, latency) = run_callers(total, callers, &bar, op).await?;
    bar.finish_and_clear();
    Ok(Measurement::new(name, what, total, elapsed, &latency).with("callers", count(callers)))
}

/// `callers` tasks take the next index until `total` ops ran, each timing
/// its own ops; returns the wall time and the merged latencies.
async fn run_callers<F, Fut>(
    total: u64,
    callers: usize,
    bar: &ProgressBar,
    op: F,
) -> Result<(Duration, Latency), BenchError>
where
    F: Fn(u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BenchError>> + Send + 'static,
{
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..callers.max(1) {
        let next = Arc::clone(&next);
        let op = op.clone();
        let bar = bar.clone();
        tasks.spawn(async move {
            let mut latency = Latency::new()?;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return Ok::<Latency, BenchError>(latency);
                }
                let op_started = Instant::now();
                op(i).await?;
                latency.record(op_started.elapsed());
                bar.inc(1);
            }
        });
    }
    let mut merged = Latency::new()?;
    while let Some(joined) = tasks.join_next().await {
        let latency = joined.map_err(|error| BenchError::Task {
            message: error.to_string(),
        })??;
        merged.merge(&latency)?;
    }
    Ok((started.elapsed(), merged))
}

/// `i mod len` as an index; `len` is never zero where this is called, and
/// a zero would map to 0 rather than divide by zero.
fn index(i: u64, len: usize) -> usize {
    usize::try_from(i % count(len).max(1)).unwrap_or(0)
}

pub(super) fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn millis(duration: Duration) -> EpochMs {
    EpochMs::try_from(duration.as_millis()).unwrap_or(EpochMs::MAX)
}

fn as_ms(n: usize) -> EpochMs {
    EpochMs::try_from(n).unwrap_or(EpochMs::MAX)
}
