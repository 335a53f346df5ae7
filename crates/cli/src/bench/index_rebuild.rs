//! `index-rebuild`: how long a host takes to start when its alarm index
//! (`index.sqlite`) must be rebuilt from the object files.
//!
//! Sets up N objects (10,000; 300 with `--quick`), each with an armed alarm
//! an hour ahead, then starts a host on the directory several times and
//! times `HostBuilder::build` (the host is usable when it returns):
//! - with a sound index (no rebuild: the start-up cost without one);
//! - with the index deleted (rebuilt: every object file is read);
//! - with garbage in `index.sqlite` (moved aside, then rebuilt).
//!
//! The floor is raw rusqlite reading the same alarm row from every object
//! file on one thread, measured in the same run: the rebuild reads on up to
//! one thread per core, so its ratio can exceed 1. Every start checks that
//! each armed alarm is back in the index. The files are in the page cache
//! (they were just written): a cold cache after a reboot costs more.

use std::path::Path;
use std::time::{Duration, Instant};

use durability_host::{Host, INDEX_FILE, IndexRebuild, ObjectContext, RebuildReason, Synchronous};
use durability_platform::{Context, EpochMs};
use rusqlite::{Connection, OpenFlags, OptionalExtension};

use super::host_calls::count;
use super::{BenchEnv, BenchError, Figure, Latency, Measurement, ScenarioReport, set_up_objects};

/// The scenario's name on the command line and in the JSON.
pub const NAME: &str = "index-rebuild";

const NAMESPACE: &str = "sleeper";

/// How far ahead each object's alarm is: it never fires during the run.
const ALARM_AHEAD_MS: EpochMs = 3_600_000;

/// Each start is timed this many times; the median is reported.
const ROUNDS: usize = 3;

/// An object that only holds its alarm.
struct Sleeper(ObjectContext);

impl durability_host::DurableObject for Sleeper {}

/// Runs the `index-rebuild` scenario.
pub fn run(env: &BenchEnv) -> Result<ScenarioReport, BenchError> {
    let objects = env.size(10_000, 300);
    let dir = env.subdir("index-rebuild")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| BenchError::Runtime { source })?;
    runtime.block_on(set_up(env, &dir, objects))?;

    let mut report = ScenarioReport {
        scenario: NAME,
        quick: env.quick(),
        headline: "start/index-deleted".into(),
        measurements: Vec::new(),
        figures: Vec::new(),
        notes: vec![
            format!(
                "{objects} objects, each with an armed alarm; one op is one object file; median of {ROUNDS} starts"
            ),
            "÷ floor: objects/s of the start divided by raw/read-alarms (one thread reading each file's alarm row); the rebuild reads on one thread per core".into(),
            "files are in the page cache (just written); a cold cache costs more".into(),
        ],
    };

    let floor = Measurement::new(
        "raw/read-alarms",
        "rusqlite: open read-only, read the alarm row, close",
        count(objects),
        median_of(ROUNDS, || raw_read(&dir))?,
        &Latency::new()?,
    );

    let sound = median_of(ROUNDS, || runtime.block_on(start(&dir, objects, None)))?;
    let deleted = median_of(ROUNDS, || {
        remove_index(&dir)?;
        runtime.block_on(start(&dir, objects, Some(RebuildReason::Missing)))
    })?;
    let garbage = median_of(ROUNDS, || {
        remove_index(&dir)?;
        std::fs::write(dir.join(INDEX_FILE), vec![0x5a_u8; 64 * 1024]).map_err(|source| {
            BenchError::Io {
                what: "cannot write garbage into",
                path: dir.join(INDEX_FILE),
                source,
            }
        })?;
        runtime.block_on(start(&dir, objects, Some(RebuildReason::Corrupt)))
    })?;
    let unclean = median_of(ROUNDS, || {
        mark_unclean_on_another_boot(&dir)?;
        runtime.block_on(start(&dir, objects, Some(RebuildReason::UncleanReboot)))
    })?;

    for (name, what, elapsed, key, label) in [
        (
            "start/index-sound",
            "HostBuilder::build with a sound index",
            sound,
            "start_sound_index_s",
            "start with a sound index",
        ),
        (
            "start/index-deleted",
            "HostBuilder::build rebuilding a deleted index",
            deleted,
            "start_rebuild_deleted_index_s",
            "start rebuilding a deleted index",
        ),
        (
            "start/index-garbage",
            "HostBuilder::build rebuilding an index full of garbage",
            garbage,
            "start_rebuild_garbage_index_s",
            "start rebuilding a garbage index",
        ),
        (
            "start/unclean-reboot",
            "HostBuilder::build after a group-commit run that did not stop cleanly, on another boot",
            unclean,
            "start_rebuild_unclean_reboot_s",
            "start rebuilding after an unclean stop and a reboot",
        ),
    ] {
        let mut measurement =
            Measurement::new(name, what, count(objects), elapsed, &Latency::new()?);
        measurement.compare_with_floor(&floor);
        report.measurements.push(measurement);
        report.figures.push(Figure {
            key,
            label: format!("{label} ({objects} objects)"),
            value: elapsed.as_secs_f64(),
            unit: "s",
        });
    }
    report.measurements.insert(0, floor);
    Ok(report)
}

