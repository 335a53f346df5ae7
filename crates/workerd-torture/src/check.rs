//! The checker: judges a finished run from outside workerd, with the rules
//! of the embedded `durability torture` (crates/cli/src/torture), from two
//! sources only: what the runner saw acknowledged ([`Acks`]) and the object
//! databases workerd left in its storage directory, copied after the final
//! stop and opened read-only.
//!
//! - Every database passes `PRAGMA integrity_check` (else `corrupt`).
//! - Attempts (the attempt log, per record and generation): no attempt
//!   number above [`MAX_ATTEMPTS`] or below 1 (`over_attempts`), no number
//!   run twice (`duplicate_attempts`: the claim commits before its handler's
//!   first log row, so a kill uses the number up), no two handlers of one
//!   record running at once in one object instance (`overlapping_handlers`).
//! - Every acknowledged item reached its end (else `lost`): an operation's
//!   log shows `ok`, `permanent` or its last attempt begun, and its row is
//!   not pending; a named alarm's last acknowledged schedule, or a later one
//!   of its name, likewise; a fanout message, for each target, was acked by
//!   an `ok` run or is parked; a log record is stored at the offset its
//!   append answered, with its key, and was consumed.
//! - Log: offsets dense from 0; the stored cursor is not behind a commit the
//!   runner saw acknowledged (`stale_settlements`); a key keeps one offset.
//! - Recurring schedules: the walk of the embedded checker, ticks in order
//!   from the schedule's first, each gap explained by the missed count the
//!   run was told (else `lost`), no tick run as two occurrences and no
//!   occurrence at two ticks (`doubled_occurrences`), ticks on the grid.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OpenFlags};
use serde_json::{Map, Value, json};

use crate::producer::Acks;
use crate::protocol::{MAX_ATTEMPTS, Outcome, SCHEDULES, TARGETS};

/// Violation messages kept per capability; the counts are always complete.
const MAX_EXAMPLES: usize = 12;

/// The file in which workerd indexes a namespace's objects (not an object).
const WORKERD_METADATA: &str = "metadata.sqlite";

/// The findings for one capability, as the embedded torture's tally.
#[derive(Debug, Default)]
pub struct Tally {
    pub accepted: u64,
    pub completed: u64,
    pub lost: u64,
    pub over_attempts: u64,
    pub stale_settlements: u64,
    pub corrupt: u64,
    /// Other broken invariants, by name.
    pub broken: BTreeMap<&'static str, u64>,
    pub detail: Map<String, Value>,
    pub examples: Vec<String>,
}

/// A broken guarantee, by the counter it goes to.
#[derive(Debug, Clone, Copy)]
pub enum Violation {
    Lost,
    OverAttempts,
    StaleSettlement,
    Corrupt,
    Broken(&'static str),
}

impl Tally {
    pub fn flag(&mut self, violation: Violation, message: impl Into<String>) {
        match violation {
            Violation::Lost => self.lost += 1,
            Violation::OverAttempts => self.over_attempts += 1,
            Violation::StaleSettlement => self.stale_settlements += 1,
            Violation::Corrupt => self.corrupt += 1,
            Violation::Broken(name) => *self.broken.entry(name).or_default() += 1,
        }
        if self.examples.len() < MAX_EXAMPLES {
            self.examples.push(message.into());
        }
    }

    fn add(&mut self, key: &str, value: u64) {
        let old = self.detail.get(key).and_then(Value::as_u64).unwrap_or(0);
        self.detail.insert(key.to_owned(), json!(old + value));
    }

    pub fn violations(&self) -> u64 {
        self.lost
            + self.over_attempts
            + self.stale_settlements
            + self.corrupt
            + self.broken.values().sum::<u64>()
    }

