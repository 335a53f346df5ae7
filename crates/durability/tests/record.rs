//! Generation-guarded compare-and-set on record tables (§2.4), on real
//! SQLite: a stale attempt never changes a replaced, purged or later record.

mod support;

use std::rc::Rc;

use durability::error::HandlerError;
use durability::migrations::{
    MigrationTarget, NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS, OPERATIONS_CAPABILITY,
    OPERATIONS_MIGRATIONS, migrate,
};
use durability::platform::{Context, Sql, params};
use durability::record::{
    AttemptRef, DurableTable, claim_attempt, delete_attempt, exhaust_attempts, update_attempt,
};
use support::with_context;

const CALLS: DurableTable = DurableTable::OPERATIONS;

/// Creates the operations table and one pending call `c1` of generation `g1`.
fn pending_call(ctx: &Rc<dyn Context>) -> &dyn Sql {
    let storage = ctx.storage();
    migrate(
        storage,
        OPERATIONS_CAPABILITY,
        OPERATIONS_MIGRATIONS,
        MigrationTarget::Latest,
    )
    .unwrap();
    storage
        .execute(
            "INSERT INTO durability_calls \
             (id, operation, payload, status, next_attempt_at, generation_id, created_at) \
             VALUES ('c1', 'charge', '{\"kind\":\"undefined\"}', 'pending', 100, 'g1', 100)",
            &[],
        )
        .unwrap();
    storage
}

/// (status, attempt, next_attempt_at, last_error, last_error_name).
type CallState = (String, u32, i64, Option<String>, Option<String>);

/// The state of `c1`.
fn call_state(sql: &dyn Sql) -> Option<CallState> {
    sql.query_row(
        "SELECT status, attempt, next_attempt_at, last_error, last_error_name \
         FROM durability_calls WHERE id = 'c1'",
        &[],
    )
    .unwrap()
    .map(|row| {
        (
            row.get(0).unwrap(),
            row.get(1).unwrap(),
            row.get(2).unwrap(),
            row.get(3).unwrap(),
            row.get(4).unwrap(),
        )
    })
}

fn attempt(n: u32) -> AttemptRef {
    AttemptRef {
        key: "c1".into(),
        generation: "g1".into(),
        attempt: n,
    }
}

