//! What one SQL statement may carry on a platform, and the check every
//! platform's storage applies before it runs a statement.
//!
//! Cloudflare's Durable Object SQLite refuses a statement with more than 100
//! bound parameters, a string, blob or row over 2 MB, or a statement text
//! over 100 KB, by throwing a JavaScript exception. The embedded host has
//! SQLite's own, much larger, limits. The capabilities are written once for
//! both, so they must keep within the smaller set; [`check_statement`] turns
//! a statement that would not keep within it into a typed
//! [`StorageError::LimitExceeded`] before anything is bound, on every
//! platform that asks for [`StorageLimits::CLOUDFLARE`] (the Cloudflare
//! adapter always; the host when built with those limits, as the
//! capabilities' own tests are).
//!
//! A row's size is not checked here: a row is its values plus a few bytes
//! each, and the capabilities keep every body well under
//! [`StorageLimits::max_value_bytes`] (their builders refuse a body limit the
//! platform cannot store), so the value check is the one that matters.
//!
//! ```
//! use durability_platform::{StorageError, StorageLimits, Value, check_statement};
//!
//! let limits = StorageLimits::CLOUDFLARE;
//! let params = vec![Value::Integer(1); 101];
//! let sql = format!("SELECT {}", vec!["?"; 101].join(", "));
//! match check_statement(&limits, &sql, &params) {
//!     Err(StorageError::LimitExceeded { limit, value, max }) => {
//!         assert_eq!((limit, value, max), ("max_bound_parameters", 101, 100));
//!     }
//!     other => panic!("expected the parameter limit, got {other:?}"),
//! }
//! ```

use crate::{StorageError, Value};

/// The most a single SQL statement may carry on a platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StorageLimits {
    /// Bound parameters per statement.
    pub max_bound_parameters: usize,
    /// Bytes of one bound string or blob (and so of one stored value).
    pub max_value_bytes: usize,
    /// Bytes of the statement's text.
    pub max_statement_bytes: usize,
}

impl StorageLimits {
    /// Cloudflare Durable Object SQLite: 100 bound parameters, 2 MB per
    /// string, blob or row, 100 KB per statement (the platform's documented
    /// limits; MB and KB are decimal there).
    pub const CLOUDFLARE: StorageLimits = StorageLimits {
        max_bound_parameters: 100,
        max_value_bytes: 2_000_000,
        max_statement_bytes: 100_000,
    };

    /// SQLite's compiled-in defaults (`SQLITE_MAX_VARIABLE_NUMBER`,
    /// `SQLITE_MAX_LENGTH`, `SQLITE_MAX_SQL_LENGTH`): what the embedded
    /// host allows unless told otherwise.
    pub const SQLITE: StorageLimits = StorageLimits {
        max_bound_parameters: 32_766,
        max_value_bytes: 1_000_000_000,
        max_statement_bytes: 1_000_000_000,
    };
}

impl Default for StorageLimits {
    fn default() -> Self {
        StorageLimits::SQLITE
    }
}

/// Checks `sql` and its `params` against `limits`: the parameter count, the
/// statement's length, and the length of every string and blob.
pub fn check_statement(
    limits: &StorageLimits,
    sql: &str,
    params: &[Value],
) -> Result<(), StorageError> {
    let exceeded = |limit, value, max| Err(StorageError::LimitExceeded { limit, value, max });
    if params.len() > limits.max_bound_parameters {
        return exceeded(
            "max_bound_parameters",
            params.len(),
            limits.max_bound_parameters,
        );
    }
    if sql.len() > limits.max_statement_bytes {
        return exceeded("max_statement_bytes", sql.len(), limits.max_statement_bytes);
    }
    for param in params {
        let bytes = match param {
            Value::Text(text) => text.len(),
            Value::Blob(blob) => blob.len(),
            Value::Null | Value::Integer(_) | Value::Real(_) => continue,
        };
        if bytes > limits.max_value_bytes {
            return exceeded("max_value_bytes", bytes, limits.max_value_bytes);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_statement_at_every_cloudflare_limit_passes_and_one_above_each_is_refused() {
        let limits = StorageLimits::CLOUDFLARE;
        let at = vec![Value::Null; 100];
        assert_eq!(check_statement(&limits, "SELECT 1", &at), Ok(()));
        let refused = |sql: &str, params: &[Value]| match check_statement(&limits, sql, params) {
            Err(StorageError::LimitExceeded { limit, .. }) => limit,
            other => panic!("not refused: {other:?}"),
        };
        assert_eq!(
            refused("SELECT 1", &vec![Value::Null; 101]),
            "max_bound_parameters"
        );
        let long_sql = format!("SELECT '{}'", "x".repeat(100_000));
        assert_eq!(refused(&long_sql, &[]), "max_statement_bytes");
        let text = Value::Text("é".repeat(1_000_001));
        assert_eq!(refused("SELECT ?", &[text]), "max_value_bytes");
        let blob = Value::Blob(vec![0; 2_000_000]);
        assert_eq!(check_statement(&limits, "SELECT ?", &[blob]), Ok(()));
        let blob = Value::Blob(vec![0; 2_000_001]);
        assert_eq!(refused("SELECT ?", &[blob]), "max_value_bytes");
    }
}
