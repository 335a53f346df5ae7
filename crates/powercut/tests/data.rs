//! Data durability: what a cut keeps of a file's content and size.

mod support;

use durability_powercut::Fault;
use support::{Mounted, durable_file, filled, open_rw, write_at};

#[test]
fn an_unsynced_write_is_gone_after_a_drop_cut() {
    let m = Mounted::new();
    durable_file(&m, "f", &filled(b'a', 8192));
    let file = open_rw(&m.path("f"));
    write_at(&file, 100, b"unsynced");
    drop(file);
    assert_eq!(&m.read("f")[100..108], b"unsynced");

    let report = m.fs.cut(Fault::Drop, 1).expect("cut");

    assert_eq!(m.read("f"), filled(b'a', 8192));
    assert_eq!(report.files, 1);
    assert_eq!(report.blocks_dropped, 1);
}

#[test]
fn a_synced_write_survives_a_drop_cut() {
    let m = Mounted::new();
    durable_file(&m, "f", &filled(b'a', 4096));
    let file = open_rw(&m.path("f"));
    write_at(&file, 10, b"synced");
    file.sync_all().expect("fsync");
    drop(file);

    let report = m.fs.cut(Fault::Drop, 1).expect("cut");

    let mut expected = filled(b'a', 4096);
    expected[10..16].copy_from_slice(b"synced");
    assert_eq!(m.read("f"), expected);
    assert_eq!(report.files, 0);
}

#[test]
fn fdatasync_makes_a_write_durable() {
    let m = Mounted::new();
    durable_file(&m, "f", b"old");
    let file = open_rw(&m.path("f"));
    write_at(&file, 0, b"new content");
    file.sync_data().expect("fdatasync");
    drop(file);

    m.fs.cut(Fault::Drop, 1).expect("cut");

    assert_eq!(m.read("f"), b"new content");
}

#[test]
fn a_grown_file_goes_back_to_its_synced_size() {
    let m = Mounted::new();
    durable_file(&m, "f", &filled(b'a', 5000));
    let file = open_rw(&m.path("f"));
    write_at(&file, 5000, &filled(b'b', 20_000));
    file.set_len(40_000).expect("ftruncate up");
    drop(file);
    assert_eq!(std::fs::metadata(m.path("f")).expect("stat").len(), 40_000);

    m.fs.cut(Fault::Drop, 1).expect("cut");

    assert_eq!(m.read("f"), filled(b'a', 5000));
}

#[test]
fn a_shrunk_file_gets_its_synced_tail_back() {
    let m = Mounted::new();
    let content: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    durable_file(&m, "f", &content);
    let file = open_rw(&m.path("f"));
    file.set_len(3000).expect("ftruncate down");
    write_at(&file, 3000, b"after the truncate");
    drop(file);

    m.fs.cut(Fault::Drop, 1).expect("cut");

    assert_eq!(m.read("f"), content);
}

#[test]
fn an_unsynced_new_file_keeps_its_entry_but_no_data_after_a_drop_cut() {
    let m = Mounted::new();
    let file = open_rw(&m.path("new"));
    write_at(&file, 0, b"never synced");
    drop(file);

    m.fs.cut(Fault::Drop, 1).expect("cut");

    assert!(m.exists("new"));
    assert_eq!(m.read("new"), b"");
}

#[test]
fn after_a_cut_everything_left_is_durable() {
    let m = Mounted::new();
    durable_file(&m, "f", b"one");
    let file = open_rw(&m.path("f"));
    write_at(&file, 0, b"two");
    drop(file);
    m.fs.cut(Fault::Drop, 1).expect("first cut");
    assert_eq!(m.read("f"), b"one");

    let report = m.fs.cut(Fault::Drop, 2).expect("second cut");

    assert_eq!(m.read("f"), b"one");
    assert_eq!(report.files, 0);
}
