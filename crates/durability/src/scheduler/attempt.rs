//! The attempt lifecycle: claim an attempt, invoke the handler against a
//! timeout, persist the outcome.
//!
//! Every outcome write is a compare-and-set on (key, generation, pending,
//! claimed attempt), so a late or duplicated settlement can never touch a
//! replaced, purged or later record. The attempt number is claimed (and
//! committed) before the handler runs, which is what bounds invocations per
//! generation by `max_attempts` across crashes. An execution keeps its permit
//! and its active entry until both its outcome is persisted and its handler
//! really ended, so a handler that ignores its abort signal can never be
//! overlapped by a retry of the same record in this instance.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use durability_platform::{EpochMs, LocalBoxFuture, Sql, StorageError, params};
use futures::future::Either;
use tokio::sync::{OwnedSemaphorePermit, oneshot, watch};
use tracing::Instrument;

use super::{AbortSignal, Engine, SettledRow};
use crate::codec::CodecError;
use crate::error::{DurabilityError, HandlerError};
use crate::lifecycle::{Emitter, Entity, LifecycleEvent, Outcome, TerminalReason};
use crate::memo::delete_memos;
use crate::record::{AttemptRef, DurableTable, claim_attempt, exhaust_attempts, update_attempt};
use crate::retry::{AttemptPolicy, decide_retry};

/// The running executions of one capability, by record key.
pub(crate) type ActiveMap = Rc<RefCell<HashMap<String, ActiveExecution>>>;

/// One execution in flight in this instance.
pub(crate) struct ActiveExecution {
    /// Tells this execution apart from a later one of the same key.
    pub id: u64,
    pub generation: String,
    pub created_at: EpochMs,
    settled: watch::Receiver<bool>,
    /// Present once an attempt was claimed and its handler is about to run.
    pub signal: Option<AbortSignal>,
}

impl ActiveExecution {
    /// Resolves when the execution is fully over: outcome persisted (or
    /// claim failed) and handler ended.
    pub fn settled(&self) -> impl std::future::Future<Output = ()> + 'static {
        let mut settled = self.settled.clone();
        async move {
            // An error means the execution's task was dropped (eviction): over too.
            let _ = settled.wait_for(|done| *done).await;
        }
    }
}

/// What a successful handler produced.
pub(crate) enum Output {
    /// Nothing to store (named alarms).
    Unit,
    /// The result in the stored encoding, or why it could not be encoded.
    Encoded(Result<String, CodecError>),
}

/// Everything that differs between an operation attempt, a named alarm
/// attempt and the like.
pub(crate) trait AttemptKind {
    /// The error persisted when a claim finds the attempts used up.
    fn exhausted_error(&self) -> HandlerError;
    /// The error an attempt times out with (also the abort reason).
    fn timeout_error(&self) -> HandlerError;
    /// Runs the handler for `attempt` (1-based).
    fn invoke(
        &self,
        attempt: u32,
        signal: AbortSignal,
    ) -> LocalBoxFuture<'static, Result<Output, HandlerError>>;
    /// Persists a success inside the completion transaction; returns its
    /// settlement time, or `None` when the compare-and-set missed. An error
    /// turns the success into a failure.
    fn complete(
        &self,
        sql: &dyn Sql,
        output: &Output,
        attempt: u32,
        now: EpochMs,
    ) -> Result<Option<EpochMs>, HandlerError>;
    /// A kind-specific terminal rule beyond non-retryable errors and
    /// exhausted attempts.
    fn is_terminal(&self, error: &HandlerError) -> bool;
    /// Whether a successful completion always takes the record out of
    /// `pending` (an operation). A named alarm may stay pending for its
    /// next occurrence (a recurring schedule): its key was still running
    /// when the completing transaction reconciled, so the timer must be
    /// re-armed once it no longer runs.
    fn completion_ends_the_record(&self) -> bool {
        false
    }
    /// Runs inside the transaction that just made this generation terminal
    /// (failed or exhausted), after the failure is written. Recurring named
    /// alarms move on to their next occurrence here; the default keeps the
    /// failed record.
    fn after_terminal(&self, _sql: &dyn Sql, _now: EpochMs) -> Result<(), StorageError> {
        Ok(())
    }
}

/// An attempt claimed ahead of its execution: by the transaction that
/// registered the record (an eager start) or that completed the previous
/// record of a due pass (a hand-off).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claimed {
    pub key: String,
    pub generation: String,
    pub attempt: u32,
}

