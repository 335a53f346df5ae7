//! `durability torture` as CI runs it: the built binary supervising real
//! child processes that it kills with SIGKILL, on real files in temporary
//! directories, and with `--power-cut` on the real FUSE power-cut
//! filesystem (CI runs as root with /dev/fuse; a run that cannot mount
//! fails its test). Assertions are about the verdict and the exit code,
//! never about timing.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::Path;
use std::process::Output;

use serde_json::Value;

mod support;
use support::{durability_with as durability, path_arg, show};

fn json_of(output: &Output) -> Value {
    match serde_json::from_slice(&output.stdout) {
        Ok(value) => value,
        Err(error) => panic!("stdout is not one JSON object ({error}):\n{}", show(output)),
    }
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
    assert_eq!(verdict["power_cut"], false, "{verdict:#}");
    assert_eq!(verdict["mode"], "default", "{verdict:#}");
    for zero in [
        "lost",
        "lost_allowed",
        "over_attempts",
        "over_attempts_allowed",
        "stale_settlements",
        "corrupt",
        "cuts",
        "violations",
    ] {
        assert_eq!(field(&verdict, zero), 0, "{zero}: {verdict:#}");
    }
    let workloads = verdict["workloads"]
        .as_object()
        .unwrap_or_else(|| panic!("no workloads: {verdict:#}"));
    for name in WORKLOADS {
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

/// The workloads `--workload all` runs.
const WORKLOADS: [&str; 5] = ["operations", "alarms", "log", "fanout", "recurring"];

/// Kills (each one a cut) per workload in the power-cut runs: enough for a
/// cut in production and one in retries, few enough that four modes of
/// five workloads fit in CI's budget.
const POWER_CUT_KILLS: u64 = 2;

/// A short `--power-cut` run of every workload in `mode`: the verdict
/// passes, nothing accepted is lost (`normal` excepted: its losses are
/// `lost_allowed`), no database is corrupt, and every death was a cut.
fn power_cut_torture_holds_the_guarantees_of(mode: &str) -> Value {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let kills = POWER_CUT_KILLS.to_string();
    let output = torture(
        dir.path(),
        &[
            "--power-cut",
            "--mode",
            mode,
            "--workload",
            "all",
            "--kills",
            &kills,
        ],
    );
    assert!(output.status.success(), "{mode}: {}", show(&output));
    let verdict = json_of(&output);
    assert_eq!(verdict["verdict"], "pass", "{verdict:#}");
    assert_eq!(verdict["power_cut"], true, "{verdict:#}");
    assert_eq!(verdict["mode"], mode, "{verdict:#}");
    for zero in [
        "lost",
        "over_attempts",
        "stale_settlements",
        "corrupt",
        "violations",
    ] {
        assert_eq!(field(&verdict, zero), 0, "{zero}: {verdict:#}");
    }
    if mode != "normal" {
        assert_eq!(field(&verdict, "lost_allowed"), 0, "{verdict:#}");
    }
    if mode == "full" {
        assert_eq!(field(&verdict, "over_attempts_allowed"), 0, "{verdict:#}");
    }
    let workloads = verdict["workloads"]
        .as_object()
        .unwrap_or_else(|| panic!("no workloads: {verdict:#}"));
    assert_eq!(workloads.len(), WORKLOADS.len(), "{verdict:#}");
    let mut unsynced_files = 0;
    for (name, report) in workloads {
        let detail = &report["detail"];
        // Every death is a cut; a life whose eio or enospc fault made its
        // host refuse to go on ended before its kill.
        assert_eq!(field(report, "cuts"), POWER_CUT_KILLS, "{name}: {report:#}");
        assert_eq!(
            field(report, "kills") + field(detail, "lives_ended_by_fault"),
            POWER_CUT_KILLS,
            "{name}: {report:#}"
        );
        let by_fault: u64 = report["faults"]
            .as_object()
            .unwrap_or_else(|| panic!("{name}: no faults: {report:#}"))
            .values()
            .filter_map(Value::as_u64)
            .sum();
        assert_eq!(by_fault, POWER_CUT_KILLS, "{name}: {report:#}");
        assert!(field(report, "accepted") > 0, "{name}: {report:#}");
        assert!(field(detail, "integrity_checked") > 0, "{name}: {report:#}");
        unsynced_files += field(detail, "cut_files");
    }
    // The cuts met data that was not durable yet: the filesystem is really
    // mounted under the host, and a test on a stub or a plain directory
    // cannot pass.
    assert!(
        unsynced_files > 0,
        "no cut found anything unsynced: {verdict:#}"
    );
    assert_eq!(
        field(&verdict, "cuts"),
        POWER_CUT_KILLS * u64::try_from(WORKLOADS.len()).unwrap_or(u64::MAX)
    );
    verdict
}

#[test]
fn power_cuts_in_the_default_mode_lose_nothing_a_reply_was_released_for() {
    power_cut_torture_holds_the_guarantees_of("default");
}

#[test]
fn power_cuts_in_the_default_mode_with_wal_file_syncs_lose_nothing_a_reply_was_released_for() {
    power_cut_torture_holds_the_guarantees_of("default-walfiles");
}

#[test]
fn power_cuts_in_full_mode_lose_nothing_and_run_no_attempt_twice() {
    power_cut_torture_holds_the_guarantees_of("full");
}

#[test]
fn power_cuts_in_normal_mode_lose_only_what_the_mode_table_allows() {
    power_cut_torture_holds_the_guarantees_of("normal");
}

#[test]
fn a_power_cut_run_refuses_the_syncfs_flush_it_cannot_observe() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let output = torture(
        dir.path(),
        &[
            "--power-cut",
            "--mode",
            "default-syncfs",
            "--workload",
            "operations",
            "--kills",
            "1",
        ],
    );
    assert!(!output.status.success(), "{}", show(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("syncfs") && stderr.contains("FUSE"),
        "{}",
        show(&output)
    );
    // Refused before anything ran: no run directory was made.
    assert!(!dir.path().join("operations").exists(), "{}", show(&output));
}

#[test]
fn a_kill_torture_in_full_mode_holds_every_guarantee() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let output = torture(
        dir.path(),
        &["--mode", "full", "--workload", "all", "--kills", "2"],
    );
    assert!(output.status.success(), "{}", show(&output));
    let verdict = json_of(&output);
    assert_eq!(verdict["verdict"], "pass", "{verdict:#}");
    assert_eq!(verdict["mode"], "full", "{verdict:#}");
    assert_eq!(verdict["power_cut"], false, "{verdict:#}");
    for zero in ["lost", "over_attempts", "corrupt", "cuts", "violations"] {
        assert_eq!(field(&verdict, zero), 0, "{zero}: {verdict:#}");
    }
}

/// The integrity check, on the files of a real run: an object database
/// with a damaged page is `corrupt`, and fails the command.
#[test]
fn the_checker_fails_a_run_whose_object_database_is_damaged() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let output = torture(dir.path(), &["--workload", "operations", "--kills", "1"]);
    assert!(output.status.success(), "{}", show(&output));

    let manifest = dir.path().join("operations").join("objects.json");
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(&manifest).unwrap_or_else(|e| panic!("read {}: {e}", manifest.display())),
    )
    .unwrap_or_else(|e| panic!("manifest: {e}"));
    let file = manifest["objects"]
        .as_object()
        .and_then(|objects| objects.values().next())
        .and_then(|entry| entry["file"].as_str())
        .unwrap_or_else(|| panic!("no object file in {manifest:#}"))
        .to_owned();
    let mut bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("read {file}: {e}"));
    assert!(bytes.len() > 8192, "{file} has one page only");
    // Every page after the first (the header stays, so SQLite opens it).
    for byte in bytes.iter_mut().skip(4096) {
        *byte = 0x5a;
    }
    std::fs::write(&file, bytes).unwrap_or_else(|e| panic!("write {file}: {e}"));

    let output = torture(dir.path(), &["--workload", "operations", "--recheck"]);
    assert!(!output.status.success(), "{}", show(&output));
    let verdict = json_of(&output);
    assert_eq!(verdict["verdict"], "fail", "{verdict:#}");
    assert!(field(&verdict, "corrupt") >= 1, "{verdict:#}");
}

