//! The `alarms` workload: named alarms scheduled, and rescheduled before or
//! after they fire, by a producer; handlers that fail some attempts; kills
//! in the middle of both.
//!
//! Each name of an object is scheduled [`SCHEDULES_PER_NAME`] times in a row,
//! each time a little later than the last, so a schedule often replaces a
//! pending occurrence. An accepted schedule ends when its occurrence fired
//! (a handler returned `Ok`), failed for good, or was replaced by a later
//! schedule of the same name. Per name the checker therefore requires that
//! the *last* accepted occurrence, or a later one, fired or failed; it also
//! verifies from the journals and the final `durability_alarms` rows:
//! - no attempt above the maximum ran or was stored;
//! - an occurrence's idempotency key is the same on every attempt and
//!   different from every other occurrence's;
//! - at most one handler per name ran at once in one process;
//! - a stored failure is the failure of the row's own generation and last
//!   attempt (else a stale settlement), and never a retryable failure with
//!   attempts left.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;

use durability::alarms::IDEMPOTENCY_KEY_PREFIX;
use durability::retry::Delay;
use durability::scheduler::MIN_ALARM_MIN_DELAY;
use durability::{AlarmCall, Alarms, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext};
use durability_platform::{Context as _, EpochMs};
use rand::Rng as _;
use serde::{Deserialize, Serialize};

use super::TortureError;
use super::attempts::Ledger;
use super::backups::{BackupCopy, Presence};
use super::journal::{self, Journal};
use super::verdict::{Tally, Violation};
use super::workload::{
    AttemptFact, Finished, HandlerEnv, Life, Objects, Outcome, Workload, count_rows,
    parse_failure_marker, system_now_ms,
};

/// Attempts per occurrence, the first included.
const MAX_ATTEMPTS: u32 = 5;

/// Fixed and short, so that retries happen within a life as well as across
/// kills.
const RETRY_DELAY_MS: f64 = 25.0;

/// How many consecutive items of an object schedule the same name.
const SCHEDULES_PER_NAME: u64 = 3;

/// Scheduled times lie up to this far ahead of now, in milliseconds: some
/// fire before their replacement arrives, some are replaced while pending.
const LEAD_MAX_MS: EpochMs = 250;

pub struct AlarmsWorkload;

/// One object with its named alarms.
pub struct AlarmsObject {
    ctx: ObjectContext,
    scheduler: Scheduler,
    alarms: Alarms,
}

impl DurableObject for AlarmsObject {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

/// The producer's journal: the time it is about to schedule a name for
/// (so times stay strictly increasing per name across lives), and the
/// schedules that returned `Ok`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "fact", rename_all = "snake_case")]
enum Produced {
    Intent(Schedule),
    Accepted(Schedule),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Schedule {
    item: u64,
    /// The object's id.
    object: String,
    name: String,
    scheduled_time: EpochMs,
    /// When `schedule` returned (system clock): set on the accepted line
    /// only, absent from journals older than `--backup-during`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    acked_ms: Option<EpochMs>,
}

/// A `durability_alarms` row as the checker reads it.
struct AlarmRow {
    generation: String,
    status: String,
    scheduled_at: EpochMs,
    attempt: u32,
    last_error: Option<String>,
}

/// The alarm name item `item` schedules.
fn name_of(item: u64, objects: u64) -> String {
    let local = item / objects.max(1);
    format!("n-{}", local / SCHEDULES_PER_NAME)
}

impl Workload for AlarmsWorkload {
    const NAME: &'static str = "alarms";
    const ABOUT: &'static str = "named alarms: schedules, replacements, scripted failures, retries";
    type Object = AlarmsObject;

