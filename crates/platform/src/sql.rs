//! SQL values, rows and the synchronous statement interface.
//!
//! The value model is SQLite's: every cell is NULL, a 64-bit integer, a
//! double, UTF-8 text or a blob. Rows decode through [`FromValue`], which
//! fails with a typed [`StorageError::Decode`] instead of panicking, so a row
//! written by another version never crashes the object that reads it.

use std::fmt;
use std::sync::Arc;

use crate::StorageError;

/// One SQLite value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Integer(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

/// The storage class of a [`Value`], used in decode errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    Null,
    Integer,
    Real,
    Text,
    Blob,
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ValueType::Null => "NULL",
            ValueType::Integer => "INTEGER",
            ValueType::Real => "REAL",
            ValueType::Text => "TEXT",
            ValueType::Blob => "BLOB",
        })
    }
}

impl Value {
    /// The storage class of this value.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::Null => ValueType::Null,
            Value::Integer(_) => ValueType::Integer,
            Value::Real(_) => ValueType::Real,
            Value::Text(_) => ValueType::Text,
            Value::Blob(_) => ValueType::Blob,
        }
    }
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Integer(v)
    }
}
impl From<i32> for Value {
    fn from(v: i32) -> Self {
        Value::Integer(i64::from(v))
    }
}
impl From<u32> for Value {
    fn from(v: u32) -> Self {
        Value::Integer(i64::from(v))
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Integer(i64::from(v))
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Real(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Text(v.to_owned())
    }
}
impl From<&String> for Value {
    fn from(v: &String) -> Self {
        Value::Text(v.clone())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Text(v)
    }
}
impl From<Vec<u8>> for Value {
    fn from(v: Vec<u8>) -> Self {
        Value::Blob(v)
    }
}
impl From<&[u8]> for Value {
    fn from(v: &[u8]) -> Self {
        Value::Blob(v.to_vec())
    }
}
impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map_or(Value::Null, Into::into)
    }
}

/// A Rust type a [`Value`] decodes into.
pub trait FromValue: Sized {
    /// Decodes `value`, or returns the storage class that was found instead.
    fn from_value(value: &Value) -> Result<Self, ValueType>;
    /// The storage class this type expects, named in decode errors.
    const EXPECTED: &'static str;
}

impl FromValue for Value {
    const EXPECTED: &'static str = "any value";
    fn from_value(value: &Value) -> Result<Self, ValueType> {
        Ok(value.clone())
    }
}
impl FromValue for i64 {
    const EXPECTED: &'static str = "INTEGER";
    fn from_value(value: &Value) -> Result<Self, ValueType> {
        match value {
            Value::Integer(v) => Ok(*v),
            other => Err(other.value_type()),
        }
    }
}
impl FromValue for u64 {
    const EXPECTED: &'static str = "non-negative INTEGER";
    fn from_value(value: &Value) -> Result<Self, ValueType> {
        match value {
            Value::Integer(v) => u64::try_from(*v).map_err(|_| ValueType::Integer),
            other => Err(other.value_type()),
        }
    }
}
impl FromValue for u32 {
    const EXPECTED: &'static str = "INTEGER in 0..=4294967295";
    fn from_value(value: &Value) -> Result<Self, ValueType> {
        match value {
            Value::Integer(v) => u32::try_from(*v).map_err(|_| ValueType::Integer),
            other => Err(other.value_type()),
        }
    }
}
impl FromValue for bool {
    const EXPECTED: &'static str = "INTEGER 0 or 1";
    fn from_value(value: &Value) -> Result<Self, ValueType> {
        match value {
            Value::Integer(0) => Ok(false),
            Value::Integer(1) => Ok(true),
            other => Err(other.value_type()),
        }
    }
}
impl FromValue for f64 {
    const EXPECTED: &'static str = "REAL";
    fn from_value(value: &Value) -> Result<Self, ValueType> {
        match value {
            Value::Real(v) => Ok(*v),
            // SQLite stores integral REALs compactly and may hand them back as integers.
            #[allow(clippy::cast_precision_loss)] // a REAL column holds f64 precision anyway
            Value::Integer(v) => Ok(*v as f64),
            other => Err(other.value_type()),
        }
    }
}
impl FromValue for String {
    const EXPECTED: &'static str = "TEXT";
    fn from_value(value: &Value) -> Result<Self, ValueType> {
        match value {
            Value::Text(v) => Ok(v.clone()),
            other => Err(other.value_type()),
        }
    }
}
impl FromValue for Vec<u8> {
    const EXPECTED: &'static str = "BLOB";
    fn from_value(value: &Value) -> Result<Self, ValueType> {
        match value {
            Value::Blob(v) => Ok(v.clone()),
            other => Err(other.value_type()),
        }
    }
}
impl<T: FromValue> FromValue for Option<T> {
    const EXPECTED: &'static str = T::EXPECTED;
    fn from_value(value: &Value) -> Result<Self, ValueType> {
        match value {
            Value::Null => Ok(None),
            other => T::from_value(other).map(Some),
        }
    }
}

/// One result row: the statement's column names (shared by every row of one
/// result, so a row costs one allocation for its values) and the values.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    columns: Arc<[String]>,
    values: Vec<Value>,
}

impl Row {
    /// Builds a row; `values` must hold one value per column.
    pub fn new(columns: Arc<[String]>, values: Vec<Value>) -> Self {
        Row { columns, values }
    }

    /// The column names, in select order.
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// The raw values, in select order.
    pub fn values(&self) -> &[Value] {
        &self.values
    }

    /// Decodes the value at `index`.
    pub fn get<T: FromValue>(&self, index: usize) -> Result<T, StorageError> {
        let value = self.values.get(index).ok_or_else(|| StorageError::Decode {
            column: format!("#{index}"),
            expected: T::EXPECTED,
            found: "no such column".into(),
        })?;
        T::from_value(value).map_err(|found| StorageError::Decode {
            column: self
                .columns
                .get(index)
                .cloned()
                .unwrap_or_else(|| format!("#{index}")),
            expected: T::EXPECTED,
            found: found.to_string(),
        })
    }

    /// Decodes the value of the column called `name`.
    pub fn get_named<T: FromValue>(&self, name: &str) -> Result<T, StorageError> {
        match self.columns.iter().position(|c| c == name) {
            Some(index) => self.get(index),
            None => Err(StorageError::Decode {
                column: name.to_owned(),
                expected: T::EXPECTED,
                found: "no such column".into(),
            }),
        }
    }
}

/// Synchronous SQL over the object's own database.
///
/// Statements outside a transaction commit on their own. Inside
/// [`StorageExt::transaction_sync`](crate::StorageExt::transaction_sync) or
/// [`StorageExt::transaction`](crate::StorageExt::transaction) they join the
/// transaction. Implementations cache prepared statements, so callers pass
/// constant SQL text and vary only the parameters.
pub trait Sql {
    /// Runs one statement and returns the number of rows it changed.
    fn execute(&self, sql: &str, params: &[Value]) -> Result<usize, StorageError>;

    /// Runs one statement and returns every row it produced.
    fn query(&self, sql: &str, params: &[Value]) -> Result<Vec<Row>, StorageError>;

    /// Runs a script of several statements without parameters (migrations).
    fn execute_script(&self, sql: &str) -> Result<(), StorageError>;

    /// Runs one statement and returns its first row, if any.
    fn query_row(&self, sql: &str, params: &[Value]) -> Result<Option<Row>, StorageError> {
        Ok(self.query(sql, params)?.into_iter().next())
    }
}
