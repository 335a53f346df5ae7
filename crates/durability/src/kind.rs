//! Matchable kinds for every public error, beside the class-name strings.
//!
//! Two audiences read an error. The stored, cross-language format (a
//! record's `last_error_name`, an enqueue's `{success: false, error}`)
//! names errors by the reference library's TypeScript class
//! (`"FanoutSettlementError"`, `"RangeError"`); those strings are part of
//! the storage format and stay. A Rust caller wants to `match`:
//!
//! - every error type the library returns has `kind() -> `[`ErrorKind`],
//!   one flat, `#[non_exhaustive]` enum, the same through every wrapping
//!   (a storage failure is [`ErrorKind::Storage`] whether it comes as a
//!   [`DurabilityError`], a [`FanoutError`] or a [`LogError`]), in the
//!   manner of `std::io::ErrorKind`;
//! - a stored error ([`SerializedError`], e.g. in
//!   [`OperationResult::Failed`](crate::OperationResult::Failed)) has
//!   `kind() -> Option<`[`LibraryErrorKind`]`>`, read from its stored name:
//!   `None` for a name of the user's own.
//!
//! ```
//! use durability::ErrorKind;
//! use durability::fanout::SettlementError;
//!
//! let error = SettlementError::Stale { id: "m".into() };
//! assert_eq!(error.name(), "FanoutSettlementError"); // the stored form
//! assert_eq!(error.kind(), ErrorKind::Stale); // what Rust code matches
//! ```
//!
//! This module owns no state and touches no storage.

use crate::codec::CodecError;
use crate::error::{
    ALARM_TIMEOUT_ERROR, ATTEMPT_TIMEOUT_ERROR, ATTEMPTS_EXHAUSTED_ERROR, ConfigError,
    DurabilityError, LibraryErrorKind, NON_RETRYABLE_ERROR, RESULT_SERIALIZATION_ERROR,
    RETRY_POLICY_ERROR, SerializedError,
};
use crate::fanout::{
    EnqueueRejection, FANOUT_ENQUEUE_ERROR, FANOUT_SETTLEMENT_ERROR, FANOUT_TIMEOUT_ERROR,
    FanoutConfigError, FanoutError, SettlementError,
};
use crate::limits::LimitError;
use crate::log::{AppendRejection, ColdError, LOG_APPEND_ERROR, LogError};
use crate::memo::MemoError;
use crate::migrations::MigrationError;
use crate::routing::{RoutingError, ShardingError, TimedOut};

/// What kind of failure an error of this crate is. Every public error type
/// has a `kind()` returning it. New kinds may be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Storage failed (full disk, I/O, a damaged file, a rejected write).
    /// For a write, the outcome may be uncertain; see the call's docs.
    Storage,
    /// A builder setting is out of its range, or two capabilities clash.
    InvalidConfig,
    /// An argument breaks a rule (a timestamp, a delay, an empty id or
    /// key, a target not configured, too many records): nothing was done.
    InvalidInput,
    /// A value cannot be stored as JSON (NaN, a failing `Serialize`).
    NotJson,
    /// A body, identifier or key is larger than its limit.
    TooLarge,
    /// An id or key already names different work (a duplicate call, a
    /// deduplication or log key conflict).
    Conflict,
    /// A read named another operation than the one registered under the
    /// id ([`DurabilityError::OperationMismatch`]).
    OperationMismatch,
    /// No handler is registered for the operation or named alarm.
    UnknownHandler,
    /// What the call names does not exist (a parked delivery, a migration
    /// target).
    NotFound,
    /// A stored row or value does not decode, or rows disagree: a damaged
    /// or foreign database, or a type changed under stored data.
    Corrupt,
    /// A schema migration refused or failed.
    Migration,
    /// The scheduler's background work was interrupted (eviction, shutdown).
    Interrupted,
    /// A registered operation's row was not found after its registration.
    NotPersisted,
    /// The message was already settled in this delivery.
    AlreadySettled,
    /// The delivery or lease is over, or newer work owns the row.
    Stale,
    /// Log records before the requested offset are gone.
    Truncated,
    /// A commit would move a log cursor past the end of the log.
    BeyondEnd,
    /// Cold storage failed or returned something unusable.
    ColdStorage,
    /// A sharding function refused a push, or returned no shard.
    Sharding,
    /// A routing client's call to an object failed.
    Call,
    /// A routing client's call was not answered in time.
    TimedOut,
    /// A memoized callback of the user's failed.
    Callback,
}

