//! `durability demo`: the first thing a new user runs. A mailbox service on
//! an embedded data directory (default `./durability-data`), over
//! `--shards` objects:
//!
//! - a producer pushes `--messages` mails in batches through a routing
//!   client to the shard of their customer, and journals every accepted
//!   batch ([`producer`]);
//! - each shard delivers every mail to an inbox consumer that fails some
//!   transiently and a few for good, and to an archive storage target;
//!   dead letters go to a DLQ directory; a named alarm cleans up and a
//!   durable operation writes each shard's digest ([`mailbox`]);
//! - bars on stderr show the progress ([`progress`]), and the summary
//!   ([`summary`]) is computed from the run's files ([`facts`]).
//!
//! Interrupted (Ctrl-C) or killed, the next invocation on the same
//! directory resumes the unfinished run: it waits until everything the
//! interrupted run accepted is delivered, says so, then accepts the rest.
//!
//! This module owns the command's arguments, the host it runs on, and the
//! order of the phases.

mod facts;
mod mailbox;
mod producer;
mod progress;
mod summary;

use std::collections::HashSet;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use durability::OperationResult;
use durability_host::{Host, HostError, Stub};

use crate::torture::journal::Journal;
use facts::{Accounting, Facts, OpenedRun};
use mailbox::{Mailbox, NAMESPACE, Shared, TARGETS};
use progress::{Counters, Progress};
use summary::{Summary, grouped};

/// What `--pause-after-batches` prints on stderr once it has paused.
pub const PAUSED_MARKER: &str = "demo paused by --pause-after-batches; waiting to be killed";

/// How long shutdown waits for deliveries in flight; the rest waits in the
/// shards' storage for the next run.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// How often the demo asks the shards what they still owe.
const DRAIN_POLL: Duration = Duration::from_millis(50);
/// How long the owed count may stay without going down before the demo
/// gives up. Longer than the fanout's infrastructure retry (a minute), which
/// a kill during a DLQ write legitimately costs.
const STALL_TIMEOUT: Duration = Duration::from_secs(120);

/// Arguments of `durability demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// The data directory: the objects' SQLite files, and per run the
    /// journals, archive, DLQ and digests. A run interrupted on it is
    /// resumed by the next invocation.
    #[arg(long, value_name = "DIR", default_value = "durability-data")]
    data_dir: PathBuf,
    /// How many mails the run enqueues (in batches of 100).
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    messages: u64,
    /// How many mailbox shards (objects) the mails are spread over.
    #[arg(long, value_name = "K", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1_024))]
    shards: u32,
    /// Print the summary as one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Serve the dashboard (and Prometheus `/metrics`) on ADDR while the
    /// mail flows, and keep serving after the run until Ctrl-C.
    #[arg(long, value_name = "ADDR")]
    serve: Option<std::net::SocketAddr>,
    /// Archive every durable change continuously to URL (`file:///dir`)
    /// while the demo runs: a base, then every synced journal pass, so
    /// that `durability restore URL_PATH DIR --at TIME` can rebuild any
    /// moment of the run (see docs/operating.md).
    #[arg(long, value_name = "URL")]
    archive: Option<String>,
    /// Test hook: stop producing after this many accepted batches and wait
    /// to be killed.
    #[arg(long, hide = true, value_name = "BATCHES")]
    pause_after_batches: Option<u64>,
}

