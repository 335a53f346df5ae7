//! The routing client (queues.md §4) on paused time: every invariant of
//! §4.7 by name, then the push algorithm's details, the options, the
//! layers, and pushes to real mailbox objects (fanout on SQLite) on an
//! inline host. The 64-object simulation is in `routing_simulation.rs`.

mod routing_support;
mod support;

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durability::ConfigError;
use durability::fanout::{EnqueueOptions, EnqueueRejection, EnqueueResult};
use durability::load::LoadSnapshot;
use durability::routing::{
    CallContext, ContextLayer, MAX_OBSERVED_SHARDS, Push, RoutingClient, RoutingError,
    RoutingTarget, Service, ServiceBuilder, ServiceExt, ShardingError, TimedOut, TimeoutLayer,
};
use durability_host::{Host, Namespace};
use routing_support::{
    Letters, Mailbox, Mailboxes, Reply, START_MS, Scripted, ScriptedError, advance_ms, mailboxes,
    paused_clock, snapshot,
};

/// A client with the default algorithm over a scripted caller.
fn adaptive(scripted: &Scripted, soft_backlog_limit: u64) -> RoutingClient<Scripted> {
    RoutingClient::builder(scripted.clone(), paused_clock())
        .soft_backlog_limit(soft_backlog_limit)
        .seed(7)
        .build()
        .expect("valid options")
}

/// A client whose sharding sends input `n` to `shard-n`.
fn by_input(scripted: &Scripted) -> RoutingClient<Scripted> {
    RoutingClient::builder(scripted.clone(), paused_clock())
        .sharding(|n, _, _| Ok(RoutingTarget::new(format!("shard-{n}"))))
        .build()
        .expect("valid options")
}

async fn push(client: &RoutingClient<Scripted>, n: u64) -> (u64, Option<LoadSnapshot>) {
    client
        .push(n, CallContext::new())
        .await
        .expect("the scripted call succeeds")
}

// ---------------------------------------------------------------- §4.7

#[tokio::test(start_paused = true)]
async fn one_push_performs_at_most_one_invoke_and_never_retries_or_switches_shards() {
    let scripted = Scripted::new(paused_clock());
    let client = adaptive(&scripted, 1_000);
    scripted.then(Reply::Fail(ScriptedError(1)));
    let failed = client.push(5, CallContext::new()).await;
    assert!(matches!(failed, Err(RoutingError::Call { .. })));
    assert_eq!(scripted.calls().len(), 1, "a failed call is not retried");

    let custom = Scripted::new(paused_clock());
    let client = by_input(&custom);
    custom.then(Reply::Fail(ScriptedError(2)));
    assert!(client.push(3, CallContext::new()).await.is_err());
    push(&client, 4).await;
    assert_eq!(custom.shards(), ["shard-3", "shard-4"], "one call per push");
}

#[tokio::test(start_paused = true)]
async fn a_thrown_invoke_leaves_observations_unchanged_and_surfaces_the_same_error() {
    let scripted = Scripted::new(paused_clock());
    let client = adaptive(&scripted, 10);
    push(&client, 1).await;
    let before = client.observations();
    let width = client.width();
    advance_ms(5_000).await;

    // A failure whose reply would have widened the client had it arrived.
    scripted.then(Reply::Fail(ScriptedError(42)));
    let error = client
        .push(1, CallContext::new())
        .await
        .expect_err("the call fails");
    match error {
        RoutingError::Call { shard, source } => {
            assert_eq!(shard, "shard-0");
            assert_eq!(source, ScriptedError(42), "the caller's error, unchanged");
        }
        other => panic!("expected the call's error, got {other:?}"),
    }
    assert_eq!(client.observations(), before);
    assert_eq!(client.width(), width);
}

#[tokio::test(start_paused = true)]
async fn stored_observations_never_exceed_1024_entries() {
    let scripted = Scripted::new(paused_clock());
    let client = by_input(&scripted);
    let shards = u64::try_from(MAX_OBSERVED_SHARDS).expect("fits") + 500;
    for n in 0..shards {
        push(&client, n).await;
    }
    let held = client.observations();
    assert_eq!(held.len(), MAX_OBSERVED_SHARDS);
    // The least recently recorded are the ones forgotten.
    assert!(!held.contains_key("shard-0"));
    assert!(!held.contains_key("shard-499"));
    assert!(held.contains_key("shard-500"));
    assert!(held.contains_key(&format!("shard-{}", shards - 1)));
}

