//! `Fault::Metadata`: namespace changes no directory sync covered may be
//! undone; those one covered stay.

mod support;

use std::fs;

use durability_powercut::Fault;
use support::{Mounted, durable_file, open_rw, sync_dir, write_at};

const SEEDS: u64 = 16;

#[test]
fn a_created_file_whose_directory_was_not_synced_can_vanish() {
    let m = Mounted::new();
    let (mut vanished, mut stayed) = (0, 0);
    for seed in 0..SEEDS {
        let name = format!("new{seed}");
        let file = open_rw(&m.path(&name));
        write_at(&file, 0, b"data");
        file.sync_all()
            .expect("fsync of the file, not of its directory");
        drop(file);
        m.fs.cut(Fault::Metadata, seed).expect("cut");
        if m.exists(&name) {
            assert_eq!(m.read(&name), b"data");
            stayed += 1;
        } else {
            vanished += 1;
        }
    }
    assert!(
        vanished > 0 && stayed > 0,
        "vanished {vanished}, stayed {stayed}"
    );
}

#[test]
fn a_created_file_whose_directory_was_synced_survives() {
    let m = Mounted::new();
    for seed in 0..SEEDS {
        let name = format!("new{seed}");
        durable_file(&m, &name, b"data");
        let report = m.fs.cut(Fault::Metadata, seed).expect("cut");
        assert_eq!(report.namespace_pending, 0);
        assert_eq!(m.read(&name), b"data");
    }
}

#[test]
fn an_unlinked_file_whose_directory_was_not_synced_can_come_back_with_its_synced_content() {
    let m = Mounted::new();
    let mut came_back = 0;
    for seed in 0..SEEDS {
        let name = format!("old{seed}");
        durable_file(&m, &name, b"synced");
        let file = open_rw(&m.path(&name));
        write_at(&file, 0, b"UNSYNCED and longer");
        drop(file);
        fs::remove_file(m.path(&name)).expect("unlink");
        assert!(!m.exists(&name));

        m.fs.cut(Fault::Metadata, seed).expect("cut");

        if m.exists(&name) {
            assert_eq!(m.read(&name), b"synced");
            came_back += 1;
        }
    }
    assert!(came_back > 0 && came_back < SEEDS);
}

#[test]
fn a_durable_unlink_stays() {
    let m = Mounted::new();
    durable_file(&m, "f", b"synced");
    fs::remove_file(m.path("f")).expect("unlink");
    sync_dir(m.fs.mountpoint());
    for seed in 0..4 {
        m.fs.cut(Fault::Metadata, seed).expect("cut");
        assert!(!m.exists("f"));
    }
}

#[test]
fn an_undone_rename_over_a_file_restores_both() {
    let m = Mounted::new();
    let mut undone = 0;
    for seed in 0..SEEDS {
        let (from, to) = (format!("from{seed}"), format!("to{seed}"));
        durable_file(&m, &from, b"new");
        durable_file(&m, &to, b"old");
        fs::rename(m.path(&from), m.path(&to)).expect("rename");

        let report = m.fs.cut(Fault::Metadata, seed).expect("cut");

        if report.undone == 1 {
            undone += 1;
            assert_eq!(m.read(&from), b"new");
            assert_eq!(m.read(&to), b"old");
        } else {
            assert!(!m.exists(&from));
            assert_eq!(m.read(&to), b"new");
        }
    }
    assert!(undone > 0 && undone < SEEDS);
}

#[test]
fn a_directory_whose_parent_was_not_synced_can_vanish_with_its_durable_entries() {
    let m = Mounted::new();
    for seed in 0..SEEDS {
        let dir = format!("d{seed}");
        fs::create_dir(m.path(&dir)).expect("mkdir");
        durable_file(&m, &format!("{dir}/f"), b"in the new directory");
        // The file's entry is durable in d, d's entry in the root is not.
        let report = m.fs.cut(Fault::Metadata, seed).expect("cut");
        assert_eq!(report.namespace_pending, 1);
        if report.undone == 1 {
            assert!(!m.exists(&dir));
        } else {
            assert_eq!(m.read(&format!("{dir}/f")), b"in the new directory");
        }
    }
}

#[test]
fn the_stash_is_never_visible_through_the_mount() {
    let m = Mounted::new();
    durable_file(&m, "f", b"x");
    fs::remove_file(m.path("f")).expect("unlink");
    let names: Vec<_> = fs::read_dir(m.fs.mountpoint())
        .expect("readdir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(names.is_empty(), "{names:?}");
    assert!(!m.exists(".powercut-stash"));
    assert!(m.backing.join(".powercut-stash").is_dir());
}