/// Why the demo failed or stopped.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("invalid --archive")]
    Archive {
        #[source]
        source: durability_host::archive::ArchiveError,
    },
    #[error("cannot start the demo's tokio runtime")]
    Runtime {
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot decode {}", path.display())]
    Decode {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot encode {what} as JSON")]
    Encode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("a journal of the run failed")]
    Journal {
        #[from]
        source: crate::torture::TortureError,
    },
    /// Another process serves the data directory: a second checkout's demo
    /// on the same directory, say. Refused at once, never waited for.
    #[error(
        "the data directory {} is in use by another host ({holder}); this demo does not wait \
         for it: stop that process, or give this run its own --data-dir",
        path.display()
    )]
    DataDirInUse { path: PathBuf, holder: String },
    #[error("the object host failed")]
    Host {
        #[from]
        source: durability_host::HostError,
    },
    #[error("a call to a mailbox shard failed")]
    Call {
        #[from]
        source: durability_host::CallError,
    },
    #[error("a mailbox shard failed")]
    Fanout {
        #[from]
        source: durability::fanout::FanoutError,
    },
    #[error("a mailbox shard's operation failed")]
    Durability {
        #[from]
        source: durability::DurabilityError,
    },
    #[error("a mailbox shard's storage failed")]
    Storage {
        #[from]
        source: durability_platform::StorageError,
    },
    #[error("cannot configure {what}")]
    Config {
        what: &'static str,
        #[source]
        source: durability::ConfigError,
    },
    #[error(
        "the push of batch {batch} failed; it may have been accepted, and the next run pushes it again"
    )]
    Push {
        batch: u64,
        #[source]
        source: Box<durability::routing::RoutingError<producer::PushError>>,
    },
    #[error("batch {batch} was rejected: {reason}")]
    Rejected { batch: u64, reason: String },
    #[error("the digest of shard {shard} did not complete: {state}")]
    Digest { shard: String, state: String },
    #[error("cannot measure enqueue latency")]
    Latency {
        #[source]
        source: crate::bench::BenchError,
    },
    #[error("a demo task failed: {message}")]
    Task { message: String },
    #[error("cannot serve the dashboard")]
    Serve {
        #[from]
        source: crate::serve::ServeError,
    },
    #[error("cannot listen for Ctrl-C")]
    Signal {
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{owed} deliveries are still owed and none settled for {waited_s} s; run again to resume"
    )]
    Stalled { owed: u64, waited_s: u64 },
    #[error("{loss}")]
    Lost { loss: String },
    #[error(
        "interrupted: run {run} accepted {accepted} of {messages} messages and owes {owed} \
         deliveries; run the same command again to finish them"
    )]
    Interrupted {
        run: u32,
        accepted: String,
        messages: String,
        owed: String,
    },
}

/// Runs `durability demo` and returns what to print.
pub fn run(args: &DemoArgs) -> Result<DemoOutput, DemoError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| DemoError::Runtime { source })?;
    runtime.block_on(demo(args))
}

/// Everything one invocation works with.
struct Run {
    opened: OpenedRun,
    /// The run's facts when this invocation started.
    before: Facts,
    shards: Vec<Stub<Mailbox>>,
    client: producer::Client,
    journal: Journal,
    counters: Arc<Counters>,
    progress: Progress,
    started: Instant,
    pause_after: Option<u64>,
}

/// What a finished invocation prints, and whether it lost anything (then it
/// exits non-zero after printing the summary).
pub struct DemoOutput {
    pub text: String,
    pub lost: Option<DemoError>,
}

