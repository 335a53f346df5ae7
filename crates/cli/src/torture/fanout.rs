//! The `fanout` workload: batches of messages accepted by a producer and
//! delivered independently to two targets, an `inbox` consumer that acks,
//! retries, leaves unsettled, dead-letters or fails whole batches on a
//! script, and an `archive` storage target whose writes sometimes fail; half
//! of the objects have a DLQ, the other half park terminal deliveries.
//!
//! An accepted message (its `enqueue` returned `Accepted` and the producer
//! journaled it) ends when each of its deliveries ended: acked by the
//! consumer or stored by the archive (a handler journaled `Ok`), written to
//! the DLQ (journaled by the DLQ writer), or parked (a row of
//! `durability_fanout_parked`). The checker verifies from the journals and
//! the final `durability_fanout_*` rows:
//! - every delivery of every accepted message ended and none is still owed
//!   (else the message is lost);
//! - no attempt above the maximum ran, and no attempt number ran twice;
//! - a delivery keeps one identity across its attempts;
//! - an explicit dead letter or parking was decided by the delivery's own
//!   attempt whose consumer chose it (else a stale settlement), and an
//!   exhausted one had used up its attempts.
//!
//! On the parking objects a consumer pass redrives every parked delivery
//! once (per message and target), journaling its intent before and the
//! answer after. A redrive registers the delivery again under a new
//! identity and deletes the parked entry in one transaction, so the checker
//! also verifies that a redriven delivery's old identity never runs again
//! and is not still parked, and allows the delivery one new identity per
//! redrive; its ending (acked or parked again) counts like any other.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;
use std::time::Duration;

use durability::fanout::{
    DeadLetterReason, EnqueueOptions, EnqueueResult, Fanout, FanoutInput, FanoutMessage,
    StoredMessage, Target,
};
use durability::retry::Delay;
use durability::scheduler::MIN_ALARM_MIN_DELAY;
use durability::{HandlerError, Scheduler};
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
    AttemptFact, Finished, HandlerEnv, Life, Objects, Outcome, Workload, count_rows, roll,
    system_now_ms,
};

/// The consumer target.
const INBOX: &str = "inbox";
/// The storage target.
const ARCHIVE: &str = "archive";
/// Every target; each message is enqueued for all of them.
const TARGETS: [&str; 2] = [INBOX, ARCHIVE];

/// Attempts per delivery, the first included.
const MAX_ATTEMPTS: u32 = 5;

/// Fixed and short, so that retries happen within a life as well as across
/// kills.
const RETRY_DELAY_MS: f64 = 25.0;

/// A batch's deadline: a kill in the middle of a batch brings its
/// deliveries back this long after they were claimed.
const BATCH_TIMEOUT: Duration = Duration::from_secs(2);

/// Consecutive items that go to one object, so an enqueue carries several.
const ITEMS_PER_BLOCK: u64 = 5;

/// The most messages one enqueue carries.
const MAX_BATCH: u64 = 5;

/// Parked entries listed per object and consumer pass.
const REDRIVE_PAGE_ENTRIES: usize = 16;

pub struct FanoutWorkload;

/// One object with its fanout.
pub struct FanoutObject {
    ctx: ObjectContext,
    scheduler: Scheduler,
    fanout: Fanout<Body>,
    /// Deliveries (`message@target`) already redriven, from the journal and
    /// this life: each is redriven once, so a scripted dead letter that
    /// parks again stays parked.
    redriven: RefCell<HashSet<String>>,
}

impl DurableObject for FanoutObject {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

/// A message's body: the item it carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Body {
    item: u64,
}

/// The producer's journal: an enqueue about to be sent, then an accepted
/// enqueue (atomic, one line) or a rejected one.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "fact", rename_all = "snake_case")]
enum Produced {
    /// Journaled before the call. An intent with no answer after it is an
    /// enqueue whose outcome a kill swallowed: it may have committed, and
    /// its deliveries may even have ended (in-process consumers are not
    /// held by the output gate) before the reply would have been released,
    /// so the retry in the next life registers the items anew, with new
    /// delivery identities.
    Intent { object: String, items: Vec<u64> },
    Accepted {
        object: String,
        items: Vec<u64>,
        ids: Vec<String>,
        /// When `enqueue` returned (system clock); absent from journals
        /// older than `--backup-during`.
        #[serde(default)]
        acked_ms: Option<EpochMs>,
    },
    Rejected {
        object: String,
        items: Vec<u64>,
        error: String,
    },
}

/// The handlers' journal: attempts of both targets, and DLQ writes.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "fact", rename_all = "snake_case")]
enum Handled {
    Attempt(AttemptFact),
    DeadLetter(DeadLetterFact),
    Redrive(RedriveFact),
}

/// A redrive of a parked delivery: journaled with `accepted: None` before
/// the call, and with the answer after it returned.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RedriveFact {
    object: String,
    /// The parked entry's id: the old delivery identity.
    parked_id: String,
    message_id: String,
    target: String,
    accepted: Option<bool>,
}

/// A DLQ write, journaled before the writer returns `Ok`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct DeadLetterFact {
    object: String,
    /// The delivery identity (the DLQ entry's key).
    delivery_id: String,
    message_id: String,
    target: String,
    attempts: u32,
    reason: DeadLetterReason,
}

/// What the consumer does with one message in one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    Ack,
    Retry,
    LeaveUnsettled,
    DeadLetter,
}

