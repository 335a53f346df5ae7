//! What a torture workload is: the small trait every workload module
//! implements, and what the harness hands it.
//!
//! A workload has three parts. Its *objects* (built by [`Workload::construct`])
//! carry the capability under test and handlers that journal every
//! invocation. Its *producer* ([`Workload::produce`]) registers items and
//! journals each one only after the capability accepted it. Its *checker*
//! ([`Workload::check`]) runs in the supervising process after the last life
//! and compares both journals with the final databases. Pull-based
//! capabilities (the log) also have a *consumer* ([`Workload::consume`]).
//!
//! Adding a workload: one module with a type implementing [`Workload`], and
//! one line in `WORKLOADS` in `torture/mod.rs`.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::Duration;

use durability::HandlerError;
use durability_host::{BoxError, DurableObject, Host, Namespace, ObjectContext, Stub};
use durability_platform::{Context as _, EpochMs, StorageError};
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use rusqlite::{Connection, OpenFlags};
use serde::{Deserialize, Serialize};

use super::TortureError;
use super::backups::{BackupCopy, Presence};
use super::journal::Journal;
use super::verdict::{Allowance, Tally};
use crate::modes::Mode;

/// New items each life may add to the run, so that production is spread
/// over the kills instead of finishing in the first life.
pub const ITEMS_PER_LIFE: u64 = 8;

/// The longest pause of a producer between two items, in milliseconds: long
/// enough that kills land in the middle of production.
const PACE_MAX_MS: u64 = 4;

/// One torture workload. See the module documentation.
pub trait Workload: 'static {
    /// The name on the command line and in the verdict.
    const NAME: &'static str;
    /// One line for `--help`.
    const ABOUT: &'static str;
    /// The objects the items are spread over.
    const OBJECTS: u64 = 4;
    /// The object type, with the capability and the journaling handlers.
    type Object: DurableObject;

    /// Builds one object on the host; its handlers journal through `env`.
    fn construct(ctx: ObjectContext, env: &HandlerEnv) -> Result<Self::Object, BoxError>;

    /// Registers every item below [`Life::quota`] not journaled as accepted
    /// yet, journaling each to `produced` once the capability accepted it.
    fn produce(
        objects: &Objects<Self::Object>,
        produced: &Journal,
        life: &Life,
    ) -> impl Future<Output = Result<(), TortureError>>;

    /// One pass of the workload's consumers, journaling what they handled to
    /// `handled`; returns whether there was anything to consume. Push-based
    /// capabilities have none: their handlers run on their own.
    fn consume(
        objects: &Objects<Self::Object>,
        handled: &Journal,
        life: &Life,
    ) -> impl Future<Output = Result<bool, TortureError>> {
        let _ = (objects, handled, life);
        async { Ok(false) }
    }

    /// How much accepted work is not settled yet, read through the objects.
    /// The final life ends when this is zero.
    fn unsettled(
        objects: &Objects<Self::Object>,
    ) -> impl Future<Output = Result<u64, TortureError>>;

    /// Compares the journals with the final databases.
    fn check(run: &Finished) -> Result<Tally, TortureError>;

    /// Checks a backup taken during the run (`--backup-during`), restored:
    /// every item the producer journaled as accepted before its object was
    /// copied ([`BackupCopy::must_hold`]) is recorded in the copy's
    /// database, in whatever state: the copy is one moment of the run, so
    /// nothing in it need have ended. Items map to objects as in
    /// [`Workload::check`].
    fn check_copy(copy: &BackupCopy) -> Result<Presence, TortureError>;
}

/// The files of one workload's run, all under one directory.
#[derive(Debug, Clone)]
pub struct Files {
    dir: PathBuf,
}