    fn construct(ctx: ObjectContext, env: &HandlerEnv) -> Result<AlarmsObject, BoxError> {
        let object = ctx.id().to_string();
        let scheduler = Scheduler::builder(ctx.clone().into_dyn())
            .alarm_min_delay(MIN_ALARM_MIN_DELAY)
            .build()?;
        let mut builder = Alarms::builder(&scheduler)
            .max_attempts(MAX_ATTEMPTS)
            .retry_delay(Delay::Fixed { ms: RETRY_DELAY_MS });
        // Handlers are registered per name: every name the run can use.
        let names = env.items / Self::OBJECTS.max(1) / SCHEDULES_PER_NAME + 1;
        for n in 0..names {
            let env = env.clone();
            let object = object.clone();
            builder = builder.handler(&format!("n-{n}"), move |call: AlarmCall| {
                let generation = call
                    .idempotency_key
                    .strip_prefix(IDEMPOTENCY_KEY_PREFIX)
                    .unwrap_or(&call.idempotency_key)
                    .to_owned();
                let fact = AttemptFact {
                    returned: None,
                    object: object.clone(),
                    key: call.name,
                    generation,
                    attempt: call.attempt,
                    life: env.life,
                    scheduled_time: Some(call.scheduled_time),
                };
                let env = env.clone();
                async move { env.attempt(fact, false).await }
            });
        }
        let alarms = builder.build()?;
        Ok(AlarmsObject {
            ctx,
            scheduler,
            alarms,
        })
    }

    async fn produce(
        objects: &Objects<AlarmsObject>,
        produced: &Journal,
        life: &Life,
    ) -> Result<(), TortureError> {
        let journaled = journal::read::<Produced>(&life.files.produced())?;
        let mut accepted = HashSet::new();
        let mut last_time: HashMap<(String, String), EpochMs> = HashMap::new();
        for fact in journaled.lines {
            match fact {
                Produced::Intent(s) => {
                    let last = last_time.entry((s.object, s.name)).or_default();
                    *last = (*last).max(s.scheduled_time);
                }
                Produced::Accepted(s) => {
                    accepted.insert(s.item);
                }
            }
        }
        let mut rng = life.rng("produce alarms");
        for item in (0..life.quota()).filter(|item| !accepted.contains(item)) {
            let stub = objects.get(item)?;
            let object = stub.id().to_string();
            let name = name_of(item, Self::OBJECTS);
            let mut scheduled_time = objects.now_ms() + rng.random_range(0..=LEAD_MAX_MS);
            if let Some(last) = last_time.get(&(object.clone(), name.clone())) {
                scheduled_time = scheduled_time.max(last + 1);
            }
            let mut schedule = Schedule {
                item,
                object: object.clone(),
                name: name.clone(),
                scheduled_time,
                acked_ms: None,
            };
            produced.append(&Produced::Intent(schedule.clone()))?;
            last_time.insert((object, name.clone()), scheduled_time);
            stub.call(move |object: Rc<AlarmsObject>| async move {
                object.alarms.schedule(&name, scheduled_time).await
            })
            .await??;
            schedule.acked_ms = Some(system_now_ms());
            produced.append(&Produced::Accepted(schedule))?;
            Life::pace(&mut rng).await;
        }
        Ok(())
    }

    async fn unsettled(objects: &Objects<AlarmsObject>) -> Result<u64, TortureError> {
        let mut pending = 0;
        for stub in objects.all() {
            pending += stub
                .call(|object: Rc<AlarmsObject>| async move {
                    count_rows(
                        &object.ctx,
                        "SELECT count(*) FROM durability_alarms WHERE status = 'pending'",
                    )
                })
                .await??;
        }
        Ok(pending)
    }

    fn check(run: &Finished) -> Result<Tally, TortureError> {
        let produced = journal::read::<Produced>(&run.files.produced())?;
        let handled = journal::read::<AttemptFact>(&run.files.handled())?;
        let mut rows = HashMap::new();
        for entry in run.manifest.objects.values() {
            let read = run.rows(
                entry,
                "durability_alarms",
                "SELECT name, generation_id, status, scheduled_at, attempt, last_error \
                 FROM durability_alarms",
                |row| {
                    Ok((
                        (entry.id.clone(), row.get::<_, String>(0)?),
                        AlarmRow {
                            generation: row.get(1)?,
                            status: row.get(2)?,
                            scheduled_at: row.get(3)?,
                            attempt: row.get(4)?,
                            last_error: row.get(5)?,
                        },
                    ))
                },
            )?;
            rows.extend(read);
        }
        let mut tally = run.tally();
        tally.detail("torn_journal_lines", produced.torn + handled.torn);
        let ledger = Ledger::check(&handled.lines, MAX_ATTEMPTS, &mut tally);
        Ok(check_facts(
            &produced.lines,
            &handled.lines,
            &ledger,
            &rows,
            tally,
        ))
    }

