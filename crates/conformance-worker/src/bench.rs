//! `workerd-bench WORKERD BUILD_DIR [--mails N] [--stamps N]`: the example
//! mailbox worker (examples/cloudflare-mailbox, built into `BUILD_DIR`)
//! under a local workerd, measured from outside over HTTP. Prints one JSON
//! object:
//!
//! - `floor`: sequential `GET /stats` round trips through the front Worker
//!   to one object, per second: the cost of a request, measured in the
//!   same run as the figures it divides;
//! - `fanout`: `--mails` mails pushed in batches of 100 through the routing
//!   client, each delivered to two targets; deliveries per second from the
//!   first push until every shard owes nothing;
//! - `operations`: `--stamps` durable operations registered on one object
//!   in batches of 100; operations per second from the first registration
//!   until every one has run.
//!
//! Each figure comes with its ratio to the floor. Nothing here is a test:
//! the numbers move with the machine's load.

#[path = "workerd.rs"]
mod workerd;

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use workerd::{Namespace, Workerd};

const NAMESPACE: Namespace = Namespace {
    class: "MailboxObject",
    binding: "MAILBOX",
};
/// Mails or operations per request.
const BATCH: usize = 100;
/// How long the floor is measured.
const FLOOR_TIME: Duration = Duration::from_secs(3);
/// Shards whose stats are summed: more than the routing client widens to
/// in a run of this size.
const SHARDS_POLLED: u64 = 16;
/// How long draining may take before the run is declared stuck.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(600);

fn post(workerd: &Workerd, path: &str, body: &Value) -> Result<Value, String> {
    let (status, answer) = workerd.request(path, Some(body.to_string()))?;
    if status >= 300 {
        return Err(format!("POST {path}: HTTP {status}: {answer}"));
    }
    Ok(answer)
}

fn stats(workerd: &Workerd) -> Result<Vec<Value>, String> {
    let (status, answer) = workerd.request(&format!("/stats?shards={SHARDS_POLLED}"), None)?;
    match answer.as_array() {
        Some(all) if status < 300 => Ok(all.iter().map(|s| s["stats"].clone()).collect()),
        _ => Err(format!("GET /stats: HTTP {status}: {answer}")),
    }
}

fn sum(all: &[Value], field: &str) -> u64 {
    all.iter().filter_map(|s| s[field].as_u64()).sum()
}

/// Polls until `done` accepts the summed stats.
fn drain(workerd: &Workerd, done: impl Fn(&[Value]) -> bool) -> Result<(), String> {
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    loop {
        if done(&stats(workerd)?) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("the work did not drain in time".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn floor(workerd: &Workerd) -> Result<f64, String> {
    let started = Instant::now();
    let mut requests = 0_u32;
    while started.elapsed() < FLOOR_TIME {
        let (status, answer) = workerd.request("/stats?shards=1", None)?;
        if status >= 300 {
            return Err(format!("floor: HTTP {status}: {answer}"));
        }
        requests += 1;
    }
    Ok(f64::from(requests) / started.elapsed().as_secs_f64())
}

fn fanout(workerd: &Workerd, mails: usize) -> Result<Value, String> {
    let started = Instant::now();
    let mut rejected = 0_u64;
    for batch in 0..mails.div_ceil(BATCH) {
        let body: Vec<Value> = (batch * BATCH..((batch + 1) * BATCH).min(mails))
            .map(|n| {
                json!({
                    "id": format!("mail-{n}"),
                    "customer": format!("customer-{}", n % 97),
                    // One in a hundred has no mailbox: dead-lettered.
                    "to": if n % 100 == 99 { format!("user{n}@example.invalid") } else { format!("user{n}@example.com") },
                    "subject": format!("mail {n}"),
                })
            })
            .collect();
        let answer = post(workerd, "/mail", &json!(body))?;
        if answer["success"] != true {
            rejected += 1;
        }
    }
    let accepted_in = started.elapsed().as_secs_f64();
    drain(workerd, |all| {
        sum(all, "owed") == 0
            && all
                .iter()
                .filter_map(|s| s["archived"]["nextOffset"].as_u64())
                .sum::<u64>()
                >= mails as u64
    })?;
    let seconds = started.elapsed().as_secs_f64();
    let all = stats(workerd)?;
    let deliveries = 2 * mails;
    Ok(json!({
        "mails": mails,
        "deliveries": deliveries,
        "rejected_batches": rejected,
        "shards_used": all.iter().filter(|s| s["archived"]["nextOffset"].as_u64().unwrap_or(0) > 0).count(),
        "inbox": sum(&all, "inbox"),
        "dead_letters": sum(&all, "dead_letters"),
        "accept_seconds": accepted_in,
        "seconds": seconds,
        "deliveries_per_s": deliveries as f64 / seconds,
    }))
}

fn operations(workerd: &Workerd, stamps: usize) -> Result<Value, String> {
    let started = Instant::now();
    for batch in 0..stamps.div_ceil(BATCH) {
        let ids: Vec<String> = (batch * BATCH..((batch + 1) * BATCH).min(stamps))
            .map(|n| format!("stamp-{n}"))
            .collect();
        post(workerd, "/stamp?shard=0", &json!({ "ids": ids }))?;
    }
    let registered_in = started.elapsed().as_secs_f64();
    drain(workerd, |all| sum(all, "stamps") >= stamps as u64)?;
    let seconds = started.elapsed().as_secs_f64();
    Ok(json!({
        "operations": stamps,
        "register_seconds": registered_in,
        "seconds": seconds,
        "operations_per_s": stamps as f64 / seconds,
    }))
}

fn number_flag(args: &[String], name: &str, default: usize) -> Result<usize, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("{name} takes a positive number")),
    }
}

fn run() -> Result<Value, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(binary), Some(build)) = (args.first(), args.get(1)) else {
        return Err("usage: workerd-bench WORKERD BUILD_DIR [--mails N] [--stamps N]".into());
    };
    let mails = number_flag(&args, "--mails", 5_000)?;
    let stamps = number_flag(&args, "--stamps", 2_000)?;
    let workerd = Workerd::launch(Path::new(binary), Path::new(build), &NAMESPACE)?;
    eprintln!(
        "workerd on 127.0.0.1:{}, storage in {}",
        workerd.port(),
        workerd.storage_dir().display()
    );
    let measured = floor(&workerd).and_then(|floor| {
        Ok((
            floor,
            fanout(&workerd, mails)?,
            operations(&workerd, stamps)?,
        ))
    });
    let (floor, fanout, operations) = match measured {
        Ok(measured) => measured,
        Err(error) => {
            for line in workerd.log_tail(40) {
                eprintln!("{line}");
            }
            return Err(error);
        }
    };
    workerd.kill()?;
    let ratio = |per_s: &Value| per_s.as_f64().map(|v| v / floor);
    Ok(json!({
        "benchmark": "workerd-mailbox",
        "floor": { "what": "sequential GET /stats round trips per second", "requests_per_s": floor },
        "fanout": fanout,
        "operations": operations,
        "ratios_to_floor": {
            "fanout_deliveries": ratio(&fanout["deliveries_per_s"]),
            "operations": ratio(&operations["operations_per_s"]),
        },
    }))
}

fn main() -> ExitCode {
    match run() {
        Ok(report) => {
            println!("{report:#}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("workerd-bench: {error}");
            ExitCode::FAILURE
        }
    }
}
