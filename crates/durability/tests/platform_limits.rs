//! Cloudflare's storage limits on the embedded host: every capability keeps
//! within them at its largest settings, a statement beyond them fails with
//! a typed error before it runs, and the builders refuse a body limit a
//! Durable Object could not store.
//!
//! The support module builds every host of the capability tests with
//! `StorageLimits::CLOUDFLARE`, so each statement of the whole suite is
//! counted against the limits; this file drives every capability at its
//! extremes in one place, where a new statement that binds a parameter per
//! item would show first.

mod support;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use durability::fanout::{
    EnqueueOptions, EnqueueResult, Fanout, FanoutConfigError, FanoutInput, FanoutMessage, Target,
};
use durability::limits::{DEFAULT_MAX_ENQUEUE_MESSAGES, MAX_BODY_BYTES_LIMIT};
use durability::log::{AppendRecord, Read};
use durability::{
    Alarms, ConfigError, DurabilityError, HandlerError, Log, OperationResult, Operations,
    Recurrence, Scheduler,
};
use durability_platform::{StorageError, StorageLimits, Value, check_statement};
use serde_json::{Value as Json, json};
use support::Harness;

fn scheduler(h: &Harness) -> Scheduler {
    let scheduler = Scheduler::new(h.context()).unwrap();
    h.install(&scheduler);
    scheduler
}

fn acking() -> Target<Json> {
    Target::consumer(|_batch: Vec<FanoutMessage<Json>>| async { Ok::<_, HandlerError>(()) })
        .ack_on_return(true)
}

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

