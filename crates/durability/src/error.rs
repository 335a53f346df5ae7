//! Every error of the crate: what user handlers return ([`HandlerError`]),
//! how a failure is persisted ([`SerializedError`]), and what the library
//! throws to its caller ([`DurabilityError`], [`ConfigError`]).
//!
//! Two families with different lifetimes live here. *Persisted* errors are
//! written to a record's `last_error`/`last_error_name` and read back by other
//! versions of the library (the TypeScript one included), so their names and
//! message templates are part of the storage format and must never change.
//! *Thrown* errors go to the caller that made a bad call and are never stored.
//!
//! This module owns no state and touches no storage.

use std::fmt;

use durability_platform::{MAX_SAFE_INTEGER, MAX_TIMER_MS, StorageError};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::codec::CodecError;
use crate::limits::LimitError;
use crate::migrations::MigrationError;

/// The `name` of an error that stops retries ([`HandlerError::non_retryable`]).
pub const NON_RETRYABLE_ERROR: &str = "NonRetryableError";
/// The `name` of an operation attempt that ran out of time.
pub const ATTEMPT_TIMEOUT_ERROR: &str = "DurableAttemptTimeoutError";
/// The `name` of a named-alarm attempt that ran out of time.
pub const ALARM_TIMEOUT_ERROR: &str = "DurableAlarmTimeoutError";
/// The `name` of a retry policy that produced an unusable delay.
pub const RETRY_POLICY_ERROR: &str = "DurableRetryPolicyError";
/// The `name` of an operation result that cannot be stored as JSON.
pub const RESULT_SERIALIZATION_ERROR: &str = "DurableResultSerializationError";
/// The `name` of a record found with no attempts left before its handler ran.
pub const ATTEMPTS_EXHAUSTED_ERROR: &str = "DurableAttemptsExhaustedError";

/// The persisted form of a failure: `{ "name": ..., "message": ... }`.
///
/// ```
/// use durability::error::{HandlerError, SerializedError};
///
/// let stored = HandlerError::named("PaymentDeclined", "card expired").serialize();
/// assert_eq!(stored, SerializedError::new("PaymentDeclined", "card expired"));
/// assert_eq!(
///     serde_json::to_string(&stored).unwrap(),
///     r#"{"name":"PaymentDeclined","message":"card expired"}"#
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SerializedError {
    /// The error's class name, `Error` when it has none.
    pub name: String,
    /// The error's message.
    pub message: String,
}

impl SerializedError {
    /// A serialized error with this name and message, taken as they are.
    pub fn new(name: impl Into<String>, message: impl Into<String>) -> Self {
        SerializedError {
            name: name.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for SerializedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.name, self.message)
    }
}

/// Which error of the library a [`HandlerError`] is, when the library (or a
/// handler through the public constructors) built it. The engine branches on
/// this, never on a user-chosen name, except for [`NON_RETRYABLE_ERROR`],
/// which is honoured by name on purpose (§4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LibraryErrorKind {
    /// [`HandlerError::non_retryable`] and the missing-handler errors.
    NonRetryable,
    /// [`HandlerError::attempt_timeout`].
    AttemptTimeout,
    /// [`HandlerError::alarm_timeout`].
    AlarmTimeout,
    /// [`HandlerError::retry_policy`].
    RetryPolicy,
    /// [`HandlerError::result_serialization`].
    ResultSerialization,
    /// [`HandlerError::attempts_exhausted`].
    AttemptsExhausted,
    /// `FanoutEnqueueError`: a stored or returned enqueue rejection.
    FanoutEnqueue,
    /// `FanoutSettlementError`: a rejected settlement call.
    FanoutSettlement,
    /// `FanoutTimeoutError`: a batch or DLQ write past its deadline.
    FanoutTimeout,
    /// `LogAppendError`: a log append rejection.
    LogAppend,
    /// `RangeError`: a value out of its range (a retry delay).
    Range,
    /// `StorageError`: storage failed under a settlement.
    Storage,
}

