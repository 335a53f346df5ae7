//! The rules by which SQL values cross into JavaScript and back.
//!
//! A Durable Object's `sql.exec` takes and returns JavaScript values: every
//! number is an IEEE double. That loses two facts the contract's value model
//! keeps, and this module decides what to do about each, in plain Rust so the
//! rules are unit-tested on the host as well as exercised under `workerd`:
//!
//! - An integer outside ±(2^53 - 1) has no exact double. Binding it would
//!   store a rounded number, so [`integer_to_number`] refuses it with
//!   [`StorageError::UnsafeInteger`]; nothing is written.
//! - A double with no fractional part reads back the same as an integer:
//!   SQLite itself stores integral REALs compactly, and JavaScript cannot tell
//!   `2.0` from `2`. [`number_to_value`] therefore reads every integral number
//!   in the safe range as [`Value::Integer`], and the contract's `f64` decoder
//!   accepts integers, so a REAL column still decodes as `f64`. A number
//!   outside the safe range can only be a REAL (no integer can be stored
//!   there), so it reads back as [`Value::Real`].
//!
//! Exceptions thrown by `exec` carry SQLite's message; [`classify_error`]
//! turns it into the contract's typed [`StorageError`].

use durability_platform::{MAX_SAFE_INTEGER, StorageError, Value};

/// The double that binds `value` exactly, or a typed error when there is none.
pub fn integer_to_number(value: i64) -> Result<f64, StorageError> {
    if (-MAX_SAFE_INTEGER..=MAX_SAFE_INTEGER).contains(&value) {
        // Exact: every integer of magnitude below 2^53 is a double.
        #[allow(clippy::cast_precision_loss)] // checked to be in the exact range above
        Ok(value as f64)
    } else {
        Err(StorageError::UnsafeInteger { value })
    }
}

/// The contract value of a number that `sql.exec` returned.
pub fn number_to_value(number: f64) -> Value {
    #[allow(clippy::cast_precision_loss)] // 2^53 - 1 is exact as a double
    let limit = MAX_SAFE_INTEGER as f64;
    if number.is_finite() && number.fract() == 0.0 && number.abs() <= limit {
        // In range and integral: the conversion is exact.
        #[allow(clippy::cast_possible_truncation)] // integral and within ±2^53
        Value::Integer(number as i64)
    } else {
        Value::Real(number)
    }
}

/// The contract error for the message of an exception `sql.exec` threw.
pub fn classify_error(message: String) -> StorageError {
    let lower = message.to_ascii_lowercase();
    if lower.contains("constraint failed") || lower.contains("sqlite_constraint") {
        StorageError::Constraint { message }
    } else if lower.contains("database or disk is full") || lower.contains("sqlite_full") {
        StorageError::Full { message }
    } else if lower.contains("malformed") || lower.contains("not a database") {
        StorageError::Corrupt { message }
    } else {
        StorageError::Sql { message }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_integers_bind_exactly() {
        assert_eq!(integer_to_number(0), Ok(0.0));
        assert_eq!(
            integer_to_number(MAX_SAFE_INTEGER),
            Ok(9_007_199_254_740_991.0)
        );
        assert_eq!(
            integer_to_number(-MAX_SAFE_INTEGER),
            Ok(-9_007_199_254_740_991.0)
        );
    }

    #[test]
    fn integers_outside_the_safe_range_are_a_typed_error() {
        for value in [
            MAX_SAFE_INTEGER + 1,
            -MAX_SAFE_INTEGER - 1,
            i64::MAX,
            i64::MIN,
        ] {
            assert_eq!(
                integer_to_number(value),
                Err(StorageError::UnsafeInteger { value })
            );
        }
    }

    #[test]
    fn integral_numbers_read_back_as_integers() {
        assert_eq!(number_to_value(2.0), Value::Integer(2));
        assert_eq!(number_to_value(-0.0), Value::Integer(0));
        assert_eq!(
            number_to_value(9_007_199_254_740_991.0),
            Value::Integer(MAX_SAFE_INTEGER)
        );
    }

    #[test]
    fn a_real_2_reads_back_as_an_integer_that_decodes_as_f64() {
        let row =
            durability_platform::Row::new(vec!["x".to_owned()].into(), vec![number_to_value(2.0)]);
        assert_eq!(row.get::<f64>(0), Ok(2.0));
    }

    #[test]
    fn fractions_and_numbers_beyond_the_safe_range_read_back_as_reals() {
        assert_eq!(number_to_value(2.5), Value::Real(2.5));
        assert_eq!(number_to_value(1e300), Value::Real(1e300));
        assert_eq!(
            number_to_value(9_007_199_254_740_992.0),
            Value::Real(9_007_199_254_740_992.0)
        );
        assert!(matches!(number_to_value(f64::NAN), Value::Real(n) if n.is_nan()));
        assert_eq!(number_to_value(f64::INFINITY), Value::Real(f64::INFINITY));
    }

    #[test]
    fn sqlite_messages_become_typed_errors() {
        assert!(matches!(
            classify_error("UNIQUE constraint failed: t.id: SQLITE_CONSTRAINT".into()),
            StorageError::Constraint { .. }
        ));
        assert!(matches!(
            classify_error("database or disk is full: SQLITE_FULL".into()),
            StorageError::Full { .. }
        ));
        assert!(matches!(
            classify_error("no such table: nope: SQLITE_ERROR".into()),
            StorageError::Sql { .. }
        ));
    }
}
