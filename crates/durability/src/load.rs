//! Load telemetry (§2, the reference's `RoutingLoad`): how busy an object is
//! now and over the last minute, for producers and routers deciding where to
//! send work.
//!
//! Everything here is in memory and advisory. It is reset when the object is
//! evicted, and the one durable number of a snapshot, the backlog
//! (`pending_deliveries`), is never reconstructed from telemetry: the
//! capability that owns the backlog passes it to [`Load::snapshot`].
//!
//! A [`Load`] counts work in two directions. Each [`Load::begin`] marks one
//! unit of work in flight; finishing it (explicitly or by dropping the
//! guard) records a sample in the one-second bucket of the second it
//! *finished* in. Sixty buckets per direction make the rolling window, so
//! memory stays bounded whatever the traffic.
//!
//! ```
//! use durability::load::{Direction, Load};
//! use std::cell::Cell;
//! use std::rc::Rc;
//!
//! let now = Rc::new(Cell::new(10_000_i64));
//! let clock = Rc::clone(&now);
//! let load = Load::new(move || clock.get());
//!
//! let call = load.begin(Direction::Inbound);
//! assert_eq!(load.snapshot(0).inbound.in_flight, 1);
//! now.set(10_250);
//! call.finish();
//! let snapshot = load.snapshot(3);
//! assert_eq!(snapshot.inbound.in_flight, 0);
//! assert_eq!(snapshot.inbound.completed, 1);
//! assert_eq!(snapshot.inbound.average_processing_ms, Some(250.0));
//! // No outbound sample yet: the average is absent, not zero.
//! assert_eq!(snapshot.outbound.average_processing_ms, None);
//! assert_eq!(snapshot.outbound.pending_deliveries, 3);
//! ```
//!
//! What each capability counts: fanout counts one inbound unit per
//! `enqueue` call (accepted, rejected or failed) and one outbound unit per
//! target batch it delivers; its backlog is the number of (message, target)
//! deliveries still owed.

use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;

use durability_platform::{Context, EpochMs};
use serde::Serialize;

/// The length of the rolling window, in milliseconds.
pub const LOAD_WINDOW_MS: u64 = 60_000;

/// The width of one bucket of the window, in milliseconds.
const BUCKET_MS: EpochMs = 1_000;

/// Buckets per direction: one per second of the window.
const BUCKETS: usize = 60;

/// Which way the work goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Work the object receives (an `enqueue` call).
    Inbound,
    /// Work the object sends on (one target batch of a fanout).
    Outbound,
}

/// The numbers of one direction over the window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Processing {
    /// Units begun and not finished, right now (never windowed).
    pub in_flight: u64,
    /// Units finished within the window.
    pub completed: u64,
    /// Mean duration of the units finished within the window; `None` when
    /// none finished (no samples is not the same as "instant").
    pub average_processing_ms: Option<f64>,
}

/// The outbound numbers, plus the durable backlog.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OutboundProcessing {
    /// Units begun and not finished, right now (never windowed).
    pub in_flight: u64,
    /// Units finished within the window.
    pub completed: u64,
    /// Mean duration of the units finished within the window; `None` when
    /// none finished.
    pub average_processing_ms: Option<f64>,
    /// Work still owed, exactly as the owning capability passed it.
    pub pending_deliveries: u64,
}

/// One reading of an object's load, in the reference library's shape
/// (`observedAt`, `windowMs`, `inbound`, `outbound`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadSnapshot {
    /// When the snapshot was taken (epoch ms).
    pub observed_at: EpochMs,
    /// The window the completed counts and averages cover:
    /// [`LOAD_WINDOW_MS`].
    pub window_ms: u64,
    /// Work received.
    pub inbound: Processing,
    /// Work sent on, and the backlog.
    pub outbound: OutboundProcessing,
}

/// Samples that finished in one second.
#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    second: EpochMs,
    count: u64,
    duration_ms: u64,
}

#[derive(Debug)]
struct DirectionState {
    active: u64,
    buckets: [Bucket; BUCKETS],
}

impl DirectionState {
    fn new() -> Self {
        DirectionState {
            active: 0,
            // Second -1 never matches a real second, so a fresh bucket is
            // replaced on first use and never counted.
            buckets: [Bucket {
                second: -1,
                count: 0,
                duration_ms: 0,
            }; BUCKETS],
        }
    }

    fn record(&mut self, now: EpochMs, duration_ms: u64) {
        let second = now.div_euclid(BUCKET_MS);
        let slot = bucket_slot(second);
        let bucket = &mut self.buckets[slot];
        if bucket.second != second {
            *bucket = Bucket {
                second,
                count: 0,
                duration_ms: 0,
            };
        }
        bucket.count = bucket.count.saturating_add(1);
        bucket.duration_ms = bucket.duration_ms.saturating_add(duration_ms);
    }

