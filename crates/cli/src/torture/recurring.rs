//! The `recurring` workload: recurring named alarms ticking every few tens
//! of milliseconds under each missed-tick policy, handlers that fail some
//! attempts (retries, exhausted attempts, permanent failures), and kills at
//! any moment, the commit of a run and its next occurrence included.
//!
//! Every object registers the same [`SCHEDULES`] in every life (a no-op once
//! stored). Each handler attempt journals its tick, its generation (from the
//! idempotency key) and the missed count it was told, in `ticks.jsonl`,
//! before the scripted attempt runs. Whatever the policy, a run at tick `t`
//! told `missed = m` says that the `m` ticks before `t` did not run, so the
//! previous run's tick must be `t - (m + 1) × interval`. The checker walks
//! each schedule's runs in tick order from its first tick (the first after
//! its registration) to the occurrence still pending at the end, and flags:
//! - a gap the missed counts do not explain: a **lost** occurrence;
//! - a tick run under two generations, or a generation at two ticks: a
//!   **doubled** occurrence (retries of one tick share one generation, so
//!   at-least-once re-runs of a tick are allowed, a second occurrence is
//!   not);
//! - a missed count larger than the gap (`miscounted_missed`), a tick off
//!   the schedule's grid (`off_grid_ticks`), a tick after the pending one
//!   (`runs_past_pending`), a schedule without its pending occurrence
//!   (`missing_occurrences`);
//! - and, through the shared attempt ledger, attempts above the maximum and
//!   overlapping handlers of one name.
//!
//! After a power cut in a mode that lets the host's own work run again
//! (group commit, `normal`), a tick run under two generations in different
//! lives is a rerun, and a missed count that calls ticks missed whose runs
//! all came in earlier lives counts runs the cut took back; both are
//! allowed (`rerun_occurrences`, `forgotten_runs`), not violations.
//!
//! The final life ends once every schedule's pending occurrence lies past a
//! horizon a little after its production, so each schedule ran through that
//! life too.
//!
//! The producer journals each object's registrations once they returned
//! (`produced.jsonl`), for `--backup-during`: a copy taken after that holds
//! every schedule of the object.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::rc::Rc;
use std::sync::OnceLock;
use std::time::Duration;

use durability::alarms::IDEMPOTENCY_KEY_PREFIX;
use durability::retry::Delay;
use durability::scheduler::MIN_ALARM_MIN_DELAY;
use durability::{AlarmCall, Alarms, MissedTicks, Recurrence, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext};
use durability_platform::{Context as _, EpochMs};
use serde::{Deserialize, Serialize};

use super::TortureError;
use super::attempts::Ledger;
use super::backups::{BackupCopy, Presence};
use super::journal::{self, Journal};
use super::verdict::{Tally, Violation};
use super::workload::{
    AttemptFact, Finished, HandlerEnv, Life, Objects, Workload, count_rows, system_now_ms,
};

/// Attempts per occurrence, the first included.
const MAX_ATTEMPTS: u32 = 4;

/// Fixed and short, so retries run past later ticks and make them missed.
const RETRY_DELAY_MS: f64 = 25.0;

/// How far past the end of its production the final life keeps ticking.
const FINAL_SPAN_MS: EpochMs = 1_500;

/// One schedule of every object.
struct ScheduleSpec {
    name: &'static str,
    /// The distance between two ticks; every tick is a multiple of it.
    interval_ms: EpochMs,
    policy: MissedTicks,
    /// A cron pattern in Europe/Paris instead of a fixed interval.
    cron: Option<&'static str>,
}

