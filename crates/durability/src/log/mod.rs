//! The retained log: an append-only, offset-addressed record log on one
//! object, with consumer cursors, optional consumer leases, retention and
//! cold segments (queues.md §5).
//!
//! Unlike fanout, records stay after they are read. Consumers pull pages
//! with [`Log::read`], keep their own cursors with [`Log::commit`] (which
//! only moves forward), and may rewind by reading from an earlier offset.
//! Records leave the object only through [`Log::trim`]: deleted, or flushed
//! to [`ColdStorage`] where [`Log::read`] still finds them.
//!
//! ```
//! use std::rc::Rc;
//! use durability::log::{AppendRecord, Log, Read};
//! use durability::Scheduler;
//! use durability_host::{Host, DurableObject, ObjectContext};
//!
//! struct Partition(ObjectContext);
//! impl DurableObject for Partition {}
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! # tokio::task::LocalSet::new().run_until(async {
//! # let dir = tempfile::tempdir().unwrap();
//! let host = Host::builder(dir.path()).threads(0).build().unwrap();
//! let partitions = host.namespace("partitions", |ctx| Ok(Partition(ctx))).unwrap();
//! let page = partitions.stub("orders:0").unwrap().call(|p: Rc<Partition>| async move {
//!     let scheduler = Scheduler::new(p.0.clone().into_dyn()).unwrap();
//!     let log = Log::<String>::builder(&scheduler).build().unwrap();
//!     let appended = log.append(vec![
//!         AppendRecord::new("created".to_owned()),
//!         AppendRecord::keyed("order-7:paid", "paid".to_owned()),
//!     ]).await.unwrap();
//!     assert_eq!(appended.offsets(), Some(&[0, 1][..]));
//!     let page = log.read(Read::from_offset(0)).await.unwrap();
//!     log.commit("billing", page.next_offset).await.unwrap();
//!     page.records.into_iter().map(|r| r.body).collect::<Vec<_>>()
//! }).await.unwrap();
//! assert_eq!(page, ["created", "paid"]);
//! # host.shutdown().await;
//! # }).await;
//! # });
//! ```
//!
//! Decisions where the reference is silent or surprising:
//! - **A repeated key with a different body is a conflict.** The reference
//!   returns the old offset whatever the body; here the append is rejected
//!   with [`AppendRejection::KeyConflict`] (or [`AppendRejection::KeyRepeated`]
//!   inside one batch) and nothing is written. The same key with the same
//!   stored JSON returns the original offset. Deduplication lasts while the
//!   record is hot; after a trim the key is free again.
//! - **A body that is not JSON is a rejection** (nothing is written), like
//!   fanout; `Err` is kept for storage and cold-storage uncertainty.
//! - **Cold holes are truncation.** A segment the index outlived, or one that
//!   holds fewer records than indexed, makes [`Log::read`] fail with
//!   [`LogError::Truncated`] at the first missing offset, whose `oldest` is
//!   where reading can resume. The reference would silently jump to the end.
//! - **A record that does not decode never blocks the others.** A stored
//!   record that no longer decodes into `B` (written before a change of the
//!   body type, or damaged) ends the page before it: a read that starts
//!   below it returns the records up to it, with `next_offset` at it. A read
//!   (or a lease) that starts exactly at it fails with [`LogError::Decode`]
//!   naming its offset, and nothing else. The consumer decides: skip it by
//!   reading from `offset + 1` and committing past it (leased consumers
//!   skip it with [`Log::commit`] too), or read it with a wider body type
//!   (`serde_json::Value`) to migrate it. With cold storage, a hot record
//!   whose stored text is not the codec's (damage) cannot go into a
//!   segment: a trim moves the records before it and stops there with
//!   [`LogError::Decode`] naming it (logged as
//!   `durability.log.trim_blocked`); until its row is repaired, the hot
//!   table keeps it and everything after it. Appends refuse anything the
//!   decoder could not read back ([`crate::codec::MAX_NESTING_DEPTH`]), so
//!   only a type change or damage produces such a record. A leased range
//!   is allocated only over records that decode; if one of its records
//!   stops decoding later (damage), the range is skipped as poison when an
//!   `on_poison` hook is configured; without one, handing it out again fails
//!   with the same error until the consumer commits past the range.
//! - **A commit cannot pass the end of the log** ([`LogError::CommitBeyondEnd`]):
//!   it would make the consumer skip records appended later.
//! - The log registers itself with the scheduler only to claim its tables
//!   (a second log on the same object is refused); it never has due work.
//! - The reference's `(appended_at, offset)` index is not created: no query
//!   uses it.
//! - A record appended without a key gets `<random instance id>:<offset in
//!   hex>` rather than a UUID of its own: just as unique, and ascending, so
//!   the UNIQUE key index grows at its end instead of taking a random insert
//!   per record.
//! - [`Log::forget_cold_before`] returns the forgotten segments (with their
//!   locators), not only their count, so the caller can delete the objects.
//!
//! Owns the `durability_log_*` tables; all their SQL is in the `store`
//! submodule.

mod cold;
mod leases;
mod retention;
mod store;

pub use cold::{ColdError, ColdStorage, Segment, SegmentRecord};
pub use leases::{
    DEFAULT_LEASE, DEFAULT_MAX_PARALLELISM, Lease, Leases, MAX_PARALLELISM, PoisonHook,
    PoisonedRange,
};
pub use retention::{MAX_LOG_BYTES, Retention};

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::rc::Rc;

