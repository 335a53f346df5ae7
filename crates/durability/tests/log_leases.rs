//! Consumer leases of the retained log (queues.md §5.10 and invariant 8 of
//! §5.11) on paused time against a real inline host.

mod log_support;
mod support;

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;
use std::time::Duration;

use durability::log::{Lease, Leases, Log, LogError, PoisonedRange, Retention};
use durability::{HandlerError, Scheduler};
use log_support::{MemoryCold, append, builder, records};
use serde_json::Value;

fn offsets(lease: &Lease<Value>) -> Vec<u64> {
    lease.records.iter().map(|r| r.offset).collect()
}

async fn lease(log: &Log<Value>, consumer: &str, limit: u32) -> Option<Lease<Value>> {
    log.lease(consumer, Some(limit)).await.expect("lease")
}

#[tokio::test(start_paused = true)]
async fn with_leases_no_offset_is_held_twice_and_the_cursor_never_passes_an_unsettled_range() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.leases(Leases::new().max_parallelism(3)).build().unwrap();
        append(&log, records(0, 12)).await;
        let mut held = Vec::new();
        while let Some(lease) = lease(&log, "workers", 2).await {
            held.push(lease);
        }
        // Three live ranges, pairwise disjoint, consecutive.
        assert_eq!(held.len(), 3);
        let all: Vec<u64> = held.iter().flat_map(offsets).collect();
        assert_eq!(all, [0, 1, 2, 3, 4, 5]);
        assert_eq!(all.iter().collect::<BTreeSet<_>>().len(), all.len());
        for lease in &held {
            assert_eq!(lease.records.len(), 2);
            assert_eq!(lease.attempt, 1);
            assert_eq!(
                (lease.first_offset, lease.last_offset),
                (lease.records[0].offset, lease.records[1].offset)
            );
        }
        // Settling later ranges first commits nothing.
        log.ack("workers", &held[2].batch_id).await.unwrap();
        log.ack("workers", &held[1].batch_id).await.unwrap();
        assert_eq!(log.cursor("workers").await.unwrap(), None);
        // A freed slot hands out the next range, not one still held.
        let next = lease(&log, "workers", 2).await.unwrap();
        assert_eq!(offsets(&next), [6, 7]);
        // The first range settles the whole run behind it.
        log.ack("workers", &held[0].batch_id).await.unwrap();
        assert_eq!(log.cursor("workers").await.unwrap(), Some(6));
        log.ack("workers", &next.batch_id).await.unwrap();
        assert_eq!(log.cursor("workers").await.unwrap(), Some(8));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn with_default_options_a_second_lease_in_a_row_is_none() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.leases(Leases::new()).build().unwrap();
        append(&log, records(0, 3)).await;
        let first = log.lease("c", None).await.unwrap().unwrap();
        // The default limit is max_batch_size: everything there is.
        assert_eq!(offsets(&first), [0, 1, 2]);
        assert!(log.lease("c", None).await.unwrap().is_none());
        log.ack("c", &first.batch_id).await.unwrap();
        assert_eq!(log.cursor("c").await.unwrap(), Some(3));
        // Nothing left to hand out.
        assert!(log.lease("c", None).await.unwrap().is_none());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn acking_a_later_range_first_leaves_the_cursor_unset_until_the_earlier_one_settles() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.leases(Leases::new().max_parallelism(2)).build().unwrap();
        append(&log, records(0, 2)).await;
        let a = lease(&log, "c", 1).await.unwrap();
        let b = lease(&log, "c", 1).await.unwrap();
        assert_eq!((offsets(&a), offsets(&b)), (vec![0], vec![1]));
        log.ack("c", &b.batch_id).await.unwrap();
        assert_eq!(log.cursor("c").await.unwrap(), None);
        log.ack("c", &a.batch_id).await.unwrap();
        assert_eq!(log.cursor("c").await.unwrap(), Some(2));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_nack_redelivers_the_range_with_a_new_batch_id_and_the_next_attempt() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.leases(Leases::new()).build().unwrap();
        append(&log, records(0, 4)).await;
        let first = lease(&log, "c", 2).await.unwrap();
        log.nack("c", &first.batch_id).await.unwrap();
        let again = lease(&log, "c", 2).await.unwrap();
        assert_eq!(offsets(&again), [0, 1]);
        assert_eq!(again.attempt, 2);
        assert_ne!(again.batch_id, first.batch_id);
        // The nacked batch id is dead.
        assert!(matches!(
            log.ack("c", &first.batch_id).await,
            Err(LogError::LeaseNotHeld { .. })
        ));
        log.ack("c", &again.batch_id).await.unwrap();
        // Settling twice is an error too.
        assert!(matches!(
            log.ack("c", &again.batch_id).await,
            Err(LogError::LeaseNotHeld { .. })
        ));
        assert_eq!(log.cursor("c").await.unwrap(), Some(2));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_expired_lease_returns_its_range_to_the_pool_and_fences_the_old_holder() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b
            .leases(Leases::new().lease_for(Duration::from_millis(1_000)))
            .build()
            .unwrap();
        append(&log, records(0, 3)).await;
        let first = lease(&log, "c", 3).await.unwrap();
        tokio::time::sleep(Duration::from_millis(999)).await;
        assert!(lease(&log, "c", 3).await.is_none());
        tokio::time::sleep(Duration::from_millis(1)).await;
        let second = lease(&log, "c", 3).await.unwrap();
        assert_eq!(offsets(&second), [0, 1, 2]);
        assert_eq!(second.attempt, 2);
        let error = log.ack("c", &first.batch_id).await.unwrap_err();
        assert!(matches!(error, LogError::LeaseNotHeld { .. }), "{error}");
        log.ack("c", &second.batch_id).await.unwrap();
        assert_eq!(log.cursor("c").await.unwrap(), Some(3));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_late_ack_succeeds_while_nobody_reclaimed_the_range() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b
            .leases(Leases::new().lease_for(Duration::from_millis(1_000)))
            .build()
            .unwrap();
        append(&log, records(0, 2)).await;
        let held = lease(&log, "c", 2).await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        log.ack("c", &held.batch_id).await.unwrap();
        assert_eq!(log.cursor("c").await.unwrap(), Some(2));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn consumers_are_independent() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.leases(Leases::new()).build().unwrap();
        append(&log, records(0, 2)).await;
        let a = lease(&log, "search", 2).await.unwrap();
        let b = lease(&log, "billing", 2).await.unwrap();
        assert_eq!(offsets(&a), offsets(&b));
        // Another consumer's batch id is not ours to settle.
        assert!(log.ack("search", &b.batch_id).await.is_err());
        log.ack("billing", &b.batch_id).await.unwrap();
        assert_eq!(log.cursor("billing").await.unwrap(), Some(2));
        assert_eq!(log.cursor("search").await.unwrap(), None);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_poison_range_is_skipped_durably_before_the_hook_runs_and_the_cursor_moves_past_it() {
    support::on_harness(|h| async move {
        let poisoned: Rc<RefCell<Vec<(PoisonedRange, bool)>>> = Rc::default();
        let seen = Rc::clone(&poisoned);
        let ctx = h.context();
        let (_s, b) = builder(&h);
        let log = b
            .leases(Leases::new().max_attempts(2).on_poison(move |range| {
                // By the time the hook runs, the skip is stored and the
                // cursor has moved past the skipped range.
                let cursor = support::query_i64(
                    &*ctx,
                    "SELECT \"offset\" FROM durability_log_cursors WHERE consumer = 'c'",
                    &[],
                );
                seen.borrow_mut().push((range, cursor == 2));
                async { Err::<(), _>(HandlerError::new("the hook may fail; nothing changes")) }
            }))
            .build()
            .unwrap();
        append(&log, records(0, 4)).await;
        for attempt in 1..=2 {
            let held = lease(&log, "c", 2).await.unwrap();
            assert_eq!((offsets(&held), held.attempt), (vec![0, 1], attempt));
            log.nack("c", &held.batch_id).await.unwrap();
        }
        // The third hand-out would exceed max_attempts: skipped, and the
        // same call goes on to the next records.
        let next = lease(&log, "c", 2).await.unwrap();
        assert_eq!(offsets(&next), [2, 3]);
        tokio::task::yield_now().await;
        let calls = poisoned.borrow().clone();
        assert_eq!(calls.len(), 1);
        let (range, stored_first) = &calls[0];
        assert!(stored_first);
        assert_eq!(
            (range.first_offset, range.last_offset, range.attempts),
            (0, 1, 2)
        );
        assert_eq!(log.cursor("c").await.unwrap(), Some(2));
        log.ack("c", &next.batch_id).await.unwrap();
        assert_eq!(log.cursor("c").await.unwrap(), Some(4));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn without_a_poison_hook_max_attempts_never_skips() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.leases(Leases::new().max_attempts(1)).build().unwrap();
        append(&log, records(0, 2)).await;
        for attempt in 1..=4 {
            let held = lease(&log, "c", 1).await.unwrap();
            assert_eq!((offsets(&held), held.attempt), (vec![0], attempt));
            log.nack("c", &held.batch_id).await.unwrap();
        }
        assert_eq!(log.cursor("c").await.unwrap(), None);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn without_the_leases_option_lease_methods_fail_and_no_lease_table_exists() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.build().unwrap();
        append(&log, records(0, 2)).await;
        assert!(matches!(
            log.lease("c", None).await,
            Err(LogError::LeasesDisabled)
        ));
        assert!(matches!(
            log.ack("c", "b").await,
            Err(LogError::LeasesDisabled)
        ));
        assert!(matches!(
            log.nack("c", "b").await,
            Err(LogError::LeasesDisabled)
        ));
        let tables = support::query_i64(
            &*h.context(),
            "SELECT COUNT(*) FROM sqlite_master WHERE name LIKE 'durability_log_lease%' \
             OR name LIKE 'durability_log_alloc%'",
            &[],
        );
        assert_eq!(tables, 0);
        // Plain reads and commits are unchanged.
        log.commit("c", 1).await.unwrap();
        assert_eq!(log.read_from(1).await.unwrap().records.len(), 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn leases_survive_eviction() {
    support::with_host(|host| async move {
        fn open(ctx: Rc<dyn durability_platform::Context>) -> Log<Value> {
            let scheduler = Scheduler::new(ctx).unwrap();
            Log::<Value>::builder(&scheduler)
                .leases(Leases::new().lease_for(Duration::from_secs(10)))
                .build()
                .unwrap()
        }
        let batch_id = host
            .run("p", |ctx| async move {
                let log = open(ctx);
                log.append(records(0, 2)).await.unwrap();
                log.lease("c", None).await.unwrap().unwrap().batch_id
            })
            .await;
        host.evict("p").await;
        // Still held after the restart.
        let (held, reclaimed) = host
            .run("p", |ctx| async move {
                let log = open(ctx);
                let held = log.lease("c", None).await.unwrap().is_none();
                tokio::time::sleep(Duration::from_secs(10)).await;
                let reclaimed = log.lease("c", None).await.unwrap().unwrap();
                (held, (reclaimed.attempt, reclaimed.batch_id))
            })
            .await;
        assert!(held);
        assert_eq!(reclaimed.0, 2);
        assert_ne!(reclaimed.1, batch_id);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_range_flushed_while_held_is_served_from_cold_storage_on_redelivery() {
    support::on_harness(|h| async move {
        let cold = MemoryCold::default();
        let (_s, b) = builder(&h);
        let log = b
            .max_batch_size(4)
            .retention(Retention::new().max_records(1))
            .cold(cold.handle())
            .leases(Leases::new())
            .build()
            .unwrap();
        append(&log, records(0, 4)).await;
        append(&log, records(4, 2)).await;
        let held = lease(&log, "c", 3).await.unwrap();
        assert_eq!(offsets(&held), [0, 1, 2]);
        // Offsets 0..=4 go to two segments, [0..3] and [4].
        assert_eq!(log.trim().await.unwrap(), 5);
        log.nack("c", &held.batch_id).await.unwrap();
        let again = lease(&log, "c", 3).await.unwrap();
        assert_eq!(again.records, held.records);
        log.ack("c", &again.batch_id).await.unwrap();
        // A new range comes from one page: it never spans a segment and the
        // hot table.
        let next = lease(&log, "c", 4).await.unwrap();
        assert_eq!(offsets(&next), [3]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn concurrent_lease_calls_get_disjoint_ranges_while_cold_reads_yield() {
    support::on_harness(|h| async move {
        let cold = MemoryCold::default();
        let (_s, b) = builder(&h);
        let log = b
            .max_batch_size(4)
            .retention(Retention::new().max_records(1))
            .cold(cold.handle())
            .leases(Leases::new().max_parallelism(4))
            .build()
            .unwrap();
        for i in 0..4 {
            append(&log, records(i * 4, 4)).await;
        }
        log.trim().await.unwrap();
        let (a, b, c) = futures::join!(
            lease(&log, "c", 4),
            lease(&log, "c", 4),
            lease(&log, "c", 4)
        );
        let mut all: Vec<u64> = [a, b, c]
            .iter()
            .flat_map(|lease| offsets(lease.as_ref().unwrap()))
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..12).collect::<Vec<_>>());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_range_whose_records_were_trimmed_away_is_truncated_until_the_consumer_commits_past_it() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b
            .retention(Retention::new().max_records(1))
            .leases(Leases::new().lease_for(Duration::from_secs(1)))
            .build()
            .unwrap();
        append(&log, records(0, 3)).await;
        let held = lease(&log, "c", 2).await.unwrap();
        log.trim().await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(matches!(
            log.lease("c", None).await,
            Err(LogError::Truncated {
                requested: 0,
                oldest: 2
            })
        ));
        // Deciding to move on is the consumer's call.
        log.commit("c", 2).await.unwrap();
        let next = log.lease("c", None).await.unwrap().unwrap();
        assert_eq!(offsets(&next), [2]);
        assert!(log.ack("c", &held.batch_id).await.is_err());
    })
    .await;
}

// Issue 10, defect 2: a lease never holds a record its holder cannot read;
// the record at the start of a lease that does not decode is a typed error,
// and committing past it lets the consumer go on.
#[tokio::test(start_paused = true)]
async fn a_record_that_does_not_decode_ends_a_lease_and_is_skipped_by_a_commit() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.leases(Leases::new()).build().unwrap();
        append(&log, records(0, 5)).await;
        let changed = h
            .context()
            .storage()
            .execute(
                "UPDATE durability_log_records SET payload = 'not json' WHERE \"offset\" = 2",
                &[],
            )
            .unwrap();
        assert_eq!(changed, 1);
        let first = lease(&log, "workers", 10).await.unwrap();
        assert_eq!(offsets(&first), [0, 1]);
        log.ack("workers", &first.batch_id).await.unwrap();
        match log.lease("workers", Some(10)).await {
            Err(LogError::Decode { offset: 2, .. }) => {}
            other => panic!("expected a decode error naming offset 2, got {other:?}"),
        }
        log.commit("workers", 3).await.unwrap();
        let rest = lease(&log, "workers", 10).await.unwrap();
        assert_eq!(offsets(&rest), [3, 4]);
    })
    .await;
}

// Issue 10, defect 2: a range handed out before one of its records stopped
// decoding (damage) can never be read again; with a poison hook it is
// skipped as poison at once instead of failing every lease of the consumer.
#[tokio::test(start_paused = true)]
async fn an_owed_range_whose_record_stopped_decoding_is_skipped_as_poison() {
    support::on_harness(|h| async move {
        let poisoned: Rc<RefCell<Vec<PoisonedRange>>> = Rc::default();
        let seen = Rc::clone(&poisoned);
        let (_s, b) = builder(&h);
        let log = b
            .leases(Leases::new().max_attempts(5).on_poison(move |range| {
                seen.borrow_mut().push(range);
                async { Ok::<(), HandlerError>(()) }
            }))
            .build()
            .unwrap();
        append(&log, records(0, 4)).await;
        let held = lease(&log, "c", 2).await.unwrap();
        assert_eq!(offsets(&held), [0, 1]);
        let changed = h
            .context()
            .storage()
            .execute(
                "UPDATE durability_log_records SET payload = 'not json' WHERE \"offset\" = 1",
                &[],
            )
            .unwrap();
        assert_eq!(changed, 1);
        log.nack("c", &held.batch_id).await.unwrap();
        let next = lease(&log, "c", 2).await.unwrap();
        assert_eq!(offsets(&next), [2, 3], "the unreadable range was skipped");
        tokio::task::yield_now().await;
        let calls = poisoned.borrow().clone();
        assert_eq!(calls.len(), 1);
        assert_eq!((calls[0].first_offset, calls[0].last_offset), (0, 1));
        assert_eq!(log.cursor("c").await.unwrap(), Some(2));
    })
    .await;
}
