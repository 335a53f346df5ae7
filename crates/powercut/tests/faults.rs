//! The faults beyond the basic cut: blocks kept out of order and torn,
//! namespace changes undone, a failing sync, a full disk; and a real
//! SQLite database on the mount.

mod support;

use std::collections::HashSet;
use std::os::fd::AsRawFd as _;

use durability_powercut::Fault;
use support::{Mounted, durable_file, filled, open_rw, sync_dir, write_at};

const BLOCK: usize = 4096;

/// Which of the 16 blocks of `f` hold the new byte after an unsynced
/// rewrite of all of them and a reorder cut with `seed`, on a fresh mount.
fn kept_blocks(seed: u64) -> (Vec<bool>, u64) {
    let m = Mounted::new();
    durable_file(&m, "f", &filled(b'o', 16 * BLOCK));
    let file = open_rw(&m.path("f"));
    write_at(&file, 0, &filled(b'n', 16 * BLOCK));
    drop(file);
    let report = m.fs.cut(Fault::Reorder, seed).expect("cut");
    let after = m.read("f");
    assert_eq!(after.len(), 16 * BLOCK, "the size was synced");
    let mut torn = 0;
    let kept = after
        .chunks(BLOCK)
        .map(|block| {
            let new = block.iter().filter(|&&b| b == b'n').count();
            assert!(
                block.iter().all(|&b| b == b'n' || b == b'o'),
                "only old or new bytes"
            );
            if new != 0 && new != BLOCK {
                torn += 1;
                // Torn at a sector: new sectors first, then old ones.
                assert_eq!(new % 512, 0, "torn at a 512-byte sector");
                assert!(block[..new].iter().all(|&b| b == b'n'));
            }
            new == BLOCK
        })
        .collect();
    assert_eq!(torn, report.blocks_torn, "{report:?}");
    assert!(report.blocks_torn <= 1, "{report:?}");
    (kept, report.blocks_kept)
}

#[test]
fn a_reorder_cut_keeps_an_arbitrary_subset_of_unsynced_blocks_the_same_for_one_seed() {
    let mut patterns = HashSet::new();
    let mut some_kept_some_dropped = false;
    for seed in 0..8 {
        let (kept, count) = kept_blocks(seed);
        assert_eq!(kept.iter().filter(|&&k| k).count() as u64, count);
        some_kept_some_dropped |= kept.iter().any(|&k| k) && kept.iter().any(|&k| !k);
        // A later block may survive where an earlier one did not.
        patterns.insert(kept);
    }
    assert!(some_kept_some_dropped, "no cut kept a strict subset");
    assert!(patterns.len() > 1, "every seed kept the same blocks");
    assert_eq!(kept_blocks(5), kept_blocks(5), "a seed decides the cut");
}

#[test]
fn an_unsynced_creation_can_vanish_and_a_synced_one_stays() {
    let m = Mounted::new();
    let (mut vanished, mut stayed) = (0, 0);
    for seed in 0..24 {
        let name = format!("new-{seed}");
        durable_file_without_dir(&m, &name);
        m.fs.cut(Fault::Metadata, seed).expect("cut");
        if m.exists(&name) {
            stayed += 1;
            assert_eq!(m.read(&name), b"data", "its synced data came along");
        } else {
            vanished += 1;
        }
    }
    assert!(
        vanished > 0 && stayed > 0,
        "vanished {vanished}, stayed {stayed}"
    );
    // With its directory synced, a creation is durable whatever the seed.
    for seed in 0..8 {
        let name = format!("synced-{seed}");
        durable_file(&m, &name, b"data");
        m.fs.cut(Fault::Metadata, seed).expect("cut");
        assert!(m.exists(&name), "{name} vanished");
    }
}

/// A file whose data is synced but whose directory entry is not.
fn durable_file_without_dir(m: &Mounted, name: &str) {
    let file = open_rw(&m.path(name));
    write_at(&file, 0, b"data");
    file.sync_all().expect("fsync");
}

