//! A producer's span is linked (`follows_from`) to the work it caused: the
//! attempt of an operation it started, the fanout pass that delivers what
//! it enqueued. Checked with a `tracing` layer that records every link and
//! every `attempt` field recorded on a span.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use durability::fanout::{EnqueueOptions, FanoutInput, FanoutMessage, Target};
use durability::{DurableCall, Fanout, HandlerError, Operations, Scheduler};
use support::Harness;
use tracing::Instrument as _;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

#[derive(Clone, Default)]
struct Links {
    /// (follower span name, followed span name).
    links: Arc<Mutex<Vec<(String, String)>>>,
    /// `attempt` values recorded on spans named `attempt`.
    attempts: Arc<Mutex<Vec<u64>>>,
    /// `producer` values recorded on spans named `attempt`.
    producers: Arc<Mutex<Vec<String>>>,
    /// `ids` of the `fanout_delivery` spans.
    deliveries: Arc<Mutex<Vec<String>>>,
}

#[derive(Default)]
struct AttemptVisitor {
    attempt: Option<u64>,
    producer: Option<String>,
    ids: Option<String>,
}

impl Visit for AttemptVisitor {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "attempt" {
            self.attempt = Some(value);
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "producer" {
            self.producer = Some(value.to_owned());
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "ids" {
            self.ids = Some(format!("{value:?}"));
        }
    }
}

impl<S> Layer<S> for Links
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(&self, attributes: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
        if attributes.metadata().name() == "fanout_delivery" {
            let mut visitor = AttemptVisitor::default();
            attributes.record(&mut visitor);
            if let Some(ids) = visitor.ids {
                self.deliveries.lock().unwrap().push(ids);
            }
        }
    }

    fn on_record(&self, span: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if ctx.span(span).is_some_and(|s| s.name() == "attempt") {
            let mut visitor = AttemptVisitor::default();
            values.record(&mut visitor);
            if let Some(attempt) = visitor.attempt {
                self.attempts.lock().unwrap().push(attempt);
            }
            if let Some(producer) = visitor.producer {
                self.producers.lock().unwrap().push(producer);
            }
        }
    }

    fn on_follows_from(&self, span: &Id, follows: &Id, ctx: Context<'_, S>) {
        let name = |id: &Id| {
            ctx.span(id)
                .map_or_else(String::new, |s| s.name().to_owned())
        };
        self.links.lock().unwrap().push((name(span), name(follows)));
    }
}

fn scheduler(h: &Harness) -> Scheduler {
    let scheduler = Scheduler::new(h.context()).unwrap();
    h.install(&scheduler);
    scheduler
}

#[tokio::test(start_paused = true)]
async fn an_operation_attempt_and_a_fanout_pass_follow_from_the_producer_span() {
    let links = Links::default();
    let subscriber = tracing_subscriber::registry().with(links.clone());
    let _default = tracing::subscriber::set_default(subscriber);
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let ops = Operations::builder(&scheduler)
            .handler("send", |_: DurableCall<()>| async {
                Ok::<_, HandlerError>(())
            })
            .build()
            .unwrap();
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "inbox",
                Target::consumer(|batch: Vec<FanoutMessage<String>>| {
                    let acks: Vec<_> = batch.iter().map(FanoutMessage::ack).collect();
                    async move {
                        for ack in acks {
                            ack.await.map_err(|e| HandlerError::new(e.to_string()))?;
                        }
                        Ok(())
                    }
                }),
            )
            .build()
            .unwrap();
        async {
            ops.start("send", "op-1", &()).await.unwrap();
            fanout
                .enqueue(
                    vec![FanoutInput::new("hi".to_owned())],
                    &EnqueueOptions::all(),
                )
                .await
                .unwrap();
        }
        .instrument(tracing::info_span!("http_request"))
        .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        h.keep((ops, fanout));
    })
    .await;
    let links = links.links.lock().unwrap().clone();
    assert!(
        links.contains(&("attempt".into(), "http_request".into())),
        "{links:?}"
    );
    assert!(
        links.contains(&("fanout_after_enqueue".into(), "http_request".into())),
        "{links:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_attempt_span_carries_its_attempt_number() {
    let links = Links::default();
    let subscriber = tracing_subscriber::registry().with(links.clone());
    let _default = tracing::subscriber::set_default(subscriber);
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let tries = std::rc::Rc::new(std::cell::Cell::new(0));
        let ops = Operations::builder(&scheduler)
            .handler("flaky", move |_: DurableCall<()>| {
                tries.set(tries.get() + 1);
                let fail = tries.get() < 3;
                async move {
                    if fail {
                        Err(HandlerError::new("not yet"))
                    } else {
                        Ok(())
                    }
                }
            })
            .build()
            .unwrap();
        ops.start("flaky", "op-1", &()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(600)).await;
        h.keep(ops);
    })
    .await;
    assert_eq!(*links.attempts.lock().unwrap(), vec![1, 2, 3]);
}

