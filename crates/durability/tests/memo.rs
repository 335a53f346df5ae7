//! Memos (§9) on real SQLite: a retried attempt reuses a stored result, a
//! stale attempt stores nothing, and memos end with their record.

mod support;

use std::cell::Cell;
use std::rc::Rc;

use durability::codec::CodecError;
use durability::error::HandlerError;
use durability::memo::{
    MEMO_MIGRATIONS, Memo, MemoError, delete_memos, delete_memos_of_dropped_table,
    delete_stale_memos,
};
use durability::migrations::{
    MEMOS_CAPABILITY, MigrationTarget, NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS,
    OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS, migrate,
};
use durability::platform::{Context, Sql, params};
use durability::record::{AttemptRef, DurableTable, claim_attempt};
use serde::{Deserialize, Serialize};
use support::with_context;

const CALLS: DurableTable = DurableTable::OPERATIONS;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    charge: String,
    cents: u64,
}

fn receipt(charge: &str) -> Receipt {
    Receipt {
        charge: charge.into(),
        cents: 1_250,
    }
}

/// Migrates operations and memos and registers call `key` of `generation`.
fn setup(sql: &dyn durability::platform::Storage, keys: &[(&str, &str)]) {
    migrate(
        sql,
        OPERATIONS_CAPABILITY,
        OPERATIONS_MIGRATIONS,
        MigrationTarget::Latest,
    )
    .unwrap();
    migrate(
        sql,
        MEMOS_CAPABILITY,
        MEMO_MIGRATIONS,
        MigrationTarget::Latest,
    )
    .unwrap();
    for (key, generation) in keys {
        register(sql, key, generation);
    }
}

/// Inserts, or replaces with a new generation, a pending call.
fn register(sql: &dyn Sql, key: &str, generation: &str) {
    sql.execute(
        "INSERT INTO durability_calls \
         (id, operation, payload, status, next_attempt_at, generation_id, created_at) \
         VALUES (?, 'charge', '{\"kind\":\"undefined\"}', 'pending', 0, ?, 0) \
         ON CONFLICT (id) DO UPDATE SET generation_id = excluded.generation_id, \
         attempt = 0, status = 'pending'",
        &params![key, generation],
    )
    .unwrap();
}

/// Claims the next attempt of `key` and returns its memos.
fn claim(ctx: &Rc<dyn Context>, key: &str, generation: &str) -> Memo {
    let attempt = claim_attempt(ctx.storage(), CALLS, key, generation, 10, None)
        .unwrap()
        .expect("claimable");
    Memo::new(
        Rc::clone(ctx),
        CALLS,
        AttemptRef {
            key: key.into(),
            generation: generation.into(),
            attempt,
        },
    )
}

/// (record_key, memo_key, generation) of every memo.
fn memos(sql: &dyn Sql) -> Vec<(String, String, String)> {
    sql.query(
        "SELECT record_key, memo_key, generation_id FROM durability_memos \
         ORDER BY record_table, record_key, memo_key",
        &[],
    )
    .unwrap()
    .iter()
    .map(|row| {
        (
            row.get(0).unwrap(),
            row.get(1).unwrap(),
            row.get(2).unwrap(),
        )
    })
    .collect()
}

fn memo_row(key: &str, memo: &str, generation: &str) -> (String, String, String) {
    (key.into(), memo.into(), generation.into())
}

/// A side effect that counts its runs.
async fn charge(runs: Rc<Cell<u32>>, id: &str) -> Result<Receipt, HandlerError> {
    runs.set(runs.get() + 1);
    Ok(receipt(id))
}

