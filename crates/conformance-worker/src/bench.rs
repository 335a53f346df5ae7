//! `workerd-bench WORKERD BENCH_BUILD [MAILBOX_BUILD] [--messages N]
//! [--operations N] [--mails N] [--stamps N]`: durability's speed under a
//! local workerd. Prints one JSON object.
//!
//! **Inside one object** (the shape the reference library is measured in;
//! the benchmark worker crates/bench-worker, built into `BENCH_BUILD`): one
//! request per scenario starts a loop inside a fresh object and answers
//! with the object's own timings and the SQL statements the adapter counted:
//!
//! - `fanout_batch_100`, `fanout_batch_10`: `--messages` (default 5,000)
//!   enqueued in batches of 100 to two targets that ack on return, delivery
//!   batch 100 and 10; `deliveries_per_sec` from the first enqueue until
//!   every delivery is acked;
//! - `operations_1_caller`, `operations_16_callers`: `--operations`
//!   (default 2,000) no-op operations, each started and awaited, from one
//!   loop and from 16 concurrent loops inside the object (one request);
//!   `ops_per_sec`;
//! - each with `floor_per_sec`: the same number of items, one SQL `INSERT`
//!   per item, in the same object and request; and the ratios to the floor
//!   and to the reference library's figures;
//! - before them, unreported, a warm-up fanout and operations run in
//!   objects of their own, so the first scenario does not also pay for the
//!   wasm's optimizing compile;
//! - `profile`: the fanout again with its targets paused while enqueueing
//!   (acceptance and delivery timed apart), and the cost of one statement,
//!   one JavaScript call and one JSON encode in this runtime.
//!
//! **From outside** (when `MAILBOX_BUILD` is given: the example mailbox
//! worker, examples/cloudflare-mailbox, over HTTP):
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
//! Nothing here is a test: the numbers move with the machine's load.

#[path = "workerd.rs"]
mod workerd;

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use workerd::{Namespace, Workerd};

const MAILBOX: Namespace = Namespace {
    class: "MailboxObject",
    binding: "MAILBOX",
};
const BENCH: Namespace = Namespace {
    class: "BenchObject",
    binding: "BENCH",
};
/// The reference library's figures in this shape, on this kind of machine
/// (deliveries/s at delivery batch 100 and 10, operations/s from one caller).
const REFERENCE_FANOUT_BATCH_100_PER_S: f64 = 4_200.0;
const REFERENCE_FANOUT_BATCH_10_PER_S: f64 = 800.0;
const REFERENCE_OPERATIONS_PER_S: f64 = 350.0;
/// Concurrent callers of the second operations scenario.
const CONCURRENT_CALLERS: u64 = 16;
/// How long one in-object scenario may run.
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(900);
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

fn request_floor(workerd: &Workerd) -> Result<f64, String> {
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

/// Runs one scenario in the object `object` and returns its report. Its own
/// agent: a scenario runs far longer than the shared request timeout.
fn scenario(workerd: &Workerd, object: &str, body: &Value) -> Result<Value, String> {
    let url = format!("http://127.0.0.1:{}/run/{object}", workerd.port());
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(SCENARIO_TIMEOUT))
        .build()
        .into();
    let mut response = agent
        .post(&url)
        .header("content-type", "application/json")
        .send(body.to_string())
        .map_err(|e| format!("{url}: {e}"))?;
    let status = response.status().as_u16();
    let text = response
        .body_mut()
        .read_to_string()
        .map_err(|e| e.to_string())?;
    if status >= 300 {
        return Err(format!("{object}: HTTP {status}: {text}"));
    }
    serde_json::from_str(&text).map_err(|_| format!("{object}: HTTP {status}: {text}"))
}

/// Adds the ratios to the floor and to the reference to a scenario's report.
fn rated(mut report: Value, field: &str, reference: Option<f64>) -> Value {
    let per_s = report[field].as_f64();
    let floor = report["floor_per_sec"].as_f64();
    report["ratio_to_floor"] = json!(per_s.zip(floor).map(|(v, f)| v / f));
    report["reference_per_sec"] = json!(reference);
    report["ratio_to_reference"] = json!(per_s.zip(reference).map(|(v, r)| v / r));
    report
}

