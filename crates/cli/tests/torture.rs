//! `durability torture` as CI runs it: the built binary supervising real
//! child processes that it kills with SIGKILL, on real files in temporary
//! directories. Assertions are about the verdict and the exit code, never
//! about timing.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn durability(args: &[&str]) -> Output {
    match Command::new(env!("CARGO_BIN_EXE_durability"))
        .args(args)
        .output()
    {
        Ok(output) => output,
        Err(error) => panic!("cannot run the durability binary: {error}"),
    }
}

fn show(output: &Output) -> String {
    format!(
        "status: {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn json_of(output: &Output) -> Value {
    match serde_json::from_slice(&output.stdout) {
        Ok(value) => value,
        Err(error) => panic!("stdout is not one JSON object ({error}):\n{}", show(output)),
    }
}

fn path_arg(path: &Path) -> &str {
    path.to_str()
        .unwrap_or_else(|| panic!("temporary path is not UTF-8: {}", path.display()))
}

fn field(verdict: &Value, name: &str) -> u64 {
    verdict[name]
        .as_u64()
        .unwrap_or_else(|| panic!("verdict field {name} is not a count: {verdict:#}"))
}

fn torture(dir: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "torture",
        "--seed",
        "1",
        "--json",
        "--data-dir",
        path_arg(dir),
    ];
    args.extend_from_slice(extra);
    durability(&args)
}

#[test]
fn a_short_torture_of_every_workload_holds_every_guarantee() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let output = torture(dir.path(), &["--workload", "all", "--kills", "3"]);
    assert!(output.status.success(), "{}", show(&output));
    let verdict = json_of(&output);
    assert_eq!(verdict["verdict"], "pass", "{verdict:#}");
    for zero in ["lost", "over_attempts", "stale_settlements", "violations"] {
        assert_eq!(field(&verdict, zero), 0, "{zero}: {verdict:#}");
    }
    let workloads = verdict["workloads"]
        .as_object()
        .unwrap_or_else(|| panic!("no workloads: {verdict:#}"));
    for name in ["operations", "alarms", "log", "fanout", "recurring"] {
        assert!(
            workloads.contains_key(name),
            "{name} did not run: {verdict:#}"
        );
    }
    for (name, report) in workloads {
        assert_eq!(field(report, "kills"), 3, "{name}: {report:#}");
        assert!(field(report, "accepted") > 0, "{name}: {report:#}");
        assert_eq!(
            field(report, "completed"),
            field(report, "accepted"),
            "{name}: {report:#}"
        );
    }
    let workload_count = u64::try_from(workloads.len()).unwrap_or(u64::MAX);
    assert_eq!(field(&verdict, "kills"), 3 * workload_count);
}

/// The real checker, on the files of a real run: an accepted operation that
/// never reached its end is found, counted as lost, and fails the command.
#[test]
fn the_checker_fails_a_run_whose_journal_holds_an_accepted_item_that_never_ended() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let output = torture(dir.path(), &["--workload", "operations", "--kills", "1"]);
    assert!(output.status.success(), "{}", show(&output));

    let produced = dir.path().join("operations").join("produced.jsonl");
    let mut journal = OpenOptions::new()
        .append(true)
        .open(&produced)
        .unwrap_or_else(|e| panic!("open {}: {e}", produced.display()));
    writeln!(
        journal,
        r#"{{"item":999999,"id":"op-999999","object":"nowhere","created":true}}"#
    )
    .unwrap_or_else(|e| panic!("append: {e}"));

    let output = torture(dir.path(), &["--workload", "operations", "--recheck"]);
    assert!(!output.status.success(), "{}", show(&output));
    let verdict = json_of(&output);
    assert_eq!(verdict["verdict"], "fail", "{verdict:#}");
    assert_eq!(field(&verdict, "lost"), 1, "{verdict:#}");
}

