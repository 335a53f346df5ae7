//! Acceptance: a batch of messages and its frozen target set commit in one
//! transaction, or nothing of them does.
//!
//! Everything that can be decided without storage (targets, ids, bodies) is
//! decided first, so a definite rejection writes nothing and touches no
//! transaction. Inside the transaction the only definite rejection is a
//! deduplication key that names different work; it rolls the whole batch
//! back. Any other failure is returned as an `Err`: the caller cannot know
//! whether the commit happened, and retrying with the same ids and keys is
//! safe while their registrations exist.

use std::rc::Rc;

use durability_platform::{EpochMs, Sql, StorageError};
use serde::de::DeserializeOwned;
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use super::error::{EnqueueRejection, FanoutError};
use super::store::{self, DELIVERIES, Manifest, json_pair};
use super::{Fanout, Inner, entity};
use crate::codec;
use crate::lifecycle::LifecycleEvent;
use crate::limits::{self, LimitError};
use crate::load::{Direction, LoadSnapshot};

/// One message to enqueue.
///
/// ```
/// use durability::fanout::FanoutInput;
///
/// let input = FanoutInput::new(serde_json::json!({"to": "ada"}))
///     .id("mail-17")
///     .deduplication_key("mail-17/retry-of-16");
/// assert_eq!(input.id.as_deref(), Some("mail-17"));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct FanoutInput<B> {
    /// The id consumers see; a random UUID when absent.
    pub id: Option<String>,
    /// The body, stored as JSON.
    pub body: B,
    /// The key that makes a repeated enqueue a no-op while the message's
    /// registration is retained; the id when absent. Redrive uses the DLQ
    /// entry's id, so the redriven delivery is new work.
    pub deduplication_key: Option<String>,
}

impl<B> FanoutInput<B> {
    /// A message with a generated id.
    pub fn new(body: B) -> Self {
        FanoutInput {
            id: None,
            body,
            deduplication_key: None,
        }
    }

    /// Sets the message id.
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Sets the deduplication key.
    pub fn deduplication_key(mut self, key: impl Into<String>) -> Self {
        self.deduplication_key = Some(key.into());
        self
    }
}

/// Which targets an enqueue is for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnqueueOptions {
    /// `None`: every configured target. Otherwise distinct configured ids
    /// (a redrive names only the target that failed).
    pub targets: Option<Vec<String>>,
}

impl EnqueueOptions {
    /// Every configured target.
    pub fn all() -> Self {
        EnqueueOptions::default()
    }

    /// Only these targets.
    pub fn to<I, S>(targets: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        EnqueueOptions {
            targets: Some(targets.into_iter().map(Into::into).collect()),
        }
    }
}

/// The answer to an enqueue that reached a definite outcome. `Accepted`
/// means durably accepted, never "delivered". Serialized in the reference
/// library's shape: `{"success": true, "value": .., "load": ..}` or
/// `{"success": false, "error": {"name", "message"}, "load": ..}`.
#[derive(Debug, Clone, PartialEq)]
pub enum EnqueueResult<T> {
    /// Committed, with the ids in input order (deduplicated ones included).
    Accepted { value: T, load: LoadSnapshot },
    /// Rejected for good; nothing was written.
    Rejected {
        error: EnqueueRejection,
        load: LoadSnapshot,
    },
}

impl<T> EnqueueResult<T> {
    /// Whether the batch was accepted.
    pub fn is_accepted(&self) -> bool {
        matches!(self, EnqueueResult::Accepted { .. })
    }

    /// The load snapshot taken after the call.
    pub fn load(&self) -> &LoadSnapshot {
        match self {
            EnqueueResult::Accepted { load, .. } | EnqueueResult::Rejected { load, .. } => load,
        }
    }

    /// The accepted value, or the rejection.
    pub fn accepted(self) -> Result<T, EnqueueRejection> {
        match self {
            EnqueueResult::Accepted { value, .. } => Ok(value),
            EnqueueResult::Rejected { error, .. } => Err(error),
        }
    }
}

