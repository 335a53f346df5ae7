//! The `operations` workload: durable operations registered by a producer
//! and run by a handler that fails some attempts, times out others, and is
//! killed in the middle of many.
//!
//! An accepted operation (its `start` returned `Ok` and the producer
//! journaled it) ends completed or failed for good. The checker verifies
//! from the journals and the final `durability_calls` rows:
//! - every accepted operation ended (else it is lost);
//! - no attempt above the maximum ran or was stored;
//! - a completion was stored by the attempt that owns the row (same
//!   generation, same claimed attempt) and whose handler returned `Ok`; a
//!   stored failure is the failure of the row's own last attempt, or the
//!   library's exhaustion or timeout at the last attempt (anything else is
//!   a stale settlement);
//! - no retryable failure ended an operation that had attempts left.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;
use std::time::Duration;

use durability::retry::Delay;
use durability::scheduler::MIN_ALARM_MIN_DELAY;
use durability::{DurableCall, Operations, Registration, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext};
use durability_platform::{Context as _, EpochMs};
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

/// The workload's one operation.
const OPERATION: &str = "work";

/// Attempts per operation, the first included: room for the scripted
/// failures plus a few attempts used up by kills.
const MAX_ATTEMPTS: u32 = 6;

/// Fixed and short, so that retries happen within a life as well as across
/// kills.
const RETRY_DELAY_MS: f64 = 25.0;

/// Shorter than the handler's slow attempts, so some attempts time out and
/// their handlers return after a retry was already scheduled.
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(150);

pub struct OperationsWorkload;

/// One object with its operations.
pub struct OpsObject {
    ctx: ObjectContext,
    scheduler: Scheduler,
    operations: Operations,
}

impl DurableObject for OpsObject {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Payload {
    item: u64,
}

/// What a successful attempt returns, so the stored result names the
/// attempt that completed the row.
#[derive(Debug, Serialize, Deserialize)]
struct Done {
    attempt: u32,
    generation: String,
}

/// The producer's journal line: `start` returned `Ok` for this operation.
#[derive(Debug, Serialize, Deserialize)]
struct Accepted {
    item: u64,
    id: String,
    /// The object's id.
    object: String,
    /// `false` when the id was already registered (by a life killed before
    /// it could journal the registration).
    created: bool,
    /// When `start` returned (system clock); absent from journals older
    /// than `--backup-during`.
    #[serde(default)]
    acked_ms: Option<EpochMs>,
}

/// A `durability_calls` row as the checker reads it.
struct CallRow {
    object: String,
    status: String,
    result: Option<String>,
    attempt: u32,
    generation: String,
    last_error: Option<String>,
}

impl Workload for OperationsWorkload {
    const NAME: &'static str = "operations";
    const ABOUT: &'static str =
        "durable operations: registrations, scripted failures, timeouts, retries";
    type Object = OpsObject;

    fn construct(ctx: ObjectContext, env: &HandlerEnv) -> Result<OpsObject, BoxError> {
        let object = ctx.id().to_string();
        let scheduler = Scheduler::builder(ctx.clone().into_dyn())
            .alarm_min_delay(MIN_ALARM_MIN_DELAY)
            .build()?;
        let env = env.clone();
        let operations = Operations::builder(&scheduler)
            .max_attempts(MAX_ATTEMPTS)
            .attempt_timeout(ATTEMPT_TIMEOUT)
            .retry_delay(Delay::Fixed { ms: RETRY_DELAY_MS })
            .handler(OPERATION, move |call: DurableCall<Payload>| {
                let env = env.clone();
                let generation = call.memo.attempt().generation.clone();
                let fact = AttemptFact {
                    returned: None,
                    object: object.clone(),
                    key: call.id,
                    generation: generation.clone(),
                    attempt: call.attempt,
                    life: env.life,
                    scheduled_time: None,
                };
                async move {
                    env.attempt(fact, true).await?;
                    Ok(Done {
                        attempt: call.attempt,
                        generation,
                    })
                }
            })
            .build()?;
        Ok(OpsObject {
            ctx,
            scheduler,
            operations,
        })
    }

