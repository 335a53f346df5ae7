//! The log through a process death: a real child process is frozen at an
//! exact step (between the cold write, the index insert and the delete of a
//! trim; inside and right after an append's transaction) and killed with
//! SIGKILL; the parent reopens the same files and checks that every record
//! is still readable, offsets are dense, and retries neither lose nor
//! duplicate anything.
//!
//! The test binary re-runs itself as the child (`log_crash_child`, ignored
//! unless `DURABILITY_LOG_CRASH_DIR` is set). The child freezes from a
//! `tracing` layer: when the log emits the named step event (the N-th time),
//! the layer prints a marker and blocks the thread, so the kill lands
//! exactly between two steps.

mod log_support;
mod support;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use durability::Scheduler;
use durability::log::{AppendRecord, Log, Retention};
use log_support::{DirCold, read_all};
use serde_json::{Value, json};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

const DIR_ENV: &str = "DURABILITY_LOG_CRASH_DIR";
const SCENARIO_ENV: &str = "DURABILITY_LOG_CRASH_SCENARIO";
const FREEZE_EVENT_ENV: &str = "DURABILITY_LOG_CRASH_FREEZE_EVENT";
const FREEZE_AT_ENV: &str = "DURABILITY_LOG_CRASH_FREEZE_AT";
const CHILD_TEST: &str = "log_crash_child";
const FROZEN_MARK: &str = "log-crash-child frozen at ";
const COMMITTED_MARK: &str = "log-crash-child committed batch ";
/// The longest the parent waits for the child to reach its step. The child
/// gets there in milliseconds; this only bounds a broken run.
const CHILD_TIMEOUT: Duration = Duration::from_secs(20);

/// Trim scenario: 12 records, segments of 5, keep 2 hot: two passes flush
/// [0..=4] and [5..=9].
const TRIM_RECORDS: u64 = 12;
const TRIM_BATCH: u32 = 5;
/// Append scenario: keyed batches of 10.
const APPEND_BATCH: u64 = 10;

fn record(i: u64) -> AppendRecord<Value> {
    AppendRecord::keyed(format!("r-{i}"), json!({ "n": i }))
}

fn append_batch(batch: u64) -> Vec<AppendRecord<Value>> {
    (batch * APPEND_BATCH..(batch + 1) * APPEND_BATCH)
        .map(record)
        .collect()
}

fn open_log(h: &support::Harness, dir: &Path, max_batch_size: u32) -> Log<Value> {
    let scheduler = Scheduler::new(h.context()).unwrap();
    h.install(&scheduler);
    Log::<Value>::builder(&scheduler)
        .max_batch_size(max_batch_size)
        .retention(Retention::new().max_records(2))
        .cold(Rc::new(DirCold {
            dir: dir.join("cold"),
        }))
        .build()
        .unwrap()
}

/// What the parent saw of the child before it killed it.
struct ChildRun {
    frozen: bool,
    committed_batches: Vec<u64>,
}

