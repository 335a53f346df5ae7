//! The contract's [`Storage`] over a Durable Object's `ctx.storage`: SQL
//! through `sql.exec`, atomic bodies through `transactionSync`, and the one
//! alarm through `getAlarm`/`setAlarm`/`deleteAlarm`.
//!
//! What the runtime does not give directly, and how it is made up here:
//! - workers-rs binds only the old key-value `transaction`; the SQL
//!   `transactionSync` is bound below. A body's [`Rollback`] becomes a thrown
//!   marker object, which `transactionSync` answers by rolling back.
//! - `setAlarm`/`deleteAlarm` called inside `transactionSync` commit or roll
//!   back with the rows, so the contract's alarm-aware transaction is the same
//!   `transactionSync` with the alarm calls made inside it.
//! - `getAlarm` is a Promise, but [`Transaction::get_alarm`] is synchronous.
//!   The alarm is loaded once when the object starts (under
//!   `blockConcurrencyWhile`, so no event sees it unloaded) and kept current
//!   by every set and delete made through this storage; at the start of an
//!   alarm delivery [`CloudflareStorage::refresh_alarm`] reloads it, since the
//!   runtime clears the alarm that fired.
//! - `rowsWritten` counts index writes too, so [`Sql::execute`] counts the
//!   rows SQLite's `changes()` would: from the write's own `RETURNING 1`
//!   rows where that is certain (`crate::changes`), else with a second
//!   statement, `SELECT changes()`.
//! - Integers travel as JavaScript numbers: see [`crate::value`].

use std::cell::{Cell, RefCell};

use durability_platform::{
    EpochMs, LocalBoxFuture, MAX_SAFE_INTEGER, Rollback, Row, Sql, Storage, StorageError,
    StorageLimits, Transaction, Value, check_statement,
};
use worker::js_sys::{self, Array, Object, Uint8Array};
use worker::wasm_bindgen::{self, JsCast, JsValue, prelude::wasm_bindgen};
use worker::wasm_bindgen_futures::{JsFuture, spawn_local};
use worker::worker_sys::types::{DurableObjectStorage, SqlStorage};

use crate::changes::returning_one;
use crate::value::{classify_error, integer_to_number, number_to_value};

#[wasm_bindgen(wasm_bindgen = wasm_bindgen)]
extern "C" {
    /// `ctx.storage`, seen for the one method workers-rs does not bind.
    #[wasm_bindgen(extends = Object)]
    type SqlTransactions;

    /// `ctx.storage.transactionSync(fn)`: runs `fn` in one SQLite
    /// transaction, rolls back when it throws and rethrows.
    #[wasm_bindgen(method, catch, js_name = transactionSync)]
    fn transaction_sync(
        this: &SqlTransactions,
        body: &mut dyn FnMut() -> Result<JsValue, JsValue>,
    ) -> Result<JsValue, JsValue>;
}

/// What a [`CloudflareStorage`] has sent to the runtime since the object
/// started, for a benchmark to divide by the items it processed. Each field
/// is one `Cell` update on its path; reading them costs nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SqlCounts {
    /// `sql.exec` calls: every statement of the capabilities, plus the
    /// `SELECT changes()` after an [`Sql::execute`] whose statement could
    /// not count its own rows.
    pub statements: u64,
    /// Parameters bound to those statements (one wasm-to-JavaScript call each).
    pub parameters: u64,
    /// Rows [`Sql::query`] read back (one call per row, plus one per cell).
    pub rows: u64,
    /// `transactionSync` bodies run.
    pub transactions: u64,
}

/// A Durable Object's storage as the contract sees it.
///
/// Created once per object instance by [`CloudflareStorage::load`]; the
/// capabilities share it through the context.
pub struct CloudflareStorage {
    storage: DurableObjectStorage,
    transactions: SqlTransactions,
    sql: SqlStorage,
    /// The alarm as committed, kept current by this storage's own calls.
    alarm: Cell<Option<EpochMs>>,
    /// Set while a `transactionSync` body runs, so that a nested call fails
    /// with a typed error instead of a runtime exception.
    in_transaction: Cell<bool>,
    counts: Cell<SqlCounts>,
}

