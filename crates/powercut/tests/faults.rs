//! What the host needs beyond the other tests' single faults: renames
//! undone over many seeds, hard links, and a real SQLite database written
//! by a process that dies of SIGKILL, then cut.

mod support;

use durability_powercut::Fault;
use support::{Mounted, durable_file, sync_dir};

#[test]
fn a_rename_whose_directory_was_not_synced_can_be_undone() {
    let m = Mounted::new();
    let mut undone = false;
    for seed in 0..24 {
        let (from, to) = (format!("a-{seed}"), format!("b-{seed}"));
        durable_file(&m, &from, b"moved");
        std::fs::rename(m.path(&from), m.path(&to)).expect("rename");
        m.fs.cut(Fault::Metadata, seed).expect("cut");
        let (a, b) = (m.exists(&from), m.exists(&to));
        let on_disk = (m.backing.join(&from).exists(), m.backing.join(&to).exists());
        assert!(
            a != b,
            "exactly one name after the cut: {a} {b}; backing {on_disk:?}; stat {:?}",
            std::fs::metadata(m.path(&from))
        );
        undone |= a;
        let kept = if a { &from } else { &to };
        assert_eq!(m.read(kept), b"moved");
    }
    assert!(undone, "no rename was undone");
}

#[test]
fn a_hard_link_is_a_second_name_and_a_namespace_change() {
    let m = Mounted::new();
    durable_file(&m, "first", b"linked");
    std::fs::hard_link(m.path("first"), m.path("second")).expect("link");
    assert_eq!(m.read("second"), b"linked");
    std::fs::remove_file(m.path("first")).expect("unlink");
    sync_dir(m.fs.mountpoint());
    m.fs.cut(Fault::Metadata, 1).expect("cut");
    assert_eq!(m.read("second"), b"linked");
    assert!(!m.exists("first"));
}

/// Where the writer child of [`rows_after_a_kill_and_a_cut`] writes, and
/// at which `synchronous`.
const CHILD_DB: &str = "POWERCUT_TEST_SQLITE_DB";
const CHILD_SYNCHRONOUS: &str = "POWERCUT_TEST_SQLITE_SYNCHRONOUS";
/// Commits the child makes before it kills itself.
const COMMITS: i64 = 200;

/// The writer child: not a test of its own (ignored, so a plain run
/// skips it), run by [`rows_after_a_kill_and_a_cut`] in a process of its
/// own that dies of SIGKILL after its last commit, as a crash does.
#[test]
#[ignore = "the writer process of the SQLite tests, run by them"]
fn sqlite_writer_child() {
    let (Ok(path), Ok(synchronous)) = (std::env::var(CHILD_DB), std::env::var(CHILD_SYNCHRONOUS))
    else {
        panic!("run by the SQLite tests, which set {CHILD_DB} and {CHILD_SYNCHRONOUS}");
    };
    let conn = rusqlite::Connection::open(path).expect("open");
    conn.execute_batch(&format!(
        "PRAGMA journal_mode=WAL; PRAGMA synchronous={synchronous};
         CREATE TABLE t (n INTEGER PRIMARY KEY, body TEXT);"
    ))
    .expect("set up");
    for n in 0..COMMITS {
        conn.execute(
            "INSERT INTO t (n, body) VALUES (?1, ?2)",
            rusqlite::params![n, "x".repeat(500)],
        )
        .expect("insert");
    }
    // SAFETY: a plain kill of this very process.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

/// Rows of table `t` after a child process made [`COMMITS`] one-row
/// commits at `synchronous` and died of SIGKILL, and a drop cut; with
/// the integrity check.
fn rows_after_a_kill_and_a_cut(synchronous: &str) -> (i64, String) {
    let m = Mounted::new();
    let path = m.path("db.sqlite");
    let status = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--ignored", "--exact", "sqlite_writer_child", "--nocapture"])
        .env(CHILD_DB, &path)
        .env(CHILD_SYNCHRONOUS, synchronous)
        .status()
        .expect("run the writer");
    {
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "the writer failed: {status}"
        );
    }
    m.fs.cut(Fault::Drop, 7).expect("cut");
    let conn = rusqlite::Connection::open(&path).expect("reopen");
    let count = conn
        .query_row("SELECT COUNT(*) FROM t", [], |row| row.get(0))
        .unwrap_or(0);
    let check = conn
        .query_row("PRAGMA integrity_check", [], |row| row.get(0))
        .unwrap_or_else(|e| e.to_string());
    (count, check)
}

#[test]
fn sqlite_at_synchronous_full_keeps_every_commit_across_a_kill_and_a_cut() {
    let (rows, check) = rows_after_a_kill_and_a_cut("FULL");
    assert_eq!((rows, check.as_str()), (COMMITS, "ok"));
}

#[test]
fn sqlite_without_syncs_loses_its_commits_at_a_cut() {
    // Shows the cut really drops what no sync covered (a kill alone
    // keeps every commit).
    let (rows, _) = rows_after_a_kill_and_a_cut("OFF");
    assert!(rows < COMMITS, "{rows} rows survived without a sync");
}