/// What a user handler returns when an attempt fails, and what the engine
/// decides retries on.
///
/// It deliberately does *not* implement [`std::error::Error`]: that is what
/// lets every `E: std::error::Error` convert into it (name `Error`, message
/// = the error's `Display`), so `?` works in handlers the way it does with
/// `anyhow`. Cloning copies two short strings and the cause chain.
///
/// ```
/// use durability::error::HandlerError;
///
/// fn parse(text: &str) -> Result<u32, HandlerError> {
///     Ok(text.parse::<u32>()?)
/// }
/// let error = parse("seven").unwrap_err();
/// assert_eq!(error.name(), "Error");
/// assert_eq!(error.message(), "invalid digit found in string");
/// assert!(!error.is_non_retryable());
///
/// let stop = HandlerError::non_retryable("account closed");
/// assert_eq!(stop.name(), "NonRetryableError");
/// assert!(stop.is_non_retryable());
/// // Errors of other packages named like ours are honoured too (§4.2).
/// assert!(HandlerError::named("NonRetryableError", "x").is_non_retryable());
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct HandlerError {
    name: String,
    message: String,
    non_retryable: bool,
    kind: Option<LibraryErrorKind>,
    cause: Option<Box<HandlerError>>,
}

impl HandlerError {
    /// A retryable error named `Error`.
    pub fn new(message: impl Into<String>) -> Self {
        Self::named("Error", message)
    }

    /// A retryable error with a class name of the caller's choice.
    pub fn named(name: impl Into<String>, message: impl Into<String>) -> Self {
        HandlerError {
            name: name.into(),
            message: message.into(),
            non_retryable: false,
            kind: None,
            cause: None,
        }
    }

    /// An error that stops retries at once: the record fails terminally with
    /// this error, whatever attempts remain. Named `NonRetryableError`.
    pub fn non_retryable(message: impl Into<String>) -> Self {
        Self::library(
            LibraryErrorKind::NonRetryable,
            NON_RETRYABLE_ERROR,
            message.into(),
        )
    }

    /// Marks this error as non-retryable while keeping its own name, so a
    /// handler can stop retries without losing what went wrong.
    pub fn into_non_retryable(mut self) -> Self {
        self.non_retryable = true;
        self
    }

    /// The non-retryable error persisted for a stored operation whose
    /// handler is not registered in this version of the program.
    pub fn no_operation_handler(operation: &str) -> Self {
        Self::non_retryable(format!(
            "No handler registered for operation \"{operation}\""
        ))
    }

    /// The non-retryable error persisted for a stored named alarm whose
    /// handler is not registered in this version of the program.
    pub fn no_alarm_handler(name: &str) -> Self {
        Self::non_retryable(format!("No named alarm handler registered for \"{name}\""))
    }

    /// `DurableAttemptTimeoutError`: an operation attempt exceeded its
    /// attempt timeout. Retried per policy.
    pub fn attempt_timeout(operation: &str, timeout_ms: u64) -> Self {
        Self::library(
            LibraryErrorKind::AttemptTimeout,
            ATTEMPT_TIMEOUT_ERROR,
            format!("Durable operation \"{operation}\" timed out after {timeout_ms}ms"),
        )
    }

    /// `DurableAlarmTimeoutError`: a named-alarm attempt exceeded its attempt
    /// timeout. Terminal unless the alarm's policy retries timeouts.
    pub fn alarm_timeout(name: &str, timeout_ms: u64) -> Self {
        Self::library(
            LibraryErrorKind::AlarmTimeout,
            ALARM_TIMEOUT_ERROR,
            format!("Durable alarm \"{name}\" timed out after {timeout_ms}ms"),
        )
    }

    /// `DurableRetryPolicyError`: the delay function of `entity_label` (for
    /// example `operation "charge"`) failed or produced an unusable delay.
    /// Always terminal.
    pub fn retry_policy(entity_label: &str, cause: Option<HandlerError>) -> Self {
        let mut error = Self::library(
            LibraryErrorKind::RetryPolicy,
            RETRY_POLICY_ERROR,
            format!(
                "Retry policy for {entity_label} must produce a non-negative safe-integer timestamp"
            ),
        );
        error.cause = cause.map(Box::new);
        error
    }