impl<T: Serialize> Serialize for EnqueueResult<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(3))?;
        match self {
            EnqueueResult::Accepted { value, load } => {
                map.serialize_entry("success", &true)?;
                map.serialize_entry("value", value)?;
                map.serialize_entry("load", load)?;
            }
            EnqueueResult::Rejected { error, load } => {
                map.serialize_entry("success", &false)?;
                map.serialize_entry("error", &error.serialize())?;
                map.serialize_entry("load", load)?;
            }
        }
        map.end()
    }
}

/// The sorted, validated targets of one registration and their stored JSON.
pub(crate) struct TargetSet {
    pub ids: Vec<String>,
    pub json: String,
}

impl TargetSet {
    /// Sorted the way JavaScript sorts strings (by UTF-16 code units), so
    /// the stored JSON is the reference library's byte for byte.
    pub(crate) fn new(mut ids: Vec<String>) -> Self {
        ids.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
        let json = serde_json::to_string(&ids).unwrap_or_default();
        TargetSet { ids, json }
    }
}

/// One message ready to register.
pub(crate) struct Entry {
    pub key: String,
    pub id: String,
    pub payload: String,
    pub targets: Rc<TargetSet>,
}

/// One delivery row a registration inserted.
pub(crate) struct Registered {
    pub message_id: String,
    pub target: String,
    pub generation: String,
    pub created_at: EpochMs,
}

/// Why a registration transaction did not commit.
pub(crate) enum RegisterError {
    /// Definite: the batch rolled back and nothing was written.
    Rejected(EnqueueRejection),
    /// Uncertain.
    Failed(FanoutError),
}

impl From<StorageError> for RegisterError {
    fn from(error: StorageError) -> Self {
        RegisterError::Failed(error.into())
    }
}

impl From<FanoutError> for RegisterError {
    fn from(error: FanoutError) -> Self {
        RegisterError::Failed(error)
    }
}

impl<B> Fanout<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// Accepts `messages` for `options.targets` (every target when `None`):
    /// the whole batch and its frozen target set commit together, or
    /// nothing does.
    ///
    /// `Ok(Rejected)` is a definite rejection with nothing written: more
    /// than `max_enqueue_messages` messages, an empty or unknown or repeated
    /// target, an empty id or key or one longer than
    /// [`MAX_ID_BYTES`](crate::limits::MAX_ID_BYTES), a body that is not
    /// JSON or is larger than `max_body_bytes`, or a deduplication key
    /// already naming other work. `Err` means storage failed and the batch may or may not have
    /// committed. A message whose key is retained with the same id, body and
    /// targets is accepted again without new rows. An empty batch is
    /// accepted and writes nothing.
    pub async fn enqueue(
        &self,
        messages: Vec<FanoutInput<B>>,
        options: &EnqueueOptions,
    ) -> Result<EnqueueResult<Vec<String>>, FanoutError> {
        let inner = &self.inner;
        let inbound = inner.routing.begin(Direction::Inbound);
        let entries = inner
            .resolve_targets(options.targets.as_deref())
            .and_then(|targets| inner.prepare(messages, &targets));
        let entries = match entries {
            Ok(entries) => entries,
            Err(rejection) => {
                inbound.finish();
                return Ok(EnqueueResult::Rejected {
                    error: rejection,
                    load: inner.load()?,
                });
            }
        };
        let ids: Vec<String> = entries.iter().map(|entry| entry.id.clone()).collect();
        let registered = inner.register(move |_| Ok(entries)).await;
        inbound.finish();
        match registered {
            Ok(registered) => {
                inner.after_registration(&registered);
                Ok(EnqueueResult::Accepted {
                    value: ids,
                    load: inner.load()?,
                })
            }
            Err(RegisterError::Rejected(rejection)) => Ok(EnqueueResult::Rejected {
                error: rejection,
                load: inner.load()?,
            }),
            Err(RegisterError::Failed(error)) => Err(error),
        }
    }

    /// [`Fanout::enqueue`] for one message; the value is its id.
    pub async fn enqueue_one(
        &self,
        message: FanoutInput<B>,
        options: &EnqueueOptions,
    ) -> Result<EnqueueResult<String>, FanoutError> {
        Ok(match self.enqueue(vec![message], options).await? {
            EnqueueResult::Accepted { value, load } => EnqueueResult::Accepted {
                value: value.into_iter().next().unwrap_or_default(),
                load,
            },
            EnqueueResult::Rejected { error, load } => EnqueueResult::Rejected { error, load },
        })
    }
}