use durability_platform::{AlarmInfo, EpochMs, LocalBoxFuture, Sql, StorageError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use thiserror::Error;

use crate::codec::{self, CodecError};
use crate::error::{DurabilityError, SerializedError};
use crate::limits::{self, LimitError};
use crate::load::{Direction, Load, LoadSnapshot};
use crate::migrations::{
    self, LOG_CAPABILITY, LOG_LEASES_CAPABILITY, LOG_LEASES_MIGRATIONS, LOG_MIGRATIONS,
    MigrationReport, MigrationTarget,
};
use crate::record::DurableTable;
use crate::scheduler::{Engine, Participant, Scheduler};

use leases::LeaseConfig;
use retention::Limits;
use store::SegmentRow;

/// The hot record table, the name under which the log claims its place on
/// the scheduler.
pub const LOG_RECORDS: DurableTable = DurableTable {
    name: "durability_log_records",
    key: "\"offset\"",
};

/// Default largest append batch, read page and cold segment, in records.
pub const DEFAULT_MAX_BATCH_SIZE: u32 = 100;

/// The largest offset the log hands out or accepts: 2^53 - 1, so offsets
/// stay exact in the JavaScript reference library.
pub const MAX_OFFSET: u64 = 9_007_199_254_740_991;

/// The name of a rejected append in its serialized (`{name, message}`) form.
pub const LOG_APPEND_ERROR: &str = "LogAppendError";

/// One record to append: a body and an optional deduplication key.
#[derive(Debug, Clone, PartialEq)]
pub struct AppendRecord<B> {
    /// The record's body, stored as JSON.
    pub body: B,
    /// Makes the append idempotent while the record is hot: appending the
    /// same key again returns the original offset.
    pub key: Option<String>,
}

impl<B> AppendRecord<B> {
    /// A record without a deduplication key: every append adds a record.
    pub fn new(body: B) -> Self {
        AppendRecord { body, key: None }
    }

    /// A record with a deduplication key.
    pub fn keyed(key: impl Into<String>, body: B) -> Self {
        AppendRecord {
            body,
            key: Some(key.into()),
        }
    }
}

/// A retained record.
#[derive(Debug, Clone, PartialEq)]
pub struct LogRecord<B> {
    /// Its offset: dense, from 0, in append order.
    pub offset: u64,
    /// Its deduplication key; when the append had none, a generated
    /// `<random instance id>:<offset in hex>`.
    pub key: String,
    /// The body.
    pub body: B,
    /// When it was appended (epoch ms).
    pub appended_at: EpochMs,
}

/// One page of [`Log::read`].
#[derive(Debug, Clone, PartialEq)]
pub struct LogPage<B> {
    /// Consecutive records starting exactly at the requested offset (empty
    /// at the end of the log).
    pub records: Vec<LogRecord<B>>,
    /// Where the next read starts; commit this after processing the page.
    pub next_offset: u64,
    /// Records after `next_offset` not read yet.
    pub lag: u64,
}

/// Where the log starts and ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LogBounds {
    /// The lowest readable offset, cold segments included (`next_offset`
    /// when nothing is readable).
    pub oldest_offset: u64,
    /// The lowest offset still in the object (`next_offset` when none is).
    pub hot_offset: u64,
    /// The offset the next new record gets.
    pub next_offset: u64,
}

/// What [`Log::read`] reads. Built with [`Read::from_offset`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Read {
    from: u64,
    limit: Option<u32>,
    max_bytes: Option<u64>,
}

impl Read {
    /// A read starting at `offset`, with the log's page size.
    pub fn from_offset(offset: u64) -> Self {
        Read {
            from: offset,
            limit: None,
            max_bytes: None,
        }
    }

    /// At most this many records (at least 1; capped at `max_batch_size`).
    pub fn limit(mut self, records: u32) -> Self {
        self.limit = Some(records);
        self
    }

    /// Stop adding records once their payloads would exceed this many bytes
    /// (at least 1). A page always holds at least one record, so a record
    /// larger than the budget is still readable.
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = Some(bytes);
        self
    }
}

/// The outcome of [`Log::append`]: accepted (durably stored, not
/// "consumed") or definitely rejected with nothing written. Storage
/// uncertainty is the `Err` of the surrounding `Result`, never a rejection.
#[derive(Debug, Clone, PartialEq)]
pub enum Appended {
    /// Stored: one offset per input record, in input order.
    Accepted {
        offsets: Vec<u64>,
        load: LoadSnapshot,
    },
    /// Rejected; nothing was written.
    Rejected {
        error: AppendRejection,
        load: LoadSnapshot,
    },
}

impl Appended {
    /// The offsets, when accepted.
    pub fn offsets(&self) -> Option<&[u64]> {
        match self {
            Appended::Accepted { offsets, .. } => Some(offsets),
            Appended::Rejected { .. } => None,
        }
    }

    /// The rejection, when rejected.
    pub fn rejection(&self) -> Option<&AppendRejection> {
        match self {
            Appended::Accepted { .. } => None,
            Appended::Rejected { error, .. } => Some(error),
        }
    }

    /// The load snapshot taken with the result.
    pub fn load(&self) -> &LoadSnapshot {
        match self {
            Appended::Accepted { load, .. } | Appended::Rejected { load, .. } => load,
        }
    }
}

/// The reference library's wire shape: `{"success": true, "value":
/// [offsets], "load": ..}` or `{"success": false, "error": {"name":
/// "LogAppendError", "message": ..}, "load": ..}`.
impl Serialize for Appended {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(3))?;
        match self {
            Appended::Accepted { offsets, load } => {
                map.serialize_entry("success", &true)?;
                map.serialize_entry("value", offsets)?;
                map.serialize_entry("load", load)?;
            }
            Appended::Rejected { error, load } => {
                map.serialize_entry("success", &false)?;
                map.serialize_entry("error", &error.serialize())?;
                map.serialize_entry("load", load)?;
            }
        }
        map.end()
    }
}