    /// `DurableResultSerializationError`: the handler of `operation`
    /// succeeded but its result cannot be stored as JSON. Always terminal for
    /// operations: running the handler again would produce the same value.
    pub fn result_serialization(operation: &str, cause: impl Into<HandlerError>) -> Self {
        Self::library(
            LibraryErrorKind::ResultSerialization,
            RESULT_SERIALIZATION_ERROR,
            format!("Result for durable operation \"{operation}\" is not JSON-serializable"),
        )
        .with_cause(cause)
    }

    /// `DurableAttemptsExhaustedError`: a pending record of `kind`
    /// (`operation` or `named alarm`) was found with no attempts left before
    /// its handler was invoked, typically because the process died during
    /// its last attempt.
    pub fn attempts_exhausted(kind: &str, name: &str, max_attempts: u32) -> Self {
        Self::library(
            LibraryErrorKind::AttemptsExhausted,
            ATTEMPTS_EXHAUSTED_ERROR,
            format!("Durable {kind} \"{name}\" exhausted its {max_attempts} attempts"),
        )
    }

    fn library(kind: LibraryErrorKind, name: &str, message: String) -> Self {
        HandlerError {
            name: name.to_owned(),
            message,
            non_retryable: false,
            kind: Some(kind),
            cause: None,
        }
    }

    /// A retryable `Error` from any error value, with its `source()` chain
    /// as the cause chain. For boxed errors, which `?` cannot convert
    /// (`Box<dyn Error>` does not implement `Error` itself):
    /// `.map_err(|e| HandlerError::from_error(&*e))`.
    pub fn from_error(error: &dyn std::error::Error) -> Self {
        from_source(error)
    }

    /// Attaches the error that caused this one (kept in memory and in logs,
    /// never persisted).
    pub fn with_cause(mut self, cause: impl Into<HandlerError>) -> Self {
        self.cause = Some(Box::new(cause.into()));
        self
    }

    /// The error's class name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The error's message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The error that caused this one, if any.
    pub fn cause(&self) -> Option<&HandlerError> {
        self.cause.as_deref()
    }

    /// Which library error this is, if the library's constructors built it.
    pub fn kind(&self) -> Option<LibraryErrorKind> {
        self.kind
    }

    /// Whether retries must stop (§4.2): the error was made non-retryable,
    /// or its name is `NonRetryableError`, whoever built it.
    pub fn is_non_retryable(&self) -> bool {
        self.non_retryable || self.name == NON_RETRYABLE_ERROR
    }

    /// The persisted `{name, message}` form. Like the reference library, an
    /// empty name becomes `Error` and an empty message `Unknown thrown value`,
    /// so a stored failure always says something.
    pub fn serialize(&self) -> SerializedError {
        SerializedError {
            name: if self.name.is_empty() {
                "Error".to_owned()
            } else {
                self.name.clone()
            },
            message: if self.message.is_empty() {
                "Unknown thrown value".to_owned()
            } else {
                self.message.clone()
            },
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.name, self.message)?;
        if let Some(cause) = &self.cause {
            write!(f, " (caused by {cause})")?;
        }
        Ok(())
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("HandlerError");
        debug
            .field("name", &self.name)
            .field("message", &self.message);
        if self.non_retryable {
            debug.field("non_retryable", &true);
        }
        if let Some(cause) = &self.cause {
            debug.field("cause", cause);
        }
        debug.finish()
    }
}

/// Any standard error becomes a retryable `Error` with its `Display` as the
/// message; its `source()` chain becomes the cause chain.
impl<E: std::error::Error> From<E> for HandlerError {
    fn from(error: E) -> Self {
        let mut converted = HandlerError::new(error.to_string());
        converted.cause = error.source().map(|source| Box::new(from_source(source)));
        converted
    }
}

fn from_source(error: &dyn std::error::Error) -> HandlerError {
    let mut converted = HandlerError::new(error.to_string());
    converted.cause = error.source().map(|source| Box::new(from_source(source)));
    converted
}

/// A stored failure read back, for example to rethrow it.
impl From<SerializedError> for HandlerError {
    fn from(error: SerializedError) -> Self {
        HandlerError::named(error.name, error.message)
    }
}

