//! The errors of fanout: what a bad configuration returns, what a definite
//! enqueue rejection carries, what a settlement call rejects with, and what
//! a failed call (storage, a damaged row) returns.
//!
//! The split matters to callers: an [`EnqueueRejection`] is *definite*
//! (nothing was written, retrying the same input fails the same way), while
//! a [`FanoutError`] from `enqueue` is *uncertain* (the batch may or may not
//! have committed; retrying with the same ids and keys is safe while their
//! registrations exist).
//!
//! `name()` of each persisted or wire-visible error is the reference
//! library's class name (`FanoutEnqueueError`, `FanoutSettlementError`), and
//! each message starts with the reference's text, followed by the detail a
//! user needs to act.

use durability_platform::{EpochMs, StorageError};
use thiserror::Error;

use super::message::SettlementOutcome;
use crate::codec::CodecError;
use crate::error::{ConfigError, DurabilityError, HandlerError, SerializedError};
use crate::limits::LimitError;
use crate::record::DurableTable;

/// The `name` of an enqueue rejection.
pub const FANOUT_ENQUEUE_ERROR: &str = "FanoutEnqueueError";
/// The `name` of a rejected settlement call.
pub const FANOUT_SETTLEMENT_ERROR: &str = "FanoutSettlementError";
/// The `name` of a batch or DLQ write that ran out of time.
pub const FANOUT_TIMEOUT_ERROR: &str = "FanoutTimeoutError";

/// Why a fanout could not be built.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FanoutConfigError {
    /// The builder was given no target.
    #[error("Fanout requires at least one static target")]
    NoTargets,
    /// A target that breaks a rule of its own.
    #[error("Invalid fanout target \"{id}\": {rule}")]
    InvalidTarget { id: String, rule: &'static str },
    /// An option out of its range (batch size, batch delay, body size, a
    /// retry policy), or a second fanout on the same scheduler.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The schema migration failed.
    #[error(transparent)]
    Setup(#[from] DurabilityError),
}

/// Why a fanout call failed. From `enqueue`, this means *uncertain*: the
/// batch may have committed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FanoutError {
    /// Storage failed, or a shared part of the library did (migrations, a
    /// row that does not decode).
    #[error(transparent)]
    Durability(#[from] DurabilityError),
    /// A delivery row exists for a message registration that was just
    /// created: the manifest and the deliveries disagree, which only a
    /// damaged or foreign database produces. The whole batch rolled back.
    #[error("Fanout manifest and delivery state disagree: delivery {delivery} already exists")]
    StateDisagrees { delivery: String },
    /// A delivery row whose message manifest is gone or belongs to another
    /// registration; the whole claim rolled back.
    #[error("Fanout delivery is missing its message manifest: delivery {delivery}")]
    MissingManifest { delivery: String },
}

impl From<StorageError> for FanoutError {
    fn from(error: StorageError) -> Self {
        FanoutError::Durability(DurabilityError::Storage(error))
    }
}

/// The scheduler only knows [`DurabilityError`]: an inconsistent fanout row
/// found during an alarm run becomes the "row does not decode" error naming
/// the delivery, which is what it is from the scheduler's point of view.
impl From<FanoutError> for DurabilityError {
    fn from(error: FanoutError) -> Self {
        match error {
            FanoutError::Durability(error) => error,
            FanoutError::StateDisagrees { delivery }
            | FanoutError::MissingManifest { delivery } => {
                let detail = format!("fanout state is inconsistent for delivery {delivery}");
                DurabilityError::Decode {
                    table: DurableTable::FANOUT_DELIVERIES.name,
                    key: delivery,
                    detail,
                }
            }
        }
    }
}

/// A definite rejection of an `enqueue` (or a redrive): nothing of the call
/// was written. Serialized as `FanoutEnqueueError`.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum EnqueueRejection {
    /// `targets` was given and empty.
    #[error("Enqueue targets must be distinct configured target IDs: the target list is empty")]
    NoTargets,
    /// A target that is not configured on this fanout.
    #[error(
        "Enqueue targets must be distinct configured target IDs: \"{target}\" is not configured"
    )]
    UnknownTarget { target: String },
    /// A target named twice.
    #[error("Enqueue targets must be distinct configured target IDs: \"{target}\" appears twice")]
    DuplicateTarget { target: String },
    /// An empty message id or deduplication key.
    #[error(
        "Message IDs and deduplication keys must be non-empty strings: the {field} of message {index} is empty"
    )]
    EmptyId { index: usize, field: &'static str },
    /// A body that cannot be stored as JSON.
    #[error("the body of message {index} cannot be stored as JSON: {source}")]
    BodyNotJson {
        index: usize,
        #[source]
        source: CodecError,
    },
    /// A message id or deduplication key longer than
    /// [`MAX_ID_BYTES`](crate::limits::MAX_ID_BYTES).
    #[error("message {index}: {limit}")]
    Limit { index: usize, limit: LimitError },
    /// More messages in one call than `max_enqueue_messages`.
    #[error(transparent)]
    TooManyMessages(LimitError),
    /// A body above `max_body_bytes`, measured as the body's own JSON.
    #[error(
        "the body of message {index} is {bytes} bytes of JSON, above the limit of {max_bytes} (max_body_bytes)"
    )]
    BodyTooLarge {
        index: usize,
        bytes: usize,
        max_bytes: usize,
    },
    /// A deduplication key whose registration (still retained) has another
    /// id, body or target set; also two different messages with one key in
    /// the same batch.
    #[error("Deduplication key \"{key}\" already identifies different work")]
    DeduplicationConflict { key: String },
    /// A redrive named a parked delivery that does not exist (already
    /// redriven or purged).
    #[error("parked delivery {id} does not exist")]
    UnknownParked { id: String },
}