    /// An accepted schedule is recorded by its name's `durability_alarms`
    /// row, pending or failed, at its time or later: a later schedule of
    /// the name replaces the row, and times only grow per name. An
    /// occurrence whose handler succeeded has its row deleted; the
    /// handler journaled its `Ok` before that deletion committed.
    fn check_copy(copy: &BackupCopy) -> Result<Presence, TortureError> {
        let produced = journal::read::<Produced>(&copy.run.files.produced())?;
        let handled = journal::read::<AttemptFact>(&copy.run.files.handled())?;
        let mut fired: HashMap<(String, String), EpochMs> = HashMap::new();
        for fact in &handled.lines {
            if let (Some(Outcome::Ok), Some(time)) = (fact.returned, fact.scheduled_time) {
                let latest = fired
                    .entry((fact.object.clone(), fact.key.clone()))
                    .or_insert(time);
                *latest = (*latest).max(time);
            }
        }
        let mut rows = HashMap::new();
        for entry in copy.run.manifest.objects.values() {
            let read = copy.run.rows(
                entry,
                "durability_alarms",
                "SELECT name, scheduled_at FROM durability_alarms",
                |row| {
                    Ok((
                        (entry.id.clone(), row.get::<_, String>(0)?),
                        row.get::<_, EpochMs>(1)?,
                    ))
                },
            )?;
            rows.extend(read);
        }
        Ok(copy_presence(copy, &produced.lines, &rows, &fired))
    }
}

/// Which accepted schedules a copy must hold and does not; `rows` are the
/// copy's scheduled times by (object id, name), `fired` the latest
/// scheduled time whose handler returned `Ok`, by the same key.
fn copy_presence(
    copy: &BackupCopy,
    produced: &[Produced],
    rows: &HashMap<(String, String), EpochMs>,
    fired: &HashMap<(String, String), EpochMs>,
) -> Presence {
    let mut presence = Presence::default();
    for fact in produced {
        let Produced::Accepted(schedule) = fact else {
            continue;
        };
        let Some(acked_ms) = copy.must_hold(&schedule.object, schedule.acked_ms) else {
            continue;
        };
        let key = (schedule.object.clone(), schedule.name.clone());
        let stored = rows.get(&key).copied();
        let at_or_after = |at: EpochMs| at >= schedule.scheduled_time;
        presence.item(
            stored.is_some_and(at_or_after) || fired.get(&key).copied().is_some_and(at_or_after),
            acked_ms,
            || {
                format!(
                    "item {} ({} at {}) was accepted at {acked_ms} and never fired, but the restored copy of {} stores {}",
                    schedule.item,
                    schedule.name,
                    schedule.scheduled_time,
                    copy.describe(&schedule.object),
                    stored.map_or("no row".to_owned(), |at| format!("the name at {at}"))
                )
            },
        );
    }
    presence
}

/// Everything journaled about one name of one object.
#[derive(Default)]
struct NameFacts {
    intents: HashSet<EpochMs>,
    accepted: Vec<EpochMs>,
    /// Scheduled times of occurrences whose handler returned `Ok`.
    fired: HashSet<EpochMs>,
    /// Occurrence identity as the handlers saw it, both ways.
    time_of_generation: HashMap<String, EpochMs>,
    generation_of_time: HashMap<EpochMs, String>,
}

fn check_facts(
    produced: &[Produced],
    handled: &[AttemptFact],
    ledger: &Ledger,
    rows: &HashMap<(String, String), AlarmRow>,
    mut tally: Tally,
) -> Tally {
    let mut names: BTreeMap<(String, String), NameFacts> = BTreeMap::new();
    let mut accepted_items = HashSet::new();
    for fact in produced {
        match fact {
            Produced::Intent(s) => {
                let facts = names.entry((s.object.clone(), s.name.clone())).or_default();
                facts.intents.insert(s.scheduled_time);
            }
            Produced::Accepted(s) => {
                if accepted_items.insert(s.item) {
                    let facts = names.entry((s.object.clone(), s.name.clone())).or_default();
                    facts.accepted.push(s.scheduled_time);
                }
            }
        }
    }
    // Occurrences already flagged, so each counts once.
    let mut unstable = HashSet::new();
    for fact in handled {
        let Some(scheduled_time) = fact.scheduled_time else {
            continue;
        };
        let facts = names
            .entry((fact.object.clone(), fact.key.clone()))
            .or_default();
        let first_sight = !facts.time_of_generation.contains_key(&fact.generation);
        if first_sight && !facts.intents.contains(&scheduled_time) {
            tally.flag(
                Violation::Broken("unknown_occurrences"),
                format!(
                    "{} ran an occurrence for {scheduled_time} that was never scheduled",
                    fact.key
                ),
            );
        }
        let known_time = *facts
            .time_of_generation
            .entry(fact.generation.clone())
            .or_insert(scheduled_time);
        let known_generation = facts
            .generation_of_time
            .entry(scheduled_time)
            .or_insert_with(|| fact.generation.clone())
            .clone();
        if (known_time != scheduled_time || known_generation != fact.generation)
            && unstable.insert((
                fact.object.clone(),
                fact.key.clone(),
                fact.generation.clone(),
            ))
        {
            tally.flag(
                Violation::Broken("unstable_idempotency_keys"),
                format!(
                    "{} attempt {}: key {} for the occurrence at {scheduled_time}, seen before with {known_generation} / {known_time}",
                    fact.key, fact.attempt, fact.generation
                ),
            );
        }
        if fact.returned == Some(Outcome::Ok) {
            facts.fired.insert(scheduled_time);
        }
    }

    let (mut fired, mut failed, mut replaced) = (0_u64, 0_u64, 0_u64);
    for ((object, name), facts) in &names {
        let Some(&last) = facts.accepted.iter().max() else {
            continue;
        };
        tally.accepted += u64::try_from(facts.accepted.len()).unwrap_or(u64::MAX);
        let row = rows.get(&(object.clone(), name.clone()));
        let last_failed = row.is_some_and(|r| r.status == "failed" && r.scheduled_at >= last);
        let ended = last_failed || facts.fired.iter().any(|&t| t >= last);
        for &time in &facts.accepted {
            if facts.fired.contains(&time) {
                fired += 1;
            } else if last_failed && row.is_some_and(|r| r.scheduled_at == time) {
                failed += 1;
            } else if time < last || ended {
                // A later schedule of the name replaced this occurrence.
                replaced += 1;
            } else {
                tally.flag(
                    Violation::Lost,
                    format!(
                        "{name} on {}: the occurrence scheduled for {time} never fired{}",
                        short(object),
                        row.map_or_else(String::new, |r| format!(
                            " (row: {} at attempt {} for {})",
                            r.status, r.attempt, r.scheduled_at
                        ))
                    ),
                );
            }
        }
    }
    tally.completed = fired + failed + replaced;
    tally.detail("fired", fired);
    tally.detail("failed", failed);
    tally.detail("replaced", replaced);

    for ((object, name), row) in rows {
        if row.attempt > MAX_ATTEMPTS {
            tally.flag(
                Violation::OverAttempts,
                format!("{name} stores attempt {} (max {MAX_ATTEMPTS})", row.attempt),
            );
        }
        match row.status.as_str() {
            "failed" => check_failure(object, name, row, ledger, &mut tally),
            status => {
                let journaled = names
                    .get(&(object.clone(), name.clone()))
                    .is_some_and(|facts| !facts.accepted.is_empty());
                // A pending row of a journaled name was counted as lost above.
                if !journaled {
                    tally.flag(
                        Violation::Broken("unsettled_rows"),
                        format!(
                            "{name} (scheduled by a killed life, never journaled) is still {status}"
                        ),
                    );
                }
            }
        }
    }
    tally
}

fn check_failure(object: &str, name: &str, row: &AlarmRow, ledger: &Ledger, tally: &mut Tally) {
    let message = row.last_error.as_deref().unwrap_or_default();
    let Some((attempt, generation)) = parse_failure_marker(message) else {
        if row.attempt < MAX_ATTEMPTS {
            tally.flag(
                Violation::Broken("premature_failures"),
                format!(
                    "{name} failed at attempt {} of {MAX_ATTEMPTS} with {message:?}",
                    row.attempt
                ),
            );
        }
        return;
    };
    if generation != row.generation || attempt != row.attempt {
        tally.flag(
            Violation::StaleSettlement,
            format!(
                "{name} stores the failure of attempt {attempt} of generation {generation} but the row is at attempt {} of {}",
                row.attempt, row.generation
            ),
        );
        return;
    }
    match ledger.outcome(object, name, &generation, attempt) {
        Some(Outcome::Permanent) => {}
        Some(Outcome::Transient) if attempt >= MAX_ATTEMPTS => {}
        Some(Outcome::Transient) => tally.flag(
            Violation::Broken("premature_failures"),
            format!("{name} failed for good after a retryable failure of attempt {attempt} of {MAX_ATTEMPTS}"),
        ),
        other => tally.flag(
            Violation::StaleSettlement,
            format!("{name} stores a failure of attempt {attempt} whose handler returned {other:?}"),
        ),
    }
}

/// The first digits of an object id, enough to tell objects apart.
fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(item: u64, scheduled_time: EpochMs) -> Schedule {
        Schedule {
            item,
            object: "o".into(),
            name: "n-0".into(),
            scheduled_time,
            acked_ms: None,
        }
    }