#[tokio::test(start_paused = true)]
async fn the_test_hosts_refuse_a_statement_beyond_cloudflare_limits_before_it_runs() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        let storage = ctx.storage();
        assert_eq!(storage.limits(), StorageLimits::CLOUDFLARE);
        storage
            .execute_script("CREATE TABLE wide (v)")
            .expect("table");
        let hundred = format!("SELECT {}", vec!["?"; 100].join(", "));
        assert_eq!(
            storage
                .query(&hundred, &vec![Value::Null; 100])
                .unwrap()
                .len(),
            1
        );
        let one_more = format!(
            "INSERT INTO wide (v) VALUES {}",
            vec!["(?)"; 101].join(", ")
        );
        match storage.execute(&one_more, &vec![Value::Integer(1); 101]) {
            Err(StorageError::LimitExceeded { limit, value, max }) => {
                assert_eq!((limit, value, max), ("max_bound_parameters", 101, 100));
            }
            other => panic!("a 101-parameter statement ran: {other:?}"),
        }
        let big = Value::Text("x".repeat(2_000_001));
        assert!(matches!(
            storage.execute("INSERT INTO wide (v) VALUES (?)", &[big]),
            Err(StorageError::LimitExceeded {
                limit: "max_value_bytes",
                ..
            })
        ));
        let long = format!("SELECT '{}'", "x".repeat(100_000));
        assert!(matches!(
            storage.query(&long, &[]),
            Err(StorageError::LimitExceeded {
                limit: "max_statement_bytes",
                ..
            })
        ));
        // Nothing of the refused statements was written.
        assert_eq!(
            support::query_i64(&*ctx, "SELECT COUNT(*) FROM wide", &[]),
            0
        );
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn every_capability_at_its_largest_batches_keeps_within_cloudflare_limits() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let delivered = Rc::new(RefCell::new(0usize));
        let fanout = Fanout::<Json>::builder(&scheduler)
            .target("a", {
                let delivered = Rc::clone(&delivered);
                Target::consumer(move |batch: Vec<FanoutMessage<Json>>| {
                    let delivered = Rc::clone(&delivered);
                    async move {
                        *delivered.borrow_mut() += batch.len();
                        Ok::<_, HandlerError>(())
                    }
                })
                .ack_on_return(true)
            })
            .target("b", acking())
            .max_batch_size(1_000)
            .build()
            .unwrap();
        // The largest enqueue: one call, one transaction, a thousand
        // messages with ids, each to two targets.
        let inputs = (0..DEFAULT_MAX_ENQUEUE_MESSAGES)
            .map(|i| {
                FanoutInput::new(json!({ "n": i, "pad": "p".repeat(500) })).id(format!("m{i}"))
            })
            .collect();
        let accepted = fanout
            .enqueue(inputs, &EnqueueOptions::all())
            .await
            .unwrap();
        assert!(
            matches!(accepted, EnqueueResult::Accepted { .. }),
            "{accepted:?}"
        );
        for _ in 0..200 {
            if *delivered.borrow() == DEFAULT_MAX_ENQUEUE_MESSAGES {
                break;
            }
            sleep_ms(100).await;
        }
        assert_eq!(*delivered.borrow(), DEFAULT_MAX_ENQUEUE_MESSAGES);
        assert_eq!(fanout.load().unwrap().outbound.pending_deliveries, 0);

        let log = Log::<Json>::builder(&scheduler)
            .max_batch_size(10_000)
            .build()
            .unwrap();
        let records: Vec<_> = (0..10_000)
            .map(|i| AppendRecord::keyed(format!("k{i}"), json!(i)))
            .collect();
        let appended = log.append(records).await.unwrap();
        assert_eq!(appended.offsets().map(<[u64]>::len), Some(10_000));
        let page = log.read(Read::from_offset(0)).await.unwrap();
        assert!(!page.records.is_empty());
        log.commit("reader", page.next_offset).await.unwrap();

        let operations = Operations::builder(&scheduler)
            .handler("echo", |call: durability::DurableCall<Json>| async move {
                Ok::<_, HandlerError>(call.payload)
            })
            .build()
            .unwrap();
        // A payload of the largest default size, stored and returned whole.
        let payload = json!("q".repeat(1_000_000));
        operations.start("echo", "big", &payload).await.unwrap();
        for _ in 0..100 {
            if !matches!(
                operations.result::<Json>("echo", "big").unwrap(),
                OperationResult::Pending { .. }
            ) {
                break;
            }
            sleep_ms(100).await;
        }
        assert!(matches!(
            operations.result::<Json>("echo", "big").unwrap(),
            OperationResult::Completed { result } if result == payload
        ));

        let alarms = Alarms::builder(&scheduler)
            .handler("tick", |_call| async { Ok::<_, HandlerError>(()) })
            .build()
            .unwrap();
        let now = scheduler.now_ms();
        alarms.schedule("tick", now + 60_000).await.unwrap();
        alarms
            .schedule_recurring(
                "tick",
                &Recurrence::cron("*/5 * * * *", "Europe/Berlin").unwrap(),
                &json!(null),
            )
            .await
            .unwrap();
        h.keep((fanout, log, operations, alarms));
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn body_limits_a_durable_object_cannot_store_are_refused_naming_the_setter() {
    support::on_harness(|h| async move {
        let scheduler = scheduler(&h);
        let too_big = 2_000_000;
        let platform_refusal = |error: &ConfigError, setter: &str| {
            matches!(
                error,
                ConfigError::AbovePlatformLimit { field, value, platform_max, .. }
                    if field == setter && *value == too_big && *platform_max == 2_000_000
            )
        };
        match Fanout::<Json>::builder(&scheduler)
            .target("a", acking())
            .max_body_bytes(too_big as usize)
            .build()
        {
            Err(FanoutConfigError::Config(error)) => {
                assert!(platform_refusal(&error, "max_body_bytes"), "{error}");
                assert!(error.to_string().contains("max_body_bytes"), "{error}");
            }
            other => panic!("fanout accepted a 2 MB body limit: {:?}", other.err()),
        }
        match Log::<Json>::builder(&scheduler)
            .max_body_bytes(too_big as usize)
            .build()
        {
            Err(DurabilityError::Config(error)) => {
                assert!(platform_refusal(&error, "max_body_bytes"), "{error}");
            }
            other => panic!("log accepted a 2 MB body limit: {:?}", other.err()),
        }
        match Operations::builder(&scheduler)
            .max_payload_bytes(too_big as usize)
            .build()
        {
            Err(DurabilityError::Config(error)) => {
                assert!(platform_refusal(&error, "max_payload_bytes"), "{error}");
            }
            other => panic!(
                "operations accepted a 2 MB payload limit: {:?}",
                other.err()
            ),
        }
        // The largest body limit Cloudflare can store is accepted, and a
        // record of that size is stored: its row fits the platform.
        let largest = 2_000_000 - durability::limits::STORED_VALUE_OVERHEAD_BYTES;
        let log = Log::<Json>::builder(&scheduler)
            .max_body_bytes(largest)
            .build()
            .unwrap();
        let body = json!("r".repeat(largest - 2));
        let appended = log.append(vec![AppendRecord::new(body)]).await.unwrap();
        assert_eq!(appended.offsets().map(<[u64]>::len), Some(1));
    })
    .await;
}

