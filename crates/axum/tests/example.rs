//! `examples/axum_service.rs` as a user runs it: the built example in a
//! child process on 127.0.0.1, mail posted over HTTP, the dashboard and
//! metrics fetched, then Ctrl-C (SIGINT to its pid) and a clean shutdown.

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `cargo test` builds the examples next to the test binaries' directory.
fn example_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let debug = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = debug.join("examples").join("axum_service");
    assert!(path.exists(), "build the example first: {}", path.display());
    path
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

fn get(url: &str) -> (u16, String) {
    let mut response = agent().get(url).call().unwrap();
    let status = response.status().as_u16();
    (status, response.body_mut().read_to_string().unwrap())
}

fn post(url: &str, body: &str) -> (u16, String) {
    let mut response = agent()
        .post(url)
        .content_type("application/json")
        .send(body)
        .unwrap();
    let status = response.status().as_u16();
    (status, response.body_mut().read_to_string().unwrap())
}

#[test]
fn the_mail_service_accepts_mail_delivers_it_serves_the_dashboard_and_stops_on_ctrl_c() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(example_binary())
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .env("DURABILITY_ADMIN_TOKEN", "an admin token for the test")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    let start = line.find("http://").unwrap_or_else(|| panic!("{line}"));
    let base = line[start..]
        .split('/')
        .take(3)
        .collect::<Vec<_>>()
        .join("/");

    for n in 0..20 {
        let (status, body) = post(
            &format!("{base}/mail"),
            &format!(r#"{{"to":"user{n}@example.test","subject":"hello {n}"}}"#),
        );
        assert_eq!(status, 202, "{body}");
    }
    let (status, _) = post(
        &format!("{base}/mail"),
        r#"{"to":"nobody@example.test","subject":"lost"}"#,
    );
    assert_eq!(status, 202);
    let (status, _) = post(
        &format!("{base}/mail"),
        r#"{"to":"no address","subject":"x"}"#,
    );
    assert_eq!(status, 422);

    // Every mail reaches its end: 20 in inboxes, 1 parked.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = get(&format!("{base}/durability/api/objects"));
        assert_eq!(status, 200);
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        let overview = &json["overview"];
        if overview["backlog"] == 0 && overview["parked"] == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "not delivered in time: {json:#}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, page) = get(&format!("{base}/durability"));
    assert_eq!(status, 200);
    assert!(
        page.contains("mail service") && page.contains("admin API enabled"),
        "{page}"
    );
    let (status, metrics) = get(&format!("{base}/durability/metrics"));
    assert_eq!(status, 200);
    assert!(
        metrics.contains(r#"durability_fanout_delivered_total{target="inbox"} 20"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"durability_fanout_parked_total{target="inbox"} 1"#),
        "{metrics}"
    );

    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}: {rest}");
    assert!(rest.contains("host shut down cleanly"), "{rest}");
}
