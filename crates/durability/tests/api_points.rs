//! The API points outside users stumbled on (issue 16), one test per
//! decision: eager settlements, platform info for operation handlers,
//! stored payloads not in the stored format, and a routing client pushing
//! to the object it runs in. (Read-by-name mismatches are tested in
//! `operations.rs`, setter-named config fields in `scheduler.rs`, error
//! kinds in the crate's `kind` module.)

mod routing_support;
mod support;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use durability::fanout::{EnqueueOptions, Fanout, FanoutInput, FanoutMessage, Target};
use durability::platform::{Context, params};
use durability::routing::{CallContext, RoutingClient, RoutingTarget};
use durability::{DurableCall, HandlerError, OperationResult, Operations, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, ObjectContext};
use durability_test::{TestHost, block_on};
use routing_support::{Letters, Mailbox, Mailboxes, mailboxes, paused_clock};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A settlement is eager: dropped unawaited it still binds. With
/// `ack_on_return`, a lazy `dead_letter` dropped unawaited would have
/// turned into an ack.
#[tokio::test(start_paused = true)]
async fn a_settlement_dropped_unawaited_still_settles() {
    support::on_harness(|h| async move {
        let scheduler = Scheduler::new(h.context()).unwrap();
        h.install(&scheduler);
        let fanout = Fanout::<String>::builder(&scheduler)
            .target(
                "t",
                Target::consumer(|batch: Vec<FanoutMessage<String>>| async move {
                    // Settled without awaiting: the outcome is ignored on
                    // purpose, the settlement is not.
                    drop(batch[0].dead_letter());
                    Ok::<_, HandlerError>(())
                })
                .ack_on_return(true),
            )
            .build()
            .unwrap();
        let accepted = fanout
            .enqueue(
                vec![FanoutInput::new("m".to_owned())],
                &EnqueueOptions::all(),
            )
            .await
            .unwrap();
        assert!(accepted.is_accepted());
        tokio::time::sleep(Duration::from_secs(1)).await;
        let parked = fanout.parked(None, 10).unwrap();
        assert_eq!(parked.len(), 1, "dead-lettered, not acked on return");
        assert_eq!(parked[0].body, "m");
        h.keep(fanout);
    })
    .await;
}

/// An object running operations whose handler records where each attempt
/// came from (the physical alarm's info, or none) in a table, and fails the
/// first attempt of every id but "eager".
struct Jobs {
    scheduler: Scheduler,
    operations: Operations,
}

