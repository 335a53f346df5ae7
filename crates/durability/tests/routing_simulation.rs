//! The default adaptive algorithm (queues.md §4.5) over 64 simulated
//! objects on paused time: a producer with skewed batch sizes floods it,
//! then trickles. The width must grow under backlog, one shard a second at
//! most, send pushes to every shard it opened and to no other, favour the
//! shards that drain fast, and give the shards back one a minute once they
//! are shallow and idle.
//!
//! The objects are simulated (a backlog that drains at a per-shard rate) so
//! that an hour of traffic runs in a moment; `routing.rs` drives real
//! mailbox objects.

mod routing_support;

use std::collections::{BTreeSet, HashMap};

use durability::platform::EpochMs;
use durability::routing::{CallContext, RoutingClient, shard_key};
use routing_support::{SimShards, advance_ms, paused_clock};

/// Objects in the namespace, and the most the client may widen to.
const OBJECTS: u64 = 64;
/// Messages a second a normal shard drains.
const FAST_RATE: u64 = 250;
/// Messages a second the skewed shards drain.
const SLOW_RATE: u64 = 25;

/// The skewed shards: the odd ones among the first sixteen, so that slow
/// and fast shards open at about the same time.
fn is_slow(n: u64) -> bool {
    n % 2 == 1 && n < 16
}
/// Batch sizes the producer cycles through: mostly single messages, now
/// and then a bulk batch (mean 25.3 messages).
const BATCH_SIZES: [u64; 10] = [1, 3, 1, 10, 1, 1, 200, 1, 30, 5];
const TICK_MS: u64 = 100;
/// Pushes per tick while flooding: 200 batches, about 5,000 messages a
/// second, what twenty normal shards drain.
const FLOOD_PUSHES_PER_TICK: usize = 20;
const FLOOD_SECONDS: u64 = 40;
const TRICKLE_MINUTES: u64 = 80;

struct Simulation {
    shards: SimShards,
    client: RoutingClient<SimShards>,
    clock: Box<dyn Fn() -> EpochMs>,
    sizes: std::iter::Cycle<std::array::IntoIter<u64, 10>>,
}

impl Simulation {
    fn new() -> Self {
        let clock = paused_clock();
        let rates: HashMap<String, u64> = (0..OBJECTS)
            .filter(|n| is_slow(*n))
            .map(|n| (shard_key(n), SLOW_RATE))
            .collect();
        let shards = SimShards::new(clock.clone(), FAST_RATE, rates);
        let client = RoutingClient::builder(shards.clone(), clock.clone())
            .max_width(OBJECTS)
            .seed(64)
            .build()
            .expect("valid options");
        Simulation {
            shards,
            client,
            clock: Box::new(clock),
            sizes: BATCH_SIZES.into_iter().cycle(),
        }
    }

    async fn push(&mut self) -> String {
        let size = self.sizes.next().unwrap_or(1);
        let before = self.shards.pushes();
        self.client
            .push(size, CallContext::new())
            .await
            .expect("simulated shards always answer");
        let after = self.shards.pushes();
        after
            .into_iter()
            .find(|(shard, count)| before.get(shard).copied().unwrap_or(0) < *count)
            .map(|(shard, _)| shard)
            .unwrap_or_default()
    }

    fn now(&self) -> EpochMs {
        (self.clock)()
    }
}

/// Each width change as (time, new width).
fn changes(samples: &[(EpochMs, u64)]) -> Vec<(EpochMs, u64)> {
    samples
        .windows(2)
        .filter(|pair| pair[0].1 != pair[1].1)
        .map(|pair| pair[1])
        .collect()
}

