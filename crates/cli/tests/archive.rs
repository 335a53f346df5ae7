//! `durability demo --archive URL` and `durability restore ARCHIVE DIR
//! --at TIME` as an operator runs them: the real executable in child
//! processes, on real files.

use std::path::Path;

use durability_host::archive;
use durability_host::inspect;

mod support;
use support::{durability, run, show};

/// Every user table of every object of `dir` with its row count.
fn contents(dir: &Path) -> Vec<(String, String, i64)> {
    let mut all = Vec::new();
    for object in inspect::list_objects(dir).unwrap() {
        let rows = inspect::read_object(dir, &object.id, |sql| {
            let tables: Vec<String> = sql
                .query(
                    "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name",
                    &[],
                )
                .unwrap()
                .iter()
                .map(|row| row.get::<String>(0).unwrap())
                .collect();
            tables
                .into_iter()
                .map(|table| {
                    let count = sql
                        .query(&format!("SELECT count(*) FROM \"{table}\""), &[])
                        .unwrap()
                        .iter()
                        .map(|row| row.get::<i64>(0).unwrap())
                        .next()
                        .unwrap();
                    (table, count)
                })
                .collect::<Vec<_>>()
        })
        .unwrap()
        .unwrap();
        all.extend(
            rows.into_iter()
                .map(|(table, count)| (object.id.clone(), table, count)),
        );
    }
    all.sort();
    all
}

#[test]
fn a_demo_archived_to_a_directory_restores_at_its_end_and_at_a_moment_within_it() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let archive_root = root.path().join("archive");
    let url = format!("file://{}", archive_root.display());
    let demo = run(durability().args(["demo", "--data-dir"]).arg(&data).args([
        "--messages",
        "2000",
        "--shards",
        "4",
        "--json",
        "--archive",
        &url,
    ]));
    assert!(demo.status.success(), "{}", show(&demo));

    // Without --at: the last moment the archive holds, which for a demo
    // that stopped cleanly is everything it wrote.
    let end = root.path().join("restored-end");
    let restored = run(durability()
        .arg("restore")
        .arg(&archive_root)
        .arg(&end)
        .arg("--json"));
    assert!(restored.status.success(), "{}", show(&restored));
    let report: serde_json::Value = serde_json::from_slice(&restored.stdout).unwrap();
    assert!(report["objects"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(contents(&end), contents(&data));

    // A moment within the run, as RFC 3339 would name it or in epoch ms.
    let manifest = archive::read_manifest(&archive_root).unwrap();
    let life = &manifest.lives[0];
    let middle = (life.bases[0].finished_ms + life.through_ms) / 2;
    let within = root.path().join("restored-middle");
    let restored = run(durability()
        .arg("restore")
        .arg(&archive_root)
        .arg(&within)
        .args(["--at", &middle.to_string()]));
    assert!(restored.status.success(), "{}", show(&restored));
    assert!(!contents(&within).is_empty());
}

#[test]
fn restore_refuses_a_bad_time_naming_the_flag_and_at_without_an_archive() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let archive_root = root.path().join("archive");
    let url = format!("file://{}", archive_root.display());
    let demo = run(durability().args(["demo", "--data-dir"]).arg(&data).args([
        "--messages",
        "100",
        "--shards",
        "2",
        "--json",
        "--archive",
        &url,
    ]));
    assert!(demo.status.success(), "{}", show(&demo));

    let refused = run(durability()
        .arg("restore")
        .arg(&archive_root)
        .arg(root.path().join("a"))
        .args(["--at", "yesterday"]));
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--at"),
        "{}",
        show(&refused)
    );

    let refused = run(durability()
        .arg("restore")
        .arg(&archive_root)
        .arg(root.path().join("b"))
        .args(["--at", "1970-01-01T00:00:01Z"]));
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("reaches back"),
        "{}",
        show(&refused)
    );
    assert!(!root.path().join("b").exists());

    let backup = root.path().join("backup");
    let made = run(durability().arg("backup").arg(&data).arg(&backup));
    assert!(made.status.success(), "{}", show(&made));
    let refused = run(durability()
        .arg("restore")
        .arg(&backup)
        .arg(root.path().join("c"))
        .args(["--at", "0"]));
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--at needs an archive"),
        "{}",
        show(&refused)
    );

    let refused = run(durability()
        .args(["demo", "--data-dir"])
        .arg(root.path().join("d"))
        .args(["--archive", "s3://bucket/prefix"]));
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--archive"),
        "{}",
        show(&refused)
    );
}