    pub fn to_json(&self) -> Value {
        json!({
            "accepted": self.accepted,
            "completed": self.completed,
            "lost": self.lost,
            "over_attempts": self.over_attempts,
            "stale_settlements": self.stale_settlements,
            "corrupt": self.corrupt,
            "other_violations": self.broken,
            "violations": self.violations(),
            "detail": self.detail,
            "examples": self.examples,
        })
    }
}

/// One handler run from the attempt log.
#[derive(Debug, Clone)]
struct Run {
    kind: String,
    key: String,
    generation: String,
    attempt: u32,
    instance: String,
    scheduled: Option<i64>,
    missed: Option<i64>,
    outcome: Option<String>,
}

/// What one object's database holds, read once.
#[derive(Debug, Default)]
struct Object {
    runs: Vec<Run>,
    /// Operation id -> status.
    calls: HashMap<String, String>,
    /// One-shot and recurring alarm rows: name -> (status, scheduled_at).
    alarms: HashMap<String, (String, i64)>,
    /// Recurring schedules: name -> (created_at, missed).
    schedules: HashMap<String, (i64, i64)>,
    /// Parked fanout deliveries: (message id, target).
    parked: HashSet<(String, String)>,
    /// Log records: offset -> (key, payload).
    records: BTreeMap<u64, (String, String)>,
    cursor: Option<u64>,
    consumed: BTreeSet<u64>,
}

/// The verdict of a run: one tally per capability.
#[derive(Debug, Default)]
pub struct Verdict {
    pub tallies: BTreeMap<&'static str, Tally>,
    /// The databases found, by object name.
    pub objects: BTreeMap<String, PathBuf>,
}

impl Verdict {
    fn tally(&mut self, name: &'static str) -> &mut Tally {
        self.tallies.entry(name).or_default()
    }

    pub fn sum(&self, field: impl Fn(&Tally) -> u64) -> u64 {
        self.tallies.values().map(field).sum()
    }