#[tokio::test(start_paused = true)]
async fn a_retried_attempt_reuses_the_memo_instead_of_repeating_the_side_effect() {
    with_context(|ctx: Rc<dyn Context>| async move {
        setup(ctx.storage(), &[("c1", "g1")]);
        let runs = Rc::new(Cell::new(0));
        let first = claim(&ctx, "c1", "g1");
        let value = first
            .memoize("charge", charge(Rc::clone(&runs), "ch_1"))
            .await
            .unwrap();
        assert_eq!(value, receipt("ch_1"));
        // The attempt fails after the side effect; the retry claims attempt 2.
        let second = claim(&ctx, "c1", "g1");
        assert_eq!(second.attempt().attempt, 2);
        let value = second
            .memoize("charge", charge(Rc::clone(&runs), "ch_2"))
            .await
            .unwrap();
        assert_eq!(value, receipt("ch_1"));
        assert_eq!(runs.get(), 1);
        // Another key is another memo.
        let other = second
            .memoize("email", charge(Rc::clone(&runs), "em_1"))
            .await
            .unwrap();
        assert_eq!(other, receipt("em_1"));
        assert_eq!(runs.get(), 2);
        assert_eq!(
            memos(ctx.storage()),
            vec![
                memo_row("c1", "charge", "g1"),
                memo_row("c1", "email", "g1")
            ]
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_memo_is_stored_only_while_the_attempt_still_owns_its_record() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let sql = ctx.storage();
        setup(sql, &[("c1", "g1")]);
        let runs = Rc::new(Cell::new(0));

        // The attempt timed out and a retry claimed the record.
        let stale = claim(&ctx, "c1", "g1");
        claim(&ctx, "c1", "g1");
        let value = stale
            .memoize("charge", charge(Rc::clone(&runs), "late"))
            .await
            .unwrap();
        assert_eq!(value, receipt("late"), "the caller still gets its value");
        assert!(memos(sql).is_empty());

        // The record completed.
        let owner = claim(&ctx, "c1", "g1");
        sql.execute("UPDATE durability_calls SET status = 'completed'", &[])
            .unwrap();
        owner
            .memoize("charge", charge(Rc::clone(&runs), "done"))
            .await
            .unwrap();
        assert!(memos(sql).is_empty());

        // The record was purged and registered again under a new generation.
        register(sql, "c1", "g2");
        let old = Memo::new(
            Rc::clone(&ctx),
            CALLS,
            AttemptRef {
                key: "c1".into(),
                generation: "g1".into(),
                attempt: 0,
            },
        );
        old.memoize("charge", charge(Rc::clone(&runs), "old"))
            .await
            .unwrap();
        assert!(memos(sql).is_empty());

        sql.execute("DELETE FROM durability_calls", &[]).unwrap();
        stale
            .memoize("charge", charge(Rc::clone(&runs), "gone"))
            .await
            .unwrap();
        assert!(memos(sql).is_empty());
        assert_eq!(runs.get(), 4);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_callback_error_stores_nothing_and_the_next_attempt_runs_it_again() {
    with_context(|ctx: Rc<dyn Context>| async move {
        setup(ctx.storage(), &[("c1", "g1")]);
        let first = claim(&ctx, "c1", "g1");
        let error = first
            .memoize("charge", async {
                Err::<Receipt, _>(HandlerError::non_retryable("declined"))
            })
            .await
            .unwrap_err();
        assert!(matches!(&error, MemoError::Callback(e) if e.message() == "declined"));
        assert!(memos(ctx.storage()).is_empty());
        let second = claim(&ctx, "c1", "g1");
        let runs = Rc::new(Cell::new(0));
        second
            .memoize("charge", charge(Rc::clone(&runs), "ch"))
            .await
            .unwrap();
        assert_eq!(runs.get(), 1);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_value_json_cannot_hold_is_an_error_and_stores_nothing() {
    with_context(|ctx: Rc<dyn Context>| async move {
        setup(ctx.storage(), &[("c1", "g1")]);
        let memo = claim(&ctx, "c1", "g1");
        let error = memo
            .memoize("ratio", async { Ok::<_, HandlerError>(f64::NAN) })
            .await
            .unwrap_err();
        assert!(
            matches!(error, MemoError::Codec(CodecError::NonFinite { .. })),
            "{error:?}"
        );
        assert!(memos(ctx.storage()).is_empty());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn memos_of_another_generation_are_ignored_and_deleted() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let sql = ctx.storage();
        setup(sql, &[("c1", "g1")]);
        let runs = Rc::new(Cell::new(0));
        let old = claim(&ctx, "c1", "g1");
        old.memoize("charge", charge(Rc::clone(&runs), "old"))
            .await
            .unwrap();
        old.memoize("email", charge(Rc::clone(&runs), "old"))
            .await
            .unwrap();
        // Rescheduled (or purged and registered again) without a cleanup.
        register(sql, "c1", "g2");
        let new = claim(&ctx, "c1", "g2");
        let value = new
            .memoize("charge", charge(Rc::clone(&runs), "new"))
            .await
            .unwrap();
        assert_eq!(value, receipt("new"));
        assert_eq!(runs.get(), 3);
        assert_eq!(memos(sql), vec![memo_row("c1", "charge", "g2")]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_stale_reader_does_not_delete_the_newer_generations_memos() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let sql = ctx.storage();
        setup(sql, &[("c1", "g1")]);
        let runs = Rc::new(Cell::new(0));
        let old = claim(&ctx, "c1", "g1");
        register(sql, "c1", "g2");
        let new = claim(&ctx, "c1", "g2");
        new.memoize("charge", charge(Rc::clone(&runs), "new"))
            .await
            .unwrap();
        // The old occurrence, still running, reads the key: it must neither
        // see the new memo nor delete it.
        let value = old
            .memoize("charge", charge(Rc::clone(&runs), "old"))
            .await
            .unwrap();
        assert_eq!(value, receipt("old"));
        assert_eq!(memos(sql), vec![memo_row("c1", "charge", "g2")]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_stored_memo_of_another_type_is_an_error_and_the_callback_does_not_run() {
    with_context(|ctx: Rc<dyn Context>| async move {
        setup(ctx.storage(), &[("c1", "g1")]);
        let memo = claim(&ctx, "c1", "g1");
        memo.memoize("charge", async { Ok::<_, HandlerError>("text".to_owned()) })
            .await
            .unwrap();
        let runs = Rc::new(Cell::new(0));
        let error = memo
            .memoize("charge", charge(Rc::clone(&runs), "x"))
            .await
            .unwrap_err();
        assert!(
            matches!(error, MemoError::Codec(CodecError::Type { .. })),
            "{error:?}"
        );
        assert_eq!(runs.get(), 0);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn delete_memos_removes_only_that_records_memos() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let sql = ctx.storage();
        setup(sql, &[("c1", "g1"), ("c2", "g1")]);
        let runs = Rc::new(Cell::new(0));
        for key in ["c1", "c2"] {
            let memo = claim(&ctx, key, "g1");
            memo.memoize("a", charge(Rc::clone(&runs), key))
                .await
                .unwrap();
            memo.memoize("b", charge(Rc::clone(&runs), key))
                .await
                .unwrap();
        }
        assert_eq!(delete_memos(sql, CALLS, "c1").unwrap(), 2);
        // Same key in another table is another record.
        assert_eq!(
            delete_memos(sql, DurableTable::NAMED_ALARMS, "c2").unwrap(),
            0
        );
        assert_eq!(
            memos(sql),
            vec![memo_row("c2", "a", "g1"), memo_row("c2", "b", "g1")]
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn delete_stale_memos_removes_memos_whose_record_generation_is_gone() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let sql = ctx.storage();
        setup(sql, &[("kept", "g1"), ("purged", "g1"), ("replaced", "g1")]);
        let runs = Rc::new(Cell::new(0));
        for key in ["kept", "purged", "replaced"] {
            claim(&ctx, key, "g1")
                .memoize("m", charge(Rc::clone(&runs), key))
                .await
                .unwrap();
        }
        sql.execute("DELETE FROM durability_calls WHERE id = 'purged'", &[])
            .unwrap();
        register(sql, "replaced", "g2");
        assert_eq!(delete_stale_memos(sql, CALLS).unwrap(), 2);
        assert_eq!(memos(sql), vec![memo_row("kept", "m", "g1")]);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn memos_of_a_dropped_table_are_deleted_after_its_migration() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let sql = ctx.storage();
        setup(sql, &[("c1", "g1")]);
        migrate(sql, NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS, MigrationTarget::Latest).unwrap();
        sql.execute(
            "INSERT INTO durability_alarms (name, generation_id, status, scheduled_at, next_attempt_at, created_at) \
             VALUES ('daily', 'a1', 'pending', 0, 0, 0)",
            &[],
        )
        .unwrap();
        let runs = Rc::new(Cell::new(0));
        claim(&ctx, "c1", "g1").memoize("m", charge(Rc::clone(&runs), "c")).await.unwrap();
        let alarm_attempt = claim_attempt(sql, DurableTable::NAMED_ALARMS, "daily", "a1", 5, None).unwrap().unwrap();
        Memo::new(
            Rc::clone(&ctx),
            DurableTable::NAMED_ALARMS,
            AttemptRef { key: "daily".into(), generation: "a1".into(), attempt: alarm_attempt },
        )
        .memoize("m", charge(Rc::clone(&runs), "a"))
        .await
        .unwrap();

        // The table still exists: nothing to do.
        assert_eq!(delete_memos_of_dropped_table(sql, CALLS).unwrap(), 0);
        migrate(sql, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS, MigrationTarget::None).unwrap();
        assert_eq!(delete_memos_of_dropped_table(sql, CALLS).unwrap(), 1);
        assert_eq!(memos(sql), vec![memo_row("daily", "m", "a1")]);

        // Without the memo table there is nothing to clean either.
        migrate(sql, MEMOS_CAPABILITY, MEMO_MIGRATIONS, MigrationTarget::None).unwrap();
        migrate(sql, NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS, MigrationTarget::None).unwrap();
        assert_eq!(delete_memos_of_dropped_table(sql, DurableTable::NAMED_ALARMS).unwrap(), 0);
    })
    .await;
}

#[test]
fn memo_errors_convert_into_handler_errors_keeping_the_callbacks_own() {
    let own: HandlerError = MemoError::Callback(HandlerError::non_retryable("declined")).into();
    assert!(own.is_non_retryable());
    assert_eq!(own.message(), "declined");
    let io: HandlerError = MemoError::Callback(std::io::Error::other("connection reset")).into();
    assert_eq!((io.name(), io.message()), ("Error", "connection reset"));
    let codec: HandlerError =
        MemoError::<HandlerError>::Codec(CodecError::NotJson { detail: "x".into() }).into();
    assert!(!codec.is_non_retryable());
    assert_eq!(codec.message(), "value is not JSON: x");
}

// Issue 10, defect 8: memo keys have the identifier limit of every
// capability; the callback does not run.
#[tokio::test(start_paused = true)]
async fn a_memo_key_that_is_empty_or_too_long_is_an_error_and_the_callback_does_not_run() {
    with_context(|ctx: Rc<dyn Context>| async move {
        setup(ctx.storage(), &[("c1", "g1")]);
        let memo = claim(&ctx, "c1", "g1");
        let runs = Rc::new(Cell::new(0_u32));
        for key in [String::new(), "k".repeat(1025)] {
            let error = memo
                .memoize(&key, charge(Rc::clone(&runs), "ch"))
                .await
                .unwrap_err();
            assert!(error.to_string().starts_with("memo: memo key"), "{error}");
        }
        assert_eq!(runs.get(), 0);
        assert!(memos(ctx.storage()).is_empty());
        memo.memoize(&"k".repeat(1024), charge(Rc::clone(&runs), "ch"))
            .await
            .unwrap();
        assert_eq!(runs.get(), 1);
    })
    .await;
}
