//! `durability demo` as a user runs it: the real built binary in a child
//! process, on real files in temporary directories, interrupted with a real
//! SIGKILL or SIGINT. Assertions are about what the summary says and the
//! exit code, never about timing.
//!
//! A run is stopped mid-way deterministically: the hidden
//! `--pause-after-batches` flag makes it stop producing after a few
//! accepted batches (deliveries go on) and say so on stderr; the test reads
//! stderr until it does, then kills the process.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use serde_json::Value;

mod support;
use support::{path_arg, show};

/// What the demo prints on stderr once paused (its `PAUSED_MARKER`).
const PAUSED: &str = "demo paused by --pause-after-batches";

fn demo(dir: &Path, extra: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_durability"));
    command.args(["demo", "--data-dir", path_arg(dir), "--json"]);
    command.args(extra);
    match command.output() {
        Ok(output) => output,
        Err(error) => panic!("cannot run the durability binary: {error}"),
    }
}

fn summary_of(output: &Output) -> Value {
    assert!(output.status.success(), "{}", show(output));
    match serde_json::from_slice(&output.stdout) {
        Ok(value) => value,
        Err(error) => panic!("stdout is not one JSON object ({error}):\n{}", show(output)),
    }
}

fn count(summary: &Value, field: &str) -> u64 {
    summary[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} is not a count: {summary:#}"))
}

/// A demo process and the rest of its stderr. The pipe is kept open: a
/// process writing to a closed stderr would fail for that reason alone.
struct Paused {
    child: Child,
    stderr: std::io::Lines<BufReader<std::process::ChildStderr>>,
}

/// Starts a demo that pauses after `batches` accepted batches, and returns
/// it once it says it paused.
fn start_paused(dir: &Path, messages: &str, shards: &str, batches: &str) -> Paused {
    let mut child = Command::new(env!("CARGO_BIN_EXE_durability"))
        .args(["demo", "--data-dir", path_arg(dir), "--json"])
        .args(["--messages", messages, "--shards", shards])
        .args(["--pause-after-batches", batches])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("cannot start the durability binary: {error}"));
    let stderr = child
        .stderr
        .take()
        .unwrap_or_else(|| panic!("no stderr pipe"));
    let mut stderr = BufReader::new(stderr).lines();
    let mut seen = Vec::new();
    for line in stderr.by_ref() {
        let line = line.unwrap_or_else(|error| panic!("cannot read stderr: {error}"));
        if line.contains(PAUSED) {
            return Paused { child, stderr };
        }
        seen.push(line);
    }
    let status = child.wait();
    panic!(
        "the demo ended ({status:?}) without pausing; stderr:\n{}",
        seen.join("\n")
    );
}

#[test]
fn a_small_run_accounts_for_every_accepted_message() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let summary = summary_of(&demo(dir.path(), &["--messages", "1000", "--shards", "3"]));
    assert_eq!(count(&summary, "accepted"), 1_000);
    assert_eq!(count(&summary, "lost"), 0);
    assert_eq!(count(&summary, "owed"), 0);
    assert_eq!(count(&summary, "parked"), 0);
    assert_eq!(summary["resumed"], false);
    // Every (message, target) ended: delivered or dead-lettered.
    let delivered: u64 = ["inbox", "archive"]
        .iter()
        .map(|target| {
            summary["delivered"][target]
                .as_u64()
                .unwrap_or_else(|| panic!("no delivered.{target}: {summary:#}"))
        })
        .sum();
    assert_eq!(delivered + count(&summary, "dead_lettered"), 2 * 1_000);
    // The inbox fails some messages for good, by their ids.
    assert!(count(&summary, "dead_lettered") > 0, "{summary:#}");
    assert!(count(&summary, "retries") > 0, "{summary:#}");
    assert_eq!(count(&summary, "digests_completed"), 3);
    assert!(
        summary["deliveries_per_sec"]
            .as_f64()
            .is_some_and(|rate| rate > 0.0)
    );
    for field in ["enqueue_p50_ms", "enqueue_p99_ms"] {
        assert!(summary[field].as_f64().is_some(), "{field}: {summary:#}");
    }
}

#[test]
fn a_run_killed_with_sigkill_is_finished_by_the_next_run() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let mut paused = start_paused(dir.path(), "3000", "4", "4");
    // `Child::kill` is SIGKILL on Unix: no handler, no flush, no shutdown.
    paused
        .child
        .kill()
        .unwrap_or_else(|error| panic!("cannot kill the demo: {error}"));
    let _ = paused.child.wait();
    assert!(!dir.path().join("runs/1/summary.json").exists());

    let resumed = demo(dir.path(), &["--messages", "3000", "--shards", "4"]);
    let stderr = String::from_utf8_lossy(&resumed.stderr).into_owned();
    let summary = summary_of(&resumed);
    assert_eq!(summary["resumed"], true);
    assert_eq!(summary["run"], 1);
    let before = count(&summary, "resumed_accepted");
    assert!(
        (400..3_000).contains(&before),
        "accepted before the kill: {before}"
    );
    assert_eq!(count(&summary, "accepted"), 3_000);
    assert_eq!(count(&summary, "lost"), 0);
    assert_eq!(count(&summary, "owed"), 0);
    assert!(
        stderr.contains("resuming run 1"),
        "the resumed run does not say so: {stderr}"
    );
}