impl EnqueueRejection {
    /// The `{name, message}` form the reference library returns in
    /// `{success: false, error}`.
    pub fn serialize(&self) -> SerializedError {
        SerializedError::new(FANOUT_ENQUEUE_ERROR, self.to_string())
    }
}

/// Why a settlement call (`ack`, `retry`, `dead_letter`) was rejected or
/// failed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum SettlementError {
    /// The message was already settled in this delivery; the first call is
    /// binding.
    #[error("Fanout delivery \"{id}\" was already settled as \"{outcome}\"")]
    AlreadySettled {
        id: String,
        outcome: SettlementOutcome,
    },
    /// The delivery is over (the consumer returned or the batch timed out),
    /// or a newer attempt or registration owns the row: nothing changed.
    #[error("Fanout delivery \"{id}\" is stale")]
    Stale { id: String },
    /// `retry_after` with a delay that is not a safe integer of
    /// milliseconds from now. The message stays unsettled.
    #[error(
        "delayMs must produce a non-negative safe-integer timestamp: {delay_ms} ms after {now_ms}"
    )]
    InvalidRetryDelay { delay_ms: u128, now_ms: EpochMs },
    /// The settlement's transaction failed; the row keeps its claim and is
    /// retried after the claim's deadline.
    #[error(transparent)]
    Storage(#[from] StorageError),
}

impl SettlementError {
    /// The reference library's class name of this error.
    pub fn name(&self) -> &'static str {
        match self {
            SettlementError::AlreadySettled { .. } | SettlementError::Stale { .. } => {
                FANOUT_SETTLEMENT_ERROR
            }
            SettlementError::InvalidRetryDelay { .. } => "RangeError",
            SettlementError::Storage(_) => "StorageError",
        }
    }

    /// As a failure that can be persisted on the row.
    pub(crate) fn to_handler_error(&self) -> HandlerError {
        HandlerError::named(self.name(), self.to_string())
    }
}

/// `FanoutTimeoutError`: a batch or a DLQ write that ran past its deadline.
pub(crate) fn timeout_error(timeout_ms: u64) -> HandlerError {
    HandlerError::named(
        FANOUT_TIMEOUT_ERROR,
        format!("Fanout delivery timed out after {timeout_ms}ms"),
    )
}