impl Decision {
    fn outcome(self) -> Outcome {
        match self {
            Decision::Ack => Outcome::Ok,
            Decision::Retry | Decision::LeaveUnsettled => Outcome::Transient,
            Decision::DeadLetter => Outcome::Permanent,
        }
    }
}

/// The consumer's script for message `id` at `attempt`: about 6 % are
/// dead-lettered at once, 6 % are retried until their attempts run out,
/// the rest are retried (or left unsettled) zero to two times, then acked.
fn decide(seed: u64, id: &str, attempt: u32) -> Decision {
    let fate = roll(seed, "fanout message", id, 0);
    match fate % 100 {
        0..6 => Decision::DeadLetter,
        6..12 => Decision::Retry,
        _ if u64::from(attempt) > (fate / 100) % 3 => Decision::Ack,
        _ if attempt.is_multiple_of(2) => Decision::LeaveUnsettled,
        _ => Decision::Retry,
    }
}

/// The key of one (message, target) delivery in attempt facts.
fn delivery_key(message_id: &str, target: &str) -> String {
    format!("{message_id}@{target}")
}

fn message_id(item: u64) -> String {
    format!("m-{item}")
}

/// Half of the objects (by id) have a DLQ; the others park.
fn has_dlq(object: &str) -> bool {
    object
        .bytes()
        .last()
        .is_some_and(|digit| digit.is_ascii_digit() && (digit - b'0').is_multiple_of(2))
}

fn journal(env: &HandlerEnv, fact: &Handled) -> Result<(), HandlerError> {
    env.journal.append(fact).map_err(|error| {
        tracing::error!(%error, "a torture handler cannot journal");
        HandlerError::new(format!("cannot journal: {error}"))
    })
}

/// The inbox consumer: journals every message of the batch, takes a
/// moment, then fails the whole batch (5 %) or settles each message as
/// scripted, journaling each decision before it acts on it.
async fn deliver(
    env: HandlerEnv,
    object: String,
    batch: Vec<FanoutMessage<Body>>,
) -> Result<(), HandlerError> {
    let facts: Vec<AttemptFact> = batch
        .iter()
        .map(|message| AttemptFact {
            returned: None,
            object: object.clone(),
            key: delivery_key(&message.id, &message.target),
            generation: message.delivery_id.clone(),
            attempt: message.attempt,
            life: env.life,
            scheduled_time: None,
        })
        .collect();
    for fact in &facts {
        journal(&env, &Handled::Attempt(fact.clone()))?;
    }
    let first = batch.first().map_or("", |m| m.id.as_str());
    let attempt = batch.first().map_or(0, |m| m.attempt);
    let batch_roll = roll(env.seed, "fanout batch", first, u64::from(attempt));
    tokio::time::sleep(Duration::from_millis(1 + batch_roll % 10)).await;
    if batch_roll % 100 < 5 {
        for fact in facts {
            let returned = AttemptFact {
                returned: Some(Outcome::Transient),
                ..fact
            };
            journal(&env, &Handled::Attempt(returned))?;
        }
        return Err(HandlerError::new("scripted batch failure"));
    }
    for (message, fact) in batch.iter().zip(facts) {
        let decision = decide(env.seed, &message.id, message.attempt);
        let returned = AttemptFact {
            returned: Some(decision.outcome()),
            ..fact
        };
        journal(&env, &Handled::Attempt(returned))?;
        let settled = match decision {
            Decision::Ack => message.ack().await,
            Decision::Retry => message.retry().await,
            Decision::DeadLetter => message.dead_letter().await,
            Decision::LeaveUnsettled => Ok(()),
        };
        if let Err(error) = settled {
            tracing::warn!(%error, id = %message.id, "a scripted settlement was refused");
        }
    }
    Ok(())
}

/// The archive: a write that fails 20 % of its attempts.
async fn store(
    env: HandlerEnv,
    object: String,
    stored: StoredMessage<Body>,
) -> Result<(), HandlerError> {
    let fact = AttemptFact {
        returned: None,
        object,
        key: delivery_key(&stored.message_id, &stored.target),
        generation: stored.id.clone(),
        attempt: stored.attempts,
        life: env.life,
        scheduled_time: None,
    };
    journal(&env, &Handled::Attempt(fact.clone()))?;
    let write_roll = roll(
        env.seed,
        "archive write",
        &stored.id,
        u64::from(stored.attempts),
    );
    tokio::time::sleep(Duration::from_millis(1 + write_roll % 5)).await;
    let outcome = if write_roll % 100 < 20 {
        Outcome::Transient
    } else {
        Outcome::Ok
    };
    journal(
        &env,
        &Handled::Attempt(AttemptFact {
            returned: Some(outcome),
            ..fact
        }),
    )?;
    match outcome {
        Outcome::Ok => Ok(()),
        _ => Err(HandlerError::new("scripted archive write failure")),
    }
}

/// The DLQ writer: journals the entry and succeeds. Kept fast, because a
/// kill in the middle of a DLQ write brings it back only after the
/// library's one-minute infrastructure retry.
fn write_dead_letter(
    env: &HandlerEnv,
    object: &str,
    stored: &StoredMessage<Body>,
) -> Result<(), HandlerError> {
    let Some(failure) = &stored.failure else {
        return Err(HandlerError::new("a dead letter without its failure"));
    };
    journal(
        env,
        &Handled::DeadLetter(DeadLetterFact {
            object: object.to_owned(),
            delivery_id: stored.id.clone(),
            message_id: stored.message_id.clone(),
            target: stored.target.clone(),
            attempts: stored.attempts,
            reason: failure.reason,
        }),
    )
}