impl CloudflareStorage {
    /// Wraps `storage` and loads its alarm. Call it under
    /// `blockConcurrencyWhile` (the object host does) so that no event runs
    /// before the alarm is known.
    pub async fn load(storage: DurableObjectStorage) -> Result<Self, StorageError> {
        let sql = storage.sql();
        let transactions = JsValue::from(&storage).unchecked_into();
        let this = CloudflareStorage {
            storage,
            transactions,
            sql,
            alarm: Cell::new(None),
            in_transaction: Cell::new(false),
            counts: Cell::new(SqlCounts::default()),
        };
        this.refresh_alarm().await?;
        Ok(this)
    }

    /// Reads the alarm from the runtime again. The object host calls it when
    /// an alarm is delivered: the runtime has cleared the alarm that fired.
    pub async fn refresh_alarm(&self) -> Result<(), StorageError> {
        let promise = self
            .storage
            .get_alarm(Object::new())
            .map_err(|e| unavailable("getAlarm", &e))?;
        let value = JsFuture::from(promise)
            .await
            .map_err(|e| unavailable("getAlarm", &e))?;
        self.alarm.set(alarm_from_js(&value)?);
        Ok(())
    }

    /// What this storage has sent to the runtime so far.
    pub fn counts(&self) -> SqlCounts {
        self.counts.get()
    }

    fn count(&self, update: impl FnOnce(&mut SqlCounts)) {
        let mut counts = self.counts.get();
        update(&mut counts);
        self.counts.set(counts);
    }

    fn exec(
        &self,
        sql: &str,
        params: &[Value],
    ) -> Result<worker::worker_sys::types::SqlStorageCursor, StorageError> {
        // A statement the runtime would refuse with an exception is refused
        // here with a typed error, before anything crosses to JavaScript.
        check_statement(&StorageLimits::CLOUDFLARE, sql, params)?;
        let bindings = Array::new();
        for value in params {
            bindings.push(&value_to_js(value)?);
        }
        self.count(|c| {
            c.statements += 1;
            c.parameters += params.len() as u64;
        });
        self.sql
            .exec(sql, bindings)
            .map_err(|e| classify_error(js_message(&e)))
    }

    /// Runs `body` inside `transactionSync`; `Ok(false)` when it rolled back.
    fn run_transaction(
        &self,
        body: &mut dyn FnMut() -> Result<(), Rollback>,
    ) -> Result<bool, StorageError> {
        if self.in_transaction.get() {
            return Err(StorageError::Sql {
                message: "a transaction cannot be opened inside another transaction".into(),
            });
        }
        let marker: JsValue = Object::new().into();
        let thrown = marker.clone();
        self.in_transaction.set(true);
        self.count(|c| c.transactions += 1);
        let outcome = self.transactions.transaction_sync(&mut || match body() {
            Ok(()) => Ok(JsValue::UNDEFINED),
            Err(Rollback) => Err(thrown.clone()),
        });
        self.in_transaction.set(false);
        match outcome {
            Ok(_) => Ok(true),
            Err(error) if Object::is(&error, &marker) => Ok(false),
            Err(error) => Err(classify_error(js_message(&error))),
        }
    }

    async fn alarm_call(
        &self,
        name: &str,
        promise: Result<js_sys::Promise, JsValue>,
    ) -> Result<(), StorageError> {
        let promise = promise.map_err(|e| unavailable(name, &e))?;
        JsFuture::from(promise)
            .await
            .map(|_| ())
            .map_err(|e| unavailable(name, &e))
    }
}

impl Sql for CloudflareStorage {
    fn execute(&self, sql: &str, params: &[Value]) -> Result<usize, StorageError> {
        // Only where the longer text stays within the statement limit, so
        // a statement the caller may send is never refused for our suffix.
        let counting = returning_one(sql)
            .filter(|counting| counting.len() <= StorageLimits::CLOUDFLARE.max_statement_bytes);
        if let Some(counting) = counting {
            // One row per changed row, read in one call: the count without
            // a second statement.
            let cursor = self.exec(&counting, params)?;
            return Ok(cursor.to_array().length() as usize);
        }
        let cursor = self.exec(sql, params)?;
        // Run the statement to its end: a cursor left open may not have
        // stepped through every row it writes.
        let _ = cursor.to_array();
        // `rowsWritten` also counts index rows; `changes()` is SQLite's own
        // count of the rows the statement changed.
        let changes = self.exec("SELECT changes()", &[])?;
        let row = changes
            .raw()
            .next()
            .map_err(|e| classify_error(js_message(&e)))?;
        let value = Array::from(&row.value()).get(0);
        value
            .as_f64()
            .and_then(|n| match number_to_value(n) {
                Value::Integer(n) => usize::try_from(n).ok(),
                _ => None,
            })
            .ok_or_else(|| StorageError::Decode {
                column: "changes()".into(),
                expected: "non-negative INTEGER",
                found: format!("{value:?}"),
            })
    }