    fn run(
        generation: &str,
        time: EpochMs,
        attempt: u32,
        returned: Option<Outcome>,
    ) -> AttemptFact {
        AttemptFact {
            returned,
            object: "o".into(),
            key: "n-0".into(),
            generation: generation.into(),
            attempt,
            life: 0,
            scheduled_time: Some(time),
        }
    }

    fn verdict(produced: &[Produced], handled: &[AttemptFact], rows: Vec<AlarmRow>) -> Tally {
        let mut tally = Tally::default();
        let ledger = Ledger::check(handled, MAX_ATTEMPTS, &mut tally);
        let rows = rows
            .into_iter()
            .map(|row| (("o".to_owned(), "n-0".to_owned()), row))
            .collect();
        check_facts(produced, handled, &ledger, &rows, tally)
    }

    #[test]
    fn a_replaced_occurrence_needs_only_its_replacement_to_fire() {
        let produced = [
            Produced::Intent(schedule(0, 100)),
            Produced::Accepted(schedule(0, 100)),
            Produced::Intent(schedule(1, 200)),
            Produced::Accepted(schedule(1, 200)),
        ];
        let handled = [
            run("g2", 200, 1, None),
            run("g2", 200, 1, Some(Outcome::Ok)),
        ];
        let tally = verdict(&produced, &handled, vec![]);
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!((tally.accepted, tally.completed), (2, 2));
    }

