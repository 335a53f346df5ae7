//! The retained log (queues.md §5) on paused time against a real inline
//! host: the invariants of §5.11, one test each, then appends, reads,
//! cursors, retention and cold segments. Leases are in `log_leases.rs`,
//! crashes in `log_crash.rs`.

mod log_support;
mod support;

use std::rc::Rc;
use std::time::Duration;

use durability::log::{
    AppendRecord, AppendRejection, Appended, LogBounds, LogError, MAX_LOG_BYTES, Read, Retention,
};
use durability::migrations::{LOG_CAPABILITY, LOG_MIGRATIONS};
use durability::{ConfigError, DurabilityError, Log};
use log_support::{MemoryCold, append, builder, read_all, records};
use serde_json::{Value, json};

fn bounds(oldest: u64, hot: u64, next: u64) -> LogBounds {
    LogBounds {
        oldest_offset: oldest,
        hot_offset: hot,
        next_offset: next,
    }
}

fn hot_offsets(h: &support::Harness) -> Vec<i64> {
    h.context()
        .storage()
        .query(
            "SELECT \"offset\" FROM durability_log_records ORDER BY \"offset\"",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get::<i64>(0).unwrap())
        .collect()
}

// ------------------------------------------------------------ §5.11 invariants

#[tokio::test(start_paused = true)]
async fn offsets_are_dense_and_strictly_increasing_in_append_order() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.build().unwrap();
        assert_eq!(append(&log, records(0, 3)).await, [0, 1, 2]);
        assert_eq!(log.bounds().await.unwrap().next_offset, 3);
        // k new distinct keys advance the next offset by exactly k, whatever
        // else the batch repeats.
        let batch = vec![
            AppendRecord::keyed("a", json!(1)),
            AppendRecord::new(json!(2)),
            AppendRecord::keyed("a", json!(1)),
            AppendRecord::keyed("b", json!(3)),
        ];
        assert_eq!(append(&log, batch).await, [3, 4, 3, 5]);
        assert_eq!(log.bounds().await.unwrap().next_offset, 6);
        assert_eq!(hot_offsets(&h), [0, 1, 2, 3, 4, 5]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_batch_is_all_or_nothing_and_repeated_keys_map_to_one_offset() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.max_batch_size(3).build().unwrap();
        append(&log, vec![AppendRecord::keyed("k", json!("v"))]).await;
        let before = support::table_snapshot(&*h.context(), "durability_log_records");
        // Each rejected batch has valid records before its bad one.
        let rejected = [
            vec![
                AppendRecord::new(json!(1)),
                AppendRecord::keyed("", json!(2)),
            ],
            vec![
                AppendRecord::new(json!(1)),
                AppendRecord::keyed("k", json!("other")),
            ],
            records(0, 4),
            Vec::new(),
        ];
        for batch in rejected {
            let outcome = log.append(batch).await.unwrap();
            assert!(outcome.rejection().is_some(), "{outcome:?}");
        }
        assert_eq!(
            support::table_snapshot(&*h.context(), "durability_log_records"),
            before
        );
        assert_eq!(log.bounds().await.unwrap().next_offset, 1);
        // Across batches, a hot key keeps its offset.
        let again = vec![
            AppendRecord::keyed("k", json!("v")),
            AppendRecord::new(json!(0)),
        ];
        assert_eq!(append(&log, again).await, [0, 1]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_cursor_never_decreases() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.build().unwrap();
        append(&log, records(0, 10)).await;
        assert_eq!(log.cursor("c").await.unwrap(), None);
        log.commit("c", 5).await.unwrap();
        log.commit("c", 3).await.unwrap();
        log.commit("c", 5).await.unwrap();
        assert_eq!(log.cursor("c").await.unwrap(), Some(5));
        log.commit("c", 10).await.unwrap();
        assert_eq!(log.cursor("c").await.unwrap(), Some(10));
        // Past the end would skip records appended later: refused.
        let error = log.commit("c", 11).await.unwrap_err();
        assert!(matches!(
            error,
            LogError::CommitBeyondEnd {
                offset: 11,
                next_offset: 10,
                ..
            }
        ));
        assert_eq!(log.cursor("c").await.unwrap(), Some(10));
    })
    .await;
}

