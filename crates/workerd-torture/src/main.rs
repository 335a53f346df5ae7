//! The workerd kill torture's runner.
//!
//! `workerd-torture WORKERD BUILD_DIR [--kills N] [--seed S] [--json]`
//! starts the real `workerd` on 127.0.0.1 with the torture worker in
//! `BUILD_DIR` (made by `scripts/build-worker`) and a fresh local disk
//! directory for Durable Object storage. Then, N times: a producer thread
//! sends a seeded mix of commands (operations, named alarms, fanout
//! batches, log appends and consumes) to [`producer::OBJECTS`] objects
//! while their handlers, retries and recurring ticks run inside workerd,
//! and at a seeded moment the runner SIGKILLs workerd and starts it again
//! on the same storage directory. A final life resends what was left in
//! doubt and drains with no kill, workerd is stopped, and
//! [`check`] judges the databases it left against what the runner saw
//! acknowledged. Exits non-zero on any violation and on any start of
//! workerd that fails.

// The launcher the conformance runner uses; its `request` helper is not
// needed here (the producer has its own client, shared by threads).
#[allow(dead_code)] // only part of the shared launcher is used here
#[path = "../../conformance-worker/src/workerd.rs"]
mod workerd;

mod check;
mod producer;
#[allow(dead_code)] // shared with the worker, which uses the rest of it
#[path = "protocol.rs"]
mod protocol;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Value, json};

use producer::{Answer, Client, OBJECTS, PRODUCERS, Producer, Shared, lock, object_name};
use protocol::{Command, LOG_PAGE_RECORDS};
use workerd::{Namespace, Workerd};

/// The worker's Durable Object class and binding.
const NAMESPACE: Namespace = Namespace {
    class: "TortureObject",
    binding: "TORTURE",
};

/// When in a life the kill comes, after its objects answered: long enough
/// for retries (100 ms apart) and recurring ticks to run within a life,
/// short enough that 10 kills take well under three minutes.
const KILL_AFTER_MS: std::ops::Range<u64> = 500..4_000;

/// How long the final life produces before it drains.
const FINAL_PRODUCTION: Duration = Duration::from_secs(2);

/// How long the drain may take: every operation, one-shot alarm and fanout
/// delivery ended and the log consumed to its end. Generous, since CI
/// shares two cores with builds.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(90);

/// How long the objects of a new life may take to answer their first
/// command (workerd listens before the worker is compiled).
const HELLO_TIMEOUT: Duration = Duration::from_secs(60);

struct Args {
    workerd: String,
    build: String,
    kills: u32,
    seed: u64,
    json: bool,
}

fn parse_args() -> Result<Args, String> {
    const USAGE: &str = "usage: workerd-torture WORKERD BUILD_DIR [--kills N] [--seed S] [--json]";
    let mut positional = Vec::new();
    let (mut kills, mut seed, mut json) = (10, None, false);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--kills" => {
                kills = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .ok_or("--kills takes a number")?;
            }
            "--seed" => {
                seed = Some(
                    args.next()
                        .and_then(|n| n.parse().ok())
                        .ok_or("--seed takes a number")?,
                );
            }
            "--json" => json = true,
            _ if arg.starts_with("--") => return Err(format!("unknown option {arg}\n{USAGE}")),
            _ => positional.push(arg),
        }
    }
    let [workerd, build] = <[String; 2]>::try_from(positional).map_err(|_| USAGE.to_owned())?;
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs())
    });
    Ok(Args {
        workerd,
        build,
        kills,
        seed,
        json,
    })
}

