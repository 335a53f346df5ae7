//! The `durability` binary as a user runs it: the real built executable in
//! a child process, on real files in temporary directories. Assertions are
//! about exit codes and what the output says, never about timing.

use std::process::Output;

use serde_json::Value;

mod support;
use support::{durability_with as durability, path_arg};

fn succeeded(output: &Output) -> bool {
    if !output.status.success() {
        eprintln!(
            "status: {}\nstdout:\n{}\nstderr:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    output.status.success()
}

fn json_of(text: &[u8]) -> Value {
    match serde_json::from_slice(text) {
        Ok(value) => value,
        Err(error) => panic!("not JSON ({error}):\n{}", String::from_utf8_lossy(text)),
    }
}

#[test]
fn help_lists_every_subcommand() {
    let output = durability(&["--help"]);
    assert!(succeeded(&output));
    let help = String::from_utf8_lossy(&output.stdout);
    for command in ["demo", "inspect", "bench"] {
        assert!(
            help.contains(command),
            "--help does not mention {command}:\n{help}"
        );
    }
}

#[test]
fn bench_help_lists_every_scenario() {
    let output = durability(&["bench", "--help"]);
    assert!(succeeded(&output));
    let help = String::from_utf8_lossy(&output.stdout);
    for scenario in ["sqlite-floor", "host-calls"] {
        assert!(
            help.contains(scenario),
            "bench --help does not mention {scenario}:\n{help}"
        );
    }
}

#[test]
fn demo_then_inspect_lists_the_mailbox_shards() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let data = dir.path().join("data");

    let demo = durability(&[
        "demo",
        "--data-dir",
        path_arg(&data),
        "--messages",
        "300",
        "--shards",
        "2",
        "--json",
    ]);
    assert!(succeeded(&demo));
    let summary = json_of(&demo.stdout);
    assert_eq!(summary["accepted"], 300);
    assert_eq!(summary["lost"], 0);

    let inspect = durability(&["inspect", path_arg(&data), "--json"]);
    assert!(succeeded(&inspect));
    let listing = json_of(&inspect.stdout);
    let objects = listing["objects"]
        .as_array()
        .unwrap_or_else(|| panic!("no objects array in {listing}"));
    let names: Vec<&str> = objects.iter().filter_map(|o| o["name"].as_str()).collect();
    assert_eq!(names, ["mailbox-0", "mailbox-1"]);
    for object in objects {
        assert_eq!(object["namespace"], "mailbox");
        assert_eq!(object["error"], Value::Null);
        assert!(object["file_bytes"].as_u64().unwrap_or(0) > 0);
        let rows = |table: &str| {
            object["tables"]
                .as_array()
                .and_then(|tables| tables.iter().find(|t| t["table"] == table))
                .and_then(|t| t["rows"].as_u64())
        };
        // Every delivery settled, and the inbox holds what was delivered.
        assert_eq!(rows("durability_fanout_deliveries"), Some(0));
        assert!(rows("mailbox_inbox").is_some_and(|n| n > 0));
        // Each capability's state, as the dashboard shows it.
        let fanout = &object["capabilities"]["fanout"];
        assert_eq!(fanout["messages"], 0, "{fanout}");
        assert!(object["capabilities"]["operations"]["by_status"]["completed"].as_u64() >= Some(1));
    }

    // The default: one row per object, few columns, no table dump.
    let table = durability(&["inspect", path_arg(&data)]);
    assert!(succeeded(&table));
    let text = String::from_utf8_lossy(&table.stdout);
    for expected in [
        "2 objects in",
        "backlog",
        "parked",
        "ops failed",
        "mailbox-0",
        "mailbox-1",
    ] {
        assert!(text.contains(expected), "lacks {expected:?}:\n{text}");
    }
    assert!(!text.contains("durability_fanout_deliveries"), "{text}");
    let lines = text.lines().filter(|l| l.contains("mailbox-")).count();
    assert_eq!(lines, 2, "one row per object:\n{text}");
    let wide = durability(&["inspect", path_arg(&data), "--wide"]);
    assert!(succeeded(&wide));
    let text = String::from_utf8_lossy(&wide.stdout);
    assert!(text.contains("durability_fanout_deliveries=0"), "{text}");
}

#[test]
fn a_second_demo_run_starts_the_next_run_on_the_same_directory() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let data = path_arg(dir.path());
    let args = [
        "demo",
        "--data-dir",
        data,
        "--messages",
        "200",
        "--shards",
        "2",
        "--json",
    ];
    let first = durability(&args);
    assert!(succeeded(&first));
    assert_eq!(json_of(&first.stdout)["run"], 1);
    let second = durability(&args);
    assert!(succeeded(&second));
    let summary = json_of(&second.stdout);
    assert_eq!(summary["run"], 2);
    assert_eq!(summary["resumed"], false);
    assert_eq!(summary["accepted"], 200);
    assert_eq!(summary["lost"], 0);
    for run in ["1", "2"] {
        assert!(
            dir.path()
                .join("runs")
                .join(run)
                .join("summary.json")
                .exists()
        );
    }
}