impl Files {
    pub fn new(dir: PathBuf) -> Self {
        Files { dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The host's data directory (with `--power-cut`, the mountpoint of
    /// the power-cut filesystem).
    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// With `--power-cut`, the backing directory of the power-cut
    /// filesystem: where the data directory's files are once it is
    /// unmounted.
    pub fn disk(&self) -> PathBuf {
        self.dir.join("disk")
    }

    /// The machine's boot id as the child's host reads it, with power
    /// cuts: a cut of the filesystem is no reboot of this machine, so the
    /// supervisor writes a new id here at each one.
    pub fn boot_id(&self) -> PathBuf {
        self.dir.join("boot-id")
    }

    /// Written by a life once its host has started, so the supervisor can
    /// tell a host that refused to start from a life that failed later.
    pub fn started(&self) -> PathBuf {
        self.dir.join("started")
    }

    /// What the producer saw accepted.
    pub fn produced(&self) -> PathBuf {
        self.dir.join("produced.jsonl")
    }

    /// What handlers and consumers saw.
    pub fn handled(&self) -> PathBuf {
        self.dir.join("handled.jsonl")
    }

    /// Which database file holds which object.
    pub fn manifest(&self) -> PathBuf {
        self.dir.join("objects.json")
    }

    /// The children's stderr, every life appended.
    pub fn children_log(&self) -> PathBuf {
        self.dir.join("children.log")
    }

    /// How the supervisor's lives ended.
    pub fn supervised(&self) -> PathBuf {
        self.dir.join("supervised.json")
    }

    /// Marks the directory as the harness's, so a rerun may clear it.
    pub fn marker(&self) -> PathBuf {
        self.dir.join("torture-run")
    }

    /// Where `--backup-during` writes the backup taken during life `life`.
    pub fn backup(&self, life: u32) -> PathBuf {
        self.dir.join("backups").join(format!("life-{life}"))
    }

    /// Where `--backup-during` restores the backup taken during life
    /// `life`: a data directory of its own, outside the run's.
    pub fn restored(&self, life: u32) -> PathBuf {
        self.dir.join("restored").join(format!("life-{life}"))
    }

    /// Where the log workload's objects flush their cold segments, one
    /// sub-directory per object id.
    pub fn cold(&self) -> PathBuf {
        self.dir.join("cold")
    }
}

/// One life of the child process.
#[derive(Debug, Clone)]
pub struct Life {
    pub files: Files,
    pub seed: u64,
    /// 0 for the first life; the final life comes after every killed one.
    pub index: u32,
    /// The final life is not killed: it finishes production and waits until
    /// all accepted work is settled.
    pub is_final: bool,
    /// Items of the whole run.
    pub items: u64,
    /// The host's durability mode.
    pub mode: Mode,
    /// Passes of the consumers so far, so each pass draws anew.
    pub passes: Cell<u64>,
}

impl Life {
    /// How many items must be accepted by the end of this life's production.
    pub fn quota(&self) -> u64 {
        if self.is_final {
            self.items
        } else {
            let lives = u64::from(self.index) + 1;
            self.items.min(lives.saturating_mul(ITEMS_PER_LIFE))
        }
    }

    /// A random generator for `purpose` in this life, derived from the seed.
    pub fn rng(&self, purpose: &str) -> StdRng {
        StdRng::seed_from_u64(self.seed_for(purpose))
    }

    fn seed_for(&self, purpose: &str) -> u64 {
        roll(self.seed, purpose, "life", u64::from(self.index))
    }

    /// A random generator for `purpose` in the next pass of this life's
    /// consumers: each pass draws differently. (One generator per life
    /// made every pass draw the same: with a single range left, the leased
    /// consumer nacked it on every pass, 18,299 times, until the final
    /// life's settle timeout.)
    pub fn pass_rng(&self, purpose: &str) -> StdRng {
        let pass = self.passes.get();
        self.passes.set(pass.wrapping_add(1));
        StdRng::seed_from_u64(roll(self.seed_for(purpose), purpose, "pass", pass))
    }

    /// Sleeps a random moment between two items.
    pub async fn pace(rng: &mut StdRng) {
        let pause = rng.random_range(0..=PACE_MAX_MS);
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

/// The system clock in epoch milliseconds. A producer reads it right after
/// a call returned: the moment the item was acknowledged, journaled with it
/// so a backup's `copied_ms` (the same machine's system clock, read by the
/// backup process) says whether the copy must hold the item. Not the
/// host's clock: a test host's may be paused. A clock before 1970 reads 0.
pub fn system_now_ms() -> EpochMs {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            EpochMs::try_from(since.as_millis()).unwrap_or(EpochMs::MAX)
        })
}

/// A deterministic 64-bit roll of `(seed, what, key, n)`.
///
/// `DefaultHasher::new()` hashes identically in every process of one build,
/// which is all the harness needs: the parent and its children are the same
/// binary.
pub fn roll(seed: u64, what: &str, key: &str, n: u64) -> u64 {
    let mut hasher = DefaultHasher::new();
    (seed, what, key, n).hash(&mut hasher);
    hasher.finish()
}

/// The stubs of a workload's objects, `Workload::OBJECTS` of them.
pub struct Objects<T> {
    host: Host,
    stubs: Vec<Stub<T>>,
}

impl<T: DurableObject> Objects<T> {
    /// Stubs of objects `{prefix}-0` .. `{prefix}-{count - 1}`.
    pub fn new(
        host: &Host,
        namespace: &Namespace<T>,
        prefix: &str,
        count: u64,
    ) -> Result<Self, TortureError> {
        let stubs = (0..count.max(1))
            .map(|n| namespace.stub(&format!("{prefix}-{n}")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Objects {
            host: host.clone(),
            stubs,
        })
    }

    /// Every stub.
    pub fn all(&self) -> &[Stub<T>] {
        &self.stubs
    }

    /// The stub of object `n` modulo the count.
    pub fn get(&self, n: u64) -> Result<&Stub<T>, TortureError> {
        let count = u64::try_from(self.stubs.len()).unwrap_or(u64::MAX).max(1);
        let index = usize::try_from(n % count).unwrap_or(0);
        self.stubs
            .get(index)
            .ok_or(TortureError::NoObject { index: n })
    }

    /// The host's clock (epoch ms), the clock objects schedule by.
    pub fn now_ms(&self) -> EpochMs {
        self.host.now_ms()
    }

    /// Where each object's database is, for the checker.
    pub fn manifest(&self) -> Manifest {
        Manifest {
            objects: self
                .stubs
                .iter()
                .map(|stub| {
                    (
                        stub.name().to_owned(),
                        ManifestEntry {
                            id: stub.id().to_string(),
                            file: self.host.object_file(stub.id()),
                        },
                    )
                })
                .collect(),
        }
    }
}

/// Which database file holds which object, written by every life so the
/// checker never needs a host of its own.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Manifest {
    pub objects: BTreeMap<String, ManifestEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ManifestEntry {
    pub id: String,
    pub file: PathBuf,
}

/// What the checker gets: the run's files, the object manifest, where the
/// data directory's files are now, and what the run's mode allows.
pub struct Finished {
    pub files: Files,
    pub manifest: Manifest,
    /// The directory the data directory's files are read from: the data
    /// directory itself, or after a power-cut run the unmounted
    /// filesystem's backing directory.
    pub databases: PathBuf,
    pub allowance: Allowance,
}

impl Finished {
    /// An empty tally that applies the run's allowance.
    pub fn tally(&self) -> Tally {
        Tally::allowing(self.allowance)
    }

    /// Where the object's database is now. The manifest names it as the
    /// host saw it, under the data directory.
    pub fn database(&self, entry: &ManifestEntry) -> PathBuf {
        match entry.file.strip_prefix(self.files.data()) {
            Ok(relative) => self.databases.join(relative),
            Err(_) => entry.file.clone(),
        }
    }

    /// Opens the object's database read-only; `None` if its file was never
    /// created (the object never ran).
    pub fn open(&self, entry: &ManifestEntry) -> rusqlite::Result<Option<Connection>> {
        let path = self.database(entry);
        if !path.exists() {
            return Ok(None);
        }
        Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map(Some)
    }

    /// Runs `sql` on the object's database, opened read-only, mapping each
    /// row with `map`. An object whose file or `table` was never created
    /// (it never ran) has no rows.
    pub fn rows<T>(
        &self,
        entry: &ManifestEntry,
        table: &str,
        sql: &str,
        mut map: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<Vec<T>, TortureError> {
        let failed = |source| TortureError::Database {
            path: self.database(entry),
            source,
        };
        let Some(connection) = self.open(entry).map_err(failed)? else {
            return Ok(Vec::new());
        };
        let exists: i64 = connection
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type IN ('table', 'view') AND name = ?1",
                [table],
                |row| row.get(0),
            )
            .map_err(failed)?;
        if exists == 0 {
            return Ok(Vec::new());
        }
        let mut statement = connection.prepare(sql).map_err(failed)?;
        let rows = statement
            .query_map([], |row| map(row))
            .map_err(failed)?
            .collect::<Result<Vec<T>, _>>()
            .map_err(failed)?;
        Ok(rows)
    }
}

/// Runs a `SELECT count(*) ...` on an object's own storage, from inside
/// the object (the final life's "is everything settled" question).
pub fn count_rows(ctx: &ObjectContext, sql: &str) -> Result<u64, StorageError> {
    let count = ctx
        .storage()
        .query_row(sql, &[])?
        .map_or(Ok(0), |row| row.get::<i64>(0))?;
    Ok(u64::try_from(count).unwrap_or(0))
}

/// How one handler invocation ended, as the handler journaled it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Returned `Ok`.
    Ok,
    /// Returned a retryable error.
    Transient,
    /// Returned a non-retryable error.
    Permanent,
}

/// A handler invocation, journaled when it begins and again just before it
/// returns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptFact {
    /// `None` when the handler began, its outcome when it returned.
    pub returned: Option<Outcome>,
    /// The object's id.
    pub object: String,
    /// The record's key: the operation id or the alarm name.
    pub key: String,
    pub generation: String,
    pub attempt: u32,
    /// The life (process) the invocation ran in.
    pub life: u32,
    /// The occurrence's scheduled time, for named alarms.
    pub scheduled_time: Option<EpochMs>,
}

/// What the handlers of one life share: the journal, the seed that decides
/// which attempts fail, and the run's size. Cloning is cheap (one
/// reference-count increment and a few integers); it is `Send + Sync` so the
/// host's factory can hand it to every executor thread.
#[derive(Clone)]
pub struct HandlerEnv {
    pub journal: Journal,
    pub seed: u64,
    pub life: u32,
    pub items: u64,
    /// The run's files, for objects that keep data outside their database
    /// (the log's cold segments).
    pub files: Files,
}

/// How long an attempt the script makes slow takes: longer than any attempt
/// timeout of the workloads that allow slow attempts, so it times out.
pub const SLOW_ATTEMPT: Duration = Duration::from_millis(300);

impl HandlerEnv {
    /// Plays one attempt of record `key`: journals its start, takes the
    /// scripted time, journals its outcome, then returns it. Whether an
    /// attempt fails is a pure function of the seed, the key and the attempt
    /// number, so retries after a kill follow the same script.
    ///
    /// Script per key: about 6 % fail permanently, 6 % fail every attempt
    /// (and run out of attempts), the rest fail their first zero to two
    /// attempts and then succeed. With `slow`, 4 % of attempts outlast the
    /// attempt timeout.
    pub async fn attempt(&self, fact: AttemptFact, slow: bool) -> Result<(), HandlerError> {
        self.journal(&fact)?;
        let per_key = roll(
            self.seed,
            "key",
            &fact.key,
            fact.scheduled_time.map_or(0, |t| t.unsigned_abs()),
        );
        let per_attempt = roll(per_key, "attempt", "", u64::from(fact.attempt));
        let outcome = match per_key % 100 {
            0..6 => Outcome::Permanent,
            6..12 => Outcome::Transient,
            _ if u64::from(fact.attempt) > (per_key / 100) % 3 => Outcome::Ok,
            _ => Outcome::Transient,
        };
        let duration = if slow && per_attempt % 100 < 4 {
            SLOW_ATTEMPT
        } else {
            Duration::from_millis(1 + per_attempt % 25)
        };
        tokio::time::sleep(duration).await;
        let returned = AttemptFact {
            returned: Some(outcome),
            ..fact
        };
        self.journal(&returned)?;
        let marker = failure_marker(returned.attempt, &returned.generation);
        match outcome {
            Outcome::Ok => Ok(()),
            Outcome::Transient => Err(HandlerError::new(format!("transient {marker}"))),
            Outcome::Permanent => Err(HandlerError::non_retryable(format!("permanent {marker}"))),
        }
    }