/// The schedules each object runs: every policy, and the cron path. The
/// catch-up-all interval is long enough that a life catches up with the
/// ticks of the downtime before it (each tick costs a few fsyncs of the
/// journals and the database); the others tick faster than a retried
/// occurrence ends, so they miss ticks within a life as well.
const SCHEDULES: &[ScheduleSpec] = &[
    ScheduleSpec {
        name: "catch-up-all",
        interval_ms: 300,
        policy: MissedTicks::CatchUp { max: 10_000 },
        cron: None,
    },
    ScheduleSpec {
        name: "catch-up-3",
        interval_ms: 150,
        policy: MissedTicks::CatchUp { max: 3 },
        cron: None,
    },
    ScheduleSpec {
        name: "skip",
        interval_ms: 150,
        policy: MissedTicks::Skip,
        cron: None,
    },
    ScheduleSpec {
        name: "run-once",
        interval_ms: 200,
        policy: MissedTicks::RunOnce,
        cron: None,
    },
    ScheduleSpec {
        name: "cron-every-second",
        interval_ms: 1_000,
        policy: MissedTicks::CatchUp { max: 100 },
        cron: Some("* * * * * *"),
    },
];

impl ScheduleSpec {
    fn recurrence(&self) -> Result<Recurrence, durability::RecurrenceError> {
        let rule = match self.cron {
            Some(pattern) => Recurrence::cron(pattern, "Europe/Paris")?,
            None => Recurrence::every(Duration::from_millis(self.interval_ms.unsigned_abs()))?,
        };
        Ok(rule.missed_ticks(self.policy))
    }
}

/// The journal of ticks, shared by every object of the life.
static TICKS: OnceLock<Journal> = OnceLock::new();

/// When the final life may end: every pending occurrence lies past it.
static HORIZON: OnceLock<EpochMs> = OnceLock::new();

pub struct RecurringWorkload;

/// One object with its recurring alarms.
pub struct RecurringObject {
    ctx: ObjectContext,
    scheduler: Scheduler,
    alarms: Alarms,
}

impl DurableObject for RecurringObject {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

/// What a handler saw of one attempt, journaled before the attempt runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct TickFact {
    object: String,
    name: String,
    generation: String,
    tick: EpochMs,
    missed: u64,
    attempt: u32,
    life: u32,
}

/// The producer's journal line: every schedule of `object` is registered
/// (the registering call returned at `acked_ms`, system clock).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Registered {
    object: String,
    names: Vec<String>,
    acked_ms: EpochMs,
}

/// A schedule's rows at the end of the run.
#[derive(Debug, Clone, Default)]
struct Stored {
    /// When it was registered: its first tick is the first after this.
    created_at: EpochMs,
    /// Ticks missed before the pending occurrence.
    missed: u64,
    /// The pending occurrence's tick, if any.
    pending: Option<EpochMs>,
}

impl Workload for RecurringWorkload {
    const NAME: &'static str = "recurring";
    const ABOUT: &'static str =
        "recurring alarms: every missed-tick policy, a cron in a time zone, scripted failures";
    /// Two objects: every tick costs a few fsyncs, and the schedules must
    /// not outrun the disk.
    const OBJECTS: u64 = 2;
    type Object = RecurringObject;

    fn construct(ctx: ObjectContext, env: &HandlerEnv) -> Result<RecurringObject, BoxError> {
        let ticks = match TICKS.get() {
            Some(journal) => journal.clone(),
            None => {
                let journal = Journal::open(&env.files.dir().join("ticks.jsonl"))?;
                TICKS.get_or_init(|| journal).clone()
            }
        };
        let object = ctx.id().to_string();
        let scheduler = Scheduler::builder(ctx.clone().into_dyn())
            .alarm_min_delay(MIN_ALARM_MIN_DELAY)
            .build()?;
        let mut builder = Alarms::builder(&scheduler)
            .max_attempts(MAX_ATTEMPTS)
            .retry_delay(Delay::Fixed { ms: RETRY_DELAY_MS });
        for spec in SCHEDULES {
            let (env, ticks, object) = (env.clone(), ticks.clone(), object.clone());
            builder = builder.handler(spec.name, move |call: AlarmCall| {
                let generation = call
                    .idempotency_key
                    .strip_prefix(IDEMPOTENCY_KEY_PREFIX)
                    .unwrap_or(&call.idempotency_key)
                    .to_owned();
                let tick = TickFact {
                    object: object.clone(),
                    name: call.name.clone(),
                    generation: generation.clone(),
                    tick: call.scheduled_time,
                    missed: call.missed,
                    attempt: call.attempt,
                    life: env.life,
                };
                let fact = AttemptFact {
                    returned: None,
                    object: object.clone(),
                    key: call.name,
                    generation,
                    attempt: call.attempt,
                    life: env.life,
                    scheduled_time: Some(call.scheduled_time),
                };
                let (env, ticks) = (env.clone(), ticks.clone());
                async move {
                    ticks.append(&tick).map_err(|error| {
                        durability::HandlerError::new(format!("cannot journal the tick: {error}"))
                    })?;
                    env.attempt(fact, false).await
                }
            });
        }
        let alarms = builder.build()?;
        Ok(RecurringObject {
            ctx,
            scheduler,
            alarms,
        })
    }