#[test]
fn inspect_of_a_directory_that_holds_no_data_directory_fails() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let output = durability(&["inspect", path_arg(dir.path()), "--json"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("is not a durability data directory"),
        "stderr: {stderr}"
    );
}

#[test]
fn inspect_of_a_data_directory_without_objects_lists_nothing() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    // What a host that served no object leaves behind.
    std::fs::write(dir.path().join("host.lock"), b"").unwrap_or_else(|e| panic!("{e}"));
    let output = durability(&["inspect", path_arg(dir.path()), "--json"]);
    assert!(succeeded(&output));
    assert_eq!(json_of(&output.stdout)["objects"], Value::Array(Vec::new()));
}

#[test]
fn inspect_of_a_missing_directory_fails_with_a_typed_message() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let missing = dir.path().join("no-such-dir");
    let output = durability(&["inspect", path_arg(&missing)]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("cannot list the objects of"),
        "stderr: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "stderr: {stderr}");
}

/// Runs `bench <scenario> --quick` with its JSON written to a file; checks
/// that it succeeded, that the JSON names the scenario and that each of
/// `fields` at its top level is a positive number. Returns the run's
/// output, its JSON and the JSON's measurements.
fn quick_bench(scenario: &str, fields: &[&str]) -> (Output, Value, Vec<Value>) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let json = dir.path().join("bench.json");
    let output = durability(&[
        "bench",
        scenario,
        "--quick",
        "--json",
        path_arg(&json),
        "--data-dir",
        path_arg(&dir.path().join("bench")),
    ]);
    assert!(succeeded(&output));
    let text = std::fs::read(&json).unwrap_or_else(|e| panic!("no JSON file written: {e}"));
    let result = json_of(&text);
    assert_eq!(result["scenario"], scenario);
    for field in fields {
        assert!(
            result[field].as_f64().is_some_and(|v| v > 0.0),
            "{field} is {:?}",
            result[field]
        );
    }
    let measurements = result["measurements"]
        .as_array()
        .unwrap_or_else(|| panic!("no measurements in {result}"))
        .clone();
    (output, result, measurements)
}

#[test]
fn bench_sqlite_floor_quick_writes_the_required_json_fields() {
    let (output, _, measurements) =
        quick_bench("sqlite-floor", &["ops_per_sec", "p50_us", "p99_us"]);
    let names: Vec<&str> = measurements
        .iter()
        .filter_map(|m| m["name"].as_str())
        .collect();
    for name in [
        "full/write",
        "full/enqueue",
        "full/enqueue-batch100",
        "normal/enqueue",
    ] {
        assert!(names.contains(&name), "{name} missing from {names:?}");
    }
    // The summary table goes to stdout as well.
    assert!(String::from_utf8_lossy(&output.stdout).contains("full/enqueue"));
}

#[test]
fn bench_operations_quick_writes_the_headline_and_cpu_per_operation() {
    let (_, result, measurements) = quick_bench(
        "operations",
        &["ops_per_sec", "floor_ratio", "p50_us", "p99_us"],
    );
    assert_eq!(result["headline"], "default/10-objects/64-callers");
    let end_to_end: Vec<&Value> = measurements
        .iter()
        .filter(|m| m["name"].as_str().is_some_and(|n| n.ends_with("-callers")))
        .collect();
    // Five modes (the default, its per-WAL flush, FULL, NORMAL, the
    // default with an archive), two placements, two caller counts; then
    // one paired round of the archive's cost (default, default-archived).
    assert_eq!(end_to_end.len(), 22, "{result}");
    // The archive's cost from paired rounds (one in a quick run).
    for key in [
        "archive_cost_percent",
        "archive_cost_min_percent",
        "archive_cost_max_percent",
    ] {
        assert!(result["figures"][key].is_number(), "{key}: {result}");
    }
    for m in end_to_end {
        let (total, user, sys) = (
            m["cpu_us_per_op"].as_f64(),
            m["cpu_user_us_per_op"].as_f64(),
            m["cpu_sys_us_per_op"].as_f64(),
        );
        assert!(total.is_some_and(|t| t > 0.0), "{m}");
        if let (Some(total), Some(user), Some(sys)) = (total, user, sys) {
            assert!((user + sys - total).abs() <= 0.2, "{m}");
        } else {
            panic!("no CPU split in {m}");
        }
    }
}

#[test]
fn bench_rejects_an_unknown_scenario() {
    let output = durability(&["bench", "no-such-scenario"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("sqlite-floor"),
        "stderr should list the scenarios: {stderr}"
    );
}