impl DurabilityError {
    /// The kind of this error, to match on.
    pub fn kind(&self) -> ErrorKind {
        match self {
            DurabilityError::Storage(_) => ErrorKind::Storage,
            DurabilityError::Config(error) => error.kind(),
            DurabilityError::InvalidTimestamp { .. } => ErrorKind::InvalidInput,
            DurabilityError::DuplicateCall { .. } => ErrorKind::Conflict,
            DurabilityError::Codec(error) => error.kind(),
            DurabilityError::Decode { .. }
            | DurabilityError::CompletedWithoutResult { .. }
            | DurabilityError::NoProgress { .. } => ErrorKind::Corrupt,
            DurabilityError::Migration(error) => error.kind(),
            DurabilityError::NotPersisted { .. } => ErrorKind::NotPersisted,
            DurabilityError::Interrupted => ErrorKind::Interrupted,
            DurabilityError::UnknownHandler { .. } => ErrorKind::UnknownHandler,
            DurabilityError::OperationMismatch { .. } => ErrorKind::OperationMismatch,
            DurabilityError::Recurrence(error) => error.kind(),
            DurabilityError::NotRecurring { .. } => ErrorKind::NotFound,
            DurabilityError::Limit(error) => error.kind(),
        }
    }
}

impl LimitError {
    /// The kind of this error: [`ErrorKind::TooLarge`] for an identifier or
    /// body over its byte limit, [`ErrorKind::InvalidInput`] for an empty
    /// identifier or too many items in one call.
    pub fn kind(&self) -> ErrorKind {
        match self {
            LimitError::TooLong { .. } => ErrorKind::TooLarge,
            LimitError::Empty { .. } | LimitError::TooMany { .. } => ErrorKind::InvalidInput,
        }
    }
}

impl crate::alarms::RecurrenceError {
    /// The kind of this error: always [`ErrorKind::InvalidInput`] (a bad
    /// pattern, zone, option, or a schedule without a future tick).
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidInput
    }
}

impl ConfigError {
    /// The kind of this error: always [`ErrorKind::InvalidConfig`].
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidConfig
    }
}

impl CodecError {
    /// The kind of this error: [`ErrorKind::NotJson`] when encoding,
    /// [`ErrorKind::Corrupt`] when stored text does not decode.
    pub fn kind(&self) -> ErrorKind {
        match self {
            CodecError::NonFinite { .. }
            | CodecError::NotJson { .. }
            | CodecError::TooDeep { .. } => ErrorKind::NotJson,
            CodecError::Malformed { .. }
            | CodecError::Envelope { .. }
            | CodecError::Type { .. } => ErrorKind::Corrupt,
        }
    }
}

impl MigrationError {
    /// The kind of this error, to match on.
    pub fn kind(&self) -> ErrorKind {
        match self {
            MigrationError::UnknownTarget { .. } => ErrorKind::NotFound,
            MigrationError::TooFarAhead { .. }
            | MigrationError::MissingDown { .. }
            | MigrationError::Script { .. } => ErrorKind::Migration,
            MigrationError::Storage(_) => ErrorKind::Storage,
        }
    }
}

impl<E> MemoError<E> {
    /// The kind of this error, to match on.
    pub fn kind(&self) -> ErrorKind {
        match self {
            MemoError::Callback(_) => ErrorKind::Callback,
            MemoError::Codec(error) => error.kind(),
            MemoError::Storage(_) => ErrorKind::Storage,
            MemoError::Limit(error) => error.kind(),
        }
    }
}

impl FanoutConfigError {
    /// The kind of this error, to match on.
    pub fn kind(&self) -> ErrorKind {
        match self {
            FanoutConfigError::NoTargets | FanoutConfigError::InvalidTarget { .. } => {
                ErrorKind::InvalidConfig
            }
            FanoutConfigError::Config(error) => error.kind(),
            FanoutConfigError::Setup(error) => error.kind(),
        }
    }
}

