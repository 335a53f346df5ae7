//! One scheduler, several capabilities: an object with both durable
//! operations and named alarms shares one physical alarm and one pool of
//! permits between them. The object's `alarm()` runs both.
//!
//! Run with `cargo run -p durability --example shared_scheduler`.

use std::error::Error;
use std::rc::Rc;
use std::time::Duration;

use durability::{
    AlarmCall, Alarms, DurableCall, HandlerError, OperationResult, Operations, Scheduler,
};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, ObjectContext};

struct Jobs {
    scheduler: Scheduler,
    operations: Operations,
    alarms: Alarms,
}

impl Jobs {
    fn new(ctx: ObjectContext) -> Result<Self, BoxError> {
        let scheduler = Scheduler::builder(ctx.into_dyn())
            .alarm_concurrency(4)
            .build()?;
        let operations = Operations::builder(&scheduler)
            .handler("resize", |call: DurableCall<(u32, u32)>| async move {
                let (w, h) = call.payload;
                Ok::<_, HandlerError>(format!("{}x{}", w / 2, h / 2))
            })
            .build()?;
        // The nightly report registers an operation: both capabilities on
        // one scheduler, so neither clobbers the other's alarm.
        let for_report = operations.clone();
        let alarms = Alarms::builder(&scheduler)
            .handler("report", move |call: AlarmCall| {
                let operations = for_report.clone();
                async move {
                    operations
                        .start("resize", &call.idempotency_key, &(800_u32, 600_u32))
                        .await
                        .map_err(HandlerError::from)?;
                    Ok(())
                }
            })
            .build()?;
        Ok(Jobs {
            scheduler,
            operations,
            alarms,
        })
    }
}

impl DurableObject for Jobs {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let host = Host::builder(dir.path()).threads(1).build()?;
    let jobs = host.namespace("jobs", Jobs::new)?;
    let job = jobs.stub("images")?;
    job.call(|jobs: Rc<Jobs>| async move {
        jobs.operations
            .start("resize", "cover", &(1_024_u32, 768_u32))
            .await?;
        let soon = jobs.scheduler.now_ms() + 500;
        jobs.alarms.schedule("report", soon).await
    })
    .await??;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cover = job
        .call(|jobs: Rc<Jobs>| async move { jobs.operations.result::<String>("resize", "cover") })
        .await??;
    if let OperationResult::Completed { result } = cover {
        println!("cover resized to {result}");
    }
    host.shutdown().await;
    Ok(())
}