    pub fn violations(&self) -> u64 {
        self.sum(Tally::violations)
    }
}

/// Copies every object database (with its WAL) out of workerd's storage
/// directory into `copies`, checks each copy, reads it and judges the run.
/// `owed` is what the objects said they still owed after the drain.
pub fn check(
    storage: &Path,
    copies: &Path,
    acks: &Acks,
    owed: &BTreeMap<String, Value>,
) -> Verdict {
    let mut verdict = Verdict::default();
    let mut objects: BTreeMap<String, Object> = BTreeMap::new();
    for file in databases(storage, &mut verdict) {
        let copy = match copy_database(&file, copies) {
            Ok(copy) => copy,
            Err(error) => {
                verdict.tally("integrity").flag(
                    Violation::Corrupt,
                    format!("{}: cannot copy: {error}", file.display()),
                );
                continue;
            }
        };
        // workerd's own index of the namespace's objects: checked, not read.
        if file.file_name().is_some_and(|n| n == WORKERD_METADATA) {
            if let Err(error) = open_checked(&copy) {
                verdict
                    .tally("integrity")
                    .flag(Violation::Corrupt, format!("{}: {error}", file.display()));
            }
            continue;
        }
        match read_object(&copy) {
            Ok((name, object)) => {
                verdict.objects.insert(name.clone(), file.clone());
                objects.insert(name, object);
            }
            Err(error) => verdict
                .tally("integrity")
                .flag(Violation::Corrupt, format!("{}: {error}", file.display())),
        }
    }
    let tally = verdict.tally("integrity");
    tally.add("databases", u64::try_from(objects.len()).unwrap_or(0));
    for object in objects.values() {
        check_attempts(&object.runs, verdict.tally("attempts"));
    }
    check_operations(&objects, acks, verdict.tally("operations"));
    check_alarms(&objects, acks, verdict.tally("alarms"));
    check_fanout(&objects, acks, owed, verdict.tally("fanout"));
    check_log(&objects, acks, verdict.tally("log"));
    check_recurring(&objects, verdict.tally("recurring"));
    verdict
}

/// Every `*.sqlite` file under workerd's storage directory (one per Durable
/// Object; workerd names them by the object's id).
fn databases(storage: &Path, verdict: &mut Verdict) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![storage.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(error) => {
                verdict.tally("integrity").flag(
                    Violation::Corrupt,
                    format!("{}: cannot list: {error}", dir.display()),
                );
                continue;
            }
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "sqlite") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// Copies `file` and its `-wal` and `-shm` beside it (when present) into
/// `dir`, so the check never touches workerd's own files.
fn copy_database(file: &Path, dir: &Path) -> std::io::Result<PathBuf> {
    let name = file.file_name().unwrap_or_default();
    let copy = dir.join(name);
    fs::copy(file, &copy)?;
    for suffix in ["-wal", "-shm"] {
        let mut side = file.as_os_str().to_owned();
        side.push(suffix);
        let side = PathBuf::from(side);
        if side.exists() {
            let mut target = copy.as_os_str().to_owned();
            target.push(suffix);
            fs::copy(&side, PathBuf::from(target))?;
        }
    }
    Ok(copy)
}

/// Opens the copy read-only and runs `PRAGMA integrity_check` on it.
fn open_checked(copy: &Path) -> Result<Connection, String> {
    let db = Connection::open_with_flags(copy, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .map_err(|e| format!("cannot open: {e}"))?;
    let integrity: Vec<String> = db
        .prepare("PRAGMA integrity_check")
        .and_then(|mut s| {
            s.query_map([], |row| row.get::<_, String>(0))?
                .collect::<Result<_, _>>()
        })
        .map_err(|e| format!("integrity_check: {e}"))?;
    if integrity != ["ok"] {
        return Err(format!("integrity_check: {}", integrity.join("; ")));
    }
    Ok(db)
}

/// Checks the copy, then reads the attempt log and the capabilities' rows
/// the checks need.
fn read_object(copy: &Path) -> Result<(String, Object), String> {
    let db = open_checked(copy)?;
    let e = |what: &'static str| move |error: rusqlite::Error| format!("{what}: {error}");
    let name: String = db
        .query_row("SELECT name FROM torture_meta WHERE id = 1", [], |r| {
            r.get(0)
        })
        .map_err(e("torture_meta"))?;
    let has = |table: &str| -> bool {
        db.query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
            [table],
            |r| r.get::<_, i64>(0),
        )
        .is_ok_and(|n| n > 0)
    };
    let mut object = Object::default();
    let mut runs = db
        .prepare(
            "SELECT kind, key, generation, attempt, instance, scheduled, missed, outcome \
             FROM torture_runs ORDER BY seq",
        )
        .map_err(e("torture_runs"))?;
    object.runs = runs
        .query_map([], |r| {
            Ok(Run {
                kind: r.get(0)?,
                key: r.get(1)?,
                generation: r.get(2)?,
                attempt: r.get(3)?,
                instance: r.get(4)?,
                scheduled: r.get(5)?,
                missed: r.get(6)?,
                outcome: r.get(7)?,
            })
        })
        .and_then(|rows| rows.collect::<Result<_, _>>())
        .map_err(e("torture_runs"))?;
    if has("durability_calls") {
        object.calls = query(&db, "SELECT id, status FROM durability_calls", |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?;
    }
    if has("durability_alarms") {
        object.alarms = query(
            &db,
            "SELECT name, status, scheduled_at FROM durability_alarms",
            |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?))),
        )?;
    }
    if has("durability_alarm_schedules") {
        object.schedules = query(
            &db,
            "SELECT name, created_at, missed FROM durability_alarm_schedules",
            |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?))),
        )?;
    }
    if has("durability_fanout_parked") {
        object.parked = query(
            &db,
            "SELECT message_id, target_id FROM durability_fanout_parked",
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
    }
    if has("durability_log_records") {
        object.records = query(
            &db,
            "SELECT \"offset\", dedup_key, payload FROM durability_log_records",
            |r| Ok((r.get::<_, u64>(0)?, (r.get(1)?, r.get(2)?))),
        )?;
        object.cursor = db
            .query_row(
                "SELECT \"offset\" FROM durability_log_cursors WHERE consumer = ?1",
                [crate::protocol::LOG_CONSUMER],
                |r| r.get(0),
            )
            .ok();
    }
    object.consumed = query(&db, "SELECT \"offset\" FROM torture_consumed", |r| r.get(0))?;
    Ok((name, object))
}

