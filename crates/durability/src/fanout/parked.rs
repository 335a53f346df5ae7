//! Parked dead letters: this port's departure from the reference, which
//! drops a terminal delivery when no DLQ is configured. Here it is parked in
//! the object's own table with its failure (see `settle`), and this module
//! lists, redrives and purges those entries.
//!
//! A redrive registers the parked delivery again, as new work for its one
//! target, and deletes the parked entry in the same transaction, so unlike a
//! redrive from an external DLQ it cannot duplicate work: either the entry
//! is still parked, or its new registration exists. The deduplication key
//! of the new registration is the parked entry's delivery identity, as in
//! the reference's redrive recipe (§3.17).

use std::cell::RefCell;

use durability_platform::EpochMs;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::enqueue::{Entry, RegisterError};
use super::error::{EnqueueRejection, FanoutError};
use super::message::{Failure, StoredMessage};
use super::store::{self, ParkedRow};
use super::{EnqueueResult, Fanout};
use crate::codec;
use crate::error::DurabilityError;
use crate::load::Direction;

impl<B> Fanout<B>
where
    B: Serialize + DeserializeOwned + 'static,
{
    /// Up to `limit` parked dead letters, oldest first, after `after` (the
    /// last entry of the previous page). Each is a [`StoredMessage`] with its
    /// failure; `stored_at` is when it was parked.
    ///
    /// An entry whose body does not decode as `B` (stored before a change of
    /// the body type) never hides the others: the page ends before it, and
    /// a page that would start with it fails with
    /// [`DurabilityError::Decode`] naming its id, which
    /// [`purge_parked`](Fanout::purge_parked) removes (after reading it with
    /// a `Fanout<serde_json::Value>` if it must be migrated).
    pub fn parked(
        &self,
        after: Option<&StoredMessage<B>>,
        limit: usize,
    ) -> Result<Vec<StoredMessage<B>>, FanoutError> {
        let rows = store::list_parked(
            self.inner.engine.sql(),
            after.map(|entry| (entry.stored_at, entry.id.as_str())),
            limit,
        )?;
        let mut entries = Vec::with_capacity(rows.len());
        for row in rows {
            match stored_message(row) {
                Ok(entry) => entries.push(entry),
                Err(error) if entries.is_empty() => return Err(error),
                Err(_) => break,
            }
        }
        Ok(entries)
    }

    /// Registers the parked deliveries `ids` again, each for its one target,
    /// as new work (attempt 0, a fresh retry budget, no memos), and deletes
    /// them from the parked table, all in one transaction. The value is
    /// their message ids. A missing id (already redriven or purged) or a
    /// target that is no longer configured rejects the whole call with
    /// nothing written.
    pub async fn redrive_parked(
        &self,
        ids: &[&str],
    ) -> Result<EnqueueResult<Vec<String>>, FanoutError> {
        let inner = &self.inner;
        if let Err(error) = inner.check_count(ids.len()) {
            return Ok(EnqueueResult::Rejected {
                error,
                load: inner.load()?,
            });
        }
        let inbound = inner.routing.begin(Direction::Inbound);
        let message_ids = RefCell::new(Vec::with_capacity(ids.len()));
        let registered = inner
            .register(|sql| {
                let mut entries = Vec::with_capacity(ids.len());
                for id in ids {
                    let Some(parked) = store::read_parked(sql, id)? else {
                        return Err(RegisterError::Rejected(EnqueueRejection::UnknownParked {
                            id: (*id).to_owned(),
                        }));
                    };
                    let targets = inner
                        .resolve_targets(Some(std::slice::from_ref(&parked.target_id)))
                        .map_err(RegisterError::Rejected)?;
                    store::delete_parked(sql, id)?;
                    message_ids.borrow_mut().push(parked.message_id.clone());
                    entries.push(Entry {
                        key: parked.id,
                        id: parked.message_id,
                        payload: parked.payload,
                        targets,
                    });
                }
                Ok(entries)
            })
            .await;
        inbound.finish();
        match registered {
            Ok(registered) => {
                inner.after_registration(&registered);
                Ok(EnqueueResult::Accepted {
                    value: message_ids.into_inner(),
                    load: inner.load()?,
                })
            }
            Err(RegisterError::Rejected(error)) => Ok(EnqueueResult::Rejected {
                error,
                load: inner.load()?,
            }),
            Err(RegisterError::Failed(error)) => Err(error),
        }
    }

    /// Deletes the parked deliveries `ids` (missing ones are ignored) in one
    /// transaction; returns how many existed.
    pub fn purge_parked(&self, ids: &[&str]) -> Result<u64, FanoutError> {
        let purged = self.inner.engine.transaction_sync(|sql| {
            let mut purged = 0_u64;
            for id in ids {
                if store::delete_parked(sql, id)? {
                    purged += 1;
                }
            }
            Ok::<_, FanoutError>(purged)
        })?;
        Ok(purged)
    }

    /// Deletes every delivery parked before `before` (epoch ms, a
    /// non-negative safe integer); returns how many.
    pub fn purge_parked_before(&self, before: EpochMs) -> Result<u64, FanoutError> {
        let before = DurabilityError::require_timestamp("before", before)?;
        Ok(store::purge_parked_before(self.inner.engine.sql(), before)?)
    }
}

fn stored_message<B: DeserializeOwned>(row: ParkedRow) -> Result<StoredMessage<B>, FanoutError> {
    let body = codec::decode_as::<B>(&row.payload).map_err(|error| {
        FanoutError::Durability(DurabilityError::Decode {
            table: "durability_fanout_parked",
            key: row.id.clone(),
            detail: error.to_string(),
        })
    })?;
    Ok(StoredMessage {
        id: row.id,
        message_id: row.message_id,
        target: row.target_id,
        body,
        enqueued_at: row.enqueued_at,
        stored_at: row.parked_at,
        attempts: row.attempts,
        failure: Some(Failure {
            reason: row.reason,
            error: row.error,
        }),
    })
}
