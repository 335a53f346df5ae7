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

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::rc::Rc;
use std::time::Duration;

use durability_platform::{EpochMs, LocalBoxFuture, MAX_SAFE_INTEGER, StorageError};
use futures::FutureExt;
use futures::future::{Either, Shared};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::dispatch::Claim;
use super::error::{SettlementError, timeout_error};
use super::message::{DeadLetterReason, Failure, SettlementOutcome, Settling, StoredMessage};
use super::store::{self, ParkedRow};
use super::{INFRASTRUCTURE_RETRY, INFRASTRUCTURE_RETRY_MS, Inner, entity};
use crate::codec;
use crate::error::{HandlerError, SerializedError};
use crate::lifecycle::{LifecycleEvent, Outcome, TerminalReason};
use crate::retry::{AttemptPolicy, decide_retry};

type SharedSettlement = Shared<LocalBoxFuture<'static, Result<(), SettlementError>>>;

/// The settlement of one message in one delivery, in memory.
pub(crate) struct SettleState {
    pub(crate) claim: Claim,
    /// The target's policy when the batch was claimed.
    pub(crate) policy: AttemptPolicy,
    /// When the batch was handed to the target.
    pub(crate) started_at: EpochMs,
    /// No settlement call is accepted any more (the target returned, timed
    /// out, or the message never reached it).
    closed: Cell<bool>,
    /// The binding settlement, once one was chosen.
    outcome: Cell<Option<SettlementOutcome>>,
    /// The chosen settlement's action ended (well or not).
    finished: Cell<bool>,
    /// The chosen settlement's action committed.
    completed: Cell<bool>,
    /// The chosen settlement's action, shared by the caller and the pass.
    pending: RefCell<Option<SharedSettlement>>,
    /// Why the message could not even be handed to its target.
    failed_before_delivery: RefCell<Option<HandlerError>>,
}

impl SettleState {
    pub(crate) fn new(claim: Claim, policy: AttemptPolicy, started_at: EpochMs) -> Self {
        SettleState {
            claim,
            policy,
            started_at,
            closed: Cell::new(false),
            outcome: Cell::new(None),
            finished: Cell::new(false),
            completed: Cell::new(false),
            pending: RefCell::new(None),
            failed_before_delivery: RefCell::new(None),
        }
    }

    pub(crate) fn close(&self) {
        self.closed.set(true);
    }

    pub(crate) fn has_outcome(&self) -> bool {
        self.outcome.get().is_some()
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.finished.get()
    }

    pub(crate) fn is_completed(&self) -> bool {
        self.completed.get()
    }

    /// The pass retries the message itself.
    pub(crate) fn choose_retry(&self) {
        self.outcome.set(Some(SettlementOutcome::Retry));
    }

    /// The action of the settlement chosen so far, if one was started.
    pub(crate) fn pending(&self) -> Option<SharedSettlement> {
        self.pending.borrow().clone()
    }

    /// The message is not handed to its target; the pass retries it with
    /// `error`.
    pub(crate) fn fail_before_delivery(&self, error: HandlerError) {
        self.closed.set(true);
        *self.failed_before_delivery.borrow_mut() = Some(error);
    }

    pub(crate) fn failure_before_delivery(&self) -> Option<HandlerError> {
        self.failed_before_delivery.borrow().clone()
    }
}

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

    /// Deletes a delivery its attempt still owns, with its memos, its share
    /// of the manifest and its place in the pending count.
    async fn remove(&self, claim: &Claim) -> Result<(), SettlementError> {
        let removed = self
            .transaction(|sql| {
                let removed =
                    store::remove_delivery(sql, &claim.row.attempt_ref(), &claim.row.message_key)?;
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

    /// `ack_on_return`: acks every message still unsettled in one
    /// transaction. A row a later attempt already reclaimed stays with that
    /// attempt and is not reported. If the transaction fails, the messages
    /// are "finished, not completed", and the pass reads them again before
    /// retrying them.
    pub(crate) async fn ack_unsettled(
        &self,
        states: &[Rc<SettleState>],
    ) -> Result<(), SettlementError> {
        // A message that never reached the consumer (its body did not
        // decode) was not handled by this return: it stays a failed attempt.
        let unsettled: Vec<&Rc<SettleState>> = states
            .iter()
            .filter(|state| {
                state.outcome.get().is_none() && state.failed_before_delivery.borrow().is_none()
            })
            .collect();
        if unsettled.is_empty() {
            return Ok(());
        }
        for state in &unsettled {
            state.outcome.set(Some(SettlementOutcome::Ack));
        }
        let removed = self
            .transaction(|sql| {
                let mut removed = HashSet::new();
                for state in &unsettled {
                    let row = &state.claim.row;
                    if store::remove_delivery(sql, &row.attempt_ref(), &row.message_key)? {
                        self.adjust_pending(-1);
                        removed.insert(row.id.as_str());
                    }
                }
                Ok::<_, StorageError>(removed)
            })
            .await;
        for state in &unsettled {
            state.finished.set(true);
        }
        let removed = removed?;
        for state in &unsettled {
            if removed.contains(state.claim.row.id.as_str()) {
                state.completed.set(true);
                self.emit_completed(state);
            }
        }
        Ok(())
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
            .transaction(|sql| {
                store::schedule_retry(sql, &row.attempt_ref(), next_attempt_at, &serialized)
            })
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
                    &row.attempt_ref(),
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
                if !store::remove_delivery(sql, &row.attempt_ref(), &row.message_key)? {
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