    async fn produce(
        objects: &Objects<OpsObject>,
        produced: &Journal,
        life: &Life,
    ) -> Result<(), TortureError> {
        let journaled = journal::read::<Accepted>(&life.files.produced())?;
        let accepted: std::collections::HashSet<u64> =
            journaled.lines.iter().map(|a| a.item).collect();
        let mut rng = life.rng("produce operations");
        for item in (0..life.quota()).filter(|item| !accepted.contains(item)) {
            let stub = objects.get(item)?;
            let id = format!("op-{item}");
            let key = id.clone();
            let registration = stub
                .call(move |object: Rc<OpsObject>| async move {
                    object
                        .operations
                        .start(OPERATION, &key, &Payload { item })
                        .await
                })
                .await??;
            produced.append(&Accepted {
                item,
                id,
                object: stub.id().to_string(),
                created: registration == Registration::Created,
                acked_ms: Some(system_now_ms()),
            })?;
            Life::pace(&mut rng).await;
        }
        Ok(())
    }

    async fn unsettled(objects: &Objects<OpsObject>) -> Result<u64, TortureError> {
        let mut pending = 0;
        for stub in objects.all() {
            pending += stub
                .call(|object: Rc<OpsObject>| async move {
                    count_rows(
                        &object.ctx,
                        "SELECT count(*) FROM durability_calls WHERE status = 'pending'",
                    )
                })
                .await??;
        }
        Ok(pending)
    }