impl DurableObject for Jobs {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

fn jobs(ctx: ObjectContext) -> Result<Jobs, BoxError> {
    ctx.storage().execute_script(
        "CREATE TABLE IF NOT EXISTS runs (id TEXT, attempt INTEGER, platform_retry INTEGER)",
    )?;
    let ctx = ctx.into_dyn();
    let scheduler = Scheduler::new(Rc::clone(&ctx))?;
    let operations = Operations::builder(&scheduler)
        .handler("job", move |call: DurableCall<()>| {
            let ctx = Rc::clone(&ctx);
            async move {
                ctx.storage().execute(
                    "INSERT INTO runs (id, attempt, platform_retry) VALUES (?1, ?2, ?3)",
                    &params![
                        call.id.clone(),
                        call.attempt,
                        call.platform.map(|info| info.retry_count)
                    ],
                )?;
                if call.attempt == 1 && call.id != "eager" {
                    return Err(HandlerError::new("first attempts fail"));
                }
                Ok::<_, HandlerError>(())
            }
        })
        .build()?;
    Ok(Jobs {
        scheduler,
        operations,
    })
}

#[test]
fn operation_handlers_tell_an_alarm_run_from_a_timer_run_and_an_eager_start() -> TestResult {
    block_on(async {
        let kit = TestHost::start()?;
        let object = kit.namespace("jobs", jobs)?.object("j")?;
        let start = |id: &'static str| {
            object.run(move |j: Rc<Jobs>| async move { j.operations.start("job", id, &()).await })
        };
        // Eager start at registration: no platform info.
        start("eager").await??;
        // A retry served by the in-memory timer: no platform info.
        start("timer").await??;
        kit.advance(Duration::from_secs(10)).await;
        // A retry run by the physical alarm after an eviction (the timer
        // went with the object): the alarm's info.
        start("alarm").await??;
        kit.settle().await;
        object.evict().await?;
        kit.advance(Duration::from_secs(60)).await;
        let runs: Vec<(String, i64, Option<i64>)> = object
            .query(
                "SELECT id, attempt, platform_retry FROM runs ORDER BY rowid",
                &[],
            )?
            .iter()
            .map(|row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
            .collect::<Result<_, durability::platform::StorageError>>()?;
        assert_eq!(
            runs,
            [
                ("eager".to_owned(), 1, None),
                ("timer".to_owned(), 1, None),
                ("timer".to_owned(), 2, None),
                ("alarm".to_owned(), 1, None),
                ("alarm".to_owned(), 2, Some(0)),
            ]
        );
        kit.shutdown().await;
        Ok::<_, Box<dyn std::error::Error>>(())
    })?
}

/// A raw row in the stored format's bare form (`'null'` instead of the
/// envelope) fails for good at its first attempt, with a stored error that
/// says what is wrong; a payload of the wrong type stays retryable.
#[tokio::test(start_paused = true)]
async fn a_payload_not_in_the_stored_format_fails_once_with_a_stored_error_saying_why() {
    support::on_harness(|h| async move {
        let ctx = h.context();
        // One permit, held by a slow operation: the rows below are not
        // started eagerly (an eager attempt runs the payload it was given),
        // so the timer's pass reads each of them as stored.
        let scheduler = Scheduler::builder(Rc::clone(&ctx))
            .alarm_concurrency(1)
            .build()
            .unwrap();
        h.install(&scheduler);
        let ran = Rc::new(RefCell::new(0_u32));
        let counted = Rc::clone(&ran);
        let operations = Operations::builder(&scheduler)
            .handler("charge", move |_call: DurableCall<u64>| {
                let counted = Rc::clone(&counted);
                async move {
                    *counted.borrow_mut() += 1;
                    Ok::<_, HandlerError>(())
                }
            })
            .handler("hold", |_call: DurableCall<()>| async {
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok::<_, HandlerError>(())
            })
            .build()
            .unwrap();
        operations.start("hold", "hold", &()).await.unwrap();
        for (id, stored) in [("bare", "null"), ("typed", r#"{"kind":"value","value":"x"}"#)] {
            operations.start("charge", id, &1_u64).await.unwrap();
            // Before an attempt reads it: what a hand-written row holds.
            ctx.storage()
                .execute(
                    "UPDATE durability_calls SET payload = ?1 WHERE id = ?2",
                    &params![stored, id],
                )
                .unwrap();
        }
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(*ran.borrow(), 0, "no handler saw either payload");

        let bare = operations.result::<()>("charge", "bare").unwrap();
        let OperationResult::Failed { attempt, error } = bare else {
            panic!("expected a terminal failure, got {bare:?}");
        };
        assert_eq!(attempt, 1, "not retried: it can never decode");
        assert_eq!(error.name, "NonRetryableError");
        assert!(
            error.message.contains("is not in the stored format")
                && error.message.contains(r#"{"kind":"value","value":<json>}"#),
            "{}",
            error.message
        );
        assert_eq!(
            error.kind(),
            Some(durability::error::LibraryErrorKind::NonRetryable)
        );

        // A payload of the wrong type is retried (a fixed deployment may
        // read it) until its attempts are used up.
        let typed = operations.result::<()>("charge", "typed").unwrap();
        assert!(
            matches!(&typed, OperationResult::Failed { attempt: 5, error } if error.name == "Error"),
            "{typed:?}"
        );
        h.keep(operations);
    })
    .await;
}

/// A routing client used inside an object can push to that same object:
/// the caller goes through the object's own stub (a `Send` future), and
/// the call runs on the object interleaved at awaits. Redriving a dead
/// letter into the fanout it came from needs no second object.
#[test]
fn a_routing_client_inside_an_object_can_push_to_that_same_object() -> TestResult {
    block_on(async {
        let kit = TestHost::start()?;
        let namespace = mailboxes(&kit.host());
        let client = RoutingClient::builder(Mailboxes(namespace.clone()), paused_clock())
            .sharding(|_, _, _| Ok(RoutingTarget::new("self")))
            .build()?;
        let reply = namespace
            .stub("self")?
            .call(move |_me: Rc<Mailbox>| async move {
                client
                    .push(Letters::many(2), CallContext::new())
                    .await
                    .map(|reply| reply.is_accepted())
                    .map_err(|e| e.kind())
            })
            .await?;
        assert_eq!(reply, Ok(true));
        let owed = kit.host().query_object(
            &namespace.id_of("self")?,
            "SELECT COUNT(*) FROM durability_fanout_deliveries",
            &[],
        )?;
        assert_eq!(owed[0].get::<i64>(0)?, 2);
        kit.shutdown().await;
        Ok::<_, Box<dyn std::error::Error>>(())
    })?
}

/// Config errors name the Rust setter the value came through (never a form
/// with units or rules in it); the rule and its units are in the message.
#[tokio::test(start_paused = true)]
async fn config_errors_name_the_setter_the_value_came_through() {
    use durability::error::ConfigError;
    use durability::log::{Leases, Log, Retention};
    use durability::retry::Delay;
    use durability::{DurabilityError, ErrorKind};

    fn field(error: &ConfigError) -> &str {
        match error {
            ConfigError::NotPositive { field }
            | ConfigError::OutOfRange { field, .. }
            | ConfigError::DurationOutOfRange { field, .. }
            | ConfigError::AboveTimerLimit { field, .. }
            | ConfigError::InvalidDelay { field, .. } => field,
            other => panic!("not a field error: {other:?}"),
        }
    }
    fn config(error: DurabilityError) -> ConfigError {
        assert_eq!(error.kind(), ErrorKind::InvalidConfig);
        match error {
            DurabilityError::Config(error) => error,
            other => panic!("not a config error: {other:?}"),
        }
    }

    support::on_harness(|h| async move {
        let scheduler = Scheduler::new(h.context()).unwrap();
        let sub_millisecond = Duration::from_micros(1_500);
        let cases: Vec<(ConfigError, &str)> = vec![
            (
                config(
                    Log::<String>::builder(&scheduler)
                        .leases(Leases::new().lease_for(sub_millisecond))
                        .build()
                        .err()
                        .unwrap(),
                ),
                "leases.lease_for",
            ),
            (
                config(
                    Log::<String>::builder(&scheduler)
                        .retention(Retention::new().max_age(sub_millisecond))
                        .build()
                        .err()
                        .unwrap(),
                ),
                "retention.max_age",
            ),
            (
                // Issue 10 defect 7: it was unbounded.
                config(
                    Log::<String>::builder(&scheduler)
                        .leases(Leases::new().max_parallelism(u32::MAX))
                        .build()
                        .err()
                        .unwrap(),
                ),
                "leases.max_parallelism",
            ),
            (
                config(
                    Operations::builder(&scheduler)
                        .attempt_timeout(Duration::ZERO)
                        .build()
                        .err()
                        .unwrap(),
                ),
                "attempt_timeout",
            ),
            (
                config(
                    Operations::builder(&scheduler)
                        .retry_delay(Delay::Fixed { ms: -1.0 })
                        .build()
                        .err()
                        .unwrap(),
                ),
                "retry_delay.ms",
            ),
            (
                match Fanout::<String>::builder(&scheduler)
                    .target(
                        "t",
                        Target::consumer(|_: Vec<FanoutMessage<String>>| async {
                            Ok::<_, HandlerError>(())
                        }),
                    )
                    .batch_delay(Duration::from_secs(u64::MAX))
                    .build()
                {
                    Err(durability::fanout::FanoutConfigError::Config(error)) => error,
                    other => panic!("expected a config error, got {:?}", other.err()),
                },
                "batch_delay",
            ),
        ];
        for (error, setter) in &cases {
            assert_eq!(field(error), *setter, "{error}");
            assert!(error.to_string().starts_with(setter), "{error}");
            assert!(
                !error.to_string().contains('('),
                "no rule in the name: {error}"
            );
        }
        assert_eq!(
            cases[0].0.to_string(),
            "leases.lease_for must be a whole number of milliseconds from 1 ms to 2147483647 ms"
        );
    })
    .await;
}