fn query<T, C: FromIterator<T>>(
    db: &Connection,
    sql: &str,
    map: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> Result<C, String> {
    db.prepare(sql)
        .and_then(|mut s| s.query_map([], map)?.collect::<Result<C, _>>())
        .map_err(|e| format!("{sql}: {e}"))
}

/// The attempt rules, per object: numbers in range, none run twice, no two
/// handlers of one record at once in one instance.
fn check_attempts(runs: &[Run], tally: &mut Tally) {
    let mut began: HashSet<(&str, &str, &str, u32)> = HashSet::new();
    let mut running: HashMap<(&str, &str, &str), u32> = HashMap::new();
    let mut over: HashSet<(&str, &str, &str, u32)> = HashSet::new();
    let mut instances = HashSet::new();
    let (mut invocations, mut returns, mut retries) = (0_u64, 0_u64, 0_u64);
    for run in runs {
        instances.insert(run.instance.as_str());
        let attempt = (
            run.kind.as_str(),
            run.key.as_str(),
            run.generation.as_str(),
            run.attempt,
        );
        if (run.attempt == 0 || run.attempt > MAX_ATTEMPTS) && over.insert(attempt) {
            tally.flag(
                Violation::OverAttempts,
                format!(
                    "{} {} ran attempt {} of generation {} (max {MAX_ATTEMPTS})",
                    run.kind, run.key, run.attempt, run.generation
                ),
            );
        }
        let slot = (run.instance.as_str(), run.kind.as_str(), run.key.as_str());
        match &run.outcome {
            None => {
                invocations += 1;
                if run.attempt > 1 {
                    retries += 1;
                }
                if !began.insert(attempt) {
                    tally.flag(
                        Violation::Broken("duplicate_attempts"),
                        format!(
                            "{} {} ran attempt {} of generation {} twice",
                            run.kind, run.key, run.attempt, run.generation
                        ),
                    );
                }
                if let Some(other) = running.insert(slot, run.attempt) {
                    tally.flag(
                        Violation::Broken("overlapping_handlers"),
                        format!(
                            "{} {} began attempt {} in instance {} while attempt {other} still ran",
                            run.kind, run.key, run.attempt, run.instance
                        ),
                    );
                }
            }
            Some(outcome) => {
                returns += 1;
                if Outcome::parse(outcome).is_none() {
                    tally.flag(
                        Violation::Broken("unknown_outcomes"),
                        format!("{} {}: outcome {outcome:?}", run.kind, run.key),
                    );
                }
                if running.remove(&slot) != Some(run.attempt) {
                    tally.flag(
                        Violation::Broken("unmatched_returns"),
                        format!(
                            "{} {} returned attempt {} in instance {} without having begun it",
                            run.kind, run.key, run.attempt, run.instance
                        ),
                    );
                }
            }
        }
    }
    tally.add("invocations", invocations);
    tally.add(
        "interrupted_invocations",
        invocations.saturating_sub(returns),
    );
    tally.add("retry_invocations", retries);
    tally.add(
        "object_instances",
        u64::try_from(instances.len()).unwrap_or(0),
    );
}

/// Whether the runs of one record (one generation, or a set of them) show
/// an end: a run that returned `ok` or `permanent`, or the last attempt
/// begun (it returned a retryable failure or a kill cut it off; either way
/// no attempt is left).
fn ended<'a>(runs: impl IntoIterator<Item = &'a Run>) -> bool {
    runs.into_iter().any(|run| match run.outcome.as_deref() {
        Some("ok") | Some("permanent") => true,
        _ => run.outcome.is_none() && run.attempt >= MAX_ATTEMPTS,
    })
}