fn inside(workerd: &Workerd, messages: usize, operations: usize) -> Result<Value, String> {
    let fanout = |object: &str, delivery_batch: usize, paused: bool| {
        scenario(
            workerd,
            object,
            &json!({
                "scenario": "fanout",
                "messages": messages,
                "enqueue_batch": BATCH,
                "delivery_batch": delivery_batch,
                "paused_enqueue": paused,
            }),
        )
    };
    let operations_run = |object: &str, callers: u64| {
        scenario(
            workerd,
            object,
            &json!({ "scenario": "operations", "operations": operations, "callers": callers }),
        )
    };
    // Not reported: compiles the worker's hot code (wasm tiers up from its
    // baseline compiler while it runs) before the first measured loop, so
    // the first scenario does not pay for the others.
    fanout("warm-up-fanout", 100, false)?;
    operations_run("warm-up-operations", 1)?;
    let batch_100 = rated(
        fanout("fanout-100", 100, false)?,
        "deliveries_per_sec",
        Some(REFERENCE_FANOUT_BATCH_100_PER_S),
    );
    let batch_10 = rated(
        fanout("fanout-10", 10, false)?,
        "deliveries_per_sec",
        Some(REFERENCE_FANOUT_BATCH_10_PER_S),
    );
    let one = rated(
        operations_run("operations-1", 1)?,
        "ops_per_sec",
        Some(REFERENCE_OPERATIONS_PER_S),
    );
    let many = rated(
        operations_run("operations-16", CONCURRENT_CALLERS)?,
        "ops_per_sec",
        None,
    );
    let split_100 = fanout("fanout-100-split", 100, true)?;
    let split_10 = fanout("fanout-10-split", 10, true)?;
    let calibrate = scenario(
        workerd,
        "calibrate",
        &json!({ "scenario": "calibrate", "inserts": 10_000, "crossings": 200_000 }),
    )?;
    Ok(json!({
        "fanout_batch_100": batch_100,
        "fanout_batch_10": batch_10,
        "operations_1_caller": one,
        "operations_16_callers": many,
        "statements_per_delivery": {
            "batch_100": batch_100["per_delivery"]["statements"],
            "batch_10": batch_10["per_delivery"]["statements"],
        },
        "statements_per_operation": {
            "1_caller": one["per_operation"]["statements"],
            "16_callers": many["per_operation"]["statements"],
        },
        "profile": {
            "fanout_batch_100_paused_enqueue": split_100,
            "fanout_batch_10_paused_enqueue": split_10,
            "calibrate": calibrate,
        },
    }))
}

fn outside(workerd: &Workerd, mails: usize, stamps: usize) -> Result<Value, String> {
    let floor = request_floor(workerd)?;
    let fanout = fanout(workerd, mails)?;
    let operations = operations(workerd, stamps)?;
    let ratio = |per_s: &Value| per_s.as_f64().map(|v| v / floor);
    Ok(json!({
        "floor": { "what": "sequential GET /stats round trips per second", "requests_per_s": floor },
        "ratios_to_floor": {
            "fanout_deliveries": ratio(&fanout["deliveries_per_s"]),
            "operations": ratio(&operations["operations_per_s"]),
        },
        "fanout": fanout,
        "operations": operations,
    }))
}

/// Starts workerd with the worker in `build`, runs `measure` against it,
/// and stops it; on failure the log's tail goes to stderr.
fn measured(
    binary: &str,
    build: &str,
    namespace: &Namespace,
    measure: impl FnOnce(&Workerd) -> Result<Value, String>,
) -> Result<Value, String> {
    let workerd = Workerd::launch(Path::new(binary), Path::new(build), namespace)?;
    eprintln!(
        "workerd on 127.0.0.1:{} ({}), storage in {}",
        workerd.port(),
        namespace.class,
        workerd.storage_dir().display()
    );
    let result = measure(&workerd);
    if result.is_err() {
        for line in workerd.log_tail(40) {
            eprintln!("{line}");
        }
    }
    workerd.kill()?;
    result
}

fn run() -> Result<Value, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(binary), Some(bench_build)) = (args.first(), args.get(1)) else {
        return Err("usage: workerd-bench WORKERD BENCH_BUILD [MAILBOX_BUILD] \
             [--messages N] [--operations N] [--mails N] [--stamps N]"
            .into());
    };
    let mailbox_build = args.get(2).filter(|a| !a.starts_with("--"));
    let messages = number_flag(&args, "--messages", 5_000)?;
    let operations = number_flag(&args, "--operations", 2_000)?;
    let mails = number_flag(&args, "--mails", 5_000)?;
    let stamps = number_flag(&args, "--stamps", 2_000)?;
    let started = Instant::now();
    let mut report = measured(binary, bench_build, &BENCH, |workerd| {
        inside(workerd, messages, operations)
    })?;
    report["benchmark"] = json!("workerd-inside-object");
    if let Some(build) = mailbox_build {
        report["outside"] = measured(binary, build, &MAILBOX, |workerd| {
            outside(workerd, mails, stamps)
        })?;
    }
    report["wall_seconds"] = json!(started.elapsed().as_secs_f64());
    Ok(report)
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