async fn demo(args: &DemoArgs) -> Result<DemoOutput, DemoError> {
    let started = Instant::now();
    // Installed before the host exists, so its first objects are counted.
    let metrics = match args.serve {
        Some(_) => Some(crate::serve::install_metrics()?),
        None => None,
    };
    // The host first: it takes the data directory's lock, so a second demo
    // on a busy directory fails here, before it reads or writes any run
    // file or says anything about resuming.
    let mut builder = Host::builder(&args.data_dir).shutdown_grace(SHUTDOWN_GRACE);
    if let Some(url) = &args.archive {
        let config = durability_host::archive::ArchiveConfig::new(url)
            .map_err(|source| DemoError::Archive { source })?;
        builder = builder.archive(config);
    }
    let host = builder.build().map_err(|error| match error {
        HostError::DataDirInUse {
            path, holder_pid, ..
        } => DemoError::DataDirInUse {
            path,
            holder: holder_pid.map_or_else(|| "pid unknown".to_owned(), |pid| format!("pid {pid}")),
        },
        other => DemoError::Host { source: other },
    })?;
    let serving = match (args.serve, metrics) {
        (Some(addr), Some(metrics)) => match serve_dashboard(&host, addr, metrics).await {
            Ok(serving) => Some(serving),
            Err(error) => {
                host.shutdown().await;
                return Err(error);
            }
        },
        _ => None,
    };
    let outcome = demo_on(args, &host, started).await;
    // Shut down after a failure too, so every file is closed cleanly.
    host.shutdown().await;
    let Some(serving) = serving else {
        return outcome;
    };
    let output = match outcome {
        Ok(output) => output,
        Err(error) => {
            serving.stop().await?;
            return Err(error);
        }
    };
    // The page keeps showing the run's final state until the user is done.
    println!("{}", output.text);
    eprintln!(
        "the run is over; the dashboard stays at http://{}/ until Ctrl-C",
        serving.addr
    );
    tokio::signal::ctrl_c()
        .await
        .map_err(|source| DemoError::Signal { source })?;
    serving.stop().await?;
    Ok(DemoOutput {
        text: String::new(),
        lost: output.lost,
    })
}

async fn demo_on(args: &DemoArgs, host: &Host, started: Instant) -> Result<DemoOutput, DemoError> {
    let opened = facts::open_run(&args.data_dir, args.messages, args.shards)?;
    let plan = opened.plan.clone();
    if opened.resumed && (plan.messages, plan.shards) != (args.messages, args.shards) {
        // Its messages are spread over its shards already: the plan stays.
        eprintln!(
            "run {} was interrupted; it is finished with its own plan ({} messages on {} \
             shards), and --messages/--shards apply to the next run",
            plan.run,
            grouped(plan.messages),
            plan.shards
        );
    }
    let before = Facts::read(&opened.paths)?;
    let counters = Arc::new(Counters::starting_from(
        &before,
        plan.batch_size,
        plan.messages,
    ));
    let shared = Arc::new(Shared::new(&args.data_dir, Arc::clone(&counters)));
    // The host runs its default threads, one per core: more do not help, the
    // run is bound by the disk's syncs (each archived mail is a file sync and
    // an ack commit).
    let mailboxes = host.namespace(NAMESPACE, move |ctx| Mailbox::new(ctx, Arc::clone(&shared)))?;
    let shards = (0..u64::from(plan.shards))
        .map(|n| mailboxes.stub(&producer::shard_name(n)))
        .collect::<Result<Vec<_>, _>>()?;
    let client = producer::client(mailboxes, host, plan.shards)?;
    let journal = Journal::open(&opened.paths.accepted())?;
    let progress = Progress::start(Arc::clone(&counters), plan.messages);
    let run = Run {
        opened,
        before,
        shards,
        client,
        journal,
        counters,
        progress,
        started,
        pause_after: args.pause_after_batches,
    };

    let outcome = tokio::select! {
        outcome = run.finish(&args.data_dir) => outcome.map(Some),
        signal = tokio::signal::ctrl_c() => signal
            .map(|()| None)
            .map_err(|source| DemoError::Signal { source }),
    };
    run.progress.finish();
    let summary = match outcome {
        Ok(Some(summary)) => summary,
        Ok(None) => return Err(run.interrupted().await),
        Err(error) => return Err(error),
    };
    facts::write_json_atomically(&run.opened.paths.summary(), &summary)?;
    let text = if args.json {
        serde_json::to_string_pretty(&summary).map_err(|source| DemoError::Encode {
            what: "the summary",
            source,
        })?
    } else {
        summary.render()
    };
    Ok(DemoOutput {
        text,
        lost: summary.loss().map(|loss| DemoError::Lost { loss }),
    })
}