impl Workload for FanoutWorkload {
    const NAME: &'static str = "fanout";
    const ABOUT: &'static str =
        "fanout: batch acceptance, a scripted consumer and a flaky archive, DLQ and parking";
    type Object = FanoutObject;

    fn construct(ctx: ObjectContext, env: &HandlerEnv) -> Result<FanoutObject, BoxError> {
        let object = ctx.id().to_string();
        let scheduler = Scheduler::builder(ctx.clone().into_dyn())
            .alarm_min_delay(MIN_ALARM_MIN_DELAY)
            .build()?;
        let inbox = {
            let (env, object) = (env.clone(), object.clone());
            Target::consumer(move |batch: Vec<FanoutMessage<Body>>| {
                deliver(env.clone(), object.clone(), batch)
            })
        };
        let archive = {
            let (env, object) = (env.clone(), object.clone());
            Target::storage(move |stored: StoredMessage<Body>| {
                store(env.clone(), object.clone(), stored)
            })
        };
        let mut builder = Fanout::builder(&scheduler)
            .target(INBOX, inbox)
            .target(ARCHIVE, archive)
            .max_attempts(MAX_ATTEMPTS)
            .attempt_timeout(BATCH_TIMEOUT)
            .retry_delay(Delay::Fixed { ms: RETRY_DELAY_MS });
        if has_dlq(&object) {
            let (env, object) = (env.clone(), object.clone());
            builder = builder.dlq(move |stored: StoredMessage<Body>| {
                std::future::ready(write_dead_letter(&env, &object, &stored))
            });
        }
        let fanout = builder.build()?;
        let redriven = journal::read::<Handled>(&env.files.handled())?
            .lines
            .into_iter()
            .filter_map(|fact| match fact {
                Handled::Redrive(r) if r.object == object && r.accepted == Some(true) => {
                    Some(delivery_key(&r.message_id, &r.target))
                }
                _ => None,
            })
            .collect();
        Ok(FanoutObject {
            ctx,
            scheduler,
            fanout,
            redriven: RefCell::new(redriven),
        })
    }

    async fn produce(
        objects: &Objects<FanoutObject>,
        produced: &Journal,
        life: &Life,
    ) -> Result<(), TortureError> {
        let journaled = journal::read::<Produced>(&life.files.produced())?;
        let mut accepted = HashSet::new();
        for fact in &journaled.lines {
            if let Produced::Accepted { items, .. } = fact {
                accepted.extend(items.iter().copied());
            }
        }
        let missing: Vec<u64> = (0..life.quota())
            .filter(|item| !accepted.contains(item))
            .collect();
        let mut rng = life.rng("produce fanout");
        let mut rest = missing.as_slice();
        while let Some(&first) = rest.first() {
            let size = usize::try_from(rng.random_range(1..=MAX_BATCH)).unwrap_or(1);
            let block = first / ITEMS_PER_BLOCK;
            let items: Vec<u64> = rest
                .iter()
                .take(size)
                .take_while(|&&item| item / ITEMS_PER_BLOCK == block)
                .copied()
                .collect();
            rest = rest.get(items.len().max(1)..).unwrap_or_default();
            let stub = objects.get(block)?;
            produced.append(&Produced::Intent {
                object: stub.id().to_string(),
                items: items.clone(),
            })?;
            // The id is also the deduplication key: enqueueing an item again
            // after a kill is a no-op if its first enqueue committed and its
            // deliveries are still owed (see `Produced::Intent`).
            let inputs: Vec<FanoutInput<Body>> = items
                .iter()
                .map(|&item| FanoutInput::new(Body { item }).id(message_id(item)))
                .collect();
            let result = stub
                .call(move |object: Rc<FanoutObject>| async move {
                    object
                        .fanout
                        .enqueue(inputs, &EnqueueOptions::all())
                        .await
                        .map_err(|error| error.to_string())
                })
                .await?
                .map_err(|message| TortureError::Fanout { message })?;
            let object = stub.id().to_string();
            let fact = match result {
                EnqueueResult::Accepted { value, .. } => Produced::Accepted {
                    object,
                    items,
                    ids: value,
                    acked_ms: Some(system_now_ms()),
                },
                EnqueueResult::Rejected { error, .. } => Produced::Rejected {
                    object,
                    items,
                    error: error.to_string(),
                },
            };
            produced.append(&fact)?;
            Life::pace(&mut rng).await;
        }
        Ok(())
    }