/// Issue 10: one damaged hot record blocked every trim to cold storage
/// (the whole pass failed before writing anything). The readable records
/// before it now move; the pass stops at it with `Decode` naming its
/// offset, as a read starting there does.
#[tokio::test(start_paused = true)]
async fn a_damaged_hot_record_stops_a_cold_trim_only_at_itself() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let cold = MemoryCold::default();
        let (_s, b) = builder(&h);
        let log = b
            .max_batch_size(10)
            .retention(Retention::new().max_records(1))
            .cold(cold.handle())
            .build()
            .unwrap();
        append(&log, records(0, 6)).await;
        ctx.storage()
            .execute(
                "UPDATE durability_log_records SET payload = '{not json' WHERE \"offset\" = 3",
                &[],
            )
            .unwrap();
        let error = log.trim().await.unwrap_err();
        assert!(
            matches!(error, LogError::Decode { offset: 3, .. }),
            "{error:?}"
        );
        // Offsets 0 to 2 went to cold and read back; 3 onwards stay hot.
        assert_eq!(cold.locators().len(), 1);
        let page = log.read(Read::from_offset(0)).await.unwrap();
        assert_eq!(
            page.records.iter().map(|r| r.offset).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        assert!(matches!(
            log.read_from(3).await,
            Err(LogError::Decode { offset: 3, .. })
        ));
        let page = log.read(Read::from_offset(4)).await.unwrap();
        assert_eq!(page.records[0].offset, 4);
        // Again: nothing more moves, the same typed error.
        assert!(matches!(
            log.trim().await,
            Err(LogError::Decode { offset: 3, .. })
        ));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn read_never_skips_a_readable_record() {
    support::on_harness(|h| async move {
        let cold = MemoryCold::default();
        let (_s, b) = builder(&h);
        let log = b
            .max_batch_size(4)
            .retention(Retention::new().max_records(5))
            .cold(cold.handle())
            .build()
            .unwrap();
        for i in 0..5 {
            append(&log, records(i * 4, 4)).await;
        }
        log.trim().await.unwrap();
        // Every offset, hot or cold, is the first record of its own read.
        for from in 0..20 {
            let page = log.read(Read::from_offset(from).limit(3)).await.unwrap();
            assert_eq!(page.records[0].offset, from);
            let offsets: Vec<u64> = page.records.iter().map(|r| r.offset).collect();
            let expected: Vec<u64> = (from..from + offsets.len() as u64).collect();
            assert_eq!(offsets, expected);
            assert_eq!(page.next_offset, from + offsets.len() as u64);
        }
        // A hole inside a segment is truncation, not a jump.
        cold.damage(5);
        let error = log.read(Read::from_offset(4)).await;
        let page = error.unwrap();
        assert_eq!(
            page.records.iter().map(|r| r.offset).collect::<Vec<_>>(),
            [4]
        );
        assert!(matches!(
            log.read_from(page.next_offset).await,
            Err(LogError::Truncated {
                requested: 5,
                oldest: 6
            })
        ));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn oldest_offset_le_hot_offset_le_next_offset_at_all_times() {
    support::on_harness(|h| async move {
        let cold = MemoryCold::default();
        let (_s, b) = builder(&h);
        let log = b
            .max_batch_size(10)
            .retention(Retention::new().max_records(10))
            .cold(cold.handle())
            .build()
            .unwrap();
        let check = |b: LogBounds| {
            assert!(b.oldest_offset <= b.hot_offset, "{b:?}");
            assert!(b.hot_offset <= b.next_offset, "{b:?}");
        };
        assert_eq!(log.bounds().await.unwrap(), bounds(0, 0, 0));
        for i in 0..5 {
            append(&log, records(i * 5, 5)).await;
            check(log.bounds().await.unwrap());
        }
        log.trim().await.unwrap();
        assert_eq!(log.bounds().await.unwrap(), bounds(0, 15, 25));
        log.forget_cold_before(10).await.unwrap();
        assert_eq!(log.bounds().await.unwrap(), bounds(10, 15, 25));
        log.forget_cold_before(25).await.unwrap();
        assert_eq!(log.bounds().await.unwrap(), bounds(15, 15, 25));
    })
    .await;
    // Without cold storage everything can go: all three meet.
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b
            .retention(Retention::new().max_age(Duration::from_millis(1)))
            .build()
            .unwrap();
        append(&log, records(0, 5)).await;
        tokio::time::sleep(Duration::from_millis(2)).await;
        log.trim().await.unwrap();
        assert_eq!(log.bounds().await.unwrap(), bounds(5, 5, 5));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn after_trim_held_bytes_and_hot_count_are_within_the_limits() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let max_bytes = 1_000;
        let log = b
            .max_batch_size(7)
            .retention(Retention::new().max_records(30).max_bytes(max_bytes))
            .build()
            .unwrap();
        for round in 0..10 {
            let batch = (0..7)
                .map(|i| AppendRecord::new(json!({ "pad": "x".repeat((round * 7 + i) % 40) })))
                .collect();
            append(&log, batch).await;
            log.trim().await.unwrap();
            let held_bytes = support::query_i64(
                &*h.context(),
                "SELECT COALESCE(SUM(bytes), 0) FROM durability_log_records",
                &[],
            );
            let held = hot_offsets(&h).len() as i64;
            assert!(held_bytes <= max_bytes as i64, "{held_bytes}");
            assert!(held <= 30, "{held}");
            // The kept bytes match the sequence row (no drift).
            let counted = support::query_i64(
                &*h.context(),
                "SELECT total_bytes FROM durability_log_seq",
                &[],
            );
            assert_eq!(counted, held_bytes);
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_record_leaves_the_hot_table_only_after_its_segment_is_written_and_indexed() {
    support::on_harness(|h| async move {
        let cold = MemoryCold::default();
        // While a segment is written, its records are all still hot and
        // nothing indexes them yet.
        let ctx = h.context();
        let seen = Rc::new(std::cell::RefCell::new(Vec::new()));
        let seen_in_hook = Rc::clone(&seen);
        *cold.on_write.borrow_mut() = Some(Box::new(move |segment| {
            let sql = ctx.storage();
            let hot = support::query_i64(
                &*ctx,
                "SELECT COUNT(*) FROM durability_log_records WHERE \"offset\" BETWEEN ? AND ?",
                &[
                    (segment.first_offset as i64).into(),
                    (segment.last_offset as i64).into(),
                ],
            );
            let indexed = sql
                .query_row(
                    "SELECT 1 FROM durability_log_segments WHERE first_offset = ?",
                    &[(segment.first_offset as i64).into()],
                )
                .unwrap()
                .is_some();
            seen_in_hook
                .borrow_mut()
                .push((hot as usize == segment.records.len(), indexed));
        }));
        let (_s, b) = builder(&h);
        let log = b
            .max_batch_size(5)
            .retention(Retention::new().max_records(1))
            .cold(cold.handle())
            .build()
            .unwrap();
        append(&log, records(0, 5)).await;
        append(&log, records(5, 5)).await;
        assert_eq!(log.trim().await.unwrap(), 9);
        assert_eq!(*seen.borrow(), [(true, false), (true, false)]);
        // Afterwards every trimmed offset is indexed.
        let indexed = support::query_i64(
            &*h.context(),
            "SELECT COUNT(*) FROM durability_log_segments",
            &[],
        );
        assert_eq!(indexed, 2);
        // A failing write leaves that pass's records hot.
        append(&log, records(10, 3)).await;
        cold.fail_writes.set(true);
        assert!(matches!(log.trim().await, Err(LogError::Cold(_))));
        assert_eq!(hot_offsets(&h), [9, 10, 11, 12]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn reading_below_the_oldest_readable_offset_is_truncated_with_requested_and_oldest() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b
            .retention(Retention::new().max_records(4))
            .build()
            .unwrap();
        append(&log, records(0, 10)).await;
        assert_eq!(log.trim().await.unwrap(), 6);
        let error = log.read_from(2).await.unwrap_err();
        assert!(matches!(
            error,
            LogError::Truncated {
                requested: 2,
                oldest: 6
            }
        ));
        assert!(
            error
                .to_string()
                .contains("the oldest retained offset is 6"),
            "{error}"
        );
        assert_eq!(read_all(&log, 6).await.unwrap(), [6, 7, 8, 9]);
    })
    .await;
}

// ------------------------------------------------------------------ appends

#[tokio::test(start_paused = true)]
async fn the_same_key_with_a_different_body_is_a_typed_conflict_and_writes_nothing() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.build().unwrap();
        append(
            &log,
            vec![AppendRecord::keyed("order-1", json!({"total": 10}))],
        )
        .await;
        let outcome = log
            .append(vec![
                AppendRecord::new(json!("x")),
                AppendRecord::keyed("order-1", json!({"total": 11})),
            ])
            .await
            .unwrap();
        match outcome.rejection() {
            Some(AppendRejection::KeyConflict { index, key, offset }) => {
                assert_eq!((*index, key.as_str(), *offset), (1, "order-1", 0));
            }
            other => panic!("expected a key conflict, got {other:?}"),
        }
        let serialized = outcome.rejection().unwrap().serialize();
        assert_eq!(serialized.name, "LogAppendError");
        // Within one batch too.
        let outcome = log
            .append(vec![
                AppendRecord::keyed("k", json!(1)),
                AppendRecord::keyed("k", json!(2)),
            ])
            .await
            .unwrap();
        assert!(matches!(
            outcome.rejection(),
            Some(AppendRejection::KeyRepeated {
                index: 1,
                first_index: 0,
                ..
            })
        ));
        assert_eq!(log.bounds().await.unwrap().next_offset, 1);
        // The same body returns the original offset.
        let same = vec![AppendRecord::keyed("order-1", json!({"total": 10}))];
        assert_eq!(append(&log, same).await, [0]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn deduplication_lasts_while_the_record_is_hot() {
    support::on_harness(|h| async move {
        let cold = MemoryCold::default();
        let (_s, b) = builder(&h);
        let log = b
            .retention(Retention::new().max_records(1))
            .cold(cold.handle())
            .build()
            .unwrap();
        append(&log, vec![AppendRecord::keyed("k", json!(1))]).await;
        append(&log, records(1, 1)).await;
        log.trim().await.unwrap();
        // Flushed: the key is free again and makes a new record.
        assert_eq!(
            append(&log, vec![AppendRecord::keyed("k", json!(1))]).await,
            [2]
        );
        // The flushed record keeps its key in cold storage.
        let page = log.read_from(0).await.unwrap();
        assert_eq!(page.records[0].key, "k");
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn rejections_are_definite_and_name_the_record_and_the_rule() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.max_batch_size(2).build().unwrap();
        let cases: Vec<(Vec<AppendRecord<Value>>, &str)> = vec![
            (Vec::new(), "Append requires at least one record"),
            (records(0, 3), "Append of 3 records exceeds maxBatchSize 2"),
            (
                vec![AppendRecord::keyed("", json!(1))],
                "records[0].key must not be empty",
            ),
        ];
        for (batch, message) in cases {
            let outcome = log.append(batch).await.unwrap();
            let Appended::Rejected { error, load } = outcome else {
                panic!("accepted");
            };
            assert!(error.to_string().starts_with(message), "{error}");
            assert_eq!(load.inbound.in_flight, 0);
        }
        assert_eq!(log.bounds().await.unwrap().next_offset, 0);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_body_that_is_not_json_is_a_rejection_not_an_error() {
    support::on_harness(|h| async move {
        let scheduler = durability::Scheduler::new(h.context()).unwrap();
        let log = Log::<f64>::builder(&scheduler).build().unwrap();
        let outcome = log
            .append(vec![AppendRecord::new(1.5), AppendRecord::new(f64::NAN)])
            .await
            .unwrap();
        match outcome.rejection() {
            Some(error @ AppendRejection::Body { index: 1, .. }) => {
                assert!(error.to_string().starts_with("records[1].body is not JSON"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(log.bounds().await.unwrap().next_offset, 0);
    })
    .await;
}

// -------------------------------------------------------------------- reads

#[tokio::test(start_paused = true)]
async fn a_page_respects_limit_and_max_bytes_and_reports_the_lag() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.max_batch_size(5).build().unwrap();
        append(&log, records(0, 5)).await;
        append(&log, records(5, 5)).await;
        // The default page is max_batch_size; a bigger limit is capped.
        let page = log.read(Read::from_offset(0).limit(50)).await.unwrap();
        assert_eq!(page.records.len(), 5);
        assert_eq!((page.next_offset, page.lag), (5, 5));
        assert_eq!(page.records[2].body, json!({"n": 2}));
        // Each stored payload is {"kind":"value","value":{"n":i}}: 33 bytes.
        let page = log.read(Read::from_offset(2).max_bytes(70)).await.unwrap();
        assert_eq!(page.records.len(), 2);
        // A budget smaller than one record still returns that record.
        let page = log.read(Read::from_offset(2).max_bytes(1)).await.unwrap();
        assert_eq!(page.records.len(), 1);
        // At and past the end: empty, next offset stays, no lag.
        let page = log.read_from(10).await.unwrap();
        assert!(page.records.is_empty());
        assert_eq!((page.next_offset, page.lag), (10, 0));
        let page = log.read_from(12).await.unwrap();
        assert_eq!((page.next_offset, page.lag), (12, 0));
        // Bad arguments name the field.
        for (read, field) in [
            (Read::from_offset(0).limit(0), "limit"),
            (Read::from_offset(0).max_bytes(0), "max_bytes"),
            (Read::from_offset(1 << 60), "from"),
        ] {
            match log.read(read).await {
                Err(LogError::InvalidArgument { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{other:?}"),
            }
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn reading_a_flushed_offset_rehydrates_transparently() {
    support::on_harness(|h| async move {
        let cold = MemoryCold::default();
        let (_s, b) = builder(&h);
        let log = b
            .max_batch_size(10)
            .retention(Retention::new().max_records(5))
            .cold(cold.handle())
            .build()
            .unwrap();
        let keyed: Vec<_> = (0..20)
            .map(|i| AppendRecord::keyed(format!("key-{i}"), json!({ "n": i })))
            .collect();
        append(&log, keyed[..10].to_vec()).await;
        append(&log, keyed[10..].to_vec()).await;
        let hot_before = log.read_from(0).await.unwrap();
        assert_eq!(log.trim().await.unwrap(), 15);
        assert_eq!(cold.locators().len(), 2);
        let cold_page = log.read_from(0).await.unwrap();
        assert_eq!(cold_page, hot_before);
        // A page never spans a segment and the hot table.
        let page = log.read_from(12).await.unwrap();
        assert_eq!(page.records.first().map(|r| r.offset), Some(12));
        assert_eq!(page.next_offset, 15);
        assert_eq!(
            read_all(&log, 0).await.unwrap(),
            (0..20).collect::<Vec<_>>()
        );
        // Paging through one segment reads it from cold storage once.
        let reads = cold.reads.get();
        for from in 0..10 {
            log.read(Read::from_offset(from).limit(1)).await.unwrap();
        }
        assert!(cold.reads.get() - reads <= 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_cold_segment_holding_fewer_records_than_indexed_surfaces_as_truncated() {
    support::on_harness(|h| async move {
        let cold = MemoryCold::default();
        let (_s, b) = builder(&h);
        let log = b
            .max_batch_size(5)
            .retention(Retention::new().max_records(5))
            .cold(cold.handle())
            .build()
            .unwrap();
        append(&log, records(0, 5)).await;
        append(&log, records(5, 5)).await;
        append(&log, records(10, 5)).await;
        log.trim().await.unwrap();
        // The tail of the first segment is missing (offsets 3 and 4).
        cold.damage(3);
        cold.damage(4);
        let page = log.read_from(0).await.unwrap();
        assert_eq!(page.records.len(), 3);
        assert_eq!(page.next_offset, 3);
        // Resumable where the next segment starts, never silently.
        assert!(matches!(
            log.read_from(3).await,
            Err(LogError::Truncated {
                requested: 3,
                oldest: 5
            })
        ));
        // A segment that is gone altogether: the same.
        let second = cold.locators()[1].clone();
        cold.lose(&second);
        assert!(matches!(
            log.read_from(7).await,
            Err(LogError::Truncated {
                requested: 7,
                oldest: 10
            })
        ));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn forget_cold_before_makes_reads_below_it_truncated() {
    support::on_harness(|h| async move {
        let cold = MemoryCold::default();
        let (_s, b) = builder(&h);
        let log = b
            .max_batch_size(4)
            .retention(Retention::new().max_records(2))
            .cold(cold.handle())
            .build()
            .unwrap();
        append(&log, records(0, 4)).await;
        append(&log, records(4, 4)).await;
        log.trim().await.unwrap();
        // Segments [0..3] and [4..5]; forgetting before 5 keeps the second
        // (it ends at 5).
        let forgotten = log.forget_cold_before(5).await.unwrap();
        assert_eq!(forgotten.len(), 1);
        assert_eq!(
            (forgotten[0].first_offset, forgotten[0].last_offset),
            (0, 3)
        );
        assert_eq!(forgotten[0].locator, cold.locators()[0]);
        assert!(matches!(
            log.read_from(1).await,
            Err(LogError::Truncated {
                requested: 1,
                oldest: 4
            })
        ));
        assert_eq!(read_all(&log, 4).await.unwrap(), [4, 5, 6, 7]);
        assert!(log.forget_cold_before(5).await.unwrap().is_empty());
    })
    .await;
}

// ---------------------------------------------------------------- retention

#[tokio::test(start_paused = true)]
async fn trim_removes_oldest_first_by_age_and_never_runs_by_itself() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b
            .retention(Retention::new().max_age(Duration::from_secs(60)))
            .build()
            .unwrap();
        append(&log, records(0, 3)).await;
        tokio::time::sleep(Duration::from_secs(30)).await;
        append(&log, records(3, 3)).await;
        tokio::time::sleep(Duration::from_secs(31)).await;
        // Nothing happened on its own.
        assert_eq!(hot_offsets(&h).len(), 6);
        assert_eq!(log.trim().await.unwrap(), 3);
        assert_eq!(hot_offsets(&h), [3, 4, 5]);
        assert_eq!(log.trim().await.unwrap(), 0);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn concurrent_trims_write_each_segment_once() {
    support::on_harness(|h| async move {
        let cold = MemoryCold::default();
        let (_s, b) = builder(&h);
        let log = b
            .max_batch_size(5)
            .retention(Retention::new().max_records(5))
            .cold(cold.handle())
            .build()
            .unwrap();
        for i in 0..4 {
            append(&log, records(i * 5, 5)).await;
        }
        let (a, b) = futures::join!(log.trim(), log.trim());
        assert_eq!(a.unwrap() + b.unwrap(), 15);
        assert_eq!(cold.writes.get(), 3);
        assert_eq!(
            read_all(&log, 0).await.unwrap(),
            (0..20).collect::<Vec<_>>()
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn trim_without_retention_removes_nothing() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.build().unwrap();
        append(&log, records(0, 3)).await;
        assert_eq!(log.trim().await.unwrap(), 0);
        assert_eq!(hot_offsets(&h).len(), 3);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_empty_cold_locator_is_an_error_and_the_records_stay_hot() {
    support::on_harness(|h| async move {
        let cold = MemoryCold::default();
        cold.empty_locator.set(true);
        let (_s, b) = builder(&h);
        let log = b
            .retention(Retention::new().max_records(1))
            .cold(cold.handle())
            .build()
            .unwrap();
        append(&log, records(0, 3)).await;
        assert!(matches!(
            log.trim().await,
            Err(LogError::EmptyLocator { first: 0, last: 1 })
        ));
        assert_eq!(hot_offsets(&h), [0, 1, 2]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn retention_limits_are_validated_and_max_bytes_is_capped_at_one_gib() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let error = b
            .retention(Retention::new().max_bytes(MAX_LOG_BYTES + 1))
            .build()
            .unwrap_err();
        assert!(matches!(
            error,
            DurabilityError::Config(ConfigError::OutOfRange { ref field, max, .. })
                if field == "retention.max_bytes" && max == 1_073_741_824
        ));
        let (_s, b) = builder(&h);
        assert!(b.max_batch_size(0).build().is_err());
    })
    .await;
}

// ---------------------------------------------------------- cursors and load

#[tokio::test(start_paused = true)]
async fn cursors_are_listed_by_name_and_load_reports_the_furthest_behind_as_backlog() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.build().unwrap();
        append(&log, records(0, 10)).await;
        // No cursor, no backlog.
        assert_eq!(log.load().await.unwrap().outbound.pending_deliveries, 0);
        log.commit("search", 8).await.unwrap();
        log.commit("billing", 3).await.unwrap();
        let cursors = log.cursors().await.unwrap();
        assert_eq!(
            cursors.into_iter().collect::<Vec<_>>(),
            [("billing".to_owned(), 3), ("search".to_owned(), 8)]
        );
        let load = log.load().await.unwrap();
        assert_eq!(load.outbound.pending_deliveries, 7);
        assert_eq!(load.inbound.completed, 1);
        assert_eq!(load.window_ms, 60_000);
        let appended = log.append(records(10, 2)).await.unwrap();
        assert_eq!(appended.load().outbound.pending_deliveries, 9);
        let wire = serde_json::to_value(&appended).unwrap();
        assert_eq!(wire["success"], json!(true));
        assert_eq!(wire["value"], json!([10, 11]));
        assert_eq!(wire["load"]["outbound"]["pendingDeliveries"], json!(9));
        assert!(matches!(
            log.commit("", 1).await,
            Err(LogError::InvalidArgument {
                field: "consumer",
                ..
            })
        ));
    })
    .await;
}

// ------------------------------------------------------- schema and attachment

#[tokio::test(start_paused = true)]
async fn one_log_per_object_and_only_its_tables_are_created() {
    support::on_harness(|h| async move {
        let (scheduler, b) = builder(&h);
        let log = b.build().unwrap();
        let second = Log::<Value>::builder(&scheduler).build();
        assert!(matches!(
            second,
            Err(DurabilityError::Config(
                ConfigError::DuplicateParticipant { .. }
            ))
        ));
        let tables: Vec<String> = h
            .context()
            .storage()
            .query(
                "SELECT name FROM sqlite_master WHERE type = 'table' \
                 AND name LIKE 'durability_%' ORDER BY name",
                &[],
            )
            .unwrap()
            .iter()
            .map(|row| row.get::<String>(0).unwrap())
            .collect();
        assert_eq!(
            tables,
            [
                "durability_log_cursors",
                "durability_log_records",
                "durability_log_segments",
                "durability_log_seq",
                "durability_migrations",
            ]
        );
        // A log never arms the object's alarm: it has no due work.
        append(&log, records(0, 3)).await;
        assert_eq!(support::physical_alarm(&*h.context()).await, None);
        // Explicit migrations revert and re-apply.
        let storage = h.context();
        drop(log);
        let report = Log::<Value>::migrate(
            storage.storage(),
            durability::migrations::MigrationTarget::None,
        )
        .unwrap();
        assert_eq!(report.rolled_back, [LOG_MIGRATIONS[0].name]);
        assert!(
            !durability::migrations::is_schema_current(
                storage.storage(),
                LOG_CAPABILITY,
                LOG_MIGRATIONS
            )
            .unwrap()
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_log_survives_eviction() {
    support::with_host(|host| async move {
        host.run("p", |ctx| async move {
            let scheduler = durability::Scheduler::new(ctx).unwrap();
            let log = Log::<Value>::builder(&scheduler).build().unwrap();
            log.append(records(0, 4)).await.unwrap();
            log.commit("c", 2).await.unwrap();
        })
        .await;
        host.evict("p").await;
        let (page, cursor) = host
            .run("p", |ctx| async move {
                let scheduler = durability::Scheduler::new(ctx).unwrap();
                let log = Log::<Value>::builder(&scheduler).build().unwrap();
                let cursor = log.cursor("c").await.unwrap();
                let page = log.read_from(cursor.unwrap_or(0)).await.unwrap();
                let offsets: Vec<u64> = page.records.iter().map(|r| r.offset).collect();
                (offsets, cursor)
            })
            .await;
        assert_eq!(cursor, Some(2));
        assert_eq!(page, [2, 3]);
    })
    .await;
}

// Issue 10, defect 2: what the decoder could not read back is refused at
// append, nothing written.
#[tokio::test(start_paused = true)]
async fn a_body_nested_deeper_than_the_decoder_reads_is_refused_and_nothing_is_written() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.build().unwrap();
        append(&log, records(0, 2)).await;
        let before = support::table_snapshot(&*h.context(), "durability_log_records");
        for depth in [127, 10_000] {
            let body = support::nested_json(depth);
            let outcome = log
                .append(vec![AppendRecord::new(json!(1)), AppendRecord::new(body)])
                .await
                .unwrap();
            match outcome.rejection() {
                Some(error @ AppendRejection::Body { index: 1, .. }) => {
                    assert!(error.to_string().contains("limit of 100 levels"), "{error}");
                }
                other => panic!("expected a body rejection, got {other:?}"),
            }
        }
        assert_eq!(
            support::table_snapshot(&*h.context(), "durability_log_records"),
            before
        );
        let read = log.read(Read::from_offset(0)).await.unwrap();
        assert_eq!(read.records.len(), 2, "the records before stay readable");
    })
    .await;
}

/// Damages the stored payload of hot record `offset` the way a row written
/// by another version (or a broken disk) would look: not a stored value.
fn damage_hot_record(h: &support::Harness, offset: u64) {
    let changed = h
        .context()
        .storage()
        .execute(
            "UPDATE durability_log_records SET payload = '{\"kind\":\"value\"' \
             WHERE \"offset\" = ?",
            &durability::platform::params![i64::try_from(offset).unwrap()],
        )
        .unwrap();
    assert_eq!(changed, 1);
}

// Issue 10, defect 2: one record that does not decode never blocks reads of
// the others; a read starting at it is a typed error naming its offset, and
// the consumer skips it by reading and committing past it.
#[tokio::test(start_paused = true)]
async fn a_record_that_does_not_decode_never_blocks_reads_of_the_others() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.build().unwrap();
        append(&log, records(0, 5)).await;
        damage_hot_record(&h, 2);
        let page = log.read(Read::from_offset(0)).await.unwrap();
        let offsets: Vec<u64> = page.records.iter().map(|r| r.offset).collect();
        assert_eq!(offsets, [0, 1], "the records before it are readable");
        assert_eq!(page.next_offset, 2);
        assert_eq!(page.lag, 3);
        match log.read(Read::from_offset(2)).await {
            Err(LogError::Decode { offset: 2, .. }) => {}
            other => panic!("expected a decode error naming offset 2, got {other:?}"),
        }
        let page = log.read(Read::from_offset(3)).await.unwrap();
        let offsets: Vec<u64> = page.records.iter().map(|r| r.offset).collect();
        assert_eq!(offsets, [3, 4], "the records after it are readable");
        log.commit("c", 3).await.unwrap();
        assert_eq!(log.cursor("c").await.unwrap(), Some(3));
    })
    .await;
}

// Issue 10, defect 8: log keys and consumer names have the identifier limit
// of every capability, and record bodies a limit (1 MiB of their own JSON
// by default).
#[tokio::test(start_paused = true)]
async fn overlong_keys_and_consumers_and_oversized_bodies_are_refused_with_nothing_written() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let log = b.build().unwrap();
        let long = "k".repeat(1025);
        let fits = Value::String("b".repeat((1 << 20) - 2));
        let over = Value::String("b".repeat((1 << 20) - 1));
        let batches = [
            (
                vec![
                    AppendRecord::new(json!(1)),
                    AppendRecord::keyed(long.as_str(), json!(2)),
                ],
                "records[1]: key is 1025 bytes, above the limit of 1024 (MAX_ID_BYTES)",
            ),
            (
                vec![AppendRecord::new(over)],
                "records[0]: body is 1048577 bytes, above the limit of 1048576 (max_body_bytes)",
            ),
        ];
        for (batch, message) in batches {
            let outcome = log.append(batch).await.unwrap();
            let error = outcome.rejection().expect("rejected");
            assert_eq!(error.to_string(), message);
        }
        assert!(hot_offsets(&h).is_empty());
        let error = log.commit(&long, 0).await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "consumer must be at most 1024 bytes (MAX_ID_BYTES)"
        );
        assert!(log.cursors().await.unwrap().is_empty());
        append(&log, vec![AppendRecord::keyed("k".repeat(1024), fits)]).await;
        log.commit(&"c".repeat(1024), 1).await.unwrap();
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn max_body_bytes_is_configurable_and_bounded_at_build() {
    support::on_harness(|h| async move {
        let (_s, b) = builder(&h);
        let error = b.max_body_bytes(0).build().unwrap_err();
        assert_eq!(
            error.to_string(),
            "max_body_bytes must be a positive integer"
        );
        let (_s, b) = builder(&h);
        let error = b.max_batch_size(u32::MAX).build().unwrap_err();
        assert_eq!(
            error.to_string(),
            "max_batch_size must be between 1 and 100000"
        );
        let (_s, b) = builder(&h);
        let log = b.max_body_bytes(7).build().unwrap();
        append(&log, vec![AppendRecord::new(json!("hello"))]).await;
        let outcome = log
            .append(vec![AppendRecord::new(json!("hello!"))])
            .await
            .unwrap();
        assert_eq!(
            outcome.rejection().map(ToString::to_string).as_deref(),
            Some("records[0]: body is 8 bytes, above the limit of 7 (max_body_bytes)")
        );
    })
    .await;
}