    fn journal(&self, fact: &AttemptFact) -> Result<(), HandlerError> {
        self.journal.append(fact).map_err(|error| {
            tracing::error!(%error, "a torture handler cannot journal its attempt");
            HandlerError::new(format!("cannot journal the attempt: {error}"))
        })
    }
}

/// The text a scripted failure carries, so the checker can tell which
/// attempt's failure was stored.
pub fn failure_marker(attempt: u32, generation: &str) -> String {
    format!("torture-failure attempt={attempt} generation={generation}")
}

/// The attempt and generation of a stored scripted failure, or `None` for an
/// error the library made (attempts exhausted, timeout).
pub fn parse_failure_marker(message: &str) -> Option<(u32, String)> {
    let rest = message.split("torture-failure ").nth(1)?;
    let mut attempt = None;
    let mut generation = None;
    for part in rest.split_whitespace() {
        if let Some(value) = part.strip_prefix("attempt=") {
            attempt = value.parse().ok();
        } else if let Some(value) = part.strip_prefix("generation=") {
            generation = Some(value.to_owned());
        }
    }
    Some((attempt?, generation?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_marker_round_trips() {
        let text = format!("transient {}", failure_marker(3, "g-1"));
        assert_eq!(parse_failure_marker(&text), Some((3, "g-1".to_owned())));
        assert_eq!(parse_failure_marker("attempts exhausted"), None);
    }

    #[test]
    fn each_pass_of_a_life_draws_anew_and_a_rerun_draws_the_same() {
        use rand::Rng as _;
        let life = || Life {
            files: Files::new(PathBuf::from("unused")),
            seed: 7,
            index: 3,
            is_final: true,
            items: 20,
            mode: Mode::DEFAULT,
            passes: Cell::new(0),
        };
        let draws = |life: &Life| -> Vec<u64> {
            (0..8)
                .map(|_| life.pass_rng("consume").random_range(0..100))
                .collect()
        };
        let (first, again) = (draws(&life()), draws(&life()));
        assert_eq!(first, again, "a run with the same seed must repeat");
        let distinct: std::collections::BTreeSet<_> = first.iter().collect();
        assert!(distinct.len() > 1, "every pass drew the same: {first:?}");
    }

    #[test]
    fn quotas_spread_production_over_the_lives() {
        let life = |index, is_final| Life {
            files: Files::new(PathBuf::from("unused")),
            seed: 1,
            index,
            is_final,
            items: 20,
            mode: Mode::DEFAULT,
            passes: Cell::new(0),
        };
        assert_eq!(life(0, false).quota(), ITEMS_PER_LIFE);
        assert_eq!(life(1, false).quota(), 2 * ITEMS_PER_LIFE);
        assert_eq!(life(5, false).quota(), 20);
        assert_eq!(life(0, true).quota(), 20);
    }
}