    /// Redrives, once each, the parked deliveries of the parking objects.
    async fn consume(
        objects: &Objects<FanoutObject>,
        handled: &Journal,
        _life: &Life,
    ) -> Result<bool, TortureError> {
        let mut worked = false;
        for stub in objects.all() {
            let object = stub.id().to_string();
            if has_dlq(&object) {
                continue;
            }
            let parked = stub
                .call(|o: Rc<FanoutObject>| async move {
                    let entries = o
                        .fanout
                        .parked(None, REDRIVE_PAGE_ENTRIES)
                        .map_err(|e| e.to_string())?;
                    let redriven = o.redriven.borrow();
                    Ok::<_, String>(
                        entries
                            .into_iter()
                            .filter(|e| !redriven.contains(&delivery_key(&e.message_id, &e.target)))
                            .map(|e| (e.id, e.message_id, e.target))
                            .collect::<Vec<_>>(),
                    )
                })
                .await?
                .map_err(|message| TortureError::Fanout { message })?;
            for (parked_id, message_id, target) in parked {
                let mut fact = RedriveFact {
                    object: object.clone(),
                    parked_id: parked_id.clone(),
                    message_id: message_id.clone(),
                    target: target.clone(),
                    accepted: None,
                };
                handled.append(&Handled::Redrive(fact.clone()))?;
                let key = delivery_key(&message_id, &target);
                let accepted = stub
                    .call(move |o: Rc<FanoutObject>| async move {
                        let result = o
                            .fanout
                            .redrive_parked(&[parked_id.as_str()])
                            .await
                            .map_err(|e| e.to_string())?;
                        let accepted = matches!(result, EnqueueResult::Accepted { .. });
                        if accepted {
                            o.redriven.borrow_mut().insert(key);
                        }
                        Ok::<_, String>(accepted)
                    })
                    .await?
                    .map_err(|message| TortureError::Fanout { message })?;
                fact.accepted = Some(accepted);
                handled.append(&Handled::Redrive(fact))?;
                worked = true;
            }
        }
        Ok(worked)
    }

    async fn unsettled(objects: &Objects<FanoutObject>) -> Result<u64, TortureError> {
        let mut owed = 0;
        for stub in objects.all() {
            owed += stub
                .call(|object: Rc<FanoutObject>| async move {
                    count_rows(
                        &object.ctx,
                        "SELECT count(*) FROM durability_fanout_deliveries",
                    )
                })
                .await??;
        }
        Ok(owed)
    }

    fn check(run: &Finished) -> Result<Tally, TortureError> {
        let produced = journal::read::<Produced>(&run.files.produced())?;
        let handled = journal::read::<Handled>(&run.files.handled())?;
        let mut stored = Stored::default();
        for entry in run.manifest.objects.values() {
            let owed = run.rows(
                entry,
                "durability_fanout_deliveries",
                "SELECT m.id, d.target_id, d.attempt FROM durability_fanout_deliveries d \
                 LEFT JOIN durability_fanout_messages m ON m.key = d.message_key",
                |row| {
                    Ok(OwedRow {
                        message_id: row.get::<_, Option<String>>(0)?.unwrap_or_default(),
                        target: row.get(1)?,
                        attempt: row.get(2)?,
                    })
                },
            )?;
            stored
                .owed
                .extend(owed.into_iter().map(|row| (entry.id.clone(), row)));
            let parked = run.rows(
                entry,
                "durability_fanout_parked",
                "SELECT id, message_id, target_id, attempts, reason FROM durability_fanout_parked",
                |row| {
                    Ok(ParkedRow {
                        delivery_id: row.get(0)?,
                        message_id: row.get(1)?,
                        target: row.get(2)?,
                        attempts: row.get(3)?,
                        reason: row.get(4)?,
                    })
                },
            )?;
            stored
                .parked
                .extend(parked.into_iter().map(|row| (entry.id.clone(), row)));
        }
        let mut tally = run.tally();
        tally.detail("torn_journal_lines", produced.torn + handled.torn);
        let attempts: Vec<AttemptFact> = handled
            .lines
            .iter()
            .filter_map(|fact| match fact {
                Handled::Attempt(fact) => Some(fact.clone()),
                Handled::DeadLetter(_) | Handled::Redrive(_) => None,
            })
            .collect();
        let dead_letters: Vec<DeadLetterFact> = handled
            .lines
            .iter()
            .filter_map(|fact| match fact {
                Handled::DeadLetter(fact) => Some(fact.clone()),
                Handled::Attempt(_) | Handled::Redrive(_) => None,
            })
            .collect();
        let ledger = Ledger::check(&attempts, MAX_ATTEMPTS, &mut tally);
        let redrives = check_redrives(&handled.lines, &stored, &mut tally);
        Ok(check_facts(
            &produced.lines,
            &attempts,
            &dead_letters,
            &ledger,
            &stored,
            &redrives,
            tally,
        ))
    }

    /// An accepted message's delivery to a target is recorded in the copy
    /// while it is owed or parked; once it ended (acked or stored, or
    /// written to the DLQ) its rows are deleted, and the handlers' journal,
    /// written before that deletion commits, says it ended. A delivery
    /// neither in the copy nor ended in the journal is missing.
    fn check_copy(copy: &BackupCopy) -> Result<Presence, TortureError> {
        let produced = journal::read::<Produced>(&copy.run.files.produced())?;
        let handled = journal::read::<Handled>(&copy.run.files.handled())?;
        let mut recorded = HashSet::new();
        for entry in copy.run.manifest.objects.values() {
            let owed = copy.run.rows(
                entry,
                "durability_fanout_deliveries",
                "SELECT m.id, d.target_id FROM durability_fanout_deliveries d \
                 LEFT JOIN durability_fanout_messages m ON m.key = d.message_key",
                |row| {
                    Ok(delivery_key(
                        &row.get::<_, Option<String>>(0)?.unwrap_or_default(),
                        &row.get::<_, String>(1)?,
                    ))
                },
            )?;
            let parked = copy.run.rows(
                entry,
                "durability_fanout_parked",
                "SELECT message_id, target_id FROM durability_fanout_parked",
                |row| {
                    Ok(delivery_key(
                        &row.get::<_, String>(0)?,
                        &row.get::<_, String>(1)?,
                    ))
                },
            )?;
            recorded.extend(
                owed.into_iter()
                    .chain(parked)
                    .map(|key| (entry.id.clone(), key)),
            );
        }
        let mut ended = HashSet::new();
        for fact in &handled.lines {
            match fact {
                Handled::Attempt(attempt) if attempt.returned == Some(Outcome::Ok) => {
                    ended.insert((attempt.object.clone(), attempt.key.clone()));
                }
                Handled::DeadLetter(dead) => {
                    ended.insert((
                        dead.object.clone(),
                        delivery_key(&dead.message_id, &dead.target),
                    ));
                }
                Handled::Attempt(_) | Handled::Redrive(_) => {}
            }
        }
        Ok(copy_presence(copy, &produced.lines, &recorded, &ended))
    }
}