/// The next record of a due pass, claimed in the transaction that
/// completes the current attempt: one commit for both, where the pass
/// would otherwise commit the claim on its own. The claim is the same
/// compare-and-set as any other, so it never exceeds `max_attempts` and
/// never touches a replaced record.
pub(crate) trait Successor {
    /// Claims the next record inside the completing transaction; `None`
    /// when there is none or it cannot be claimed now (it then runs as
    /// usual). An error leaves the transaction to fail like any other.
    ///
    /// A claim takes the record for its lane at once (reserved and marked
    /// running), before the transaction commits: the commit may yield, and
    /// neither another pass nor the transaction's own reconcile may see
    /// the claimed record as free work in the meantime.
    fn claim(&self, sql: &dyn Sql, now: EpochMs) -> Result<Option<Claimed>, StorageError>;
    /// The completing transaction failed after `claimed` was taken: give
    /// the record back (its claim rolled back with the transaction).
    fn abandon(&self, claimed: &Claimed);
}

/// How one attempt ended, as [`Engine::run_attempt`] reports it.
struct Attempted {
    outcome: Result<(), DurabilityError>,
    /// Resolves when the handler (if it was started) has really ended.
    handler_done: Option<oneshot::Receiver<()>>,
    /// The attempt completed the record, and the completing transaction
    /// reconciled the alarm: nothing is left to re-arm for this key.
    completed: bool,
}

impl Attempted {
    /// Settled without running the handler.
    fn settled(outcome: Result<(), DurabilityError>) -> Self {
        Attempted {
            outcome,
            handler_done: None,
            completed: false,
        }
    }
}

/// One record generation to execute.
pub(crate) struct ExecutionSpec {
    pub table: DurableTable,
    pub key: String,
    pub generation: String,
    pub created_at: EpochMs,
    /// Names the entity in retry-policy errors: `operation "send"`.
    pub label: String,
    pub entity: Entity,
    pub active: ActiveMap,
    pub policy: AttemptPolicy,
    pub emitter: Emitter,
    /// Whether the completed event carries the result (off: keeps results
    /// out of telemetry).
    pub include_result: bool,
    pub kind: Rc<dyn AttemptKind>,
    /// An attempt already claimed (and committed) for this generation,
    /// by the registration of an eager start or by the completion of the
    /// previous record of a due pass. `None`: the execution claims one.
    pub claimed: Option<u32>,
    /// Claims the next record of the pass when this attempt completes.
    pub successor: Option<Rc<dyn Successor>>,
}

impl ExecutionSpec {
    fn emit(&self, event: impl FnOnce(Entity) -> LifecycleEvent) {
        self.emitter.emit(&event(self.entity.clone()));
    }

    fn settled_row(&self) -> SettledRow {
        SettledRow {
            generation: self.generation.clone(),
            created_at: self.created_at,
        }
    }
}

