//! `durability demo --serve ADDR` and `durability serve DATA_DIR --listen
//! ADDR`: the real binary in a child process, its dashboard fetched over
//! real HTTP on 127.0.0.1, stopped with SIGINT sent to its pid.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, ChildStderr, Command, Stdio};
use std::time::SystemTime;

use serde_json::Value;

mod support;
use support::path_arg;

/// A child process and its stderr, read line by line.
struct Running {
    child: Child,
    stderr: BufReader<ChildStderr>,
    seen: String,
}

impl Running {
    fn start(args: &[&str]) -> Running {
        let mut child = Command::new(env!("CARGO_BIN_EXE_durability"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run the durability binary: {e}"));
        let stderr = BufReader::new(child.stderr.take().unwrap());
        Running {
            child,
            stderr,
            seen: String::new(),
        }
    }

    /// Reads stderr until a line contains `marker`; returns that line.
    fn wait_for(&mut self, marker: &str) -> String {
        loop {
            let mut line = String::new();
            let read = self.stderr.read_line(&mut line).unwrap();
            assert!(
                read > 0,
                "the process ended before {marker:?}; stderr:\n{}",
                self.seen
            );
            self.seen.push_str(&line);
            if line.contains(marker) {
                return line;
            }
        }
    }

    /// The `http://127.0.0.1:PORT` in `line`.
    fn base_url(line: &str) -> String {
        let start = line
            .find("http://")
            .unwrap_or_else(|| panic!("no URL in {line:?}"));
        let rest = &line[start..];
        let end = rest[7..].find('/').map_or(rest.len(), |i| i + 7);
        rest[..end].to_owned()
    }

    /// Sends SIGINT (Ctrl-C) to the process by pid and waits for its exit.
    fn interrupt(mut self) -> (std::process::ExitStatus, String) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-INT", &pid]).status().unwrap();
        assert!(sent.success());
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stderr, &mut rest).unwrap();
        let status = self.child.wait().unwrap();
        let mut stdout = String::new();
        if let Some(mut out) = self.child.stdout.take() {
            std::io::Read::read_to_string(&mut out, &mut stdout).unwrap();
        }
        (status, stdout)
    }
}

impl Drop for Running {
    /// A test that fails before it interrupts the process still stops it,
    /// by its pid, rather than leaving a server running.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn get(url: &str) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut response = agent
        .get(url)
        .call()
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = response.status().as_u16();
    (status, response.body_mut().read_to_string().unwrap())
}

/// Size and modification time of every object database file, to show that
/// serving a directory writes nothing. (A read-only reader of a WAL
/// database may create SQLite's empty `-wal`/`-shm` companions; they hold
/// no data and are left out.)
fn fingerprint(dir: &Path) -> Vec<(String, u64, SystemTime)> {
    let mut files = Vec::new();
    for shard in std::fs::read_dir(dir.join("objects")).unwrap() {
        for file in std::fs::read_dir(shard.unwrap().path()).unwrap() {
            let file = file.unwrap();
            if !file.file_name().to_string_lossy().ends_with(".sqlite") {
                continue;
            }
            let meta = file.metadata().unwrap();
            files.push((
                file.file_name().to_string_lossy().into_owned(),
                meta.len(),
                meta.modified().unwrap(),
            ));
        }
    }
    files.sort();
    files
}

#[test]
fn demo_serve_shows_the_page_and_metrics_while_running_and_after_until_ctrl_c() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut demo = Running::start(&[
        "demo",
        "--data-dir",
        path_arg(&data),
        "--messages",
        "400",
        "--shards",
        "2",
        "--json",
        "--serve",
        "127.0.0.1:0",
    ]);
    let base = Running::base_url(&demo.wait_for("dashboard: http://"));
    let (status, page) = get(&format!("{base}/"));
    assert_eq!(status, 200);
    assert!(page.contains("<title>durability demo</title>"), "{page}");
    // After the run the process keeps serving the final state.
    demo.wait_for("the dashboard stays at");
    let (status, body) = get(&format!("{base}/api/objects"));
    assert_eq!(status, 200);
    let json: Value = serde_json::from_str(&body).unwrap();
    let objects = json["objects"].as_array().unwrap();
    assert_eq!(objects.len(), 2, "{json:#}");
    for object in objects {
        assert_eq!(object["namespace"], "mailbox");
        assert_eq!(
            object["capabilities"]["fanout"]["messages"], 0,
            "all delivered"
        );
    }
    let (status, page) = get(&format!("{base}/"));
    assert_eq!(status, 200);
    assert!(
        page.contains("mailbox-0") && page.contains("mailbox-1"),
        "{page}"
    );
    let (status, metrics) = get(&format!("{base}/metrics"));
    assert_eq!(status, 200);
    for series in [
        r#"durability_fanout_enqueued_total{target="inbox"} 400"#,
        r#"durability_fanout_enqueued_total{target="archive"} 400"#,
        "durability_host_commits_total",
        r#"durability_alarms_scheduled_total{alarm="cleanup"}"#,
    ] {
        assert!(metrics.contains(series), "lacks {series:?}:\n{metrics}");
    }
    let (status, stdout) = demo.interrupt();
    assert!(
        status.success(),
        "Ctrl-C after the run is a clean exit: {status}"
    );
    let summary: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(summary["accepted"], 400);
    assert_eq!(summary["lost"], 0);
}