/// Invalid configuration, returned when a scheduler, a helper or a policy is
/// built. Each variant is one rule and names the field that broke it.
///
/// `field` is the Rust builder setter the value came through
/// (`alarm_min_delay`, `max_batch_size`, `leases.lease_for` for the `lease_for`
/// setter of the `leases` option), never a form with units or rules in it;
/// the rule and its units are in the message.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A count or a duration that must be at least 1.
    #[error("{field} must be a positive integer")]
    NotPositive { field: String },
    /// A value outside its inclusive range.
    #[error("{field} must be between {min} and {max}")]
    OutOfRange { field: String, min: u64, max: u64 },
    /// A duration that is not a whole number of milliseconds within its
    /// inclusive range.
    #[error("{field} must be a whole number of milliseconds from {min_ms} ms to {max_ms} ms")]
    DurationOutOfRange {
        field: String,
        min_ms: u64,
        max_ms: u64,
    },
    /// A duration longer than any in-memory timer can wait. JavaScript
    /// timers treat such delays as zero, so the reference library would
    /// expire them at once; this port rejects them instead.
    #[error("{field} must be at most {MAX_TIMER_MS} ms (the longest timer), got {value_ms}")]
    AboveTimerLimit { field: String, value_ms: u64 },
    /// A duration setter given a value that is not a whole number of
    /// milliseconds: stored times are milliseconds, and rounding would
    /// silently change the setting.
    #[error("{field} must be a whole number of milliseconds, got {value:?}")]
    NotWholeMilliseconds {
        field: String,
        value: std::time::Duration,
    },
    /// A retry delay setting that is NaN, infinite or negative.
    #[error("{field} must be a finite non-negative number of milliseconds, got {value}")]
    InvalidDelay { field: String, value: f64 },
    /// A handler name that collides with a method of the helper.
    #[error("\"{name}\" is reserved by {owner}")]
    ReservedName { name: String, owner: &'static str },
    /// A body limit above what the platform's storage can hold in one value
    /// (on Cloudflare, 2 MB per string, blob or row): `max` is the most the
    /// setter `field` accepts there, the platform's `max_value_bytes` less
    /// [`STORED_VALUE_OVERHEAD_BYTES`](crate::limits::STORED_VALUE_OVERHEAD_BYTES).
    #[error(
        "{field} is {value} bytes, above the {max} bytes this platform can store in one value (its max_value_bytes of {platform_max} less the stored envelope)"
    )]
    AbovePlatformLimit {
        field: String,
        value: u64,
        max: u64,
        platform_max: u64,
    },
    /// A duration at or above the platform's CPU limit per invocation
    /// ([`Context::invocation_cpu_limit`](durability_platform::Context::invocation_cpu_limit)):
    /// a run that long would be ended by the platform before it hands off.
    #[error(
        "{field} is {value_ms} ms, not below the platform's CPU limit per invocation of {limit_ms} ms"
    )]
    AboveInvocationLimit {
        field: String,
        value_ms: u64,
        limit_ms: u64,
    },
    /// A second helper for the same table on one scheduler.
    #[error("A {table} helper is already attached to this scheduler")]
    DuplicateParticipant { table: String },
}

