//! Durable operations on the embedded host: a payment service whose charge
//! handler fails twice before it succeeds, keyed by an idempotency id so a
//! caller's retry never charges twice.
//!
//! Run with `cargo run -p durability --example operations [DATA_DIR]`; run it
//! twice on the same directory and the second run finds the payment done.

use std::error::Error;
use std::rc::Rc;
use std::time::Duration;

use durability::retry::Delay;
use durability::{DurableCall, HandlerError, OperationResult, Operations, Registration, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, ObjectContext};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Charge {
    account: String,
    cents: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    reference: String,
    attempts: u32,
}

/// One object per account: its scheduler and its operations.
struct Payments {
    scheduler: Scheduler,
    operations: Operations,
}

impl Payments {
    fn new(ctx: ObjectContext) -> Result<Self, BoxError> {
        let scheduler = Scheduler::new(ctx.into_dyn())?;
        let operations = Operations::builder(&scheduler)
            .max_attempts(5)
            .retry_delay(Delay::Fixed { ms: 200.0 })
            .handler("charge", |call: DurableCall<Charge>| async move {
                // A flaky payment provider: the first two attempts fail.
                if call.attempt < 3 {
                    return Err(HandlerError::new("provider unavailable"));
                }
                Ok::<_, HandlerError>(Receipt {
                    reference: format!(
                        "{}:{}:{}",
                        call.payload.account, call.payload.cents, call.id
                    ),
                    attempts: call.attempt,
                })
            })
            .build()?;
        Ok(Payments {
            scheduler,
            operations,
        })
    }
}

impl DurableObject for Payments {
    // Retries come back through the object's alarm: delegate it.
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let temporary = tempfile::tempdir()?;
    let dir = std::env::args()
        .nth(1)
        .map_or_else(|| temporary.path().to_path_buf(), Into::into);
    let host = Host::builder(&dir).threads(2).build()?;
    let accounts = host.namespace("payments", Payments::new)?;
    let account = accounts.stub("account-42")?;

    let registration = account
        .call(|payments: Rc<Payments>| async move {
            let charge = Charge {
                account: "account-42".into(),
                cents: 1_250,
            };
            // The same id twice: the second registration writes nothing.
            let first = payments
                .operations
                .start("charge", "order-17", &charge)
                .await?;
            payments
                .operations
                .start("charge", "order-17", &charge)
                .await?;
            Ok::<_, durability::DurabilityError>(first)
        })
        .await??;
    println!(
        "order-17 {}",
        match registration {
            Registration::Created => "registered",
            Registration::Existing => "was already registered",
        }
    );

    let result = account
        .call(|payments: Rc<Payments>| async move {
            payments
                .operations
                .wait::<Receipt>("charge", "order-17", Duration::from_secs(30))
                .await
        })
        .await??;
    match result {
        OperationResult::Completed { result } => {
            println!(
                "charged: {} after {} attempts",
                result.reference, result.attempts
            )
        }
        other => println!("not done yet: {other:?}"),
    }
    host.shutdown().await;
    Ok(())
}
