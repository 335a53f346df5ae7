//! `durability demo --archive URL` and `durability restore ARCHIVE DIR
//! --at TIME` as an operator runs them: the real executable in child
//! processes, on real files.

use std::path::Path;

use durability_host::archive;
use durability_host::inspect;

mod support;
use support::s3::{S3Server, aws_env};
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

    // verify takes the directory or its file:// URL.
    for named in [archive_root.display().to_string(), url.clone()] {
        let verified = run(durability().args(["verify", &named, "--json"]));
        assert!(verified.status.success(), "{}", show(&verified));
        let report: serde_json::Value = serde_json::from_slice(&verified.stdout).unwrap();
        assert!(report["chunks"].as_u64().unwrap() >= 1, "{report}");
    }

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
        .args(["--archive", "gs://bucket/prefix"]));
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--archive"),
        "{}",
        show(&refused)
    );
}

#[test]
fn a_demo_archived_to_s3_verifies_and_restores_at_its_end_and_at_a_moment_within_it() {
    let server = S3Server::start();
    server.create_bucket("demo-archive");
    let env = aws_env(server.port());
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("data");
    let url = "s3://demo-archive/hosts/demo";
    let demo = run(durability()
        .envs(env.iter().cloned())
        .args(["demo", "--data-dir"])
        .arg(&data)
        .args([
            "--messages",
            "2000",
            "--shards",
            "4",
            "--json",
            "--archive",
            url,
        ]));
    assert!(demo.status.success(), "{}", show(&demo));

    let verified = run(durability()
        .envs(env.iter().cloned())
        .args(["verify", url, "--json"]));
    assert!(verified.status.success(), "{}", show(&verified));
    let report: serde_json::Value = serde_json::from_slice(&verified.stdout).unwrap();
    assert!(report["bases"].as_u64().unwrap() >= 1, "{report}");
    assert!(report["chunks"].as_u64().unwrap() >= 1, "{report}");

    let end = root.path().join("restored-end");
    let restored = run(durability()
        .envs(env.iter().cloned())
        .args(["restore", url])
        .arg(&end)
        .arg("--json"));
    assert!(restored.status.success(), "{}", show(&restored));
    assert_eq!(contents(&end), contents(&data));

    // The manifest as the store holds it.
    let text = server.get("demo-archive", "hosts/demo/archive.json");
    let manifest_json: serde_json::Value = serde_json::from_slice(&text).unwrap();
    let life = &manifest_json["lives"][0];
    let middle = (life["bases"][0]["finished_ms"].as_i64().unwrap()
        + life["through_ms"].as_i64().unwrap())
        / 2;
    let within = root.path().join("restored-middle");
    let restored = run(durability()
        .envs(env.iter().cloned())
        .args(["restore", url])
        .arg(&within)
        .args(["--at", &middle.to_string()]));
    assert!(restored.status.success(), "{}", show(&restored));
    assert!(!contents(&within).is_empty());

    // A corrupted chunk: verify and restore both refuse it by its URL.
    let chunk = server
        .keys("demo-archive", "hosts/demo/lives/")
        .into_iter()
        .rfind(|key| key.ends_with(".passes"))
        .unwrap();
    let mut bytes = server.get("demo-archive", &chunk);
    let at = bytes.len() / 2;
    bytes[at] ^= 1;
    server.put("demo-archive", &chunk, &bytes);
    let named = format!("s3://demo-archive/{chunk}");
    for command in [
        vec!["verify".to_owned(), url.to_owned()],
        vec![
            "restore".to_owned(),
            url.to_owned(),
            root.path().join("refused").display().to_string(),
        ],
    ] {
        let refused = run(durability().envs(env.iter().cloned()).args(&command));
        assert!(!refused.status.success(), "{}", show(&refused));
        assert!(
            String::from_utf8_lossy(&refused.stderr).contains(&named),
            "{command:?} names {named}: {}",
            show(&refused)
        );
    }
    assert!(!root.path().join("refused").exists());
}