#[tokio::test(start_paused = true)]
async fn no_observation_older_than_the_window_is_passed_to_sharding() {
    let scripted = Scripted::new(paused_clock());
    // What sharding saw at each push: the whole map and shard-0's entry.
    type Seen = Vec<(HashMap<String, LoadSnapshot>, Option<LoadSnapshot>)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let client = RoutingClient::builder(scripted.clone(), paused_clock())
        .sharding({
            let seen = Arc::clone(&seen);
            move |n, _, observations| {
                seen.lock()
                    .expect("seen")
                    .push((observations.to_map(), observations.get("shard-0")));
                Ok(RoutingTarget::new(format!("shard-{n}")))
            }
        })
        .build()
        .expect("valid options");

    push(&client, 0).await;
    advance_ms(59_999).await;
    push(&client, 1).await;
    advance_ms(1).await;
    push(&client, 2).await;

    let seen = seen.lock().expect("seen");
    assert!(seen[0].0.is_empty());
    assert!(seen[1].0.contains_key("shard-0"), "59.999 s old is fresh");
    assert!(seen[1].1.is_some());
    assert!(!seen[2].0.contains_key("shard-0"), "60 s old is stale");
    assert_eq!(seen[2].1, None);
    assert!(seen[2].0.contains_key("shard-1"));
    assert!(!client.observations().contains_key("shard-0"));
}

#[tokio::test(start_paused = true)]
async fn width_grows_by_at_most_one_per_second() {
    let scripted = Scripted::new(paused_clock());
    let client = adaptive(&scripted, 100);
    for _ in 0..50 {
        scripted.then(Reply::Backlog(1_000));
        push(&client, 1).await;
    }
    assert_eq!(
        client.width(),
        2,
        "fifty deep replies in one instant widen once"
    );
    advance_ms(999).await;
    scripted.then(Reply::Backlog(1_000));
    push(&client, 1).await;
    assert_eq!(client.width(), 2);
    advance_ms(1).await;
    scripted.then(Reply::Backlog(1_000));
    push(&client, 1).await;
    assert_eq!(client.width(), 3);
    for _ in 0..10 {
        advance_ms(1_000).await;
        scripted.then(Reply::Backlog(101));
        push(&client, 1).await;
    }
    assert_eq!(client.width(), 13);
}

#[tokio::test(start_paused = true)]
async fn width_shrinks_by_at_most_one_per_window_and_never_below_one() {
    let scripted = Scripted::new(paused_clock());
    let client = adaptive(&scripted, 100);
    for _ in 0..3 {
        scripted.then(Reply::Backlog(101));
        push(&client, 1).await;
        advance_ms(1_000).await;
    }
    assert_eq!(client.width(), 4);

    // Shallow, idle replies: the first narrowing waits a window after the
    // last widening, the next one a window after that.
    let mut widths = Vec::new();
    for _ in 0..(5 * 60) {
        push(&client, 1).await;
        widths.push(client.width());
        advance_ms(1_000).await;
    }
    assert_eq!(client.width(), 1);
    let changes: Vec<usize> = widths
        .windows(2)
        .enumerate()
        .filter(|(_, pair)| pair[0] != pair[1])
        .map(|(i, _)| i + 1)
        .collect();
    assert_eq!(changes.len(), 3, "4 → 1 is three narrowings: {changes:?}");
    for pair in changes.windows(2) {
        assert!(
            pair[1] - pair[0] >= 60,
            "narrowings a window apart: {changes:?}"
        );
    }
    assert!(widths.iter().all(|width| *width >= 1));
}

#[tokio::test(start_paused = true)]
async fn with_custom_sharding_the_width_never_changes() {
    let scripted = Scripted::new(paused_clock());
    let client = RoutingClient::builder(scripted.clone(), paused_clock())
        .sharding(|_, _, _| Ok("only".into()))
        .soft_backlog_limit(1)
        .build()
        .expect("valid options");
    for _ in 0..5 {
        scripted.then(Reply::Backlog(1_000_000));
        push(&client, 1).await;
        advance_ms(1_000).await;
        assert_eq!(client.width(), 1);
    }
}

// ------------------------------------------------------ push algorithm