#[tokio::test(start_paused = true)]
async fn default_algorithm_widens_under_backlog_and_narrows_when_idle_over_64_objects() {
    let mut sim = Simulation::new();
    let mut samples = vec![(sim.now(), sim.client.width())];
    let mut flooded = BTreeSet::new();

    // Flood.
    for _ in 0..(FLOOD_SECONDS * 1_000 / TICK_MS) {
        for _ in 0..FLOOD_PUSHES_PER_TICK {
            flooded.insert(sim.push().await);
            samples.push((sim.now(), sim.client.width()));
        }
        advance_ms(TICK_MS).await;
    }
    let peak = sim.client.width();
    let widening = changes(&samples);
    assert!(
        peak >= 15,
        "a flood of twenty shards' worth widens the client: {widening:?}"
    );
    assert!(peak <= FLOOD_SECONDS + 1, "one step a second at most");
    assert!(
        widening.iter().all(|(_, width)| *width > 1),
        "only widening"
    );
    for pair in widening.windows(2) {
        assert_eq!(pair[1].1, pair[0].1 + 1, "one shard at a time");
        assert!(
            pair[1].0 - pair[0].0 >= 1_000,
            "a second apart: {widening:?}"
        );
    }
    // Every shard the width opened took pushes, and no other did.
    let opened: BTreeSet<String> = (0..peak).map(shard_key).collect();
    assert_eq!(flooded, opened);

    // Trickle: one single message a second. The slow shards hold more
    // than the limit for a few more minutes, and a push that draws one of
    // them still widens (a reply is evidence of backlog however little is
    // pushed); then the shards drain and the width comes back, one shard a
    // minute at most.
    let trickle_start = samples.len() - 1;
    let mut last_minute = BTreeSet::new();
    for second in 0..(TRICKLE_MINUTES * 60) {
        let shard = sim.push().await;
        samples.push((sim.now(), sim.client.width()));
        if second >= TRICKLE_MINUTES * 60 - 60 {
            last_minute.insert(shard);
        }
        advance_ms(1_000).await;
    }
    let trickle = changes(&samples[trickle_start..]);
    let widest = trickle
        .iter()
        .map(|(_, width)| *width)
        .max()
        .unwrap_or(peak)
        .max(peak);
    assert_eq!(
        sim.client.width(),
        1,
        "narrowed back to one shard: {trickle:?}"
    );
    let narrowings = trickle
        .windows(2)
        .filter(|pair| pair[1].1 < pair[0].1)
        .count();
    assert_eq!(
        u64::try_from(narrowings).expect("fits"),
        widest - 1,
        "one step per shard given back: {trickle:?}"
    );
    let all = changes(&samples);
    for pair in all.windows(2) {
        let ((before_at, before), (at, width)) = (pair[0], pair[1]);
        assert_eq!(before.abs_diff(width), 1, "one shard at a time");
        if width < before {
            assert!(
                at - before_at >= 60_000,
                "a narrowing a minute after any change: {all:?}"
            );
        } else {
            assert!(
                at - before_at >= 1_000,
                "a widening a second after any change: {all:?}"
            );
        }
    }
    assert_eq!(
        last_minute.into_iter().collect::<Vec<_>>(),
        [shard_key(0)],
        "at width one every push goes to shard-0"
    );
    assert!(sim.shards.backlogs().values().all(|backlog| *backlog == 0));
}

#[tokio::test(start_paused = true)]
async fn slow_shards_receive_less_of_a_flood_than_fast_ones() {
    let mut sim = Simulation::new();
    for _ in 0..(FLOOD_SECONDS * 1_000 / TICK_MS) {
        for _ in 0..FLOOD_PUSHES_PER_TICK {
            sim.push().await;
        }
        advance_ms(TICK_MS).await;
    }
    let pushes = sim.shards.pushes();
    let width = sim.client.width();
    let average = |slow: bool| {
        let shards: Vec<u64> = (1..16).filter(|n| is_slow(*n) == slow).collect();
        let total: u64 = shards
            .iter()
            .map(|n| pushes.get(&shard_key(*n)).copied().unwrap_or(0))
            .sum();
        total / u64::try_from(shards.len()).expect("fits")
    };
    // shard-0 is the only shard for the first second; the others opened
    // in turn, slow and fast alternating.
    let (slow, fast) = (average(true), average(false));
    assert!(width >= 16);
    assert!(
        slow * 4 < fast * 3,
        "a shard draining ten times slower reports more backlog and loses two-choice draws: \
         slow {slow} vs fast {fast} pushes per shard"
    );
}
