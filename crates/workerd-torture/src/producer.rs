//! The runner's producer: a thread that sends a seeded mix of commands to
//! the objects while workerd lives, and the runner's own record of what
//! workerd acknowledged ([`Acks`]).
//!
//! Only an HTTP 200 whose body is `{"ok": ..}` counts as acknowledged.
//! Anything else (the connection dropped by a kill, a timeout, an error
//! answer) leaves the item in doubt: its command is sent again, with the
//! same ids and keys, at the start of the next life, which is safe since
//! every command is idempotent by id or key (a named alarm is not re-sent:
//! a later schedule of its name replaces it anyway). The producer never
//! reads what the worker stored; the checker compares the two at the end.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::Read as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::Value;

use crate::protocol::{ALARM_NAMES, Command};

/// How many objects the workload spreads over.
pub const OBJECTS: u64 = 4;

/// Producer threads per life. Each owns the objects `n` with
/// `n % PRODUCERS == lane`, so the commands to one object stay in the order
/// they were made (a named alarm's times grow in the order they arrive),
/// while two objects are called at once.
pub const PRODUCERS: u64 = 2;

/// The longest pause between two commands of the producer.
const PACE_MAX_MS: u64 = 15;

/// How long one request may take; workerd answers in milliseconds unless
/// it is being killed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// The name of object `n` (modulo [`OBJECTS`]).
pub fn object_name(n: u64) -> String {
    format!("t-{}", n % OBJECTS)
}

/// Everything workerd acknowledged, per object name.
#[derive(Debug, Default)]
pub struct Acks {
    /// Operation ids whose start was acknowledged.
    pub ops: BTreeMap<String, BTreeSet<String>>,
    /// Per alarm name: the time of its last acknowledged schedule (times
    /// only grow per name, see [`alarm_time`]) and how many schedules of
    /// it were acknowledged.
    pub alarms: BTreeMap<String, BTreeMap<String, (i64, u64)>>,
    /// Fanout message ids whose batch was acknowledged.
    pub messages: BTreeMap<String, BTreeSet<String>>,
    /// Log keys and the offset their append answered.
    pub records: BTreeMap<String, BTreeMap<String, u64>>,
    /// A key answered with two different offsets (object, key, offsets).
    pub moved_keys: Vec<(String, String, u64, u64)>,
    /// The highest cursor a consume acknowledged as committed.
    pub commits: BTreeMap<String, u64>,
    /// Commands answered with 200 and `ok`, per command kind.
    pub answered: BTreeMap<&'static str, u64>,
    /// Commands left in doubt (no acknowledgement), per command kind.
    pub in_doubt: BTreeMap<&'static str, u64>,
}

/// State shared by the lives' producer threads and the runner.
#[derive(Debug, Default)]
pub struct Shared {
    pub acks: Acks,
    /// Commands to send again first in the next life, by object number.
    pub resend: VecDeque<(u64, Command)>,
    /// The next item number (ids and keys are made from it).
    next_item: u64,
    /// Per (object number, alarm name): the latest time ever sent.
    alarm_sent: BTreeMap<(u64, String), i64>,
}

/// Locks `shared`; a poisoned lock (a producer thread panicked) still holds
/// consistent data, since every update is one statement.
pub fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The wall clock in epoch ms, the clock workerd's objects schedule by
/// (same machine).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// How a request to workerd ended.
pub enum Answer {
    /// HTTP 200 with `{"ok": value}`.
    Ok(Value),
    /// Anything else, described.
    Failed(String),
}

/// HTTP to one workerd port. Cloning is cheap (ureq's agent is shared).
#[derive(Clone)]
pub struct Client {
    port: u16,
    agent: ureq::Agent,
}

impl Client {
    pub fn new(port: u16) -> Client {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(REQUEST_TIMEOUT))
            .build()
            .into();
        Client { port, agent }
    }

    /// Sends `command` to the object named `object`.
    pub fn send(&self, object: &str, command: &Command) -> Answer {
        let url = format!("http://127.0.0.1:{}/object/{object}", self.port);
        let body = match serde_json::to_string(command) {
            Ok(body) => body,
            Err(error) => return Answer::Failed(error.to_string()),
        };
        let mut response = match self
            .agent
            .post(&url)
            .header("content-type", "application/json")
            .send(body)
        {
            Ok(response) => response,
            Err(error) => return Answer::Failed(format!("{url}: {error}")),
        };
        let status = response.status().as_u16();
        let mut text = String::new();
        if let Err(error) = response.body_mut().as_reader().read_to_string(&mut text) {
            return Answer::Failed(format!("{url}: reading the answer: {error}"));
        }
        match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(mut answer)) if status == 200 => match answer.remove("ok") {
                Some(value) => Answer::Ok(value),
                None => Answer::Failed(format!("HTTP 200 without ok: {text}")),
            },
            _ => Answer::Failed(format!("HTTP {status}: {text}")),
        }
    }
}

/// One life's producer.
pub struct Producer {
    pub client: Client,
    pub shared: Arc<Mutex<Shared>>,
    /// Set by the runner when it kills workerd (or ends production).
    pub stop: Arc<AtomicBool>,
    pub rng: StdRng,
    /// Which objects this producer owns (see [`PRODUCERS`]).
    lane: u64,
}