/// An attempt number above the maximum in the handlers' journal is found.
#[test]
fn the_checker_fails_a_run_whose_handlers_ran_an_attempt_above_the_maximum() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let output = torture(dir.path(), &["--workload", "alarms", "--kills", "1"]);
    assert!(output.status.success(), "{}", show(&output));

    let handled = dir.path().join("alarms").join("handled.jsonl");
    let mut journal = OpenOptions::new()
        .append(true)
        .open(&handled)
        .unwrap_or_else(|e| panic!("open {}: {e}", handled.display()));
    writeln!(
        journal,
        r#"{{"returned":null,"object":"o","key":"n-0","generation":"g","attempt":99,"life":0,"scheduled_time":0}}"#
    )
    .unwrap_or_else(|e| panic!("append: {e}"));

    let output = torture(dir.path(), &["--workload", "alarms", "--recheck"]);
    assert!(!output.status.success(), "{}", show(&output));
    assert_eq!(field(&json_of(&output), "over_attempts"), 1);
}

/// The recurring checker, on the files of a real run: a tick whose runs
/// vanish from the journal is a lost occurrence, and a tick run under a
/// second generation is a doubled one.
#[test]
fn the_recurring_checker_fails_a_lost_and_a_doubled_occurrence() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let output = torture(dir.path(), &["--workload", "recurring", "--kills", "1"]);
    assert!(output.status.success(), "{}", show(&output));
    let ticks = dir.path().join("recurring").join("ticks.jsonl");
    let original = std::fs::read_to_string(&ticks).unwrap_or_else(|e| panic!("read: {e}"));
    let facts: Vec<Value> = original
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    // The second tick the catch-up-all schedule of one object ran.
    let schedule =
        |fact: &&Value| fact["name"] == "catch-up-all" && fact["object"] == facts[0]["object"];
    let mut run: Vec<i64> = facts
        .iter()
        .filter(schedule)
        .filter_map(|f| f["tick"].as_i64())
        .collect();
    run.sort_unstable();
    run.dedup();
    assert!(run.len() >= 3, "too short a run: {run:?}");
    let victim = run[1];

    let without: Vec<&str> = original
        .lines()
        .filter(|line| {
            serde_json::from_str::<Value>(line).map_or(true, |fact| {
                !(schedule(&&fact) && fact["tick"].as_i64() == Some(victim))
            })
        })
        .collect();
    std::fs::write(&ticks, without.join("\n") + "\n").unwrap_or_else(|e| panic!("write: {e}"));
    let output = torture(dir.path(), &["--workload", "recurring", "--recheck"]);
    assert!(!output.status.success(), "{}", show(&output));
    assert_eq!(field(&json_of(&output), "lost"), 1, "{}", show(&output));

    let mut doubled = facts
        .iter()
        .find(|f| schedule(f))
        .cloned()
        .unwrap_or_default();
    doubled["generation"] = Value::from("another-generation");
    std::fs::write(&ticks, format!("{original}{doubled}\n"))
        .unwrap_or_else(|e| panic!("write: {e}"));
    let output = torture(dir.path(), &["--workload", "recurring", "--recheck"]);
    assert!(!output.status.success(), "{}", show(&output));
    let verdict = json_of(&output);
    assert_eq!(
        verdict["workloads"]["recurring"]["other_violations"]["doubled_occurrences"],
        Value::from(1),
        "{verdict:#}"
    );
}

#[test]
fn torture_refuses_to_clear_a_directory_it_did_not_make() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let foreign = dir.path().join("operations");
    std::fs::create_dir_all(&foreign).unwrap_or_else(|e| panic!("mkdir: {e}"));
    std::fs::write(foreign.join("precious.txt"), "keep me")
        .unwrap_or_else(|e| panic!("write: {e}"));
    let output = torture(dir.path(), &["--workload", "operations", "--kills", "0"]);
    assert!(!output.status.success(), "{}", show(&output));
    assert!(foreign.join("precious.txt").exists());
}
