//! Every route of the dashboard over a real server on 127.0.0.1, in front
//! of a real threaded host: status codes, the JSON shape, what the HTML
//! names, and the admin guard (off by default, token required, constant
//! time comparison behind it).

mod support;

use std::rc::Rc;

use durability_axum::{Admin, AdminError, Dashboard, DashboardError};
use support::{Server, Shop, World, get, post};

const TOKEN: &str = "correct horse battery staple";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_names_every_capability_state_of_every_object() {
    let world = World::new().await;
    let server = Server::start(
        Dashboard::for_host(&world.host)
            .title("shop <ops>")
            .build()
            .unwrap(),
    )
    .await;
    let page = get(format!("{}/", server.base)).await;
    assert_eq!(page.status, 200);
    assert!(
        page.content_type.starts_with("text/html"),
        "{}",
        page.content_type
    );
    for expected in [
        "<title>shop &lt;ops&gt;</title>", // the title is escaped
        "shops /</span> shop-1",
        "inbox",
        "order-poison", // parked, with its reason
        "explicit",
        "charge", // operations by status
        "completed",
        "failed",
        "card &lt;declined&gt;", // the last error, escaped
        "cleanup",               // the upcoming alarm
        "indexer",               // the log consumer
        "offsets 0..3",
        "fetch(base + 'fragment'", // live refresh
    ] {
        assert!(
            page.body.contains(expected),
            "page lacks {expected:?}:\n{}",
            page.body
        );
    }
    let fragment = get(format!("{}/fragment", server.base)).await;
    assert_eq!(fragment.status, 200);
    assert!(fragment.body.contains("fanout backlog"));
    assert!(!fragment.body.contains("<html"), "a fragment, not a page");
    world.host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_json_lists_objects_with_each_capability_state() {
    let world = World::new().await;
    let server = Server::start(Dashboard::for_host(&world.host).build().unwrap()).await;
    let listing = get(format!("{}/api/objects", server.base)).await;
    assert_eq!(listing.status, 200);
    assert!(listing.content_type.starts_with("application/json"));
    let json = listing.json();
    let objects = json["objects"].as_array().unwrap();
    assert_eq!(objects.len(), 1);
    let shop = &objects[0];
    assert_eq!(shop["id"], world.id.as_str());
    assert_eq!(shop["namespace"], "shops");
    assert_eq!(shop["name"], "shop-1");
    let fanout = &shop["capabilities"]["fanout"];
    let inbox = &fanout["targets"][0];
    assert_eq!(inbox["target"], "inbox");
    assert_eq!(
        inbox["backlog"], 1,
        "the slow one waits for its retry: {inbox}"
    );
    assert_eq!(inbox["retrying"], 1);
    assert_eq!(inbox["parked"], 1);
    assert_eq!(fanout["parked"][0]["message_id"], "order-poison");
    assert_eq!(fanout["parked"][0]["reason"], "explicit");
    let ops = &shop["capabilities"]["operations"];
    assert_eq!(ops["by_status"]["completed"], 1);
    assert_eq!(ops["by_status"]["failed"], 1);
    assert_eq!(ops["failed"][0]["id"], "pay-2");
    assert_eq!(
        ops["failed"][0]["error"],
        "NonRetryableError: card <declined>"
    );
    let alarms = &shop["capabilities"]["alarms"];
    assert_eq!(alarms["pending"], 1);
    assert_eq!(alarms["upcoming"][0]["name"], "cleanup");
    let log = &shop["capabilities"]["log"];
    assert_eq!(log["oldest_offset"], 0);
    assert_eq!(log["next_offset"], 3);
    assert_eq!(log["consumers"][0]["consumer"], "indexer");
    assert_eq!(log["consumers"][0]["lag"], 2);
    assert_eq!(json["overview"]["parked"], 1);

    let one = get(format!("{}/api/objects/{}", server.base, world.id)).await;
    assert_eq!(one.status, 200);
    assert_eq!(one.json()["name"], "shop-1");
    let missing = get(format!("{}/api/objects/{}", server.base, "0".repeat(64))).await;
    assert_eq!(missing.status, 404);
    assert!(
        missing.json()["error"]
            .as_str()
            .unwrap()
            .contains("no object")
    );
    world.host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_do_not_exist_unless_enabled() {
    let world = World::new().await;
    let server = Server::start(Dashboard::for_host(&world.host).build().unwrap()).await;
    for action in [
        "evict",
        "parked/redrive",
        "parked/purge",
        "operations/purge",
    ] {
        let url = format!("{}/api/objects/{}/{action}", server.base, world.id);
        let reply = post(url, Some(TOKEN), r#"{"ids":["x"]}"#).await;
        assert_eq!(reply.status, 404, "{action}: {reply:?}");
    }
    assert_eq!(world.host.live_objects(), 1, "nothing was evicted");
    world.host.shutdown().await;
}

fn admin(world: &World) -> Admin {
    let parked = world.shops.clone();
    let purged = world.shops.clone();
    let operations = world.shops.clone();
    Admin::new(TOKEN)
        .unwrap()
        .on_redrive_parked(move |object, ids| {
            let stub = parked.stub(object.name.as_deref().unwrap_or_default());
            async move {
                let stub = stub.map_err(|e| AdminError::new(e.to_string()))?;
                stub.call(move |shop: Rc<Shop>| async move {
                    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
                    let redriven = shop.fanout.redrive_parked(&ids).await;
                    match redriven {
                        Ok(result) => result
                            .accepted()
                            .map(|ids| ids.len() as u64)
                            .map_err(|e| AdminError::new(e.to_string())),
                        Err(e) => Err(AdminError::new(e.to_string())),
                    }
                })
                .await
                .map_err(|e| AdminError::new(e.to_string()))?
            }
        })
        .on_purge_parked(move |object, ids| {
            let stub = purged.stub(object.name.as_deref().unwrap_or_default());
            async move {
                let stub = stub.map_err(|e| AdminError::new(e.to_string()))?;
                stub.call(move |shop: Rc<Shop>| async move {
                    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
                    shop.fanout
                        .purge_parked(&ids)
                        .map_err(|e| AdminError::new(e.to_string()))
                })
                .await
                .map_err(|e| AdminError::new(e.to_string()))?
            }
        })
        .on_purge_operations(move |object, before| {
            let stub = operations.stub(object.name.as_deref().unwrap_or_default());
            async move {
                let stub = stub.map_err(|e| AdminError::new(e.to_string()))?;
                stub.call(move |shop: Rc<Shop>| async move {
                    shop.ops
                        .purge_before(before)
                        .await
                        .map_err(|e| AdminError::new(e.to_string()))
                })
                .await
                .map_err(|e| AdminError::new(e.to_string()))?
            }
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_actions_need_the_token_and_act_on_the_object() {
    let world = World::new().await;
    let router = Dashboard::for_host(&world.host)
        .admin(admin(&world))
        .build()
        .unwrap();
    let server = Server::start(router).await;
    let object = format!("{}/api/objects/{}", server.base, world.id);
    let parked_id = {
        let json = get(object.clone()).await.json();
        json["capabilities"]["fanout"]["parked"][0]["id"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let ids = serde_json::json!({ "ids": [parked_id] }).to_string();

    // No token: 401 with a challenge; a wrong one (even a prefix): 403.
    let refused = post(format!("{object}/parked/purge"), None, &ids).await;
    assert_eq!(refused.status, 401);
    assert_eq!(refused.www_authenticate.as_deref(), Some("Bearer"));
    for wrong in [
        "correct horse battery stapl",
        "correct horse battery staple!",
        "x",
    ] {
        let refused = post(format!("{object}/parked/purge"), Some(wrong), &ids).await;
        assert_eq!(refused.status, 403, "{wrong:?}");
    }
    let json = get(object.clone()).await.json();
    assert_eq!(
        json["capabilities"]["fanout"]["targets"][0]["parked"], 1,
        "refusals changed nothing"
    );

    // Bad bodies are refused with the rule.
    let empty = post(
        format!("{object}/parked/purge"),
        Some(TOKEN),
        r#"{"ids":[]}"#,
    )
    .await;
    assert_eq!(empty.status, 422);
    assert!(empty.json()["error"].as_str().unwrap().contains("ids"));
    let garbage = post(format!("{object}/parked/purge"), Some(TOKEN), "{").await;
    assert_eq!(garbage.status, 422);
    let negative = post(
        format!("{object}/operations/purge"),
        Some(TOKEN),
        r#"{"before_ms":-1}"#,
    )
    .await;
    assert_eq!(negative.status, 422);
    let unknown = post(
        format!(
            "{}/api/objects/{}/parked/purge",
            server.base,
            "0".repeat(64)
        ),
        Some(TOKEN),
        &ids,
    )
    .await;
    assert_eq!(unknown.status, 404, "{unknown:?}");

    // Redrive: registered again as new work; the consumer parks it again.
    let redriven = post(format!("{object}/parked/redrive"), Some(TOKEN), &ids).await;
    assert_eq!(
        (redriven.status, redriven.json()["redriven"].as_u64()),
        (200, Some(1)),
        "{redriven:?}"
    );
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let json = get(object.clone()).await.json();
    let parked_again = json["capabilities"]["fanout"]["parked"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // Purge it.
    let purged = post(
        format!("{object}/parked/purge"),
        Some(TOKEN),
        &serde_json::json!({ "ids": [parked_again] }).to_string(),
    )
    .await;
    assert_eq!(
        (purged.status, purged.json()["purged"].as_u64()),
        (200, Some(1)),
        "{purged:?}"
    );
    let json = get(object.clone()).await.json();
    assert_eq!(
        json["capabilities"]["fanout"]["parked"]
            .as_array()
            .unwrap()
            .len(),
        0
    );

    // Purge finished operations: both (completed and failed) are finished.
    let before = world.host.now_ms() + 1_000;
    let purged = post(
        format!("{object}/operations/purge"),
        Some(TOKEN),
        &format!(r#"{{"before_ms":{before}}}"#),
    )
    .await;
    assert_eq!(
        (purged.status, purged.json()["purged"].as_u64()),
        (200, Some(2)),
        "{purged:?}"
    );

    // Evict: the object leaves memory; its rows stay.
    assert_eq!(world.host.live_objects(), 1);
    let evicted = post(format!("{object}/evict"), Some(TOKEN), "").await;
    assert_eq!(evicted.status, 200, "{evicted:?}");
    assert_eq!(evicted.json()["evicted"], world.id.as_str());
    assert_eq!(world.host.live_objects(), 0);
    let json = get(object).await.json();
    assert_eq!(json["capabilities"]["log"]["next_offset"], 3);
    world.host.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_dashboard_serves_a_directory_without_a_host_and_cannot_evict() {
    let world = World::new().await;
    world.host.shutdown().await;
    let router = Dashboard::builder(world.dir.path())
        .admin(Admin::new(TOKEN).unwrap())
        .build()
        .unwrap();
    let server = Server::start(router).await;
    let json = get(format!("{}/api/objects", server.base)).await.json();
    assert_eq!(json["objects"][0]["name"], "shop-1");
    let page = get(format!("{}/", server.base)).await;
    assert!(page.body.contains("read-only view"));
    let evict = post(
        format!("{}/api/objects/{}/evict", server.base, world.id),
        Some(TOKEN),
        "",
    )
    .await;
    assert_eq!(evict.status, 409);
    let redrive = post(
        format!("{}/api/objects/{}/parked/redrive", server.base, world.id),
        Some(TOKEN),
        r#"{"ids":["x"]}"#,
    )
    .await;
    assert_eq!(redrive.status, 501, "not wired: {redrive:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_in_prometheus_text_when_asked() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).unwrap();
    let world = World::new().await;
    let server = Server::start(
        Dashboard::for_host(&world.host)
            .prometheus(handle)
            .build()
            .unwrap(),
    )
    .await;
    let reply = get(format!("{}/metrics", server.base)).await;
    assert_eq!(reply.status, 200);
    assert!(reply.content_type.starts_with("text/plain"));
    for expected in [
        // The other tests of this binary run at the same time and report
        // to the same global recorder: series are checked, not values.
        r#"durability_fanout_enqueued_total{target="inbox"} "#,
        r#"durability_fanout_parked_total{target="inbox"} "#,
        r#"durability_operations_completed_total{operation="charge"} "#,
        r#"durability_alarms_scheduled_total{alarm="cleanup"} "#,
        "durability_log_appended_records_total ",
        "durability_host_live_objects ",
        r#"durability_host_call_duration_seconds_count{namespace="shops"}"#,
    ] {
        assert!(
            reply.body.contains(expected),
            "lacks {expected:?}:\n{}",
            reply.body
        );
    }
    let page = get(format!("{}/", server.base)).await;
    assert!(page.body.contains("Prometheus metrics"));
    // Without a handle there is no route.
    let plain = Server::start(Dashboard::for_host(&world.host).build().unwrap()).await;
    assert_eq!(get(format!("{}/metrics", plain.base)).await.status, 404);
    world.host.shutdown().await;
}

#[test]
fn settings_out_of_bounds_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let error = Dashboard::builder(dir.path())
        .title("")
        .build()
        .unwrap_err();
    assert!(matches!(
        error,
        DashboardError::Invalid { field: "title", .. }
    ));
    let error = Dashboard::builder(dir.path())
        .refresh_interval(std::time::Duration::from_millis(10))
        .build()
        .unwrap_err();
    assert!(matches!(
        error,
        DashboardError::Invalid {
            field: "refresh_interval",
            ..
        }
    ));
    let error = Admin::new("short").unwrap_err();
    assert!(matches!(
        error,
        DashboardError::Invalid {
            field: "admin token",
            ..
        }
    ));
}
