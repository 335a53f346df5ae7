//! Dispatch (§3.7, §3.8): one bounded pass per target, then one call of the
//! target with the whole batch.
//!
//! A pass of one target never overlaps another pass of the same target in
//! this instance (a second caller joins the running one), while different
//! targets run concurrently, each holding one permit of the scheduler's
//! pool; a slow or removed target cannot stop another, and the due queries
//! are per target, so one target's backlog cannot hide another's work
//! behind a global limit.
//!
//! Must not decide settlement rules (that is `settle`) or write SQL (that is
//! `store`).

use std::rc::Rc;
use std::time::Duration;

use durability_platform::{AlarmInfo, EpochMs, LocalBoxFuture, StorageError};
use futures::future::{Either, join_all};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{oneshot, watch};
use tracing::Instrument;

use super::error::{FanoutError, timeout_error};
use super::message::{DeadLetterReason, FanoutMessage, StoredMessage};
use super::settle::SettleState;
use super::store::{self, DELIVERIES, DeliveryRow, Manifest, Phase};
use super::target::{DeliverFn, Target, TargetKind, WriteFn};
use super::{INFRASTRUCTURE_RETRY_MS, Inner, MISSING_TARGET_POSTPONE_BATCH, entity};
use crate::codec;
use crate::error::{DurabilityError, HandlerError};
use crate::lifecycle::LifecycleEvent;
use crate::load::Direction;
use crate::memo::Memo;
use crate::record::DurableTable;
use crate::retry::AttemptPolicy;
use crate::scheduler::Participant;

/// A delivery row claimed (or found terminal) by a pass, with what its
/// manifest says about the message.
pub(crate) struct Claim {
    /// The row; after a claim, `attempt` is the claimed attempt.
    pub row: DeliveryRow,
    pub message_id: String,
    /// The body in the stored encoding.
    pub payload: String,
    pub enqueued_at: EpochMs,
}

impl Claim {
    fn new(row: DeliveryRow, manifest: Manifest) -> Self {
        Claim {
            row,
            message_id: manifest.id,
            payload: manifest.payload,
            enqueued_at: manifest.created_at,
        }
    }
}

impl<B> Participant for Inner<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    fn table(&self) -> DurableTable {
        DELIVERIES
    }

    fn run_due(
        self: Rc<Self>,
        _now: EpochMs,
        _info: Option<AlarmInfo>,
    ) -> LocalBoxFuture<'static, Result<(), DurabilityError>> {
        Box::pin(async move { self.run_due().await.map_err(DurabilityError::from) })
    }
}

/// Marks a target's pass as running for as long as it lives; dropping it
/// (the pass ended, or its task was dropped) lets the next pass start and
/// wakes the passes that joined this one.
struct RunningPass<B> {
    inner: Rc<Inner<B>>,
    target: String,
    done: watch::Sender<bool>,
}

impl<B> Drop for RunningPass<B> {
    fn drop(&mut self) {
        self.inner.running.borrow_mut().remove(&self.target);
        let _ = self.done.send(true);
    }
}

