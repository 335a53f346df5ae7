//! `backup`: objects/s and MB/s of `Host::backup` of N objects (10,000;
//! 300 with `--quick`) while the host serves them, against a floor of the
//! same copies made with SQLite's online backup API in a bare loop.
//!
//! Set-up: N objects, each with [`ROWS_PER_OBJECT`] rows of about 100
//! bytes, then a host (the default mode) started on the directory. Two
//! backups are timed, each into a new directory:
//! - `backup/idle-host`: the host serves but nothing calls it;
//! - `backup/while-writing`: 16 callers keep writing one row per call to
//!   the objects during the whole backup (their calls/s is reported).
//!
//! Each backup is checked with `verify` afterwards (not timed), and the
//! idle one is then restored into a new directory (`restore/all`, timed:
//! verification, writes, syncs and the alarm index; no floor). The floor,
//! `raw/backup-api`, opens every object file read-only and copies it with
//! `rusqlite::backup` into a fresh file on one thread: no checksum, no
//! sync, no manifest, no temporary name. Last, `restore/at-a-moment`:
//! a host archiving the directory (`HostBuilder::archive`, `file://`)
//! writes one row to every object once its base exists and stops; the
//! archive is restored at the moment after the last write
//! (`archive::restore_at`: the base, every pass replayed, syncs, the
//! alarm index), timed. The backup itself hashes each
//! copy, syncs each file and directory and copies on up to 4 threads, so
//! its ratio can be below or above 1. The files are in the page cache.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use durability_host::{Host, ObjectContext, Synchronous};
use durability_platform::{Context, StorageError, StorageExt, params};
use rusqlite::{Connection, OpenFlags};

use super::host_calls::count;
use super::{BenchEnv, BenchError, Figure, Latency, Measurement, ScenarioReport, set_up_objects};

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "backup";

const NAMESPACE: &str = "kept";

/// Rows each object holds before the backup: a few pages of data.
const ROWS_PER_OBJECT: usize = 20;

/// The host's live-object cap while it is backed up: 4 descriptors each
/// fit the usual limit of 20,000 (see [`backups`]).
const MAX_LIVE_OBJECTS: usize = 4_000;

/// Callers writing during `backup/while-writing`.
const WRITERS: usize = 16;

/// An object with one table of rows.
struct Kept(ObjectContext);

impl durability_host::DurableObject for Kept {}

fn factory(ctx: ObjectContext) -> Result<Kept, durability_host::BoxError> {
    ctx.storage().execute_script(
        "CREATE TABLE IF NOT EXISTS kept (id INTEGER PRIMARY KEY, value TEXT NOT NULL)",
    )?;
    Ok(Kept(ctx))
}