fn runs_of<'a>(
    object: &'a Object,
    kind: &'a str,
    key: &'a str,
) -> impl Iterator<Item = &'a Run> + 'a {
    object
        .runs
        .iter()
        .filter(move |run| run.kind == kind && run.key == key)
}

fn object_of<'a>(
    objects: &'a BTreeMap<String, Object>,
    name: &str,
    tally: &mut Tally,
) -> Option<&'a Object> {
    let object = objects.get(name);
    if object.is_none() {
        tally.flag(
            Violation::Lost,
            format!("object {name} acknowledged work but has no database"),
        );
    }
    object
}

fn check_operations(objects: &BTreeMap<String, Object>, acks: &Acks, tally: &mut Tally) {
    for (name, ids) in &acks.ops {
        tally.accepted += u64::try_from(ids.len()).unwrap_or(0);
        let Some(object) = object_of(objects, name, tally) else {
            continue;
        };
        for id in ids {
            let status = object.calls.get(id).map_or("missing", String::as_str);
            if ended(runs_of(object, "op", id)) && matches!(status, "completed" | "failed") {
                tally.completed += 1;
                tally.add(status, 1);
            } else {
                tally.flag(
                    Violation::Lost,
                    format!("operation {id} on {name} did not end (row {status})"),
                );
            }
        }
    }
}

fn check_alarms(objects: &BTreeMap<String, Object>, acks: &Acks, tally: &mut Tally) {
    for (name, alarms) in &acks.alarms {
        let Some(object) = object_of(objects, name, tally) else {
            continue;
        };
        for (alarm, &(last, schedules)) in alarms {
            // Every acknowledged schedule counts; all but the last of a name
            // end by being replaced, so the name stands or falls with it.
            tally.accepted += schedules;
            // The occurrences at or after the last acknowledged schedule,
            // each by its generation.
            let mut occurrences: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
            for run in runs_of(object, "alarm", alarm) {
                if run.scheduled.is_some_and(|at| at >= last) {
                    occurrences.entry(&run.generation).or_default().push(run);
                }
            }
            if occurrences.values().any(|runs| ended(runs.iter().copied())) {
                tally.completed += schedules;
                tally.add("replaced", schedules - 1);
            } else {
                tally.flag(
                    Violation::Lost,
                    format!("alarm {alarm} on {name} scheduled at {last} never fired or failed"),
                );
                tally.completed += schedules - 1;
            }
        }
    }
}

fn check_fanout(
    objects: &BTreeMap<String, Object>,
    acks: &Acks,
    owed: &BTreeMap<String, Value>,
    tally: &mut Tally,
) {
    for (name, ids) in &acks.messages {
        tally.accepted += u64::try_from(ids.len()).unwrap_or(0);
        let Some(object) = object_of(objects, name, tally) else {
            continue;
        };
        for id in ids {
            let mut whole = true;
            for target in TARGETS {
                let key = format!("{id}@{target}");
                let acked =
                    runs_of(object, target, &key).any(|r| r.outcome.as_deref() == Some("ok"));
                let parked = object.parked.contains(&(id.clone(), target.to_owned()));
                match (acked, parked) {
                    (true, _) => tally.add("acked_deliveries", 1),
                    (false, true) => tally.add("parked_deliveries", 1),
                    (false, false) => {
                        whole = false;
                        tally.flag(
                            Violation::Lost,
                            format!("message {id} on {name} was neither acked by nor parked for {target}"),
                        );
                    }
                }
            }
            if whole {
                tally.completed += 1;
            }
        }
    }
    for (name, left) in owed {
        let owed = left.get("owed").and_then(Value::as_u64).unwrap_or(0);
        if owed > 0 {
            tally.flag(
                Violation::Broken("owed_at_end"),
                format!("{name} still owes {owed} deliveries after the drain"),
            );
        }
    }
}