/// Creates `objects` objects with an alarm each (synchronous NORMAL: the
/// set-up is not what is measured).
async fn set_up(env: &BenchEnv, dir: &Path, objects: usize) -> Result<(), BenchError> {
    let host = Host::builder(dir)
        .synchronous(Synchronous::Normal)
        .build()?;
    let ns = host.namespace(NAMESPACE, |ctx| Ok(Sleeper(ctx)))?;
    let bar = env.progress("set-up/objects", count(objects));
    let at_ms = host.now_ms() + ALARM_AHEAD_MS;
    let outcome = set_up_objects(
        &host,
        &ns,
        objects,
        &bar,
        |i| format!("sleeper-{i}"),
        |_| move |o: std::rc::Rc<Sleeper>| async move { o.0.storage().set_alarm(at_ms).await },
    )
    .await;
    bar.finish_and_clear();
    host.shutdown().await;
    outcome
}

/// Starts a host on `dir`, times its build, checks that the rebuild (or
/// none) is the expected one and found every alarm, and shuts it down.
async fn start(
    dir: &Path,
    objects: usize,
    expected: Option<RebuildReason>,
) -> Result<Duration, BenchError> {
    let started = Instant::now();
    let host = Host::builder(dir).build()?;
    let elapsed = started.elapsed();
    let rebuild: Option<IndexRebuild> = host.index_rebuild().cloned();
    host.shutdown().await;
    let found = rebuild.as_ref().map(|r| (r.reason, r.alarms));
    let wanted = expected.map(|reason| (reason, count(objects)));
    if found != wanted {
        return Err(BenchError::Task {
            message: format!("the start rebuilt {found:?}, expected {wanted:?}"),
        });
    }
    Ok(elapsed)
}

/// Leaves the index as a power loss and a reboot would: the last run
/// recorded no clean stop, on a boot that is not this one.
fn mark_unclean_on_another_boot(dir: &Path) -> Result<(), BenchError> {
    let sqlite = |source| BenchError::Sqlite {
        what: "cannot mark the index as left by an unclean stop",
        source,
    };
    let conn = Connection::open(dir.join(INDEX_FILE)).map_err(sqlite)?;
    conn.execute_batch(
        "INSERT OR REPLACE INTO host_run (key, value) VALUES ('clean', '0');
         INSERT OR REPLACE INTO host_run (key, value) VALUES ('boot_id', 'a-boot-before-the-power-loss');",
    )
    .map_err(sqlite)
}

fn remove_index(dir: &Path) -> Result<(), BenchError> {
    for suffix in ["", "-wal", "-shm", ".corrupt", ".corrupt-wal"] {
        let path = dir.join(format!("{INDEX_FILE}{suffix}"));
        match std::fs::remove_file(&path) {
            Err(source) if source.kind() != std::io::ErrorKind::NotFound => {
                return Err(BenchError::Io {
                    what: "cannot remove",
                    path,
                    source,
                });
            }
            _ => {}
        }
    }
    Ok(())
}

/// The floor: one thread opens every object file read-only and reads its
/// alarm row, as the rebuild does, without the index writes.
fn raw_read(dir: &Path) -> Result<Duration, BenchError> {
    let started = Instant::now();
    let objects = dir.join("objects");
    let sqlite = |what: &'static str| move |source| BenchError::Sqlite { what, source };
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BenchError::Io {
            what: "cannot list",
            path,
            source,
        }
    };
    for shard in std::fs::read_dir(&objects).map_err(io(&objects))? {
        let shard = shard.map_err(io(&objects))?.path();
        for file in std::fs::read_dir(&shard).map_err(io(&shard))? {
            let path = file.map_err(io(&shard))?.path();
            if path.extension().is_none_or(|e| e != "sqlite") {
                continue;
            }
            let conn = Connection::open_with_flags(
                &path,
                OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )
            .map_err(sqlite("cannot open an object file"))?;
            let _: Option<i64> = conn
                .query_row(
                    "SELECT at_ms FROM _durability_host_alarm WHERE slot = 0",
                    [],
                    |row| row.get(0),
                )
                .optional()
                .map_err(sqlite("cannot read an object's alarm"))?;
        }
    }
    Ok(started.elapsed())
}

/// The median duration of `rounds` runs of `f`.
fn median_of(
    rounds: usize,
    mut f: impl FnMut() -> Result<Duration, BenchError>,
) -> Result<Duration, BenchError> {
    let mut times = (0..rounds.max(1))
        .map(|_| f())
        .collect::<Result<Vec<_>, _>>()?;
    times.sort();
    Ok(times.get(times.len() / 2).copied().unwrap_or_default())
}
