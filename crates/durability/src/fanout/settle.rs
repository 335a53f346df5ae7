//! Settlement (§3.9–§3.12): what `ack`, `retry` and `dead_letter` do to a
//! claimed delivery, the retry rule shared with unsettled messages, and the
//! dead-letter flow.
//!
//! Every write is a compare-and-set on the attempt the pass claimed, so a
//! settlement of a stale attempt (the row was reclaimed after a timeout,
//! registered again, or removed) changes nothing and reports
//! [`SettlementError::Stale`]. Each message accepts one settlement per
//! delivery: the first call is binding, later ones and calls after the
//! batch closed are rejected.
//!
//! The dead-letter flow persists its intent before any external I/O: once
//! a delivery is decided terminal, a crash or a timeout can repeat the DLQ
//! write but can never turn the decision back into a consumer delivery.
//!
//! After the target's turn ([`Inner::finish_batch`]) this module ends the
//! batch: acks on return (for a cursor's range, one write that moves the
//! cursor past the whole batch), acks a storage target's written messages,
//! retries the unsettled ones, dead-letters the terminal ones, and finally
//! moves the cursor past everything of its range that is settled or has
//! become an exception row. A settlement still running keeps the rest of
//! the range claimed: it comes back at the claim's deadline, minus what
//! has a row by then.
//!
//! Must not claim or hand over (that is `dispatch`) or write SQL (that is
//! `store`).

use std::collections::HashSet;
use std::rc::Rc;
use std::time::Duration;

use durability_platform::{EpochMs, LocalBoxFuture, MAX_SAFE_INTEGER, StorageError};
use futures::FutureExt;
use futures::future::Either;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::batch::{Batch, Claim, ClaimedRange, Handover, SettleState, SharedSettlement};
use super::error::{FanoutError, SettlementError, timeout_error};
use super::message::{Failure, Settling, StoredMessage};
use super::outcome::{DeadLetterReason, SettlementOutcome};
use super::store::{self, DeliveryRow, Lane, ParkedRow, Phase};
use super::target::{Target, TargetKind};
use super::{INFRASTRUCTURE_RETRY, INFRASTRUCTURE_RETRY_MS, Inner, entity};
use crate::codec;
use crate::error::{HandlerError, SerializedError};
use crate::lifecycle::{LifecycleEvent, Outcome, TerminalReason};
use crate::retry::{AttemptPolicy, decide_retry};

/// Claims a target's next batch inside the commit that ends its previous
/// one (given by `mod.rs`, which wires `dispatch` in): `None` when nothing
/// is due or the claim could not be made (the next pass claims as usual).
pub(crate) type NextClaim<'a> = &'a dyn Fn(&dyn durability_platform::Sql) -> Option<Batch>;