    /// The current second and the 59 before it.
    fn processing(&self, now: EpochMs) -> (u64, Option<f64>) {
        let current = now.div_euclid(BUCKET_MS);
        let oldest = current - (BUCKETS as EpochMs - 1);
        let (count, duration_ms) = self
            .buckets
            .iter()
            .filter(|bucket| (oldest..=current).contains(&bucket.second))
            .fold((0_u64, 0_u64), |(count, duration), bucket| {
                (
                    count.saturating_add(bucket.count),
                    duration.saturating_add(bucket.duration_ms),
                )
            });
        #[allow(clippy::cast_precision_loss)] // an average; counts stay far below 2^53
        let average = (count > 0).then(|| duration_ms as f64 / count as f64);
        (count, average)
    }
}

fn bucket_slot(second: EpochMs) -> usize {
    // rem_euclid of a positive modulus is in 0..BUCKETS, so it fits a usize.
    usize::try_from(second.rem_euclid(BUCKETS as EpochMs)).unwrap_or(0)
}

struct State {
    inbound: DirectionState,
    outbound: DirectionState,
}

impl State {
    fn direction(&mut self, direction: Direction) -> &mut DirectionState {
        match direction {
            Direction::Inbound => &mut self.inbound,
            Direction::Outbound => &mut self.outbound,
        }
    }
}

/// The load counters of one object (ref `RoutingLoad`). Several
/// capabilities of one object may share one `Load`; their numbers add up.
///
/// Cloning is one reference-count increment; clones share the counters.
/// Objects run on one thread, so the counters sit in a `RefCell`, never
/// borrowed across an await.
#[derive(Clone)]
pub struct Load {
    state: Rc<RefCell<State>>,
    clock: Rc<dyn Fn() -> EpochMs>,
}

impl Load {
    /// Counters on the given clock (epoch milliseconds).
    pub fn new(clock: impl Fn() -> EpochMs + 'static) -> Self {
        Load {
            state: Rc::new(RefCell::new(State {
                inbound: DirectionState::new(),
                outbound: DirectionState::new(),
            })),
            clock: Rc::new(clock),
        }
    }

    /// Counters on the clock of the object behind `ctx`.
    pub fn for_context(ctx: &Rc<dyn Context>) -> Self {
        let ctx = Rc::clone(ctx);
        Load::new(move || ctx.now_ms())
    }

    /// Marks one unit of work in flight until the returned guard is
    /// finished or dropped.
    pub fn begin(&self, direction: Direction) -> InFlight {
        self.state.borrow_mut().direction(direction).active += 1;
        InFlight {
            load: self.clone(),
            direction,
            started_at: (self.clock)(),
            finished: false,
        }
    }

    /// The counters now, with `pending_deliveries` reported exactly as given.
    pub fn snapshot(&self, pending_deliveries: u64) -> LoadSnapshot {
        let now = (self.clock)();
        let state = self.state.borrow();
        let (inbound_completed, inbound_average) = state.inbound.processing(now);
        let (outbound_completed, outbound_average) = state.outbound.processing(now);
        LoadSnapshot {
            observed_at: now,
            window_ms: LOAD_WINDOW_MS,
            inbound: Processing {
                in_flight: state.inbound.active,
                completed: inbound_completed,
                average_processing_ms: inbound_average,
            },
            outbound: OutboundProcessing {
                in_flight: state.outbound.active,
                completed: outbound_completed,
                average_processing_ms: outbound_average,
                pending_deliveries,
            },
        }
    }

    fn finish(&self, direction: Direction, started_at: EpochMs) {
        let now = (self.clock)();
        let duration_ms = u64::try_from(now.saturating_sub(started_at)).unwrap_or(0);
        let mut state = self.state.borrow_mut();
        let counters = state.direction(direction);
        counters.active = counters.active.saturating_sub(1);
        counters.record(now, duration_ms);
    }
}

/// The reference library's name for [`Load`].
pub type RoutingLoad = Load;

impl fmt::Debug for Load {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.borrow();
        f.debug_struct("Load")
            .field("inbound_in_flight", &state.inbound.active)
            .field("outbound_in_flight", &state.outbound.active)
            .finish_non_exhaustive()
    }
}

/// One unit of work in flight. Finishing it records its duration; only the
/// first finish counts, and dropping an unfinished guard finishes it, so the
/// in-flight count always returns to where it was.
#[must_use = "the unit of work finishes when this guard is dropped"]
pub struct InFlight {
    load: Load,
    direction: Direction,
    started_at: EpochMs,
    finished: bool,
}

impl InFlight {
    /// Records the sample now.
    pub fn finish(mut self) {
        self.finish_once();
    }

    fn finish_once(&mut self) {
        if !self.finished {
            self.finished = true;
            self.load.finish(self.direction, self.started_at);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.finish_once();
    }
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("direction", &self.direction)
            .field("started_at", &self.started_at)
            .field("finished", &self.finished)
            .finish()
    }
}
