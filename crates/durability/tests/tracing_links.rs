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
}

struct AttemptVisitor(Option<u64>);

impl Visit for AttemptVisitor {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "attempt" {
            self.0 = Some(value);
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl<S> Layer<S> for Links
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(&self, _: &Attributes<'_>, _: &Id, _: Context<'_, S>) {}

    fn on_record(&self, span: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if ctx.span(span).is_some_and(|s| s.name() == "attempt") {
            let mut visitor = AttemptVisitor(None);
            values.record(&mut visitor);
            if let Some(attempt) = visitor.0 {
                self.attempts.lock().unwrap().push(attempt);
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
