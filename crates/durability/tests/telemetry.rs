//! The capabilities' metrics, read back from a recording backend
//! (`metrics-util`'s debugging recorder) installed for the test's thread:
//! the inline host runs every object on that thread, so each test sees
//! exactly the series its own work moved.

mod support;

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use durability::fanout::{EnqueueOptions, FanoutInput, FanoutMessage, Target};
use durability::log::{AppendRecord, Read};
use durability::telemetry as names;
use durability::{
    AlarmCall, Alarms, DurableCall, Fanout, HandlerError, Log, Operations, Scheduler,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};
use support::Harness;

fn scheduler(h: &Harness) -> Scheduler {
    let scheduler = Scheduler::new(h.context()).unwrap();
    h.install(&scheduler);
    scheduler
}

/// Every series of a snapshot, keyed by name and sorted labels.
struct Series(Vec<(CompositeKey, DebugValue)>);

impl Series {
    fn take(snapshotter: &Snapshotter) -> Self {
        Series(
            snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .map(|(key, _, _, value)| (key, value))
                .collect(),
        )
    }

    fn find(&self, kind: MetricKind, name: &str, labels: &[(&str, &str)]) -> Option<&DebugValue> {
        self.0.iter().find_map(|(key, value)| {
            let k = key.key();
            let mut have: Vec<(&str, &str)> = k.labels().map(|l| (l.key(), l.value())).collect();
            have.sort_unstable();
            let mut want = labels.to_vec();
            want.sort_unstable();
            (key.kind() == kind && k.name() == name && have == want).then_some(value)
        })
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        match self.find(MetricKind::Counter, name, labels) {
            Some(DebugValue::Counter(n)) => *n,
            _ => 0,
        }
    }

    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        match self.find(MetricKind::Histogram, name, labels) {
            Some(DebugValue::Histogram(values)) => values.iter().map(|v| v.into_inner()).collect(),
            _ => Vec::new(),
        }
    }

    /// Every name starts with `durability_` and no label value is an id.
    fn assert_bounded(&self, ids: &[&str]) {
        for (key, _) in &self.0 {
            let key = key.key();
            assert!(key.name().starts_with("durability_"), "{}", key.name());
            for label in key.labels() {
                assert!(
                    !ids.contains(&label.value()),
                    "id {:?} used as a label value",
                    label.value()
                );
            }
        }
    }
}

/// Runs `body` on a fresh harness object with the recorder installed on
/// the test's thread, and returns what it recorded.
async fn recorded<F, Fut>(body: F) -> Series
where
    F: FnOnce(Rc<Harness>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _installed = metrics::set_default_local_recorder(&recorder);
    support::on_harness(body).await;
    Series::take(&snapshotter)
}

#[tokio::test(start_paused = true)]
async fn fanout_counts_enqueued_delivered_retried_dead_lettered_and_parked_per_target() {
    let series = recorded(|h| async move {
        let scheduler = scheduler(&h);
        let retried = Rc::new(Cell::new(false));
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "inbox",
                Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                    let settlements: Vec<_> = batch
                        .iter()
                        .map(|m| match m.body.as_str() {
                            "flaky" if !retried.replace(true) => m.retry(),
                            "poison" => m.dead_letter(),
                            _ => m.ack(),
                        })
                        .collect();
                    async move {
                        for s in settlements {
                            s.await.map_err(|e| HandlerError::new(e.to_string()))?;
                        }
                        Ok(())
                    }
                }),
            )
            .target(
                "archive",
                Target::storage(|_| async { Ok::<_, HandlerError>(()) }),
            )
            .build()
            .unwrap();
        let inputs = ["fine", "flaky", "poison"]
            .map(|body| FanoutInput::new(body.to_owned()).id(format!("id-{body}")))
            .to_vec();
        fanout
            .enqueue(inputs, &EnqueueOptions::all())
            .await
            .unwrap()
            .accepted()
            .unwrap();
        tokio::time::sleep(Duration::from_secs(120)).await;
        h.keep(fanout);
    })
    .await;
    let inbox = [("target", "inbox")];
    let archive = [("target", "archive")];
    assert_eq!(series.counter(names::FANOUT_ENQUEUED, &inbox), 3);
    assert_eq!(series.counter(names::FANOUT_ENQUEUED, &archive), 3);
    assert_eq!(series.counter(names::FANOUT_DELIVERED, &inbox), 2);
    assert_eq!(series.counter(names::FANOUT_DELIVERED, &archive), 3);
    assert_eq!(series.counter(names::FANOUT_RETRIED, &inbox), 1);
    assert_eq!(
        series.counter(
            names::FANOUT_DEAD_LETTERED,
            &[("target", "inbox"), ("reason", "dead_lettered")]
        ),
        1
    );
    assert_eq!(series.counter(names::FANOUT_PARKED, &inbox), 1);
    assert_eq!(series.counter(names::FANOUT_PARKED, &archive), 0);
    // Three inbox attempts settled with an outcome: fine, flaky (retry) and
    // flaky again; the dead letter is a terminal event, not a settlement.
    assert_eq!(
        series
            .samples(names::FANOUT_DELIVERY_DURATION, &inbox)
            .len(),
        3
    );
    series.assert_bounded(&["id-fine", "id-flaky", "id-poison"]);
}