/// Why an append was rejected. Nothing of a rejected batch is written.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum AppendRejection {
    /// An empty batch.
    #[error("Append requires at least one record")]
    Empty,
    /// A batch larger than the log's `max_batch_size`.
    #[error("Append of {count} records exceeds maxBatchSize {max}")]
    TooMany { count: usize, max: u32 },
    /// A deduplication key that is the empty string.
    #[error("records[{index}].key must not be empty")]
    EmptyKey { index: usize },
    /// A key longer than [`MAX_ID_BYTES`](crate::limits::MAX_ID_BYTES), or
    /// a body larger than the log's `max_body_bytes`.
    #[error("records[{index}]: {limit}")]
    Limit { index: usize, limit: LimitError },
    /// A body that cannot be stored as JSON.
    #[error("records[{index}].body is not JSON: {source}")]
    Body {
        index: usize,
        #[source]
        source: CodecError,
    },
    /// A key already held by a hot record whose body differs.
    #[error(
        "records[{index}].key {key:?} already holds a different body at offset {offset}; a deduplication key names one record"
    )]
    KeyConflict {
        index: usize,
        key: String,
        offset: u64,
    },
    /// A key given twice in one batch with different bodies.
    #[error(
        "records[{index}].key {key:?} repeats records[{first_index}].key with a different body"
    )]
    KeyRepeated {
        index: usize,
        first_index: usize,
        key: String,
    },
}

impl AppendRejection {
    /// The `{name: "LogAppendError", message}` form, for the wire.
    pub fn serialize(&self) -> SerializedError {
        SerializedError::new(LOG_APPEND_ERROR, self.to_string())
    }
}

/// Why a log call failed. A failed call wrote nothing, except where a
/// variant says otherwise.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LogError {
    /// The object's storage failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// An argument broke a rule; `field` names it.
    #[error("{field} {rule}")]
    InvalidArgument {
        field: &'static str,
        rule: &'static str,
    },
    /// The requested offset is no longer readable: trimmed without cold
    /// storage, its segment forgotten or gone, or missing from its segment.
    /// `oldest` is the lowest readable offset above it, where a consumer can
    /// resume (after deciding what the gap means to it).
    #[error("offset {requested} is no longer readable; the oldest retained offset is {oldest}")]
    Truncated { requested: u64, oldest: u64 },
    /// Cold storage failed; whether the records are there is unknown. A
    /// failed write during a trim leaves that pass's records hot (earlier
    /// passes of the same call stay trimmed).
    #[error("cold storage failed: {0}")]
    Cold(#[source] ColdError),
    /// Cold storage returned an empty locator; the records stay hot.
    #[error("Cold storage must return a non-empty locator (segment {first}..={last})")]
    EmptyLocator { first: u64, last: u64 },
    /// The stored record at `offset` does not decode into the log's body
    /// type. Only a read or lease starting at that offset fails with it;
    /// skip it by reading from (and committing) `offset + 1`.
    #[error("record {offset} does not decode: {detail}")]
    Decode { offset: u64, detail: String },
    /// A commit beyond the next offset: the consumer would skip records
    /// appended later.
    #[error(
        "cannot commit consumer {consumer:?} to offset {offset}: the log ends at {next_offset}"
    )]
    CommitBeyondEnd {
        consumer: String,
        offset: u64,
        next_offset: u64,
    },
    /// A lease method on a log built without [`LogBuilder::leases`].
    #[error("lease methods need the log to be built with the `leases` option")]
    LeasesDisabled,
    /// An ack or nack of a batch the caller no longer holds.
    #[error(
        "batch {batch_id:?} of consumer {consumer:?} is not held: it was settled, reclaimed after its lease expired, or never existed"
    )]
    LeaseNotHeld { consumer: String, batch_id: String },
}

/// Configures a [`Log`]; every option has a validated default.
pub struct LogBuilder<B> {
    scheduler: Scheduler,
    max_batch_size: u32,
    max_body_bytes: usize,
    retention: Option<Retention>,
    cold: Option<Rc<dyn ColdStorage>>,
    leases: Option<Leases>,
    routing: Option<Load>,
    _body: PhantomData<fn() -> B>,
}

impl<B> LogBuilder<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// The largest append batch, read page and cold segment. Default 100;
    /// from 1 to 100,000
    /// ([`MAX_ITEMS_PER_CALL_LIMIT`](crate::limits::MAX_ITEMS_PER_CALL_LIMIT)).
    pub fn max_batch_size(mut self, records: u32) -> Self {
        self.max_batch_size = records;
        self
    }

    /// Largest record body an append accepts, measured as the body's own
    /// JSON. Default 1 MiB; from 1 byte to 32 MiB
    /// ([`MAX_BODY_BYTES_LIMIT`](crate::limits::MAX_BODY_BYTES_LIMIT)). A
    /// larger body rejects its whole batch.
    /// On a platform with a per-value bound (Cloudflare: 2 MB), at most that
    /// bound less [`STORED_VALUE_OVERHEAD_BYTES`](crate::limits::STORED_VALUE_OVERHEAD_BYTES);
    /// `build` refuses more with [`ConfigError::AbovePlatformLimit`](crate::ConfigError::AbovePlatformLimit).
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// What [`Log::trim`] keeps hot. Without it, `trim` removes nothing and
    /// the log grows until the object's storage is full.
    pub fn retention(mut self, retention: Retention) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Where trimmed records go to stay readable. Without it, trimmed
    /// records are deleted.
    pub fn cold(mut self, cold: Rc<dyn ColdStorage>) -> Self {
        self.cold = Some(cold);
        self
    }

    /// Enables consumer leases (and creates their tables).
    pub fn leases(mut self, leases: Leases) -> Self {
        self.leases = Some(leases);
        self
    }

    /// Counts this log's appends in `load`, shared with other capabilities
    /// of the object (their numbers add up). Default: counters of its own.
    pub fn routing(mut self, load: Load) -> Self {
        self.routing = Some(load);
        self
    }

    /// Validates the options, migrates the schema and claims the log's
    /// tables on the scheduler (one log per object).
    pub fn build(self) -> Result<Log<B>, DurabilityError> {
        limits::check_setting(
            "max_batch_size",
            usize::try_from(self.max_batch_size).unwrap_or(usize::MAX),
            limits::MAX_ITEMS_PER_CALL_LIMIT,
        )?;
        limits::check_body_setting(
            "max_body_bytes",
            self.max_body_bytes,
            &self.scheduler.engine.ctx.storage().limits(),
        )?;
        let retention = self.retention.map(Retention::validate).transpose()?;
        let leases = self.leases.map(Leases::validate).transpose()?;
        let engine = Rc::clone(&self.scheduler.engine);
        engine.migrate_schema(LOG_CAPABILITY, LOG_MIGRATIONS)?;
        if leases.is_some() {
            engine.migrate_schema(LOG_LEASES_CAPABILITY, LOG_LEASES_MIGRATIONS)?;
        }
        let inner = Rc::new(Inner {
            engine: Rc::clone(&engine),
            max_batch_size: self.max_batch_size,
            max_body_bytes: self.max_body_bytes,
            retention,
            cold: self.cold,
            leases,
            trim_lock: tokio::sync::Mutex::new(()),
            lease_lock: tokio::sync::Mutex::new(()),
            cold_cache: RefCell::new(None),
            key_prefix: engine.new_generation(),
            load: self
                .routing
                .unwrap_or_else(|| Load::for_context(&engine.ctx)),
        });
        engine.register(&inner)?;
        Ok(Log {
            inner,
            _body: PhantomData,
        })
    }
}