    #[test]
    fn a_last_occurrence_that_never_fired_is_lost() {
        let produced = [
            Produced::Intent(schedule(0, 100)),
            Produced::Accepted(schedule(0, 100)),
            Produced::Intent(schedule(1, 200)),
            Produced::Accepted(schedule(1, 200)),
        ];
        // Only the replaced occurrence fired: what a stale settlement that
        // deleted the replacement leaves behind.
        let handled = [
            run("g1", 100, 1, None),
            run("g1", 100, 1, Some(Outcome::Ok)),
        ];
        let tally = verdict(&produced, &handled, vec![]);
        assert_eq!(tally.lost, 1);
        assert_eq!(tally.completed, 1);
    }

    #[test]
    fn two_keys_for_one_occurrence_are_unstable_idempotency_keys() {
        let produced = [
            Produced::Intent(schedule(0, 100)),
            Produced::Accepted(schedule(0, 100)),
        ];
        let handled = [
            run("g1", 100, 1, None),
            run("g1", 100, 1, Some(Outcome::Transient)),
            run("other", 100, 2, None),
            run("other", 100, 2, Some(Outcome::Ok)),
        ];
        let tally = verdict(&produced, &handled, vec![]);
        assert_eq!(tally.broken.get("unstable_idempotency_keys"), Some(&1));
    }

    #[test]
    fn a_failure_stored_for_an_older_generation_is_a_stale_settlement() {
        let produced = [
            Produced::Intent(schedule(0, 100)),
            Produced::Accepted(schedule(0, 100)),
        ];
        let handled = [
            run("g1", 100, 1, None),
            run("g1", 100, 1, Some(Outcome::Permanent)),
        ];
        let row = AlarmRow {
            generation: "g2".into(),
            status: "failed".into(),
            scheduled_at: 100,
            attempt: 1,
            last_error: Some(format!(
                "permanent {}",
                crate::torture::workload::failure_marker(1, "g1")
            )),
        };
        let tally = verdict(&produced, &handled, vec![row]);
        assert_eq!(tally.stale_settlements, 1);
    }
}