#[tokio::test(start_paused = true)]
async fn an_older_reply_never_overwrites_a_newer_observation() {
    let scripted = Scripted::new(paused_clock());
    let client = by_input(&scripted);
    scripted.then(Reply::Load(snapshot(START_MS + 10, 7)));
    push(&client, 0).await;
    scripted.then(Reply::Load(snapshot(START_MS + 5, 99)));
    push(&client, 0).await;
    assert_eq!(
        client.observations()["shard-0"].outbound.pending_deliveries,
        7
    );
    // An equally new one does replace it.
    scripted.then(Reply::Load(snapshot(START_MS + 10, 8)));
    push(&client, 0).await;
    assert_eq!(
        client.observations()["shard-0"].outbound.pending_deliveries,
        8
    );
}

#[tokio::test(start_paused = true)]
async fn a_recorded_shard_moves_to_the_end_and_the_oldest_is_evicted() {
    let scripted = Scripted::new(paused_clock());
    let client = by_input(&scripted);
    let max = u64::try_from(MAX_OBSERVED_SHARDS).expect("fits");
    for n in 0..max {
        push(&client, n).await;
    }
    // Recording shard-0 again makes shard-1 the oldest.
    push(&client, 0).await;
    push(&client, max).await;
    let held = client.observations();
    assert_eq!(held.len(), MAX_OBSERVED_SHARDS);
    assert!(held.contains_key("shard-0"));
    assert!(!held.contains_key("shard-1"));
}

#[tokio::test(start_paused = true)]
async fn a_reply_without_a_snapshot_or_with_a_stale_one_teaches_nothing() {
    let scripted = Scripted::new(paused_clock());
    let client = adaptive(&scripted, 10);
    scripted.then(Reply::Nothing);
    push(&client, 1).await;
    advance_ms(61_000).await;
    scripted.then(Reply::Load(snapshot(START_MS, 1_000)));
    let (_, load) = push(&client, 1).await;
    assert_eq!(load, Some(snapshot(START_MS, 1_000)), "returned unchanged");
    assert!(client.observations().is_empty());
    assert_eq!(client.width(), 1, "a stale backlog does not widen");
}

#[tokio::test(start_paused = true)]
async fn pushes_spread_over_every_shard_of_the_width() {
    let scripted = Scripted::new(paused_clock());
    let client = adaptive(&scripted, 10);
    // Widen to 4: each push reports a deep backlog, one second apart.
    for _ in 0..3 {
        scripted.then(Reply::Backlog(11));
        push(&client, 1).await;
        advance_ms(1_000).await;
    }
    assert_eq!(client.width(), 4);
    // Shallow replies from now on: the width holds for the next minute,
    // and unobserved shards are tried before observed ones.
    for _ in 0..40 {
        push(&client, 1).await;
    }
    let visited: std::collections::BTreeSet<String> = scripted.shards().into_iter().collect();
    assert_eq!(
        visited.into_iter().collect::<Vec<_>>(),
        ["shard-0", "shard-1", "shard-2", "shard-3"]
    );
}

#[tokio::test(start_paused = true)]
async fn the_less_backlogged_of_two_candidates_wins() {
    let scripted = Scripted::new(paused_clock());
    let client = RoutingClient::builder(scripted.clone(), paused_clock())
        .soft_backlog_limit(10)
        .max_width(2)
        .seed(3)
        .build()
        .expect("valid options");
    scripted.then(Reply::Backlog(11));
    push(&client, 1).await;
    assert_eq!(client.width(), 2);
    // From now on shard-0 stays deeper than shard-1, both under the limit.
    scripted.otherwise(|shard| if shard == "shard-0" { 9 } else { 0 });
    while client.observations().len() < 2 {
        push(&client, 1).await;
    }
    let before = scripted.calls().len();
    for _ in 0..100 {
        push(&client, 1).await;
    }
    let after = scripted.shards().split_off(before);
    let deep = after.iter().filter(|shard| *shard == "shard-0").count();
    // shard-0 wins only when both candidates are shard-0: one draw in four.
    assert!(
        deep * 2 < after.len() - deep,
        "{deep} of {} pushes went to the deeper shard",
        after.len()
    );
}

