//! The host's metrics, read back from `metrics-util`'s debugging recorder
//! installed for the test's thread (the inline host runs every object
//! there): live objects, constructions, evictions, commits and their
//! syncs, alarm deliveries and lateness, call latency.

mod support;

use std::rc::Rc;
use std::time::Duration;

use durability_host::telemetry as names;
use durability_platform::{Context, StorageExt, params};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::{CompositeKey, MetricKind};
use support::{Notes, inline_host, local, notes};

fn value<'a>(
    series: &'a [(CompositeKey, DebugValue)],
    kind: MetricKind,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<&'a DebugValue> {
    series.iter().find_map(|(key, value)| {
        let k = key.key();
        let have: Vec<(&str, &str)> = k.labels().map(|l| (l.key(), l.value())).collect();
        (key.kind() == kind && k.name() == name && have == labels).then_some(value)
    })
}

#[tokio::test(start_paused = true)]
async fn the_host_reports_objects_commits_alarms_and_call_latency() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _installed = metrics::set_default_local_recorder(&recorder);
    let dir = tempfile::tempdir().unwrap();
    local(async {
        let host = inline_host(dir.path());
        let notes = notes(&host);
        let (a, b) = (notes.stub("a").unwrap(), notes.stub("b").unwrap());
        for stub in [&a, &a, &b] {
            stub.call(|o: Rc<Notes>| async move {
                o.ctx.storage().transaction_sync(|sql| {
                    sql.execute("INSERT INTO notes (text) VALUES (?1)", &params!["x"])
                })
            })
            .await
            .unwrap()
            .unwrap();
        }
        let at = host.now_ms() + 1_000;
        a.call(move |o: Rc<Notes>| async move { o.ctx.storage().set_alarm(at).await })
            .await
            .unwrap()
            .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
        host.evict(b.id()).await.unwrap();
        host.shutdown().await;
    })
    .await;
    let series: Vec<(CompositeKey, DebugValue)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| (key, value))
        .collect();
    let counter =
        |name, labels: &[(&str, &str)]| match value(&series, MetricKind::Counter, name, labels) {
            Some(DebugValue::Counter(n)) => *n,
            other => panic!("{name}: {other:?}"),
        };
    let samples =
        |name, labels: &[(&str, &str)]| match value(&series, MetricKind::Histogram, name, labels) {
            Some(DebugValue::Histogram(v)) => {
                v.iter().map(|v| v.into_inner()).collect::<Vec<f64>>()
            }
            other => panic!("{name}: {other:?}"),
        };
    let ns = [("namespace", "notes")];
    assert_eq!(counter(names::OBJECTS_CONSTRUCTED, &ns), 2);
    // b explicitly, then a at shutdown.
    assert_eq!(counter(names::EVICTIONS, &[]), 2);
    match value(&series, MetricKind::Gauge, names::LIVE_OBJECTS, &[]) {
        Some(DebugValue::Gauge(live)) => {
            assert_eq!(live.into_inner(), 0.0, "all gone after shutdown")
        }
        other => panic!("live objects: {other:?}"),
    }
    // Three inserts and the alarm's set and clear, at least; each synced
    // (synchronous=FULL by default), plus the index's durable writes.
    let commits = counter(names::COMMITS, &[]);
    assert!(commits >= 5, "{commits}");
    assert!(counter(names::FSYNCS, &[]) >= commits);
    assert_eq!(counter(names::ALARM_FIRES, &ns), 1);
    assert_eq!(
        samples(names::ALARM_LATENESS, &ns),
        vec![0.0],
        "on paused time, on time"
    );
    // Four calls (three inserts and the alarm's set).
    assert_eq!(samples(names::CALL_DURATION, &ns).len(), 4);
    for (key, _) in &series {
        assert!(
            names::ALL.contains(&key.key().name()),
            "{} is not in ALL",
            key.key().name()
        );
    }
}
