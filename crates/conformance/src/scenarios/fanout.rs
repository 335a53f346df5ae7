//! Fanout: atomic batches, deduplication, independent targets, batching,
//! ack on return, retries, dead letters, parked entries and their redrive
//! and purge, and per-target rate and concurrency limits.

use serde_json::{Value, json};

use super::{Driver, ask, check, events, eventually};
use crate::fixture::fanout::{
    BATCH_EVENT, DELIVERY_EVENT, FANOUT_MAX_ATTEMPTS, MAX_BATCH_SIZE, RATED_PER_SECOND,
};
use crate::{FanoutCommand, FanoutSpec};

fn spec(id: &str) -> FanoutSpec {
    FanoutSpec {
        id: id.into(),
        ..FanoutSpec::default()
    }
}

fn enqueue(messages: Vec<FanoutSpec>, targets: &[&str]) -> FanoutCommand {
    FanoutCommand::Enqueue {
        messages,
        targets: targets.iter().map(|t| (*t).to_owned()).collect(),
    }
}

fn target(name: &str) -> String {
    name.to_owned()
}

async fn drained(driver: &dyn Driver, object: &str) -> Result<(), String> {
    eventually(driver, object, FanoutCommand::Owed, |v| *v == 0)
        .await
        .map(drop)
}

async fn parked(driver: &dyn Driver, object: &str, count: usize) -> Result<Vec<Value>, String> {
    let all = eventually(driver, object, FanoutCommand::Parked, |v| {
        v.as_array().is_some_and(|p| p.len() >= count)
    })
    .await?;
    Ok(all.as_array().cloned().unwrap_or_default())
}

/// The batches handed to `target`, as their message ids.
async fn batches(
    driver: &dyn Driver,
    object: &str,
    target: &str,
) -> Result<Vec<Vec<String>>, String> {
    Ok(events(driver, object, BATCH_EVENT)
        .await?
        .iter()
        .filter(|e| e["name"] == target)
        .map(|e| {
            e["detail"]["ids"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|id| id.as_str().map(str::to_owned))
                .collect()
        })
        .collect())
}

pub(crate) async fn fanout_batch_two_targets_retry_dead_letter_parked(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-fanout");
    let batch = vec![
        spec("m1"),
        FanoutSpec {
            fail_b: 1,
            ..spec("m2")
        },
        FanoutSpec {
            poison: true,
            ..spec("m3")
        },
    ];
    let accepted = ask(driver, &object, enqueue(batch, &["a", "b"])).await?;
    check(accepted["accepted"] == json!(["m1", "m2", "m3"]), || {
        format!("enqueue: {accepted}")
    })?;
    drained(driver, &object).await?;
    let deliveries = ask(driver, &object, FanoutCommand::Deliveries).await?;
    // Target a got all three at once; b got m1 at once, m2 on its retry,
    // and dead-lettered m3.
    check(
        deliveries == json!(["a:m1@1", "a:m2@1", "a:m3@1", "b:m1@1", "b:m2@2"]),
        || format!("deliveries: {deliveries}"),
    )?;
    let parked = parked(driver, &object, 1).await?;
    check(
        parked.len() == 1
            && parked[0]["target"] == "b"
            && parked[0]["message_id"] == "m3"
            && parked[0]["reason"] == "explicit",
        || format!("parked: {parked:?}"),
    )
}