#[tokio::test(start_paused = true)]
async fn sharding_that_refuses_or_returns_an_empty_key_calls_no_object() {
    let scripted = Scripted::new(paused_clock());
    let client = RoutingClient::builder(scripted.clone(), paused_clock())
        .sharding(|n, _, _| match n {
            0 => Ok(RoutingTarget::new("")),
            _ => Err(ShardingError::new("no customer id")),
        })
        .build()
        .expect("valid options");
    let empty = client.push(0, CallContext::new()).await;
    assert!(matches!(empty, Err(RoutingError::EmptyShard)));
    assert_eq!(
        empty.expect_err("empty").to_string(),
        "Sharding must return a non-empty shard key or { shard, locationHint }"
    );
    let refused = client.push(1, CallContext::new()).await;
    assert!(matches!(refused, Err(RoutingError::Sharding(_))));
    assert!(scripted.calls().is_empty());
}

#[tokio::test(start_paused = true)]
async fn the_target_location_hint_and_context_reach_the_caller() {
    let scripted = Scripted::new(paused_clock());
    let client = RoutingClient::builder(scripted.clone(), paused_clock())
        .sharding(|_, context, _| {
            let lane = context.get_str("lane").unwrap_or("default");
            Ok(RoutingTarget::new(format!("lane-{lane}")).location_hint("weur"))
        })
        .build()
        .expect("valid options");
    let context = CallContext::new().with("lane", "vip");
    client.push(9, context.clone()).await.expect("pushed");
    let call = &scripted.calls()[0];
    assert_eq!(call.target.shard, "lane-vip");
    assert_eq!(call.target.location_hint.as_deref(), Some("weur"));
    assert_eq!(call.context, context);
    assert_eq!(call.input, 9);
}

// ------------------------------------------------------------- options

#[tokio::test(start_paused = true)]
async fn soft_backlog_limit_must_be_a_positive_safe_integer() {
    let scripted = Scripted::new(paused_clock());
    for limit in [0, durability::platform::MAX_SAFE_INTEGER.unsigned_abs() + 1] {
        let error = RoutingClient::builder(scripted.clone(), paused_clock())
            .soft_backlog_limit(limit)
            .build()
            .expect_err("out of range");
        assert!(
            matches!(error, ConfigError::OutOfRange { ref field, .. } if field == "soft_backlog_limit")
        );
    }
    let error = RoutingClient::builder(scripted.clone(), paused_clock())
        .max_width(0)
        .build()
        .expect_err("zero width");
    assert!(matches!(error, ConfigError::NotPositive { ref field } if field == "max_width"));
    assert!(
        RoutingClient::builder(scripted, paused_clock())
            .soft_backlog_limit(1)
            .build()
            .is_ok()
    );
}

// -------------------------------------------------------------- layers

#[tokio::test(start_paused = true)]
async fn context_layers_shallow_merge_in_attachment_order_over_the_callers_context() {
    let scripted = Scripted::new(paused_clock());
    let client = by_input(&scripted);
    let mut service = ServiceBuilder::new()
        .layer(ContextLayer::new(
            CallContext::new()
                .with("tenant", "acme")
                .with("lane", "bulk"),
        ))
        .layer(ContextLayer::new(CallContext::new().with("lane", "vip")))
        .service(client);
    let caller_context = CallContext::new()
        .with("lane", "caller")
        .with("trace", "t-1")
        .with("tenant", serde_json::json!({"nested": true}));
    service
        .ready()
        .await
        .expect("ready")
        .call(Push::new(1).context(caller_context))
        .await
        .expect("pushed");
    let context = &scripted.calls()[0].context;
    assert_eq!(context.get_str("lane"), Some("vip"), "the later layer wins");
    assert_eq!(
        context.get_str("tenant"),
        Some("acme"),
        "a layer wins over the caller, whole"
    );
    assert_eq!(
        context.get_str("trace"),
        Some("t-1"),
        "untouched fields stay"
    );
}

