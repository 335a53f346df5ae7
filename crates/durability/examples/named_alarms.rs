//! Named alarms on the embedded host: a session object that expires idle
//! sessions. Each touch reschedules the `expire` alarm, replacing the
//! pending occurrence; only the last one fires.
//!
//! Run with `cargo run -p durability --example named_alarms`.

use std::cell::Cell;
use std::error::Error;
use std::rc::Rc;
use std::time::Duration;

use durability::{AlarmCall, Alarms, HandlerError, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, ObjectContext};

const IDLE_TIMEOUT_MS: i64 = 1_500;

struct Session {
    scheduler: Scheduler,
    alarms: Alarms,
    expired: Rc<Cell<u32>>,
}

impl Session {
    fn new(ctx: ObjectContext) -> Result<Self, BoxError> {
        let scheduler = Scheduler::builder(ctx.into_dyn())
            .alarm_min_delay(Duration::from_secs(1))
            .build()?;
        let expired = Rc::new(Cell::new(0));
        let alarms = Alarms::builder(&scheduler)
            .handler("expire", {
                let expired = Rc::clone(&expired);
                move |call: AlarmCall| {
                    expired.set(expired.get() + 1);
                    println!(
                        "session expired (occurrence {}, attempt {})",
                        call.idempotency_key, call.attempt
                    );
                    async { Ok::<_, HandlerError>(()) }
                }
            })
            .build()?;
        Ok(Session {
            scheduler,
            alarms,
            expired,
        })
    }

    async fn touch(&self) -> Result<(), durability::DurabilityError> {
        let at = self.scheduler.now_ms() + IDLE_TIMEOUT_MS;
        self.alarms.schedule("expire", at).await
    }
}

impl DurableObject for Session {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let host = Host::builder(dir.path()).threads(1).build()?;
    let sessions = host.namespace("sessions", Session::new)?;
    let session = sessions.stub("user-7")?;
    for _ in 0..3 {
        session
            .call(|s: Rc<Session>| async move { s.touch().await })
            .await??;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let expired = session
        .call(|s: Rc<Session>| async move { s.expired.get() })
        .await?;
    println!("expired {expired} time(s) after 3 touches");
    host.shutdown().await;
    Ok(())
}
