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