/// Mounts the dashboard over the demo's host, with `/metrics`.
async fn serve_dashboard(
    host: &Host,
    addr: std::net::SocketAddr,
    metrics: metrics_exporter_prometheus::PrometheusHandle,
) -> Result<crate::serve::Serving, DemoError> {
    let router = durability_axum::Dashboard::for_host(host)
        .title("durability demo")
        .prometheus(metrics)
        .build()
        .map_err(|source| crate::serve::ServeError::Dashboard { source })?;
    let serving = crate::serve::Serving::start(addr, router).await?;
    eprintln!(
        "dashboard: http://{}/ (JSON at /api/objects, Prometheus at /metrics)",
        serving.addr
    );
    Ok(serving)
}

impl Run {
    /// The phases: finish what an interrupted run accepted, accept the rest
    /// of the plan, wait until it is delivered, write the digests, account.
    async fn finish(&self, data_dir: &std::path::Path) -> Result<Summary, DemoError> {
        let plan = &self.opened.plan;
        let resumed_accepted = self.accepted_before();
        let mut resumed_owed = 0;
        if self.opened.resumed {
            resumed_owed = self.owed().await?;
            self.progress.note(&format!(
                "resuming run {}: {} of {} messages were accepted before it was interrupted; \
                 finishing their {} owed deliveries first",
                plan.run,
                grouped(resumed_accepted),
                grouped(plan.messages),
                grouped(resumed_owed)
            ));
            self.drain().await?;
            let (parked, _) = self.parked_and_cleanup().await?;
            let so_far = Accounting::of(plan, &Facts::read(&self.opened.paths)?, &parked);
            let remaining = grouped(plan.messages.saturating_sub(resumed_accepted));
            if so_far.lost == 0 {
                self.progress.note(&format!(
                    "resumed run {}: every accepted message reached its end; accepting the remaining {remaining}",
                    plan.run,
                ));
            } else {
                // Said now, and again (with an exit code) in the summary.
                self.progress.note(&format!(
                    "resumed run {}: {} accepted messages reached no end (see the summary); \
                     accepting the remaining {remaining}",
                    plan.run,
                    grouped(so_far.lost),
                ));
            }
        }

        let todo: Vec<u64> = (0..plan.batches())
            .filter(|batch| !self.before.accepted_batches.contains(batch))
            .collect();
        let producing = Instant::now();
        let produced = producer::produce(
            self.client.clone(),
            plan,
            todo,
            self.journal.clone(),
            Arc::clone(&self.counters),
            self.pause_after,
        )
        .await?;
        let producing = producing.elapsed();
        if produced.paused {
            self.progress.note(PAUSED_MARKER);
            std::future::pending::<()>().await;
        }
        self.drain().await?;
        let delivering = self.started.elapsed();

        let mut digests_completed = 0;
        for stub in &self.shards {
            let run = plan.run;
            match stub
                .call(move |mailbox: Rc<Mailbox>| async move { mailbox.digest(run).await })
                .await??
            {
                OperationResult::Completed { .. } => digests_completed += 1,
                other => {
                    return Err(DemoError::Digest {
                        shard: stub.name().to_owned(),
                        state: format!("{other:?}"),
                    });
                }
            }
        }

        let after = Facts::read(&self.opened.paths)?;
        let (parked, (cleanup_runs, inbox_rows_trimmed)) = self.parked_and_cleanup().await?;
        let accounting = Accounting::of(plan, &after, &parked);
        let latency = produced.latency.summary();
        let per_sec = |count: u64, elapsed: Duration| {
            let seconds = elapsed.as_secs_f64();
            if seconds > 0.0 {
                (count as f64 / seconds).round()
            } else {
                0.0
            }
        };
        let by_target = |counts: &std::collections::HashMap<&'static str, u64>| {
            TARGETS
                .iter()
                .map(|target| (*target, counts.get(target).copied().unwrap_or(0)))
                .collect()
        };
        Ok(Summary {
            run: plan.run,
            resumed: self.opened.resumed,
            resumed_accepted,
            resumed_owed,
            messages: plan.messages,
            shards: plan.shards,
            accepted: accounting.accepted,
            delivered: by_target(&accounting.delivered),
            dead_lettered: accounting.dead_lettered.values().sum(),
            dead_lettered_by_target: by_target(&accounting.dead_lettered),
            parked: accounting.parked,
            lost: accounting.lost,
            lost_examples: accounting
                .lost_examples
                .iter()
                .map(|(message, target)| summary::LostDelivery {
                    message: message.clone(),
                    target,
                })
                .collect(),
            owed: self.owed().await?,
            redelivered: accounting.redelivered,
            retries: after.retries,
            deliveries_per_sec: per_sec(
                after.deliveries().saturating_sub(self.before.deliveries()),
                delivering,
            ),
            accepted_per_sec: per_sec(produced.messages, producing),
            enqueue_p50_ms: latency.map(|l| round_ms(l.p50_us)),
            enqueue_p99_ms: latency.map(|l| round_ms(l.p99_us)),
            enqueue_batch: plan.batch_size,
            digests_completed,
            cleanup_runs,
            inbox_rows_trimmed,
            elapsed_s: (self.started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
            data_dir: data_dir.display().to_string(),
        })
    }