    async fn produce(
        objects: &Objects<RecurringObject>,
        produced: &Journal,
        life: &Life,
    ) -> Result<(), TortureError> {
        // Registration is idempotent: every life registers every schedule,
        // and only the first registration of each is stored.
        for stub in objects.all() {
            stub.call(|object: Rc<RecurringObject>| async move {
                for spec in SCHEDULES {
                    let recurrence = spec.recurrence()?;
                    object
                        .alarms
                        .schedule_recurring(spec.name, &recurrence, &())
                        .await?;
                }
                Ok::<_, durability::DurabilityError>(())
            })
            .await??;
            produced.append(&Registered {
                object: stub.id().to_string(),
                names: SCHEDULES.iter().map(|spec| spec.name.to_owned()).collect(),
                acked_ms: system_now_ms(),
            })?;
        }
        if life.is_final {
            HORIZON.get_or_init(|| objects.now_ms() + FINAL_SPAN_MS);
        }
        Ok(())
    }

    async fn unsettled(objects: &Objects<RecurringObject>) -> Result<u64, TortureError> {
        let Some(&horizon) = HORIZON.get() else {
            return Ok(1);
        };
        let mut unsettled = 0;
        for stub in objects.all() {
            unsettled += stub
                .call(move |object: Rc<RecurringObject>| async move {
                    count_rows(
                        &object.ctx,
                        &format!(
                            "SELECT count(*) FROM durability_alarms \
                             WHERE status = 'pending' AND scheduled_at <= {horizon}"
                        ),
                    )
                })
                .await??;
        }
        Ok(unsettled)
    }

    fn check(run: &Finished) -> Result<Tally, TortureError> {
        let ticks = journal::read::<TickFact>(&run.files.dir().join("ticks.jsonl"))?;
        let handled = journal::read::<AttemptFact>(&run.files.handled())?;
        let mut stored: HashMap<(String, String), Stored> = HashMap::new();
        for entry in run.manifest.objects.values() {
            let schedules = run.rows(
                entry,
                "durability_alarm_schedules",
                "SELECT s.name, s.created_at, s.missed, a.scheduled_at \
                 FROM durability_alarm_schedules s \
                 LEFT JOIN durability_alarms a ON a.name = s.name AND a.status = 'pending'",
                |row| {
                    Ok((
                        (entry.id.clone(), row.get::<_, String>(0)?),
                        Stored {
                            created_at: row.get(1)?,
                            missed: row.get(2)?,
                            pending: row.get(3)?,
                        },
                    ))
                },
            )?;
            stored.extend(schedules);
        }
        let mut tally = run.tally();
        tally.detail("torn_journal_lines", ticks.torn + handled.torn);
        Ledger::check(&handled.lines, MAX_ATTEMPTS, &mut tally);
        Ok(check_ticks(&ticks.lines, &stored, tally))
    }

    /// A registered schedule is recorded by its `durability_alarm_schedules`
    /// row (no schedule of the workload ever ends).
    fn check_copy(copy: &BackupCopy) -> Result<Presence, TortureError> {
        let produced = journal::read::<Registered>(&copy.run.files.produced())?;
        let mut rows = HashSet::new();
        for entry in copy.run.manifest.objects.values() {
            let names = copy.run.rows(
                entry,
                "durability_alarm_schedules",
                "SELECT name FROM durability_alarm_schedules",
                |row| row.get::<_, String>(0),
            )?;
            rows.extend(names.into_iter().map(|name| (entry.id.clone(), name)));
        }
        Ok(copy_presence(copy, &produced.lines, &rows))
    }
}

