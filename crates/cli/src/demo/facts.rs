//! The demo's run directory: what a run set out to do (its plan) and the
//! facts its producer and its targets wrote to disk, read back to account
//! for every accepted message.
//!
//! Under the data directory (the host's files are beside them):
//!
//! ```text
//! objects/, index.sqlite            the host: one SQLite file per mailbox shard
//! runs/<n>/plan.json                what run n set out to do
//! runs/<n>/accepted.jsonl           one fsync'd line per accepted enqueue
//! runs/<n>/inbox.jsonl              one fsync'd line per inbox batch
//! runs/<n>/archive/<shard>/<id>.json  the archive target's entries
//! runs/<n>/dlq/<id>.<target>.json   dead letters
//! runs/<n>/digests/<shard>.json     what the digest operation wrote
//! runs/<n>/summary.json             written when run n finished
//! ```
//!
//! A run is finished when its `summary.json` exists; a later invocation on
//! the same directory resumes the last run if it is not. Nothing here is
//! counted in memory: every number the summary reports about messages is
//! read back from these files (and the objects' parked tables).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::DemoError;
use super::mailbox::{INBOX, TARGETS};
use crate::torture::journal;

/// Messages per enqueue call (one routing push, one transaction).
pub const ENQUEUE_BATCH: u64 = 100;

/// What one run sets out to do. Written before its first enqueue, so a
/// resumed run produces exactly the messages the interrupted one would have.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The run's number, from 1; part of every message id.
    pub run: u32,
    /// Messages the run enqueues.
    pub messages: u64,
    /// Mailbox shards (objects) the messages are spread over.
    pub shards: u32,
    /// Messages per enqueue call.
    pub batch_size: u64,
}

impl Plan {
    /// How many enqueue calls the run makes.
    pub fn batches(&self) -> u64 {
        self.messages.div_ceil(self.batch_size)
    }

    /// The message numbers of batch `batch`.
    pub fn batch_range(&self, batch: u64) -> Range<u64> {
        let start = batch.saturating_mul(self.batch_size).min(self.messages);
        start..start.saturating_add(self.batch_size).min(self.messages)
    }

    /// The id of message number `n`: unique across runs, so a message of
    /// run 2 never deduplicates against one of run 1 on the same object.
    pub fn message_id(&self, n: u64) -> String {
        format!("r{}-{n:08}", self.run)
    }
}

/// The producer's journal line: one accepted enqueue call, written after it
/// returned `Accepted` and before the next one starts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AcceptedFact {
    pub batch: u64,
    pub shard: String,
    pub count: u64,
}

/// The inbox consumer's journal line for one batch it handled, written
/// before it returns (and so before the delivered messages are acked).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct InboxFact {
    pub shard: String,
    /// Handed to the recipient's inbox; acked when the consumer returns.
    pub delivered: Vec<String>,
    /// Asked to be delivered again later.
    pub retried: Vec<String>,
    /// Dead-lettered: the recipient has no mailbox.
    pub bounced: Vec<String>,
}

/// The paths of one run.
#[derive(Debug, Clone)]
pub struct RunPaths {
    dir: PathBuf,
}