pub(crate) async fn a_batch_with_a_conflicting_key_is_rejected_whole(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-atomic");
    // Held back, so the first message's key stays retained.
    ask(
        driver,
        &object,
        FanoutCommand::Pause {
            target: target("held"),
        },
    )
    .await?;
    let first = FanoutSpec {
        key: Some("k1".into()),
        tag: Some("x".into()),
        ..spec("m1")
    };
    let accepted = ask(driver, &object, enqueue(vec![first], &["held"])).await?;
    check(accepted["accepted"] == json!(["m1"]), || {
        format!("first: {accepted}")
    })?;
    let conflicting = FanoutSpec {
        key: Some("k1".into()),
        tag: Some("y".into()),
        ..spec("m3")
    };
    let rejected = ask(
        driver,
        &object,
        enqueue(vec![spec("m2"), conflicting], &["held"]),
    )
    .await?;
    check(rejected["rejected"].is_string(), || {
        format!("a conflicting key: {rejected}")
    })?;
    let unknown = ask(
        driver,
        &object,
        enqueue(vec![spec("m4")], &["held", "nowhere"]),
    )
    .await?;
    check(
        unknown["rejected"]
            .as_str()
            .is_some_and(|e| e.contains("nowhere")),
        || format!("an unknown target: {unknown}"),
    )?;
    let backlog = ask(
        driver,
        &object,
        FanoutCommand::Backlog {
            target: target("held"),
        },
    )
    .await?;
    check(backlog == 1, || {
        format!("a rejected batch left deliveries: {backlog}")
    })?;
    ask(
        driver,
        &object,
        FanoutCommand::Resume {
            target: target("held"),
        },
    )
    .await?;
    drained(driver, &object).await?;
    let deliveries = ask(driver, &object, FanoutCommand::Deliveries).await?;
    check(deliveries == json!(["held:m1@1"]), || {
        format!("deliveries: {deliveries}")
    })
}

pub(crate) async fn the_same_message_again_is_accepted_without_new_work(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-dedup");
    ask(
        driver,
        &object,
        FanoutCommand::Pause {
            target: target("held"),
        },
    )
    .await?;
    for _ in 0..2 {
        let accepted = ask(driver, &object, enqueue(vec![spec("d1")], &["held"])).await?;
        check(accepted["accepted"] == json!(["d1"]), || {
            format!("enqueue: {accepted}")
        })?;
    }
    let backlog = ask(
        driver,
        &object,
        FanoutCommand::Backlog {
            target: target("held"),
        },
    )
    .await?;
    check(backlog == 1, || {
        format!("a repeated enqueue added work: {backlog}")
    })?;
    ask(
        driver,
        &object,
        FanoutCommand::Resume {
            target: target("held"),
        },
    )
    .await?;
    drained(driver, &object).await?;
    let handed = events(driver, &object, DELIVERY_EVENT).await?;
    check(handed.len() == 1, || {
        format!("delivered more than once: {handed:?}")
    })
}

pub(crate) async fn a_paused_target_never_holds_back_another(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-independent");
    ask(
        driver,
        &object,
        FanoutCommand::Pause {
            target: target("b"),
        },
    )
    .await?;
    ask(
        driver,
        &object,
        enqueue(vec![spec("p1"), spec("p2")], &["a", "b"]),
    )
    .await?;
    eventually(driver, &object, FanoutCommand::Deliveries, |v| {
        *v == json!(["a:p1@1", "a:p2@1"])
    })
    .await?;
    let backlog = ask(
        driver,
        &object,
        FanoutCommand::Backlog {
            target: target("b"),
        },
    )
    .await?;
    check(backlog == 2, || {
        format!("the paused target's backlog: {backlog}")
    })?;
    ask(
        driver,
        &object,
        FanoutCommand::Resume {
            target: target("b"),
        },
    )
    .await?;
    drained(driver, &object).await?;
    let deliveries = ask(driver, &object, FanoutCommand::Deliveries).await?;
    check(
        deliveries == json!(["a:p1@1", "a:p2@1", "b:p1@1", "b:p2@1"]),
        || format!("deliveries: {deliveries}"),
    )
}

pub(crate) async fn deliveries_come_in_batches_of_at_most_max_batch_size(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-batches");
    let messages: Vec<FanoutSpec> = (0..25).map(|i| spec(&format!("b{i:02}"))).collect();
    ask(driver, &object, enqueue(messages, &["a"])).await?;
    drained(driver, &object).await?;
    let handed = batches(driver, &object, "a").await?;
    let sizes: Vec<usize> = handed.iter().map(Vec::len).collect();
    check(
        sizes.iter().all(|s| *s <= MAX_BATCH_SIZE)
            && sizes.iter().sum::<usize>() == 25
            && sizes.len() >= 3,
        || format!("batch sizes {sizes:?}"),
    )?;
    // In sequence order, each message once.
    let order: Vec<String> = handed.concat();
    let expected: Vec<String> = (0..25).map(|i| format!("b{i:02}")).collect();
    check(order == expected, || format!("delivery order {order:?}"))
}

