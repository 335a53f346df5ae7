//! A process killed with SIGKILL loses nothing it committed.
//!
//! The test binary re-runs itself as the child: the ignored test below does
//! the child's part when `DURABILITY_HOST_CRASH_CHILD_DIR` is set.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::time::Duration;

use durability_platform::Context;
use support::{Notes, inline_host, local, notes};

const CHILD_DIR_ENV: &str = "DURABILITY_HOST_CRASH_CHILD_DIR";
const CHILD_TEST: &str = "child_commits_rows_and_sets_an_alarm_until_killed";
/// The child reports this many commits before the parent kills it.
const COMMITS_BEFORE_KILL: usize = 100;
const ALARM_MARK: &str = "crash-child alarm set at ";
const COMMIT_MARK: &str = "crash-child committed ";

#[tokio::test(start_paused = true)]
async fn a_killed_process_keeps_every_committed_row_and_its_alarm() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            CHILD_TEST,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR_ENV, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut alarm_at = None;
    let mut committed = Vec::new();
    for line in stdout.lines() {
        let line = line.unwrap();
        // The harness may print its own text before ours on a line.
        if let Some((_, at)) = line.split_once(ALARM_MARK) {
            alarm_at = Some(at.trim().parse::<i64>().unwrap());
        } else if let Some((_, n)) = line.split_once(COMMIT_MARK) {
            committed.push(n.to_owned());
            if committed.len() == COMMITS_BEFORE_KILL {
                break;
            }
        }
    }
    // SIGKILL while the child keeps committing: no chance to clean up.
    child.kill().unwrap();
    child.wait().unwrap();
    let alarm_at = alarm_at.expect("the child set its alarm");
    assert_eq!(committed.len(), COMMITS_BEFORE_KILL);

    local(async {
        let host = durability_host::Host::builder(dir.path())
            .threads(0)
            .clock_start_ms(alarm_at - 1_000)
            .build()
            .unwrap();
        let stub = notes(&host).stub("crash").unwrap();
        let (texts, alarm) = stub
            .call(|o: Rc<Notes>| async move { (o.texts().unwrap(), o.alarm().await.unwrap()) })
            .await
            .unwrap();
        // Every reported commit is there, in order; a commit the child made
        // after its last report may be there too.
        assert_eq!(texts[..committed.len()], committed[..]);
        assert_eq!(alarm, Some(alarm_at));
        tokio::time::sleep(Duration::from_secs(2)).await;
        let log = stub
            .call(|o: Rc<Notes>| async move { o.alarm_log().unwrap() })
            .await
            .unwrap();
        assert_eq!(log, vec![(alarm_at, 0)]);
        host.shutdown().await;
    })
    .await;
}

#[tokio::test]
#[ignore = "the child half of a_killed_process_keeps_every_committed_row_and_its_alarm"]
async fn child_commits_rows_and_sets_an_alarm_until_killed() {
    let Some(dir) = std::env::var_os(CHILD_DIR_ENV) else {
        return;
    };
    local(async {
        let host = inline_host(std::path::Path::new(&dir));
        let stub = notes(&host).stub("crash").unwrap();
        let at = host.now_ms() + 3_600_000;
        stub.call(move |o: Rc<Notes>| async move { o.ctx.storage().set_alarm(at).await })
            .await
            .unwrap()
            .unwrap();
        println!("{ALARM_MARK}{at}");
        for i in 0.. {
            let text = format!("row {i}");
            let reported = text.clone();
            stub.call(move |o: Rc<Notes>| async move { o.add(&text) })
                .await
                .unwrap()
                .unwrap();
            // Printed only after the commit returned.
            println!("{COMMIT_MARK}{reported}");
        }
    })
    .await;
}