/// Which deliveries of accepted messages a copy must hold and does not:
/// `recorded` are the copy's owed and parked deliveries, `ended` the ones
/// the handlers' journal saw end, both by (object id, delivery key).
fn copy_presence(
    copy: &BackupCopy,
    produced: &[Produced],
    recorded: &HashSet<(String, String)>,
    ended: &HashSet<(String, String)>,
) -> Presence {
    let mut presence = Presence::default();
    let mut seen = HashSet::new();
    for fact in produced {
        let Produced::Accepted {
            object,
            ids,
            acked_ms,
            ..
        } = fact
        else {
            continue;
        };
        let Some(acked_ms) = copy.must_hold(object, *acked_ms) else {
            continue;
        };
        for id in ids {
            for target in TARGETS {
                let slot = (object.clone(), delivery_key(id, target));
                if !seen.insert(slot.clone()) {
                    continue;
                }
                let present = recorded.contains(&slot) || ended.contains(&slot);
                presence.item(present, acked_ms, || {
                    format!(
                        "{} was accepted at {acked_ms} but is neither in the restored copy of {} nor ended",
                        slot.1,
                        copy.describe(object)
                    )
                });
            }
        }
    }
    presence
}

/// The final fanout rows of every object, by object id.
#[derive(Debug, Default)]
struct Stored {
    owed: Vec<(String, OwedRow)>,
    parked: Vec<(String, ParkedRow)>,
}

/// A delivery still owed at the end.
#[derive(Debug)]
struct OwedRow {
    message_id: String,
    target: String,
    attempt: u32,
}

/// A parked terminal delivery.
#[derive(Debug)]
struct ParkedRow {
    delivery_id: String,
    message_id: String,
    target: String,
    attempts: u32,
    reason: String,
}

/// A terminal delivery's record, from the DLQ journal or the parked table.
struct Terminal<'a> {
    object: &'a str,
    delivery_id: &'a str,
    message_id: &'a str,
    target: &'a str,
    attempts: u32,
    explicit: bool,
    source: &'static str,
}