fn check_log(objects: &BTreeMap<String, Object>, acks: &Acks, tally: &mut Tally) {
    for (object, key, earlier, later) in &acks.moved_keys {
        tally.flag(
            Violation::Broken("moved_keys"),
            format!("{key} on {object} was answered with offset {earlier}, then {later}"),
        );
    }
    for (name, object) in objects {
        // Dense from 0: no retention in this workload, so every record is
        // hot.
        for (index, &offset) in object.records.keys().enumerate() {
            if u64::try_from(index).ok() != Some(offset) {
                tally.flag(
                    Violation::Broken("offset_gaps"),
                    format!("{name}: offset {offset} is record number {index}"),
                );
                break;
            }
        }
        let commit = acks.commits.get(name).copied().unwrap_or(0);
        let cursor = object.cursor.unwrap_or(0);
        if cursor < commit {
            tally.flag(
                Violation::StaleSettlement,
                format!("{name}: cursor {cursor} is behind the acknowledged commit {commit}"),
            );
        }
    }
    for (name, records) in &acks.records {
        tally.accepted += u64::try_from(records.len()).unwrap_or(0);
        let Some(object) = object_of(objects, name, tally) else {
            continue;
        };
        for (key, &offset) in records {
            let stored = object.records.get(&offset);
            let intact = stored.is_some_and(|(k, payload)| {
                k == key
                    && serde_json::from_str::<Value>(payload).is_ok_and(|stored| {
                        // The log's codec wraps the body: {"kind":"value","value":..}.
                        stored.pointer("/value/key").and_then(Value::as_str) == Some(key)
                    })
            });
            if !intact {
                tally.flag(
                    Violation::Lost,
                    format!("{key} on {name} is not stored at offset {offset} ({stored:?})"),
                );
            } else if !object.consumed.contains(&offset) {
                tally.flag(
                    Violation::Lost,
                    format!("{key} on {name} (offset {offset}) was never consumed"),
                );
            } else {
                tally.completed += 1;
            }
        }
    }
}