impl Engine {
    /// Registers the execution in its active map at once, then claims and
    /// runs one attempt in the background. The returned future resolves when
    /// the outcome is persisted, not when a timed-out handler finally ends;
    /// dropping it does not stop the execution.
    pub(crate) fn start_execution(
        self: &Rc<Self>,
        spec: ExecutionSpec,
        eager_permit: Option<OwnedSemaphorePermit>,
    ) -> LocalBoxFuture<'static, Result<(), DurabilityError>> {
        let id = self.next_id();
        let (settled_tx, settled_rx) = watch::channel(false);
        spec.active.borrow_mut().insert(
            spec.key.clone(),
            ActiveExecution {
                id,
                generation: spec.generation.clone(),
                created_at: spec.created_at,
                settled: settled_rx,
                signal: None,
            },
        );
        self.track_active(spec.table.name, &spec.key);
        let (outcome_tx, outcome_rx) = oneshot::channel();
        let span = tracing::info_span!(
            parent: None,
            "attempt",
            object = %self.ctx.id(),
            table = spec.table.name,
            key = %spec.key,
            generation = %spec.generation,
            attempt = tracing::field::Empty,
            producer = tracing::field::Empty,
        );
        // Linked to what started it: the producer's span for an eager
        // start (`Operations::start` inside a request), else the alarm run.
        span.follows_from(tracing::Span::current());
        let engine = Rc::clone(self);
        let body = async move {
            let mut held = None;
            let mut handler_done = None;
            let mut completed = false;
            let outcome = match eager_permit {
                Some(permit) => Ok(permit),
                None => engine.acquire_permit().await,
            };
            let outcome = match outcome {
                Ok(permit) => {
                    held = Some(permit);
                    let attempted = engine.run_attempt(&spec, id).await;
                    handler_done = attempted.handler_done;
                    completed = attempted.completed;
                    attempted.outcome
                }
                Err(error) => Err(error),
            };
            let _ = outcome_tx.send(outcome);
            if let Some(done) = handler_done {
                // Resolves when the handler ends, or when its task is dropped.
                let _ = done.await;
            }
            drop(held);
            let _ = settled_tx.send(true);
            engine.finish_execution(&spec, id, completed).await;
        };
        self.ctx.wait_until(Box::pin(body.instrument(span)));
        Box::pin(async move {
            outcome_rx
                .await
                .unwrap_or(Err(DurabilityError::Interrupted))
        })
    }

    /// `completed`: the completing transaction reconciled already, and the
    /// record is no longer pending, so there is nothing to re-arm for it.
    async fn finish_execution(self: &Rc<Self>, spec: &ExecutionSpec, id: u64, completed: bool) {
        {
            let mut active = spec.active.borrow_mut();
            if active.get(&spec.key).map(|entry| entry.id) == Some(id) {
                active.remove(&spec.key);
            }
        }
        // Unconditionally, like the reference: the set holds keys, so an old
        // purged generation settling also un-marks a newer running one.
        self.release_active(spec.table.name, &spec.key);
        // Work the timer skipped while this key ran is picked up at its time.
        if !completed && let Err(error) = self.schedule_next_alarm().await {
            tracing::error!(
                event = "durability.scheduler.refresh_failed",
                table = spec.table.name,
                key = %spec.key,
                %error,
                "could not re-arm the scheduler after an execution"
            );
        }
    }

    /// Claims, invokes and settles one attempt.
    async fn run_attempt(self: &Rc<Self>, spec: &ExecutionSpec, id: u64) -> Attempted {
        // One statement, no alarm change: next_attempt_at stays in the past,
        // so the physical fallback stays armed while the handler runs.
        let claimed = match spec.claimed {
            Some(attempt) => Ok(Some(attempt)),
            None => claim_attempt(
                self.sql(),
                spec.table,
                &spec.key,
                &spec.generation,
                spec.policy.max_attempts,
                None,
            ),
        };
        let attempt = match claimed {
            Err(error) => return Attempted::settled(Err(error.into())),
            Ok(None) => return Attempted::settled(self.fail_exhausted(spec).await),
            Ok(Some(attempt)) => attempt,
        };
        tracing::Span::current().record("attempt", attempt);
        let started_at = self.now();
        spec.emit(|entity| LifecycleEvent::AttemptStarted {
            entity,
            timestamp: started_at,
            attempt,
        });
        let signal = AbortSignal::new();
        if let Some(entry) = spec.active.borrow_mut().get_mut(&spec.key)
            && entry.id == id
        {
            entry.signal = Some(signal.clone());
        }
        let (result_tx, result_rx) = oneshot::channel();
        let (done_tx, done_rx) = oneshot::channel();
        let invocation = spec.kind.invoke(attempt, signal.clone());
        // The handler runs as its own task: after a timeout it keeps running
        // (holding the permit) until it really ends.
        self.ctx.wait_until(Box::pin(async move {
            let _ = result_tx.send(invocation.await);
            let _ = done_tx.send(());
        }));
        let timeout = self
            .ctx
            .sleep(Duration::from_millis(spec.policy.attempt_timeout_ms));
        let result = match futures::future::select(result_rx, timeout).await {
            Either::Left((Ok(result), _)) => result,
            Either::Left((Err(_), _)) => Err(HandlerError::new(
                "the handler's task ended before it returned a result",
            )),
            Either::Right(((), _)) => {
                let error = spec.kind.timeout_error();
                signal.abort(error.clone());
                Err(error)
            }
        };
        let mut completed = false;
        let outcome = match result {
            Ok(output) => match self.complete(spec, &output, attempt).await {
                Ok(Some(timestamp)) => {
                    completed = spec.kind.completion_ends_the_record();
                    self.notify(spec.table, &spec.key, Some(&spec.settled_row()));
                    let result = match (&output, spec.include_result) {
                        (Output::Encoded(Ok(text)), true) => {
                            crate::codec::decode(text).ok().flatten()
                        }
                        _ => None,
                    };
                    spec.emit(|entity| LifecycleEvent::AttemptSettled {
                        entity,
                        timestamp,
                        attempt,
                        duration_ms: duration_between(started_at, timestamp),
                        outcome: Outcome::Completed { result },
                    });
                    Ok(())
                }
                Ok(None) => Ok(()),
                Err(error) => self.settle_failure(spec, attempt, started_at, error).await,
            },
            Err(error) => self.settle_failure(spec, attempt, started_at, error).await,
        };
        Attempted {
            outcome,
            handler_done: Some(done_rx),
            completed,
        }
    }

    /// One transaction: a failed memo cleanup must undo the completion, not
    /// orphan the memos. It also reconciles the alarm, so a completion
    /// needs no commit of its own to re-arm the scheduler.
    async fn complete(
        self: &Rc<Self>,
        spec: &ExecutionSpec,
        output: &Output,
        attempt: u32,
    ) -> Result<Option<EpochMs>, HandlerError> {
        let now = self.now();
        let taken = RefCell::new(None);
        let completed = self
            .transaction(|sql| {
                let completed_at = spec.kind.complete(sql, output, attempt, now)?;
                if completed_at.is_none() {
                    return Ok(None);
                }
                delete_memos(sql, spec.table, &spec.key)?;
                if let Some(successor) = &spec.successor {
                    *taken.borrow_mut() = successor.claim(sql, now)?;
                }
                Ok::<_, HandlerError>(completed_at)
            })
            .await;
        if completed.is_err()
            && let (Some(successor), Some(claimed)) = (&spec.successor, taken.borrow().as_ref())
        {
            successor.abandon(claimed);
        }
        completed
    }

    /// Persists a failed attempt as a retry or a terminal failure, with the
    /// alarm reconcile in the same transaction.
    async fn settle_failure(
        self: &Rc<Self>,
        spec: &ExecutionSpec,
        attempt: u32,
        started_at: EpochMs,
        error: HandlerError,
    ) -> Result<(), DurabilityError> {
        let kind_terminal = spec.kind.is_terminal(&error);
        let decision = decide_retry(
            &spec.policy,
            &spec.label,
            attempt,
            error,
            kind_terminal,
            self.now(),
            self.uniform(),
        );
        let serialized = decision.error.serialize();
        let status = if decision.terminal {
            "failed"
        } else {
            "pending"
        };
        let attempt_ref = AttemptRef {
            key: spec.key.clone(),
            generation: spec.generation.clone(),
            attempt,
        };
        let owned = self
            .transaction(|sql| {
                let owned = update_attempt(
                    sql,
                    spec.table,
                    &attempt_ref,
                    "status = ?, next_attempt_at = ?, last_error = ?, last_error_name = ?",
                    &params![
                        status,
                        decision.next_attempt_at,
                        serialized.message.as_str(),
                        serialized.name.as_str()
                    ],
                )?;
                // Memos stay on a retry so the next attempt can reuse them.
                if owned && decision.terminal {
                    delete_memos(sql, spec.table, &spec.key)?;
                    spec.kind.after_terminal(sql, decision.timestamp)?;
                }
                Ok::<_, StorageError>(owned)
            })
            .await?;
        if !owned {
            return Ok(());
        }
        if decision.terminal {
            self.notify(spec.table, &spec.key, None);
        }
        let duration_ms = duration_between(started_at, decision.timestamp);
        let outcome = if decision.terminal {
            Outcome::Failed { error: serialized }
        } else {
            Outcome::RetryScheduled {
                error: serialized,
                next_attempt_at: decision.next_attempt_at,
            }
        };
        spec.emit(|entity| LifecycleEvent::AttemptSettled {
            entity,
            timestamp: decision.timestamp,
            attempt,
            duration_ms,
            outcome,
        });
        Ok(())
    }

    /// The claim found no attempt left (the process died during the last
    /// one): fail the generation without invoking the handler.
    async fn fail_exhausted(self: &Rc<Self>, spec: &ExecutionSpec) -> Result<(), DurabilityError> {
        let exhausted = spec.kind.exhausted_error().serialize();
        let now = self.now();
        let attempt = self
            .transaction(|sql| {
                let attempt = exhaust_attempts(
                    sql,
                    spec.table,
                    &spec.key,
                    &spec.generation,
                    spec.policy.max_attempts,
                    &exhausted,
                )?;
                if attempt.is_some() {
                    delete_memos(sql, spec.table, &spec.key)?;
                    spec.kind.after_terminal(sql, now)?;
                }
                Ok::<_, StorageError>(attempt)
            })
            .await?;
        let Some(attempt) = attempt else {
            return Ok(());
        };
        self.notify(spec.table, &spec.key, None);
        let timestamp = self.now();
        spec.emit(|entity| LifecycleEvent::Terminal {
            entity,
            timestamp,
            attempt,
            reason: TerminalReason::AttemptsExhausted,
            error: exhausted,
        });
        Ok(())
    }
}

/// `max(0, end - start)` in milliseconds.
fn duration_between(start: EpochMs, end: EpochMs) -> u64 {
    u64::try_from(end.saturating_sub(start)).unwrap_or(0)
}