    fn check(run: &Finished) -> Result<Tally, TortureError> {
        let produced = journal::read::<Accepted>(&run.files.produced())?;
        let handled = journal::read::<AttemptFact>(&run.files.handled())?;
        let mut rows = HashMap::new();
        for entry in run.manifest.objects.values() {
            let read = run.rows(
                entry,
                "durability_calls",
                "SELECT id, status, result, attempt, generation_id, last_error \
                 FROM durability_calls",
                |row| {
                    Ok((
                        row.get::<_, String>(0)?,
                        CallRow {
                            object: entry.id.clone(),
                            status: row.get(1)?,
                            result: row.get(2)?,
                            attempt: row.get(3)?,
                            generation: row.get(4)?,
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
        Ok(check_facts(&produced.lines, &ledger, &rows, tally))
    }

    /// An accepted operation is recorded by its `durability_calls` row in
    /// its object, whatever its status.
    fn check_copy(copy: &BackupCopy) -> Result<Presence, TortureError> {
        let produced = journal::read::<Accepted>(&copy.run.files.produced())?;
        let mut rows = HashSet::new();
        for entry in copy.run.manifest.objects.values() {
            let ids = copy.run.rows(
                entry,
                "durability_calls",
                "SELECT id FROM durability_calls",
                |row| row.get::<_, String>(0),
            )?;
            rows.extend(ids.into_iter().map(|id| (entry.id.clone(), id)));
        }
        Ok(copy_presence(copy, &produced.lines, &rows))
    }
}

/// Which accepted operations a copy must hold and does not; `rows` are
/// the copy's `(object id, operation id)`. An operation journaled twice (a
/// registration repeated after a kill) counts once.
fn copy_presence(
    copy: &BackupCopy,
    produced: &[Accepted],
    rows: &HashSet<(String, String)>,
) -> Presence {
    let mut presence = Presence::default();
    let mut seen = HashSet::new();
    for fact in produced {
        let Some(acked_ms) = copy.must_hold(&fact.object, fact.acked_ms) else {
            continue;
        };
        if !seen.insert(fact.id.as_str()) {
            continue;
        }
        let present = rows.contains(&(fact.object.clone(), fact.id.clone()));
        presence.item(present, acked_ms, || {
            format!(
                "{} was accepted at {acked_ms} but has no row in the restored copy of {}",
                fact.id,
                copy.describe(&fact.object)
            )
        });
    }
    presence
}

/// The checker's comparison of the accepted operations and the handlers'
/// ledger with the final rows (by id).
fn check_facts(
    produced: &[Accepted],
    ledger: &Ledger,
    rows: &HashMap<String, CallRow>,
    mut tally: Tally,
) -> Tally {
    let accepted: BTreeMap<&str, &Accepted> = produced.iter().map(|a| (a.id.as_str(), a)).collect();
    tally.accepted = u64::try_from(accepted.len()).unwrap_or(u64::MAX);
    tally.detail(
        "reregistered",
        produced.iter().filter(|a| !a.created).count(),
    );
    let (mut succeeded, mut failed) = (0_u64, 0_u64);
    for (id, fact) in &accepted {
        let Some(row) = rows.get(*id) else {
            tally.flag(Violation::Lost, format!("{id} was accepted but has no row"));
            continue;
        };
        if row.object != fact.object {
            tally.flag(
                Violation::Broken("misplaced_rows"),
                format!(
                    "{id} was accepted by {} but stored in {}",
                    fact.object, row.object
                ),
            );
        }
        match row.status.as_str() {
            "completed" => {
                succeeded += 1;
                check_completion(id, row, ledger, &mut tally);
            }
            "failed" => {
                failed += 1;
                check_failure(id, row, ledger, &mut tally);
            }
            status => tally.flag(
                Violation::Lost,
                format!(
                    "{id} is still {status} after the final life (attempt {})",
                    row.attempt
                ),
            ),
        }
    }
    tally.completed = succeeded + failed;
    for (id, row) in rows {
        if row.attempt > MAX_ATTEMPTS {
            tally.flag(
                Violation::OverAttempts,
                format!("{id} stores attempt {} (max {MAX_ATTEMPTS})", row.attempt),
            );
        }
        if !accepted.contains_key(id.as_str()) && row.status == "pending" {
            tally.flag(
                Violation::Broken("unsettled_rows"),
                format!("{id} (registered by a killed life, never journaled) is still pending"),
            );
        }
    }
    tally.detail("succeeded", succeeded);
    tally.detail("failed", failed);
    tally
}

fn check_completion(id: &str, row: &CallRow, ledger: &Ledger, tally: &mut Tally) {
    let done = row
        .result
        .as_deref()
        .and_then(|text| durability::codec::decode_as::<Done>(text).ok());
    let Some(done) = done else {
        tally.flag(
            Violation::Broken("undecodable_results"),
            format!(
                "{id} is completed with an unreadable result {:?}",
                row.result
            ),
        );
        return;
    };
    if done.generation != row.generation || done.attempt != row.attempt {
        tally.flag(
            Violation::StaleSettlement,
            format!(
                "{id} was completed by attempt {} of generation {} but the row is at attempt {} of {}",
                done.attempt, done.generation, row.attempt, row.generation
            ),
        );
    } else if ledger.outcome(&row.object, id, &done.generation, done.attempt) != Some(Outcome::Ok) {
        tally.flag(
            Violation::StaleSettlement,
            format!(
                "{id} was completed by attempt {} whose handler never returned Ok",
                done.attempt
            ),
        );
    }
}

fn check_failure(id: &str, row: &CallRow, ledger: &Ledger, tally: &mut Tally) {
    let message = row.last_error.as_deref().unwrap_or_default();
    let Some((attempt, generation)) = parse_failure_marker(message) else {
        // The library's own failure: attempts exhausted (the last ones used
        // up by kills) or the last attempt timed out.
        if row.attempt < MAX_ATTEMPTS {
            tally.flag(
                Violation::Broken("premature_failures"),
                format!(
                    "{id} failed at attempt {} of {MAX_ATTEMPTS} with {message:?}",
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
                "{id} stores the failure of attempt {attempt} of generation {generation} but the row is at attempt {} of {}",
                row.attempt, row.generation
            ),
        );
        return;
    }
    match ledger.outcome(&row.object, id, &generation, attempt) {
        Some(Outcome::Permanent) => {}
        Some(Outcome::Transient) if attempt >= MAX_ATTEMPTS => {}
        Some(Outcome::Transient) => tally.flag(
            Violation::Broken("premature_failures"),
            format!("{id} failed for good after a retryable failure of attempt {attempt} of {MAX_ATTEMPTS}"),
        ),
        other => tally.flag(
            Violation::StaleSettlement,
            format!("{id} stores a failure of attempt {attempt} whose handler returned {other:?}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torture::workload::failure_marker;

    fn accepted(item: u64) -> Accepted {
        Accepted {
            item,
            id: format!("op-{item}"),
            object: "o".into(),
            created: true,
            acked_ms: None,
        }
    }

    fn attempt(id: &str, attempt: u32, returned: Option<Outcome>) -> AttemptFact {
        AttemptFact {
            returned,
            object: "o".into(),
            key: id.into(),
            generation: "g".into(),
            attempt,
            life: 0,
            scheduled_time: None,
        }
    }

    fn completed(attempt: u32) -> CallRow {
        CallRow {
            object: "o".into(),
            status: "completed".into(),
            result: durability::codec::encode(&Done {
                attempt,
                generation: "g".into(),
            })
            .ok(),
            attempt,
            generation: "g".into(),
            last_error: None,
        }
    }

    fn verdict(produced: &[Accepted], facts: &[AttemptFact], rows: Vec<(&str, CallRow)>) -> Tally {
        let mut tally = Tally::default();
        let ledger = Ledger::check(facts, MAX_ATTEMPTS, &mut tally);
        let rows = rows
            .into_iter()
            .map(|(id, row)| (id.to_owned(), row))
            .collect();
        check_facts(produced, &ledger, &rows, tally)
    }

    #[test]
    fn an_operation_completed_by_its_own_attempt_passes() {
        let facts = [
            attempt("op-0", 1, None),
            attempt("op-0", 1, Some(Outcome::Ok)),
        ];
        let tally = verdict(&[accepted(0)], &facts, vec![("op-0", completed(1))]);
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!((tally.accepted, tally.completed), (1, 1));
    }

    #[test]
    fn an_accepted_operation_that_never_ended_is_lost() {
        let mut pending = completed(1);
        pending.status = "pending".into();
        pending.result = None;
        let tally = verdict(&[accepted(0), accepted(1)], &[], vec![("op-0", pending)]);
        assert_eq!(tally.lost, 2, "one pending, one without a row");
        assert_eq!(tally.completed, 0);
    }

    #[test]
    fn a_completion_by_an_older_attempt_is_a_stale_settlement() {
        let facts = [
            attempt("op-0", 1, None),
            attempt("op-0", 1, Some(Outcome::Ok)),
            attempt("op-0", 2, None),
        ];
        let mut row = completed(1);
        row.attempt = 2;
        let tally = verdict(&[accepted(0)], &facts, vec![("op-0", row)]);
        assert_eq!(tally.stale_settlements, 1);
    }

    #[test]
    fn a_completion_whose_handler_failed_is_a_stale_settlement() {
        let facts = [
            attempt("op-0", 1, None),
            attempt("op-0", 1, Some(Outcome::Transient)),
        ];
        let tally = verdict(&[accepted(0)], &facts, vec![("op-0", completed(1))]);
        assert_eq!(tally.stale_settlements, 1);
    }

    #[test]
    fn a_stored_attempt_above_the_maximum_is_an_over_attempt() {
        let tally = verdict(
            &[accepted(0)],
            &[],
            vec![(
                "op-0",
                CallRow {
                    status: "failed".into(),
                    result: None,
                    last_error: Some("attempts exhausted".into()),
                    ..completed(MAX_ATTEMPTS + 1)
                },
            )],
        );
        assert_eq!(tally.over_attempts, 1);
    }

    #[test]
    fn a_retryable_failure_with_attempts_left_is_premature() {
        let facts = [
            attempt("op-0", 1, None),
            attempt("op-0", 1, Some(Outcome::Transient)),
        ];
        let row = CallRow {
            status: "failed".into(),
            result: None,
            last_error: Some(format!("transient {}", failure_marker(1, "g"))),
            ..completed(1)
        };
        let tally = verdict(&[accepted(0)], &facts, vec![("op-0", row)]);
        assert_eq!(tally.broken.get("premature_failures"), Some(&1));
    }
}
