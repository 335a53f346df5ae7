//! The dashboard in a real headless browser (Debian's `chromium`, which
//! `.ci/run` installs): the page renders each capability's state, and its
//! inline script refreshes the figures without a reload.
//!
//! This test fails, never skips, when Chromium is missing: a dashboard
//! that no browser has rendered is not tested. Set `DURABILITY_CHROMIUM`
//! to use another binary, and `DURABILITY_SCREENSHOT` to a path to keep a
//! screenshot of the page.

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use durability_axum::Dashboard;
use support::{Server, World};

fn chromium() -> String {
    std::env::var("DURABILITY_CHROMIUM").unwrap_or_else(|_| "chromium".to_owned())
}

/// Runs headless Chromium on `url` with `args`, killing it (by pid) if it
/// has not finished within a minute.
fn run_chromium(url: &str, args: &[String]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1440,1100",
            // Virtual time runs the page's timers (its refresh) at once.
            "--virtual-time-budget=6000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start `{}` ({e}): the browser test needs Chromium \
                 (`apt-get install chromium`, as .ci/run does)",
                chromium()
            )
        });
    let pid = child.id();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let watchdog = std::thread::spawn(move || {
        if done_rx.recv_timeout(Duration::from_secs(60)).is_err() {
            // Still running after a minute: stop it by its pid.
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    });
    let mut stdout = String::new();
    if let Some(mut out) = child.stdout.take() {
        std::io::Read::read_to_string(&mut out, &mut stdout).unwrap();
    }
    let output = child.wait_with_output().unwrap();
    let _ = done_tx.send(());
    watchdog.join().unwrap();
    assert!(
        output.status.success(),
        "chromium failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_headless_browser_renders_the_dashboard_and_its_live_refresh() {
    let world = World::new().await;
    let router = Dashboard::for_host(&world.host)
        .title("shop dashboard")
        .refresh_interval(Duration::from_secs(1))
        .build()
        .unwrap();
    let app = axum::Router::new().nest("/durability", router);
    let server = Server::start(app).await;
    let url = format!("{}/durability", server.base);
    let dom = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || run_chromium(&url, &["--dump-dom".to_owned()]))
            .await
            .unwrap()
    };
    for expected in [
        "<title>shop dashboard</title>",
        "shop-1",
        "fanout backlog",
        "order-poison",
        "charge",
        "cleanup",
        "indexer",
    ] {
        assert!(
            dom.contains(expected),
            "the rendered page lacks {expected:?}:\n{dom}"
        );
    }
    // The inline script fetched the fragment (relative to a nested mount)
    // and stamped the time: the figures refresh without a reload.
    assert!(
        dom.contains(r#"<span class="meta" id="updated">updated "#),
        "the page did not refresh itself:\n{dom}"
    );
    if let Ok(path) = std::env::var("DURABILITY_SCREENSHOT") {
        let arg = format!("--screenshot={path}");
        tokio::task::spawn_blocking(move || run_chromium(&url, &[arg]))
            .await
            .unwrap();
    }
    world.host.shutdown().await;
}