/// The embedded recurring checker's walk, per object and schedule.
fn check_recurring(objects: &BTreeMap<String, Object>, tally: &mut Tally) {
    let (mut due, mut ran, mut skipped) = (0_u64, 0_u64, 0_u64);
    for (name, object) in objects {
        for spec in &SCHEDULES {
            let schedule = spec.name;
            let interval = spec.interval_ms;
            // Tick -> (generations, smallest missed count told).
            let mut ticks: BTreeMap<i64, (BTreeSet<&str>, i64)> = BTreeMap::new();
            let mut generations: HashMap<&str, BTreeSet<i64>> = HashMap::new();
            for run in runs_of(object, "tick", schedule) {
                let (Some(tick), missed) = (run.scheduled, run.missed.unwrap_or(0)) else {
                    continue;
                };
                let entry = ticks
                    .entry(tick)
                    .or_insert_with(|| (BTreeSet::new(), missed));
                entry.0.insert(&run.generation);
                entry.1 = entry.1.min(missed);
                generations.entry(&run.generation).or_default().insert(tick);
            }
            for (tick, (gens, _)) in &ticks {
                if gens.len() > 1 {
                    tally.flag(
                        Violation::Broken("doubled_occurrences"),
                        format!(
                            "{schedule} on {name}: tick {tick} ran as {} occurrences",
                            gens.len()
                        ),
                    );
                }
                if tick.rem_euclid(interval) != 0 {
                    tally.flag(
                        Violation::Broken("off_grid_ticks"),
                        format!(
                            "{schedule} on {name}: tick {tick} is not a multiple of {interval} ms"
                        ),
                    );
                }
            }
            for (generation, at) in &generations {
                if at.len() > 1 {
                    tally.flag(
                        Violation::Broken("doubled_occurrences"),
                        format!("{schedule} on {name}: occurrence {generation} ran ticks {at:?}"),
                    );
                }
            }
            let (Some(&(created_at, pending_missed)), Some((status, pending))) =
                (object.schedules.get(schedule), object.alarms.get(schedule))
            else {
                tally.flag(
                    Violation::Broken("missing_schedules"),
                    format!("{schedule} on {name} has no stored schedule or occurrence"),
                );
                continue;
            };
            if status != "pending" {
                tally.flag(
                    Violation::Broken("missing_occurrences"),
                    format!("{schedule} on {name}: its occurrence is {status}"),
                );
                continue;
            }
            let pending = *pending;
            if let Some((&last, _)) = ticks.last_key_value()
                && last > pending
            {
                tally.flag(
                    Violation::Broken("runs_past_pending"),
                    format!("{schedule} on {name}: tick {last} ran but {pending} is still pending"),
                );
            }
            let first = (created_at.div_euclid(interval) + 1) * interval;
            let mut previous = first - interval;
            let mut steps: Vec<(i64, i64)> = ticks
                .iter()
                .filter(|(tick, _)| **tick < pending)
                .map(|(tick, (_, missed))| (*tick, *missed))
                .collect();
            steps.push((pending, pending_missed));
            for (tick, missed) in steps {
                let gap = ((tick - previous) / interval - 1).max(0);
                due += u64::try_from(gap + 1).unwrap_or(0);
                if gap > missed {
                    tally.flag(
                        Violation::Lost,
                        format!(
                            "{schedule} on {name}: {} ticks between {previous} and {tick} never ran and were not reported missed (told {missed})",
                            gap - missed
                        ),
                    );
                    // One violation per lost tick, as the embedded checker.
                    for _ in 1..(gap - missed) {
                        tally.lost += 1;
                    }
                } else if gap < missed {
                    tally.flag(
                        Violation::Broken("miscounted_missed"),
                        format!(
                            "{schedule} on {name}: tick {tick} was told {missed} missed, but {gap} ticks lie since {previous}"
                        ),
                    );
                }
                skipped += u64::try_from(gap.min(missed)).unwrap_or(0);
                if tick != pending {
                    ran += 1;
                }
                previous = tick;
            }
            // The pending occurrence itself is not due yet.
            due = due.saturating_sub(1);
        }
    }
    tally.accepted = due;
    tally.completed = ran + skipped;
    tally.add("ticks_run", ran);
    tally.add("ticks_reported_missed", skipped);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(kind: &str, key: &str, attempt: u32, instance: &str, outcome: Option<&str>) -> Run {
        Run {
            kind: kind.into(),
            key: key.into(),
            generation: "g".into(),
            attempt,
            instance: instance.into(),
            scheduled: None,
            missed: None,
            outcome: outcome.map(str::to_owned),
        }
    }

    #[test]
    fn an_attempt_number_run_again_after_a_kill_is_a_duplicate_attempt() {
        let mut tally = Tally::default();
        let runs = [
            run("op", "op-1", 1, "a", None),
            run("op", "op-1", 1, "b", None),
        ];
        check_attempts(&runs, &mut tally);
        assert_eq!(tally.broken.get("duplicate_attempts"), Some(&1));
        assert_eq!(tally.violations(), 1);
    }

    #[test]
    fn an_attempt_above_the_maximum_is_an_over_attempt() {
        let mut tally = Tally::default();
        let runs = [run("op", "op-1", MAX_ATTEMPTS + 1, "a", None)];
        check_attempts(&runs, &mut tally);
        assert_eq!(tally.over_attempts, 1);
    }

    #[test]
    fn two_handlers_of_one_record_in_one_instance_overlap() {
        let mut tally = Tally::default();
        let runs = [
            run("op", "op-1", 1, "a", None),
            run("op", "op-1", 2, "a", None),
        ];
        check_attempts(&runs, &mut tally);
        assert_eq!(tally.broken.get("overlapping_handlers"), Some(&1));
    }

    #[test]
    fn retries_across_kills_within_the_maximum_are_clean() {
        let mut tally = Tally::default();
        let runs = [
            run("op", "op-1", 1, "a", None),
            run("op", "op-1", 2, "b", None),
            run("op", "op-1", 2, "b", Some("transient")),
            run("op", "op-1", 3, "b", None),
            run("op", "op-1", 3, "b", Some("ok")),
        ];
        check_attempts(&runs, &mut tally);
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples);
    }

    fn acked_op(id: &str) -> Acks {
        let mut acks = Acks::default();
        acks.ops.entry("t-0".into()).or_default().insert(id.into());
        acks
    }

    #[test]
    fn an_acknowledged_operation_that_never_ended_is_lost() {
        let mut object = Object {
            runs: vec![run("op", "op-1", 1, "a", Some("transient"))],
            ..Object::default()
        };
        object.calls.insert("op-1".into(), "pending".into());
        let objects = BTreeMap::from([("t-0".to_owned(), object)]);
        let mut tally = Tally::default();
        check_operations(&objects, &acked_op("op-1"), &mut tally);
        assert_eq!((tally.accepted, tally.lost), (1, 1));
    }

    #[test]
    fn an_operation_whose_last_attempt_a_kill_cut_off_has_ended() {
        let mut object = Object {
            runs: vec![run("op", "op-1", MAX_ATTEMPTS, "a", None)],
            ..Object::default()
        };
        object.calls.insert("op-1".into(), "failed".into());
        let objects = BTreeMap::from([("t-0".to_owned(), object)]);
        let mut tally = Tally::default();
        check_operations(&objects, &acked_op("op-1"), &mut tally);
        assert_eq!((tally.completed, tally.violations()), (1, 0));
    }

    fn tick(at: i64, missed: i64, generation: &str) -> Run {
        Run {
            generation: generation.into(),
            scheduled: Some(at),
            missed: Some(missed),
            ..run("tick", SCHEDULES[1].name, 1, "a", None)
        }
    }

    fn ticking(runs: Vec<Run>, pending: i64) -> BTreeMap<String, Object> {
        let mut object = Object {
            runs,
            ..Object::default()
        };
        for spec in &SCHEDULES {
            object.schedules.insert(spec.name.into(), (0, 0));
            object
                .alarms
                .insert(spec.name.into(), ("pending".into(), spec.interval_ms));
        }
        object
            .alarms
            .insert(SCHEDULES[1].name.into(), ("pending".into(), pending));
        BTreeMap::from([("t-0".to_owned(), object)])
    }

    #[test]
    fn a_recurring_gap_reported_missed_is_clean_and_one_not_reported_is_lost() {
        let interval = SCHEDULES[1].interval_ms;
        let reported = ticking(
            vec![tick(interval, 0, "g1"), tick(4 * interval, 2, "g4")],
            5 * interval,
        );
        let mut tally = Tally::default();
        check_recurring(&reported, &mut tally);
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples);

        let unreported = ticking(
            vec![tick(interval, 0, "g1"), tick(4 * interval, 0, "g4")],
            5 * interval,
        );
        let mut tally = Tally::default();
        check_recurring(&unreported, &mut tally);
        assert_eq!(tally.lost, 2, "{:?}", tally.examples);
    }

    #[test]
    fn a_tick_run_as_two_occurrences_is_doubled() {
        let interval = SCHEDULES[1].interval_ms;
        let objects = ticking(
            vec![tick(interval, 0, "g1"), tick(interval, 0, "g2")],
            2 * interval,
        );
        let mut tally = Tally::default();
        check_recurring(&objects, &mut tally);
        assert_eq!(tally.broken.get("doubled_occurrences"), Some(&1));
    }
}