/// The object of the durable-context test: its capabilities are built in
/// its constructor, so an evicted object comes back with them.
struct Traced {
    scheduler: Scheduler,
    ops: Operations,
    fanout: Fanout<String>,
}

impl durability_host::DurableObject for Traced {
    async fn alarm(
        &self,
        info: durability_host::AlarmInfo,
    ) -> Result<(), durability_host::BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

type Seen = Arc<Mutex<Vec<(String, u32, Option<String>)>>>;

fn traced(
    ctx: durability_host::ObjectContext,
    seen: Seen,
) -> Result<Traced, durability_host::BoxError> {
    let scheduler = Scheduler::new(ctx.into_dyn())?;
    // The producer's context: here the name of the span it ran in, the way
    // an OpenTelemetry capture would return its traceparent.
    let capture: durability::trace::TraceCapture = std::rc::Rc::new(|| {
        tracing::Span::current()
            .metadata()
            .map(|m| format!("00-{}-01", m.name()))
    });
    let op_seen = Arc::clone(&seen);
    let ops = Operations::builder(&scheduler)
        .handler("send", move |call: DurableCall<()>| {
            op_seen.lock().unwrap().push((
                "operation".into(),
                call.attempt,
                call.trace_context.clone(),
            ));
            async move {
                if call.attempt == 1 {
                    Err(HandlerError::new("first attempt fails"))
                } else {
                    Ok(())
                }
            }
        })
        .trace_context(std::rc::Rc::clone(&capture))
        .build()?;
    let fanout = Fanout::<String>::builder(&scheduler)
        .target(
            "inbox",
            Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                let settlements: Vec<_> = batch
                    .iter()
                    .map(|m| {
                        seen.lock().unwrap().push((
                            "delivery".into(),
                            m.attempt,
                            m.trace_context.clone(),
                        ));
                        if m.attempt == 1 { m.retry() } else { m.ack() }
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
        .trace_context(capture)
        .build()?;
    Ok(Traced {
        scheduler,
        ops,
        fanout,
    })
}

#[tokio::test(start_paused = true)]
async fn the_producer_context_is_stored_with_the_work_and_reaches_a_retry_in_a_new_instance() {
    let links = Links::default();
    let subscriber = tracing_subscriber::registry().with(links.clone());
    let _default = tracing::subscriber::set_default(subscriber);
    let seen: Seen = Arc::default();
    let dir = tempfile::tempdir().unwrap();
    tokio::task::LocalSet::new()
        .run_until(async {
            let host = durability_host::Host::builder(dir.path())
                .threads(0)
                .build()
                .unwrap();
            let objects = {
                let seen = Arc::clone(&seen);
                host.namespace("traced", move |ctx| traced(ctx, Arc::clone(&seen)))
                    .unwrap()
            };
            let stub = objects.stub("t").unwrap();
            stub.call(|t: std::rc::Rc<Traced>| {
                async move {
                    t.ops.start("send", "op-1", &()).await.unwrap();
                    t.fanout
                        .enqueue(
                            vec![FanoutInput::new("hi".to_owned())],
                            &EnqueueOptions::all(),
                        )
                        .await
                        .unwrap();
                }
                .instrument(tracing::info_span!("checkout"))
            })
            .await
            .unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            // The first attempts ran; the object goes (as in a restart)
            // before the retries.
            host.evict(stub.id()).await.unwrap();
            tokio::time::sleep(Duration::from_secs(600)).await;
            let id = stub.id().to_string();
            host.shutdown().await;
            // Both records ended: their stored contexts went with them.
            let left = durability_host::inspect::read_object(dir.path(), &id, |sql| {
                sql.query_row(
                    "SELECT count(*) FROM durability_memos WHERE memo_key = ?",
                    &[durability::trace::TRACE_CONTEXT_MEMO_KEY.into()],
                )
                .unwrap()
                .map(|row| row.get::<i64>(0).unwrap())
            })
            .unwrap()
            .unwrap();
            assert_eq!(left, Some(0));
        })
        .await;
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    let traced = Some("00-checkout-01".to_owned());
    assert_eq!(
        seen,
        vec![
            ("delivery".into(), 1, traced.clone()),
            ("delivery".into(), 2, traced.clone()),
            ("operation".into(), 1, traced.clone()),
            ("operation".into(), 2, traced),
        ]
    );
    // Each batch handed over is a span naming its messages and attempts.
    let deliveries = links.deliveries.lock().unwrap().clone();
    assert_eq!(deliveries.len(), 2, "{deliveries:?}");
    assert!(
        deliveries[0].ends_with("#1") && deliveries[1].ends_with("#2"),
        "{deliveries:?}"
    );
    assert!(
        links
            .producers
            .lock()
            .unwrap()
            .iter()
            .filter(|p| *p == "00-checkout-01")
            .count()
            >= 2,
        "the attempt spans record the producer: {:?}",
        links.producers.lock().unwrap()
    );
}
