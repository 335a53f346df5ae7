//! `durability backup`, `verify` and `restore` as an operator runs them:
//! the real executable in a child process, on real files, including a
//! backup killed with SIGKILL in the middle.

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use durability_host::{DurableObject, Host, ObjectContext};
use durability_platform::Context;

mod support;
use support::{durability, run, show};

struct Thing(ObjectContext);
impl DurableObject for Thing {}

/// Makes a data directory with `n` objects, each with a row and an alarm
/// an hour ahead, through the real host, which then stops.
fn data_dir_with_objects(dir: &Path, n: usize) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let host = Host::builder(dir).threads(2).build().unwrap();
        let things = host
            .namespace("things", |ctx| {
                ctx.storage()
                    .execute_script("CREATE TABLE IF NOT EXISTS t (v INTEGER)")?;
                Ok(Thing(ctx))
            })
            .unwrap();
        let at = host.now_ms() + 3_600_000;
        for i in 0..n {
            things
                .stub(&format!("thing-{i}"))
                .unwrap()
                .call(move |o: Rc<Thing>| async move {
                    o.0.storage().execute("INSERT INTO t (v) VALUES (1)", &[])?;
                    o.0.storage().set_alarm(at).await
                })
                .await
                .unwrap()
                .unwrap();
        }
        host.shutdown().await;
    });
}

fn copy_of_first_object(backup: &Path) -> PathBuf {
    let shards = backup.join("objects");
    let shard = std::fs::read_dir(shards)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::read_dir(shard)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
}

#[test]
fn backup_verify_and_restore_round_trip_and_backup_json_has_exactly_its_fields() {
    let root = tempfile::tempdir().unwrap();
    let (data, dest, restored) = (
        root.path().join("data"),
        root.path().join("backup"),
        root.path().join("restored"),
    );
    data_dir_with_objects(&data, 20);
    let output = run(durability()
        .arg("backup")
        .arg(&data)
        .arg(&dest)
        .arg("--json"));
    assert!(output.status.success(), "{}", show(&output));
    let printed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let fields: Vec<&str> = printed
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(fields, ["objects", "bytes", "seconds", "manifest"]);
    assert_eq!(printed["objects"], 20);
    assert!(printed["bytes"].as_u64().unwrap() > 0);
    assert_eq!(
        printed["manifest"].as_str().unwrap(),
        dest.join("manifest.json").display().to_string()
    );

    let output = run(durability().arg("verify").arg(&dest));
    assert!(output.status.success(), "{}", show(&output));
    let output = run(durability()
        .arg("restore")
        .arg(&dest)
        .arg(&restored)
        .arg("--json"));
    assert!(output.status.success(), "{}", show(&output));
    let printed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(printed["objects"], 20);
    assert_eq!(printed["alarms"], 20);
    let output = run(durability().arg("inspect").arg(&restored).arg("--json"));
    assert!(output.status.success(), "{}", show(&output));
    let listing: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(listing["objects"].as_array().unwrap().len(), 20);

    // A second backup to the same name is refused; the first stays.
    let output = run(durability().arg("backup").arg(&data).arg(&dest));
    assert!(!output.status.success(), "{}", show(&output));
    assert!(String::from_utf8_lossy(&output.stderr).contains("already exists"));
}

#[test]
fn verify_and_restore_name_a_corrupted_object_and_exit_non_zero() {
    let root = tempfile::tempdir().unwrap();
    let (data, dest, restored) = (
        root.path().join("data"),
        root.path().join("backup"),
        root.path().join("restored"),
    );
    data_dir_with_objects(&data, 3);
    let output = run(durability().arg("backup").arg(&data).arg(&dest));
    assert!(output.status.success(), "{}", show(&output));
    let copy = copy_of_first_object(&dest);
    let mut bytes = std::fs::read(&copy).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&copy, &bytes).unwrap();

    for output in [
        run(durability().arg("verify").arg(&dest)),
        run(durability().arg("restore").arg(&dest).arg(&restored)),
    ] {
        assert!(!output.status.success(), "{}", show(&output));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(&copy.display().to_string()), "{stderr}");
        assert!(stderr.contains("SHA-256"), "{stderr}");
    }
    assert!(!restored.exists());
}

