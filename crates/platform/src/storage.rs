//! Transactions, the object's one alarm, and storage errors.
//!
//! The trait methods take `dyn` closures so that a capability can hold the
//! storage as `&dyn Storage`; [`StorageExt`] puts typed results and errors on
//! top of them. A transaction body is synchronous on purpose: nothing else of
//! the object can run while it is open, so no other task's statement can join
//! it by accident.

use thiserror::Error;

use crate::{EpochMs, LocalBoxFuture, Sql, StorageLimits};

/// Why a storage call failed. Every variant is a definite failure of the
/// call; after a failed commit nothing of the transaction is visible.
#[derive(Debug, Clone, Error, PartialEq)]
#[non_exhaustive]
pub enum StorageError {
    /// The disk or the database reached its size limit (ENOSPC, SQLITE_FULL).
    #[error("storage is full: {message}")]
    Full { message: String },
    /// The database file is damaged or is not a database.
    #[error("storage is corrupt or unreadable: {message}")]
    Corrupt { message: String },
    /// The database could not be opened or read (permissions, I/O).
    #[error("storage is unavailable: {message}")]
    Unavailable { message: String },
    /// A constraint (primary key, unique, check, not null) rejected a write.
    #[error("constraint violated: {message}")]
    Constraint { message: String },
    /// The statement itself is wrong (syntax, unknown table or column).
    #[error("SQL error: {message}")]
    Sql { message: String },
    /// A stored value does not have the type the reader expects.
    #[error("column {column}: expected {expected}, found {found}")]
    Decode {
        column: String,
        expected: &'static str,
        found: String,
    },
    /// The alarm time is not a non-negative safe integer of milliseconds.
    #[error("alarm time {at_ms} must be a non-negative safe integer of milliseconds")]
    InvalidAlarmTime { at_ms: i64 },
    /// An integer parameter is outside ±(2^53 - 1). Platforms whose values
    /// travel as JavaScript numbers (Cloudflare) cannot store it exactly, so
    /// they refuse it instead of storing a rounded REAL.
    #[error(
        "integer parameter {value} is outside the safe range ±9007199254740991 that every platform stores exactly"
    )]
    UnsafeInteger { value: i64 },
    /// A statement beyond one of the platform's [`StorageLimits`]: `limit`
    /// names the field, `value` is what the statement carried. Nothing was
    /// bound or run.
    #[error("the statement's {value} is above the platform's {limit} of {max}")]
    LimitExceeded {
        limit: &'static str,
        value: usize,
        max: usize,
    },
}

/// Returned by a transaction body to roll the transaction back. The body's
/// own error travels beside it (see [`StorageExt`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rollback;

/// SQL inside [`StorageExt::transaction`], plus the object's alarm, so that rows
/// and alarm commit or roll back together.
pub trait Transaction: Sql {
    /// The alarm as it will be after this transaction commits.
    fn get_alarm(&self) -> Result<Option<EpochMs>, StorageError>;
    /// Sets the alarm (replacing any other) when this transaction commits.
    fn set_alarm(&self, at_ms: EpochMs) -> Result<(), StorageError>;
    /// Clears the alarm when this transaction commits.
    fn delete_alarm(&self) -> Result<(), StorageError>;
}

/// The object's storage: its SQL database and its one alarm.
///
/// An object has exactly one alarm. Setting it replaces the previous time; a
/// time in the past fires at once. While the object's alarm handler runs, the
/// alarm that fired is no longer reported by [`Storage::get_alarm`]; if the
/// handler sets a new one, that one stays.
pub trait Storage: Sql {
    /// Runs `body` in one atomic transaction without touching the alarm.
    /// `Err(Rollback)` from the body rolls back and is returned as `Ok(false)`;
    /// `Ok(true)` means the body succeeded and the transaction committed.
    fn transaction_sync_dyn(
        &self,
        body: &mut dyn FnMut(&dyn Sql) -> Result<(), Rollback>,
    ) -> Result<bool, StorageError>;

    /// Runs `body` in one atomic transaction in which the alarm can be read
    /// and changed; rows and alarm commit or roll back together. Returns like
    /// [`Storage::transaction_sync_dyn`].
    fn transaction_dyn<'a>(
        &'a self,
        body: &'a mut dyn FnMut(&dyn Transaction) -> Result<(), Rollback>,
    ) -> LocalBoxFuture<'a, Result<bool, StorageError>>;

    /// The alarm time, if one is set.
    fn get_alarm(&self) -> LocalBoxFuture<'_, Result<Option<EpochMs>, StorageError>>;
    /// Sets the alarm, replacing any other.
    fn set_alarm(&self, at_ms: EpochMs) -> LocalBoxFuture<'_, Result<(), StorageError>>;
    /// Clears the alarm.
    fn delete_alarm(&self) -> LocalBoxFuture<'_, Result<(), StorageError>>;

    /// What one statement may carry here. Every statement this storage runs
    /// is checked against it ([`check_statement`](crate::check_statement)),
    /// and the capabilities' builders refuse settings the limits rule out.
    fn limits(&self) -> StorageLimits {
        StorageLimits::SQLITE
    }
}

/// Typed transactions over any [`Storage`]: the body returns its own
/// `Result<T, E>`, an `Err` rolls back and is returned as is, and a failed
/// commit becomes `E::from(StorageError)`.
pub trait StorageExt: Storage {
    /// [`Storage::transaction_sync_dyn`] with a typed body.
    fn transaction_sync<T, E>(&self, body: impl FnOnce(&dyn Sql) -> Result<T, E>) -> Result<T, E>
    where
        E: From<StorageError>,
    {
        let mut body = Some(body);
        let mut outcome: Option<Result<T, E>> = None;
        let committed = self.transaction_sync_dyn(&mut |sql| {
            // A platform that retries a transaction body would call it again;
            // a second call finds the body gone and rolls back.
            let body = body.take().ok_or(Rollback)?;
            record(&mut outcome, body(sql))
        });
        finish(committed, outcome)
    }

    /// [`Storage::transaction_dyn`] with a typed body.
    fn transaction<'a, T: 'a, E>(
        &'a self,
        body: impl FnOnce(&dyn Transaction) -> Result<T, E> + 'a,
    ) -> LocalBoxFuture<'a, Result<T, E>>
    where
        E: From<StorageError> + 'a,
    {
        Box::pin(async move {
            let mut body = Some(body);
            let mut outcome: Option<Result<T, E>> = None;
            let committed = {
                let mut run = |txn: &dyn Transaction| {
                    let body = body.take().ok_or(Rollback)?;
                    record(&mut outcome, body(txn))
                };
                self.transaction_dyn(&mut run).await
            };
            finish(committed, outcome)
        })
    }
}

impl<S: Storage + ?Sized> StorageExt for S {}

fn record<T, E>(outcome: &mut Option<Result<T, E>>, result: Result<T, E>) -> Result<(), Rollback> {
    let failed = result.is_err();
    *outcome = Some(result);
    if failed { Err(Rollback) } else { Ok(()) }
}

fn finish<T, E: From<StorageError>>(
    committed: Result<bool, StorageError>,
    outcome: Option<Result<T, E>>,
) -> Result<T, E> {
    match (committed, outcome) {
        // The body failed: its error wins over whatever the rollback said.
        (_, Some(Err(error))) => Err(error),
        (Ok(true), Some(Ok(value))) => Ok(value),
        (Err(error), _) => Err(error.into()),
        (Ok(_), _) => Err(StorageError::Sql {
            message: "transaction body did not run".into(),
        }
        .into()),
    }
}