impl FanoutError {
    /// The kind of this error, to match on.
    pub fn kind(&self) -> ErrorKind {
        match self {
            FanoutError::Durability(error) => error.kind(),
            FanoutError::StateDisagrees { .. } | FanoutError::MissingManifest { .. } => {
                ErrorKind::Corrupt
            }
            FanoutError::UnknownTarget { .. } => ErrorKind::NotFound,
        }
    }
}

impl EnqueueRejection {
    /// The kind of this rejection, to match on (its stored name is always
    /// `FanoutEnqueueError`).
    pub fn kind(&self) -> ErrorKind {
        match self {
            EnqueueRejection::NoTargets
            | EnqueueRejection::UnknownTarget { .. }
            | EnqueueRejection::DuplicateTarget { .. }
            | EnqueueRejection::EmptyId { .. } => ErrorKind::InvalidInput,
            EnqueueRejection::BodyNotJson { .. } => ErrorKind::NotJson,
            EnqueueRejection::BodyTooLarge { .. } => ErrorKind::TooLarge,
            EnqueueRejection::DeduplicationConflict { .. } => ErrorKind::Conflict,
            EnqueueRejection::UnknownParked { .. } => ErrorKind::NotFound,
            EnqueueRejection::Limit { limit, .. } => limit.kind(),
            EnqueueRejection::TooManyMessages(limit) => limit.kind(),
        }
    }
}

impl SettlementError {
    /// The kind of this error, to match on ([`SettlementError::name`] is
    /// the stored class name).
    pub fn kind(&self) -> ErrorKind {
        match self {
            SettlementError::AlreadySettled { .. } => ErrorKind::AlreadySettled,
            SettlementError::Stale { .. } => ErrorKind::Stale,
            SettlementError::InvalidRetryDelay { .. } => ErrorKind::InvalidInput,
            SettlementError::Storage(_) => ErrorKind::Storage,
        }
    }
}

impl LogError {
    /// The kind of this error, to match on.
    pub fn kind(&self) -> ErrorKind {
        match self {
            LogError::Storage(_) => ErrorKind::Storage,
            LogError::InvalidArgument { .. } => ErrorKind::InvalidInput,
            LogError::Truncated { .. } => ErrorKind::Truncated,
            LogError::Cold(_) | LogError::EmptyLocator { .. } => ErrorKind::ColdStorage,
            LogError::Decode { .. } => ErrorKind::Corrupt,
            LogError::CommitBeyondEnd { .. } => ErrorKind::BeyondEnd,
            LogError::LeasesDisabled => ErrorKind::InvalidConfig,
            LogError::LeaseNotHeld { .. } => ErrorKind::Stale,
        }
    }
}

impl AppendRejection {
    /// The kind of this rejection, to match on (its stored name is always
    /// `LogAppendError`).
    pub fn kind(&self) -> ErrorKind {
        match self {
            AppendRejection::Empty
            | AppendRejection::TooMany { .. }
            | AppendRejection::EmptyKey { .. } => ErrorKind::InvalidInput,
            AppendRejection::Body { .. } => ErrorKind::NotJson,
            AppendRejection::KeyConflict { .. } | AppendRejection::KeyRepeated { .. } => {
                ErrorKind::Conflict
            }
            AppendRejection::Limit { limit, .. } => limit.kind(),
        }
    }
}

impl ColdError {
    /// The kind of this error: always [`ErrorKind::ColdStorage`].
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::ColdStorage
    }
}

impl<E> RoutingError<E> {
    /// The kind of this error, to match on. The object's own error is in
    /// [`RoutingError::Call`]'s `source`, unchanged.
    pub fn kind(&self) -> ErrorKind {
        match self {
            RoutingError::EmptyShard | RoutingError::Sharding(_) => ErrorKind::Sharding,
            RoutingError::Call { .. } => ErrorKind::Call,
            RoutingError::TimedOut(_) => ErrorKind::TimedOut,
        }
    }
}

impl ShardingError {
    /// The kind of this error: always [`ErrorKind::Sharding`].
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::Sharding
    }
}

impl TimedOut {
    /// The kind of this error: always [`ErrorKind::TimedOut`].
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::TimedOut
    }
}

