//! The input limits every capability applies the same way, and the typed
//! error that names the field and the rule a rejected input broke.
//!
//! Why limits at all: every id, key and name is a primary or unique key of
//! an object's SQLite table and is copied into rows, memos, lifecycle
//! events and logs; every body is held in memory whole while it is encoded,
//! stored and delivered. Without a bound, one caller can make an object's
//! commits, indexes and memory as large as it likes.
//!
//! - **Identifiers** (operation ids, fanout message ids and deduplication
//!   keys, log deduplication keys, log consumer names, memo keys, handler
//!   and alarm names): non-empty, at most [`MAX_ID_BYTES`] bytes of UTF-8,
//!   the same bound the host puts on object and namespace names. Not
//!   configurable: a longer identifier is a bug in the caller, not a need.
//! - **Bodies** (operation payloads, fanout bodies, log records): at most a
//!   configurable number of bytes of the body's own JSON (the text
//!   `serde_json` writes for it, not the stored envelope around it),
//!   [`DEFAULT_MAX_BODY_BYTES`] by default, at most
//!   [`MAX_BODY_BYTES_LIMIT`]. The setters are
//!   `OperationsBuilder::max_payload_bytes`, `FanoutBuilder::max_body_bytes`
//!   and `LogBuilder::max_body_bytes`.
//! - **Nesting** of any stored value: [`crate::codec::MAX_NESTING_DEPTH`].
//! - **Items per call**: fanout messages per enqueue
//!   (`FanoutBuilder::max_enqueue_messages`, default
//!   [`DEFAULT_MAX_ENQUEUE_MESSAGES`]) and log records per append (the
//!   log's `max_batch_size`).
//!
//! This module touches no storage.
//!
//! ```
//! use durability::limits::{self, LimitError, MAX_ID_BYTES};
//!
//! assert!(limits::check_id("id", "order-7").is_ok());
//! assert_eq!(limits::check_id("id", ""), Err(LimitError::Empty { field: "id" }));
//! let long = "x".repeat(MAX_ID_BYTES + 1);
//! assert_eq!(
//!     limits::check_id("id", &long).unwrap_err().to_string(),
//!     "id is 1025 bytes, above the limit of 1024 (MAX_ID_BYTES)"
//! );
//! ```

use thiserror::Error;

/// The most bytes (UTF-8) of any identifier: ids, keys, names.
pub const MAX_ID_BYTES: usize = 1024;

/// Default most bytes of one body's own JSON (1 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;

/// The highest body limit a builder accepts (32 MiB): a body is held whole
/// in memory several times over while it is encoded, committed and handed
/// to a handler, on a thread every object of the host shares.
pub const MAX_BODY_BYTES_LIMIT: usize = 32 << 20;

/// Default most fanout messages per enqueue call.
pub const DEFAULT_MAX_ENQUEUE_MESSAGES: usize = 1_000;

/// The highest per-call item limit a builder accepts: one call is one
/// transaction, which holds the object's only writer.
pub const MAX_ITEMS_PER_CALL_LIMIT: usize = 100_000;

/// An input outside its limit. `field` is the name of the argument or
/// input field; `limit` names the constant or builder setting that set the
/// bound.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum LimitError {
    /// An identifier that is the empty string.
    #[error("{field} must not be empty")]
    Empty { field: &'static str },
    /// An identifier or a body longer than its limit.
    #[error("{field} is {bytes} bytes, above the limit of {max_bytes} ({limit})")]
    TooLong {
        field: &'static str,
        bytes: usize,
        max_bytes: usize,
        limit: &'static str,
    },
    /// More items in one call than its limit.
    #[error("{field} holds {count} items, above the limit of {max} per call ({limit})")]
    TooMany {
        field: &'static str,
        count: usize,
        max: usize,
        limit: &'static str,
    },
}

/// Checks an identifier: non-empty, at most [`MAX_ID_BYTES`] bytes.
pub fn check_id(field: &'static str, value: &str) -> Result<(), LimitError> {
    if value.is_empty() {
        return Err(LimitError::Empty { field });
    }
    if value.len() > MAX_ID_BYTES {
        return Err(LimitError::TooLong {
            field,
            bytes: value.len(),
            max_bytes: MAX_ID_BYTES,
            limit: "MAX_ID_BYTES",
        });
    }
    Ok(())
}

/// Checks a builder's count or size setting: at least 1 and at most
/// `max`, each broken rule a typed error naming the setter.
pub(crate) fn check_setting(
    field: &'static str,
    value: usize,
    max: usize,
) -> Result<(), crate::error::ConfigError> {
    use crate::error::ConfigError;
    if value == 0 {
        return Err(ConfigError::NotPositive {
            field: field.into(),
        });
    }
    if value > max {
        return Err(ConfigError::OutOfRange {
            field: field.into(),
            min: 1,
            max: u64::try_from(max).unwrap_or(u64::MAX),
        });
    }
    Ok(())
}

/// Bytes a stored row may hold beside a body of the limit's size: the
/// envelope around the body (`{"kind":"value","value":...}`), its ids and
/// keys (at most [`MAX_ID_BYTES`] each), a lifecycle or error text.
/// Generous on purpose: it only lowers the highest body limit a platform
/// with a per-value bound accepts.
pub const STORED_VALUE_OVERHEAD_BYTES: usize = 64 << 10;

/// Checks a builder's body limit: at least 1, at most
/// [`MAX_BODY_BYTES_LIMIT`], and small enough that a body of that size,
/// with its row, fits the platform's largest value
/// ([`StorageLimits::max_value_bytes`] less [`STORED_VALUE_OVERHEAD_BYTES`]).
pub(crate) fn check_body_setting(
    field: &'static str,
    value: usize,
    storage: &durability_platform::StorageLimits,
) -> Result<(), crate::error::ConfigError> {
    check_setting(field, value, MAX_BODY_BYTES_LIMIT)?;
    let max = storage
        .max_value_bytes
        .saturating_sub(STORED_VALUE_OVERHEAD_BYTES);
    if value > max {
        let wide = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        return Err(crate::error::ConfigError::AbovePlatformLimit {
            field: field.into(),
            value: wide(value),
            max: wide(max),
            platform_max: wide(storage.max_value_bytes),
        });
    }
    Ok(())
}

/// Checks a body's own JSON length against the limit set by `setting`.
pub fn check_body(
    field: &'static str,
    bytes: usize,
    max_bytes: usize,
    setting: &'static str,
) -> Result<(), LimitError> {
    if bytes > max_bytes {
        return Err(LimitError::TooLong {
            field,
            bytes,
            max_bytes,
            limit: setting,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identifier_of_exactly_the_limit_is_accepted_and_one_byte_more_is_not() {
        assert!(check_id("key", &"é".repeat(MAX_ID_BYTES / 2)).is_ok());
        assert_eq!(
            check_id("key", &"x".repeat(MAX_ID_BYTES + 1)),
            Err(LimitError::TooLong {
                field: "key",
                bytes: MAX_ID_BYTES + 1,
                max_bytes: MAX_ID_BYTES,
                limit: "MAX_ID_BYTES",
            })
        );
    }

    #[test]
    fn a_body_is_measured_against_the_setting_it_names() {
        assert!(check_body("payload", 10, 10, "max_payload_bytes").is_ok());
        assert_eq!(
            check_body("payload", 11, 10, "max_payload_bytes")
                .unwrap_err()
                .to_string(),
            "payload is 11 bytes, above the limit of 10 (max_payload_bytes)"
        );
    }
}