impl Producer {
    pub fn new(
        client: Client,
        shared: Arc<Mutex<Shared>>,
        stop: Arc<AtomicBool>,
        seed: u64,
        lane: u64,
    ) -> Self {
        Producer {
            client,
            shared,
            stop,
            rng: StdRng::seed_from_u64(seed),
            lane: lane % PRODUCERS,
        }
    }

    /// Sends the commands to its objects left in doubt by the life before,
    /// then new ones, until stopped. A command that fails goes back to the
    /// resend queue.
    pub fn run(mut self) {
        loop {
            let next = {
                let mut shared = lock(&self.shared);
                let mine = shared
                    .resend
                    .iter()
                    .position(|(object, _)| object % PRODUCERS == self.lane);
                mine.and_then(|index| shared.resend.remove(index))
            };
            let Some((object, command)) = next else { break };
            if self.stopped() || !self.send(object, command) {
                return;
            }
        }
        while !self.stopped() {
            let (object, command) = self.next_command();
            if !self.send(object, command) {
                return;
            }
            let pause = self.rng.random_range(0..=PACE_MAX_MS);
            std::thread::sleep(Duration::from_millis(pause));
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Sends one command and records its acknowledgement; `false` (and the
    /// command queued to be sent again) when it was not acknowledged.
    pub fn send(&self, object: u64, command: Command) -> bool {
        let name = object_name(object);
        let answer = self.client.send(&name, &command);
        let mut shared = lock(&self.shared);
        let kind = kind(&command);
        match answer {
            Answer::Ok(value) => {
                *shared.acks.answered.entry(kind).or_default() += 1;
                record(&mut shared.acks, &name, command, &value);
                true
            }
            Answer::Failed(_) => {
                *shared.acks.in_doubt.entry(kind).or_default() += 1;
                if !matches!(command, Command::AlarmSchedule { .. } | Command::LogConsume) {
                    shared.resend.push_back((object, command));
                }
                false
            }
        }
    }

    fn next_command(&mut self) -> (u64, Command) {
        let mut shared = lock(&self.shared);
        let roll = self.rng.random_range(0..100);
        let object = self.lane + PRODUCERS * self.rng.random_range(0..OBJECTS / PRODUCERS);
        let mut item = || {
            let item = shared.next_item;
            shared.next_item += 1;
            item
        };
        let command = match roll {
            0..30 => Command::OpStart {
                id: format!("op-{}", item()),
            },
            30..50 => {
                let batch = self.rng.random_range(1..=5);
                Command::FanoutEnqueue {
                    ids: (0..batch).map(|_| format!("m-{}", item())).collect(),
                }
            }
            50..70 => {
                let batch = self.rng.random_range(1..=5);
                Command::LogAppend {
                    keys: (0..batch).map(|_| format!("k-{}", item())).collect(),
                }
            }
            70..80 => Command::LogConsume,
            _ => {
                let name = ALARM_NAMES[self.rng.random_range(0..ALARM_NAMES.len())].to_owned();
                let wanted = now_ms() + self.rng.random_range(50..1_500);
                let at_ms = alarm_time(&mut shared, object, &name, wanted);
                Command::AlarmSchedule { name, at_ms }
            }
        };
        (object, command)
    }
}

/// The time to schedule `name` at: `wanted`, or just after the latest time
/// ever sent for the name. Times of one name only grow, so the occurrence
/// of the last acknowledged schedule, or of a later one (acknowledged or
/// not), is the one that must fire.
fn alarm_time(shared: &mut Shared, object: u64, name: &str, wanted: i64) -> i64 {
    let sent = shared
        .alarm_sent
        .entry((object, name.to_owned()))
        .or_insert(i64::MIN);
    *sent = wanted.max(sent.saturating_add(1));
    *sent
}

fn kind(command: &Command) -> &'static str {
    match command {
        Command::Hello { .. } => "hello",
        Command::OpStart { .. } => "op_start",
        Command::AlarmSchedule { .. } => "alarm_schedule",
        Command::FanoutEnqueue { .. } => "fanout_enqueue",
        Command::LogAppend { .. } => "log_append",
        Command::LogConsume => "log_consume",
        Command::Pending => "pending",
    }
}

/// Keeps what an acknowledged command accepted.
fn record(acks: &mut Acks, object: &str, command: Command, value: &Value) {
    let object = object.to_owned();
    match command {
        Command::OpStart { id } => {
            acks.ops.entry(object).or_default().insert(id);
        }
        Command::AlarmSchedule { name, at_ms } => {
            let (last, count) = acks
                .alarms
                .entry(object)
                .or_default()
                .entry(name)
                .or_insert((at_ms, 0));
            *last = (*last).max(at_ms);
            *count += 1;
        }
        Command::FanoutEnqueue { ids } => {
            acks.messages.entry(object).or_default().extend(ids);
        }
        Command::LogAppend { keys } => {
            let offsets: Vec<u64> = value
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            let records = acks.records.entry(object.clone()).or_default();
            for (key, offset) in keys.into_iter().zip(offsets) {
                match records.get(&key) {
                    Some(&earlier) if earlier != offset => {
                        acks.moved_keys.push((object.clone(), key, earlier, offset));
                    }
                    _ => {
                        records.insert(key, offset);
                    }
                }
            }
        }
        Command::LogConsume => {
            if let Some(next) = value.get("next").and_then(Value::as_u64) {
                let commit = acks.commits.entry(object).or_default();
                *commit = (*commit).max(next);
            }
        }
        Command::Hello { .. } | Command::Pending => {}
    }
}