/// The retained log of one object. Cloning is one reference-count increment.
///
/// `B` is the record body; it is stored as JSON.
pub struct Log<B> {
    inner: Rc<Inner>,
    _body: PhantomData<fn() -> B>,
}

impl<B> Clone for Log<B> {
    fn clone(&self) -> Self {
        Log {
            inner: Rc::clone(&self.inner),
            _body: PhantomData,
        }
    }
}

impl<B> fmt::Debug for Log<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Log")
            .field("object", &self.inner.engine.ctx.id().as_str())
            .field("max_batch_size", &self.inner.max_batch_size)
            .field("retention", &self.inner.retention)
            .field("cold", &self.inner.cold.is_some())
            .field("leases", &self.inner.leases.is_some())
            .finish()
    }
}

/// The shared state behind a [`Log`]; not generic, so the scheduler can hold
/// it as a participant.
struct Inner {
    engine: Rc<Engine>,
    max_batch_size: u32,
    max_body_bytes: usize,
    retention: Option<Limits>,
    cold: Option<Rc<dyn ColdStorage>>,
    leases: Option<LeaseConfig>,
    // Held across the awaits of a trim (the cold write), so two trims never
    // write the same segment; appends and reads do not wait for it.
    trim_lock: tokio::sync::Mutex<()>,
    // Held across the awaits of a lease call (a cold read), so two callers
    // never allocate or reclaim the same range.
    lease_lock: tokio::sync::Mutex<()>,
    // The last segment read from cold storage, so a reader paging through a
    // segment reads it once, not once per page. One segment of at most
    // `max_batch_size` records; keyed by its whole index row, so a re-index
    // or a forget makes it unreachable.
    cold_cache: RefCell<Option<(SegmentRow, Rc<Vec<SegmentRecord>>)>>,
    // The prefix of generated deduplication keys: a random UUID per instance.
    key_prefix: String,
    // Inbound: one unit per append call (accepted, rejected or failed). The
    // log records no outbound work: consumers pull.
    load: Load,
}

impl Participant for Inner {
    fn table(&self) -> DurableTable {
        LOG_RECORDS
    }

    fn run_due(
        self: Rc<Self>,
        _now: EpochMs,
        _info: Option<AlarmInfo>,
    ) -> LocalBoxFuture<'static, Result<(), DurabilityError>> {
        // The log has no due work: retention is driven by the application.
        Box::pin(std::future::ready(Ok(())))
    }

    fn custom_next_pending_at(
        &self,
        _sql: &dyn Sql,
    ) -> Option<Result<Option<EpochMs>, StorageError>> {
        Some(Ok(None))
    }
}

/// A record body in the form it was read in: stored text from the hot
/// table, or plain JSON from a cold segment.
enum RawBody {
    Stored(String),
    Cold(serde_json::Value),
}

struct RawRecord {
    offset: u64,
    key: String,
    body: RawBody,
    appended_at: EpochMs,
}

impl RawRecord {
    fn decode<B: DeserializeOwned>(self) -> Result<LogRecord<B>, LogError> {
        let offset = self.offset;
        let body = match self.body {
            RawBody::Stored(text) => {
                codec::decode_as::<B>(&text).map_err(|error| LogError::Decode {
                    offset,
                    detail: error.to_string(),
                })?
            }
            RawBody::Cold(value) => {
                serde_json::from_value::<B>(value).map_err(|error| LogError::Decode {
                    offset,
                    detail: error.to_string(),
                })?
            }
        };
        Ok(LogRecord {
            offset,
            key: self.key,
            body,
            appended_at: self.appended_at,
        })
    }
}

/// Decodes a page up to its first record that does not decode, which ends
/// the page so that one bad record never hides the good ones before it.
/// Fails only when the very first record does not decode: that error names
/// its offset, which is what a consumer skips.
fn decode_prefix<B: DeserializeOwned>(
    records: Vec<RawRecord>,
) -> Result<Vec<LogRecord<B>>, LogError> {
    let mut decoded = Vec::with_capacity(records.len());
    for raw in records {
        match raw.decode() {
            Ok(record) => decoded.push(record),
            Err(error) => {
                tracing::warn!(
                    event = "durability.log.undecodable_record",
                    %error,
                    "a stored log record does not decode; the page ends before it"
                );
                if decoded.is_empty() {
                    return Err(error);
                }
                break;
            }
        }
    }
    Ok(decoded)
}