impl<B> Inner<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// At most `max_enqueue_messages` messages (or parked ids) per call: a
    /// call is one transaction, which holds the object's only writer.
    pub(crate) fn check_count(&self, count: usize) -> Result<(), EnqueueRejection> {
        if count > self.max_enqueue_messages {
            return Err(EnqueueRejection::TooManyMessages(LimitError::TooMany {
                field: "messages",
                count,
                max: self.max_enqueue_messages,
                limit: "max_enqueue_messages",
            }));
        }
        Ok(())
    }

    /// The requested targets, or all of them, checked and sorted.
    pub(crate) fn resolve_targets(
        &self,
        requested: Option<&[String]>,
    ) -> Result<Rc<TargetSet>, EnqueueRejection> {
        let ids: Vec<String> = match requested {
            Some(ids) => ids.to_vec(),
            None => self.targets.keys().cloned().collect(),
        };
        if ids.is_empty() {
            return Err(EnqueueRejection::NoTargets);
        }
        let set = TargetSet::new(ids);
        for (index, id) in set.ids.iter().enumerate() {
            if !self.targets.contains_key(id) {
                return Err(EnqueueRejection::UnknownTarget { target: id.clone() });
            }
            if index > 0 && set.ids[index - 1] == *id {
                return Err(EnqueueRejection::DuplicateTarget { target: id.clone() });
            }
        }
        Ok(Rc::new(set))
    }

    /// The count, ids, keys and stored bodies, checked before any storage is
    /// touched.
    fn prepare(
        &self,
        messages: Vec<FanoutInput<B>>,
        targets: &Rc<TargetSet>,
    ) -> Result<Vec<Entry>, EnqueueRejection> {
        self.check_count(messages.len())?;
        let mut entries = Vec::with_capacity(messages.len());
        for (index, message) in messages.into_iter().enumerate() {
            let id = message.id.unwrap_or_else(|| self.engine.new_generation());
            let key = message.deduplication_key.unwrap_or_else(|| id.clone());
            if id.is_empty() {
                return Err(EnqueueRejection::EmptyId { index, field: "id" });
            }
            if key.is_empty() {
                return Err(EnqueueRejection::EmptyId {
                    index,
                    field: "deduplication key",
                });
            }
            let too_long = |limit| EnqueueRejection::Limit { index, limit };
            limits::check_id("id", &id).map_err(too_long)?;
            limits::check_id("deduplication key", &key).map_err(too_long)?;
            let payload = codec::encode(&message.body)
                .map_err(|source| EnqueueRejection::BodyNotJson { index, source })?;
            let bytes = codec::body_bytes(&payload);
            if bytes > self.max_body_bytes {
                return Err(EnqueueRejection::BodyTooLarge {
                    index,
                    bytes,
                    max_bytes: self.max_body_bytes,
                });
            }
            entries.push(Entry {
                key,
                id,
                payload,
                targets: Rc::clone(targets),
            });
        }
        Ok(entries)
    }

    /// Registers the entries `prepare` returns (it runs inside the
    /// transaction, so a redrive can read and delete what it registers),
    /// processing them in order: a retained key with identical work is
    /// skipped, one naming different work rejects the whole batch. The
    /// alarm is reconciled in the same commit.
    pub(crate) async fn register(
        &self,
        prepare: impl FnOnce(&dyn Sql) -> Result<Vec<Entry>, RegisterError>,
    ) -> Result<Vec<Registered>, RegisterError> {
        let trace_context = crate::trace::capture(self.trace.as_ref());
        self.transaction(|sql| {
            let mut registered = Vec::new();
            let first_seq = store::read_next_seq(sql)?;
            let mut next_seq = first_seq;
            // Consecutive messages with one target set and one due time
            // share a span per target: one row per call and target.
            let mut spans: Vec<(Rc<TargetSet>, i64, i64, EpochMs)> = Vec::new();
            for entry in prepare(sql)? {
                if let Some(existing) = store::read_manifest(sql, &entry.key)? {
                    if existing.id != entry.id
                        || existing.payload != entry.payload
                        || existing.targets != entry.targets.json
                    {
                        return Err(RegisterError::Rejected(
                            EnqueueRejection::DeduplicationConflict { key: entry.key },
                        ));
                    }
                    continue;
                }
                let created_at = self.engine.now();
                let seq = next_seq;
                next_seq += 1;
                let manifest = Manifest {
                    seq,
                    targets: entry.targets.json.clone(),
                    key: entry.key,
                    id: entry.id,
                    payload: entry.payload,
                    created_at,
                    generation: self.engine.new_generation(),
                };
                store::insert_manifest(sql, &manifest)?;
                let due_at = self.first_attempt_at(created_at);
                match spans.last_mut() {
                    Some((targets, _, last, due))
                        if targets.json == entry.targets.json && *due == due_at =>
                    {
                        *last = seq;
                    }
                    _ => spans.push((Rc::clone(&entry.targets), seq, seq, due_at)),
                }
                for target in &entry.targets.ids {
                    if let Some(context) = &trace_context {
                        let delivery = json_pair(&manifest.key, target);
                        crate::trace::store(
                            sql,
                            DELIVERIES,
                            &delivery,
                            &manifest.generation,
                            created_at,
                            context,
                        )?;
                    }
                    self.adjust_pending(1);
                    registered.push(Registered {
                        message_id: manifest.id.clone(),
                        target: target.clone(),
                        generation: manifest.generation.clone(),
                        created_at,
                    });
                }
            }
            for (targets, first, last, due_at) in &spans {
                for target in &targets.ids {
                    store::ensure_cursor(sql, target)?;
                    store::insert_span(sql, target, *first, *last, *due_at)?;
                }
            }
            if next_seq != first_seq {
                store::store_next_seq(sql, next_seq)?;
            }
            Ok(registered)
        })
        .await
    }

    /// After a registration committed: one `registered` event per inserted
    /// row, and, when first deliveries are due at once, a pass in the
    /// background (its failure is logged, never returned to the caller).
    pub(crate) fn after_registration(self: &Rc<Self>, registered: &[Registered]) {
        for row in registered {
            self.emit(|| LifecycleEvent::Registered {
                entity: entity(&row.message_id, &row.target, &row.generation),
                timestamp: row.created_at,
            });
        }
        // Delayed first deliveries are not due yet: the timer or the alarm
        // armed by the commit runs them at their window.
        if registered.is_empty() || self.batch_delay_ms != 0 {
            return;
        }
        let inner = Rc::clone(self);
        // The first pass is linked to the producer's span, so a trace leads
        // from the request that enqueued to the deliveries it caused.
        let span = tracing::info_span!(
            parent: None,
            "fanout_after_enqueue",
            object = %self.engine.ctx.id(),
            deliveries = registered.len(),
        );
        span.follows_from(tracing::Span::current());
        let task = async move {
            let result = match Rc::clone(&inner).run_due().await {
                Ok(()) => inner
                    .engine
                    .schedule_next_alarm()
                    .await
                    .map_err(FanoutError::from),
                Err(error) => Err(error),
            };
            if let Err(error) = result {
                tracing::error!(
                    event = "durability.fanout.failed",
                    %error,
                    "background fanout pass failed"
                );
            }
        };
        self.engine
            .ctx
            .wait_until(Box::pin(tracing::Instrument::instrument(task, span)));
    }
}