/// Which registered schedules a copy must hold and does not; `rows` are
/// the copy's `(object id, name)`. Every life registers again; a schedule
/// counts once, by its first registration.
fn copy_presence(
    copy: &BackupCopy,
    produced: &[Registered],
    rows: &HashSet<(String, String)>,
) -> Presence {
    let mut presence = Presence::default();
    let mut seen = HashSet::new();
    for fact in produced {
        let Some(acked_ms) = copy.must_hold(&fact.object, Some(fact.acked_ms)) else {
            continue;
        };
        for name in &fact.names {
            let key = (fact.object.clone(), name.clone());
            if !seen.insert(key.clone()) {
                continue;
            }
            presence.item(rows.contains(&key), acked_ms, || {
                format!(
                    "schedule {name} was registered at {acked_ms} but is not in the restored copy of {}",
                    copy.describe(&fact.object)
                )
            });
        }
    }
    presence
}

/// Everything journaled about one schedule of one object.
#[derive(Default)]
struct Runs {
    /// Tick -> how it ran.
    ticks: BTreeMap<EpochMs, TickRuns>,
    /// Generation -> the ticks it ran.
    generations: HashMap<String, BTreeSet<EpochMs>>,
}

/// The journaled runs of one tick.
struct TickRuns {
    /// The generations seen running it, with the lives each ran in.
    generations: BTreeMap<String, BTreeSet<u32>>,
    /// The smallest missed count a run of it was told...
    missed: u64,
    /// ...and the life of that run.
    missed_life: u32,
}

impl TickRuns {
    /// Whether its generations ran in different lives only: after a power
    /// cut took back the commit that scheduled the tick, the life after it
    /// schedules the tick again under a new generation.
    fn doubled_across_cuts_only(&self) -> bool {
        let mut lives = BTreeSet::new();
        self.generations
            .values()
            .flatten()
            .all(|life| lives.insert(*life))
    }
}