impl RunPaths {
    /// The paths of run `run` under `data_dir`.
    pub fn of(data_dir: &Path, run: u32) -> Self {
        RunPaths {
            dir: runs_dir(data_dir).join(run.to_string()),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn plan(&self) -> PathBuf {
        self.dir.join("plan.json")
    }

    pub fn accepted(&self) -> PathBuf {
        self.dir.join("accepted.jsonl")
    }

    pub fn inbox(&self) -> PathBuf {
        self.dir.join("inbox.jsonl")
    }

    pub fn summary(&self) -> PathBuf {
        self.dir.join("summary.json")
    }

    fn archive(&self) -> PathBuf {
        self.dir.join("archive")
    }

    /// The archive directory of one shard.
    pub fn archive_of(&self, shard: &str) -> PathBuf {
        self.archive().join(file_key(shard))
    }

    /// The archive entry of `message_id`, written by shard `shard`.
    pub fn archive_entry(&self, shard: &str, message_id: &str) -> PathBuf {
        self.archive_of(shard)
            .join(format!("{}.json", file_key(message_id)))
    }

    fn dlq(&self) -> PathBuf {
        self.dir.join("dlq")
    }

    /// The dead letter of `message_id` for `target`.
    pub fn dlq_entry(&self, message_id: &str, target: &str) -> PathBuf {
        self.dlq().join(format!(
            "{}.{}.json",
            file_key(message_id),
            file_key(target)
        ))
    }

    /// The digest of shard `shard`.
    pub fn digest(&self, shard: &str) -> PathBuf {
        self.dir
            .join("digests")
            .join(format!("{}.json", file_key(shard)))
    }
}

fn runs_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("runs")
}

/// The run an invocation works on, and whether it resumes an interrupted one.
#[derive(Debug)]
pub struct OpenedRun {
    pub plan: Plan,
    pub paths: RunPaths,
    pub resumed: bool,
}

/// Finds the last run under `data_dir`: resumes it if it did not finish,
/// otherwise starts the next one with `messages` and `shards`.
pub fn open_run(data_dir: &Path, messages: u64, shards: u32) -> Result<OpenedRun, DemoError> {
    let runs = runs_dir(data_dir);
    fs::create_dir_all(&runs).map_err(|source| DemoError::Io {
        what: "cannot create the runs directory",
        path: runs.clone(),
        source,
    })?;
    let last = last_run(&runs)?;
    if let Some(run) = last {
        let paths = RunPaths::of(data_dir, run);
        if !paths.summary().exists() {
            if let Some(plan) = read_json::<Plan>(&paths.plan())? {
                return Ok(OpenedRun {
                    plan,
                    paths,
                    resumed: true,
                });
            }
            // Killed before its plan was written: it accepted nothing, so
            // its number is reused for a fresh plan.
            return start(paths, run, messages, shards);
        }
    }
    let run = last.map_or(1, |run| run.saturating_add(1));
    start(RunPaths::of(data_dir, run), run, messages, shards)
}

fn start(paths: RunPaths, run: u32, messages: u64, shards: u32) -> Result<OpenedRun, DemoError> {
    let plan = Plan {
        run,
        messages,
        shards,
        batch_size: ENQUEUE_BATCH,
    };
    fs::create_dir_all(paths.dir()).map_err(|source| DemoError::Io {
        what: "cannot create the run directory",
        path: paths.dir().to_path_buf(),
        source,
    })?;
    write_json_atomically(&paths.plan(), &plan)?;
    Ok(OpenedRun {
        plan,
        paths,
        resumed: false,
    })
}

/// The highest run number under `runs`.
fn last_run(runs: &Path) -> Result<Option<u32>, DemoError> {
    let entries = fs::read_dir(runs).map_err(|source| DemoError::Io {
        what: "cannot list the runs directory",
        path: runs.to_path_buf(),
        source,
    })?;
    let mut last = None;
    for entry in entries {
        let entry = entry.map_err(|source| DemoError::Io {
            what: "cannot list the runs directory",
            path: runs.to_path_buf(),
            source,
        })?;
        if let Some(run) = entry.file_name().to_str().and_then(|n| n.parse().ok()) {
            last = last.max(Some(run));
        }
    }
    Ok(last)
}

/// Reads a JSON file; a missing file is `None`.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, DemoError> {
    let text = match fs::read(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(DemoError::Io {
                what: "cannot read",
                path: path.to_path_buf(),
                source,
            });
        }
    };
    serde_json::from_slice(&text)
        .map(Some)
        .map_err(|source| DemoError::Decode {
            path: path.to_path_buf(),
            source,
        })
}

/// Writes `value` as JSON to `path` through a synced temporary file and a
/// rename, so a kill leaves either the old file or the whole new one.
pub fn write_json_atomically<T: Serialize>(path: &Path, value: &T) -> Result<(), DemoError> {
    let text = serde_json::to_vec_pretty(value).map_err(|source| DemoError::Encode {
        what: "a run file",
        source,
    })?;
    let temporary = path.with_extension("json.tmp");
    let io = |source| DemoError::Io {
        what: "cannot write",
        path: path.to_path_buf(),
        source,
    };
    let mut file = fs::File::create(&temporary).map_err(io)?;
    file.write_all(&text).map_err(io)?;
    file.sync_all().map_err(io)?;
    fs::rename(&temporary, path).map_err(io)
}

/// Writes `bytes` to `path` unless an entry exists there: entries are keyed
/// and never overwritten, so a write repeated after a crash or a timeout
/// changes nothing. Returns whether this call created the entry.
///
/// The bytes go to a synced temporary file first and are published with a
/// hard link, which fails if the entry exists: a kill leaves either no
/// entry or a whole one, never a torn file that a retry would then keep.
pub fn write_once(path: &Path, bytes: &[u8]) -> std::io::Result<bool> {
    static TEMPORARIES: AtomicU64 = AtomicU64::new(0);
    if path.exists() {
        return Ok(false);
    }
    let parent = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(parent)?;
    let n = TEMPORARIES.fetch_add(1, Ordering::Relaxed);
    let temporary = parent.join(format!(".tmp-{}-{n}", std::process::id()));
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temporary)?;
        file.write_all(bytes)?;
        file.sync_data()?;
        match fs::hard_link(&temporary, path) {
            Ok(()) => Ok(true),
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(error) => Err(error),
        }
    })();
    let _ = fs::remove_file(&temporary);
    written
}