/// Runs the `backup` scenario.
pub fn run(env: &BenchEnv) -> Result<ScenarioReport, BenchError> {
    let objects = env.size(10_000, 300);
    let dir = env.subdir("backup-data")?;
    let out = env.subdir("backup-copies")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| BenchError::Runtime { source })?;
    runtime.block_on(set_up(env, &dir, objects))?;

    // The set-up's writes reach the disk now, so that the first
    // measurement's sync does not pay for them.
    write_back()?;
    let floor_elapsed = raw_backup(&dir, &out.join("raw"))?;
    write_back()?;
    let (idle, writing, calls) = runtime.block_on(backups(&dir, &out, objects))?;
    write_back()?;
    let restore = timed_restore(&out.join("idle"), &out.join("restored"), objects)?;
    let archive = out.join("archive");
    let at = runtime.block_on(archived_run(&dir, &archive, objects))?;
    write_back()?;
    let started = Instant::now();
    let pitr = durability_host::archive::restore_at(&archive, out.join("restored-at"), at)
        .map_err(|error| BenchError::Archive {
            message: error.to_string(),
        })?;
    let pitr_elapsed = started.elapsed();
    if pitr.objects != count(objects) {
        return Err(BenchError::Task {
            message: format!(
                "the restore at a moment wrote {} of {objects} objects",
                pitr.objects
            ),
        });
    }

    let floor = Measurement::new(
        "raw/backup-api",
        "rusqlite::backup of each object file into a new file, one thread, no hash or sync",
        count(objects),
        floor_elapsed,
        &Latency::new()?,
    );
    let mut report = ScenarioReport {
        scenario: NAME,
        quick: env.quick(),
        headline: "backup/while-writing".into(),
        measurements: Vec::new(),
        figures: Vec::new(),
        notes: vec![
            format!(
                "{objects} objects of {ROWS_PER_OBJECT} rows each; one op is one object copied; the host runs in the default mode"
            ),
            "÷ floor: objects/s divided by raw/backup-api (one thread, SQLite's backup API, no SHA-256, no sync, no manifest)".into(),
            format!("while-writing: {WRITERS} callers write one row per call during the backup"),
            "files are in the page cache (just written); a cold cache costs more".into(),
        ],
    };
    // The floor copies the same files, so it moves the same bytes.
    let floor_bytes = idle.1;
    report.measurements.push(
        floor
            .clone()
            .with("mb_per_sec", megabytes_per_sec(floor_bytes, floor_elapsed)),
    );
    for ((elapsed, bytes), name, what, keys) in [
        (
            idle,
            "backup/idle-host",
            "Host::backup while the host serves, nothing calling",
            ("idle_objects_per_sec", "idle_mb_per_sec", "idle"),
        ),
        (
            writing,
            "backup/while-writing",
            "Host::backup while 16 callers write",
            (
                "writing_objects_per_sec",
                "writing_mb_per_sec",
                "while writing",
            ),
        ),
    ] {
        let mb_per_sec = megabytes_per_sec(bytes, elapsed);
        let mut measurement =
            Measurement::new(name, what, count(objects), elapsed, &Latency::new()?)
                .with("bytes", bytes)
                .with("mb_per_sec", mb_per_sec);
        measurement.compare_with_floor(&floor);
        report.figures.push(Figure {
            key: keys.0,
            label: format!("backup objects/s ({})", keys.2),
            value: measurement.ops_per_sec(),
            unit: "objects/s",
        });
        report.figures.push(Figure {
            key: keys.1,
            label: format!("backup MB/s ({})", keys.2),
            value: mb_per_sec,
            unit: "MB/s",
        });
        report.measurements.push(measurement);
    }
    report.figures.push(Figure {
        key: "writer_calls_per_sec",
        label: "writers' calls/s during the backup".into(),
        value: calls,
        unit: "calls/s",
    });
    report.measurements.push(
        Measurement::new(
            "restore/all",
            "restore of the idle backup into a new data directory (verify, write, sync, alarm index)",
            count(objects),
            restore,
            &Latency::new()?,
        )
        .with("mb_per_sec", megabytes_per_sec(floor_bytes, restore)),
    );
    report.figures.push(Figure {
        key: "restore_s",
        label: format!("restore of {objects} objects"),
        value: restore.as_secs_f64(),
        unit: "s",
    });
    report.measurements.push(
        Measurement::new(
            "restore/at-a-moment",
            "archive::restore_at of an archive (a base of every object, then one committed row per object shipped as journal passes) at the moment after the last write: base restore, replay of every pass, syncs, alarm index",
            count(objects),
            pitr_elapsed,
            &Latency::new()?,
        )
        .with("passes", pitr.passes)
        .with("transactions", pitr.transactions)
        .with("chunks", pitr.chunks),
    );
    report.figures.push(Figure {
        key: "restore_at_s",
        label: format!("point-in-time restore of {objects} objects"),
        value: pitr_elapsed.as_secs_f64(),
        unit: "s",
    });
    Ok(report)
}

/// Times a restore of `backup` into the new directory `into`, and checks
/// it wrote every object.
fn timed_restore(backup: &Path, into: &Path, objects: usize) -> Result<Duration, BenchError> {
    let started = Instant::now();
    let report =
        durability_host::backup::restore(backup, into, &durability_host::backup::Restore::all())?;
    let elapsed = started.elapsed();
    if report.objects != count(objects) {
        return Err(BenchError::Task {
            message: format!("the restore wrote {} of {objects} objects", report.objects),
        });
    }
    Ok(elapsed)
}

