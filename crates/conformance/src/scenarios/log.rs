//! The retained log: appends with keys, pages and lag, cursors, leases
//! (ack order, expiry, fencing, nack), retention into cold segments that
//! stay readable, and truncation when a segment is forgotten or lost.

use std::time::Duration;

use serde_json::{Value, json};

use super::{Driver, ask, check};
use crate::LogCommand;
use crate::fixture::log::{LEASE_MS, RETAINED_RECORDS};

fn append(bodies: &[&str], keys: &[Option<&str>]) -> LogCommand {
    LogCommand::Append {
        bodies: bodies.iter().map(|b| json!(b)).collect(),
        keys: keys.iter().map(|k| k.map(str::to_owned)).collect(),
    }
}

fn numbered(count: usize) -> LogCommand {
    LogCommand::Append {
        bodies: (0..count).map(|i| json!(format!("r{i}"))).collect(),
        keys: Vec::new(),
    }
}

fn read(from: u64, limit: Option<u32>) -> LogCommand {
    LogCommand::Read { from, limit }
}

fn cursor(consumer: &str) -> LogCommand {
    LogCommand::Cursor {
        consumer: consumer.into(),
    }
}

fn lease(consumer: &str, limit: Option<u32>) -> LogCommand {
    LogCommand::Lease {
        consumer: consumer.into(),
        limit,
    }
}

fn ack(consumer: &str, lease: &Value) -> LogCommand {
    LogCommand::Ack {
        consumer: consumer.into(),
        batch_id: lease["batch_id"].as_str().unwrap_or_default().to_owned(),
    }
}

pub(crate) async fn log_append_read_commit(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-log");
    let appended = ask(
        driver,
        &object,
        append(&["a", "b", "c"], &[Some("k-a"), None, None]),
    )
    .await?;
    check(appended["offsets"] == json!([0, 1, 2]), || {
        format!("append: {appended}")
    })?;
    // The same key again returns the original offset and writes nothing.
    let again = ask(driver, &object, append(&["a"], &[Some("k-a")])).await?;
    check(again["offsets"] == json!([0]), || {
        format!("keyed re-append: {again}")
    })?;
    let page = ask(driver, &object, read(0, None)).await?;
    check(
        page["bodies"] == json!(["a", "b", "c"]) && page["next_offset"] == 3,
        || format!("read: {page}"),
    )?;
    let none = ask(driver, &object, cursor("c1")).await?;
    check(none.is_null(), || format!("cursor before commit: {none}"))?;
    let commit = LogCommand::Commit {
        consumer: "c1".into(),
        offset: 3,
    };
    ask(driver, &object, commit).await?;
    let cursor = ask(driver, &object, cursor("c1")).await?;
    check(cursor == 3, || format!("cursor after commit: {cursor}"))
}

pub(crate) async fn a_key_with_another_body_is_a_conflict_and_writes_nothing(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-keys");
    ask(driver, &object, append(&["x"], &[Some("k")])).await?;
    let conflict = ask(driver, &object, append(&["z", "y"], &[None, Some("k")])).await?;
    check(
        conflict["rejected"]
            .as_str()
            .is_some_and(|e| e.contains("\"k\"")),
        || format!("a key with another body: {conflict}"),
    )?;
    let repeated = ask(
        driver,
        &object,
        append(&["p", "q"], &[Some("j"), Some("j")]),
    )
    .await?;
    check(repeated["rejected"].is_string(), || {
        format!("a key repeated in a batch: {repeated}")
    })?;
    let bounds = ask(driver, &object, LogCommand::Bounds).await?;
    check(bounds["nextOffset"] == 1, || {
        format!("rejected appends wrote: {bounds}")
    })
}

pub(crate) async fn reads_page_by_limit_and_report_the_lag(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-pages");
    ask(driver, &object, numbered(7)).await?;
    let page = ask(driver, &object, read(2, Some(3))).await?;
    check(
        page["offsets"] == json!([2, 3, 4])
            && page["bodies"] == json!(["r2", "r3", "r4"])
            && page["next_offset"] == 5
            && page["lag"] == 2,
        || format!("page: {page}"),
    )?;
    let end = ask(driver, &object, read(7, None)).await?;
    check(
        end["offsets"] == json!([]) && end["next_offset"] == 7 && end["lag"] == 0,
        || format!("the end of the log: {end}"),
    )
}

pub(crate) async fn a_cursor_only_moves_forward_and_never_past_the_end(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-cursor");
    ask(driver, &object, numbered(3)).await?;
    let commit = |offset| LogCommand::Commit {
        consumer: "c".into(),
        offset,
    };
    ask(driver, &object, commit(2)).await?;
    ask(driver, &object, commit(1)).await?;
    let kept = ask(driver, &object, cursor("c")).await?;
    check(kept == 2, || {
        format!("a commit moved the cursor back: {kept}")
    })?;
    let beyond = ask(driver, &object, commit(4)).await?;
    check(beyond["refused"].is_string(), || {
        format!("a commit past the end: {beyond}")
    })?;
    let kept = ask(driver, &object, cursor("c")).await?;
    check(kept == 2, || {
        format!("a refused commit moved the cursor: {kept}")
    })
}