fn check_facts(
    produced: &[Produced],
    attempts: &[AttemptFact],
    dead_letters: &[DeadLetterFact],
    ledger: &Ledger,
    stored: &Stored,
    redrives: &HashMap<(String, String), u64>,
    mut tally: Tally,
) -> Tally {
    // Accepted messages by (object, id).
    let mut accepted: BTreeMap<(String, String), u64> = BTreeMap::new();
    // Enqueues of a message whose answer never came, by (object, id).
    let mut unanswered: HashMap<(String, String), u64> = HashMap::new();
    for fact in produced {
        match fact {
            Produced::Intent { object, items } => {
                for item in items {
                    *unanswered
                        .entry((object.clone(), message_id(*item)))
                        .or_default() += 1;
                }
            }
            Produced::Accepted {
                object, items, ids, ..
            } => {
                if ids.len() != items.len() {
                    tally.flag(
                        Violation::Broken("enqueue_answers"),
                        format!(
                            "an enqueue of {} items answered {} ids",
                            items.len(),
                            ids.len()
                        ),
                    );
                }
                for (item, id) in items.iter().zip(ids) {
                    accepted.insert((object.clone(), id.clone()), *item);
                }
                for item in items {
                    if let Some(n) = unanswered.get_mut(&(object.clone(), message_id(*item))) {
                        *n = n.saturating_sub(1);
                    }
                }
            }
            Produced::Rejected {
                object,
                items,
                error,
            } => {
                for item in items {
                    if let Some(n) = unanswered.get_mut(&(object.clone(), message_id(*item))) {
                        *n = n.saturating_sub(1);
                    }
                }
                tally.flag(
                    Violation::Broken("rejected_enqueues"),
                    format!("the enqueue of items {items:?} was rejected: {error}"),
                );
            }
        }
    }
    tally.accepted = u64::try_from(accepted.len()).unwrap_or(u64::MAX);

    // What the handlers saw per delivery: its identities and whether an
    // attempt ended it with Ok (acked or stored).
    let mut identities: HashMap<(&str, &str), HashSet<&str>> = HashMap::new();
    let mut succeeded: HashSet<(&str, &str)> = HashSet::new();
    for fact in attempts {
        let slot = (fact.object.as_str(), fact.key.as_str());
        identities
            .entry(slot)
            .or_default()
            .insert(fact.generation.as_str());
        if fact.returned == Some(Outcome::Ok) {
            succeeded.insert(slot);
        }
    }
    for ((object, key), generations) in &identities {
        // Each redrive gives the delivery one new identity, and so may each
        // enqueue of its message whose answer a kill swallowed.
        let message = key.split_once('@').map_or(*key, |(message, _)| message);
        let allowed = 1
            + redrives
                .get(&((*object).to_owned(), (*key).to_owned()))
                .copied()
                .unwrap_or(0)
            + unanswered
                .get(&((*object).to_owned(), message.to_owned()))
                .copied()
                .unwrap_or(0);
        if generations.len() as u64 > allowed {
            tally.flag(
                Violation::Broken("unstable_delivery_ids"),
                format!(
                    "{key} on {} was delivered as {generations:?}",
                    short(object)
                ),
            );
        }
    }

    let terminals: Vec<Terminal<'_>> = dead_letters
        .iter()
        .map(|d| Terminal {
            object: &d.object,
            delivery_id: &d.delivery_id,
            message_id: &d.message_id,
            target: &d.target,
            attempts: d.attempts,
            explicit: d.reason == DeadLetterReason::Explicit,
            source: "DLQ entry",
        })
        .chain(stored.parked.iter().map(|(object, p)| Terminal {
            object,
            delivery_id: &p.delivery_id,
            message_id: &p.message_id,
            target: &p.target,
            attempts: p.attempts,
            explicit: p.reason == "explicit",
            source: "parked delivery",
        }))
        .collect();
    let mut terminal: HashSet<(&str, String)> = HashSet::new();
    let mut dlq_writes: HashMap<&str, u64> = HashMap::new();
    for t in &terminals {
        let key = delivery_key(t.message_id, t.target);
        if t.source == "DLQ entry" {
            *dlq_writes.entry(t.delivery_id).or_default() += 1;
        }
        if t.attempts > MAX_ATTEMPTS {
            tally.flag(
                Violation::OverAttempts,
                format!("{} of {key} records {} attempts", t.source, t.attempts),
            );
        }
        if t.explicit {
            let outcome = ledger.outcome(t.object, &key, t.delivery_id, t.attempts);
            if outcome != Some(Outcome::Permanent) {
                tally.flag(
                    Violation::StaleSettlement,
                    format!(
                        "{} of {key} says attempt {} dead-lettered it, but that attempt returned {outcome:?}",
                        t.source, t.attempts
                    ),
                );
            }
        } else if t.attempts < MAX_ATTEMPTS {
            tally.flag(
                Violation::Broken("premature_dead_letters"),
                format!(
                    "{} of {key} is exhausted after {} of {MAX_ATTEMPTS} attempts",
                    t.source, t.attempts
                ),
            );
        }
        terminal.insert((t.object, key));
    }
    tally.detail(
        "dead_lettered",
        u64::try_from(dlq_writes.len()).unwrap_or(u64::MAX),
    );
    tally.detail(
        "repeated_dlq_writes",
        dlq_writes.values().map(|n| n - 1).sum::<u64>(),
    );
    tally.detail(
        "parked",
        u64::try_from(stored.parked.len()).unwrap_or(u64::MAX),
    );

    let owed: HashSet<(&str, String)> = stored
        .owed
        .iter()
        .map(|(object, row)| (object.as_str(), delivery_key(&row.message_id, &row.target)))
        .collect();
    for (object, row) in &stored.owed {
        if row.attempt > MAX_ATTEMPTS {
            tally.flag(
                Violation::OverAttempts,
                format!(
                    "{} stores attempt {} (max {MAX_ATTEMPTS})",
                    delivery_key(&row.message_id, &row.target),
                    row.attempt
                ),
            );
        }
        if !accepted.contains_key(&(object.clone(), row.message_id.clone())) {
            tally.flag(
                Violation::Broken("unsettled_deliveries"),
                format!(
                    "{} (enqueued by a killed life, never journaled) is still owed",
                    delivery_key(&row.message_id, &row.target)
                ),
            );
        }
    }

    let mut completed = 0_u64;
    let mut deliveries_ended = 0_u64;
    for (object, id) in accepted.keys() {
        let mut missing = Vec::new();
        for target in TARGETS {
            let key = delivery_key(id, target);
            let slot = (object.as_str(), key.clone());
            let ended = !owed.contains(&slot)
                && (succeeded.contains(&(object.as_str(), key.as_str()))
                    || terminal.contains(&slot));
            if ended {
                deliveries_ended += 1;
            } else if owed.contains(&slot) {
                missing.push(format!("{target} (still owed)"));
            } else {
                missing.push(target.to_owned());
            }
        }
        if missing.is_empty() {
            completed += 1;
        } else {
            tally.flag(
                Violation::Lost,
                format!("{id} on {} never ended for {missing:?}", short(object)),
            );
        }
    }
    tally.completed = completed;
    tally.detail("deliveries_ended", deliveries_ended);
    tally
}

