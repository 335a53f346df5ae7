//! What the client remembers of each shard: the newest load snapshot a
//! reply carried, for at most [`MAX_OBSERVED_SHARDS`] shards and at most
//! [`OBSERVATION_TTL_MS`] after the object took it.
//!
//! Two ordered indexes make every step O(log n) whatever the number of
//! shards: one by recording order (a recorded shard moves to the end; the
//! oldest is evicted past the bound) and one by `observed_at` (expiry pops
//! from the front). A push therefore never walks the table.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use durability_platform::EpochMs;

use super::adaptive::Adaptive;
use crate::load::{LOAD_WINDOW_MS, LoadSnapshot};

/// The most shards a client remembers; past it the shard recorded least
/// recently is forgotten.
pub const MAX_OBSERVED_SHARDS: usize = 1_024;

/// How long a snapshot stays usable after the object took it: the load
/// window. An older one describes a minute that is over.
pub const OBSERVATION_TTL_MS: EpochMs = LOAD_WINDOW_MS as EpochMs;

struct Entry {
    snapshot: LoadSnapshot,
    order: u64,
}

/// The bounded, expiring map from shard key to its newest snapshot.
#[derive(Default)]
pub(crate) struct ObservationTable {
    entries: HashMap<Arc<str>, Entry>,
    by_order: BTreeMap<u64, Arc<str>>,
    by_age: BTreeSet<(EpochMs, u64)>,
    next_order: u64,
}

/// Whether a snapshot taken at `observed_at` is too old to use at `now`.
pub(crate) fn is_stale(observed_at: EpochMs, now: EpochMs) -> bool {
    now.saturating_sub(observed_at) >= OBSERVATION_TTL_MS
}

impl ObservationTable {
    /// Forgets every snapshot that is stale at `now`.
    pub(crate) fn expire(&mut self, now: EpochMs) {
        while let Some(&(observed_at, order)) = self.by_age.first() {
            if !is_stale(observed_at, now) {
                break;
            }
            self.by_age.pop_first();
            if let Some(shard) = self.by_order.remove(&order) {
                self.entries.remove(&shard);
            }
        }
    }

    /// Records `snapshot` as the newest of `shard`, unless a newer one is
    /// already held (replies can arrive out of order) or it is already
    /// stale (it would only be expired again, possibly after evicting a
    /// live entry). Returns whether it was recorded.
    pub(crate) fn record(&mut self, shard: &str, snapshot: LoadSnapshot, now: EpochMs) -> bool {
        if is_stale(snapshot.observed_at, now) {
            return false;
        }
        let key: Arc<str> = match self.entries.get_key_value(shard) {
            Some((key, held)) => {
                if snapshot.observed_at < held.snapshot.observed_at {
                    return false;
                }
                let key = Arc::clone(key);
                self.forget(&key);
                key
            }
            None => Arc::from(shard),
        };
        let order = self.next_order;
        self.next_order += 1;
        self.by_order.insert(order, Arc::clone(&key));
        self.by_age.insert((snapshot.observed_at, order));
        self.entries.insert(key, Entry { snapshot, order });
        if self.entries.len() > MAX_OBSERVED_SHARDS
            && let Some((_, oldest)) = self.by_order.first_key_value()
        {
            let oldest = Arc::clone(oldest);
            self.forget(&oldest);
        }
        true
    }

    fn forget(&mut self, shard: &str) {
        if let Some(entry) = self.entries.remove(shard) {
            self.by_order.remove(&entry.order);
            self.by_age
                .remove(&(entry.snapshot.observed_at, entry.order));
        }
    }

    /// The snapshot of `shard`, if one is held.
    pub(crate) fn get(&self, shard: &str) -> Option<&LoadSnapshot> {
        self.entries.get(shard).map(|entry| &entry.snapshot)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Copies of every snapshot fresh at `now`.
    pub(crate) fn fresh(&self, now: EpochMs) -> HashMap<String, LoadSnapshot> {
        self.entries
            .iter()
            .filter(|(_, entry)| !is_stale(entry.snapshot.observed_at, now))
            .map(|(shard, entry)| (shard.to_string(), entry.snapshot))
            .collect()
    }
}

/// What a client changes on every push: its observations and the default
/// algorithm's width. One lock for both, so a push takes it twice (to
/// choose, to learn) and threads that share the client rarely queue on it.
pub(crate) struct RoutingState {
    pub(crate) table: ObservationTable,
    pub(crate) adaptive: Adaptive,
}

/// Locks the state. No code runs under this lock but the table's and the
/// width's own O(log n) steps (never an await, never the application's
/// code), so a poisoned lock (a panic elsewhere in the holder's thread)
/// still guards consistent state and is taken over.
pub(crate) fn lock(state: &Mutex<RoutingState>) -> MutexGuard<'_, RoutingState> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The client's recent observations, as custom sharding sees them during
/// one push: every snapshot it returns is younger than
/// [`OBSERVATION_TTL_MS`] at the push's start.
///
/// It reads the client's table on each call rather than copying it for
/// every push (a copy of 1,024 shards per push would cost more than the
/// choice): [`Observations::get`] sees replies of concurrent pushes as they
/// land. [`Observations::to_map`] takes a consistent copy when a sharding
/// function needs one. Nothing here can change what the client holds.
pub struct Observations<'a> {
    state: &'a Mutex<RoutingState>,
    now: EpochMs,
}

impl<'a> Observations<'a> {
    pub(crate) fn new(state: &'a Mutex<RoutingState>, now: EpochMs) -> Self {
        Observations { state, now }
    }

    /// When the push started, by the client's clock (epoch ms).
    pub fn now_ms(&self) -> EpochMs {
        self.now
    }

    /// The newest snapshot of `shard`, if a fresh one is held.
    pub fn get(&self, shard: &str) -> Option<LoadSnapshot> {
        lock(self.state)
            .table
            .get(shard)
            .filter(|snapshot| !is_stale(snapshot.observed_at, self.now))
            .copied()
    }

    /// How many shards have a fresh snapshot.
    pub fn len(&self) -> usize {
        self.to_map().len()
    }

    /// Whether no shard has a fresh snapshot.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of every fresh snapshot, by shard key.
    pub fn to_map(&self) -> HashMap<String, LoadSnapshot> {
        lock(self.state).table.fresh(self.now)
    }
}

impl std::fmt::Debug for Observations<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observations")
            .field("now", &self.now)
            .field("shards", &lock(self.state).table.len())
            .finish()
    }
}