pub(crate) async fn ack_on_return_acks_what_the_consumer_left_unsettled(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-ack-on-return");
    let message = FanoutSpec {
        ack_from: 2,
        ..spec("u1")
    };
    ask(driver, &object, enqueue(vec![message], &["a", "manual"])).await?;
    drained(driver, &object).await?;
    // `a` returned without settling and was acked; `manual`, without ack on
    // return, got the message again.
    let deliveries = ask(driver, &object, FanoutCommand::Deliveries).await?;
    check(deliveries == json!(["a:u1@1", "manual:u1@2"]), || {
        format!("deliveries: {deliveries}")
    })?;
    let handed = events(driver, &object, DELIVERY_EVENT).await?;
    check(
        handed.iter().any(|e| {
            e["name"] == "manual" && e["attempt"] == 1 && e["detail"]["outcome"] == "unsettled"
        }),
        || format!("deliveries handed over: {handed:?}"),
    )
}

pub(crate) async fn a_failing_consumer_retries_only_what_it_left_unsettled(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-consumer-error");
    let acked = FanoutSpec {
        ack_from: 1,
        ..spec("e1")
    };
    let failing = FanoutSpec {
        ack_from: 2,
        manual_err: true,
        ..spec("e2")
    };
    ask(driver, &object, enqueue(vec![acked, failing], &["manual"])).await?;
    drained(driver, &object).await?;
    let deliveries = ask(driver, &object, FanoutCommand::Deliveries).await?;
    check(deliveries == json!(["manual:e1@1", "manual:e2@2"]), || {
        format!("deliveries: {deliveries}")
    })?;
    let handed = batches(driver, &object, "manual").await?;
    check(
        handed
            == vec![
                vec!["e1".to_owned(), "e2".to_owned()],
                vec!["e2".to_owned()],
            ],
        || format!("batches: {handed:?}"),
    )
}

pub(crate) async fn a_non_retryable_consumer_error_parks_at_once(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-fatal");
    let message = FanoutSpec {
        non_retryable_b: true,
        ..spec("n1")
    };
    ask(driver, &object, enqueue(vec![message], &["b"])).await?;
    let parked = parked(driver, &object, 1).await?;
    check(
        parked[0]["message_id"] == "n1"
            && parked[0]["reason"] == "exhausted"
            && parked[0]["attempts"] == 1,
        || format!("parked: {parked:?}"),
    )?;
    let owed = ask(driver, &object, FanoutCommand::Owed).await?;
    check(owed == 0, || {
        format!("a parked delivery is still owed: {owed}")
    })
}

pub(crate) async fn attempts_used_up_park_the_delivery_as_exhausted(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-exhausted");
    let message = FanoutSpec {
        fail_b: 99,
        ..spec("x1")
    };
    ask(driver, &object, enqueue(vec![message], &["b"])).await?;
    let parked = parked(driver, &object, 1).await?;
    check(
        parked[0]["reason"] == "exhausted" && parked[0]["attempts"] == FANOUT_MAX_ATTEMPTS,
        || format!("parked: {parked:?}"),
    )?;
    let handed = events(driver, &object, DELIVERY_EVENT).await?;
    check(handed.len() == FANOUT_MAX_ATTEMPTS as usize, || {
        format!("attempts beyond the limit: {handed:?}")
    })
}