fn check_ticks(
    facts: &[TickFact],
    stored: &HashMap<(String, String), Stored>,
    mut tally: Tally,
) -> Tally {
    let reruns = tally.allowance().reruns;
    // No cut follows the final life (the last one journaled): its runs are
    // never forgotten.
    let final_life = facts.iter().map(|f| f.life).max().unwrap_or(0);
    let mut schedules: BTreeMap<(String, String), Runs> = BTreeMap::new();
    for fact in facts {
        let runs = schedules
            .entry((fact.object.clone(), fact.name.clone()))
            .or_default();
        let tick = runs.ticks.entry(fact.tick).or_insert_with(|| TickRuns {
            generations: BTreeMap::new(),
            missed: fact.missed,
            missed_life: fact.life,
        });
        tick.generations
            .entry(fact.generation.clone())
            .or_default()
            .insert(fact.life);
        if fact.missed < tick.missed {
            (tick.missed, tick.missed_life) = (fact.missed, fact.life);
        }
        runs.generations
            .entry(fact.generation.clone())
            .or_default()
            .insert(fact.tick);
    }
    for key in stored.keys() {
        schedules.entry(key.clone()).or_default();
    }

    let (mut due, mut ran, mut skipped) = (0_u64, 0_u64, 0_u64);
    for ((object, name), runs) in &schedules {
        let object_short = object.get(..8).unwrap_or(object);
        let Some(spec) = SCHEDULES.iter().find(|s| s.name == name) else {
            tally.flag(
                Violation::Broken("unknown_schedules"),
                format!("{name} on {object_short} is not a schedule of the workload"),
            );
            continue;
        };
        let interval = spec.interval_ms;
        let Some(schedule) = stored.get(&(object.clone(), name.clone())) else {
            tally.flag(
                Violation::Broken("missing_schedules"),
                format!("{name} on {object_short} ran but its schedule is not stored"),
            );
            continue;
        };
        for (tick, tick_runs) in &runs.ticks {
            let generations = &tick_runs.generations;
            if generations.len() > 1 {
                tally.flag_or_allow(
                    reruns && tick_runs.doubled_across_cuts_only(),
                    "rerun_occurrences",
                    Violation::Broken("doubled_occurrences"),
                    format!(
                        "{name} on {object_short}: tick {tick} ran as {} occurrences ({generations:?})",
                        generations.len()
                    ),
                );
            }
            if tick.rem_euclid(interval) != 0 {
                tally.flag(
                    Violation::Broken("off_grid_ticks"),
                    format!(
                        "{name} on {object_short}: tick {tick} is not a multiple of {interval} ms"
                    ),
                );
            }
        }
        for (generation, ticks) in &runs.generations {
            if ticks.len() > 1 {
                tally.flag(
                    Violation::Broken("doubled_occurrences"),
                    format!(
                        "{name} on {object_short}: generation {generation} ran ticks {ticks:?}"
                    ),
                );
            }
        }
        let Some(pending) = schedule.pending else {
            tally.flag(
                Violation::Broken("missing_occurrences"),
                format!("{name} on {object_short} has no pending occurrence"),
            );
            continue;
        };
        // The walk: from the tick before the first one, through every run,
        // to the pending occurrence (told `schedule.missed`).
        let first = (schedule.created_at.div_euclid(interval) + 1) * interval;
        let mut previous = first - interval;
        // Each step: the tick, the missed count it was told, and the life
        // that told it.
        let mut steps: Vec<(EpochMs, u64, u32)> = runs
            .ticks
            .iter()
            .filter(|(tick, _)| **tick < pending)
            .map(|(tick, runs)| (*tick, runs.missed, runs.missed_life))
            .collect();
        steps.push((pending, schedule.missed, final_life));
        if let Some((&last, _)) = runs.ticks.last_key_value()
            && last > pending
        {
            tally.flag(
                Violation::Broken("runs_past_pending"),
                format!("{name} on {object_short}: tick {last} ran but {pending} is still pending"),
            );
        }
        for (tick, missed, life) in steps {
            let gap = (tick - previous) / interval - 1;
            let gap = u64::try_from(gap).unwrap_or(0);
            due += gap + 1;
            if gap > missed {
                for _ in missed..gap {
                    tally.flag(
                        Violation::Lost,
                        format!(
                            "{name} on {object_short}: {} ticks between {previous} and {tick} never ran and were not reported missed (told {missed})",
                            gap - missed
                        ),
                    );
                }
            } else if gap < missed {
                // The ticks the count calls missed that the journal says
                // ran: a cut may have taken their runs back, if they ran
                // only in lives before the one that counted.
                let since = tick - EpochMs::try_from(missed + 1).unwrap_or(EpochMs::MAX) * interval;
                let forgotten = runs
                    .ticks
                    .range(since + 1..tick)
                    .all(|(_, earlier)| earlier.generations.values().flatten().all(|&l| l < life));
                tally.flag_or_allow(
                    reruns && forgotten,
                    "forgotten_runs",
                    Violation::Broken("miscounted_missed"),
                    format!(
                        "{name} on {object_short}: tick {tick} was told {missed} missed, but {gap} ticks lie since {previous}"
                    ),
                );
            }
            skipped += gap.min(missed);
            if tick != pending {
                ran += 1;
            }
            previous = tick;
        }
        // The pending occurrence itself is not due yet.
        due -= 1;
    }
    tally.accepted = due;
    tally.completed = ran + skipped;
    tally.detail("ticks_run", ran);
    tally.detail("ticks_reported_missed", skipped);
    tally.detail(
        "schedules",
        u64::try_from(schedules.len()).unwrap_or(u64::MAX),
    );
    tally
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torture::verdict::Allowance;

    fn fact(generation: &str, tick: EpochMs, missed: u64) -> TickFact {
        TickFact {
            object: "object-1".into(),
            name: "skip".into(),
            generation: generation.into(),
            tick,
            missed,
            attempt: 1,
            life: 0,
        }
    }

    fn verdict(facts: &[TickFact], pending: EpochMs, missed: u64) -> Tally {
        verdict_allowing(facts, pending, missed, Allowance::default())
    }

    fn in_life(mut fact: TickFact, life: u32) -> TickFact {
        fact.life = life;
        fact
    }

    fn after_power_cuts() -> Allowance {
        Allowance {
            reruns: true,
            ..Allowance::default()
        }
    }

    fn verdict_allowing(
        facts: &[TickFact],
        pending: EpochMs,
        missed: u64,
        allowance: Allowance,
    ) -> Tally {
        let stored = HashMap::from([(
            ("object-1".to_owned(), "skip".to_owned()),
            Stored {
                // Registered at 1_010: the first tick ("skip" ticks every
                // 150 ms) is 1_050.
                created_at: 1_010,
                missed,
                pending: Some(pending),
            },
        )]);
        check_ticks(facts, &stored, Tally::allowing(allowance))
    }

    #[test]
    fn consecutive_ticks_and_explained_gaps_pass() {
        let facts = [
            fact("g1", 1_050, 0),
            fact("g2", 1_200, 0),
            // A retry of one tick: same generation.
            fact("g2", 1_200, 0),
            fact("g3", 1_650, 2),
        ];
        let tally = verdict(&facts, 1_950, 1);
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!((tally.accepted, tally.completed), (6, 6));
    }

    #[test]
    fn a_gap_the_missed_counts_do_not_explain_is_a_lost_occurrence() {
        let facts = [fact("g1", 1_050, 0), fact("g3", 1_500, 1)];
        let tally = verdict(&facts, 1_650, 0);
        assert_eq!(tally.lost, 1, "{:?}", tally.examples());
        // The pending occurrence was stored too far ahead.
        let tally = verdict(&[fact("g1", 1_050, 0)], 1_500, 0);
        assert_eq!(tally.lost, 2);
    }

    #[test]
    fn a_tick_run_as_two_occurrences_is_doubled() {
        let facts = [fact("g1", 1_050, 0), fact("g2", 1_050, 0)];
        let tally = verdict(&facts, 1_200, 0);
        assert_eq!(tally.broken.get("doubled_occurrences"), Some(&1));
        let facts = [fact("g1", 1_050, 0), fact("g1", 1_200, 0)];
        let tally = verdict(&facts, 1_350, 0);
        assert_eq!(tally.broken.get("doubled_occurrences"), Some(&1));
    }

    #[test]
    fn a_missed_count_larger_than_the_gap_is_flagged() {
        let facts = [fact("g1", 1_050, 0), fact("g2", 1_200, 3)];
        let tally = verdict(&facts, 1_350, 0);
        assert_eq!(tally.broken.get("miscounted_missed"), Some(&1));
    }

    #[test]
    fn a_tick_a_power_cut_took_back_may_run_again_in_a_later_life() {
        let facts = [fact("g1", 1_050, 0), in_life(fact("g2", 1_050, 0), 1)];
        let tally = verdict_allowing(&facts, 1_200, 0, after_power_cuts());
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!(tally.allowed.get("rerun_occurrences"), Some(&1));
        // In one life it is still a doubled occurrence.
        let facts = [fact("g1", 1_050, 0), fact("g2", 1_050, 0)];
        let tally = verdict_allowing(&facts, 1_200, 0, after_power_cuts());
        assert_eq!(tally.broken.get("doubled_occurrences"), Some(&1));
    }

    #[test]
    fn a_missed_count_may_not_know_a_run_a_power_cut_took_back() {
        // 1_200 ran in life 0, the cut took it back, and life 1 counted it
        // missed at 1_350.
        let mut told = vec![
            fact("g1", 1_050, 0),
            fact("g2", 1_200, 0),
            in_life(fact("g3", 1_350, 1), 1),
        ];
        let tally = verdict_allowing(&told, 1_500, 0, after_power_cuts());
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!(tally.allowed.get("forgotten_runs"), Some(&1));
        // Without the allowance, or with the run in the same life, it is
        // a miscount.
        assert_eq!(
            verdict(&told, 1_500, 0).broken.get("miscounted_missed"),
            Some(&1)
        );
        told[2].life = 0;
        let tally = verdict_allowing(&told, 1_500, 0, after_power_cuts());
        assert_eq!(tally.broken.get("miscounted_missed"), Some(&1));
    }
}