#[test]
fn an_unlinked_file_whose_directory_was_not_synced_can_come_back_with_its_synced_content() {
    let m = Mounted::new();
    let mut came_back = false;
    for seed in 0..24 {
        let name = format!("old-{seed}");
        durable_file(&m, &name, b"synced content");
        std::fs::remove_file(m.path(&name)).expect("unlink");
        m.fs.cut(Fault::Metadata, seed).expect("cut");
        if m.exists(&name) {
            came_back = true;
            assert_eq!(m.read(&name), b"synced content");
        }
    }
    assert!(came_back, "no unlink was undone");
    // A removal whose directory was synced stays removed.
    durable_file(&m, "gone", b"x");
    std::fs::remove_file(m.path("gone")).expect("unlink");
    sync_dir(m.fs.mountpoint());
    m.fs.cut(Fault::Metadata, 3).expect("cut");
    assert!(!m.exists("gone"));
}

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
fn a_failed_fsync_reports_eio_and_a_later_fsync_does_not_cover_what_it_lost() {
    let m = Mounted::new();
    durable_file(&m, "f", &filled(b'a', 2 * BLOCK));
    let file = open_rw(&m.path("f"));
    write_at(&file, 0, &filled(b'b', BLOCK));
    m.fs.fail_fsync(1);
    let error = file.sync_data().expect_err("the armed fsync fails");
    assert_eq!(error.raw_os_error(), Some(libc::EIO), "{error}");
    // Linux after a writeback error: the next sync succeeds, but the
    // lost block is not made durable by it; a block written after the
    // failure is.
    write_at(&file, BLOCK as u64, &filled(b'c', BLOCK));
    file.sync_data().expect("the next fsync succeeds");
    drop(file);
    m.fs.cut(Fault::Drop, 1).expect("cut");
    let after = m.read("f");
    assert_eq!(
        &after[..BLOCK],
        &filled(b'a', BLOCK)[..],
        "the failed write is gone"
    );
    assert_eq!(
        &after[BLOCK..],
        &filled(b'c', BLOCK)[..],
        "the later write is durable"
    );
}

#[test]
fn a_full_disk_refuses_writes_from_the_chosen_one_until_the_cut() {
    let m = Mounted::new();
    durable_file(&m, "f", b"");
    let file = open_rw(&m.path("f"));
    m.fs.fill_at_write(2);
    write_at(&file, 0, b"first");
    let error = std::os::unix::fs::FileExt::write_at(&file, b"second", 5).expect_err("full");
    assert_eq!(error.raw_os_error(), Some(libc::ENOSPC), "{error}");
    let error = std::os::unix::fs::FileExt::write_at(&file, b"third", 5).expect_err("still full");
    assert_eq!(error.raw_os_error(), Some(libc::ENOSPC), "{error}");
    assert_eq!(m.read("f"), b"first", "nothing of a refused write");
    drop(file);
    m.fs.cut(Fault::Drop, 1).expect("cut");
    let file = open_rw(&m.path("f"));
    write_at(&file, 0, b"after the reboot");
}

#[test]
fn direct_io_set_with_fcntl_works_and_is_not_durable_until_synced() {
    #[repr(C, align(4096))]
    struct Aligned([u8; BLOCK]);
    let m = Mounted::new();
    durable_file(&m, "d", &filled(0, BLOCK));
    let file = open_rw(&m.path("d"));
    // SAFETY: plain fcntl calls on an open descriptor.
    let set = unsafe {
        let flags = libc::fcntl(file.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags | libc::O_DIRECT)
    };
    assert_eq!(
        set,
        0,
        "O_DIRECT refused: {}",
        std::io::Error::last_os_error()
    );
    let block = Aligned([7; BLOCK]);
    write_at(&file, 0, &block.0);
    drop(file);
    assert_eq!(m.read("d"), filled(7, BLOCK));
    m.fs.cut(Fault::Drop, 1).expect("cut");
    assert_eq!(
        m.read("d"),
        filled(0, BLOCK),
        "a direct write is no more durable than another"
    );
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
