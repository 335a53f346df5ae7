//! Load snapshots and the routing client, which runs inside one object
//! and pushes to other objects by name: the default sharding widens over
//! at least four objects under backlog, and custom sharding by a lane
//! reaches exactly the named ones.

use serde_json::{Value, json};

use super::{Driver, ask, check, eventually};
use crate::{FanoutCommand, FanoutSpec, LogCommand, RoutingCommand};

async fn held_backlog(driver: &dyn Driver, object: &str) -> Result<Value, String> {
    ask(
        driver,
        object,
        FanoutCommand::Backlog {
            target: "held".into(),
        },
    )
    .await
}

pub(crate) async fn a_load_snapshot_counts_backlog_and_work_done(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let object = format!("{prefix}-load");
    ask(driver, &object, RoutingCommand::Push { count: 3 }).await?;
    let spec = |id: &str| FanoutSpec {
        id: id.into(),
        ..FanoutSpec::default()
    };
    let enqueue = FanoutCommand::Enqueue {
        messages: vec![spec("l1"), spec("l2")],
        targets: vec!["a".into()],
    };
    ask(driver, &object, enqueue).await?;
    // The held messages stay owed; target a's are delivered.
    eventually(driver, &object, FanoutCommand::Owed, |v| *v == 3).await?;
    let load = ask(driver, &object, RoutingCommand::Snapshot).await?;
    let fanout = &load["fanout"];
    check(
        fanout["outbound"]["pendingDeliveries"] == 3
            && fanout["inbound"]["completed"]
                .as_u64()
                .is_some_and(|c| c >= 2)
            && fanout["outbound"]["completed"]
                .as_u64()
                .is_some_and(|c| c >= 1)
            && fanout["windowMs"] == 60_000,
        || format!("fanout load: {load}"),
    )?;
    // The log's backlog is the lag of its furthest-behind consumer.
    ask(
        driver,
        &object,
        LogCommand::Append {
            bodies: vec![json!(1), json!(2), json!(3), json!(4)],
            keys: Vec::new(),
        },
    )
    .await?;
    ask(
        driver,
        &object,
        LogCommand::Commit {
            consumer: "fast".into(),
            offset: 4,
        },
    )
    .await?;
    ask(
        driver,
        &object,
        LogCommand::Commit {
            consumer: "slow".into(),
            offset: 1,
        },
    )
    .await?;
    let load = ask(driver, &object, RoutingCommand::Snapshot).await?;
    check(load["log"]["outbound"]["pendingDeliveries"] == 3, || {
        format!("log load: {load}")
    })
}

pub(crate) async fn the_routing_client_widens_over_four_objects_under_backlog(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let router = format!("{prefix}-router");
    let route = RoutingCommand::Route {
        shard_prefix: prefix.into(),
        per_push: 3,
        soft_backlog_limit: 2,
        min_width: 4,
        max_pushes: 60,
        interval_ms: 250,
    };
    let routed = ask(driver, &router, route).await?;
    let observed = routed["observed"].as_object().cloned().unwrap_or_default();
    check(
        routed["width"].as_u64().is_some_and(|w| w >= 4) && observed.len() >= 4,
        || format!("the client did not widen over four objects: {routed}"),
    )?;
    // What the client learnt is what the named objects hold.
    for (shard, pending) in &observed {
        let backlog = held_backlog(driver, &format!("{prefix}-{shard}")).await?;
        check(
            backlog == *pending && backlog.as_u64().is_some_and(|b| b > 0 && b % 3 == 0),
            || format!("{shard} holds {backlog}, the client saw {pending}"),
        )?;
    }
    Ok(())
}

pub(crate) async fn sharding_by_lane_reaches_exactly_the_named_objects(
    driver: &dyn Driver,
    prefix: &str,
) -> Result<(), String> {
    let router = format!("{prefix}-router");
    let pushes: Vec<(String, u32)> = [("l1", 1), ("l2", 2), ("l3", 3), ("l4", 4), ("l1", 5)]
        .iter()
        .map(|(lane, count)| ((*lane).to_owned(), *count))
        .collect();
    let route = RoutingCommand::RouteByLane {
        shard_prefix: prefix.into(),
        pushes,
    };
    let routed = ask(driver, &router, route).await?;
    check(
        routed["observed"] == json!({ "l1": 6, "l2": 2, "l3": 3, "l4": 4 }) && routed["width"] == 1,
        || format!("routed by lane: {routed}"),
    )?;
    for (lane, expected) in [("l1", 6), ("l2", 2), ("l3", 3), ("l4", 4)] {
        let backlog = held_backlog(driver, &format!("{prefix}-{lane}")).await?;
        check(backlog == expected, || {
            format!("{lane} holds {backlog}, expected {expected}")
        })?;
    }
    Ok(())
}