#[tokio::test(start_paused = true)]
async fn a_timeout_stops_waiting_but_does_not_cancel_the_call() {
    support::with_host(|test_host| async move {
        let host = test_host.host.clone();
        let (open, gate) = tokio::sync::watch::channel(false);
        let namespace = host
            .namespace("slow", {
                move |ctx| {
                    Ok(SlowObject {
                        _ctx: ctx,
                        ran: std::cell::Cell::new(false),
                    })
                }
            })
            .expect("namespace");
        let caller = SlowCaller {
            namespace: namespace.clone(),
            gate: SendGate(gate),
        };
        let clock = host.clone();
        let client = RoutingClient::builder(caller, move || clock.now_ms())
            .sharding(|_, _, _| Ok("slow-0".into()))
            .build()
            .expect("valid options");
        let timeout =
            TimeoutLayer::new(Duration::from_secs(5), tokio::time::sleep).expect("valid timeout");
        let mut service = ServiceBuilder::new().layer(timeout).service(client.clone());
        let outcome = service
            .ready()
            .await
            .expect("ready")
            .call(Push::new(1))
            .await;
        match outcome {
            Err(RoutingError::TimedOut(TimedOut { after })) => {
                assert_eq!(after, Duration::from_secs(5));
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(client.observations().is_empty(), "nothing recorded");
        // The object is still running the call: opening the gate lets it
        // finish its work although nobody waits for the reply.
        open.send(true).expect("the object holds the gate");
        let stub = namespace.stub("slow-0").expect("name");
        let ran = loop {
            let ran = stub
                .call(|object: Rc<SlowObject>| async move { object.ran.get() })
                .await
                .expect("call");
            if ran {
                break ran;
            }
            tokio::task::yield_now().await;
        };
        assert!(ran);
    })
    .await;
}

#[test]
fn a_timeout_must_be_positive_and_within_the_timer_limit() {
    let sleep = |_: Duration| async {};
    assert!(matches!(
        TimeoutLayer::new(Duration::ZERO, sleep),
        Err(ConfigError::NotPositive { .. })
    ));
    assert!(matches!(
        TimeoutLayer::new(
            Duration::from_millis(durability::platform::MAX_TIMER_MS + 1),
            sleep
        ),
        Err(ConfigError::AboveTimerLimit { .. })
    ));
}

/// An object whose one method waits for the test's gate, then marks that
/// it ran.
struct SlowObject {
    _ctx: durability_host::ObjectContext,
    ran: std::cell::Cell<bool>,
}

impl durability_host::DurableObject for SlowObject {}

/// A gate that can be handed to the object's thread: closed until the
/// test opens it.
#[derive(Clone)]
struct SendGate(tokio::sync::watch::Receiver<bool>);

impl SendGate {
    async fn wait(mut self) {
        // An error means the test dropped the sender: nothing to wait for.
        let _ = self.0.wait_for(|open| *open).await;
    }
}

struct SlowCaller {
    namespace: durability_host::Namespace<SlowObject>,
    gate: SendGate,
}

impl durability::routing::ShardCaller for SlowCaller {
    type Input = u64;
    type Output = (u64, Option<LoadSnapshot>);
    type Error = durability_host::CallError;

    fn call(
        &self,
        target: &RoutingTarget,
        input: u64,
        _: &CallContext,
    ) -> impl std::future::Future<Output = Result<Self::Output, Self::Error>> + Send {
        let stub = self.namespace.stub(&target.shard).expect("valid name");
        let gate = self.gate.clone();
        async move {
            stub.call(move |object: Rc<SlowObject>| async move {
                gate.wait().await;
                object.ran.set(true);
                (input, None)
            })
            .await
        }
    }
}

// ------------------------------------------------- real host objects

#[tokio::test(start_paused = true)]
async fn pushes_to_real_mailboxes_widen_under_their_real_backlog() {
    support::with_host(|test_host| async move {
        let host = test_host.host.clone();
        let clock = host.clone();
        let namespace = mailboxes(&host);
        let client = RoutingClient::builder(Mailboxes(namespace.clone()), move || clock.now_ms())
            .soft_backlog_limit(30)
            .seed(11)
            .build()
            .expect("valid options");
        let mut widths = Vec::new();
        for _ in 0..12 {
            for _ in 0..4 {
                let reply = client
                    .push(Letters::many(10), CallContext::new())
                    .await
                    .expect("the mailbox answers");
                assert!(reply.is_accepted());
            }
            widths.push(client.width());
            advance_ms(1_000).await;
        }
        // 40 letters a second against a limit of 30 per shard: the width
        // grows, one step a second at most.
        assert!(widths.windows(2).all(|w| w[1] <= w[0] + 1), "{widths:?}");
        let width = client.width();
        assert!(width >= 3, "widened under backlog: {widths:?}");

        // What the client observed is each mailbox's real backlog.
        let observed = client.observations();
        let mut total = 0;
        for n in 0..width {
            let shard = durability::routing::shard_key(n);
            let backlog = mailbox_backlog(&namespace, &shard).await;
            total += backlog;
            if let Some(load) = observed.get(&shard) {
                assert!(load.outbound.pending_deliveries <= backlog);
            }
        }
        assert_eq!(
            total,
            12 * 4 * 10,
            "every letter is owed by exactly one mailbox"
        );
        // A shard past the width was never called.
        assert_eq!(
            mailbox_backlog(&namespace, &durability::routing::shard_key(width)).await,
            0
        );
    })
    .await;
}

async fn mailbox_backlog(namespace: &Namespace<Mailbox>, shard: &str) -> u64 {
    namespace
        .stub(shard)
        .expect("name")
        .call(|mailbox: Rc<Mailbox>| async move {
            mailbox
                .fanout
                .load()
                .expect("load")
                .outbound
                .pending_deliveries
        })
        .await
        .expect("call")
}

#[tokio::test(start_paused = true)]
async fn a_rejected_reply_is_returned_unchanged_and_still_teaches_the_client() {
    support::with_host(|test_host| async move {
        let host = test_host.host.clone();
        let clock = host.clone();
        let client = RoutingClient::builder(Mailboxes(mailboxes(&host)), move || clock.now_ms())
            .build()
            .expect("valid options");
        client
            .push(Letters::many(3), CallContext::new())
            .await
            .expect("accepted");
        let rejected = client
            .push(
                Letters {
                    bodies: vec!["x".into()],
                    targets: EnqueueOptions::to(["nowhere"]),
                },
                CallContext::new(),
            )
            .await
            .expect("a rejection is a reply");
        match rejected {
            EnqueueResult::Rejected { error, load } => {
                assert_eq!(
                    error,
                    EnqueueRejection::UnknownTarget {
                        target: "nowhere".into()
                    }
                );
                assert_eq!(load.outbound.pending_deliveries, 3);
                assert_eq!(client.observations()["shard-0"], load);
            }
            EnqueueResult::Accepted { .. } => panic!("an unknown target is rejected"),
        }
    })
    .await;
}

#[test]
fn the_client_and_its_push_future_are_send_for_a_host_caller() {
    fn assert_send_sync<T: Send + Sync>(_: &T) {}
    fn assert_send<T: Send>(_: &T) {}
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let host = Host::builder(dir.path()).threads(1).build().expect("host");
        let clock = host.clone();
        let client = RoutingClient::builder(Mailboxes(mailboxes(&host)), move || clock.now_ms())
            .build()
            .expect("valid options");
        assert_send_sync(&client);
        let push = client.push(Letters::many(1), CallContext::new());
        assert_send(&push);
        drop(push);
        host.shutdown().await;
    });
}