    /// Every shard's parked (message, target) pairs, and the cleanup alarm's
    /// runs and trimmed rows summed over the shards.
    async fn parked_and_cleanup(
        &self,
    ) -> Result<(HashSet<(String, String)>, (u64, u64)), DemoError> {
        let mut parked = HashSet::new();
        let (mut cleanup_runs, mut inbox_rows_trimmed) = (0, 0);
        for stub in &self.shards {
            let (entries, cleanup) = stub
                .call(|mailbox: Rc<Mailbox>| async move {
                    Ok::<_, DemoError>((mailbox.parked()?, mailbox.cleanup_stats()?))
                })
                .await??;
            parked.extend(entries);
            cleanup_runs += cleanup.runs;
            inbox_rows_trimmed += cleanup.trimmed;
        }
        Ok((parked, (cleanup_runs, inbox_rows_trimmed)))
    }

    /// Messages the run's journal said were accepted when this invocation
    /// started.
    fn accepted_before(&self) -> u64 {
        let plan = &self.opened.plan;
        self.before
            .accepted_batches
            .iter()
            .map(|batch| plan.batch_range(*batch).count() as u64)
            .sum()
    }

    /// Deliveries every shard of the plan still owes.
    async fn owed(&self) -> Result<u64, DemoError> {
        let mut owed = 0;
        for stub in &self.shards {
            owed += stub
                .call(|mailbox: Rc<Mailbox>| async move { mailbox.owed() })
                .await??;
        }
        Ok(owed)
    }

    /// Waits until no shard owes a delivery; fails when the owed count
    /// stops going down for [`STALL_TIMEOUT`].
    async fn drain(&self) -> Result<(), DemoError> {
        let mut least = u64::MAX;
        let mut progressed = Instant::now();
        loop {
            let owed = self.owed().await?;
            if owed == 0 {
                return Ok(());
            }
            if owed < least {
                least = owed;
                progressed = Instant::now();
            } else if progressed.elapsed() > STALL_TIMEOUT {
                return Err(DemoError::Stalled {
                    owed,
                    waited_s: STALL_TIMEOUT.as_secs(),
                });
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
    }

    /// The error an interrupted invocation returns: what is accepted (from
    /// the journal) and still owed, and how to finish it.
    async fn interrupted(&self) -> DemoError {
        let plan = &self.opened.plan;
        let accepted = Facts::read(&self.opened.paths)
            .map(|facts| {
                facts
                    .accepted_batches
                    .iter()
                    .map(|batch| plan.batch_range(*batch).count() as u64)
                    .sum::<u64>()
            })
            .map_or_else(|_| "?".to_owned(), grouped);
        let owed = self.owed().await.map_or_else(|_| "?".to_owned(), grouped);
        DemoError::Interrupted {
            run: plan.run,
            accepted,
            messages: grouped(plan.messages),
            owed,
        }
    }
}

fn round_ms(us: f64) -> f64 {
    (us / 10.0).round() / 100.0
}
