//! A producer's trace context, stored with the work it registers, so that
//! every attempt or delivery of that work (even after a crash, in another
//! process) can be linked to the request that caused it.
//!
//! `tracing` spans live in one process, so what travels has to be text the
//! application chooses: a [`TraceCapture`] runs when an operation is
//! registered or a fanout message accepted, inside the producer's span, and
//! returns the context to keep, typically a W3C `traceparent` read from
//! OpenTelemetry (`tracing-opentelemetry`'s `OpenTelemetrySpanExt`), or
//! [`current_span`]'s process-local span reference when no exporter is
//! used. Nothing is captured unless a capture is configured
//! (`OperationsBuilder::trace_context`, `FanoutBuilder::trace_context`).
//!
//! The context is stored as a memo of the record (key
//! [`TRACE_CONTEXT_MEMO_KEY`]) in the registration's own transaction, so
//! it needs no table of its own, costs nothing when no capture is
//! configured, and is deleted with the record's memos when the record ends.
//! Each attempt reads it back: the handler gets it
//! (`DurableCall::trace_context`, `FanoutMessage::trace_context`) to
//! continue the trace, and the `attempt` span and the delivery event record
//! it as their `producer` field.
//!
//! A capture that returns more than [`MAX_TRACE_CONTEXT_BYTES`] is ignored
//! (with a warning): telemetry never fails the work it describes.

use std::rc::Rc;

use durability_platform::{EpochMs, Sql, StorageError};

use crate::codec;
use crate::record::DurableTable;

/// Returns the producer's trace context, or `None` to store nothing.
pub type TraceCapture = Rc<dyn Fn() -> Option<String>>;

/// The memo key the context is stored under. Memo keys starting with
/// `durability.` are reserved for the library.
pub const TRACE_CONTEXT_MEMO_KEY: &str = "durability.trace_context";

/// The longest context kept, in bytes (a `traceparent` is 55, with
/// `tracestate` a few hundred).
pub const MAX_TRACE_CONTEXT_BYTES: usize = 1_024;

/// A capture of the current `tracing` span as `<name>#<id>`: meaningful in
/// the producing process's logs only (span ids are reused after a span
/// closes); use an OpenTelemetry `traceparent` to link across processes.
pub fn current_span() -> TraceCapture {
    Rc::new(|| {
        let span = tracing::Span::current();
        let id = span.id()?;
        let name = span.metadata().map_or("span", |m| m.name());
        Some(format!("{name}#{}", id.into_u64()))
    })
}

/// Runs `capture`, if any, dropping an oversized context.
pub(crate) fn capture(capture: Option<&TraceCapture>) -> Option<String> {
    let context = capture?()?;
    if context.len() > MAX_TRACE_CONTEXT_BYTES {
        tracing::warn!(
            event = "durability.trace_context.too_long",
            bytes = context.len(),
            max = MAX_TRACE_CONTEXT_BYTES,
            "trace context not stored: longer than the limit"
        );
        return None;
    }
    Some(context)
}

/// Stores `context` for the record `key` of `table` (generation
/// `generation`), inside the registration's transaction.
pub(crate) fn store(
    sql: &dyn Sql,
    table: DurableTable,
    key: &str,
    generation: &str,
    now: EpochMs,
    context: &str,
) -> Result<(), StorageError> {
    let value = codec::encode(context).map_err(|e| StorageError::Unavailable {
        message: e.to_string(),
    })?;
    sql.execute(
        "INSERT INTO durability_memos \
         (record_table, record_key, memo_key, generation_id, value, created_at) \
         VALUES (?, ?, ?, ?, ?, ?) \
         ON CONFLICT (record_table, record_key, memo_key) DO UPDATE SET \
         generation_id = excluded.generation_id, value = excluded.value, \
         created_at = excluded.created_at",
        &[
            table.name.into(),
            key.into(),
            TRACE_CONTEXT_MEMO_KEY.into(),
            generation.into(),
            value.into(),
            now.into(),
        ],
    )?;
    Ok(())
}

/// The context stored for the record `key` of `table` at `generation`, if
/// any (a context of another generation belongs to older work).
pub(crate) fn load(
    sql: &dyn Sql,
    table: DurableTable,
    key: &str,
    generation: &str,
) -> Result<Option<String>, StorageError> {
    let row = sql.query_row(
        "SELECT value FROM durability_memos \
         WHERE record_table = ? AND record_key = ? AND memo_key = ? AND generation_id = ?",
        &[
            table.name.into(),
            key.into(),
            TRACE_CONTEXT_MEMO_KEY.into(),
            generation.into(),
        ],
    )?;
    let Some(row) = row else { return Ok(None) };
    let text: String = row.get(0)?;
    Ok(codec::decode_as::<String>(&text).ok())
}