impl<B> Inner<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// One pass over every target that has delivery rows (configured or
    /// not), the targets concurrently. Fails with the first failing target;
    /// the others still finish.
    pub(crate) async fn run_due(self: Rc<Self>) -> Result<(), FanoutError> {
        let targets = self.list_targets()?;
        let passes: Vec<_> = targets
            .into_iter()
            .map(|target| self.start_pass(target))
            .collect();
        for result in join_all(passes).await {
            result?;
        }
        Ok(())
    }

    /// Every target id present in the deliveries table, in order.
    fn list_targets(&self) -> Result<Vec<String>, StorageError> {
        let sql = self.engine.sql();
        let mut targets = Vec::new();
        let mut after = String::new();
        while let Some(next) = store::next_target(sql, &after)? {
            targets.push(next.clone());
            after = next;
        }
        Ok(targets)
    }

    /// Runs a pass of `target`, or joins the one already running.
    fn start_pass(
        self: &Rc<Self>,
        target: String,
    ) -> LocalBoxFuture<'static, Result<(), FanoutError>> {
        let running = self.running.borrow().get(&target).cloned();
        if let Some(mut done) = running {
            return Box::pin(async move {
                // An error means the running pass was dropped: over too.
                let _ = done.wait_for(|done| *done).await;
                Ok(())
            });
        }
        let (done, receiver) = watch::channel(false);
        self.running.borrow_mut().insert(target.clone(), receiver);
        let guard = RunningPass {
            inner: Rc::clone(self),
            target: target.clone(),
            done,
        };
        let inner = Rc::clone(self);
        let span = tracing::info_span!(
            "fanout_pass",
            object = %self.engine.ctx.id(),
            target = %target,
        );
        Box::pin(
            async move {
                let result = inner.run_target(&target).await;
                drop(guard);
                result
            }
            .instrument(span),
        )
    }

    /// One bounded batch of one target.
    async fn run_target(self: &Rc<Self>, target_id: &str) -> Result<(), FanoutError> {
        let _permit = self.engine.acquire_permit().await?;
        let now = self.engine.now();
        let Some(target) = self.targets.get(target_id) else {
            return self.postpone_missing(target_id, now).await;
        };
        let due = store::list_due(self.engine.sql(), target_id, now, self.max_batch_size)?;
        if due.is_empty() {
            return Ok(());
        }
        let policy = self.policies.resolve(target_id);
        let (claims, terminal) = self.claim(due, &policy).await?;
        // Terminal rows were found, not claimed: they go to the DLQ (or are
        // parked) and never to the target.
        for claim in terminal {
            let reason = claim
                .row
                .dead_letter_reason
                .unwrap_or(DeadLetterReason::Exhausted);
            self.settled_by_pass(
                &claim.row,
                self.dead_letter_flow(&claim, reason, None).await,
            )?;
        }
        if !claims.is_empty() {
            self.deliver(target, claims, &policy).await?;
        }
        Ok(())
    }

    /// A target that is no longer configured keeps its rows: its due rows
    /// (delivery and dead-letter phase alike) come back in a minute, attempts
    /// and errors untouched, until the target is configured again.
    async fn postpone_missing(&self, target_id: &str, now: EpochMs) -> Result<(), FanoutError> {
        let due = store::list_due(
            self.engine.sql(),
            target_id,
            now,
            MISSING_TARGET_POSTPONE_BATCH,
        )?;
        if due.is_empty() {
            return Ok(());
        }
        tracing::error!(
            event = "durability.fanout.target_missing",
            target = target_id,
            rows = due.len(),
            "Target \"{target_id}\" is no longer configured; retaining work"
        );
        let at = now.saturating_add(INFRASTRUCTURE_RETRY_MS);
        self.transaction(|sql| {
            for row in &due {
                store::postpone(sql, &row.attempt_ref(), at)?;
            }
            Ok::<_, StorageError>(())
        })
        .await?;
        Ok(())
    }

    /// One transaction claims the whole batch (one commit per batch, not
    /// per message): each claimed row's attempt goes up by one and its due
    /// time becomes the batch deadline, so a process that dies mid-batch
    /// leaves rows that come back at the deadline with the attempt counted.
    /// Rows in dead-letter phase or out of attempts are returned as terminal,
    /// unclaimed.
    async fn claim(
        &self,
        due: Vec<DeliveryRow>,
        policy: &AttemptPolicy,
    ) -> Result<(Vec<Claim>, Vec<Claim>), FanoutError> {
        let timeout_ms = EpochMs::try_from(policy.attempt_timeout_ms).unwrap_or(EpochMs::MAX);
        let deadline = self.engine.now().saturating_add(timeout_ms);
        self.transaction(|sql| {
            let mut claims = Vec::with_capacity(due.len());
            let mut terminal = Vec::new();
            for mut row in due {
                let manifest = store::read_manifest(sql, &row.message_key)?
                    .filter(|manifest| manifest.generation == row.generation);
                let Some(manifest) = manifest else {
                    return Err(FanoutError::MissingManifest { delivery: row.id });
                };
                if row.phase == Phase::DeadLetter || row.attempt >= policy.max_attempts {
                    terminal.push(Claim::new(row, manifest));
                    continue;
                }
                let Some(attempt) = store::claim(sql, &row, policy.max_attempts, deadline)? else {
                    continue;
                };
                row.attempt = attempt;
                row.next_attempt_at = deadline;
                claims.push(Claim::new(row, manifest));
            }
            Ok((claims, terminal))
        })
        .await
    }

    /// Hands the claimed batch to its target under the attempt timeout,
    /// then retries every message that was not settled for good.
    async fn deliver(
        self: &Rc<Self>,
        target: &Target<B>,
        claims: Vec<Claim>,
        policy: &AttemptPolicy,
    ) -> Result<(), FanoutError> {
        let started_at = self.engine.now();
        let outbound = self.routing.begin(Direction::Outbound);
        let states: Vec<Rc<SettleState>> = claims
            .into_iter()
            .map(|claim| Rc::new(SettleState::new(claim, policy.clone(), started_at)))
            .collect();
        for state in &states {
            let row = &state.claim.row;
            tracing::debug!(
                event = "durability.fanout.delivering",
                id = %state.claim.message_id,
                target = %row.target_id,
                generation = %row.generation,
                attempt = row.attempt,
                "delivering"
            );
            self.emit(|| LifecycleEvent::AttemptStarted {
                entity: entity(&state.claim.message_id, &row.target_id, &row.generation),
                timestamp: started_at,
                attempt: row.attempt,
            });
        }
        let timeout_ms = policy.attempt_timeout_ms;
        // One span per handed-over batch: the ids (`<message>#<attempt>`,
        // at most max_batch_size of them) a user follows an item by.
        let span = tracing::info_span!(
            "fanout_delivery",
            object = %self.engine.ctx.id(),
            target = %states.first().map_or("", |s| s.claim.row.target_id.as_str()),
            messages = states.len(),
            ids = %states
                .iter()
                .map(|s| format!("{}#{}", s.claim.message_id, s.claim.row.attempt))
                .collect::<Vec<_>>()
                .join(","),
        );
        let work = tracing::Instrument::instrument(self.invoke(target, &states), span);
        let deadline = self.engine.ctx.sleep(Duration::from_millis(timeout_ms));
        futures::pin_mut!(work);
        let failure = match futures::future::select(work, deadline).await {
            Either::Left((Ok(()), _)) => {
                HandlerError::new("Consumer returned without settling the message")
            }
            Either::Left((Err(error), _)) => error,
            Either::Right(((), _)) => timeout_error(timeout_ms),
        };
        for state in &states {
            state.close();
        }
        outbound.finish();
        self.retry_unsettled(&states, failure).await
    }

    /// Calls the target and waits for every settlement it started. Also the
    /// settlements of a target that failed: a consumer error must not skip
    /// acks already in flight.
    async fn invoke(
        self: &Rc<Self>,
        target: &Target<B>,
        states: &[Rc<SettleState>],
    ) -> Result<(), HandlerError> {
        let invocation = match &target.kind {
            TargetKind::Consumer { deliver } => self.call_consumer(deliver, states).await,
            TargetKind::Storage { write } => self.write_each(write, states).await,
        };
        for state in states {
            state.close();
        }
        let acked_on_return = if invocation.is_ok() && target.ack_on_return {
            self.ack_unsettled(states).await
        } else {
            Ok(())
        };
        let started: Vec<_> = states.iter().filter_map(|state| state.pending()).collect();
        let settled = join_all(started).await;
        invocation?;
        acked_on_return.map_err(|error| error.to_handler_error())?;
        for result in settled {
            result.map_err(|error| error.to_handler_error())?;
        }
        Ok(())
    }

    /// One call of the consumer with the whole batch. The call runs as a
    /// task of its own: if it outlives the deadline it is not cancelled (a
    /// consumer behind an RPC cannot be), and its late settlements are
    /// rejected.
    async fn call_consumer(
        self: &Rc<Self>,
        deliver: &DeliverFn<B>,
        states: &[Rc<SettleState>],
    ) -> Result<(), HandlerError> {
        let mut messages = Vec::with_capacity(states.len());
        for state in states {
            match codec::decode_as::<B>(&state.claim.payload) {
                Ok(body) => messages.push(self.message(state, body)),
                // A body this version cannot read is a failure of that
                // message alone: it is retried, never handed over half-read.
                Err(error) => state.fail_before_delivery(HandlerError::from(error)),
            }
        }
        if messages.is_empty() {
            return Ok(());
        }
        let (sender, receiver) = oneshot::channel();
        let call = deliver(messages);
        self.engine.ctx.spawn(Box::pin(async move {
            let _ = sender.send(call.await);
        }));
        receiver.await.unwrap_or_else(|_| {
            Err(HandlerError::new(
                "the consumer's task ended before it returned",
            ))
        })
    }

    fn message(self: &Rc<Self>, state: &Rc<SettleState>, body: B) -> FanoutMessage<B> {
        let row = &state.claim.row;
        let trace_context = if self.trace.is_some() {
            crate::trace::load(self.engine.sql(), DELIVERIES, &row.id, &row.generation)
                .unwrap_or_else(|error| {
                    tracing::warn!(%error, "trace context unreadable; delivered without it");
                    None
                })
        } else {
            None
        };
        if let Some(context) = &trace_context {
            tracing::debug!(
                event = "durability.fanout.producer",
                id = %state.claim.message_id,
                target = %row.target_id,
                producer = %context,
                "delivery of a traced message"
            );
        }
        FanoutMessage {
            id: state.claim.message_id.clone(),
            delivery_id: row.identity(),
            target: row.target_id.clone(),
            body,
            attempt: row.attempt,
            enqueued_at: state.claim.enqueued_at,
            memo: Memo::new(Rc::clone(&self.engine.ctx), DELIVERIES, row.attempt_ref()),
            trace_context,
            state: Rc::clone(state),
            fanout: Rc::clone(self),
        }
    }

    /// A storage target: every message written concurrently and acked once
    /// its write resolved; the first failure in batch order is the batch's.
    async fn write_each(
        self: &Rc<Self>,
        write: &WriteFn<B>,
        states: &[Rc<SettleState>],
    ) -> Result<(), HandlerError> {
        let writes = states.iter().map(|state| {
            let inner = Rc::clone(self);
            let write = Rc::clone(write);
            let state = Rc::clone(state);
            async move {
                let body = match codec::decode_as::<B>(&state.claim.payload) {
                    Ok(body) => body,
                    // Its own failure, not the batch's first one: the retry
                    // must record why this message could not be written.
                    Err(error) => {
                        let error = HandlerError::from(error);
                        state.fail_before_delivery(error.clone());
                        return Err(error);
                    }
                };
                let row = &state.claim.row;
                write(StoredMessage {
                    id: row.identity(),
                    message_id: state.claim.message_id.clone(),
                    target: row.target_id.clone(),
                    body,
                    enqueued_at: state.claim.enqueued_at,
                    stored_at: inner.engine.now(),
                    attempts: row.attempt,
                    failure: None,
                })
                .await?;
                inner
                    .ack(&state)
                    .await
                    .map_err(|error| error.to_handler_error())
            }
        });
        join_all(writes).await.into_iter().collect()
    }

    /// After the batch: every message not settled for good is retried with
    /// `failure`, in batch order. A settlement still running keeps its row's
    /// claim deadline (it comes back then if the settlement never lands); a
    /// settlement that failed may have committed anyway, so the row is read
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
                let current = store::read_delivery(self.engine.sql(), &claimed.id)?;
                let still_ours = current.is_some_and(|row| {
                    row.generation == claimed.generation
                        && row.attempt == claimed.attempt
                        && row.phase == Phase::Delivery
                });
                if !still_ours {
                    continue;
                }
            }
            state.choose_retry();
            let error = state
                .failure_before_delivery()
                .unwrap_or_else(|| failure.clone());
            let result = self
                .retry_rule(&state.claim, &state.policy, None, error, state.started_at)
                .await;
            self.settled_by_pass(&state.claim.row, result)?;
        }
        Ok(())
    }

    /// The outcome of a settlement a pass made itself: a row a newer attempt
    /// already owns is that attempt's business, not a failure of this pass.
    fn settled_by_pass(
        &self,
        row: &DeliveryRow,
        result: Result<(), super::SettlementError>,
    ) -> Result<(), FanoutError> {
        match result {
            Ok(()) => Ok(()),
            Err(super::SettlementError::Storage(error)) => Err(error.into()),
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
}