struct RawPage {
    records: Vec<RawRecord>,
    next_offset: u64,
    lag: u64,
}

/// One record ready to insert, or a reference to the record it repeats.
struct Prepared {
    key: String,
    /// Whether the caller gave the key (only those are looked up).
    keyed: bool,
    payload: String,
}

impl<B> Log<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// Starts configuring the log of the object behind `scheduler`.
    pub fn builder(scheduler: &Scheduler) -> LogBuilder<B> {
        LogBuilder {
            scheduler: scheduler.clone(),
            max_batch_size: DEFAULT_MAX_BATCH_SIZE,
            max_body_bytes: limits::DEFAULT_MAX_BODY_BYTES,
            retention: None,
            cold: None,
            leases: None,
            routing: None,
            _body: PhantomData,
        }
    }

    /// Migrates the log's schema of `storage` to `target` explicitly.
    pub fn migrate(
        storage: &dyn durability_platform::Storage,
        target: MigrationTarget,
    ) -> Result<MigrationReport, DurabilityError> {
        Ok(migrations::migrate(
            storage,
            LOG_CAPABILITY,
            LOG_MIGRATIONS,
            target,
        )?)
    }

    /// Migrates the lease schema of `storage` to `target` explicitly.
    pub fn migrate_leases(
        storage: &dyn durability_platform::Storage,
        target: MigrationTarget,
    ) -> Result<MigrationReport, DurabilityError> {
        Ok(migrations::migrate(
            storage,
            LOG_LEASES_CAPABILITY,
            LOG_LEASES_MIGRATIONS,
            target,
        )?)
    }

    /// Appends a batch atomically: every record or none. New records get
    /// consecutive offsets in input order; a record whose key is already
    /// hot (or repeated earlier in the batch) with the same body gets that
    /// record's offset instead. Offsets are returned in input order.
    ///
    /// Bad input is a [`Appended::Rejected`] with nothing written; `Err`
    /// means the storage failed and the batch may or may not be stored
    /// (retry it with keys to make the retry safe).
    pub async fn append(&self, records: Vec<AppendRecord<B>>) -> Result<Appended, LogError> {
        let inner = &self.inner;
        let in_flight = inner.load.begin(Direction::Inbound);
        let outcome = self.append_batch(records);
        in_flight.finish();
        let (outcome, pending) = outcome?;
        let load = inner.load.snapshot(pending);
        Ok(match outcome {
            Ok(offsets) => Appended::Accepted { offsets, load },
            Err(error) => Appended::Rejected { error, load },
        })
    }

    /// The synchronous body of [`Log::append`]: validation, then one
    /// transaction. Nothing awaits, so no other task of the object can
    /// interleave with the offset allocation.
    /// Returns the outcome and the backlog for the load snapshot.
    fn append_batch(
        &self,
        records: Vec<AppendRecord<B>>,
    ) -> Result<(Result<Vec<u64>, AppendRejection>, u64), LogError> {
        let inner = &self.inner;
        let rejected = |rejection| Ok((Err(rejection), inner.pending()?));
        if records.is_empty() {
            return rejected(AppendRejection::Empty);
        }
        let max = inner.max_batch_size;
        if records.len() > usize::try_from(max).unwrap_or(usize::MAX) {
            return rejected(AppendRejection::TooMany {
                count: records.len(),
                max,
            });
        }
        let mut prepared = Vec::with_capacity(records.len());
        // Where each caller key first appears in the batch.
        let mut first_index: BTreeMap<&str, usize> = BTreeMap::new();
        // Per input record: the index of the prepared record it stands for.
        let mut slots = Vec::with_capacity(records.len());
        for (index, record) in records.iter().enumerate() {
            let payload = match codec::encode(&record.body) {
                Ok(payload) => payload,
                Err(source) => return rejected(AppendRejection::Body { index, source }),
            };
            let body_bytes = codec::body_bytes(&payload);
            if let Err(limit) =
                limits::check_body("body", body_bytes, inner.max_body_bytes, "max_body_bytes")
            {
                return rejected(AppendRejection::Limit { index, limit });
            }
            if let Some(key) = record.key.as_deref().filter(|key| !key.is_empty())
                && let Err(limit) = limits::check_id("key", key)
            {
                return rejected(AppendRejection::Limit { index, limit });
            }
            match record.key.as_deref() {
                Some("") => return rejected(AppendRejection::EmptyKey { index }),
                Some(key) => {
                    if let Some(&first) = first_index.get(key) {
                        // `first` is an earlier input, so its slot exists.
                        let slot = slots.get(first).copied().unwrap_or_default();
                        let same = prepared
                            .get(slot)
                            .is_some_and(|earlier: &Prepared| earlier.payload == payload);
                        if !same {
                            return rejected(AppendRejection::KeyRepeated {
                                index,
                                first_index: first,
                                key: key.to_owned(),
                            });
                        }
                        slots.push(slot);
                        continue;
                    }
                    first_index.insert(key, index);
                    slots.push(prepared.len());
                    prepared.push(Prepared {
                        key: key.to_owned(),
                        keyed: true,
                        payload,
                    });
                }
                None => {
                    slots.push(prepared.len());
                    // Named once its offset is known (see below).
                    prepared.push(Prepared {
                        key: String::new(),
                        keyed: false,
                        payload,
                    });
                }
            }
        }
        let appended_at = inner.engine.now();
        let outcome = inner.engine.transaction_sync(|sql| {
            // Look every caller key up before writing anything, so a conflict
            // returns with nothing to roll back.
            let mut assigned: Vec<Option<u64>> = Vec::with_capacity(prepared.len());
            for record in &prepared {
                let existing = if record.keyed {
                    store::find_key(sql, &record.key)?
                } else {
                    None
                };
                match existing {
                    Some((offset, payload)) if payload == record.payload => {
                        assigned.push(Some(offset));
                    }
                    Some((offset, _)) => {
                        let index = first_index
                            .get(record.key.as_str())
                            .copied()
                            .unwrap_or_default();
                        let conflict = AppendRejection::KeyConflict {
                            index,
                            key: record.key.clone(),
                            offset,
                        };
                        return Ok((Err(conflict), pending(sql)?));
                    }
                    None => assigned.push(None),
                }
            }
            let mut seq = store::seq(sql)?;
            let first_new = seq.next_offset;
            for (record, offset) in prepared.iter().zip(assigned.iter_mut()) {
                if offset.is_some() {
                    continue;
                }
                if seq.next_offset > MAX_OFFSET {
                    return Err(LogError::InvalidArgument {
                        field: "append",
                        rule: "would pass the largest offset (2^53 - 1)",
                    });
                }
                let bytes = u64::try_from(record.payload.len()).unwrap_or(u64::MAX);
                // A record without a caller key gets `<instance id>:<offset>`:
                // unique (offsets are never reused, the instance id is a
                // random UUID) and ascending within an instance, so the
                // UNIQUE index grows at its end instead of taking a random
                // insert per record as a UUID per record would.
                let generated;
                let key = if record.keyed {
                    record.key.as_str()
                } else {
                    generated = format!("{}:{:016x}", inner.key_prefix, seq.next_offset);
                    generated.as_str()
                };
                store::insert_record(
                    sql,
                    seq.next_offset,
                    key,
                    &record.payload,
                    bytes,
                    appended_at,
                )?;
                *offset = Some(seq.next_offset);
                seq.next_offset += 1;
                seq.total_bytes = seq.total_bytes.saturating_add(bytes);
            }
            if seq.next_offset != first_new {
                store::set_seq(sql, seq)?;
            }
            tracing::trace!(
                event = "durability.log.appending",
                first_offset = first_new,
                next_offset = seq.next_offset,
                "append rows written, committing"
            );
            let assigned: Vec<u64> = assigned
                .into_iter()
                .map(Option::unwrap_or_default)
                .collect();
            Ok((Ok(assigned), pending(sql)?))
        })?;
        let (assigned, pending) = match outcome {
            (Ok(assigned), pending) => (assigned, pending),
            (Err(rejection), pending) => return Ok((Err(rejection), pending)),
        };
        // Every slot indexes `assigned` by construction.
        let offsets: Vec<u64> = slots
            .iter()
            .map(|&slot| assigned.get(slot).copied().unwrap_or_default())
            .collect();
        tracing::debug!(
            event = "durability.log.appended",
            records = offsets.len(),
            first_offset = offsets.first().copied(),
            last_offset = offsets.last().copied(),
            "append committed"
        );
        crate::telemetry::log_appended(offsets.len());
        Ok((Ok(offsets), pending))
    }

    /// Reads a page: consecutive records starting exactly at the requested
    /// offset, from the hot table or, below the hot offset, from one cold
    /// segment (a page never spans two segments or a segment and the hot
    /// table). Never skips a record: an offset that cannot be read is
    /// [`LogError::Truncated`].
    pub async fn read(&self, read: Read) -> Result<LogPage<B>, LogError> {
        let limit = match read.limit {
            Some(0) => {
                return Err(LogError::InvalidArgument {
                    field: "limit",
                    rule: "must be a positive integer",
                });
            }
            Some(limit) => limit.min(self.inner.max_batch_size),
            None => self.inner.max_batch_size,
        };
        if read.max_bytes == Some(0) {
            return Err(LogError::InvalidArgument {
                field: "max_bytes",
                rule: "must be a positive integer",
            });
        }
        require_offset("from", read.from)?;
        let page = self
            .inner
            .read_raw(
                read.from,
                u64::from(limit),
                read.max_bytes.unwrap_or(u64::MAX),
            )
            .await?;
        let end = page.next_offset.saturating_add(page.lag);
        let records = decode_prefix(page.records)?;
        let next_offset = records.last().map_or(page.next_offset, |r| r.offset + 1);
        crate::telemetry::log_read(records.len());
        Ok(LogPage {
            records,
            next_offset,
            lag: end.saturating_sub(next_offset),
        })
    }

    /// [`Log::read`] from `offset` with the default page size.
    pub async fn read_from(&self, offset: u64) -> Result<LogPage<B>, LogError> {
        self.read(Read::from_offset(offset)).await
    }

    /// Where the log starts and ends.
    pub async fn bounds(&self) -> Result<LogBounds, LogError> {
        Ok(bounds(self.inner.engine.sql())?)
    }

    /// A consumer's committed offset (the next offset it will read), or
    /// `None` if it never committed; start such a consumer at
    /// [`LogBounds::oldest_offset`].
    pub async fn cursor(&self, consumer: &str) -> Result<Option<u64>, LogError> {
        Ok(store::cursor(self.inner.engine.sql(), consumer)?)
    }

    /// Records that `consumer` has processed everything before `offset`.
    /// Only moves forward: a smaller or equal offset changes nothing. Fails
    /// beyond the end of the log.
    pub async fn commit(&self, consumer: &str, offset: u64) -> Result<(), LogError> {
        require_consumer(consumer)?;
        require_offset("offset", offset)?;
        let now = self.inner.engine.now();
        let next_offset = self.inner.engine.transaction_sync(|sql| {
            let next_offset = store::seq(sql)?.next_offset;
            if offset > next_offset {
                return Err(LogError::CommitBeyondEnd {
                    consumer: consumer.to_owned(),
                    offset,
                    next_offset,
                });
            }
            store::advance_cursor(sql, consumer, offset, now)?;
            Ok(next_offset)
        })?;
        crate::telemetry::log_consumer_lag(consumer, next_offset - offset);
        Ok(())
    }

    /// Every consumer's committed offset, by consumer name.
    pub async fn cursors(&self) -> Result<BTreeMap<String, u64>, LogError> {
        Ok(store::cursors(self.inner.engine.sql())?
            .into_iter()
            .collect())
    }

    /// Applies the retention: removes the oldest hot records that a limit
    /// condemns, flushing them to cold storage first when it is configured
    /// (written, then indexed, then deleted, so a crash never leaves a
    /// record unreadable). Returns how many records left the hot table.
    /// Never runs by itself; call it from a named alarm. Where the platform
    /// limits CPU per event (Cloudflare), one call stops after the share of
    /// it the scheduler allows in-memory work (its alarm handoff, at most
    /// half the limit) and may leave condemned records for the next call.
    pub async fn trim(&self) -> Result<u64, LogError> {
        let trimmed = retention::trim(&self.inner).await?;
        crate::telemetry::log_trimmed(trimmed);
        Ok(trimmed)
    }

    /// Forgets the cold segments that end below `offset`, the way an
    /// external lifecycle rule deletes them; reads below the new oldest
    /// offset then fail with [`LogError::Truncated`]. Returns the forgotten
    /// segments, whose objects the caller may now delete.
    pub async fn forget_cold_before(&self, offset: u64) -> Result<Vec<ForgottenSegment>, LogError> {
        require_offset("offset", offset)?;
        let rows = self
            .inner
            .engine
            .transaction_sync(|sql| store::forget_segments_before(sql, offset))?;
        Ok(rows
            .into_iter()
            .map(|row| ForgottenSegment {
                first_offset: row.first_offset,
                last_offset: row.last_offset,
                locator: row.locator,
            })
            .collect())
    }

    /// The load snapshot: appends in flight and over the last minute, and as
    /// backlog the lag of the furthest-behind consumer (0 without cursors).
    pub async fn load(&self) -> Result<LoadSnapshot, LogError> {
        self.inner.load_snapshot()
    }

    /// Leases the next range of records to one of several workers sharing
    /// `consumer`: first a range owed redelivery (nacked, or its lease
    /// expired), else the next unallocated records. `None` when the consumer
    /// already holds `max_parallelism` live ranges or nothing is left. The
    /// lease is stored before it is returned.
    pub async fn lease(
        &self,
        consumer: &str,
        limit: Option<u32>,
    ) -> Result<Option<Lease<B>>, LogError> {
        leases::lease(&self.inner, consumer, limit).await
    }

    /// Settles a leased range as processed. The cursor then moves over the
    /// unbroken run of settled ranges from where it is, never past an
    /// unsettled one. Fails with [`LogError::LeaseNotHeld`] if the batch was
    /// fenced (reclaimed by another worker) or already settled.
    pub async fn ack(&self, consumer: &str, batch_id: &str) -> Result<(), LogError> {
        leases::settle(&self.inner, consumer, batch_id, true).await
    }

    /// Gives a leased range back for immediate redelivery.
    pub async fn nack(&self, consumer: &str, batch_id: &str) -> Result<(), LogError> {
        leases::settle(&self.inner, consumer, batch_id, false).await
    }
}