/// A file-name-safe key for an id: the id itself when it is made of ASCII
/// letters, digits, `-` and `_` (every id the demo makes), else `x-` and
/// its bytes in hex, so no id ever becomes a path of its own.
pub fn file_key(id: &str) -> String {
    let plain = !id.is_empty()
        && !id.starts_with("x-")
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if plain {
        id.to_owned()
    } else {
        let hex: String = id.bytes().map(|b| format!("{b:02x}")).collect();
        format!("x-{hex}")
    }
}

/// The id a [`file_key`] was made from.
fn id_of_key(key: &str) -> Option<String> {
    let Some(hex) = key.strip_prefix("x-") else {
        return Some(key.to_owned());
    };
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| {
            hex.get(i..i + 2)
                .and_then(|b| u8::from_str_radix(b, 16).ok())
        })
        .collect();
    bytes.and_then(|bytes| String::from_utf8(bytes).ok())
}

/// Everything the files of one run say.
#[derive(Debug, Default)]
pub struct Facts {
    /// Batches whose enqueue was accepted (journaled by the producer).
    pub accepted_batches: BTreeSet<u64>,
    /// Messages handed to the inbox, by id (at least once each).
    pub inbox_delivered: HashSet<String>,
    /// Inbox deliveries counted with repeats: a message delivered again
    /// after a crash before its ack counts twice here.
    pub inbox_deliveries: u64,
    /// Retries the inbox asked for.
    pub retries: u64,
    /// Archive entries, by message id.
    pub archived: HashSet<String>,
    /// Dead letters: (message id, target).
    pub dead_letters: HashSet<(String, String)>,
    /// Journal lines a kill cut short (never acted on).
    pub torn_lines: u64,
}

impl Facts {
    /// Reads every fact of the run at `paths`.
    pub fn read(paths: &RunPaths) -> Result<Facts, DemoError> {
        let mut facts = Facts::default();
        let accepted = journal::read::<AcceptedFact>(&paths.accepted())?;
        facts.torn_lines += accepted.torn;
        facts.accepted_batches = accepted.lines.iter().map(|fact| fact.batch).collect();
        let inbox = journal::read::<InboxFact>(&paths.inbox())?;
        facts.torn_lines += inbox.torn;
        for fact in inbox.lines {
            facts.inbox_deliveries += fact.delivered.len() as u64;
            facts.retries += fact.retried.len() as u64;
            facts.inbox_delivered.extend(fact.delivered);
        }
        for shard in list(&paths.archive())? {
            if shard.is_dir() {
                for entry in list(&shard)? {
                    if let Some(id) = entry_stem(&entry).and_then(id_of_key) {
                        facts.archived.insert(id);
                    }
                }
            }
        }
        for entry in list(&paths.dlq())? {
            let Some(stem) = entry_stem(&entry) else {
                continue;
            };
            let mut keys = stem.splitn(2, '.');
            if let (Some(message), Some(target)) = (
                keys.next().and_then(id_of_key),
                keys.next().and_then(id_of_key),
            ) {
                facts.dead_letters.insert((message, target));
            }
        }
        Ok(facts)
    }

    /// The messages delivered to `target`, by id.
    pub fn delivered_to(&self, target: &str) -> &HashSet<String> {
        if target == INBOX {
            &self.inbox_delivered
        } else {
            &self.archived
        }
    }

    /// Settled (message, target) pairs: delivered to a target or dead-lettered.
    pub fn deliveries(&self) -> u64 {
        (self.inbox_delivered.len() + self.archived.len() + self.dead_letters.len()) as u64
    }
}

/// The name of a `.json` entry without its extension; temporary files and
/// anything else are skipped.
fn entry_stem(path: &Path) -> Option<&str> {
    path.file_name()?.to_str()?.strip_suffix(".json")
}

/// The entries of a directory; a missing directory has none.
fn list(dir: &Path) -> Result<Vec<PathBuf>, DemoError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(DemoError::Io {
                what: "cannot list",
                path: dir.to_path_buf(),
                source,
            });
        }
    };
    entries
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(|source| DemoError::Io {
            what: "cannot list",
            path: dir.to_path_buf(),
            source,
        })
}