#[test]
fn a_life_whose_host_refuses_to_start_fails_the_run_as_a_refused_start() {
    // A second holder of the data directory's lock, taken between two lives
    // (a killed life's lock is released by the kernel at once): the next
    // life's host really refuses to start, as it would after a cut that
    // left a journal it cannot replay.
    let dir = tempfile::tempdir().expect("temporary directory");
    let run_dir = dir.path().join("runs");
    let lock_path = run_dir.join("operations").join("data").join("host.lock");
    let holder = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while std::time::Instant::now() < deadline {
            if let Ok(file) = OpenOptions::new().write(true).open(&lock_path)
                && file.try_lock().is_ok()
            {
                return Some(file);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        None
    });
    let output = durability(&[
        "torture",
        "--seed",
        "3",
        "--json",
        "--workload",
        "operations",
        "--kills",
        "4",
        "--data-dir",
        path_arg(&run_dir),
    ]);
    let held = holder.join().expect("the lock holder thread");
    assert!(held.is_some(), "never got the lock between two lives");
    assert!(!output.status.success(), "{}", show(&output));
    let verdict = json_of(&output);
    assert_eq!(verdict["verdict"], "fail", "{verdict:#}");
    assert!(field(&verdict, "refused_starts") >= 1, "{verdict:#}");
    let examples = verdict["workloads"]["operations"]["examples"].to_string();
    assert!(examples.contains("refused to start"), "{verdict:#}");
}