#[test]
fn a_run_interrupted_with_ctrl_c_says_how_to_finish_and_the_next_run_does() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let Paused { mut child, stderr } = start_paused(dir.path(), "2000", "2", "3");
    let pid = i32::try_from(child.id()).unwrap_or_else(|e| panic!("pid: {e}"));
    // SAFETY: signals a child this test started and has not reaped.
    let sent = unsafe { libc::kill(pid, libc::SIGINT) };
    assert_eq!(sent, 0, "cannot send SIGINT");
    let rest: Vec<String> = stderr.map_while(Result::ok).collect();
    let status = child
        .wait()
        .unwrap_or_else(|error| panic!("cannot wait for the demo: {error}"));
    assert!(!status.success(), "{status}");
    let rest = rest.join("\n");
    assert!(
        rest.contains("interrupted") && rest.contains("run the same command again"),
        "{rest}"
    );

    let summary = summary_of(&demo(dir.path(), &["--messages", "2000", "--shards", "2"]));
    assert_eq!(summary["resumed"], true);
    assert_eq!(count(&summary, "accepted"), 2_000);
    assert_eq!(count(&summary, "lost"), 0);
}

#[test]
fn a_zero_message_run_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let data = dir.path().join("data");
    let output = demo(&data, &["--messages", "0"]);
    assert!(!output.status.success(), "{}", show(&output));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--messages"));
    assert!(!data.exists());
}

#[test]
fn a_second_demo_on_a_busy_directory_names_the_directory_and_the_holders_pid_and_exits_at_once() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let mut paused = start_paused(dir.path(), "2000", "2", "2");
    let holder = paused.child.id();
    // Another plan, so a resume would have had something to say about it.
    let asked = std::time::Instant::now();
    let second = demo(dir.path(), &["--messages", "500", "--shards", "3"]);
    let answered_in = asked.elapsed();
    paused
        .child
        .kill()
        .unwrap_or_else(|error| panic!("cannot kill the demo: {error}"));
    let _ = paused.child.wait();
    assert!(!second.status.success(), "{}", show(&second));
    assert_eq!(second.status.code(), Some(1), "{}", show(&second));
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("in use by another host"), "{stderr}");
    assert!(
        stderr.contains(&dir.path().display().to_string()),
        "the message does not name the directory: {stderr}"
    );
    assert!(
        stderr.contains(&format!("pid {holder}")),
        "the message does not name the holder's pid {holder}: {stderr}"
    );
    // A bound against waiting for the lock, not a measure of speed: the
    // refusal comes before any work, the first run would hold the lock for
    // as long as the test lets it live.
    assert!(
        answered_in < std::time::Duration::from_secs(30),
        "the second demo took {answered_in:?} to give up"
    );
    assert!(
        !stderr.contains("resum") && !stderr.contains("interrupted"),
        "a false resume line: {stderr}"
    );
    assert!(!dir.path().join("runs/2").exists());
}

#[test]
fn a_run_that_lost_messages_says_which_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let mut paused = start_paused(dir.path(), "1000", "1", "2");
    // Wait until the inbox has delivered (and acked) some mail.
    let inbox = dir.path().join("runs/1/inbox.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::fs::metadata(&inbox).map_or(0, |m| m.len()) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no inbox delivery within a minute"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // A journaled delivery is acked a moment later (a kill in between
    // redelivers it); the paused run has only two batches to settle.
    std::thread::sleep(std::time::Duration::from_secs(2));
    paused
        .child
        .kill()
        .unwrap_or_else(|error| panic!("cannot kill the demo: {error}"));
    let _ = paused.child.wait();
    // The proof of those deliveries is gone: the fanout acked them, so
    // nothing delivers them again, and the accounting finds no end.
    std::fs::write(&inbox, b"").unwrap_or_else(|e| panic!("{e}"));

    let resumed = demo(dir.path(), &["--messages", "1000", "--shards", "1"]);
    assert!(!resumed.status.success(), "{}", show(&resumed));
    let summary: Value = serde_json::from_slice(&resumed.stdout)
        .unwrap_or_else(|e| panic!("the summary is still printed ({e}): {}", show(&resumed)));
    let lost = count(&summary, "lost");
    assert!(lost > 0, "{summary:#}");
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(
        stderr.contains("reached no end") && stderr.contains("on inbox"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("every accepted message reached its end"),
        "{stderr}"
    );
}
