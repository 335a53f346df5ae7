//! A recurring named alarm: a newsletter object sends its daily digest at
//! 08:00 in Paris, whatever the season. The object registers the schedule
//! on every start (a no-op once stored); a host that was down across 08:00
//! sends the missed digest once when it is back (`MissedTicks::RunOnce`).
//!
//! So that the example does not wait for tomorrow morning, the host's clock
//! starts at 07:59:58 Paris time on 2 June 2025.
//!
//! Run with `cargo run -p durability --example daily_digest`.

use std::error::Error;
use std::rc::Rc;
use std::time::Duration;

use durability::{AlarmCall, Alarms, HandlerError, MissedTicks, Recurrence, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, ObjectContext};
use serde::{Deserialize, Serialize};

/// 2025-06-02T07:59:58+02:00.
const JUST_BEFORE_EIGHT_MS: i64 = 1_748_843_998_000;

#[derive(Serialize, Deserialize)]
struct Digest {
    list: String,
}

struct Newsletter {
    scheduler: Scheduler,
    alarms: Alarms,
}

impl Newsletter {
    fn new(ctx: ObjectContext) -> Result<Self, BoxError> {
        let scheduler = Scheduler::builder(ctx.into_dyn())
            .alarm_min_delay(Duration::from_secs(1))
            .build()?;
        let alarms = Alarms::builder(&scheduler)
            .handler("daily-digest", |call: AlarmCall| async move {
                let digest: Digest = call.payload_as()?;
                let local = jiff::Timestamp::from_millisecond(call.scheduled_time)
                    .and_then(|t| t.in_tz("Europe/Paris"))
                    .map_err(|e| HandlerError::non_retryable(e.to_string()))?;
                // Key the send by call.idempotency_key: a retry of this
                // morning's digest must not mail it twice.
                println!(
                    "sending the {} digest for {} ({} missed before it)",
                    digest.list,
                    local.strftime("%Y-%m-%d %H:%M %Z"),
                    call.missed
                );
                Ok(())
            })
            .build()?;
        Ok(Newsletter { scheduler, alarms })
    }

    /// Registers the digest: unchanged on every start after the first.
    async fn start(&self) -> Result<Option<i64>, durability::DurabilityError> {
        let every_morning =
            Recurrence::cron("0 8 * * *", "Europe/Paris")?.missed_ticks(MissedTicks::RunOnce);
        let digest = Digest {
            list: "weekday".into(),
        };
        self.alarms
            .schedule_recurring("daily-digest", &every_morning, &digest)
            .await
    }
}

impl DurableObject for Newsletter {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let host = Host::builder(dir.path())
        .threads(1)
        .clock_start_ms(JUST_BEFORE_EIGHT_MS)
        .build()?;
    let newsletters = host.namespace("newsletters", Newsletter::new)?;
    let newsletter = newsletters.stub("weekday")?;
    let first = newsletter
        .call(|n: Rc<Newsletter>| async move { n.start().await })
        .await??;
    println!("first digest due at {first:?} (epoch ms)");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let listed = newsletter
        .call(|n: Rc<Newsletter>| async move { n.alarms.list() })
        .await??;
    for entry in listed {
        println!(
            "{}: {:?}, next run at {:?} ms, {} run(s) so far",
            entry.name, entry.state, entry.next_run_at, entry.runs
        );
    }
    host.shutdown().await;
    Ok(())
}