impl<B> Inner<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// The settlement gate: accepts the first call while the delivery is
    /// open, and starts its action at once, whether or not the caller
    /// awaits it (the pass awaits every started action before it closes).
    fn start_settlement(
        &self,
        state: &Rc<SettleState>,
        outcome: SettlementOutcome,
        action: LocalBoxFuture<'static, Result<(), SettlementError>>,
    ) -> Settling {
        let id = &state.claim.message_id;
        if let Some(current) = state.outcome.get() {
            return Settling::rejected(SettlementError::AlreadySettled {
                id: id.clone(),
                outcome: current,
            });
        }
        if state.closed.get() {
            return Settling::rejected(SettlementError::Stale { id: id.clone() });
        }
        state.outcome.set(Some(outcome));
        let tracked_state = Rc::clone(state);
        let tracked: SharedSettlement = async move {
            let result = action.await;
            tracked_state.finished.set(true);
            if result.is_ok() {
                tracked_state.completed.set(true);
            }
            result
        }
        .boxed_local()
        .shared();
        *state.pending.borrow_mut() = Some(tracked.clone());
        let driver = tracked.clone();
        self.engine.ctx.wait_until(Box::pin(async move {
            let _ = driver.await;
        }));
        Settling::new(tracked)
    }

    /// `ack()`: removes the row (one transaction).
    pub(crate) fn ack(self: &Rc<Self>, state: &Rc<SettleState>) -> Settling {
        let inner = Rc::clone(self);
        let acked = Rc::clone(state);
        self.start_settlement(
            state,
            SettlementOutcome::Ack,
            Box::pin(async move {
                inner.remove(&acked.claim).await?;
                inner.emit_completed(&acked);
                Ok(())
            }),
        )
    }

    /// `retry()` / `retry_after(delay)`. A delay is checked before the gate:
    /// a bad one is rejected and leaves the message unsettled.
    pub(crate) fn retry(
        self: &Rc<Self>,
        state: &Rc<SettleState>,
        delay: Option<Duration>,
    ) -> Settling {
        let delay_ms = match delay {
            None => None,
            Some(delay) => {
                let now = self.engine.now();
                let requested = delay.as_millis();
                let ms = i64::try_from(requested).ok().filter(|ms| {
                    now.checked_add(*ms)
                        .is_some_and(|at| at <= MAX_SAFE_INTEGER)
                });
                match ms {
                    Some(ms) => Some(ms),
                    None => {
                        return Settling::rejected(SettlementError::InvalidRetryDelay {
                            delay_ms: requested,
                            now_ms: now,
                        });
                    }
                }
            }
        };
        let inner = Rc::clone(self);
        let retried = Rc::clone(state);
        self.start_settlement(
            state,
            SettlementOutcome::Retry,
            Box::pin(async move {
                let error = HandlerError::named("Retry", "Retried by consumer");
                inner
                    .retry_rule(
                        &retried.claim,
                        &retried.policy,
                        delay_ms,
                        error,
                        retried.started_at,
                    )
                    .await
            }),
        )
    }

    /// `dead_letter()`: the dead-letter flow with reason `explicit` and the
    /// row's previous failure.
    pub(crate) fn dead_letter(self: &Rc<Self>, state: &Rc<SettleState>) -> Settling {
        let inner = Rc::clone(self);
        let dead = Rc::clone(state);
        self.start_settlement(
            state,
            SettlementOutcome::DeadLetter,
            Box::pin(async move {
                inner
                    .dead_letter_flow(&dead.claim, DeadLetterReason::Explicit, None)
                    .await
            }),
        )
    }

    /// Ends a delivery its attempt still owns, with its memos and its place
    /// in the pending count.
    async fn remove(&self, claim: &Claim) -> Result<(), SettlementError> {
        let removed = self
            .transaction(|sql| {
                let removed = store::remove_delivery(sql, &claim.row)?;
                if removed {
                    self.adjust_pending(-1);
                }
                Ok::<_, StorageError>(removed)
            })
            .await?;
        if removed {
            Ok(())
        } else {
            Err(SettlementError::Stale {
                id: claim.row.id.clone(),
            })
        }
    }

    /// Acks `acked` (unsettled messages of a target that acks on return,
    /// and a storage target's written ones) in one transaction. When every
    /// other delivery of the batch's cursor range already settled for good,
    /// the same transaction moves the cursor past the whole range: the
    /// common path costs one small write per batch and nothing per
    /// message. Otherwise each cursor delivery gets its tombstone. An
    /// exception row is removed; one a later attempt already reclaimed
    /// stays with that attempt and is not reported. If the transaction
    /// fails, the messages are "finished, not completed", and the pass
    /// reads them again before retrying them.
    ///
    /// When the cursor moves, `next` may claim the target's next batch in
    /// the same commit (one commit per batch instead of two while a backlog
    /// lasts).
    async fn ack_together(
        &self,
        states: &[Rc<SettleState>],
        acked: &[&Rc<SettleState>],
        range: Option<ClaimedRange>,
        target_id: &str,
        next: Option<NextClaim<'_>>,
    ) -> Result<(bool, Option<Batch>), SettlementError> {
        if acked.is_empty() {
            return Ok((false, None));
        }
        for state in acked {
            state.choose(SettlementOutcome::Ack);
        }
        let acked_ids: HashSet<&str> = acked.iter().map(|s| s.claim.row.id.as_str()).collect();
        let whole_range = range.filter(|_| {
            states.iter().all(|state| {
                state.claim.row.lane != Lane::Cursor
                    || state.is_completed()
                    || acked_ids.contains(state.claim.row.id.as_str())
            })
        });
        let result = self
            .transaction(|sql| {
                let mut removed = HashSet::new();
                let mut moved = false;
                if let Some(claimed) = whole_range {
                    moved = store::advance_cursor(
                        sql,
                        target_id,
                        claimed.attempt,
                        claimed.from,
                        claimed.end,
                        false,
                    )?
                    .moved;
                }
                for state in acked {
                    let row = &state.claim.row;
                    let gone = if row.lane == Lane::Cursor && moved {
                        crate::memo::delete_memos(sql, store::DELIVERIES, &row.id)?;
                        true
                    } else {
                        store::remove_delivery(sql, row)?
                    };
                    if gone {
                        self.adjust_pending(-1);
                        removed.insert(row.id.as_str());
                    }
                }
                let claimed = match next {
                    Some(claim) if moved => claim(sql),
                    _ => None,
                };
                Ok::<_, StorageError>((removed, moved, claimed))
            })
            .await;
        for state in acked {
            state.finished.set(true);
        }
        let (removed, moved, claimed) = result?;
        for state in acked {
            if removed.contains(state.claim.row.id.as_str()) {
                state.completed.set(true);
                self.emit_completed(state);
            }
        }
        Ok((moved, claimed))
    }

    /// Ends the batch after the target's turn: acks on return or a storage
    /// target's writes, retries what is left unsettled, dead-letters the
    /// terminal deliveries, then moves the cursor past its range. Returns
    /// the next batch when `next` claimed it in the commit of the acks.
    #[allow(clippy::too_many_arguments)] // one caller (the pass), each argument named there
    pub(crate) async fn finish_batch(
        &self,
        target_id: &str,
        target: Option<&Target<B>>,
        states: &[Rc<SettleState>],
        terminal: Vec<Claim>,
        mut range: Option<ClaimedRange>,
        handover: Option<Handover>,
        next: NextClaim<'_>,
    ) -> Result<Option<Batch>, FanoutError> {
        let mut claimed = None;
        // The range moves with the acks only if nothing of it is left to
        // dead-letter first.
        let movable = range.filter(|_| terminal.iter().all(|c| c.row.lane != Lane::Cursor));
        let failure = match handover {
            None => None,
            Some(Handover::TimedOut(ms)) => Some(timeout_error(ms)),
            Some(Handover::Returned(Err(error))) => Some(error),
            Some(Handover::Returned(Ok(()))) => {
                let acks_on_return = target.is_some_and(|target| {
                    target.ack_on_return && matches!(target.kind, TargetKind::Consumer { .. })
                });
                let mut failure =
                    HandlerError::new("Consumer returned without settling the message");
                if acks_on_return {
                    let unsettled: Vec<&Rc<SettleState>> =
                        states.iter().filter(|state| state.is_unsettled()).collect();
                    // The next batch is claimed only in the commit that
                    // moves the cursor past this whole one (every delivery
                    // of its range acked or settled for good).
                    match self
                        .ack_together(states, &unsettled, movable, target_id, Some(next))
                        .await
                    {
                        Ok((true, next)) => {
                            range = None;
                            claimed = next;
                        }
                        Ok((false, _)) => {}
                        Err(error) => failure = error.to_handler_error(),
                    }
                }
                Some(failure)
            }
        };
        // A storage target's written messages are acked together, whether
        // or not the rest of the batch made it.
        let written: Vec<&Rc<SettleState>> = states
            .iter()
            .filter(|state| state.written.get() && state.outcome.get().is_none())
            .collect();
        let mut written_failure = None;
        match self
            .ack_together(states, &written, movable.and(range), target_id, None)
            .await
        {
            Ok((true, _)) => range = None,
            Ok((false, _)) => {}
            Err(error) => written_failure = Some(error.to_handler_error()),
        }
        if let Some(failure) = written_failure.or(failure) {
            self.retry_unsettled(states, failure).await?;
        }
        // Terminal deliveries were found, not claimed: they go to the DLQ
        // (or are parked) and never to the target.
        for claim in terminal {
            let reason = claim
                .row
                .dead_letter_reason
                .unwrap_or(DeadLetterReason::Exhausted);
            let result = self.dead_letter_flow(&claim, reason, None).await;
            self.settled_by_pass(&claim.row, result)?;
        }
        if let Some(claimed) = range {
            self.finish_range(target_id, states, claimed).await?;
        }
        Ok(claimed)
    }

    /// Moves the cursor past its claimed range, or, while a settlement of
    /// one of its deliveries is still running, up to that delivery (the
    /// rest of the range stays claimed and comes back at its deadline).
    async fn finish_range(
        &self,
        target_id: &str,
        states: &[Rc<SettleState>],
        claimed: ClaimedRange,
    ) -> Result<(), FanoutError> {
        let running = states
            .iter()
            .filter(|state| state.claim.row.lane == Lane::Cursor)
            .filter(|state| state.has_outcome() && !state.is_finished())
            .map(|state| state.claim.row.seq)
            .min();
        let (to, keep_claim) = match running {
            Some(seq) => (seq, true),
            None => (claimed.end, false),
        };
        if to <= claimed.from && keep_claim {
            return Ok(());
        }
        let advance = self
            .transaction(|sql| {
                store::advance_cursor(
                    sql,
                    target_id,
                    claimed.attempt,
                    claimed.from,
                    to,
                    keep_claim,
                )
            })
            .await?;
        if !advance.moved {
            tracing::warn!(
                target = target_id,
                from = claimed.from,
                attempt = claimed.attempt,
                "the cursor moved on without this pass; left as it is"
            );
        }
        Ok(())
    }

    /// Every message not settled for good is retried with `failure`, in
    /// batch order. A settlement still running keeps its claim (it comes
    /// back at the deadline if the settlement never lands); a settlement
    /// that failed may have committed anyway, so the delivery is read
    /// again before it is retried.
    async fn retry_unsettled(
        &self,
        states: &[Rc<SettleState>],
        failure: HandlerError,
    ) -> Result<(), FanoutError> {
        for state in states {
            if state.is_completed() {
                continue;
            }
            if state.has_outcome() {
                if !state.is_finished() {
                    continue;
                }
                let claimed = &state.claim.row;
                let sql = self.engine.sql();
                let still_ours = match store::read_delivery(sql, &claimed.id)? {
                    Some(row) => {
                        row.generation == claimed.generation
                            && row.attempt == claimed.attempt
                            && row.phase == Phase::Delivery
                    }
                    // A delivery still on its cursor has no row until it
                    // settles; with none (not even a tombstone), the
                    // settlement did not commit.
                    None => claimed.lane == Lane::Cursor && !store::has_row(sql, &claimed.id)?,
                };
                if !still_ours {
                    continue;
                }
            }
            state.choose(SettlementOutcome::Retry);
            let error = state
                .failure_before_delivery()
                .unwrap_or_else(|| failure.clone());
            let result = self
                .retry_rule(&state.claim, &state.policy, None, error, state.started_at)
                .await;
            state.finished.set(true);
            state.completed.set(result.is_ok());
            self.settled_by_pass(&state.claim.row, result)?;
        }
        Ok(())
    }

    /// The outcome of a settlement a pass made itself: a delivery a newer
    /// attempt already owns is that attempt's business, not a failure of
    /// this pass.
    fn settled_by_pass(
        &self,
        row: &DeliveryRow,
        result: Result<(), SettlementError>,
    ) -> Result<(), FanoutError> {
        match result {
            Ok(()) => Ok(()),
            Err(SettlementError::Storage(error)) => Err(error.into()),
            Err(other) => {
                tracing::warn!(
                    delivery = %row.id,
                    generation = %row.generation,
                    attempt = row.attempt,
                    error = %other,
                    "a newer attempt owns the delivery; left to it"
                );
                Ok(())
            }
        }
    }

    /// The retry rule, shared by `retry()` and unsettled messages: a
    /// delivery out of attempts, or whose policy gives up (a non-retryable
    /// error, an unusable delay), is dead-lettered; any other is due again
    /// after the delay, its attempt unchanged (the next claim counts it).
    pub(crate) async fn retry_rule(
        &self,
        claim: &Claim,
        policy: &AttemptPolicy,
        delay_ms: Option<i64>,
        error: HandlerError,
        started_at: EpochMs,
    ) -> Result<(), SettlementError> {
        let row = &claim.row;
        if row.attempt >= policy.max_attempts {
            return self
                .dead_letter_flow(claim, DeadLetterReason::Exhausted, Some(error.serialize()))
                .await;
        }
        let now = self.engine.now();
        let next_attempt_at = match delay_ms {
            Some(ms) => match now.checked_add(ms).filter(|at| *at <= MAX_SAFE_INTEGER) {
                Some(at) => at,
                None => {
                    let refused = HandlerError::retry_policy("fanout", None);
                    return self
                        .dead_letter_flow(
                            claim,
                            DeadLetterReason::Exhausted,
                            Some(refused.serialize()),
                        )
                        .await;
                }
            },
            None => {
                let decision = decide_retry(
                    policy,
                    "fanout",
                    row.attempt,
                    error.clone(),
                    false,
                    now,
                    self.engine.uniform(),
                );
                if decision.terminal {
                    return self
                        .dead_letter_flow(
                            claim,
                            DeadLetterReason::Exhausted,
                            Some(decision.error.serialize()),
                        )
                        .await;
                }
                decision.next_attempt_at
            }
        };
        let serialized = error.serialize();
        let scheduled = self
            .transaction(|sql| store::schedule_retry(sql, row, next_attempt_at, &serialized))
            .await?;
        if !scheduled {
            return Err(SettlementError::Stale { id: row.id.clone() });
        }
        let timestamp = self.engine.now();
        self.emit(|| LifecycleEvent::AttemptSettled {
            entity: entity(&claim.message_id, &row.target_id, &row.generation),
            timestamp,
            attempt: row.attempt,
            duration_ms: duration_since(started_at, timestamp),
            outcome: Outcome::RetryScheduled {
                error: serialized,
                next_attempt_at,
            },
        });
        Ok(())
    }

    /// The dead-letter flow. Without a DLQ the delivery is parked: removed
    /// and stored in the parked table in one transaction. With a DLQ, intent
    /// is committed first (phase `dead_letter`, due again in a minute), then
    /// the DLQ write runs under a one-minute deadline; its failure is
    /// reported and swallowed, and the next pass after the minute repeats it
    /// with the same timestamp, reason and error.
    pub(crate) async fn dead_letter_flow(
        &self,
        claim: &Claim,
        reason: DeadLetterReason,
        failure: Option<SerializedError>,
    ) -> Result<(), SettlementError> {
        let row = &claim.row;
        let now = self.engine.now();
        // Stable across repeats of this step, so a repeated DLQ write is
        // byte-identical and a refusing writer sees the same entry.
        let timestamp = row.dead_lettered_at.unwrap_or(now);
        let error = failure.or_else(|| row.last_failure());
        let Some(dlq) = &self.dlq else {
            return self.park(claim, reason, error, timestamp).await;
        };
        // A body this version cannot read cannot be handed to a typed DLQ
        // either; retrying that write every minute would keep it out of
        // sight for ever. It is parked with its raw stored body instead.
        let body = match codec::decode_as::<B>(&claim.payload) {
            Ok(body) => body,
            Err(decode) => {
                tracing::error!(
                    event = "durability.fanout.undecodable_dead_letter",
                    id = %claim.message_id,
                    target = %row.target_id,
                    error = %decode,
                    "a dead letter's body does not decode; parked instead of written to the DLQ"
                );
                let error = error.or_else(|| Some(HandlerError::from(decode).serialize()));
                return self.park(claim, reason, error, timestamp).await;
            }
        };
        let intent = self
            .transaction(|sql| {
                store::persist_dead_letter_intent(
                    sql,
                    row,
                    timestamp,
                    reason,
                    now.saturating_add(INFRASTRUCTURE_RETRY_MS),
                    error.as_ref(),
                )
            })
            .await?;
        if !intent {
            return Err(SettlementError::Stale { id: row.id.clone() });
        }
        let written = async {
            let stored = StoredMessage {
                id: row.identity(),
                message_id: claim.message_id.clone(),
                target: row.target_id.clone(),
                body,
                enqueued_at: claim.enqueued_at,
                stored_at: timestamp,
                attempts: row.attempt,
                failure: Some(Failure {
                    reason,
                    error: error.clone(),
                }),
            };
            let write = dlq(stored);
            let deadline = self.engine.ctx.sleep(INFRASTRUCTURE_RETRY);
            futures::pin_mut!(write);
            match futures::future::select(write, deadline).await {
                Either::Left((result, _)) => result?,
                Either::Right(((), _)) => {
                    return Err(timeout_error(
                        u64::try_from(INFRASTRUCTURE_RETRY_MS).unwrap_or(60_000),
                    ));
                }
            }
            self.remove(claim)
                .await
                .map_err(|error| error.to_handler_error())
        }
        .await;
        match written {
            Ok(()) => self.emit_terminal(claim, reason, error),
            Err(failure) => tracing::error!(
                event = "durability.fanout.dead_letter_failed",
                id = %claim.message_id,
                target = %row.target_id,
                error = %failure,
                "dead-letter write failed; retried in a minute"
            ),
        }
        Ok(())
    }

    /// Without a DLQ nothing outside the object could ever accept this
    /// delivery, and retrying a write would keep the object awake for ever;
    /// so it is parked in the object's own table, atomically with its
    /// removal, and keeps no alarm armed.
    async fn park(
        &self,
        claim: &Claim,
        reason: DeadLetterReason,
        error: Option<SerializedError>,
        parked_at: EpochMs,
    ) -> Result<(), SettlementError> {
        let row = &claim.row;
        let parked = ParkedRow {
            id: row.identity(),
            message_id: claim.message_id.clone(),
            message_key: row.message_key.clone(),
            target_id: row.target_id.clone(),
            payload: claim.payload.clone(),
            enqueued_at: claim.enqueued_at,
            parked_at,
            attempts: row.attempt,
            reason,
            error: error.clone(),
        };
        let removed = self
            .transaction(|sql| {
                if !store::remove_delivery(sql, row)? {
                    return Ok(false);
                }
                self.adjust_pending(-1);
                store::park(sql, &parked)?;
                Ok::<_, StorageError>(true)
            })
            .await?;
        if !removed {
            return Err(SettlementError::Stale { id: row.id.clone() });
        }
        crate::telemetry::fanout_parked(&row.target_id);
        self.emit_terminal(claim, reason, error);
        Ok(())
    }

    fn emit_completed(&self, state: &SettleState) {
        let row = &state.claim.row;
        let timestamp = self.engine.now();
        self.emit(|| LifecycleEvent::AttemptSettled {
            entity: entity(&state.claim.message_id, &row.target_id, &row.generation),
            timestamp,
            attempt: row.attempt,
            duration_ms: duration_since(state.started_at, timestamp),
            outcome: Outcome::Completed { result: None },
        });
    }

    fn emit_terminal(
        &self,
        claim: &Claim,
        reason: DeadLetterReason,
        error: Option<SerializedError>,
    ) {
        let row = &claim.row;
        self.emit(|| LifecycleEvent::Terminal {
            entity: entity(&claim.message_id, &row.target_id, &row.generation),
            timestamp: self.engine.now(),
            attempt: row.attempt,
            reason: match reason {
                DeadLetterReason::Explicit => TerminalReason::DeadLettered,
                DeadLetterReason::Exhausted => TerminalReason::AttemptsExhausted,
            },
            error: error
                .unwrap_or_else(|| SerializedError::new("DeadLetter", "Dead-lettered by consumer")),
        });
    }
}

/// `max(0, end - start)` in milliseconds.
fn duration_since(start: EpochMs, end: EpochMs) -> u64 {
    u64::try_from(end.saturating_sub(start)).unwrap_or(0)
}