pub(crate) async fn leases_hand_out_ranges_and_acks_move_the_cursor_in_order(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-leases");
    ask(driver, &object, numbered(4)).await?;
    let first = ask(driver, &object, lease("w", Some(2))).await?;
    let second = ask(driver, &object, lease("w", Some(2))).await?;
    check(
        first["first_offset"] == 0
            && first["last_offset"] == 1
            && first["attempt"] == 1
            && second["first_offset"] == 2
            && second["last_offset"] == 3
            && second["bodies"] == json!(["r2", "r3"]),
        || format!("leases: {first}, {second}"),
    )?;
    let third = ask(driver, &object, lease("w", Some(2))).await?;
    check(third.is_null(), || {
        format!("a lease beyond the parallelism: {third}")
    })?;
    // The cursor never passes an unsettled range.
    ask(driver, &object, ack("w", &second)).await?;
    let held_back = ask(driver, &object, cursor("w")).await?;
    check(held_back.as_u64().unwrap_or(0) == 0, || {
        format!("the cursor passed an unsettled range: {held_back}")
    })?;
    ask(driver, &object, ack("w", &first)).await?;
    let moved = ask(driver, &object, cursor("w")).await?;
    check(moved == 4, || {
        format!("the cursor after both acks: {moved}")
    })
}

pub(crate) async fn an_expired_lease_is_handed_out_again_and_the_old_holder_is_fenced(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-expiry");
    ask(driver, &object, numbered(2)).await?;
    let first = ask(driver, &object, lease("w", None)).await?;
    driver.sleep(Duration::from_millis(LEASE_MS + 400)).await;
    let again = ask(driver, &object, lease("w", None)).await?;
    check(
        again["first_offset"] == first["first_offset"]
            && again["last_offset"] == first["last_offset"]
            && again["attempt"] == 2
            && again["batch_id"] != first["batch_id"],
        || format!("after expiry: {first} then {again}"),
    )?;
    let fenced = ask(driver, &object, ack("w", &first)).await?;
    check(fenced["refused"].is_string(), || {
        format!("the expired holder's ack: {fenced}")
    })?;
    let settled = ask(driver, &object, ack("w", &again)).await?;
    check(settled["settled"] == true, || {
        format!("the new holder's ack: {settled}")
    })?;
    let moved = ask(driver, &object, cursor("w")).await?;
    check(moved == 2, || format!("cursor: {moved}"))
}

pub(crate) async fn a_nacked_range_is_handed_out_again_at_once(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-nack");
    ask(driver, &object, numbered(2)).await?;
    let first = ask(driver, &object, lease("w", None)).await?;
    let nack = LogCommand::Nack {
        consumer: "w".into(),
        batch_id: first["batch_id"].as_str().unwrap_or_default().to_owned(),
    };
    ask(driver, &object, nack).await?;
    let again = ask(driver, &object, lease("w", None)).await?;
    check(
        again["first_offset"] == first["first_offset"] && again["attempt"] == 2,
        || format!("after a nack: {first} then {again}"),
    )
}

pub(crate) async fn retention_moves_the_oldest_records_to_readable_cold_segments(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-retention");
    let count = 12_u64;
    ask(driver, &object, numbered(12)).await?;
    let trimmed = ask(driver, &object, LogCommand::Trim).await?;
    check(trimmed == count - RETAINED_RECORDS, || {
        format!("trimmed {trimmed}")
    })?;
    let bounds = ask(driver, &object, LogCommand::Bounds).await?;
    check(
        bounds["oldestOffset"] == 0
            && bounds["hotOffset"] == count - RETAINED_RECORDS
            && bounds["nextOffset"] == count,
        || format!("bounds after trim: {bounds}"),
    )?;
    // Every record is still readable, cold ones first, in order.
    let mut bodies = Vec::new();
    let mut from = 0;
    while from < count {
        let page = ask(driver, &object, read(from, None)).await?;
        let next = page["next_offset"]
            .as_u64()
            .ok_or_else(|| format!("page: {page}"))?;
        check(next > from, || format!("no progress from {from}: {page}"))?;
        bodies.extend(page["bodies"].as_array().cloned().unwrap_or_default());
        from = next;
    }
    let expected: Vec<Value> = (0..count).map(|i| json!(format!("r{i}"))).collect();
    check(bodies == expected, || format!("read back {bodies:?}"))
}

pub(crate) async fn a_forgotten_or_lost_segment_is_truncation(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let hot = 12 - RETAINED_RECORDS;
    for (suffix, lose) in [
        ("forgotten", LogCommand::ForgetColdBefore { offset: hot }),
        ("lost", LogCommand::LoseColdSegments),
    ] {
        let object = format!("{prefix}-{suffix}");
        ask(driver, &object, numbered(12)).await?;
        ask(driver, &object, LogCommand::Trim).await?;
        ask(driver, &object, lose).await?;
        let gone = ask(driver, &object, read(0, None)).await?;
        check(
            gone["truncated"]["requested"] == 0
                && gone["truncated"]["oldest"].as_u64().is_some_and(|o| o > 0),
            || format!("{suffix} segment: reading from 0 gave {gone}"),
        )?;
        let resumed = ask(driver, &object, read(hot, None)).await?;
        check(
            resumed["offsets"]
                .as_array()
                .is_some_and(|o| o.len() as u64 == RETAINED_RECORDS),
            || format!("{suffix} segment: reading the hot records gave {resumed}"),
        )?;
    }
    Ok(())
}