/// Why a call into a capability failed. Nothing of a failed call is written.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum DurabilityError {
    /// The object's storage failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// Invalid configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A time or duration argument that is negative or beyond 2^53 - 1.
    #[error("{field} must be a non-negative safe integer, got {value}")]
    InvalidTimestamp { field: &'static str, value: i64 },
    /// An operation id that belongs to another operation.
    #[error(
        "Durable call \"{id}\" already belongs to operation \"{existing}\", not \"{requested}\""
    )]
    DuplicateCall {
        id: String,
        existing: String,
        requested: String,
    },
    /// A payload or result that cannot be stored as JSON, or a stored value
    /// that is not what the reader expects.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// A stored row that does not decode (written by another version, or
    /// damaged). Names the table and the row's key so it can be found.
    #[error("row {key:?} of {table} does not decode: {detail}")]
    Decode {
        table: &'static str,
        key: String,
        detail: String,
    },
    /// A schema migration failed.
    #[error(transparent)]
    Migration(#[from] MigrationError),
    /// A registration committed but its row cannot be read back.
    #[error("Durable call \"{id}\" was not persisted")]
    NotPersisted { id: String },
    /// Background work of the scheduler ended before it reported, which
    /// happens when the object is evicted or the host shuts down mid-run.
    /// Nothing is lost: the persisted work runs again from the alarm.
    #[error("the scheduler's background work was interrupted (eviction or shutdown)")]
    Interrupted,
    /// A registration or schedule for a name no handler was registered for
    /// in this helper: nothing is stored (a stored row whose handler was
    /// removed by a later deployment fails on its first claim instead).
    #[error("no handler is registered for {kind} \"{name}\"")]
    UnknownHandler { kind: &'static str, name: String },
    /// An id, a name or a payload outside its limit (see [`crate::limits`]);
    /// nothing was written.
    #[error(transparent)]
    Limit(#[from] LimitError),
    /// A completed operation row without a result.
    /// A recurring schedule was rejected (named alarms).
    #[error(transparent)]
    Recurrence(#[from] crate::alarms::RecurrenceError),

    /// `pause`/`resume` named an alarm that has no recurring schedule.
    #[error("named alarm \"{name}\" has no recurring schedule")]
    NotRecurring { name: String },

    #[error("Completed durable call \"{id}\" has no result")]
    CompletedWithoutResult { id: String },
    /// An alarm run changed nothing while work of these tables stayed due
    /// (two runs in a row): a row the run can neither advance nor decode
    /// as damaged, most likely. The scheduler treats it as a failed run:
    /// it logs it, calls `on_alarm_retry`, and retries at the fallback pace
    /// instead of re-running at once.
    #[error(
        "an alarm run made no progress while work of {tables:?} stayed due (a damaged row?); retrying at the fallback pace"
    )]
    NoProgress { tables: Vec<String> },
    /// A read (`Operations::result`, `Operations::wait`) named another
    /// operation than the one registered under `id`. Nothing was read.
    #[error(
        "Durable call \"{id}\" belongs to operation \"{registered}\", not \"{requested}\"; read it under its own name"
    )]
    OperationMismatch {
        id: String,
        registered: String,
        requested: String,
    },
}