    fn query(&self, sql: &str, params: &[Value]) -> Result<Vec<Row>, StorageError> {
        let cursor = self.exec(sql, params)?;
        let columns: std::sync::Arc<[String]> = cursor
            .column_names()
            .iter()
            .map(|name| name.as_string().unwrap_or_default())
            .collect::<Vec<_>>()
            .into();
        let mut rows = Vec::new();
        let raw = cursor.raw();
        loop {
            let next = raw.next().map_err(|e| classify_error(js_message(&e)))?;
            if next.done() {
                break;
            }
            let cells = Array::from(&next.value());
            let mut values = Vec::with_capacity(columns.len());
            for (index, cell) in cells.iter().enumerate() {
                values.push(value_from_js(&cell).map_err(|found| {
                    StorageError::Decode {
                        column: columns
                            .get(index)
                            .cloned()
                            .unwrap_or_else(|| format!("#{index}")),
                        expected: "a SQLite value",
                        found,
                    }
                })?);
            }
            rows.push(Row::new(std::sync::Arc::clone(&columns), values));
        }
        self.count(|c| c.rows += rows.len() as u64);
        Ok(rows)
    }

    fn execute_script(&self, sql: &str) -> Result<(), StorageError> {
        // `exec` without bindings runs every statement of the script.
        let cursor = self.exec(sql, &[])?;
        let _ = cursor.to_array();
        Ok(())
    }
}

impl Storage for CloudflareStorage {
    fn transaction_sync_dyn(
        &self,
        body: &mut dyn FnMut(&dyn Sql) -> Result<(), Rollback>,
    ) -> Result<bool, StorageError> {
        self.run_transaction(&mut || body(self))
    }

    fn transaction_dyn<'a>(
        &'a self,
        body: &'a mut dyn FnMut(&dyn Transaction) -> Result<(), Rollback>,
    ) -> LocalBoxFuture<'a, Result<bool, StorageError>> {
        Box::pin(async move {
            let txn = AlarmTransaction {
                storage: self,
                alarm: Cell::new(self.alarm.get()),
                calls: RefCell::new(Vec::new()),
            };
            let committed = self.run_transaction(&mut || body(&txn));
            let calls = txn.calls.into_inner();
            match committed {
                Ok(true) => {
                    self.alarm.set(txn.alarm.get());
                    // The alarm writes committed with the rows; their
                    // promises only report the outcome.
                    for (name, promise) in calls {
                        self.alarm_call(name, Ok(promise)).await?;
                    }
                    Ok(true)
                }
                other => {
                    // Rolled back with the rows: observe the promises so a
                    // rejection is not reported as unhandled.
                    for (_, promise) in calls {
                        spawn_local(async move {
                            let _ = JsFuture::from(promise).await;
                        });
                    }
                    other
                }
            }
        })
    }

    fn get_alarm(&self) -> LocalBoxFuture<'_, Result<Option<EpochMs>, StorageError>> {
        Box::pin(async move { Ok(self.alarm.get()) })
    }

    fn set_alarm(&self, at_ms: EpochMs) -> LocalBoxFuture<'_, Result<(), StorageError>> {
        Box::pin(async move {
            let date = alarm_date(at_ms)?;
            self.alarm_call("setAlarm", self.storage.set_alarm(date, Object::new()))
                .await?;
            self.alarm.set(Some(at_ms));
            Ok(())
        })
    }

    fn delete_alarm(&self) -> LocalBoxFuture<'_, Result<(), StorageError>> {
        Box::pin(async move {
            self.alarm_call("deleteAlarm", self.storage.delete_alarm(Object::new()))
                .await?;
            self.alarm.set(None);
            Ok(())
        })
    }

    fn limits(&self) -> StorageLimits {
        StorageLimits::CLOUDFLARE
    }
}

/// The view a body of [`StorageExt::transaction`](durability_platform::StorageExt::transaction)
/// gets: the same SQL, plus the alarm as this transaction leaves it.
struct AlarmTransaction<'a> {
    storage: &'a CloudflareStorage,
    alarm: Cell<Option<EpochMs>>,
    /// `setAlarm`/`deleteAlarm` promises, awaited after the commit.
    calls: RefCell<Vec<(&'static str, js_sys::Promise)>>,
}