#[test]
fn serve_shows_a_data_directory_read_only_without_constructing_objects() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let demo = Command::new(env!("CARGO_BIN_EXE_durability"))
        .args([
            "demo",
            "--data-dir",
            path_arg(&data),
            "--messages",
            "200",
            "--shards",
            "3",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        demo.status.success(),
        "{}",
        String::from_utf8_lossy(&demo.stderr)
    );
    let before = fingerprint(&data);

    let mut serve = Running::start(&["serve", path_arg(&data), "--listen", "127.0.0.1:0"]);
    let base = Running::base_url(&serve.wait_for("serving the read-only view"));
    let (status, page) = get(&format!("{base}/"));
    assert_eq!(status, 200);
    assert!(
        page.contains("read-only view") && page.contains("mailbox-2"),
        "{page}"
    );
    let (status, body) = get(&format!("{base}/api/objects"));
    assert_eq!(status, 200);
    let json: Value = serde_json::from_str(&body).unwrap();
    let names: Vec<&str> = json["objects"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o["name"].as_str())
        .collect();
    assert_eq!(names, ["mailbox-0", "mailbox-1", "mailbox-2"]);
    assert!(json["objects"][0]["capabilities"]["operations"].is_object());
    // No admin and no metrics in the read-only view.
    assert_eq!(get(&format!("{base}/metrics")).0, 404);
    // It holds no lock: a host (here another demo run) can open the
    // directory while it serves.
    let second = Command::new(env!("CARGO_BIN_EXE_durability"))
        .args([
            "demo",
            "--data-dir",
            path_arg(&data),
            "--messages",
            "100",
            "--shards",
            "3",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    let (status, _) = serve.interrupt();
    assert!(status.success(), "{status}");

    // Serving alone wrote nothing: a fresh serve and a few requests leave
    // every object file as it was.
    let before_second = fingerprint(&data);
    assert_ne!(before, before_second, "the second run wrote");
    let mut serve = Running::start(&["serve", path_arg(&data), "--listen", "127.0.0.1:0"]);
    let base = Running::base_url(&serve.wait_for("serving the read-only view"));
    for _ in 0..3 {
        assert_eq!(get(&format!("{base}/api/objects")).0, 200);
        assert_eq!(get(&format!("{base}/")).0, 200);
    }
    let (status, _) = serve.interrupt();
    assert!(status.success());
    assert_eq!(
        fingerprint(&data),
        before_second,
        "serve changed an object file"
    );

    let missing = Command::new(env!("CARGO_BIN_EXE_durability"))
        .args([
            "serve",
            path_arg(&dir.path().join("nope")),
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("is not a readable directory"));
}

#[test]
fn serve_with_an_archive_shows_how_far_it_reaches_while_a_demo_of_another_process_ships_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let url = format!("file://{}", dir.path().join("archive").display());
    // Long enough that its host ships for several seconds.
    let mut demo = Running::start(&[
        "demo",
        "--data-dir",
        path_arg(&data),
        "--messages",
        "20000",
        "--shards",
        "2",
        "--json",
        "--serve",
        "127.0.0.1:0",
        "--archive",
        &url,
    ]);
    demo.wait_for("dashboard: http://");
    let mut serve = Running::start(&[
        "serve",
        path_arg(&data),
        "--listen",
        "127.0.0.1:0",
        "--archive",
        &url,
    ]);
    let base = Running::base_url(&serve.wait_for("serving the read-only view"));
    let archive = || -> Value {
        let (status, body) = get(&format!("{base}/api/archive"));
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    };
    // While the demo's host runs it ships, and the manifest stays fresh.
    // (Right after the first base its end is later than the last pass
    // shipped before it: nothing is restorable until the next shipment.)
    let restorable = |s: &Value| {
        s["through_ms"]
            .as_i64()
            .zip(s["earliest_ms"].as_i64())
            .is_some_and(|(through, earliest)| earliest <= through)
    };
    let mut status = archive();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !restorable(&status) {
        assert!(std::time::Instant::now() < deadline, "no base: {status}");
        std::thread::sleep(std::time::Duration::from_millis(100));
        status = archive();
    }
    assert_eq!(status["url"], url.as_str(), "{status}");
    assert_eq!(status["error"], Value::Null, "{status}");
    assert_eq!(
        status["shipping"], true,
        "the demo is still running: {status}"
    );
    assert!(status["lag_seconds"].as_f64().unwrap() < 30.0, "{status}");
    let (code, page) = get(&format!("{base}/"));
    assert_eq!(code, 200);
    assert!(
        page.contains(&format!("archive <code>{url}</code>")),
        "{page}"
    );

    // The run ends and its host stops: the life closes, everything shipped.
    demo.wait_for("the dashboard stays at");
    let status = archive();
    assert_eq!(status["shipping"], false, "{status}");
    assert_eq!(status["lag_seconds"], 0.0, "{status}");
    let (stopped, _) = demo.interrupt();
    assert!(stopped.success());
    let (stopped, _) = serve.interrupt();
    assert!(stopped.success());

    let refused = Command::new(env!("CARGO_BIN_EXE_durability"))
        .args(["serve", path_arg(&data), "--archive", "gs://bucket/x"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("--archive"), "{said}");
}