impl DurabilityError {
    /// Checks that `value` is a persisted time or duration: an integer in
    /// `0..=2^53 - 1`, readable by the JavaScript library too.
    ///
    /// ```
    /// use durability::error::DurabilityError;
    ///
    /// assert_eq!(DurabilityError::require_timestamp("before", 5).unwrap(), 5);
    /// let error = DurabilityError::require_timestamp("scheduled_time", -1).unwrap_err();
    /// assert_eq!(error.to_string(), "scheduled_time must be a non-negative safe integer, got -1");
    /// ```
    pub fn require_timestamp(field: &'static str, value: i64) -> Result<i64, DurabilityError> {
        if (0..=MAX_SAFE_INTEGER).contains(&value) {
            Ok(value)
        } else {
            Err(DurabilityError::InvalidTimestamp { field, value })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn library_errors_use_the_persisted_names_and_message_templates() {
        let cases = [
            (
                HandlerError::non_retryable("stop"),
                "NonRetryableError",
                "stop",
            ),
            (
                HandlerError::no_operation_handler("charge"),
                "NonRetryableError",
                "No handler registered for operation \"charge\"",
            ),
            (
                HandlerError::no_alarm_handler("daily"),
                "NonRetryableError",
                "No named alarm handler registered for \"daily\"",
            ),
            (
                HandlerError::attempt_timeout("charge", 300_000),
                "DurableAttemptTimeoutError",
                "Durable operation \"charge\" timed out after 300000ms",
            ),
            (
                HandlerError::alarm_timeout("daily", 50),
                "DurableAlarmTimeoutError",
                "Durable alarm \"daily\" timed out after 50ms",
            ),
            (
                HandlerError::retry_policy("operation \"charge\"", None),
                "DurableRetryPolicyError",
                "Retry policy for operation \"charge\" must produce a non-negative safe-integer timestamp",
            ),
            (
                HandlerError::result_serialization("charge", HandlerError::new("NaN")),
                "DurableResultSerializationError",
                "Result for durable operation \"charge\" is not JSON-serializable",
            ),
            (
                HandlerError::attempts_exhausted("named alarm", "daily", 5),
                "DurableAttemptsExhaustedError",
                "Durable named alarm \"daily\" exhausted its 5 attempts",
            ),
        ];
        for (error, name, message) in cases {
            assert_eq!(error.serialize(), SerializedError::new(name, message));
            assert!(error.kind().is_some());
        }
    }

    #[test]
    fn non_retryable_is_recognised_by_flag_or_by_name() {
        assert!(HandlerError::non_retryable("x").is_non_retryable());
        assert!(HandlerError::named("NonRetryableError", "x").is_non_retryable());
        let kept = HandlerError::named("Declined", "x").into_non_retryable();
        assert!(kept.is_non_retryable());
        assert_eq!(kept.name(), "Declined");
        assert!(!HandlerError::new("x").is_non_retryable());
        assert!(!HandlerError::attempt_timeout("op", 1).is_non_retryable());
    }

    #[test]
    fn serialize_never_persists_an_empty_name_or_message() {
        assert_eq!(
            HandlerError::named("", "").serialize(),
            SerializedError::new("Error", "Unknown thrown value")
        );
    }

    #[test]
    fn standard_errors_convert_with_their_source_chain() {
        #[derive(Debug, Error)]
        #[error("outer")]
        struct Outer(#[source] std::fmt::Error);

        let error = HandlerError::from(Outer(std::fmt::Error));
        assert_eq!(error.name(), "Error");
        assert_eq!(error.message(), "outer");
        assert_eq!(
            error.cause().map(HandlerError::message),
            Some("an error occurred when formatting an argument")
        );
    }

    #[test]
    fn boxed_errors_convert_too() {
        fn boxed() -> Result<(), Box<dyn std::error::Error>> {
            Err("plain".into())
        }
        fn handler() -> Result<(), HandlerError> {
            boxed().map_err(|e| HandlerError::from_error(&*e))
        }
        assert_eq!(handler().unwrap_err().message(), "plain");
        let sync: Box<dyn std::error::Error + Send + Sync> = "sync".into();
        assert_eq!(HandlerError::from_error(&*sync).message(), "sync");
    }

    #[test]
    fn retry_policy_error_keeps_its_cause_out_of_the_persisted_form() {
        let error = HandlerError::retry_policy("fanout", Some(HandlerError::new("boom")));
        assert_eq!(error.cause().map(HandlerError::message), Some("boom"));
        assert!(!error.serialize().message.contains("boom"));
    }

    #[test]
    fn config_errors_name_the_field_and_the_rule() {
        let error = ConfigError::NotPositive {
            field: "alarm_concurrency".into(),
        };
        assert_eq!(
            error.to_string(),
            "alarm_concurrency must be a positive integer"
        );
        let error = ConfigError::OutOfRange {
            field: "alarm_min_delay_ms".into(),
            min: 1_000,
            max: 15_000,
        };
        assert_eq!(
            error.to_string(),
            "alarm_min_delay_ms must be between 1000 and 15000"
        );
    }

    #[test]
    fn duplicate_call_uses_the_reference_message() {
        let error = DurabilityError::DuplicateCall {
            id: "a".into(),
            existing: "charge".into(),
            requested: "refund".into(),
        };
        assert_eq!(
            error.to_string(),
            "Durable call \"a\" already belongs to operation \"charge\", not \"refund\""
        );
    }

    #[test]
    fn require_timestamp_accepts_exactly_the_safe_non_negative_range() {
        assert!(DurabilityError::require_timestamp("t", 0).is_ok());
        assert!(DurabilityError::require_timestamp("t", MAX_SAFE_INTEGER).is_ok());
        assert!(DurabilityError::require_timestamp("t", MAX_SAFE_INTEGER + 1).is_err());
        assert!(DurabilityError::require_timestamp("t", -1).is_err());
    }
}
