//! Cold storage: where trimmed records go when they must stay readable.
//!
//! The log never talks to a disk, a bucket or a network itself (this crate
//! builds for `wasm32-unknown-unknown`); the application hands it a
//! [`ColdStorage`] with two async calls, `write(segment) -> locator` and
//! `read(locator)`. A [`Segment`] is a run of consecutive records, at most
//! `max_batch_size` of them, serialized in the reference library's shape
//! (`{"firstOffset", "lastOffset", "records": [{"offset",
//! "deduplicationKey", "body", "appendedAt"}]}`).
//!
//! The order that keeps every record readable through a crash is the log's
//! job (write, then index, then delete; see [`Log::trim`](super::Log::trim)).
//! What it needs from an implementation:
//! - `write` may be called again for the same records after a crash between
//!   the write and the index (at least once). Writing the same segment twice
//!   must be harmless. Two segments may share a first offset and differ in
//!   their last offset (the retention changed between two attempts), so an
//!   implementation that names objects by offset names them by both.
//! - A locator must keep addressing exactly the segment it was returned for.
//! - `read` returns `Ok(None)` for a segment that is gone (deleted by a
//!   lifecycle rule, say) and `Err` only for a failure to find out; the log
//!   turns the first into [`LogError::Truncated`](super::LogError::Truncated)
//!   and passes the second on.
//!
//! This module owns the segment format and the trait; it touches no storage.

use std::fmt;

use durability_platform::{EpochMs, LocalBoxFuture};
use serde::{Deserialize, Serialize};

/// A run of consecutive records written to cold storage as one object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Segment {
    /// The offset of the first record.
    pub first_offset: u64,
    /// The offset of the last record.
    pub last_offset: u64,
    /// The records, ascending by offset, one for each offset in between.
    pub records: Vec<SegmentRecord>,
}

/// One record inside a [`Segment`]: the body as plain JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SegmentRecord {
    /// The record's offset.
    pub offset: u64,
    /// The record's deduplication key (generated when the append had none).
    pub deduplication_key: String,
    /// The record's body.
    pub body: serde_json::Value,
    /// When it was appended (epoch ms).
    pub appended_at: EpochMs,
}

impl Segment {
    /// The segment as JSON bytes, for implementations that store bytes.
    pub fn to_json(&self) -> Result<Vec<u8>, ColdError> {
        serde_json::to_vec(self).map_err(ColdError::new)
    }

    /// A segment from the bytes [`Segment::to_json`] produced.
    pub fn from_json(bytes: &[u8]) -> Result<Segment, ColdError> {
        serde_json::from_slice(bytes).map_err(ColdError::new)
    }
}

/// A failure of cold storage (I/O, network, a malformed object). The log
/// passes it to the caller unchanged: it says nothing about whether the
/// records are gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColdError {
    message: String,
}

impl ColdError {
    /// A failure described by `message`.
    pub fn new(message: impl fmt::Display) -> Self {
        ColdError {
            message: message.to_string(),
        }
    }

    /// What failed.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for ColdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ColdError {}

impl From<std::io::Error> for ColdError {
    fn from(error: std::io::Error) -> Self {
        ColdError::new(error)
    }
}

/// Where flushed segments live: an object store, a directory, another
/// database. Implemented by the application; see the module docs for the
/// contract.
///
/// ```
/// use std::cell::RefCell;
/// use std::collections::BTreeMap;
/// use durability::log::{ColdError, ColdStorage, Segment};
/// use durability::platform::LocalBoxFuture;
///
/// /// Keeps segments in memory (a test double; real ones write somewhere durable).
/// #[derive(Default)]
/// struct InMemory(RefCell<BTreeMap<String, Vec<u8>>>);
///
/// impl ColdStorage for InMemory {
///     fn write<'a>(&'a self, segment: &'a Segment) -> LocalBoxFuture<'a, Result<String, ColdError>> {
///         Box::pin(async move {
///             let locator = format!("{}-{}", segment.first_offset, segment.last_offset);
///             self.0.borrow_mut().insert(locator.clone(), segment.to_json()?);
///             Ok(locator)
///         })
///     }
///     fn read<'a>(&'a self, locator: &'a str) -> LocalBoxFuture<'a, Result<Option<Segment>, ColdError>> {
///         Box::pin(async move {
///             self.0.borrow().get(locator).map(|bytes| Segment::from_json(bytes)).transpose()
///         })
///     }
/// }
/// ```
pub trait ColdStorage {
    /// Stores `segment` and returns a non-empty locator that [`read`]
    /// accepts. May be called again with the same records after a crash.
    ///
    /// [`read`]: ColdStorage::read
    fn write<'a>(&'a self, segment: &'a Segment) -> LocalBoxFuture<'a, Result<String, ColdError>>;

    /// The segment stored under `locator`, or `None` if it is gone.
    fn read<'a>(
        &'a self,
        locator: &'a str,
    ) -> LocalBoxFuture<'a, Result<Option<Segment>, ColdError>>;
}