/// The redrive checks, in journal order (attempts and redrives share the
/// journal): the old identity of a delivery whose redrive was attempted
/// never runs again, an accepted redrive leaves nothing parked under the old
/// identity, and every redrive of a listed entry is accepted. Returns the
/// redrive attempts per (object, delivery key).
fn check_redrives(
    handled: &[Handled],
    stored: &Stored,
    tally: &mut Tally,
) -> HashMap<(String, String), u64> {
    let mut attempted: HashMap<(String, String), u64> = HashMap::new();
    // Old identities whose redrive was attempted, and those accepted.
    let mut retired: HashSet<(&str, &str)> = HashSet::new();
    let mut accepted: HashSet<(&str, &str)> = HashSet::new();
    let mut redriven = 0_u64;
    for fact in handled {
        match fact {
            Handled::Redrive(r) => match r.accepted {
                None => {
                    retired.insert((r.object.as_str(), r.parked_id.as_str()));
                    *attempted
                        .entry((r.object.clone(), delivery_key(&r.message_id, &r.target)))
                        .or_default() += 1;
                }
                Some(true) => {
                    redriven += 1;
                    accepted.insert((r.object.as_str(), r.parked_id.as_str()));
                }
                Some(false) => tally.flag(
                    Violation::Broken("rejected_redrives"),
                    format!(
                        "the redrive of the parked {}, just listed, was rejected",
                        delivery_key(&r.message_id, &r.target)
                    ),
                ),
            },
            Handled::Attempt(a) => {
                if retired.contains(&(a.object.as_str(), a.generation.as_str())) {
                    // `normal`: a cut may undo the redrive's commit, whose
                    // reply was seen, and its old identity runs on.
                    tally.flag_or_allow(
                        tally.allowance().undone_settlements,
                        "undone_redrives",
                        Violation::Broken("redriven_delivery_ran_again"),
                        format!(
                            "{} ran attempt {} as {} after that identity was redriven",
                            a.key, a.attempt, a.generation
                        ),
                    );
                }
            }
            Handled::DeadLetter(_) => {}
        }
    }
    for (object, parked) in &stored.parked {
        if accepted.contains(&(object.as_str(), parked.delivery_id.as_str())) {
            tally.flag_or_allow(
                tally.allowance().undone_settlements,
                "undone_redrives",
                Violation::Broken("redriven_still_parked"),
                format!(
                    "{} on {} is still parked as {} after its redrive was accepted",
                    delivery_key(&parked.message_id, &parked.target),
                    short(object),
                    parked.delivery_id
                ),
            );
        }
    }
    tally.detail("redriven", redriven);
    attempted
}