#[test]
fn the_embedded_host_default_takes_the_largest_body_limit() {
    // SQLite's own limits leave room for every body limit a builder takes.
    let max = StorageLimits::SQLITE.max_value_bytes;
    assert!(MAX_BODY_BYTES_LIMIT + durability::limits::STORED_VALUE_OVERHEAD_BYTES <= max);
    assert!(
        check_statement(
            &StorageLimits::SQLITE,
            "SELECT ?",
            &[Value::Blob(vec![0; MAX_BODY_BYTES_LIMIT])]
        )
        .is_ok()
    );
}

/// The harness's context, reporting a CPU limit per invocation as a
/// Durable Object's does.
struct CpuLimited(Rc<dyn durability_platform::Context>, Duration);

impl durability_platform::Context for CpuLimited {
    fn id(&self) -> &durability_platform::ObjectId {
        self.0.id()
    }
    fn storage(&self) -> &dyn durability_platform::Storage {
        self.0.storage()
    }
    fn now_ms(&self) -> durability_platform::EpochMs {
        self.0.now_ms()
    }
    fn sleep(&self, duration: Duration) -> durability_platform::LocalBoxFuture<'static, ()> {
        self.0.sleep(duration)
    }
    fn random_bytes(&self, buf: &mut [u8]) {
        self.0.random_bytes(buf);
    }
    fn spawn(&self, task: durability_platform::LocalBoxFuture<'static, ()>) {
        self.0.spawn(task);
    }
    fn wait_until(&self, task: durability_platform::LocalBoxFuture<'static, ()>) {
        self.0.wait_until(task);
    }
    fn invocation_cpu_limit(&self) -> Option<Duration> {
        Some(self.1)
    }
}

#[tokio::test(start_paused = true)]
async fn under_a_cpu_limit_a_long_alarm_run_hands_off_at_half_of_it_and_longer_handoffs_are_refused()
 {
    support::on_harness(|h| async move {
        let limit = Duration::from_secs(30);
        let ctx: Rc<dyn durability_platform::Context> = Rc::new(CpuLimited(h.context(), limit));
        let refused = Scheduler::builder(Rc::clone(&ctx))
            .alarm_handoff(limit)
            .build();
        match refused {
            Err(ConfigError::AboveInvocationLimit {
                field,
                value_ms,
                limit_ms,
            }) => {
                assert_eq!(
                    (field.as_str(), value_ms, limit_ms),
                    ("alarm_handoff", 30_000, 30_000)
                );
            }
            other => panic!("a handoff at the CPU limit was accepted: {other:?}"),
        }
        let scheduler = Scheduler::new(Rc::clone(&ctx)).unwrap();
        h.install(&scheduler);
        let alarms = Alarms::builder(&scheduler)
            .handler("long", |_call| async {
                sleep_ms(60_000).await;
                Ok::<_, HandlerError>(())
            })
            .build()
            .unwrap();
        h.keep(alarms.clone());
        alarms.schedule("long", scheduler.now_ms()).await.unwrap();
        ctx.storage().delete_alarm().await.unwrap();
        let started = scheduler.now_ms();
        scheduler.alarm(None).await.unwrap();
        // The default handoff is half the CPU limit, not 14 minutes.
        assert_eq!(scheduler.now_ms() - started, 15_000);
        assert!(support::physical_alarm(&*ctx).await.is_some());
    })
    .await;
}