#[tokio::test(start_paused = true)]
async fn claims_require_matching_generation_pending_status_and_attempts_left() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let sql = pending_call(&ctx);
        assert_eq!(
            claim_attempt(sql, CALLS, "c1", "g1", 2, None).unwrap(),
            Some(1)
        );
        assert_eq!(
            claim_attempt(sql, CALLS, "c1", "g0", 2, None).unwrap(),
            None
        );
        assert_eq!(
            claim_attempt(sql, CALLS, "nope", "g1", 2, None).unwrap(),
            None
        );
        assert_eq!(
            claim_attempt(sql, CALLS, "c1", "g1", 2, None).unwrap(),
            Some(2)
        );
        assert_eq!(
            claim_attempt(sql, CALLS, "c1", "g1", 2, None).unwrap(),
            None,
            "no attempts left"
        );
        // A claim leaves next_attempt_at alone unless a deadline is given.
        assert_eq!(call_state(sql).unwrap().2, 100);
        assert_eq!(
            claim_attempt(sql, CALLS, "c1", "g1", 3, Some(9_000)).unwrap(),
            Some(3)
        );
        assert_eq!(call_state(sql).unwrap().2, 9_000);
        sql.execute("UPDATE durability_calls SET status = 'completed'", &[])
            .unwrap();
        assert_eq!(
            claim_attempt(sql, CALLS, "c1", "g1", 10, None).unwrap(),
            None
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_outcome_write_changes_only_the_attempt_that_still_owns_the_record() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let sql = pending_call(&ctx);
        claim_attempt(sql, CALLS, "c1", "g1", 5, None).unwrap();
        claim_attempt(sql, CALLS, "c1", "g1", 5, None).unwrap();
        let set = "next_attempt_at = ?, last_error = ?";
        // Attempt 1 moved on: its late settlement misses.
        assert!(!update_attempt(sql, CALLS, &attempt(1), set, &params![1, "late"]).unwrap());
        // Another generation misses.
        let other = AttemptRef {
            generation: "g0".into(),
            ..attempt(2)
        };
        assert!(!update_attempt(sql, CALLS, &other, set, &params![1, "other"]).unwrap());
        assert_eq!(
            call_state(sql).unwrap(),
            ("pending".into(), 2, 100, None, None)
        );
        // The owner settles.
        assert!(update_attempt(sql, CALLS, &attempt(2), set, &params![500, "busy"]).unwrap());
        assert_eq!(
            call_state(sql).unwrap(),
            ("pending".into(), 2, 500, Some("busy".into()), None)
        );
        // Once not pending, even the owner misses.
        assert!(update_attempt(sql, CALLS, &attempt(2), "status = ?", &params!["failed"]).unwrap());
        assert!(
            !update_attempt(sql, CALLS, &attempt(2), "last_error = ?", &params!["again"]).unwrap()
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_stale_attempt_never_deletes_a_replacement() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        migrate(storage, NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS, MigrationTarget::Latest).unwrap();
        let schedule = |generation: &str| {
            storage
                .execute(
                    "INSERT INTO durability_alarms \
                     (name, generation_id, status, scheduled_at, next_attempt_at, attempt, created_at) \
                     VALUES ('daily', ?, 'pending', 0, 0, 0, 0) \
                     ON CONFLICT (name) DO UPDATE SET generation_id = excluded.generation_id, attempt = 0",
                    &params![generation],
                )
                .unwrap();
        };
        let table = DurableTable::NAMED_ALARMS;
        schedule("old");
        assert_eq!(claim_attempt(storage, table, "daily", "old", 5, None).unwrap(), Some(1));
        // Rescheduled while the old occurrence runs.
        schedule("new");
        let old = AttemptRef { key: "daily".into(), generation: "old".into(), attempt: 1 };
        assert!(!delete_attempt(storage, table, &old).unwrap());
        let generation: String = storage
            .query_row("SELECT generation_id FROM durability_alarms", &[])
            .unwrap()
            .unwrap()
            .get(0)
            .unwrap();
        assert_eq!(generation, "new");
        assert_eq!(claim_attempt(storage, table, "daily", "new", 5, None).unwrap(), Some(1));
        let new = AttemptRef { key: "daily".into(), generation: "new".into(), attempt: 1 };
        assert!(delete_attempt(storage, table, &new).unwrap());
        assert!(!delete_attempt(storage, table, &new).unwrap());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn exhaustion_fails_only_a_pending_record_of_its_generation_without_attempts_left() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let sql = pending_call(&ctx);
        let error = HandlerError::attempts_exhausted("operation", "charge", 2).serialize();
        claim_attempt(sql, CALLS, "c1", "g1", 2, None).unwrap();
        assert_eq!(
            exhaust_attempts(sql, CALLS, "c1", "g1", 2, &error).unwrap(),
            None,
            "attempts left"
        );
        claim_attempt(sql, CALLS, "c1", "g1", 2, None).unwrap();
        assert_eq!(
            exhaust_attempts(sql, CALLS, "c1", "g0", 2, &error).unwrap(),
            None
        );
        assert_eq!(
            exhaust_attempts(sql, CALLS, "c1", "g1", 2, &error).unwrap(),
            Some(2)
        );
        assert_eq!(
            call_state(sql).unwrap(),
            (
                "failed".into(),
                2,
                100,
                Some("Durable operation \"charge\" exhausted its 2 attempts".into()),
                Some("DurableAttemptsExhaustedError".into())
            )
        );
        assert_eq!(
            exhaust_attempts(sql, CALLS, "c1", "g1", 2, &error).unwrap(),
            None,
            "already failed"
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_purged_record_matches_nothing() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let sql = pending_call(&ctx);
        claim_attempt(sql, CALLS, "c1", "g1", 5, None).unwrap();
        sql.execute("DELETE FROM durability_calls", &[]).unwrap();
        assert!(
            !update_attempt(sql, CALLS, &attempt(1), "status = ?", &params!["completed"]).unwrap()
        );
        assert!(!delete_attempt(sql, CALLS, &attempt(1)).unwrap());
        let error = HandlerError::new("x").serialize();
        assert_eq!(
            exhaust_attempts(sql, CALLS, "c1", "g1", 1, &error).unwrap(),
            None
        );
        assert_eq!(
            claim_attempt(sql, CALLS, "c1", "g1", 5, None).unwrap(),
            None
        );
        assert!(call_state(sql).is_none());
    })
    .await;
}
