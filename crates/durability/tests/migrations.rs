//! Schema migrations (§10) on real SQLite through the host: the observed
//! examples of §10.4, every invariant of §10.5, the 2.x legacy history, and a
//! process killed by SIGKILL in the middle of a batch.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::rc::Rc;

use durability::memo::MEMO_MIGRATIONS;
use durability::migrations::{
    Direction, Migration, MigrationError, MigrationReport, MigrationTarget,
    NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS,
    is_schema_current, migrate,
};
use durability::platform::{Context, Sql, params};
use support::{open_host, with_context};

/// Tables and indexes whose name starts with `durability`, sorted.
fn schema(sql: &dyn Sql) -> Vec<String> {
    sql.query(
        "SELECT type || ' ' || name FROM sqlite_master \
         WHERE name LIKE 'durability%' ORDER BY type, name",
        &[],
    )
    .unwrap()
    .iter()
    .map(|row| row.get::<String>(0).unwrap())
    .collect()
}

/// The full text of every durability table and index, to compare states.
fn schema_text(sql: &dyn Sql) -> Vec<(String, Option<String>)> {
    sql.query(
        "SELECT name, sql FROM sqlite_master WHERE name LIKE 'durability%' ORDER BY name",
        &[],
    )
    .unwrap()
    .iter()
    .map(|row| (row.get(0).unwrap(), row.get(1).unwrap()))
    .collect()
}