#[test]
fn restore_refuses_a_data_directory_a_host_holds_naming_its_pid() {
    let root = tempfile::tempdir().unwrap();
    let (data, dest, held) = (
        root.path().join("data"),
        root.path().join("backup"),
        root.path().join("held"),
    );
    data_dir_with_objects(&data, 2);
    let output = run(durability().arg("backup").arg(&data).arg(&dest));
    assert!(output.status.success(), "{}", show(&output));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
        let host = Host::builder(&held).threads(1).build().unwrap();
        let output = run(durability().arg("restore").arg(&dest).arg(&held));
        assert!(!output.status.success(), "{}", show(&output));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("in use by another host"), "{stderr}");
        assert!(stderr.contains(&std::process::id().to_string()), "{stderr}");
        host.shutdown().await;
    });
    let output = run(durability().arg("restore").arg(&dest).arg(&held));
    assert!(!output.status.success(), "{}", show(&output));
    assert!(String::from_utf8_lossy(&output.stderr).contains("is not empty"));
}

/// The hidden temporary directories beside `dest`.
fn partials(dest: &Path) -> Vec<PathBuf> {
    let name = dest.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::read_dir(dest.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&format!(".{name}.partial-"))
        })
        .collect()
}

fn copies_in(partial: &Path) -> usize {
    let Ok(shards) = std::fs::read_dir(partial.join("objects")) else {
        return 0;
    };
    shards
        .filter_map(|s| std::fs::read_dir(s.ok()?.path()).ok())
        .map(Iterator::count)
        .sum()
}

#[test]
fn a_backup_killed_in_the_middle_leaves_nothing_under_its_name_and_nothing_that_verifies() {
    let root = tempfile::tempdir().unwrap();
    let (data, dest) = (root.path().join("data"), root.path().join("backup"));
    data_dir_with_objects(&data, 1500);
    let mut child = durability()
        .arg("backup")
        .arg(&data)
        .arg(&dest)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Killed once it has copied some objects (and long before the last).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if partials(&dest).iter().any(|p| copies_in(p) >= 10) {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the backup ended before it could be killed"
        );
        assert!(
            Instant::now() < deadline,
            "the backup never started copying"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();

    assert!(!dest.exists(), "no directory under the destination's name");
    let left = partials(&dest);
    assert_eq!(left.len(), 1, "{left:?}");
    let partial = left.first().unwrap();
    assert!(!partial.join("manifest.json").exists());
    let output = run(durability().arg("verify").arg(partial));
    assert!(!output.status.success(), "{}", show(&output));
    assert!(String::from_utf8_lossy(&output.stderr).contains("not a complete backup"));
    let output = run(durability()
        .arg("restore")
        .arg(partial)
        .arg(root.path().join("r")));
    assert!(!output.status.success(), "{}", show(&output));

    // The next backup under the same name is not hindered by the leftover.
    let output = run(durability().arg("backup").arg(&data).arg(&dest));
    assert!(output.status.success(), "{}", show(&output));
    let output = run(durability().arg("verify").arg(&dest));
    assert!(output.status.success(), "{}", show(&output));
}

#[test]
fn backup_refuses_a_directory_that_is_not_a_data_directory() {
    let root = tempfile::tempdir().unwrap();
    let output = run(durability()
        .arg("backup")
        .arg(root.path())
        .arg(root.path().join("b")));
    assert!(!output.status.success(), "{}", show(&output));
    assert!(String::from_utf8_lossy(&output.stderr).contains("not a durability data directory"));
    assert!(!root.path().join("b").exists());
}

#[test]
fn bench_backup_quick_reports_objects_and_megabytes_per_second_against_its_floor() {
    let root = tempfile::tempdir().unwrap();
    let json = root.path().join("backup.json");
    let output = run(durability()
        .args(["bench", "backup", "--quick", "--json"])
        .arg(&json)
        .arg("--data-dir")
        .arg(root.path().join("bench")));
    assert!(output.status.success(), "{}", show(&output));
    let result: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(result["scenario"], "backup");
    let measurements = result["measurements"].as_array().unwrap();
    let names: Vec<&str> = measurements
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "raw/backup-api",
            "backup/idle-host",
            "backup/while-writing",
            "restore/all",
            "restore/at-a-moment"
        ]
    );
    for measurement in measurements {
        assert_eq!(measurement["ops"], 300, "{measurement}");
    }
    // A point-in-time restore is timed, not sized: the rest count bytes.
    for measurement in &measurements[..4] {
        assert!(measurement["mb_per_sec"].is_number(), "{measurement}");
    }
    for measurement in &measurements[1..3] {
        assert_eq!(measurement["floor"], "raw/backup-api", "{measurement}");
        assert!(measurement["floor_ratio"].is_number(), "{measurement}");
    }
    assert!(result["figures"]["writer_calls_per_sec"].is_number());
}
