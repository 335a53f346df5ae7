//! Dispatch (§3.7, §3.8): what a pass of one target takes, and how it is
//! handed over.
//!
//! A pass first takes the target's next first deliveries from its cursor:
//! the messages of its due spans after `next_seq`, up to the batch size,
//! claimed as one range in one small write to the cursor row (its attempt
//! and deadline: a process that dies mid-batch leaves a claim that comes
//! back at the deadline with the attempt counted, and is delivered again,
//! never skipped). Then, in the same transaction, due exception rows
//! (retries, dead-letter intent) fill the batch, each claimed by a
//! compare-and-set on its attempt. First deliveries go before retries,
//! each in sequence order. One call of the target gets the whole batch.
//!
//! A failing message never holds back its target's cursor: it leaves the
//! cursor as an exception row and the cursor moves on (see `settle`).
//!
//! Must not decide settlement rules (that is `settle`, which `mod.rs` runs
//! after the handover) or write SQL (that is `store`).

use std::rc::Rc;
use std::time::Duration;

use durability_platform::{EpochMs, Sql};
use futures::future::{Either, join_all};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::oneshot;

use super::batch::{Batch, Claim, ClaimedRange, Handover, SettleState};
use super::error::FanoutError;
use super::message::{FanoutMessage, StoredMessage};
use super::store::{self, CursorClaim, DELIVERIES, Phase};
use super::target::{DeliverFn, Target, TargetKind, WriteFn};
use super::{INFRASTRUCTURE_RETRY_MS, Inner, MISSING_TARGET_POSTPONE_BATCH};
use crate::codec;
use crate::error::HandlerError;
use crate::lifecycle::LifecycleEvent;
use crate::load::Direction;
use crate::memo::Memo;
use crate::retry::AttemptPolicy;

/// Which deliveries a claim takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lanes {
    /// First deliveries from the cursor, then due exception rows.
    All,
    /// First deliveries from the cursor only.
    CursorOnly,
}

/// Most spans of one target a pass looks at: enough for a batch made of
/// many small enqueue calls, bounded so a pass stays a bounded read.
const SPANS_PER_PASS: usize = 64;

