//! A claimed batch in memory: what a pass took from its target's cursor
//! and exception rows, and the settlement state of each message while the
//! target has it. `dispatch` fills it and hands it over, `settle` reads and
//! ends it; neither calls the other, both share these types.

use std::cell::{Cell, RefCell};

use durability_platform::{EpochMs, LocalBoxFuture};
use futures::future::Shared;

use super::error::SettlementError;
use super::outcome::SettlementOutcome;
use super::store::{DeliveryRow, Manifest};
use crate::error::HandlerError;
use crate::retry::AttemptPolicy;

/// A settlement's action, shared by the caller that started it and the
/// pass that waits for it.
pub(crate) type SharedSettlement = Shared<LocalBoxFuture<'static, Result<(), SettlementError>>>;

/// A delivery claimed (or found terminal) by a pass, with what its message
/// row says.
pub(crate) struct Claim {
    /// The delivery; after a claim, `attempt` is the claimed attempt.
    pub row: DeliveryRow,
    pub message_id: String,
    /// The body in the stored encoding.
    pub payload: String,
    pub enqueued_at: EpochMs,
}

impl Claim {
    pub(crate) fn new(row: DeliveryRow, manifest: Manifest) -> Self {
        Claim {
            row,
            message_id: manifest.id,
            payload: manifest.payload,
            enqueued_at: manifest.created_at,
        }
    }
}

/// The range of a target's cursor a pass claimed: `[from, end)` as
/// `attempt`. Settled by moving the cursor to `end` once every delivery of
/// the range is acked or has a row of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClaimedRange {
    pub from: i64,
    pub end: i64,
    pub attempt: u32,
}

/// What one pass of one target claimed.
pub(crate) struct Batch {
    /// To hand to the target.
    pub claims: Vec<Claim>,
    /// Found out of attempts or in dead-letter phase: they go to the DLQ
    /// (or are parked), never to the target.
    pub terminal: Vec<Claim>,
    /// The cursor range the batch holds, if it took one.
    pub range: Option<ClaimedRange>,
}

/// Why the target's turn with a batch ended.
pub(crate) enum Handover {
    /// The target returned (a storage target: every write ended).
    Returned(Result<(), HandlerError>),
    /// The attempt timeout ran out first (in milliseconds).
    TimedOut(u64),
}

/// The settlement of one message in one delivery, in memory.
pub(crate) struct SettleState {
    pub(crate) claim: Claim,
    /// The target's policy when the batch was claimed.
    pub(crate) policy: AttemptPolicy,
    /// When the batch was handed to the target.
    pub(crate) started_at: EpochMs,
    /// No settlement call is accepted any more (the target returned, timed
    /// out, or the message never reached it).
    pub(crate) closed: Cell<bool>,
    /// The binding settlement, once one was chosen.
    pub(crate) outcome: Cell<Option<SettlementOutcome>>,
    /// The chosen settlement's action ended (well or not).
    pub(crate) finished: Cell<bool>,
    /// The chosen settlement's action committed.
    pub(crate) completed: Cell<bool>,
    /// The chosen settlement's action, shared by the caller and the pass.
    pub(crate) pending: RefCell<Option<SharedSettlement>>,
    /// Why the message could not even be handed to its target.
    pub(crate) failed_before_delivery: RefCell<Option<HandlerError>>,
    /// A storage target wrote it: the pass acks it.
    pub(crate) written: Cell<bool>,
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
            written: Cell::new(false),
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

    /// The pass settles the message itself with `outcome`.
    pub(crate) fn choose(&self, outcome: SettlementOutcome) {
        self.outcome.set(Some(outcome));
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

    /// Unsettled, and handed to the target: what acking on return covers.
    pub(crate) fn is_unsettled(&self) -> bool {
        self.outcome.get().is_none() && self.failed_before_delivery.borrow().is_none()
    }
}