/// Asserts what every run with `--backup-during` must show: it passed,
/// every workload took and restored backups, and their copies held every
/// item accepted before its object was copied.
fn assert_backups_hold_every_acknowledged_item(verdict: &Value) {
    assert_eq!(verdict["verdict"], "pass", "{verdict:#}");
    assert_eq!(field(verdict, "backup_items_missing"), 0, "{verdict:#}");
    assert_eq!(field(verdict, "violations"), 0, "{verdict:#}");
    let workloads = verdict["workloads"]
        .as_object()
        .unwrap_or_else(|| panic!("no workloads: {verdict:#}"));
    assert_eq!(workloads.len(), WORKLOADS.len(), "{verdict:#}");
    for (name, report) in workloads {
        assert!(field(report, "backups") > 0, "{name}: {report:#}");
        assert!(
            field(report, "backup_items_checked") > 0,
            "{name}: no item was accepted before a copy: {report:#}"
        );
        assert!(
            field(&report["detail"], "backup_integrity_checked") > 0,
            "{name}: {report:#}"
        );
    }
    assert!(field(verdict, "backups") >= field(verdict, "kills"));
}

/// Issue 31: `durability backup` of the live data directory while each life
/// serves it, `durability restore` of each backup, and the torture checker
/// on every restored copy: every item acknowledged before its object was
/// copied is there.
#[test]
fn backups_taken_during_the_torture_hold_every_item_acknowledged_before_their_copy() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let output = torture(
        dir.path(),
        &["--backup-during", "--workload", "all", "--kills", "3"],
    );
    assert!(output.status.success(), "{}", show(&output));
    assert_backups_hold_every_acknowledged_item(&json_of(&output));
}

/// The same with every death a power cut: the backups read the power-cut
/// filesystem while the host writes through it.
#[test]
fn backups_taken_during_a_power_cut_torture_hold_every_item_acknowledged_before_their_copy() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let output = torture(
        dir.path(),
        &[
            "--backup-during",
            "--power-cut",
            "--workload",
            "all",
            "--kills",
            "3",
        ],
    );
    assert!(output.status.success(), "{}", show(&output));
    let verdict = json_of(&output);
    assert_eq!(verdict["power_cut"], true, "{verdict:#}");
    assert_backups_hold_every_acknowledged_item(&verdict);
}

/// The backup check, on the copies of a real run: a restored copy that lost
/// the rows of acknowledged operations fails the run, every item it had to
/// hold counted missing and named. (The rows are deleted after the run, as
/// a restore that dropped them would leave the copy; `--recheck` then
/// checks the kept copies again.)
#[test]
fn the_backup_check_fails_a_restored_copy_that_lost_an_acknowledged_item() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let args = [
        "--backup-during",
        "--workload",
        "operations",
        "--kills",
        "2",
    ];
    let output = torture(dir.path(), &args);
    assert!(output.status.success(), "{}", show(&output));
    let checked = field(&json_of(&output), "backup_items_checked");
    assert!(checked > 0, "{}", show(&output));

    let restored = dir.path().join("operations").join("restored");
    let mut emptied = 0;
    for file in sqlite_files(&restored) {
        let connection = rusqlite::Connection::open(&file)
            .unwrap_or_else(|e| panic!("open {}: {e}", file.display()));
        // A copy taken before the object's first migration has no table
        // yet.
        let tables: i64 = connection
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE name = 'durability_calls'",
                [],
                |row| row.get(0),
            )
            .unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
        if tables > 0 {
            emptied += connection
                .execute("DELETE FROM durability_calls", [])
                .unwrap_or_else(|e| panic!("delete in {}: {e}", file.display()));
        }
    }
    assert!(emptied > 0, "no row to delete under {}", restored.display());

    let output = torture(dir.path(), &["--workload", "operations", "--recheck"]);
    assert!(!output.status.success(), "{}", show(&output));
    let verdict = json_of(&output);
    assert_eq!(verdict["verdict"], "fail", "{verdict:#}");
    assert_eq!(
        field(&verdict, "backup_items_checked"),
        checked,
        "{verdict:#}"
    );
    assert_eq!(
        field(&verdict, "backup_items_missing"),
        checked,
        "{verdict:#}"
    );
    assert_eq!(
        field(&verdict, "lost"),
        0,
        "the run itself is intact: {verdict:#}"
    );
    let examples = verdict["workloads"]["operations"]["examples"].to_string();
    assert!(
        examples.contains("has no row in the restored copy of object"),
        "{verdict:#}"
    );
}

/// Every `*.sqlite` file under `dir` (the restored copies' object files;
/// a copy taken before any object existed has none).
fn sqlite_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.unwrap_or_else(|e| panic!("{e}")).path();
        if path.is_dir() {
            found.extend(sqlite_files(&path));
        } else if path.extension().is_some_and(|e| e == "sqlite") {
            found.push(path);
        }
    }
    found
}