impl<B> Inner<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// Claims the next batch of `target_id` in one transaction: first
    /// deliveries from its cursor, then due exception rows.
    pub(crate) async fn claim_batch(
        &self,
        target_id: &str,
        policy: &AttemptPolicy,
    ) -> Result<Batch, FanoutError> {
        self.transaction(|sql| self.claim_in(sql, target_id, policy, Lanes::All))
            .await
    }

    /// The claim of [`Inner::claim_batch`] inside the caller's transaction
    /// (`settle` runs the next claim of a target in the commit that ends
    /// its previous batch, `mod.rs` wires the two). With
    /// [`Lanes::CursorOnly`], exception rows are left for a pass of their
    /// own.
    pub(crate) fn claim_in(
        &self,
        sql: &dyn Sql,
        target_id: &str,
        policy: &AttemptPolicy,
        lanes: Lanes,
    ) -> Result<Batch, FanoutError> {
        let now = self.engine.now();
        // The flow-control gate: how many this claim may take (0 when the
        // target has no token left or is at its concurrency).
        let limit = self.allowance(target_id, now);
        let batch = Batch {
            claims: Vec::new(),
            terminal: Vec::new(),
            range: None,
        };
        if limit == 0 {
            return Ok(batch);
        }
        let batch = self.claim_up_to(sql, target_id, policy, lanes, limit, batch)?;
        self.take_tokens(target_id, batch.claims.len(), now);
        Ok(batch)
    }

    /// The claim itself, at most `limit` deliveries.
    fn claim_up_to(
        &self,
        sql: &dyn Sql,
        target_id: &str,
        policy: &AttemptPolicy,
        lanes: Lanes,
        limit: usize,
        mut batch: Batch,
    ) -> Result<Batch, FanoutError> {
        let now = self.engine.now();
        let timeout_ms = EpochMs::try_from(policy.attempt_timeout_ms).unwrap_or(EpochMs::MAX);
        let deadline = now.saturating_add(timeout_ms);
        {
            let cursor = store::read_cursor(sql, target_id)?;
            // A paused target: nothing at all is taken, retries included.
            if cursor.as_ref().is_some_and(|cursor| cursor.paused) {
                return Ok(batch);
            }
            if let Some(cursor) = cursor {
                match cursor.claim {
                    // Out with this pass or another, or back at its deadline.
                    Some(claim) if claim.deadline > now => {}
                    // A claim that never finished (the process died, or
                    // the pass failed): the same range again, one attempt
                    // more, or straight to the dead letters when it used
                    // its last one.
                    Some(claim) => {
                        // A claim always ends past the cursor: one that
                        // does not is a damaged row, and taking it again
                        // would move the cursor back.
                        if claim.end <= cursor.next_seq {
                            return Err(store::damaged_cursor(
                                target_id,
                                format!(
                                    "claim_end {} is not past next_seq {}",
                                    claim.end, cursor.next_seq
                                ),
                            ));
                        }
                        let span =
                            usize::try_from(claim.end.saturating_sub(cursor.next_seq)).unwrap_or(0);
                        let messages = store::cursor_messages(
                            sql,
                            target_id,
                            cursor.next_seq,
                            claim.end - 1,
                            span,
                        )?;
                        let exhausted = claim.attempt >= policy.max_attempts;
                        let taken = if exhausted {
                            claim
                        } else {
                            let again = CursorClaim {
                                end: claim.end,
                                attempt: claim.attempt + 1,
                                deadline,
                            };
                            if !store::write_claim(
                                sql,
                                target_id,
                                cursor.next_seq,
                                claim.attempt,
                                cursor.next_seq,
                                again,
                            )? {
                                return Ok(batch);
                            }
                            again
                        };
                        batch.range = Some(ClaimedRange {
                            from: cursor.next_seq,
                            end: claim.end,
                            attempt: taken.attempt,
                        });
                        for message in messages.into_iter().filter(|m| !m.excepted) {
                            let row = store::cursor_delivery(&message.manifest, target_id, taken);
                            let claim = Claim::new(row, message.manifest);
                            if exhausted {
                                batch.terminal.push(claim);
                            } else {
                                batch.claims.push(claim);
                            }
                        }
                    }
                    None if cursor.paused_until > now => {}
                    None => {
                        let spans = store::first_spans(sql, target_id, SPANS_PER_PASS)?;
                        // A cursor always deletes the spans it passes, so a
                        // span wholly behind it means a damaged cursor row:
                        // its messages would be skipped without a word.
                        if let Some(behind) =
                            spans.iter().find(|span| span.last_seq < cursor.next_seq)
                        {
                            return Err(store::cursor_past_span(
                                target_id,
                                cursor.next_seq,
                                behind,
                            ));
                        }
                        let due: Vec<_> = spans
                            .iter()
                            .take_while(|span| span.due_at <= now)
                            .filter(|span| span.last_seq >= cursor.next_seq)
                            .collect();
                        if let (Some(first), Some(last)) = (due.first(), due.last()) {
                            let from = first.first_seq.max(cursor.next_seq);
                            let messages =
                                store::cursor_messages(sql, target_id, from, last.last_seq, limit)?;
                            // Sequences never reach i64::MAX (one per
                            // message): a span or message that says so is
                            // damaged, and its end would wrap around.
                            let end = match messages.last() {
                                Some(message) if messages.len() >= limit => {
                                    message.manifest.seq.checked_add(1)
                                }
                                _ => last.last_seq.checked_add(1),
                            }
                            .ok_or_else(|| {
                                store::damaged_cursor(
                                    target_id,
                                    format!(
                                        "the span {}..={} it owes ends at the largest sequence number",
                                        last.first_seq, last.last_seq
                                    ),
                                )
                            })?;
                            let fresh: Vec<_> =
                                messages.into_iter().filter(|m| !m.excepted).collect();
                            let claim = CursorClaim {
                                end,
                                attempt: 1,
                                deadline,
                            };
                            if fresh.is_empty() {
                                // Nothing of the range is the cursor's to
                                // deliver (every message already has a row):
                                // the cursor simply passes it.
                                store::advance_cursor(
                                    sql,
                                    target_id,
                                    0,
                                    cursor.next_seq,
                                    end,
                                    false,
                                )?;
                            } else if store::write_claim(
                                sql,
                                target_id,
                                cursor.next_seq,
                                0,
                                from,
                                claim,
                            )? {
                                batch.range = Some(ClaimedRange {
                                    from,
                                    end,
                                    attempt: 1,
                                });
                                for message in fresh {
                                    let row =
                                        store::cursor_delivery(&message.manifest, target_id, claim);
                                    batch.claims.push(Claim::new(row, message.manifest));
                                }
                            }
                        }
                    }
                }
            }
            let room = limit.saturating_sub(batch.claims.len() + batch.terminal.len());
            if room == 0 || lanes == Lanes::CursorOnly {
                return Ok(batch);
            }
            for mut row in store::retries_due(sql, target_id, now, room)? {
                let manifest = store::read_manifest(sql, &row.message_key)?
                    .filter(|manifest| manifest.generation == row.generation);
                let Some(manifest) = manifest else {
                    return Err(FanoutError::MissingManifest { delivery: row.id });
                };
                if row.phase == Phase::DeadLetter || row.attempt >= policy.max_attempts {
                    batch.terminal.push(Claim::new(row, manifest));
                    continue;
                }
                let Some(attempt) = store::claim(sql, &row, policy.max_attempts, deadline)? else {
                    continue;
                };
                row.attempt = attempt;
                row.next_attempt_at = deadline;
                batch.claims.push(Claim::new(row, manifest));
            }
            Ok(batch)
        }
    }

    /// A target that is no longer configured keeps its work: its due
    /// exception rows (at most [`MISSING_TARGET_POSTPONE_BATCH`] a pass)
    /// and its cursor come back in a minute, attempts and errors untouched,
    /// until the target is configured again.
    pub(crate) async fn postpone_missing(&self, target_id: &str) -> Result<(), FanoutError> {
        let now = self.engine.now();
        let at = now.saturating_add(INFRASTRUCTURE_RETRY_MS);
        let sql = self.engine.sql();
        let due = store::retries_due(sql, target_id, now, MISSING_TARGET_POSTPONE_BATCH)?;
        let cursor = store::read_cursor(sql, target_id)?;
        if cursor.as_ref().is_some_and(|cursor| cursor.paused) {
            return Ok(());
        }
        let cursor_due = match &cursor {
            Some(cursor) => match cursor.claim {
                Some(claim) => claim.deadline <= now,
                None => {
                    cursor.paused_until <= now
                        && store::first_spans(sql, target_id, 1)?
                            .first()
                            .is_some_and(|span| span.due_at <= now)
                }
            },
            None => false,
        };
        if due.is_empty() && !cursor_due {
            return Ok(());
        }
        tracing::error!(
            event = "durability.fanout.target_missing",
            target = target_id,
            rows = due.len(),
            "Target \"{target_id}\" is no longer configured; retaining work"
        );
        self.transaction(|sql| {
            for row in &due {
                store::postpone(sql, &row.attempt_ref(), at)?;
            }
            if let Some(cursor) = cursor.filter(|_| cursor_due) {
                match cursor.claim {
                    Some(claim) => {
                        store::write_claim(
                            sql,
                            target_id,
                            cursor.next_seq,
                            claim.attempt,
                            cursor.next_seq,
                            CursorClaim {
                                deadline: at,
                                ..claim
                            },
                        )?;
                    }
                    None => store::pause_cursor(sql, target_id, at)?,
                }
            }
            Ok::<_, FanoutError>(())
        })
        .await
    }

    /// Hands the claimed batch to its target under the attempt timeout:
    /// one call with the whole batch, then every settlement it started is
    /// awaited. Settles nothing itself: `settle` reads the states after.
    pub(crate) async fn hand_over(
        self: &Rc<Self>,
        target: &Target<B>,
        states: &[Rc<SettleState>],
        policy: &AttemptPolicy,
    ) -> Handover {
        let started_at = self.engine.now();
        let outbound = self.routing.begin(Direction::Outbound);
        for state in states {
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
                entity: super::entity(&state.claim.message_id, &row.target_id, &row.generation),
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
        let work = tracing::Instrument::instrument(self.invoke(target, states), span);
        let deadline = self.engine.ctx.sleep(Duration::from_millis(timeout_ms));
        futures::pin_mut!(work);
        let handover = match futures::future::select(work, deadline).await {
            Either::Left((returned, _)) => Handover::Returned(returned),
            Either::Right(((), _)) => Handover::TimedOut(timeout_ms),
        };
        for state in states {
            state.close();
        }
        outbound.finish();
        handover
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
        let started: Vec<_> = states.iter().filter_map(|state| state.pending()).collect();
        let settled = join_all(started).await;
        invocation?;
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
            memo: Memo::new(Rc::clone(&self.engine.ctx), DELIVERIES, row.attempt_ref())
                .max_value_bytes(self.max_body_bytes, "max_body_bytes"),
            trace_context,
            state: Rc::clone(state),
            fanout: Rc::clone(self),
        }
    }

    /// A storage target: every message written concurrently and marked
    /// written once its write resolved (the pass acks the written ones
    /// together); the first failure in batch order is the batch's.
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
                state.written.set(true);
                Ok(())
            }
        });
        join_all(writes).await.into_iter().collect()
    }
}
