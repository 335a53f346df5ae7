//! `Fault::TornOverwrite`: a write in flight over synced bytes leaves
//! them garbled, even when it was writing them unchanged; nothing else is
//! touched but what a drop takes back.

mod support;

use durability_powercut::Fault;
use support::{Mounted, durable_file, filled, open_rw, write_at};

const BLOCK: usize = 4096;

/// A durable file of four blocks of `a`, then unsynced: block 1's bytes
/// 100..300 written again unchanged, block 2 overwritten with `b`, and a
/// fifth block of `c` appended. Cut with `seed`.
fn overwrite_and_cut(m: &Mounted, name: &str, seed: u64) -> (Vec<u8>, u64) {
    durable_file(m, name, &filled(b'a', 4 * BLOCK));
    let file = open_rw(&m.path(name));
    write_at(&file, (BLOCK + 100) as u64, &filled(b'a', 200));
    write_at(&file, (2 * BLOCK) as u64, &filled(b'b', BLOCK));
    write_at(&file, (4 * BLOCK) as u64, &filled(b'c', BLOCK));
    drop(file);
    let report = m.fs.cut(Fault::TornOverwrite, seed).expect("cut");
    (m.read(name), report.bytes_garbled)
}

#[test]
fn a_torn_overwrite_garbles_the_synced_bytes_it_covered_and_nothing_else() {
    let m = Mounted::new();
    for seed in 0..4 {
        let name = format!("f{seed}");
        let (content, garbled) = overwrite_and_cut(&m, &name, seed);
        assert_eq!(content.len(), 4 * BLOCK, "the append went back");
        assert_eq!(garbled, 200 + BLOCK as u64);
        let untouched = [0..BLOCK + 100, BLOCK + 300..2 * BLOCK, 3 * BLOCK..4 * BLOCK];
        for range in untouched {
            assert!(
                content[range.clone()].iter().all(|&b| b == b'a'),
                "seed {seed}: {range:?} changed"
            );
        }
        // Rewritten unchanged, and still neither the old nor the new bytes.
        assert!(
            content[BLOCK + 100..BLOCK + 300].iter().all(|&b| b != b'a'),
            "seed {seed}: an identical rewrite was not garbled"
        );
        assert!(
            content[2 * BLOCK..3 * BLOCK]
                .iter()
                .all(|&b| b != b'a' && b != b'b'),
            "seed {seed}: an overwrite kept old or new bytes"
        );
    }
}

#[test]
fn a_synced_overwrite_is_durable_and_never_garbled() {
    let m = Mounted::new();
    durable_file(&m, "f", &filled(b'a', 2 * BLOCK));
    let file = open_rw(&m.path("f"));
    write_at(&file, 10, &filled(b'b', BLOCK));
    file.sync_data().expect("fdatasync");
    // Beyond the synced size: no synced byte under it.
    write_at(&file, (2 * BLOCK) as u64, &filled(b'c', 10));
    drop(file);
    let report = m.fs.cut(Fault::TornOverwrite, 3).expect("cut");
    assert_eq!(report.bytes_garbled, 0);
    let mut expected = filled(b'a', 2 * BLOCK);
    expected[10..10 + BLOCK].fill(b'b');
    assert_eq!(m.read("f"), expected);
}

#[test]
fn a_torn_overwrite_is_deterministic_for_one_seed() {
    let first = overwrite_and_cut(&Mounted::new(), "f", 42);
    let second = overwrite_and_cut(&Mounted::new(), "f", 42);
    assert_eq!(first, second);
}