/// How many lost (message, target) pairs a summary names.
pub const LOST_SHOWN: usize = 20;

/// Where each accepted message ended, per target, from the facts and the
/// parked entries of the objects.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Accounting {
    pub accepted: u64,
    /// Delivered accepted messages, per target.
    pub delivered: HashMap<&'static str, u64>,
    /// Dead letters of accepted messages, per target.
    pub dead_lettered: HashMap<&'static str, u64>,
    /// Parked entries of accepted messages (terminal without a DLQ).
    pub parked: u64,
    /// Accepted messages with a target where they reached no end.
    pub lost: u64,
    /// The first [`LOST_SHOWN`] of them: (message id, target).
    pub lost_examples: Vec<(String, &'static str)>,
    /// Inbox deliveries beyond the first of their message (at least once).
    pub redelivered: u64,
}

impl Accounting {
    /// Checks every accepted message of `plan` against `facts` and
    /// `parked` ((message id, target) pairs) on every target.
    pub fn of(plan: &Plan, facts: &Facts, parked: &HashSet<(String, String)>) -> Accounting {
        let mut accounting = Accounting::default();
        let mut key = (String::new(), String::new());
        for batch in &facts.accepted_batches {
            for n in plan.batch_range(*batch) {
                let id = plan.message_id(n);
                accounting.accepted += 1;
                let mut ended = true;
                for target in TARGETS {
                    key.0.clone_from(&id);
                    key.1.clear();
                    key.1.push_str(target);
                    if facts.delivered_to(target).contains(&id) {
                        *accounting.delivered.entry(target).or_default() += 1;
                    } else if facts.dead_letters.contains(&key) {
                        *accounting.dead_lettered.entry(target).or_default() += 1;
                    } else if parked.contains(&key) {
                        accounting.parked += 1;
                    } else {
                        ended = false;
                        if accounting.lost_examples.len() < LOST_SHOWN {
                            accounting.lost_examples.push((id.clone(), target));
                        }
                    }
                }
                if !ended {
                    accounting.lost += 1;
                }
            }
        }
        accounting.redelivered = facts
            .inbox_deliveries
            .saturating_sub(facts.inbox_delivered.len() as u64);
        accounting
    }
}

#[cfg(test)]
mod tests {
    use super::super::mailbox::ARCHIVE;
    use super::*;

    #[test]
    fn file_keys_round_trip_and_never_contain_a_separator() {
        for id in ["r1-00000042", "inbox", "a/b", "../x", "x-1", "", "α.β"] {
            let key = file_key(id);
            assert!(!key.contains('/') && !key.contains('.'), "{key}");
            assert_eq!(id_of_key(&key).as_deref(), Some(id), "{key}");
        }
    }

    #[test]
    fn write_once_never_overwrites_an_entry() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let path = dir.path().join("a").join("entry.json");
        assert!(write_once(&path, b"first").unwrap_or_else(|e| panic!("{e}")));
        assert!(!write_once(&path, b"second").unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(fs::read(&path).unwrap_or_else(|e| panic!("{e}")), b"first");
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(dir.path().join("a"))
            .unwrap_or_else(|e| panic!("{e}"))
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, ["entry.json"]);
    }

    #[test]
    fn a_message_without_an_end_on_every_target_is_lost() {
        let plan = Plan {
            run: 1,
            messages: 3,
            shards: 1,
            batch_size: 3,
        };
        let mut facts = Facts::default();
        facts.accepted_batches.insert(0);
        let (a, b, c) = (plan.message_id(0), plan.message_id(1), plan.message_id(2));
        facts.inbox_delivered.extend([a.clone(), b.clone()]);
        facts.inbox_deliveries = 3;
        facts.archived.extend([a.clone(), c.clone()]);
        facts.dead_letters.insert((c, INBOX.into()));
        let parked: HashSet<_> = [(b, ARCHIVE.to_owned())].into();
        let accounting = Accounting::of(&plan, &facts, &parked);
        assert_eq!(accounting.accepted, 3);
        assert_eq!(accounting.lost, 0);
        assert_eq!(accounting.parked, 1);
        assert_eq!(accounting.redelivered, 1);
        let mut facts_without_archive = facts;
        facts_without_archive.archived.remove(&a);
        let accounting = Accounting::of(&plan, &facts_without_archive, &parked);
        assert_eq!(accounting.lost, 1);
    }
}