impl Sql for AlarmTransaction<'_> {
    fn execute(&self, sql: &str, params: &[Value]) -> Result<usize, StorageError> {
        self.storage.execute(sql, params)
    }
    fn query(&self, sql: &str, params: &[Value]) -> Result<Vec<Row>, StorageError> {
        self.storage.query(sql, params)
    }
    fn execute_script(&self, sql: &str) -> Result<(), StorageError> {
        self.storage.execute_script(sql)
    }
}

impl Transaction for AlarmTransaction<'_> {
    fn get_alarm(&self) -> Result<Option<EpochMs>, StorageError> {
        Ok(self.alarm.get())
    }

    fn set_alarm(&self, at_ms: EpochMs) -> Result<(), StorageError> {
        let date = alarm_date(at_ms)?;
        let promise = self
            .storage
            .storage
            .set_alarm(date, Object::new())
            .map_err(|e| unavailable("setAlarm", &e))?;
        self.calls.borrow_mut().push(("setAlarm", promise));
        self.alarm.set(Some(at_ms));
        Ok(())
    }

    fn delete_alarm(&self) -> Result<(), StorageError> {
        let promise = self
            .storage
            .storage
            .delete_alarm(Object::new())
            .map_err(|e| unavailable("deleteAlarm", &e))?;
        self.calls.borrow_mut().push(("deleteAlarm", promise));
        self.alarm.set(None);
        Ok(())
    }
}

fn alarm_date(at_ms: EpochMs) -> Result<js_sys::Date, StorageError> {
    if !(0..=MAX_SAFE_INTEGER).contains(&at_ms) {
        return Err(StorageError::InvalidAlarmTime { at_ms });
    }
    let ms = integer_to_number(at_ms)?;
    Ok(js_sys::Date::new(&JsValue::from_f64(ms)))
}

fn alarm_from_js(value: &JsValue) -> Result<Option<EpochMs>, StorageError> {
    if value.is_null() || value.is_undefined() {
        return Ok(None);
    }
    match value.as_f64().map(number_to_value) {
        Some(Value::Integer(ms)) => Ok(Some(ms)),
        _ => Err(StorageError::Decode {
            column: "getAlarm()".into(),
            expected: "milliseconds or null",
            found: format!("{value:?}"),
        }),
    }
}

fn value_to_js(value: &Value) -> Result<JsValue, StorageError> {
    Ok(match value {
        Value::Null => JsValue::NULL,
        Value::Integer(v) => JsValue::from_f64(integer_to_number(*v)?),
        Value::Real(v) => JsValue::from_f64(*v),
        Value::Text(v) => JsValue::from_str(v),
        // A copy in a buffer of its own: `exec` binds an ArrayBuffer as a BLOB.
        Value::Blob(v) => Uint8Array::from(v.as_slice()).buffer().into(),
    })
}

fn value_from_js(value: &JsValue) -> Result<Value, String> {
    if value.is_null() || value.is_undefined() {
        Ok(Value::Null)
    } else if let Some(number) = value.as_f64() {
        Ok(number_to_value(number))
    } else if let Some(text) = value.as_string() {
        Ok(Value::Text(text))
    } else if let Some(buffer) = value.dyn_ref::<js_sys::ArrayBuffer>() {
        Ok(Value::Blob(Uint8Array::new(buffer).to_vec()))
    } else if let Some(array) = value.dyn_ref::<Uint8Array>() {
        Ok(Value::Blob(array.to_vec()))
    } else if value.is_bigint() {
        i64::try_from(value.clone())
            .map(Value::Integer)
            .map_err(|_| format!("{value:?}"))
    } else {
        Err(format!("{value:?}"))
    }
}

/// The message of a thrown JavaScript value.
pub(crate) fn js_message(error: &JsValue) -> String {
    error
        .dyn_ref::<js_sys::Error>()
        .map(|e| String::from(e.message()))
        .or_else(|| error.as_string())
        .unwrap_or_else(|| format!("{error:?}"))
}

fn unavailable(call: &str, error: &JsValue) -> StorageError {
    StorageError::Unavailable {
        message: format!("{call}: {}", js_message(error)),
    }
}