/// A cold segment that [`Log::forget_cold_before`] removed from the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForgottenSegment {
    /// Its first offset.
    pub first_offset: u64,
    /// Its last offset.
    pub last_offset: u64,
    /// Its locator, as [`ColdStorage::write`] returned it.
    pub locator: String,
}

fn require_offset(field: &'static str, offset: u64) -> Result<(), LogError> {
    if offset > MAX_OFFSET {
        return Err(LogError::InvalidArgument {
            field,
            rule: "must be at most 2^53 - 1",
        });
    }
    Ok(())
}

fn require_consumer(consumer: &str) -> Result<(), LogError> {
    if consumer.is_empty() {
        return Err(LogError::InvalidArgument {
            field: "consumer",
            rule: "must not be empty",
        });
    }
    if consumer.len() > limits::MAX_ID_BYTES {
        return Err(LogError::InvalidArgument {
            field: "consumer",
            rule: "must be at most 1024 bytes (MAX_ID_BYTES)",
        });
    }
    Ok(())
}

/// The log's bounds: three seeks (sequence row, lowest hot rowid, lowest
/// segment key).
fn bounds(sql: &dyn Sql) -> Result<LogBounds, StorageError> {
    let next_offset = store::seq(sql)?.next_offset;
    let hot_offset = store::hot_offset(sql)?.unwrap_or(next_offset);
    // A segment indexed but not yet deleted (a crash between the two) starts
    // at the hot offset; `min` keeps oldest <= hot either way.
    let oldest_offset =
        store::lowest_segment(sql)?.map_or(hot_offset, |first| first.min(hot_offset));
    Ok(LogBounds {
        oldest_offset,
        hot_offset,
        next_offset,
    })
}