fn megabytes_per_sec(bytes: u64, elapsed: Duration) -> f64 {
    let seconds = elapsed.as_secs_f64();
    if seconds > 0.0 {
        bytes as f64 / 1_000_000.0 / seconds
    } else {
        0.0
    }
}

/// Creates `objects` objects with their rows (synchronous NORMAL: the
/// set-up is not what is measured), then stops the host.
async fn set_up(env: &BenchEnv, dir: &Path, objects: usize) -> Result<(), BenchError> {
    let host = Host::builder(dir)
        .synchronous(Synchronous::Normal)
        .build()?;
    let ns = host.namespace(NAMESPACE, factory)?;
    let bar = env.progress("set-up/objects", count(objects));
    let outcome = set_up_objects(
        &host,
        &ns,
        objects,
        &bar,
        |i| format!("kept-{i}"),
        |i| {
            move |o: std::rc::Rc<Kept>| async move {
                o.0.storage()
                    .transaction_sync(|txn| -> Result<(), StorageError> {
                        for row in 0..ROWS_PER_OBJECT {
                            txn.execute(
                                "INSERT INTO kept (value) VALUES (?1)",
                                &params![format!("{i:08}-{row:04}-{}", "x".repeat(80))],
                            )?;
                        }
                        Ok(())
                    })
            }
        },
    )
    .await;
    bar.finish_and_clear();
    host.shutdown().await;
    outcome
}

/// Starts a host on `dir` and times two backups: one with nothing
/// calling, one while [`WRITERS`] callers write. Returns each one's time
/// and bytes, and the writers' calls/s.
async fn backups(
    dir: &Path,
    out: &Path,
    objects: usize,
) -> Result<((Duration, u64), (Duration, u64), f64), BenchError> {
    // A copy read in the process of a host that has the object open keeps
    // its descriptor until the host closes the object (SQLite defers the
    // close while the host holds the file's lock): four descriptors per
    // live object, not the three the default cap counts on. The cap here
    // leaves room for that (see docs/operating.md).
    let host = Host::builder(dir)
        .max_live_objects(MAX_LIVE_OBJECTS)
        .build()?;
    let ns = host.namespace(NAMESPACE, factory)?;
    let outcome = async {
        let idle = timed_backup(&host, &out.join("idle")).await?;
        write_back()?;
        let stop = Arc::new(AtomicBool::new(false));
        let calls = Arc::new(AtomicU64::new(0));
        let mut writers = tokio::task::JoinSet::new();
        for w in 0..WRITERS {
            let (ns, stop, calls) = (ns.clone(), Arc::clone(&stop), Arc::clone(&calls));
            writers.spawn(async move {
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    let stub = ns.stub(&format!("kept-{}", i % objects))?;
                    stub.call(|o: std::rc::Rc<Kept>| async move {
                        o.0.storage()
                            .execute("INSERT INTO kept (value) VALUES ('during')", &[])
                    })
                    .await??;
                    calls.fetch_add(1, Ordering::Relaxed);
                    i += WRITERS;
                }
                Ok::<(), BenchError>(())
            });
        }
        let started = Instant::now();
        let writing = timed_backup(&host, &out.join("writing")).await;
        let writer_seconds = started.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        while let Some(joined) = writers.join_next().await {
            joined.map_err(|e| BenchError::Task {
                message: e.to_string(),
            })??;
        }
        let writing = writing?;
        let calls_per_sec = calls.load(Ordering::Relaxed) as f64 / writer_seconds.max(1e-9);
        Ok::<_, BenchError>((idle, writing, calls_per_sec))
    }
    .await;
    host.shutdown().await;
    outcome
}

