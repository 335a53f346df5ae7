//! Flow control per fanout target (issue 14): an object fans each event out
//! to a `webhook` target limited to 50 deliveries a second (at most 4 in
//! flight) and to an unlimited `audit` target. The webhook gets its burst
//! of 50, then one delivery every 20 ms; the audit target is not slowed.
//! Pausing the webhook (say, while its endpoint is down) keeps accepting
//! events and delivers nothing until it is resumed, across restarts.
//!
//! Run with `cargo run -p durability --example webhook_rate_limit`.

use std::cell::Cell;
use std::error::Error;
use std::rc::Rc;
use std::time::{Duration, Instant};

use durability::fanout::{
    EnqueueOptions, Fanout, FanoutError, FanoutInput, FanoutMessage, FlowControl, Target,
};
use durability::{HandlerError, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, ObjectContext};

const EVENTS: u32 = 120;

struct Hooks {
    scheduler: Scheduler,
    events: Fanout<String>,
    posted: Rc<Cell<u32>>,
    audited: Rc<Cell<u32>>,
}

impl Hooks {
    fn new(ctx: ObjectContext) -> Result<Self, BoxError> {
        let scheduler = Scheduler::new(ctx.into_dyn())?;
        let (posted, audited) = (Rc::new(Cell::new(0)), Rc::new(Cell::new(0)));
        let webhook = {
            let posted = Rc::clone(&posted);
            Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                // POST each event to the endpoint here.
                posted.set(posted.get() + batch.len() as u32);
                async { Ok::<_, HandlerError>(()) }
            })
            .ack_on_return(true)
        };
        let audit = {
            let audited = Rc::clone(&audited);
            Target::consumer(move |batch: Vec<FanoutMessage<String>>| {
                audited.set(audited.get() + batch.len() as u32);
                async { Ok::<_, HandlerError>(()) }
            })
            .ack_on_return(true)
        };
        let events = Fanout::<String>::builder(&scheduler)
            .target("webhook", webhook)
            .target("audit", audit)
            .flow_control(
                "webhook",
                FlowControl::new()
                    .rate_limit(50, Duration::from_secs(1))
                    .concurrency(4),
            )
            .build()?;
        Ok(Hooks {
            scheduler,
            events,
            posted,
            audited,
        })
    }

    /// Pauses or resumes the webhook, durably.
    async fn endpoint_down(&self, down: bool) -> Result<(), FanoutError> {
        if down {
            self.events.pause_target("webhook").await
        } else {
            self.events.resume_target("webhook").await
        }
    }
}

impl DurableObject for Hooks {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let host = Host::builder(dir.path()).threads(1).build()?;
    let objects = host.namespace("hooks", Hooks::new)?;
    let hooks = objects.stub("shop-42")?;
    let started = Instant::now();
    hooks
        .call(|h: Rc<Hooks>| async move {
            let events = (0..EVENTS)
                .map(|i| FanoutInput::new(format!("order {i} paid")).id(format!("e{i}")))
                .collect();
            h.events.enqueue(events, &EnqueueOptions::all()).await
        })
        .await??;
    let counts = || hooks.call(|h: Rc<Hooks>| async move { (h.posted.get(), h.audited.get()) });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (posted, audited) = counts().await?;
    println!("after 0.1 s: webhook {posted}, audit {audited} of {EVENTS}");
    // The endpoint goes down for a second: nothing is lost, nothing posted.
    hooks
        .call(|h: Rc<Hooks>| async move { h.endpoint_down(true).await })
        .await??;
    let (paused_at, _) = counts().await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (still, _) = counts().await?;
    println!("paused for 1 s: webhook {paused_at} -> {still}");
    hooks
        .call(|h: Rc<Hooks>| async move { h.endpoint_down(false).await })
        .await??;
    loop {
        let (posted, _) = counts().await?;
        if posted >= EVENTS {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "webhook got all {EVENTS} events after {:.1} s (a burst of 50, then 50/s)",
        started.elapsed().as_secs_f64()
    );
    host.shutdown().await;
    Ok(())
}