pub(crate) async fn a_parked_delivery_is_redriven_as_new_work(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-redrive");
    let message = FanoutSpec {
        poison: true,
        ..spec("r1")
    };
    ask(driver, &object, enqueue(vec![message], &["a", "b"])).await?;
    let parked = parked(driver, &object, 1).await?;
    let id = parked[0]["id"]
        .as_str()
        .ok_or("a parked entry without an id")?
        .to_owned();
    ask(driver, &object, FanoutCommand::HealB).await?;
    let redriven = ask(
        driver,
        &object,
        FanoutCommand::Redrive {
            ids: vec![id.clone()],
        },
    )
    .await?;
    check(redriven["accepted"] == json!(["r1"]), || {
        format!("redrive: {redriven}")
    })?;
    drained(driver, &object).await?;
    // Only the target that failed gets it again, as a first attempt.
    let deliveries = ask(driver, &object, FanoutCommand::Deliveries).await?;
    check(deliveries == json!(["a:r1@1", "b:r1@1"]), || {
        format!("deliveries: {deliveries}")
    })?;
    let left = ask(driver, &object, FanoutCommand::Parked).await?;
    check(left == json!([]), || {
        format!("parked after redrive: {left}")
    })?;
    let again = ask(driver, &object, FanoutCommand::Redrive { ids: vec![id] }).await?;
    check(again["rejected"].is_string(), || {
        format!("a second redrive: {again}")
    })
}

pub(crate) async fn purge_parked_removes_only_the_named_entries(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-purge-parked");
    let poison = |id: &str| FanoutSpec {
        poison: true,
        ..spec(id)
    };
    ask(
        driver,
        &object,
        enqueue(vec![poison("q1"), poison("q2")], &["b"]),
    )
    .await?;
    let parked = parked(driver, &object, 2).await?;
    let q1 = parked
        .iter()
        .find(|p| p["message_id"] == "q1")
        .and_then(|p| p["id"].as_str())
        .ok_or("q1 is not parked")?
        .to_owned();
    let purged = ask(
        driver,
        &object,
        FanoutCommand::PurgeParked {
            ids: vec![q1, "missing".into()],
        },
    )
    .await?;
    check(purged == 1, || format!("purged {purged}"))?;
    let left = ask(driver, &object, FanoutCommand::Parked).await?;
    check(
        left.as_array()
            .is_some_and(|l| l.len() == 1 && l[0]["message_id"] == "q2"),
        || format!("parked after purge: {left}"),
    )
}

pub(crate) async fn a_rate_limited_target_gets_no_more_than_its_rate(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-rated");
    let count = 3 * RATED_PER_SECOND;
    let messages: Vec<FanoutSpec> = (0..count).map(|i| spec(&format!("t{i}"))).collect();
    ask(driver, &object, enqueue(messages, &["rated"])).await?;
    drained(driver, &object).await?;
    let handed = events(driver, &object, DELIVERY_EVENT).await?;
    let times: Vec<i64> = handed.iter().filter_map(|e| e["at_ms"].as_i64()).collect();
    check(times.len() == count, || format!("deliveries: {handed:?}"))?;
    // A full bucket, then RATED_PER_SECOND a second: the last two buckets'
    // worth take at least two seconds (checked with slack).
    let span = times
        .iter()
        .max()
        .zip(times.iter().min())
        .map(|(max, min)| max - min);
    check(span.is_some_and(|s| s >= 1_500), || {
        format!("{count} deliveries at {RATED_PER_SECOND}/s came within {span:?} ms: {times:?}")
    })?;
    let sizes: Vec<usize> = batches(driver, &object, "rated")
        .await?
        .iter()
        .map(Vec::len)
        .collect();
    check(sizes.iter().all(|s| *s <= RATED_PER_SECOND), || {
        format!("a batch beyond the bucket: {sizes:?}")
    })
}

pub(crate) async fn a_concurrency_limited_target_gets_one_delivery_at_a_time(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-narrow");
    let messages: Vec<FanoutSpec> = (0..4).map(|i| spec(&format!("c{i}"))).collect();
    ask(driver, &object, enqueue(messages, &["narrow"])).await?;
    drained(driver, &object).await?;
    let handed = batches(driver, &object, "narrow").await?;
    let expected: Vec<Vec<String>> = (0..4).map(|i| vec![format!("c{i}")]).collect();
    check(handed == expected, || format!("batches: {handed:?}"))
}