/// Runs the child until it freezes at the `at`-th `event`, then SIGKILLs it.
fn run_child_until(dir: &Path, scenario: &str, event: &str, at: usize) -> ChildRun {
    std::fs::create_dir_all(dir.join("cold")).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            CHILD_TEST,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(DIR_ENV, dir)
        .env(SCENARIO_ENV, scenario)
        .env(FREEZE_EVENT_ENV, event)
        .env(FREEZE_AT_ENV, at.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let (lines, received) = mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines() {
            let Ok(line) = line else { break };
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut run = ChildRun {
        frozen: false,
        committed_batches: Vec::new(),
    };
    // Bounded: a child that never reaches its step fails the test instead
    // of hanging it.
    while let Ok(line) = received.recv_timeout(CHILD_TIMEOUT) {
        // The test harness may print its own text before ours on a line.
        if line.contains(FROZEN_MARK) {
            run.frozen = true;
            break;
        }
        if let Some((_, batch)) = line.split_once(COMMITTED_MARK) {
            run.committed_batches.push(batch.trim().parse().unwrap());
        }
    }
    // SIGKILL: no destructor, no flush, no rollback by the child.
    child.kill().unwrap();
    child.wait().unwrap();
    run
}

/// Reopens the child's object in this process and runs `check` on it.
async fn after_restart<F, Fut>(dir: &Path, max_batch_size: u32, check: F)
where
    F: FnOnce(Rc<support::Harness>, Log<Value>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    let dir = dir.to_path_buf();
    tokio::task::LocalSet::new()
        .run_until(async move {
            let (host, objects) = support::open_harness_host(&dir.join("host"));
            objects
                .stub("partition")
                .unwrap()
                .call(move |h: Rc<support::Harness>| async move {
                    let log = open_log(&h, &dir, max_batch_size);
                    check(h, log).await;
                })
                .await
                .unwrap();
            host.shutdown().await;
        })
        .await;
}

fn segment_index(h: &support::Harness) -> Vec<(i64, i64)> {
    h.context()
        .storage()
        .query(
            "SELECT first_offset, last_offset FROM durability_log_segments ORDER BY first_offset",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| (row.get(0).unwrap(), row.get(1).unwrap()))
        .collect()
}

fn cold_files(dir: &Path) -> usize {
    std::fs::read_dir(dir.join("cold"))
        .unwrap()
        .filter(|entry| {
            let name = entry.as_ref().unwrap().file_name();
            !name.to_string_lossy().ends_with(".tmp")
        })
        .count()
}

/// Every record from 0 is readable with its own body, hot or cold.
async fn assert_everything_readable(log: &Log<Value>, next: u64) {
    assert_eq!(
        read_all(log, 0).await.unwrap(),
        (0..next).collect::<Vec<_>>()
    );
    let mut at = 0;
    while at < next {
        let page = log.read_from(at).await.unwrap();
        for r in &page.records {
            assert_eq!(r.body, json!({ "n": r.offset }));
            assert_eq!(r.key, format!("r-{}", r.offset));
        }
        at = page.next_offset;
    }
}

/// Offsets in the hot table form one dense run ending at the next offset.
fn assert_hot_dense(h: &support::Harness, log_next: u64) {
    let offsets: Vec<i64> = h
        .context()
        .storage()
        .query(
            "SELECT \"offset\" FROM durability_log_records ORDER BY \"offset\"",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0).unwrap())
        .collect();
    if let Some(&first) = offsets.first() {
        let expected: Vec<i64> = (first..log_next as i64).collect();
        assert_eq!(offsets, expected);
    }
}

// -------------------------------------------------------------------- trims

#[tokio::test(start_paused = true)]
async fn a_crash_after_the_segment_write_leaves_its_records_hot_and_the_next_trim_rewrites_it() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_child_until(dir.path(), "trim", "durability.log.segment_written", 2);
    assert!(run.frozen, "the child never reached the step");
    let path = dir.path().to_path_buf();
    after_restart(dir.path(), TRIM_BATCH, move |h, log| async move {
        // The second segment is written but not indexed: its records are hot.
        assert_eq!(cold_files(&path), 2);
        assert_eq!(segment_index(&h), [(0, 4)]);
        let b = log.bounds().await.unwrap();
        assert_eq!((b.oldest_offset, b.hot_offset, b.next_offset), (0, 5, 12));
        assert_hot_dense(&h, 12);
        assert_everything_readable(&log, TRIM_RECORDS).await;
        // The retried trim writes it again (harmless) and finishes.
        assert_eq!(log.trim().await.unwrap(), 5);
        assert_eq!(segment_index(&h), [(0, 4), (5, 9)]);
        assert_eq!(cold_files(&path), 2);
        assert_everything_readable(&log, TRIM_RECORDS).await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_crash_after_the_index_insert_keeps_reads_hot_and_the_next_trim_upserts_the_index() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_child_until(dir.path(), "trim", "durability.log.segment_indexed", 2);
    assert!(run.frozen, "the child never reached the step");
    after_restart(dir.path(), TRIM_BATCH, |h, log| async move {
        // Indexed and still hot: the segment overlaps the hot table.
        assert_eq!(segment_index(&h), [(0, 4), (5, 9)]);
        let b = log.bounds().await.unwrap();
        assert_eq!((b.oldest_offset, b.hot_offset, b.next_offset), (0, 5, 12));
        assert_hot_dense(&h, 12);
        assert_everything_readable(&log, TRIM_RECORDS).await;
        assert_eq!(log.trim().await.unwrap(), 5);
        assert_eq!(segment_index(&h), [(0, 4), (5, 9)]);
        let b = log.bounds().await.unwrap();
        assert_eq!((b.oldest_offset, b.hot_offset, b.next_offset), (0, 10, 12));
        assert_everything_readable(&log, TRIM_RECORDS).await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_crash_after_the_delete_leaves_a_consistent_log() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_child_until(dir.path(), "trim", "durability.log.trimmed", 1);
    assert!(run.frozen, "the child never reached the step");
    after_restart(dir.path(), TRIM_BATCH, |h, log| async move {
        assert_eq!(segment_index(&h), [(0, 4)]);
        let b = log.bounds().await.unwrap();
        assert_eq!((b.oldest_offset, b.hot_offset, b.next_offset), (0, 5, 12));
        assert_everything_readable(&log, TRIM_RECORDS).await;
        assert_eq!(log.trim().await.unwrap(), 5);
        assert_everything_readable(&log, TRIM_RECORDS).await;
    })
    .await;
}

// ------------------------------------------------------------------ appends

#[tokio::test(start_paused = true)]
async fn a_crash_inside_an_append_batch_keeps_offsets_dense_and_a_keyed_retry_appends_once() {
    let dir = tempfile::tempdir().unwrap();
    // Frozen inside the fifth batch's transaction, rows written, not committed.
    let run = run_child_until(dir.path(), "append", "durability.log.appending", 5);
    assert!(run.frozen, "the child never reached the step");
    assert_eq!(run.committed_batches, [0, 1, 2, 3]);
    after_restart(dir.path(), APPEND_BATCH as u32, |h, log| async move {
        // Nothing of the interrupted batch exists.
        assert_eq!(log.bounds().await.unwrap().next_offset, 40);
        assert_hot_dense(&h, 40);
        // Retrying a committed batch returns its offsets; the interrupted
        // one appends once, right after them.
        let retried = log.append(append_batch(3)).await.unwrap();
        assert_eq!(retried.offsets().unwrap(), (30..40).collect::<Vec<_>>());
        let resumed = log.append(append_batch(4)).await.unwrap();
        assert_eq!(resumed.offsets().unwrap(), (40..50).collect::<Vec<_>>());
        let again = log.append(append_batch(4)).await.unwrap();
        assert_eq!(again.offsets(), resumed.offsets());
        assert_eq!(log.bounds().await.unwrap().next_offset, 50);
        assert_hot_dense(&h, 50);
        assert_everything_readable(&log, 50).await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_crash_after_an_append_commits_makes_a_keyed_retry_return_the_original_offsets() {
    let dir = tempfile::tempdir().unwrap();
    // Frozen after the fifth batch committed, before its caller heard back.
    let run = run_child_until(dir.path(), "append", "durability.log.appended", 5);
    assert!(run.frozen, "the child never reached the step");
    assert_eq!(run.committed_batches, [0, 1, 2, 3]);
    after_restart(dir.path(), APPEND_BATCH as u32, |h, log| async move {
        assert_eq!(log.bounds().await.unwrap().next_offset, 50);
        let retried = log.append(append_batch(4)).await.unwrap();
        assert_eq!(retried.offsets().unwrap(), (40..50).collect::<Vec<_>>());
        assert_eq!(log.bounds().await.unwrap().next_offset, 50);
        let distinct_keys = support::query_i64(
            &*h.context(),
            "SELECT COUNT(DISTINCT dedup_key) FROM durability_log_records",
            &[],
        );
        assert_eq!(distinct_keys, 50);
        assert_hot_dense(&h, 50);
        assert_everything_readable(&log, 50).await;
    })
    .await;
}

// -------------------------------------------------------------------- child

/// Blocks the thread forever at the `at`-th occurrence of one step event.
struct Freeze {
    event: String,
    at: usize,
    seen: AtomicUsize,
}

struct EventField(Option<String>);

impl Visit for EventField {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "event" {
            self.0 = Some(value.to_owned());
        }
    }

    fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Freeze {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let mut name = EventField(None);
        event.record(&mut name);
        if name.0.as_deref() != Some(self.event.as_str()) {
            return;
        }
        if self.seen.fetch_add(1, Ordering::SeqCst) + 1 != self.at {
            return;
        }
        println!("{FROZEN_MARK}{}", self.event);
        let _ = std::io::stdout().flush();
        loop {
            std::thread::sleep(Duration::from_secs(3_600));
        }
    }
}

#[tokio::test]
#[ignore = "the child half of the log crash tests"]
async fn log_crash_child() {
    let Some(dir) = std::env::var_os(DIR_ENV) else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let scenario = std::env::var(SCENARIO_ENV).unwrap();
    tracing_subscriber::registry()
        .with(Freeze {
            event: std::env::var(FREEZE_EVENT_ENV).unwrap(),
            at: std::env::var(FREEZE_AT_ENV).unwrap().parse().unwrap(),
            seen: AtomicUsize::new(0),
        })
        .init();
    tokio::task::LocalSet::new()
        .run_until(async move {
            let (host, objects) = support::open_harness_host(&dir.join("host"));
            objects
                .stub("partition")
                .unwrap()
                .call(move |h: Rc<support::Harness>| async move {
                    let max_batch_size = match scenario.as_str() {
                        "trim" => TRIM_BATCH,
                        _ => APPEND_BATCH as u32,
                    };
                    let log = open_log(&h, &dir, max_batch_size);
                    match scenario.as_str() {
                        "trim" => {
                            let all: Vec<_> = (0..TRIM_RECORDS).map(record).collect();
                            for chunk in all.chunks(TRIM_BATCH as usize) {
                                log.append(chunk.to_vec()).await.unwrap();
                            }
                            log.trim().await.unwrap();
                        }
                        "append" => {
                            for batch in 0..100 {
                                log.append(append_batch(batch)).await.unwrap();
                                println!("{COMMITTED_MARK}{batch}");
                            }
                        }
                        other => panic!("unknown scenario {other}"),
                    }
                })
                .await
                .unwrap();
            host.shutdown().await;
        })
        .await;
}
