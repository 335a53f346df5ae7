//! Migrations: every capability's schema on a fresh object, nothing to do
//! on a built one, and the fixture's own capability taken to any target:
//! applied once, reverted by its down scripts (also by a version that does
//! not know them), a failing batch rolled back whole.

use serde_json::{Value, json};

use super::{Driver, ask, check};
use crate::fixture::migrations::{CAPABILITY, MIGRATIONS};
use crate::{MigrateTo, MigrationsCommand, PlatformCommand};

fn migrate(known: usize, target: MigrateTo) -> MigrationsCommand {
    MigrationsCommand::Migrate {
        known,
        target,
        broken: false,
    }
}

fn names(range: std::ops::Range<usize>) -> Value {
    json!(MIGRATIONS[range].iter().map(|m| m.name).collect::<Vec<_>>())
}

fn history(capability: &str) -> MigrationsCommand {
    MigrationsCommand::History {
        capability: capability.into(),
    }
}

async fn tables(driver: &dyn Driver, object: &str) -> Result<Vec<String>, String> {
    let tables = ask(driver, object, PlatformCommand::Tables).await?;
    Ok(tables
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_str().map(str::to_owned))
        .collect())
}

pub(crate) async fn migrations_on_a_fresh_object(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-fresh");
    let tables = tables(driver, &object).await?;
    for table in [
        "durability_migrations",
        "durability_calls",
        "durability_alarms",
        "durability_alarm_schedules",
        "durability_log_records",
        "conformance_events",
    ] {
        check(tables.iter().any(|t| t == table), || {
            format!("table {table} missing after migrations: {tables:?}")
        })?;
    }
    check(
        tables.iter().any(|t| t.starts_with("durability_fanout_")),
        || format!("no fanout table: {tables:?}"),
    )?;
    for capability in ["operations", "namedAlarms", "fanout", "log", "logLeases"] {
        let rows = ask(driver, &object, history(capability)).await?;
        check(rows.as_array().is_some_and(|r| !r.is_empty()), || {
            format!("no history of {capability}: {rows}")
        })?;
    }
    Ok(())
}

pub(crate) async fn migrating_a_built_object_again_applies_nothing(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-rerun");
    let report = ask(driver, &object, MigrationsCommand::Remigrate).await?;
    let nothing = json!({ "applied": [], "rolled_back": [] });
    for capability in ["operations", "alarms", "fanout", "log", "log_leases"] {
        check(report[capability] == nothing, || {
            format!("migrating {capability} again changed something: {report}")
        })?;
    }
    Ok(())
}

pub(crate) async fn a_capability_applies_its_whole_list_once(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-once");
    let first = ask(driver, &object, migrate(3, MigrateTo::Latest)).await?;
    check(first["applied"] == names(0..3), || {
        format!("first run: {first}")
    })?;
    let again = ask(driver, &object, migrate(3, MigrateTo::Latest)).await?;
    check(
        again["applied"] == json!([]) && again["rolled_back"] == json!([]),
        || format!("second run: {again}"),
    )?;
    let rows = ask(driver, &object, history(CAPABILITY)).await?;
    check(rows == names(0..3), || format!("history: {rows}"))?;
    let tables = tables(driver, &object).await?;
    check(
        ["conformance_notes", "conformance_tags", "conformance_links"]
            .iter()
            .all(|t| tables.iter().any(|have| have == t)),
        || format!("tables: {tables:?}"),
    )
}

pub(crate) async fn down_scripts_revert_to_a_named_target_and_to_none(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-down");
    ask(driver, &object, migrate(3, MigrateTo::Latest)).await?;
    let to_first = MigrateTo::Named {
        name: MIGRATIONS[0].name.into(),
    };
    let back = ask(driver, &object, migrate(3, to_first)).await?;
    check(
        back["rolled_back"] == json!([MIGRATIONS[2].name, MIGRATIONS[1].name]),
        || format!("back to the first: {back}"),
    )?;
    let left = tables(driver, &object).await?;
    check(
        left.iter().any(|t| t == "conformance_notes")
            && !left
                .iter()
                .any(|t| t == "conformance_tags" || t == "conformance_links"),
        || format!("tables after reverting two: {left:?}"),
    )?;
    let none = ask(driver, &object, migrate(3, MigrateTo::None)).await?;
    check(none["rolled_back"] == names(0..1), || {
        format!("to none: {none}")
    })?;
    let left = tables(driver, &object).await?;
    check(
        !left.iter().any(|t| t.starts_with("conformance_notes")),
        || format!("tables after reverting all: {left:?}"),
    )?;
    let rows = ask(driver, &object, history(CAPABILITY)).await?;
    check(rows == json!([]), || {
        format!("history after reverting all: {rows}")
    })?;
    let up = ask(driver, &object, migrate(3, MigrateTo::Latest)).await?;
    check(up["applied"] == names(0..3), || format!("up again: {up}"))
}

pub(crate) async fn an_older_version_reverts_what_it_does_not_know_from_the_stored_down(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-older");
    ask(driver, &object, migrate(3, MigrateTo::Latest)).await?;
    // A version that knows only the first migration.
    let older = ask(driver, &object, migrate(1, MigrateTo::Latest)).await?;
    check(
        older["rolled_back"] == json!([MIGRATIONS[2].name, MIGRATIONS[1].name]),
        || format!("an older version's run: {older}"),
    )?;
    let rows = ask(driver, &object, history(CAPABILITY)).await?;
    check(rows == names(0..1), || format!("history: {rows}"))?;
    // Three unknown migrations are more than a version reverts on its own.
    ask(driver, &object, migrate(3, MigrateTo::Latest)).await?;
    let refused = ask(driver, &object, migrate(0, MigrateTo::Latest)).await?;
    check(
        refused["error"]
            .as_str()
            .is_some_and(|e| e.contains("ahead")),
        || format!("a version three migrations behind: {refused}"),
    )?;
    let rows = ask(driver, &object, history(CAPABILITY)).await?;
    check(rows == names(0..3), || {
        format!("a refused revert changed the history: {rows}")
    })
}

pub(crate) async fn a_failing_up_script_rolls_back_its_whole_batch(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-failing");
    let command = MigrationsCommand::Migrate {
        known: 1,
        target: MigrateTo::Latest,
        broken: true,
    };
    let failed = ask(driver, &object, command).await?;
    check(
        failed["error"]
            .as_str()
            .is_some_and(|e| e.contains("conformance_0002_broken")),
        || format!("a failing up script: {failed}"),
    )?;
    let left = tables(driver, &object).await?;
    check(
        !left
            .iter()
            .any(|t| t == "conformance_notes" || t == "conformance_half"),
        || format!("a failed batch left tables: {left:?}"),
    )?;
    let rows = ask(driver, &object, history(CAPABILITY)).await?;
    check(rows == json!([]), || {
        format!("a failed batch left history: {rows}")
    })
}

pub(crate) async fn an_unknown_target_is_refused_and_changes_nothing(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-unknown");
    let refused = ask(
        driver,
        &object,
        migrate(
            3,
            MigrateTo::Named {
                name: "nope".into(),
            },
        ),
    )
    .await?;
    check(
        refused["error"]
            .as_str()
            .is_some_and(|e| e.contains("nope")),
        || format!("an unknown target: {refused}"),
    )?;
    let rows = ask(driver, &object, history(CAPABILITY)).await?;
    check(rows == json!([]), || {
        format!("an unknown target wrote history: {rows}")
    })
}