/// Starts a host archiving `dir` to `archive`, waits for its base, writes
/// one row to every object, stops it; returns a moment after the last
/// write (every one of them then lies before it).
async fn archived_run(dir: &Path, archive: &Path, objects: usize) -> Result<i64, BenchError> {
    let config =
        durability_host::archive::ArchiveConfig::new(&format!("file://{}", archive.display()))
            .map_err(|error| BenchError::Archive {
                message: error.to_string(),
            })?;
    let host = Host::builder(dir)
        .max_live_objects(MAX_LIVE_OBJECTS)
        .archive(config)
        .build()?;
    let ns = host.namespace(NAMESPACE, factory)?;
    let outcome = async {
        while !durability_host::archive::read_manifest(archive)
            .is_ok_and(|m| m.lives.iter().any(|l| !l.bases.is_empty()))
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut writers = tokio::task::JoinSet::new();
        for w in 0..WRITERS {
            let ns = ns.clone();
            writers.spawn(async move {
                for i in (w..objects).step_by(WRITERS) {
                    let stub = ns.stub(&format!("kept-{i}"))?;
                    stub.call(|o: std::rc::Rc<Kept>| async move {
                        o.0.storage()
                            .execute("INSERT INTO kept (value) VALUES ('archived')", &[])
                    })
                    .await??;
                }
                Ok::<(), BenchError>(())
            });
        }
        while let Some(joined) = writers.join_next().await {
            joined.map_err(|e| BenchError::Task {
                message: e.to_string(),
            })??;
        }
        Ok::<_, BenchError>(())
    }
    .await;
    let written = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    host.shutdown().await;
    outcome.map(|()| written)
}

/// Writes every dirty page of the machine back (`sync`), so that each
/// measurement starts from the same state of the disk.
fn write_back() -> Result<(), BenchError> {
    std::process::Command::new("sync")
        .status()
        .map(|_| ())
        .map_err(|source| BenchError::Io {
            what: "cannot run",
            path: "sync".into(),
            source,
        })
}

/// Times one `Host::backup` into `dest`, then verifies it (untimed).
async fn timed_backup(host: &Host, dest: &Path) -> Result<(Duration, u64), BenchError> {
    let started = Instant::now();
    let report = host.backup(dest).await?;
    let elapsed = started.elapsed();
    durability_host::backup::verify(dest)?;
    Ok((elapsed, report.bytes))
}

/// The floor: every object file copied with SQLite's backup API on one
/// thread, into fresh files under `out`.
fn raw_backup(dir: &Path, out: &Path) -> Result<Duration, BenchError> {
    let started = Instant::now();
    let objects = dir.join("objects");
    let sqlite = |what: &'static str| move |source| BenchError::Sqlite { what, source };
    let io = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| BenchError::Io { what, path, source }
    };
    std::fs::create_dir_all(out).map_err(io("cannot create", out))?;
    let mut n = 0u64;
    for shard in std::fs::read_dir(&objects).map_err(io("cannot list", &objects))? {
        let shard = shard.map_err(io("cannot list", &objects))?.path();
        for file in std::fs::read_dir(&shard).map_err(io("cannot list", &shard))? {
            let path = file.map_err(io("cannot list", &shard))?.path();
            if path.extension().is_none_or(|e| e != "sqlite") {
                continue;
            }
            let from = Connection::open_with_flags(
                &path,
                OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )
            .map_err(sqlite("cannot open an object file"))?;
            let mut to = Connection::open(out.join(format!("{n}.sqlite")))
                .map_err(sqlite("cannot create a copy"))?;
            // As the backup writes its copies: no journal, no sync.
            to.pragma_update(None, "journal_mode", "OFF")
                .and_then(|()| to.pragma_update(None, "synchronous", "OFF"))
                .map_err(sqlite("cannot set up a copy"))?;
            rusqlite::backup::Backup::new(&from, &mut to)
                .and_then(|backup| backup.step(-1).map(|_| ()))
                .map_err(sqlite("cannot copy an object file"))?;
            n += 1;
        }
    }
    Ok(started.elapsed())
}