/// The first digits of an object id, enough to tell objects apart.
fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepted(items: &[u64]) -> Produced {
        Produced::Accepted {
            object: "o".into(),
            items: items.to_vec(),
            ids: items.iter().map(|&i| message_id(i)).collect(),
            acked_ms: None,
        }
    }

    fn attempt(item: u64, target: &str, attempt: u32, returned: Option<Outcome>) -> AttemptFact {
        AttemptFact {
            returned,
            object: "o".into(),
            key: delivery_key(&message_id(item), target),
            generation: format!("[\"g{item}\",\"{target}\"]"),
            attempt,
            life: 0,
            scheduled_time: None,
        }
    }

    fn run(produced: &[Produced], attempts: &[AttemptFact], stored: &Stored) -> Tally {
        let mut tally = Tally::default();
        let ledger = Ledger::check(attempts, MAX_ATTEMPTS, &mut tally);
        check_facts(
            produced,
            attempts,
            &[],
            &ledger,
            stored,
            &HashMap::new(),
            tally,
        )
    }

    fn delivered(item: u64) -> Vec<AttemptFact> {
        TARGETS
            .iter()
            .flat_map(|t| {
                [
                    attempt(item, t, 1, None),
                    attempt(item, t, 1, Some(Outcome::Ok)),
                ]
            })
            .collect()
    }

    fn redrive(item: u64, parked_id: &str, accepted: Option<bool>) -> Handled {
        Handled::Redrive(RedriveFact {
            object: "o".into(),
            parked_id: parked_id.into(),
            message_id: message_id(item),
            target: INBOX.into(),
            accepted,
        })
    }

    /// Item 0's inbox delivery dead-lettered (parked) as `g0`, redriven,
    /// and acked under a new identity.
    /// Item 0 delivered and acked under a first identity whose enqueue
    /// answer a kill swallowed, then under a second one after the retry.
    fn delivered_twice() -> Vec<AttemptFact> {
        let mut second = attempt(0, INBOX, 1, Some(Outcome::Ok));
        second.generation = "[\"g-retry\",\"inbox\"]".into();
        vec![attempt(0, INBOX, 1, Some(Outcome::Ok)), second]
    }

    fn intent(items: &[u64]) -> Produced {
        Produced::Intent {
            object: "o".into(),
            items: items.to_vec(),
        }
    }

    #[test]
    fn a_new_identity_is_allowed_only_after_an_enqueue_whose_answer_was_lost() {
        let attempts = delivered_twice();
        // Killed after its intent and before its answer, then retried.
        let lost = run(
            &[intent(&[0]), intent(&[0]), accepted(&[0])],
            &attempts,
            &Stored::default(),
        );
        assert_eq!(lost.broken.get("unstable_delivery_ids"), None);
        // Every enqueue answered: a second identity is a broken guarantee.
        let answered = run(
            &[intent(&[0]), accepted(&[0])],
            &attempts,
            &Stored::default(),
        );
        assert_eq!(answered.broken.get("unstable_delivery_ids"), Some(&1));
    }

    fn redriven_then_acked() -> Vec<Handled> {
        let old = attempt(0, INBOX, 1, None).generation;
        let mut new = attempt(0, INBOX, 1, None);
        new.generation = "[\"g-new\",\"inbox\"]".into();
        let mut facts = vec![
            Handled::Attempt(attempt(0, INBOX, 1, None)),
            Handled::Attempt(attempt(0, INBOX, 1, Some(Outcome::Permanent))),
            redrive(0, &old, None),
            redrive(0, &old, Some(true)),
            Handled::Attempt(new.clone()),
            Handled::Attempt(AttemptFact {
                returned: Some(Outcome::Ok),
                ..new
            }),
        ];
        facts.extend(
            [
                attempt(0, ARCHIVE, 1, None),
                attempt(0, ARCHIVE, 1, Some(Outcome::Ok)),
            ]
            .map(Handled::Attempt),
        );
        facts
    }

    fn run_handled(handled: &[Handled], stored: &Stored) -> Tally {
        let attempts: Vec<AttemptFact> = handled
            .iter()
            .filter_map(|f| match f {
                Handled::Attempt(a) => Some(a.clone()),
                _ => None,
            })
            .collect();
        let mut tally = Tally::default();
        let ledger = Ledger::check(&attempts, MAX_ATTEMPTS, &mut tally);
        let redrives = check_redrives(handled, stored, &mut tally);
        check_facts(
            &[accepted(&[0])],
            &attempts,
            &[],
            &ledger,
            stored,
            &redrives,
            tally,
        )
    }

    #[test]
    fn a_redriven_delivery_may_end_under_its_new_identity() {
        let tally = run_handled(&redriven_then_acked(), &Stored::default());
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!(tally.completed, 1);
        // Without the redrive the second identity is an unstable delivery id.
        let without: Vec<Handled> = redriven_then_acked()
            .into_iter()
            .filter(|f| !matches!(f, Handled::Redrive(_)))
            .collect();
        let tally = run_handled(&without, &Stored::default());
        assert_eq!(tally.broken.get("unstable_delivery_ids"), Some(&1));
    }

    #[test]
    fn a_redriven_identity_that_runs_again_is_flagged() {
        let mut handled = redriven_then_acked();
        handled.push(Handled::Attempt(attempt(0, INBOX, 2, None)));
        let tally = run_handled(&handled, &Stored::default());
        assert_eq!(
            tally.broken.get("redriven_delivery_ran_again"),
            Some(&1),
            "{:?}",
            tally.examples()
        );
    }

    #[test]
    fn an_accepted_redrive_whose_entry_is_still_parked_is_flagged() {
        let old = attempt(0, INBOX, 1, None).generation;
        let stored = Stored {
            owed: Vec::new(),
            parked: vec![(
                "o".into(),
                ParkedRow {
                    delivery_id: old,
                    message_id: message_id(0),
                    target: INBOX.into(),
                    attempts: 1,
                    reason: "explicit".into(),
                },
            )],
        };
        let tally = run_handled(&redriven_then_acked(), &stored);
        assert_eq!(
            tally.broken.get("redriven_still_parked"),
            Some(&1),
            "{:?}",
            tally.examples()
        );
    }

    #[test]
    fn a_message_delivered_to_every_target_passes() {
        let tally = run(&[accepted(&[0])], &delivered(0), &Stored::default());
        assert_eq!(tally.violations(), 0, "{:?}", tally.examples());
        assert_eq!((tally.accepted, tally.completed), (1, 1));
    }

    #[test]
    fn a_message_one_target_never_got_is_lost() {
        let facts = [
            attempt(0, INBOX, 1, None),
            attempt(0, INBOX, 1, Some(Outcome::Ok)),
        ];
        let tally = run(&[accepted(&[0])], &facts, &Stored::default());
        assert_eq!(tally.lost, 1);
        assert_eq!(tally.completed, 0);
    }

    #[test]
    fn a_delivery_still_owed_at_the_end_is_lost() {
        let stored = Stored {
            owed: vec![(
                "o".into(),
                OwedRow {
                    message_id: message_id(0),
                    target: ARCHIVE.into(),
                    attempt: 1,
                },
            )],
            parked: Vec::new(),
        };
        let tally = run(&[accepted(&[0])], &delivered(0), &stored);
        assert_eq!(tally.lost, 1);
    }

    #[test]
    fn a_parking_no_attempt_decided_is_a_stale_settlement() {
        let mut facts = delivered(0);
        facts.retain(|f| !f.key.ends_with(ARCHIVE));
        let stored = Stored {
            owed: Vec::new(),
            parked: vec![(
                "o".into(),
                ParkedRow {
                    delivery_id: "[\"g0\",\"archive\"]".into(),
                    message_id: message_id(0),
                    target: ARCHIVE.into(),
                    attempts: 1,
                    reason: "explicit".into(),
                },
            )],
        };
        let tally = run(&[accepted(&[0])], &facts, &stored);
        assert_eq!(tally.stale_settlements, 1);
    }

    #[test]
    fn an_exhausted_dead_letter_with_attempts_left_is_premature() {
        let stored = Stored {
            owed: Vec::new(),
            parked: vec![(
                "o".into(),
                ParkedRow {
                    delivery_id: "[\"g0\",\"inbox\"]".into(),
                    message_id: message_id(0),
                    target: INBOX.into(),
                    attempts: 2,
                    reason: "exhausted".into(),
                },
            )],
        };
        let tally = run(&[accepted(&[0])], &delivered(0), &stored);
        assert_eq!(tally.broken.get("premature_dead_letters"), Some(&1));
    }
}