#[tokio::test(start_paused = true)]
async fn operations_count_each_step_per_operation_name_and_time_the_handler() {
    let series = recorded(|h| async move {
        let scheduler = scheduler(&h);
        let ops = Operations::builder(&scheduler)
            .handler("send", |_: DurableCall<()>| async {
                tokio::time::sleep(Duration::from_millis(250)).await;
                Ok::<_, HandlerError>(())
            })
            .handler("charge", |_: DurableCall<()>| async {
                Err::<(), _>(HandlerError::new("card declined"))
            })
            .max_attempts(2)
            .build()
            .unwrap();
        ops.start("send", "op-1", &()).await.unwrap();
        ops.start("send", "op-2", &()).await.unwrap();
        ops.start("send", "op-2", &()).await.unwrap(); // deduplicated
        ops.start("charge", "op-3", &()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(600)).await;
        h.keep(ops);
    })
    .await;
    let send = [("operation", "send")];
    let charge = [("operation", "charge")];
    assert_eq!(series.counter(names::OPERATIONS_REGISTERED, &send), 2);
    assert_eq!(series.counter(names::OPERATIONS_STARTED, &send), 2);
    assert_eq!(series.counter(names::OPERATIONS_COMPLETED, &send), 2);
    assert_eq!(series.counter(names::OPERATIONS_REGISTERED, &charge), 1);
    assert_eq!(series.counter(names::OPERATIONS_STARTED, &charge), 2);
    assert_eq!(series.counter(names::OPERATIONS_COMPLETED, &charge), 0);
    assert_eq!(
        series.counter(
            names::OPERATIONS_FAILED,
            &[("operation", "charge"), ("retry", "true")]
        ),
        1
    );
    assert_eq!(
        series.counter(
            names::OPERATIONS_FAILED,
            &[("operation", "charge"), ("retry", "false")]
        ),
        1
    );
    let durations = series.samples(names::OPERATIONS_HANDLER_DURATION, &send);
    assert_eq!(durations, vec![0.25, 0.25], "seconds, on paused time");
    series.assert_bounded(&["op-1", "op-2", "op-3"]);
}

#[tokio::test(start_paused = true)]
async fn named_alarms_count_scheduled_and_fired_and_measure_lateness() {
    let series = recorded(|h| async move {
        let scheduler = scheduler(&h);
        let alarms = Alarms::builder(&scheduler)
            .handler("cleanup", |_: AlarmCall| async {
                Ok::<_, HandlerError>(())
            })
            .build()
            .unwrap();
        let at = scheduler.now_ms() + 30_000;
        alarms.schedule("cleanup", at).await.unwrap();
        alarms.schedule("cleanup", at).await.unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
        h.keep(alarms);
    })
    .await;
    let cleanup = [("alarm", "cleanup")];
    assert_eq!(series.counter(names::ALARMS_SCHEDULED, &cleanup), 2);
    assert_eq!(series.counter(names::ALARMS_FIRED, &cleanup), 1);
    assert_eq!(series.counter(names::ALARMS_COMPLETED, &cleanup), 1);
    let lateness = series.samples(names::ALARMS_LATENESS, &cleanup);
    assert_eq!(lateness.len(), 1);
    assert!(lateness[0] < 0.1, "live timers fire on time: {lateness:?}");
}

#[tokio::test(start_paused = true)]
async fn the_log_counts_appended_read_and_trimmed_records_and_consumer_lag() {
    let series = recorded(|h| async move {
        let scheduler = scheduler(&h);
        let log = Log::<u32>::builder(&scheduler)
            .retention(durability::log::Retention::new().max_records(2))
            .build()
            .unwrap();
        log.append((0..5).map(AppendRecord::new).collect())
            .await
            .unwrap();
        let page = log.read(Read::from_offset(0).limit(3)).await.unwrap();
        assert_eq!(page.records.len(), 3);
        log.commit("indexer", 3).await.unwrap();
        assert_eq!(log.trim().await.unwrap(), 3);
        h.keep(log);
    })
    .await;
    assert_eq!(series.counter(names::LOG_APPENDED, &[]), 5);
    assert_eq!(series.counter(names::LOG_READ, &[]), 3);
    assert_eq!(series.counter(names::LOG_TRIMMED, &[]), 3);
    assert_eq!(
        series.samples(names::LOG_CONSUMER_LAG, &[("consumer", "indexer")]),
        vec![2.0]
    );
}