#[test]
fn concurrent_pushes_from_a_multi_threaded_runtime_each_land_once() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let host = Host::builder(dir.path()).threads(2).build().expect("host");
        let namespace = mailboxes(&host);
        let clock = host.clone();
        let client = RoutingClient::builder(Mailboxes(namespace.clone()), move || clock.now_ms())
            .sharding(|letters, _, _| Ok(format!("box-{}", letters.bodies.len() % 4).into()))
            .build()
            .expect("valid options");
        let mut tasks = tokio::task::JoinSet::new();
        for task in 0..8 {
            let client = client.clone();
            tasks.spawn(async move {
                for n in 0..10 {
                    let letters = Letters::many(1 + (task + n) % 4);
                    let reply = client
                        .push(letters, CallContext::new())
                        .await
                        .expect("pushed");
                    assert!(reply.is_accepted());
                }
            });
        }
        while let Some(joined) = tasks.join_next().await {
            joined.expect("task");
        }
        let mut total = 0;
        for n in 0..4 {
            total += mailbox_backlog(&namespace, &format!("box-{n}")).await;
        }
        let expected: usize = (0..8)
            .flat_map(|task| (0..10).map(move |n| 1 + (task + n) % 4))
            .sum();
        assert_eq!(total, u64::try_from(expected).expect("fits"));
        assert_eq!(client.observations().len(), 4);
        host.shutdown().await;
    });
}