/// Every history row: (name, capability, down). Empty without the table.
fn history(sql: &dyn Sql) -> Vec<(String, Option<String>, Option<String>)> {
    if !has_history_table(sql) {
        return Vec::new();
    }
    sql.query(
        "SELECT name, capability, down FROM durability_migrations ORDER BY id",
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

fn has_history_table(sql: &dyn Sql) -> bool {
    sql.query_row(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'durability_migrations'",
        &[],
    )
    .unwrap()
    .is_some()
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|name| (*name).to_owned()).collect()
}

fn report(applied: &[&str], rolled_back: &[&str]) -> MigrationReport {
    MigrationReport {
        applied: names(applied),
        rolled_back: names(rolled_back),
    }
}

fn named(name: &str) -> MigrationTarget {
    MigrationTarget::Named(name.to_owned())
}

const CALLS_0001: &str = "durability_0001_create_calls";
const CALLS_0002: &str = "durability_0002_pending_index";
const CALLS_0004: &str = "durability_0004_calls_generation_and_created_at";
const ALARMS_0003: &str = "durability_0003_create_alarms";
const ALARMS_0004: &str = "durability_0004_alarms_generation_and_created_at";
const LEGACY_0004: &str = "durability_0004_generation_and_created_at";
const SCHEDULES_0014: &str = "durability_0014_create_alarm_schedules";

/// Operations as a newer version would ship them: the known list plus
/// `extra` migrations that each create one table.
fn newer_operations(extra: usize) -> Vec<Migration> {
    const FUTURE: [Migration; 3] = [
        Migration {
            name: "durability_0005_calls_future",
            up: "CREATE TABLE durability_calls_future_a (x INTEGER);",
            down: "DROP TABLE durability_calls_future_a;",
        },
        Migration {
            name: "durability_0006_calls_future",
            up: "CREATE TABLE durability_calls_future_b (x INTEGER);",
            down: "DROP TABLE durability_calls_future_b;",
        },
        Migration {
            name: "durability_0007_calls_future",
            up: "CREATE TABLE durability_calls_future_c (x INTEGER);",
            down: "DROP TABLE durability_calls_future_c;",
        },
    ];
    OPERATIONS_MIGRATIONS
        .iter()
        .chain(&FUTURE[..extra])
        .copied()
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_fresh_object_gets_every_operations_migration_in_order() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        assert!(!is_schema_current(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS).unwrap());
        let done = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        assert_eq!(done, report(&[CALLS_0001, CALLS_0002, CALLS_0004], &[]));
        assert_eq!(
            schema(storage),
            names(&[
                "index durability_calls_created_idx",
                "index durability_calls_pending_idx",
                "table durability_calls",
                "table durability_migrations",
            ])
        );
        let rows = history(storage);
        assert_eq!(rows.len(), 3);
        for ((name, capability, down), migration) in rows.iter().zip(OPERATIONS_MIGRATIONS) {
            assert_eq!(name, migration.name);
            assert_eq!(capability.as_deref(), Some(OPERATIONS_CAPABILITY));
            assert_eq!(down.as_deref(), Some(migration.down));
        }
        assert!(is_schema_current(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS).unwrap());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn constructing_one_capability_creates_only_its_tables_and_the_history_table() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        migrate(
            storage,
            NAMED_ALARMS_CAPABILITY,
            NAMED_ALARMS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        assert_eq!(
            schema(storage),
            names(&[
                "index durability_alarms_created_idx",
                "index durability_alarms_pending_idx",
                "table durability_alarm_schedules",
                "table durability_alarms",
                "table durability_migrations",
            ])
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn migrating_to_a_named_target_then_to_none_reverts_newest_first() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        let done = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            named(CALLS_0001),
        )
        .unwrap();
        assert_eq!(done, report(&[], &[CALLS_0004, CALLS_0002]));
        assert_eq!(
            schema(storage),
            names(&["table durability_calls", "table durability_migrations"])
        );
        let done = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            MigrationTarget::None,
        )
        .unwrap();
        assert_eq!(done, report(&[], &[CALLS_0001]));
        assert!(schema(storage).is_empty());
        // Back up again from nothing.
        let done = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            named(CALLS_0002),
        )
        .unwrap();
        assert_eq!(done, report(&[CALLS_0001, CALLS_0002], &[]));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_unknown_target_fails_before_any_statement_runs() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        let error = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            named("durability_9999_nope"),
        )
        .unwrap_err();
        assert_eq!(
            error,
            MigrationError::UnknownTarget {
                name: "durability_9999_nope".into()
            }
        );
        assert_eq!(
            error.to_string(),
            "Unknown durability migration target \"durability_9999_nope\""
        );
        assert!(!has_history_table(storage));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn repeating_a_migrate_call_with_the_same_target_changes_nothing() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        for target in [
            MigrationTarget::Latest,
            named(CALLS_0002),
            MigrationTarget::None,
        ] {
            migrate(
                storage,
                OPERATIONS_CAPABILITY,
                OPERATIONS_MIGRATIONS,
                target.clone(),
            )
            .unwrap();
            let (schema_before, history_before) = (schema_text(storage), history(storage));
            let again = migrate(
                storage,
                OPERATIONS_CAPABILITY,
                OPERATIONS_MIGRATIONS,
                target,
            )
            .unwrap();
            assert_eq!(again, MigrationReport::default());
            assert_eq!(schema_text(storage), schema_before);
            assert_eq!(history(storage), history_before);
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn repeating_a_migrate_call_refreshes_stale_down_scripts() {
    with_context(|ctx: Rc<dyn Context>| async move {
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
                "UPDATE durability_migrations SET down = 'SELECT 1;' WHERE name = ?",
                &params![CALLS_0002],
            )
            .unwrap();
        assert!(!is_schema_current(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS).unwrap());
        let schema_before = schema_text(storage);
        let again = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        assert_eq!(again, MigrationReport::default());
        assert_eq!(schema_text(storage), schema_before);
        assert!(is_schema_current(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS).unwrap());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_batch_applies_atomically_and_a_failing_up_leaves_neither_tables_nor_history_rows() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        let list = [
            Migration {
                name: "test_0001_good",
                up: "CREATE TABLE durability_test_good (x INTEGER); CREATE INDEX durability_test_good_idx ON durability_test_good (x);",
                down: "DROP TABLE durability_test_good;",
            },
            Migration {
                name: "test_0002_bad",
                up: "CREATE TABLE durability_test_half (x INTEGER); CREATE TABLE (;",
                down: "DROP TABLE durability_test_half;",
            },
        ];
        let error = migrate(storage, "test", &list, MigrationTarget::Latest).unwrap_err();
        assert!(
            matches!(&error, MigrationError::Script { name, direction: Direction::Up, .. } if name == "test_0002_bad"),
            "{error:?}"
        );
        assert_eq!(schema(storage), names(&["table durability_migrations"]));
        assert!(history(storage).is_empty());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_batch_reverts_atomically_and_a_failing_down_leaves_everything_applied() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        migrate(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS, MigrationTarget::Latest).unwrap();
        let (schema_before, history_before) = (schema_text(storage), history(storage));
        // The same migrations, but the oldest one's revert is broken: the
        // newer two revert first, then the batch fails and rolls back.
        let mut broken: Vec<Migration> = OPERATIONS_MIGRATIONS.to_vec();
        broken[0].down = "DROP TABLE durability_no_such_table;";
        let error = migrate(storage, OPERATIONS_CAPABILITY, &broken, MigrationTarget::None).unwrap_err();
        assert!(
            matches!(&error, MigrationError::Script { name, direction: Direction::Down, .. } if name == CALLS_0001),
            "{error:?}"
        );
        assert_eq!(schema_text(storage), schema_before);
        assert_eq!(history(storage), history_before);
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn at_most_two_unknown_migrations_are_auto_reverted() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        // One unknown migration: reverted whatever the target.
        migrate(
            storage,
            OPERATIONS_CAPABILITY,
            &newer_operations(1),
            MigrationTarget::Latest,
        )
        .unwrap();
        let done = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            named(CALLS_0004),
        )
        .unwrap();
        assert_eq!(done, report(&[], &["durability_0005_calls_future"]));
        assert!(!schema(storage).contains(&"table durability_calls_future_a".to_owned()));

        // Two: both reverted, newest first, then the target is applied.
        migrate(
            storage,
            OPERATIONS_CAPABILITY,
            &newer_operations(2),
            MigrationTarget::Latest,
        )
        .unwrap();
        let done = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            MigrationTarget::None,
        )
        .unwrap();
        assert_eq!(
            done,
            report(
                &[],
                &[
                    "durability_0006_calls_future",
                    "durability_0005_calls_future",
                    CALLS_0004,
                    CALLS_0002,
                    CALLS_0001
                ]
            )
        );
        assert!(schema(storage).is_empty());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn more_than_two_unknown_migrations_is_an_error_before_reverting_or_applying_anything() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        migrate(storage, OPERATIONS_CAPABILITY, &newer_operations(3), MigrationTarget::Latest).unwrap();
        let (schema_before, history_before) = (schema_text(storage), history(storage));
        for target in [MigrationTarget::Latest, MigrationTarget::None, named(CALLS_0001)] {
            let error = migrate(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS, target).unwrap_err();
            assert_eq!(
                error,
                MigrationError::TooFarAhead { capability: OPERATIONS_CAPABILITY.into(), count: 3 }
            );
            assert_eq!(
                error.to_string(),
                "Durability operations schema is 3 migrations ahead of this version; refusing to revert more than 2"
            );
            assert_eq!(schema_text(storage), schema_before);
            assert_eq!(history(storage), history_before);
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_unknown_migration_without_a_stored_down_script_is_an_error() {
    with_context(|ctx: Rc<dyn Context>| async move {
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
                "INSERT INTO durability_migrations (name, capability, down) VALUES (?, ?, NULL)",
                &params!["durability_0009_calls_future", OPERATIONS_CAPABILITY],
            )
            .unwrap();
        let error = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap_err();
        assert_eq!(
            error,
            MigrationError::MissingDown {
                name: "durability_0009_calls_future".into()
            }
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn migrating_one_capability_never_alters_another_capabilitys_tables_or_history() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        migrate(
            storage,
            NAMED_ALARMS_CAPABILITY,
            NAMED_ALARMS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        let alarms_schema = |sql: &dyn Sql| -> Vec<(String, Option<String>)> {
            schema_text(sql)
                .into_iter()
                .filter(|(name, _)| name.starts_with("durability_alarms"))
                .collect()
        };
        let alarms_history =
            |sql: &dyn Sql| -> Vec<(String, Option<String>, Option<String>, String)> {
                sql.query(
                    "SELECT name, capability, down, applied_at FROM durability_migrations \
                 WHERE capability = ? ORDER BY id",
                    &params![NAMED_ALARMS_CAPABILITY],
                )
                .unwrap()
                .iter()
                .map(|row| {
                    (
                        row.get(0).unwrap(),
                        row.get(1).unwrap(),
                        row.get(2).unwrap(),
                        row.get(3).unwrap(),
                    )
                })
                .collect()
            };
        let (schema_before, history_before) = (alarms_schema(storage), alarms_history(storage));
        for target in [
            MigrationTarget::Latest,
            named(CALLS_0001),
            MigrationTarget::None,
        ] {
            migrate(
                storage,
                OPERATIONS_CAPABILITY,
                OPERATIONS_MIGRATIONS,
                target,
            )
            .unwrap();
            assert_eq!(alarms_schema(storage), schema_before);
            assert_eq!(alarms_history(storage), history_before);
        }
        // Three unknown operations migrations block operations only.
        migrate(
            storage,
            OPERATIONS_CAPABILITY,
            &newer_operations(3),
            MigrationTarget::Latest,
        )
        .unwrap();
        assert!(
            migrate(
                storage,
                OPERATIONS_CAPABILITY,
                OPERATIONS_MIGRATIONS,
                MigrationTarget::Latest
            )
            .is_err()
        );
        let again = migrate(
            storage,
            NAMED_ALARMS_CAPABILITY,
            NAMED_ALARMS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        assert_eq!(again, MigrationReport::default());
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn after_migrating_every_capability_to_none_no_durability_table_or_history_table_remains() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        let capabilities = [
            (OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS),
            (NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS),
            ("memos", MEMO_MIGRATIONS),
        ];
        for (capability, list) in capabilities {
            migrate(storage, capability, list, MigrationTarget::Latest).unwrap();
        }
        for (index, (capability, list)) in capabilities.iter().enumerate() {
            migrate(storage, capability, list, MigrationTarget::None).unwrap();
            // The history table stays while another capability has rows.
            assert_eq!(has_history_table(storage), index + 1 < capabilities.len());
        }
        assert!(schema(storage).is_empty(), "{:?}", schema(storage));
    })
    .await;
}

/// A database as the 2.x library left it: a history table without the
/// `capability` and `down` columns, the combined 0004 row, and both tables.
fn write_2x_database(sql: &dyn Sql) {
    sql.execute_script(
        "CREATE TABLE durability_migrations (\
         id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT UNIQUE, \
         applied_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)",
    )
    .unwrap();
    // 2.x had the alarms table (0003, 0004) but no recurring schedules (0014).
    for migration in OPERATIONS_MIGRATIONS
        .iter()
        .chain(&NAMED_ALARMS_MIGRATIONS[..2])
    {
        sql.execute_script(migration.up).unwrap();
    }
    for name in [CALLS_0001, CALLS_0002, ALARMS_0003, LEGACY_0004] {
        sql.execute(
            "INSERT INTO durability_migrations (name) VALUES (?)",
            &params![name],
        )
        .unwrap();
    }
}

/// The 2.x database of [`write_2x_database`] after a 3.x library gave its
/// history table the `capability` and `down` columns but left 0004 recorded
/// only as the combined row, so this version does not translate it: the
/// rebuild guard records the split rows instead.
fn write_2x_database_with_3x_history_columns(sql: &dyn Sql) {
    write_2x_database(sql);
    sql.execute_script(
        "ALTER TABLE durability_migrations ADD COLUMN capability TEXT;
         ALTER TABLE durability_migrations ADD COLUMN down TEXT;",
    )
    .unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_2x_history_is_translated_claimed_and_keeps_its_combined_row() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        write_2x_database(storage);
        let schema_before = schema_text(storage);

        let done = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        assert_eq!(done, MigrationReport::default());
        assert!(is_schema_current(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS).unwrap());
        let rows = history(storage);
        let row = |name: &str| rows.iter().find(|row| row.0 == name).cloned().unwrap();
        assert_eq!(row(CALLS_0001).1.as_deref(), Some(OPERATIONS_CAPABILITY));
        assert_eq!(row(CALLS_0004).1.as_deref(), Some(OPERATIONS_CAPABILITY));
        // Claimed rows get this version's down scripts, so they can be reverted.
        assert_eq!(
            row(CALLS_0004).2.as_deref(),
            Some(OPERATIONS_MIGRATIONS[2].down)
        );
        // Other capabilities' rows are left for them to claim.
        assert_eq!(row(ALARMS_0003).1, None);
        assert_eq!(row(ALARMS_0004), (ALARMS_0004.to_owned(), None, None));
        assert_eq!(row(LEGACY_0004), (LEGACY_0004.to_owned(), None, None));

        let done = migrate(
            storage,
            NAMED_ALARMS_CAPABILITY,
            NAMED_ALARMS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        // Only what 2.x did not have runs: the recurring schedules table.
        assert_eq!(done, report(&[SCHEDULES_0014], &[]));
        assert!(
            is_schema_current(storage, NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS).unwrap()
        );
        assert_eq!(schema_text(storage).len(), schema_before.len() + 1);

        for (capability, list) in [
            (OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS),
            (NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS),
        ] {
            migrate(storage, capability, list, MigrationTarget::None).unwrap();
        }
        // The combined row is never removed, so a 2.x deployment still sees
        // a complete history, and the history table stays.
        assert_eq!(schema(storage), names(&["table durability_migrations"]));
        assert_eq!(history(storage), vec![(LEGACY_0004.to_owned(), None, None)]);

        // The combined row does not resurrect a reverted split row: going up
        // again applies 0004 for real.
        let done = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        assert_eq!(done, report(&[CALLS_0001, CALLS_0002, CALLS_0004], &[]));
        assert!(
            storage
                .query(
                    "SELECT generation_id, created_at FROM durability_calls",
                    &[]
                )
                .is_ok()
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn rows_written_before_0004_get_a_legacy_generation_and_survive_its_revert() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        migrate(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS, named(CALLS_0002)).unwrap();
        storage
            .execute(
                "INSERT INTO durability_calls (id, operation, payload, status, next_attempt_at) \
                 VALUES ('c1', 'charge', '{\"kind\":\"undefined\"}', 'pending', 5)",
                &[],
            )
            .unwrap();
        migrate(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS, MigrationTarget::Latest).unwrap();
        let row = storage
            .query_row("SELECT generation_id, created_at, next_attempt_at FROM durability_calls WHERE id = 'c1'", &[])
            .unwrap()
            .unwrap();
        assert_eq!(row.get::<String>(0).unwrap(), "legacy:c1");
        // Backfilled with SQLite's clock (the wall clock, not the host's).
        assert!(row.get::<i64>(1).unwrap() > 1_600_000_000_000);
        assert_eq!(row.get::<i64>(2).unwrap(), 5);

        migrate(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS, named(CALLS_0002)).unwrap();
        let row = storage
            .query_row("SELECT * FROM durability_calls WHERE id = 'c1'", &[])
            .unwrap()
            .unwrap();
        assert!(!row.columns().iter().any(|column| column == "generation_id" || column == "created_at"));
        assert_eq!(row.get_named::<String>("operation").unwrap(), "charge");
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn schema_is_current_only_when_the_history_matches_the_list_exactly() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        assert!(is_schema_current(storage, "empty", &[]).unwrap());
        assert!(!is_schema_current(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS).unwrap());
        migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            named(CALLS_0002),
        )
        .unwrap();
        assert!(!is_schema_current(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS).unwrap());
        assert!(
            is_schema_current(storage, OPERATIONS_CAPABILITY, &OPERATIONS_MIGRATIONS[..2]).unwrap()
        );
        assert!(
            !is_schema_current(storage, OPERATIONS_CAPABILITY, &OPERATIONS_MIGRATIONS[..1])
                .unwrap()
        );
        assert!(
            !is_schema_current(storage, NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS).unwrap()
        );
        assert!(is_schema_current(storage, NAMED_ALARMS_CAPABILITY, &[]).unwrap());
    })
    .await;
}

/// Where the crash child finds its data directory.
const CRASH_DIR_ENV: &str = "DURABILITY_TEST_MIGRATION_CRASH_DIR";
/// Printed by the child right before it starts migrating.
const CRASH_CHILD_READY: &str = "migration-crash-child: migrating";

/// A batch slow enough (millions of inserted rows) that a kill sent when it
/// starts lands inside it.
const SLOW_MIGRATIONS: &[Migration] = &[
    Migration {
        name: "crash_0001_slow",
        up: "CREATE TABLE durability_crash_rows (n INTEGER NOT NULL);
WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < 5000000)
INSERT INTO durability_crash_rows SELECT n FROM c;",
        down: "DROP TABLE durability_crash_rows;",
    },
    Migration {
        name: "crash_0002_after",
        up: "CREATE TABLE durability_crash_after (n INTEGER);",
        down: "DROP TABLE durability_crash_after;",
    },
];

/// The child process of
/// [`a_crash_during_a_migration_batch_leaves_the_schema_before_or_after_it`]:
/// migrates until it is killed. Does nothing when run on its own.
#[test]
#[ignore = "run as a child process by a_crash_during_a_migration_batch_leaves_the_schema_before_or_after_it"]
fn migration_crash_child() {
    let Some(dir) = std::env::var_os(CRASH_DIR_ENV) else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tokio::task::LocalSet::new().block_on(&runtime, async move {
        let (_host, objects) = open_host(Path::new(&dir));
        let migrated = objects
            .stub("crash")
            .unwrap()
            .call(|object: Rc<support::TestObject>| async move {
                let mut stdout = std::io::stdout();
                writeln!(stdout, "{CRASH_CHILD_READY}").unwrap();
                stdout.flush().unwrap();
                migrate(
                    object.ctx.storage(),
                    "crash",
                    SLOW_MIGRATIONS,
                    MigrationTarget::Latest,
                )
            })
            .await
            .unwrap();
        migrated.unwrap();
    });
}

#[test]
fn a_crash_during_a_migration_batch_leaves_the_schema_before_or_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "migration_crash_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CRASH_DIR_ENV, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut ready = false;
    for line in stdout.lines() {
        if line.unwrap().contains(CRASH_CHILD_READY) {
            ready = true;
            break;
        }
    }
    assert!(ready, "the child never started migrating");
    // SIGKILL: no destructor, no rollback by the process itself.
    child.kill().unwrap();
    child.wait().unwrap();

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    tokio::task::LocalSet::new().block_on(&runtime, async move {
        let (host, objects) = open_host(dir.path());
        let stub = objects.stub("crash").unwrap();
        stub.call(|object: Rc<support::TestObject>| async move {
            let storage = object.ctx.storage();
            let tables = schema(storage);
            let crash_rows: Vec<_> = history(storage)
                .into_iter()
                .filter(|(_, capability, _)| capability.as_deref() == Some("crash"))
                .collect();
            let has_rows_table = tables.contains(&"table durability_crash_rows".to_owned());
            let has_after_table = tables.contains(&"table durability_crash_after".to_owned());
            let before = !has_rows_table && !has_after_table && crash_rows.is_empty();
            let after = has_rows_table && has_after_table && crash_rows.len() == 2;
            assert!(
                before || after,
                "between: tables {tables:?}, history {crash_rows:?}"
            );
            if after {
                let count = storage
                    .query_row("SELECT COUNT(*) FROM durability_crash_rows", &[])
                    .unwrap()
                    .unwrap()
                    .get::<i64>(0)
                    .unwrap();
                assert_eq!(count, 5_000_000);
            }
            let integrity = storage
                .query_row("PRAGMA integrity_check", &[])
                .unwrap()
                .unwrap()
                .get::<String>(0)
                .unwrap();
            assert_eq!(integrity, "ok");
            // Either state is a consistent starting point for the next call.
            migrate(storage, "crash", SLOW_MIGRATIONS, MigrationTarget::None).unwrap();
            assert!(schema(storage).is_empty(), "{:?}", schema(storage));
        })
        .await
        .unwrap();
        host.shutdown().await;
    });
}

// Issue 10, defect 5: a 3.x history table (with the `capability` and `down`
// columns) that records 0004 only as the 2.x combined row. The tables
// already have the 0004 columns; re-running the table rebuild would give
// every existing row a new generation and created_at.
#[tokio::test(start_paused = true)]
async fn a_table_rebuild_already_in_the_schema_is_recorded_not_run_again() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        write_2x_database_with_3x_history_columns(storage);
        storage
            .execute(
                "INSERT INTO durability_calls (id, operation, payload, status, next_attempt_at, \
                 generation_id, created_at) \
                 VALUES ('c1', 'charge', '{\"kind\":\"undefined\"}', 'pending', 5, 'g-real', 42)",
                &[],
            )
            .unwrap();
        storage
            .execute(
                "INSERT INTO durability_alarms (name, generation_id, status, scheduled_at, \
                 next_attempt_at, created_at) VALUES ('a1', 'g-alarm', 'pending', 7, 7, 43)",
                &[],
            )
            .unwrap();
        let done = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        assert_eq!(done, MigrationReport::default(), "recorded, not applied");
        migrate(
            storage,
            NAMED_ALARMS_CAPABILITY,
            NAMED_ALARMS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        let call = storage
            .query_row(
                "SELECT generation_id, created_at FROM durability_calls WHERE id = 'c1'",
                &[],
            )
            .unwrap()
            .unwrap();
        assert_eq!(call.get::<String>(0).unwrap(), "g-real");
        assert_eq!(call.get::<i64>(1).unwrap(), 42);
        let alarm = storage
            .query_row(
                "SELECT generation_id, created_at FROM durability_alarms WHERE name = 'a1'",
                &[],
            )
            .unwrap()
            .unwrap();
        assert_eq!(alarm.get::<String>(0).unwrap(), "g-alarm");
        assert_eq!(alarm.get::<i64>(1).unwrap(), 43);
        assert!(is_schema_current(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS).unwrap());
        // Reverting and re-applying still runs the rebuild for real.
        migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            named(CALLS_0002),
        )
        .unwrap();
        let done = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        assert_eq!(done, report(&[CALLS_0004], &[]));
        let call = storage
            .query_row(
                "SELECT generation_id FROM durability_calls WHERE id = 'c1'",
                &[],
            )
            .unwrap()
            .unwrap();
        assert_eq!(call.get::<String>(0).unwrap(), "legacy:c1");
    })
    .await;
}

