//! `Fault::Reorder`: each unsynced block keeps or loses its write on its
//! own, one is torn at a sector, and a seed decides it all.

mod support;

use durability_powercut::{CutReport, Fault};
use support::{Mounted, durable_file, filled, open_rw, write_at};

const BLOCKS: usize = 16;
const BLOCK: usize = 4096;
const SECTOR: usize = 512;

/// A durable file of `BLOCKS` blocks of `a`, every block then overwritten
/// with `b` unsynced; cut with `seed`.
fn overwrite_and_cut(m: &Mounted, seed: u64) -> (Vec<u8>, CutReport) {
    durable_file(m, "f", &filled(b'a', BLOCKS * BLOCK));
    let file = open_rw(&m.path("f"));
    for block in 0..BLOCKS {
        write_at(&file, (block * BLOCK) as u64, &filled(b'b', BLOCK));
    }
    drop(file);
    let report = m.fs.cut(Fault::Reorder, seed).expect("cut");
    (m.read("f"), report)
}

/// How many sectors of a block hold the new content `b`, if they are a
/// prefix and every other sector holds `old`.
fn new_prefix_sectors(block: &[u8], old: u8) -> Option<usize> {
    let sectors: Vec<u8> = block.chunks(SECTOR).map(|s| s[0]).collect();
    let all_same = block
        .chunks(SECTOR)
        .all(|s| s.iter().all(|&byte| byte == s[0]));
    let new = sectors.iter().take_while(|&&b| b == b'b').count();
    (all_same && sectors[new..].iter().all(|&b| b == old)).then_some(new)
}

#[test]
fn reorder_keeps_some_unsynced_blocks_and_drops_others_with_one_torn() {
    let m = Mounted::new();
    let (mut ever_kept, mut ever_dropped) = (false, false);
    for seed in 0..8 {
        let (content, report) = overwrite_and_cut(&m, seed);
        assert_eq!(content.len(), BLOCKS * BLOCK, "overwrites change no size");
        let mut torn = 0;
        for block in content.chunks(BLOCK) {
            match new_prefix_sectors(block, b'a') {
                Some(8) => ever_kept = true,
                Some(0) => ever_dropped = true,
                Some(_) => torn += 1,
                None => panic!("block is not a new prefix over old sectors"),
            }
        }
        assert!(torn <= 1, "seed {seed}: {torn} torn blocks");
        assert_eq!(report.blocks_torn, 1);
        assert_eq!(
            report.blocks_kept + report.blocks_dropped + report.blocks_torn,
            BLOCKS as u64
        );
    }
    assert!(ever_kept && ever_dropped);
}

#[test]
fn reorder_is_deterministic_for_one_seed() {
    let first = overwrite_and_cut(&Mounted::new(), 42);
    let second = overwrite_and_cut(&Mounted::new(), 42);
    assert_eq!(first, second);
}

#[test]
fn reorder_keeps_or_drops_an_unsynced_size_change_and_zeros_what_went_back() {
    let (mut kept, mut dropped) = (false, false);
    let m = Mounted::new();
    for seed in 0..16 {
        let name = format!("g{seed}");
        durable_file(&m, &name, &filled(b'a', BLOCK));
        let file = open_rw(&m.path(&name));
        write_at(&file, BLOCK as u64, &filled(b'b', 3 * BLOCK));
        drop(file);
        m.fs.cut(Fault::Reorder, seed).expect("cut");
        let content = m.read(&name);
        assert!(content[..BLOCK].iter().all(|&b| b == b'a'));
        match content.len() {
            len if len == BLOCK => dropped = true,
            len if len == 4 * BLOCK => {
                kept = true;
                for block in content[BLOCK..].chunks(BLOCK) {
                    assert!(
                        new_prefix_sectors(block, 0).is_some(),
                        "a block beyond the old size is new or zeros"
                    );
                }
            }
            len => panic!("size {len} is neither the synced nor the new one"),
        }
    }
    assert!(kept && dropped);
}
