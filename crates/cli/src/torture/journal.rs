//! Fsync'd journals: what the producer and the handlers of a torture run saw,
//! one JSON line per fact.
//!
//! The checker compares these facts with the final databases, so a fact is
//! only a fact once it is on disk: [`Journal::append`] writes one whole line
//! and then `sync_data`s the file before it returns, and callers append
//! *before* they act on the fact (the producer after its call returned `Ok`,
//! a handler before it returns). A process killed inside `append` may leave
//! a line without its newline; [`Journal::open`] ends such a torn line so the
//! next life starts on a fresh one, and [`read`] skips it and counts it.

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::TortureError;

/// An append-only journal file shared by every thread of one child process.
/// Cloning is one reference-count increment.
///
/// A std `Mutex` because no await happens while it is held: one line is
/// written and synced under it, which also keeps concurrent lines whole and
/// in the order their writers reached the file.
#[derive(Clone)]
pub struct Journal {
    path: Arc<PathBuf>,
    file: Arc<Mutex<File>>,
}

impl Journal {
    /// Opens (or creates) the journal at `path` for appending. A torn last
    /// line left by a killed process is ended with a newline first.
    pub fn open(path: &Path) -> Result<Journal, TortureError> {
        let io = |source| TortureError::Io {
            what: "cannot open the journal",
            path: path.to_path_buf(),
            source,
        };
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)
            .map_err(io)?;
        let length = file.metadata().map_err(io)?.len();
        if length > 0 {
            file.seek(SeekFrom::Start(length - 1)).map_err(io)?;
            let mut last = [0_u8; 1];
            file.read_exact(&mut last).map_err(io)?;
            if last[0] != b'\n' {
                file.write_all(b"\n").map_err(io)?;
                file.sync_data().map_err(io)?;
            }
        }
        Ok(Journal {
            path: Arc::new(path.to_path_buf()),
            file: Arc::new(Mutex::new(file)),
        })
    }

    /// Appends `fact` as one JSON line and syncs it to disk before returning.
    pub fn append<T: Serialize>(&self, fact: &T) -> Result<(), TortureError> {
        let mut line = serde_json::to_vec(fact).map_err(|source| TortureError::Encode {
            what: "a journal line",
            source,
        })?;
        line.push(b'\n');
        let io = |source| TortureError::Io {
            what: "cannot append to the journal",
            path: self.path.to_path_buf(),
            source,
        };
        let file = self
            .file
            .lock()
            .map_err(|_| TortureError::JournalPoisoned {
                path: self.path.to_path_buf(),
            })?;
        // One write_all of the whole line on an O_APPEND file, so a kill can
        // cut the line's tail but never interleave it with another line.
        (&*file).write_all(&line).map_err(io)?;
        file.sync_data().map_err(io)?;
        Ok(())
    }
}

/// The facts of one journal file, in the order they were written.
#[derive(Debug)]
pub struct Facts<T> {
    pub lines: Vec<T>,
    /// Lines a kill cut short (they were never acted on).
    pub torn: u64,
}

impl<T> Default for Facts<T> {
    fn default() -> Self {
        Facts {
            lines: Vec::new(),
            torn: 0,
        }
    }
}

/// Reads every fact of the journal at `path`; a missing file has none.
///
/// A line that does not parse can only be one a kill cut short: whole lines
/// are written by this program in one call. It is skipped and counted.
pub fn read<T: DeserializeOwned>(path: &Path) -> Result<Facts<T>, TortureError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Facts::default()),
        Err(source) => {
            return Err(TortureError::Io {
                what: "cannot read the journal",
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let mut facts = Facts::default();
    for line in text.lines().filter(|line| !line.is_empty()) {
        match serde_json::from_str(line) {
            Ok(fact) => facts.lines.push(fact),
            Err(_) => facts.torn += 1,
        }
    }
    Ok(facts)
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Fact {
        n: u32,
    }

    #[test]
    fn a_torn_line_is_ended_by_the_next_life_and_skipped_by_the_reader() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let path = dir.path().join("facts.jsonl");
        let journal = Journal::open(&path).unwrap_or_else(|e| panic!("open: {e}"));
        journal
            .append(&Fact { n: 1 })
            .unwrap_or_else(|e| panic!("append: {e}"));
        drop(journal);
        // What a kill in the middle of a write leaves behind.
        let mut file = OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("reopen: {e}"));
        file.write_all(b"{\"n\":")
            .unwrap_or_else(|e| panic!("write: {e}"));
        drop(file);
        let journal = Journal::open(&path).unwrap_or_else(|e| panic!("open again: {e}"));
        journal
            .append(&Fact { n: 2 })
            .unwrap_or_else(|e| panic!("append: {e}"));
        let facts: Facts<Fact> = read(&path).unwrap_or_else(|e| panic!("read: {e}"));
        assert_eq!(facts.lines, vec![Fact { n: 1 }, Fact { n: 2 }]);
        assert_eq!(facts.torn, 1);
    }
}
