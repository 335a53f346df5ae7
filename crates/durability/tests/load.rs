//! Load snapshots (queues.md §2): one test per invariant of §2.5, on paused
//! time, with the clock of a real object.

mod support;

use std::time::Duration;

use durability::load::{Direction, Load};

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

// §2.5 (1)
#[tokio::test(start_paused = true)]
async fn no_samples_is_an_absent_average_never_zero() {
    support::on_harness(|h| async move {
        let load = Load::for_context(&h.context());
        let empty = load.snapshot(0);
        assert_eq!(empty.inbound.completed, 0);
        assert_eq!(empty.inbound.average_processing_ms, None);
        assert_eq!(empty.outbound.average_processing_ms, None);
        // An instant sample is an average of zero, which is not "none".
        load.begin(Direction::Outbound).finish();
        let instant = load.snapshot(0);
        assert_eq!(instant.outbound.completed, 1);
        assert_eq!(instant.outbound.average_processing_ms, Some(0.0));
        assert_eq!(instant.inbound.average_processing_ms, None);
        // Once the window has passed it, "none" again.
        sleep_ms(61_000).await;
        let later = load.snapshot(0);
        assert_eq!(later.outbound.completed, 0);
        assert_eq!(later.outbound.average_processing_ms, None);
        let json = serde_json::to_value(later).unwrap();
        assert!(json["outbound"]["averageProcessingMs"].is_null());
    })
    .await;
}

// §2.5 (2)
#[tokio::test(start_paused = true)]
async fn in_flight_is_instantaneous_and_returns_to_where_it_was_after_finish() {
    support::on_harness(|h| async move {
        let load = Load::for_context(&h.context());
        let first = load.begin(Direction::Inbound);
        let second = load.begin(Direction::Inbound);
        let outbound = load.begin(Direction::Outbound);
        assert_eq!(load.snapshot(0).inbound.in_flight, 2);
        assert_eq!(load.snapshot(0).outbound.in_flight, 1);
        // Never windowed: still in flight a long time later.
        sleep_ms(3_600_000).await;
        assert_eq!(load.snapshot(0).inbound.in_flight, 2);
        first.finish();
        assert_eq!(load.snapshot(0).inbound.in_flight, 1);
        // Dropping finishes too, exactly once.
        drop(second);
        drop(outbound);
        let snapshot = load.snapshot(0);
        assert_eq!(snapshot.inbound.in_flight, 0);
        assert_eq!(snapshot.outbound.in_flight, 0);
        assert_eq!(snapshot.inbound.completed, 2);
        assert_eq!(snapshot.inbound.average_processing_ms, Some(3_600_000.0));
        // Clones share the counters.
        let shared = load.clone();
        let guard = shared.begin(Direction::Outbound);
        assert_eq!(load.snapshot(0).outbound.in_flight, 1);
        guard.finish();
        assert_eq!(load.snapshot(0).outbound.in_flight, 0);
    })
    .await;
}

// §2.5 (3)
#[tokio::test(start_paused = true)]
async fn a_sample_older_than_sixty_whole_seconds_never_contributes() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let load = Load::for_context(&ctx);
        // Align on the start of a second, so the boundaries are exact.
        let now = ctx.now_ms();
        sleep_ms(u64::try_from(1_000 - now.rem_euclid(1_000)).unwrap()).await;
        let slow = load.begin(Direction::Inbound);
        sleep_ms(400).await;
        slow.finish(); // finished in second S, took 400 ms
        sleep_ms(1_000).await;
        let quick = load.begin(Direction::Inbound);
        sleep_ms(100).await;
        quick.finish(); // second S + 1, took 100 ms
        let both = load.snapshot(0);
        assert_eq!(both.inbound.completed, 2);
        assert_eq!(both.inbound.average_processing_ms, Some(250.0));
        // Second S is still the oldest of the 60 the window holds...
        sleep_ms(58_000).await;
        assert_eq!(load.snapshot(0).inbound.completed, 2);
        // ...and not one second later, while S + 1 still is.
        sleep_ms(1_000).await;
        let one = load.snapshot(0);
        assert_eq!(one.inbound.completed, 1);
        assert_eq!(one.inbound.average_processing_ms, Some(100.0));
        // Buckets are reused as the window turns: an old sample in a reused
        // slot never adds to a new one.
        sleep_ms(120_000).await;
        load.begin(Direction::Inbound).finish();
        let reused = load.snapshot(0);
        assert_eq!(reused.inbound.completed, 1);
        assert_eq!(reused.inbound.average_processing_ms, Some(0.0));
    })
    .await;
}

// §2.5 (4)
#[tokio::test(start_paused = true)]
async fn pending_deliveries_is_exactly_the_argument() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let load = Load::for_context(&ctx);
        for pending in [0, 1, 17, u64::MAX] {
            let snapshot = load.snapshot(pending);
            assert_eq!(snapshot.outbound.pending_deliveries, pending);
            assert_eq!(snapshot.observed_at, ctx.now_ms());
            assert_eq!(snapshot.window_ms, 60_000);
        }
    })
    .await;
}
