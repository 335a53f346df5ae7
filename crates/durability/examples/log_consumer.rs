//! A consumer loop with leases: three workers share one consumer name and
//! pull disjoint ranges in parallel. A worker acks what it processed, nacks
//! what failed (it comes back with a higher attempt), and a record that
//! keeps failing is skipped as poison after three attempts and reported.
//! The committed cursor only moves over ranges that are settled.
//!
//! Run with `cargo run -p durability --example log_consumer`.

use std::error::Error;
use std::rc::Rc;
use std::time::Duration;

use durability::Scheduler;
use durability::log::{AppendRecord, Lease, Leases, Log};
use durability_host::{DurableObject, Host, ObjectContext, Stub};

const CONSUMER: &str = "indexer";
const WORKERS: usize = 3;
const RECORDS: u64 = 40;
/// The record that always fails, to show the poison path.
const POISON: u64 = 13;

struct Jobs {
    log: Log<u64>,
}

impl DurableObject for Jobs {}

fn open(ctx: ObjectContext) -> Result<Jobs, durability_host::BoxError> {
    let scheduler = Scheduler::new(ctx.into_dyn())?;
    let log = Log::<u64>::builder(&scheduler)
        .leases(
            Leases::new()
                .max_parallelism(WORKERS as u32)
                .lease_for(Duration::from_secs(5))
                .max_attempts(3)
                .on_poison(|range| async move {
                    // A real application would park the records somewhere
                    // for a human (their offsets are in `range`).
                    println!(
                        "poison: offsets {}..={} skipped after {} attempts",
                        range.first_offset, range.last_offset, range.attempts
                    );
                    Ok(())
                }),
        )
        .build()?;
    Ok(Jobs { log })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let host = Host::builder(dir.path()).threads(1).build()?;
    let jobs = host.namespace("jobs", open)?.stub("search-index")?;
    jobs.call(|j: Rc<Jobs>| async move {
        let records = (0..RECORDS).map(AppendRecord::new).collect();
        j.log
            .append(records)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await??;

    let workers: Vec<_> = (0..WORKERS)
        .map(|worker| tokio::spawn(work(worker, jobs.clone())))
        .collect();
    let mut processed = 0;
    for worker in workers {
        processed += worker.await??;
    }
    let cursor = jobs
        .call(|j: Rc<Jobs>| async move { j.log.cursor(CONSUMER).await.map_err(|e| e.to_string()) })
        .await??;
    println!("{processed} ranges processed; {CONSUMER} committed up to {cursor:?}");
    host.shutdown().await;
    Ok(())
}

/// One worker: lease a range, process it outside the object, settle it.
/// Stops when there is nothing left to lease.
async fn work(worker: usize, jobs: Stub<Jobs>) -> Result<usize, String> {
    let mut processed = 0;
    let mut idle_rounds = 0;
    while idle_rounds < 3 {
        let lease: Option<Lease<u64>> = jobs
            .call(|j: Rc<Jobs>| async move {
                j.log
                    .lease(CONSUMER, Some(4))
                    .await
                    .map_err(|e| e.to_string())
            })
            .await
            .map_err(|e| e.to_string())??;
        let Some(lease) = lease else {
            // Nothing free right now: other workers hold the rest.
            idle_rounds += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        idle_rounds = 0;
        tokio::time::sleep(Duration::from_millis(10)).await; // the "work"
        let failed = lease.records.iter().any(|r| r.body == POISON);
        println!(
            "worker {worker}: offsets {}..={} attempt {} -> {}",
            lease.first_offset,
            lease.last_offset,
            lease.attempt,
            if failed { "nack" } else { "ack" }
        );
        let batch_id = lease.batch_id.clone();
        jobs.call(move |j: Rc<Jobs>| async move {
            let settled = if failed {
                j.log.nack(CONSUMER, &batch_id).await
            } else {
                j.log.ack(CONSUMER, &batch_id).await
            };
            settled.map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())??;
        processed += usize::from(!failed);
    }
    Ok(processed)
}