/// Tells every object its name (and registers its recurring schedules),
/// retrying until each answers: the proof that a new life really serves.
fn hello(client: &Client) -> Result<(), String> {
    let deadline = Instant::now() + HELLO_TIMEOUT;
    for n in 0..OBJECTS {
        let name = object_name(n);
        let command = Command::Hello { name: name.clone() };
        loop {
            match client.send(&name, &command) {
                Answer::Ok(_) => break,
                Answer::Failed(error) if Instant::now() > deadline => {
                    return Err(format!("{name} does not answer after a start: {error}"));
                }
                Answer::Failed(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }
    Ok(())
}

/// Runs [`PRODUCERS`] producer threads while `during` runs, then stops and
/// joins them.
fn produce<T>(
    client: &Client,
    shared: &Arc<Mutex<Shared>>,
    rng: &mut StdRng,
    during: impl FnOnce(&mut StdRng) -> T,
) -> Result<T, String> {
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..PRODUCERS)
        .map(|lane| {
            let producer = Producer::new(
                client.clone(),
                Arc::clone(shared),
                Arc::clone(&stop),
                rng.random(),
                lane,
            );
            std::thread::spawn(move || producer.run())
        })
        .collect();
    let result = during(rng);
    stop.store(true, Ordering::SeqCst);
    for thread in threads {
        thread
            .join()
            .map_err(|_| "a producer thread panicked".to_owned())?;
    }
    Ok(result)
}

/// One life that ends in a kill: produce until the seeded moment, SIGKILL
/// workerd (the producers' requests in flight fail and stay in doubt),
/// then start it again on the same storage.
fn killed_life(
    workerd: &Workerd,
    client: &Client,
    shared: &Arc<Mutex<Shared>>,
    rng: &mut StdRng,
) -> Result<(), String> {
    produce(client, shared, rng, |rng| {
        std::thread::sleep(Duration::from_millis(rng.random_range(KILL_AFTER_MS)));
        workerd.kill()
    })??;
    workerd.start()
}

/// What each object still owes, from its own answer, by object number.
fn pending(client: &Client) -> Result<BTreeMap<u64, Value>, String> {
    let mut all = BTreeMap::new();
    for n in 0..OBJECTS {
        let name = object_name(n);
        match client.send(&name, &Command::Pending) {
            Answer::Ok(value) => {
                all.insert(n, value);
            }
            Answer::Failed(error) => return Err(format!("{name}: pending: {error}")),
        }
    }
    Ok(all)
}

fn settled(left: &Value) -> bool {
    let field = |name: &str| left.get(name).and_then(Value::as_u64).unwrap_or(u64::MAX);
    field("ops") == 0
        && field("alarms") == 0
        && field("owed") == 0
        && field("cursor") == field("log_end")
}

/// The final life: produce a little more, resend everything left in doubt
/// until it is acknowledged, then wait until nothing is owed, consuming the
/// log to its end. Returns what each object owes at the end of the drain.
fn final_life(
    client: &Client,
    shared: &Arc<Mutex<Shared>>,
    rng: &mut StdRng,
) -> Result<BTreeMap<String, Value>, String> {
    produce(client, shared, rng, |_| {
        std::thread::sleep(FINAL_PRODUCTION)
    })?;
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    let stop = Arc::new(AtomicBool::new(false));
    let resender = Producer::new(client.clone(), Arc::clone(shared), stop, 0, 0);
    loop {
        let next = lock(shared).resend.pop_front();
        let Some((object, command)) = next else { break };
        if !resender.send(object, command) && Instant::now() > deadline {
            return Err("commands left in doubt are still refused after the drain timeout".into());
        }
    }
    loop {
        let left = pending(client)?;
        let mut all_settled = true;
        for (&object, value) in &left {
            if !settled(value) {
                all_settled = false;
                let lag = value.get("log_end").and_then(Value::as_u64).unwrap_or(0)
                    > value.get("cursor").and_then(Value::as_u64).unwrap_or(0);
                if lag {
                    resender.send(object, Command::LogConsume);
                }
            }
        }
        if all_settled || Instant::now() > deadline {
            return Ok(left
                .into_iter()
                .map(|(object, value)| (object_name(object), value))
                .collect());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

struct Run {
    kills: u32,
    failed_start: Option<String>,
    owed: BTreeMap<String, Value>,
    verdict: check::Verdict,
    shared: Arc<Mutex<Shared>>,
}

fn run(args: &Args) -> Result<Run, String> {
    let workerd = Workerd::launch(Path::new(&args.workerd), Path::new(&args.build), &NAMESPACE)?;
    let client = Client::new(workerd.port());
    let shared = Arc::new(Mutex::new(Shared::default()));
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut kills = 0;
    let mut failed_start = None;
    let mut owed = BTreeMap::new();
    let mut life = 0;
    loop {
        if let Err(error) = hello(&client) {
            failed_start = Some(format!("life {life}: {error}"));
            break;
        }
        if kills == args.kills {
            match final_life(&client, &shared, &mut rng) {
                Ok(left) => owed = left,
                Err(error) => failed_start = Some(format!("final life: {error}")),
            }
            break;
        }
        let killed = killed_life(&workerd, &client, &shared, &mut rng);
        kills += 1;
        if let Err(error) = killed {
            failed_start = Some(format!("restart after kill {kills}: {error}"));
            break;
        }
        life += 1;
        // Progress goes to stderr, so `--json` keeps stdout one object.
        if kills % 10 == 0 {
            eprintln!("workerd-torture: {kills} kills");
        }
    }
    workerd.kill()?;
    if failed_start.is_some() {
        eprintln!("--- last lines of the workerd log ---");
        for line in workerd.log_tail(40) {
            eprintln!("{line}");
        }
    }
    let copies = tempfile::tempdir().map_err(|e| e.to_string())?;
    let verdict = check::check(
        &workerd.storage_dir(),
        copies.path(),
        &lock(&shared).acks,
        &owed,
    );
    Ok(Run {
        kills,
        failed_start,
        owed,
        verdict,
        shared,
    })
}

fn report(args: &Args, run: &Run, elapsed: Duration) -> Value {
    let verdict = &run.verdict;
    let shared = lock(&run.shared);
    let failed = run.failed_start.is_some() || verdict.violations() > 0;
    json!({
        "verdict": if failed { "fail" } else { "pass" },
        "seed": args.seed,
        "kills": run.kills,
        "failed_start": run.failed_start,
        "objects": verdict.objects.len(),
        "accepted": verdict.sum(|t| t.accepted),
        "completed": verdict.sum(|t| t.completed),
        "lost": verdict.sum(|t| t.lost),
        "over_attempts": verdict.sum(|t| t.over_attempts),
        "stale_settlements": verdict.sum(|t| t.stale_settlements),
        "corrupt": verdict.sum(|t| t.corrupt),
        "violations": verdict.violations(),
        "seconds": (elapsed.as_secs_f64() * 10.0).round() / 10.0,
        "answered": shared.acks.answered,
        "in_doubt": shared.acks.in_doubt,
        "log_page_records": LOG_PAGE_RECORDS,
        "owed_at_end": run.owed,
        "capabilities": verdict
            .tallies
            .iter()
            .map(|(name, tally)| (name.to_string(), tally.to_json()))
            .collect::<serde_json::Map<_, _>>(),
    })
}

fn render(report: &Value) -> String {
    let mut text = String::new();
    if let Some(capabilities) = report["capabilities"].as_object() {
        text.push_str("capability   accepted completed  lost  over  stale corrupt other\n");
        for (name, tally) in capabilities {
            let n = |field: &str| tally[field].as_u64().unwrap_or(0);
            let other: u64 = tally["other_violations"]
                .as_object()
                .map_or(0, |o| o.values().filter_map(Value::as_u64).sum());
            text.push_str(&format!(
                "{name:<12} {:>8} {:>9} {:>5} {:>5} {:>6} {:>7} {:>5}\n",
                n("accepted"),
                n("completed"),
                n("lost"),
                n("over_attempts"),
                n("stale_settlements"),
                n("corrupt"),
                other
            ));
            for example in tally["examples"].as_array().into_iter().flatten() {
                text.push_str(&format!(
                    "  {name}: {}\n",
                    example.as_str().unwrap_or_default()
                ));
            }
        }
    }
    if let Some(error) = report["failed_start"].as_str() {
        text.push_str(&format!("FAILED START: {error}\n"));
    }
    text.push_str(&format!(
        "{}: {} kills, {} accepted, {} lost, {} over attempts, {} corrupt, {} violations (seed {}, {:.1} s)",
        if report["verdict"] == "pass" { "PASS" } else { "FAIL" },
        report["kills"],
        report["accepted"],
        report["lost"],
        report["over_attempts"],
        report["corrupt"],
        report["violations"],
        report["seed"],
        report["seconds"].as_f64().unwrap_or(0.0),
    ));
    text
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(error) => {
            eprintln!("workerd-torture: {error}");
            return ExitCode::from(2);
        }
    };
    let started = Instant::now();
    let run = match run(&args) {
        Ok(run) => run,
        Err(error) => {
            eprintln!("workerd-torture: {error}");
            return ExitCode::FAILURE;
        }
    };
    let report = report(&args, &run, started.elapsed());
    if args.json {
        println!("{report}");
    } else {
        println!("{}", render(&report));
    }
    if report["verdict"] == "pass" {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