impl Inner {
    fn load_snapshot(&self) -> Result<LoadSnapshot, LogError> {
        Ok(self.load.snapshot(self.pending()?))
    }

    /// The backlog: how far the slowest consumer is behind.
    fn pending(&self) -> Result<u64, StorageError> {
        pending(self.engine.sql())
    }

    /// Reads up to `limit` records from `from` (at least one, then while the
    /// payloads fit in `max_bytes`).
    async fn read_raw(&self, from: u64, limit: u64, max_bytes: u64) -> Result<RawPage, LogError> {
        let sql = self.engine.sql();
        let b = bounds(sql)?;
        if from < b.oldest_offset {
            return Err(LogError::Truncated {
                requested: from,
                oldest: b.oldest_offset,
            });
        }
        let records = if from < b.hot_offset {
            self.read_cold(from, limit, max_bytes, b.hot_offset).await?
        } else {
            let rows = store::hot_records(sql, from, limit)?;
            let mut budget = Budget::new(max_bytes);
            let mut records = Vec::with_capacity(rows.len());
            for row in rows {
                if !budget.take(row.bytes) {
                    break;
                }
                records.push(RawRecord {
                    offset: row.offset,
                    key: row.key,
                    body: RawBody::Stored(row.payload),
                    appended_at: row.appended_at,
                });
            }
            records
        };
        // An empty page means `from` is at or past the end of the log.
        let next_offset = records.last().map_or(from, |r| r.offset + 1);
        // The end of the log moves only forward; re-read it after a cold
        // read's await so the lag is not stale.
        let end = store::seq(self.engine.sql())?.next_offset;
        Ok(RawPage {
            lag: end.saturating_sub(next_offset),
            next_offset,
            records,
        })
    }

