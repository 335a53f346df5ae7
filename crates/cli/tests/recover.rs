//! `durability recover` as an operator meets it: the real binary in child
//! processes, a demo SIGKILLed after it was acknowledged some batches, and
//! its journal damaged on disk the way a disk that lost synced bytes
//! damages it (a zeroed stretch with synced passes after it). The judges
//! are the exit codes of the next start, of `recover`, of `inspect` and of
//! a demo run afterwards, never what the code under test says is durable.

use std::io::{BufRead as _, BufReader};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

mod support;
use support::{durability_with as durability, path_arg, show};

/// What the demo prints on stderr once paused (its `PAUSED_MARKER`).
const PAUSED: &str = "demo paused by --pause-after-batches";

/// The bytes a test zeroes in a segment.
const HOLE: u64 = 64 << 10;

/// Runs a demo on `dir` until it has been acknowledged `batches` batches
/// of mails, then kills it with SIGKILL.
fn demo_killed_after(dir: &Path, batches: &str) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_durability"))
        .args(["demo", "--data-dir", path_arg(dir), "--json"])
        .args(["--messages", "3000", "--shards", "4"])
        .args(["--pause-after-batches", batches])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("cannot start the durability binary: {error}"));
    let stderr = child
        .stderr
        .take()
        .unwrap_or_else(|| panic!("no stderr pipe"));
    let mut seen = Vec::new();
    let mut paused = false;
    for line in BufReader::new(stderr).lines() {
        let line = line.unwrap_or_else(|error| panic!("cannot read stderr: {error}"));
        if line.contains(PAUSED) {
            paused = true;
            break;
        }
        seen.push(line);
    }
    if let Err(error) = child.kill() {
        panic!("cannot kill the demo: {error}");
    }
    let status = child.wait();
    assert!(
        paused,
        "the demo ended ({status:?}) without pausing; stderr:\n{}",
        seen.join("\n")
    );
}

/// Where the last byte of `bytes` that is not zero ends.
fn data_end(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .rposition(|&b| b != 0)
        .map_or(0, |at| at as u64 + 1)
}

/// The journal segment of `dir` holding the most data, with that length.
fn fullest_segment(dir: &Path) -> (PathBuf, u64) {
    let journal = dir.join("journal");
    let entries = std::fs::read_dir(&journal)
        .unwrap_or_else(|error| panic!("no journal in {}: {error}", journal.display()));
    entries
        .map(|entry| entry.unwrap_or_else(|error| panic!("{error}")).path())
        .filter(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("segment-") && name.ends_with(".log"))
        })
        .map(|path| {
            let bytes = std::fs::read(&path).unwrap_or_else(|error| panic!("{error}"));
            let end = data_end(&bytes);
            (path, end)
        })
        .max_by_key(|(_, end)| *end)
        .unwrap_or_else(|| panic!("no journal segment in {}", journal.display()))
}

/// The bytes of every object file (database and WAL) under `dir`, by path.
fn object_files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.join("objects")];
    while let Some(at) = dirs.pop() {
        for entry in std::fs::read_dir(&at).unwrap_or_else(|error| panic!("{error}")) {
            let path = entry.unwrap_or_else(|error| panic!("{error}")).path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let bytes = std::fs::read(&path).unwrap_or_else(|error| panic!("{error}"));
                files.push((path, bytes));
            }
        }
    }
    files.sort();
    files
}

#[test]
fn recover_refuses_a_directory_that_is_not_a_data_directory() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    std::fs::write(dir.path().join("notes.txt"), "not a data directory")
        .unwrap_or_else(|e| panic!("{e}"));
    let output = durability(&["recover", path_arg(dir.path())]);
    assert!(!output.status.success(), "{}", show(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("is not a durability data directory")
            && stderr.contains(path_arg(dir.path())),
        "{}",
        show(&output)
    );
    assert!(dir.path().join("notes.txt").exists());
}

#[test]
fn a_journal_that_lost_synced_bytes_refuses_a_start_until_recover_applies_what_is_whole() {
    let root = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let data = root.path().join("data");
    demo_killed_after(&data, "20");
    let (segment, end) = fullest_segment(&data);
    // A stretch well inside the journal, with synced passes after it.
    let at = end / 3;
    assert!(
        end >= 256 << 10 && at + HOLE + (64 << 10) < end,
        "the journal holds too little to damage ({end} bytes in {})",
        segment.display()
    );
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .unwrap_or_else(|e| panic!("{e}"));
    file.write_all_at(&vec![0; HOLE as usize], at)
        .unwrap_or_else(|e| panic!("{e}"));
    drop(file);
    let objects = object_files(&data);
    let damaged = std::fs::read(&segment).unwrap_or_else(|e| panic!("{e}"));

    // The next start refuses, naming the way out, and touches nothing.
    let refused = durability(&["demo", "--data-dir", path_arg(&data), "--json"]);
    assert!(!refused.status.success(), "{}", show(&refused));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("lost synced records") && stderr.contains("durability recover"),
        "{}",
        show(&refused)
    );
    assert!(
        object_files(&data) == objects,
        "a refused start touched an object file"
    );
    assert!(std::fs::read(&segment).unwrap_or_default() == damaged);

    let recovered = durability(&["recover", path_arg(&data), "--json"]);
    assert!(recovered.status.success(), "{}", show(&recovered));
    let report: Value = serde_json::from_slice(&recovered.stdout)
        .unwrap_or_else(|e| panic!("recover --json is not JSON ({e}): {}", show(&recovered)));
    let damaged_segments = report["damaged"].as_array().cloned().unwrap_or_default();
    assert_eq!(damaged_segments.len(), 1, "{report:#}");
    let lost = &damaged_segments[0]["lost"][0];
    // Every pass starts at a 4 KiB block: a hole that begins in the
    // padding after a pass loses nothing before the next block.
    assert!(
        lost["start"]
            .as_u64()
            .is_some_and(|start| start <= at.next_multiple_of(4096))
            && lost["end"].as_u64().is_some_and(|stop| stop >= at + HOLE),
        "the lost stretch does not cover the hole at {at}: {report:#}"
    );
    assert!(report["records_applied"].as_u64() > Some(0), "{report:#}");
    // The damaged segment is kept aside as it was.
    let moved = PathBuf::from(report["moved_to"].as_str().unwrap_or_default());
    let kept = moved.join(segment.file_name().unwrap_or_default());
    assert!(
        std::fs::read(&kept).unwrap_or_default() == damaged,
        "{report:#}"
    );

    // Every object opens, and a host starts on the directory and finishes
    // the interrupted run to its summary. That summary may count lost
    // mails (then the demo exits non-zero): the commits of the hole and
    // those recover left out are gone, which is what it reported.
    let inspected = durability(&["inspect", path_arg(&data)]);
    assert!(inspected.status.success(), "{}", show(&inspected));
    let again = durability(&["demo", "--data-dir", path_arg(&data), "--json"]);
    let summary: Value = serde_json::from_slice(&again.stdout)
        .unwrap_or_else(|e| panic!("no summary after recover ({e}): {}", show(&again)));
    assert_eq!(summary["accepted"].as_u64(), Some(3000), "{summary:#}");
    assert_eq!(
        again.status.success(),
        summary["lost"].as_u64() == Some(0),
        "{}",
        show(&again)
    );
}