// MIG-005: recording the split 0004 rows that stand for the combined 2.x
// row is bookkeeping. A report that named them would tell the caller a
// table was rebuilt when none was.
#[tokio::test(start_paused = true)]
async fn a_2x_history_whose_0004_rebuild_is_done_reports_nothing_applied() {
    with_context(|ctx: Rc<dyn Context>| async move {
        let storage = ctx.storage();
        write_2x_database_with_3x_history_columns(storage);

        let done = migrate(
            storage,
            OPERATIONS_CAPABILITY,
            OPERATIONS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        assert_eq!(done, MigrationReport::default());
        let done = migrate(
            storage,
            NAMED_ALARMS_CAPABILITY,
            NAMED_ALARMS_MIGRATIONS,
            MigrationTarget::Latest,
        )
        .unwrap();
        // The one script that runs: 2.x had no recurring schedules.
        assert_eq!(done, report(&[SCHEDULES_0014], &[]));

        // The split rows are recorded all the same, so the next call has
        // nothing left to do.
        assert!(is_schema_current(storage, OPERATIONS_CAPABILITY, OPERATIONS_MIGRATIONS).unwrap());
        assert!(
            is_schema_current(storage, NAMED_ALARMS_CAPABILITY, NAMED_ALARMS_MIGRATIONS).unwrap()
        );
    })
    .await;
}