    /// A page from the cold segment holding `from` (which is below the hot
    /// offset). Stops at the first offset the segment lacks; if that is
    /// `from` itself, the read is truncated.
    async fn read_cold(
        &self,
        from: u64,
        limit: u64,
        max_bytes: u64,
        hot_offset: u64,
    ) -> Result<Vec<RawRecord>, LogError> {
        let sql = self.engine.sql();
        let segment = store::segment_at_or_below(sql, from)?.filter(|s| s.last_offset >= from);
        let Some(cold) = self.cold.as_ref() else {
            // Segments without a cold store to read them from: only the hot
            // table is readable.
            return Err(LogError::Truncated {
                requested: from,
                oldest: hot_offset,
            });
        };
        let Some(segment) = segment else {
            return Err(LogError::Truncated {
                requested: from,
                oldest: resume_after(sql, from, hot_offset)?,
            });
        };
        let cached = self
            .cold_cache
            .borrow()
            .as_ref()
            .filter(|(row, _)| *row == segment)
            .map(|(_, records)| Rc::clone(records));
        let records = match cached {
            Some(records) => records,
            None => {
                let Some(stored) = cold.read(&segment.locator).await.map_err(LogError::Cold)?
                else {
                    tracing::warn!(
                        event = "durability.log.segment_missing",
                        first_offset = segment.first_offset,
                        last_offset = segment.last_offset,
                        locator = %segment.locator,
                        "an indexed cold segment is gone"
                    );
                    let sql = self.engine.sql();
                    return Err(LogError::Truncated {
                        requested: from,
                        oldest: resume_after(sql, segment.last_offset, hot_offset)?,
                    });
                };
                // Only what the index row promises counts, in offset order.
                let mut records: Vec<SegmentRecord> = stored
                    .records
                    .into_iter()
                    .filter(|r| r.offset >= segment.first_offset && r.offset <= segment.last_offset)
                    .collect();
                records.sort_by_key(|r| r.offset);
                records.dedup_by_key(|r| r.offset);
                let records = Rc::new(records);
                *self.cold_cache.borrow_mut() = Some((segment.clone(), Rc::clone(&records)));
                records
            }
        };
        let start = records.partition_point(|r| r.offset < from);
        let mut page = Vec::new();
        let mut budget = Budget::new(max_bytes);
        let rest = records.get(start..).unwrap_or_default();
        for (expected, record) in (from..).zip(rest) {
            if record.offset != expected || u64::try_from(page.len()).unwrap_or(u64::MAX) >= limit {
                break;
            }
            let bytes = codec::encode_value(Some(&record.body)).map_or(0, |text| text.len());
            if !budget.take(u64::try_from(bytes).unwrap_or(u64::MAX)) {
                break;
            }
            page.push(RawRecord {
                offset: record.offset,
                key: record.deduplication_key.clone(),
                body: RawBody::Cold(record.body.clone()),
                appended_at: record.appended_at,
            });
        }
        if page.is_empty() {
            // The segment lacks `from`: a hole, never a silent skip.
            let next_in_segment = records.get(start).map(|r| r.offset);
            let sql = self.engine.sql();
            let oldest = match next_in_segment {
                Some(offset) => offset,
                None => resume_after(sql, segment.last_offset, hot_offset)?,
            };
            tracing::warn!(
                event = "durability.log.segment_hole",
                requested = from,
                first_offset = segment.first_offset,
                last_offset = segment.last_offset,
                "a cold segment holds fewer records than indexed"
            );
            return Err(LogError::Truncated {
                requested: from,
                oldest,
            });
        }
        Ok(page)
    }
}

/// How far the furthest-behind consumer is behind the end of the log (0
/// without consumers): two seeks.
fn pending(sql: &dyn Sql) -> Result<u64, StorageError> {
    let next_offset = store::seq(sql)?.next_offset;
    Ok(store::slowest_cursor(sql)?.map_or(0, |slowest| next_offset.saturating_sub(slowest)))
}

/// The lowest offset above `offset` where reading can resume: the next
/// indexed segment, or the hot table.
fn resume_after(sql: &dyn Sql, offset: u64, hot_offset: u64) -> Result<u64, StorageError> {
    Ok(store::segment_above(sql, offset)?.map_or(hot_offset, |first| first.min(hot_offset)))
}

/// A page's byte budget: the first record always fits.
struct Budget {
    left: u64,
    taken: bool,
}

impl Budget {
    fn new(max_bytes: u64) -> Self {
        Budget {
            left: max_bytes,
            taken: false,
        }
    }

    fn take(&mut self, bytes: u64) -> bool {
        if self.taken && bytes > self.left {
            return false;
        }
        self.left = self.left.saturating_sub(bytes);
        self.taken = true;
        true
    }
}