/// Every stored name and its kind, in one place so the two directions
/// cannot disagree.
const STORED_NAMES: [(&str, LibraryErrorKind); 12] = [
    (NON_RETRYABLE_ERROR, LibraryErrorKind::NonRetryable),
    (ATTEMPT_TIMEOUT_ERROR, LibraryErrorKind::AttemptTimeout),
    (ALARM_TIMEOUT_ERROR, LibraryErrorKind::AlarmTimeout),
    (RETRY_POLICY_ERROR, LibraryErrorKind::RetryPolicy),
    (
        RESULT_SERIALIZATION_ERROR,
        LibraryErrorKind::ResultSerialization,
    ),
    (
        ATTEMPTS_EXHAUSTED_ERROR,
        LibraryErrorKind::AttemptsExhausted,
    ),
    (FANOUT_ENQUEUE_ERROR, LibraryErrorKind::FanoutEnqueue),
    (FANOUT_SETTLEMENT_ERROR, LibraryErrorKind::FanoutSettlement),
    (FANOUT_TIMEOUT_ERROR, LibraryErrorKind::FanoutTimeout),
    (LOG_APPEND_ERROR, LibraryErrorKind::LogAppend),
    ("RangeError", LibraryErrorKind::Range),
    ("StorageError", LibraryErrorKind::Storage),
];

impl LibraryErrorKind {
    /// The stored (TypeScript class) name of this kind.
    pub fn name(self) -> &'static str {
        STORED_NAMES
            .iter()
            .find(|(_, kind)| *kind == self)
            .map_or("Error", |(name, _)| name)
    }

    /// The kind a stored name stands for; `None` for a name of the user's
    /// own (`"Error"`, `"PaymentDeclined"`).
    pub fn from_name(name: &str) -> Option<Self> {
        STORED_NAMES
            .iter()
            .find(|(stored, _)| *stored == name)
            .map(|(_, kind)| *kind)
    }
}

impl SerializedError {
    /// The library error this stored error is, read from its name; `None`
    /// for an error of the user's own.
    pub fn kind(&self) -> Option<LibraryErrorKind> {
        LibraryErrorKind::from_name(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use durability_platform::StorageError;

    use super::*;

    #[test]
    fn every_stored_name_maps_to_one_kind_and_back() {
        for (name, kind) in STORED_NAMES {
            assert_eq!(LibraryErrorKind::from_name(name), Some(kind));
            assert_eq!(kind.name(), name);
        }
        assert_eq!(LibraryErrorKind::from_name("Error"), None);
        assert_eq!(
            SerializedError::new("DurableAttemptTimeoutError", "x").kind(),
            Some(LibraryErrorKind::AttemptTimeout)
        );
    }

    #[test]
    fn a_storage_failure_has_one_kind_through_every_wrapping() {
        let storage = StorageError::Full {
            message: "disk".into(),
        };
        let durability = DurabilityError::Storage(storage.clone());
        assert_eq!(durability.kind(), ErrorKind::Storage);
        assert_eq!(
            FanoutError::Durability(durability).kind(),
            ErrorKind::Storage
        );
        assert_eq!(
            LogError::Storage(storage.clone()).kind(),
            ErrorKind::Storage
        );
        assert_eq!(
            SettlementError::Storage(storage.clone()).kind(),
            ErrorKind::Storage
        );
        assert_eq!(MigrationError::Storage(storage).kind(), ErrorKind::Storage);
    }

    #[test]
    fn settlement_errors_keep_their_class_names_and_gain_kinds() {
        let cases = [
            (
                SettlementError::AlreadySettled {
                    id: "m".into(),
                    outcome: crate::fanout::SettlementOutcome::Ack,
                },
                "FanoutSettlementError",
                ErrorKind::AlreadySettled,
            ),
            (
                SettlementError::Stale { id: "m".into() },
                "FanoutSettlementError",
                ErrorKind::Stale,
            ),
            (
                SettlementError::InvalidRetryDelay {
                    delay_ms: 1,
                    now_ms: 2,
                },
                "RangeError",
                ErrorKind::InvalidInput,
            ),
        ];
        for (error, name, kind) in cases {
            assert_eq!(error.name(), name);
            assert_eq!(error.kind(), kind);
            assert_eq!(
                LibraryErrorKind::from_name(error.name()).map(LibraryErrorKind::name),
                Some(name)
            );
        }
    }
}
