//! Injected failures: a sync that fails with EIO and a disk that fills up.

mod support;

use std::os::unix::fs::FileExt;

use durability_powercut::Fault;
use support::{Mounted, durable_file, filled, open_rw, write_at};

#[test]
fn a_failed_fsync_returns_eio_and_a_later_fsync_does_not_make_its_writes_durable() {
    let m = Mounted::new();
    durable_file(&m, "f", &filled(b'a', 8192));
    let file = open_rw(&m.path("f"));
    write_at(&file, 0, &filled(b'b', 4096));
    m.fs.fail_fsync(1);

    let failed = file.sync_all().expect_err("the armed fsync fails");
    assert_eq!(failed.raw_os_error(), Some(libc::EIO));
    file.sync_all()
        .expect("the next fsync succeeds, as on Linux");
    drop(file);

    m.fs.cut(Fault::Drop, 1).expect("cut");
    assert_eq!(m.read("f"), filled(b'a', 8192));
}

#[test]
fn a_block_written_again_after_a_failed_fsync_is_covered_by_the_next_one() {
    let m = Mounted::new();
    durable_file(&m, "f", &filled(b'a', 8192));
    let file = open_rw(&m.path("f"));
    write_at(&file, 0, &filled(b'b', 8192));
    m.fs.fail_fsync(1);
    file.sync_data().expect_err("the armed fdatasync fails");
    write_at(&file, 0, &filled(b'c', 4096));
    file.sync_data().expect("fdatasync");
    drop(file);

    m.fs.cut(Fault::Drop, 1).expect("cut");

    let mut expected = filled(b'c', 4096);
    expected.extend(filled(b'a', 4096));
    assert_eq!(m.read("f"), expected);
}

#[test]
fn fail_fsync_counts_syncs_from_now() {
    let m = Mounted::new();
    let file = open_rw(&m.path("f"));
    m.fs.fail_fsync(3);
    file.sync_all().expect("first");
    file.sync_data().expect("second");
    assert_eq!(
        file.sync_all().expect_err("third").raw_os_error(),
        Some(libc::EIO)
    );
    file.sync_all().expect("fourth");
}

#[test]
fn a_full_disk_fails_the_nth_write_and_every_later_one_until_the_cut() {
    let m = Mounted::new();
    durable_file(&m, "f", b"synced");
    let plain = open_rw(&m.path("f"));
    m.fs.fill_at_write(2);

    write_at(&plain, 0, b"first write fits");
    let enospc = |e: std::io::Error| assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
    enospc(plain.write_all_at(b"second", 100).expect_err("full"));
    enospc(plain.write_all_at(b"third", 200).expect_err("still full"));
    enospc(plain.set_len(1 << 20).expect_err("growing is writing"));
    plain.set_len(4).expect("shrinking needs no space");
    drop(plain);
    assert_eq!(m.read("f"), b"firs");

    m.fs.cut(Fault::Drop, 1).expect("cut");

    assert_eq!(m.read("f"), b"synced");
    let file = open_rw(&m.path("f"));
    write_at(&file, 0, b"space again");
}

/// A shared writable mapping of a whole file, unmapped on drop.
struct Mapping {
    at: *mut u8,
    len: usize,
}

impl Mapping {
    fn of(file: &std::fs::File, len: usize) -> Mapping {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of `len` bytes of a descriptor
        // `file` keeps open for the call; nothing else aliases it.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(
            at,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Mapping { at: at.cast(), len }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `at` maps `len` bytes until drop.
        unsafe { std::slice::from_raw_parts_mut(self.at, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `at` and `len` are what mmap returned and was given.
        unsafe { libc::munmap(self.at.cast(), self.len) };
    }
}

/// SQLite's -shm is shared memory between the processes of one machine:
/// another process opening the file (a backup beside a live host) must
/// not take back what a running one wrote through its mapping, even when
/// the disk is full and nothing can be written back. Only a cut may.
#[test]
fn a_full_disk_keeps_what_a_live_process_wrote_through_a_shared_mapping_when_another_opens_the_file()
 {
    let m = Mounted::new();
    durable_file(&m, "shm", &filled(0, 32768));
    let file = open_rw(&m.path("shm"));
    let mut mapping = Mapping::of(&file, 32768);
    mapping.bytes()[0] = b'a';
    mapping.bytes()[5000] = b'b';
    m.fs.fill_at_write(1);
    mapping.bytes()[1] = b'c';

    let other = std::fs::File::open(m.path("shm")).expect("a second open");
    let mut seen = [0; 2];
    other.read_exact_at(&mut seen, 0).expect("read");
    assert_eq!(seen, *b"ac", "what the second open reads");
    let kept = (
        mapping.bytes()[0],
        mapping.bytes()[1],
        mapping.bytes()[5000],
    );
    assert_eq!(kept, (b'a', b'c', b'b'), "what the live mapping holds");
    drop((other, mapping, file));

    m.fs.cut(Fault::Drop, 1).expect("cut");

    assert_eq!(m.read("shm"), filled(0, 32768), "nothing synced it");
}

/// What the test above protects, as the torture's backups met it: a WAL
/// database that a live connection committed to, opened by another
/// reader once the disk filled, showed the reader none of the committed
/// rows (the WAL index lost all but its header page).
#[test]
fn a_full_disk_does_not_hide_a_live_wal_from_a_new_reader() {
    let m = Mounted::new();
    let db = m.path("db.sqlite");
    let conn = rusqlite::Connection::open(&db).expect("open");
    conn.execute_batch(
        "PRAGMA journal_mode = WAL; PRAGMA wal_autocheckpoint = 0;
         CREATE TABLE t (x); PRAGMA wal_checkpoint(TRUNCATE);",
    )
    .expect("set up");
    for n in 0..50 {
        conn.execute("INSERT INTO t VALUES (?1)", [n])
            .expect("insert");
    }
    let count = |conn: &rusqlite::Connection| {
        conn.query_row("SELECT count(*) FROM t", [], |row| row.get::<_, i64>(0))
            .expect("count")
    };
    assert_eq!(count(&conn), 50);
    // The second write fails: the first page of a write-back fits.
    m.fs.fill_at_write(2);

    // Another process's SQLite opens the -shm first thing.
    drop(std::fs::File::open(m.path("db.sqlite-shm")).expect("open the -shm"));
    let reader =
        rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("open a reader");

    assert_eq!((count(&conn), count(&reader)), (50, 50));
}
