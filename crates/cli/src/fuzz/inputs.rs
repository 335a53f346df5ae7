//! Random and adversarial inputs, and the trace that records them.
//!
//! Every draw goes through [`Fx`], which notes what it drew in the case's
//! trace (shortened: a 2 MB string is shown by its length), so a failure
//! comes with the exact inputs of its case. A case's generator is seeded
//! by (run seed, case number) only, so any case can be run again alone.

use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use serde_json::{Map, Value, json};

use durability::retry::{Delay, MethodPolicy};

/// The longest text a trace line shows of one value.
const SHOWN_CHARS: usize = 160;

/// A case's random source and the trace of what it drew and did.
pub struct Fx {
    rng: StdRng,
    /// Shared with the child, which reads it even when the case panicked.
    trace: Arc<Mutex<Vec<String>>>,
    /// Trace mode: every note is also printed at once (flushed), so the
    /// inputs of a case that kills its process survive it.
    echo: bool,
}

impl Fx {
    pub fn new(seed: u64, case: u64, echo: bool) -> Self {
        // SplitMix-style mixing, so neighbouring cases get unrelated streams.
        let mixed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17)
            ^ case.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        Fx {
            rng: StdRng::seed_from_u64(mixed),
            trace: Arc::new(Mutex::new(Vec::new())),
            echo,
        }
    }

    /// Records a step of the case.
    pub fn note(&mut self, line: impl Into<String>) {
        let line = line.into();
        if self.echo {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "T {}", line.replace('\n', " "));
            let _ = out.flush();
        }
        if let Ok(mut trace) = self.trace.lock() {
            trace.push(line);
        }
    }

    /// The trace, shared: it outlives the case.
    pub fn shared_trace(&self) -> Arc<Mutex<Vec<String>>> {
        Arc::clone(&self.trace)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        self.rng.random_bool(p.clamp(0.0, 1.0))
    }

    pub fn below(&mut self, n: usize) -> usize {
        self.rng.random_range(0..n.max(1))
    }

    pub fn range_u64(&mut self, lo: u64, hi: u64) -> u64 {
        self.rng.random_range(lo..=hi.max(lo))
    }

    pub fn any_u64(&mut self) -> u64 {
        self.rng.random()
    }

    pub fn unit(&mut self) -> f64 {
        self.rng.random()
    }

    /// One of `items`, uniformly.
    pub fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        let i = self.below(items.len());
        items[i.min(items.len().saturating_sub(1))].clone()
    }

    /// A count for a setting: edge values often, anything sometimes.
    pub fn count_u64(&mut self, what: &str) -> u64 {
        let value = match self.below(8) {
            0 => 0,
            1 => 1,
            2 => self.range_u64(2, 20),
            3 => self.range_u64(21, 10_000),
            4 => u64::from(u32::MAX),
            5 => u64::MAX,
            6 => (1 << 53) - 1,
            _ => self.any_u64(),
        };
        self.note(format!("{what} = {value}"));
        value
    }

    pub fn count_u32(&mut self, what: &str) -> u32 {
        let value = match self.below(6) {
            0 => 0,
            1 => 1,
            2 | 3 => self.range_u64(2, 6) as u32,
            4 => u32::MAX,
            _ => self.rng.random(),
        };
        self.note(format!("{what} = {value}"));
        value
    }

    pub fn count_usize(&mut self, what: &str) -> usize {
        let value = match self.below(6) {
            0 => 0,
            1 => 1,
            2 | 3 => self.range_u64(2, 200) as usize,
            4 => usize::MAX,
            _ => self.rng.random_range(0..100_000),
        };
        self.note(format!("{what} = {value}"));
        value
    }

    /// A duration: zero, sub-millisecond, fractional milliseconds, the
    /// timer limit and beyond, or ordinary.
    pub fn duration(&mut self, what: &str) -> Duration {
        let value = match self.below(10) {
            0 => Duration::ZERO,
            1 => Duration::from_nanos(self.range_u64(1, 999_999)),
            2 => Duration::from_micros(1_500),
            3 => Duration::from_millis(self.range_u64(1, 100)),
            4 => Duration::from_secs(self.range_u64(1, 3_600)),
            5 => Duration::from_millis((1 << 31) - 1),
            6 => Duration::from_millis(1 << 31),
            7 => Duration::from_millis((1 << 53) - 1),
            8 => Duration::MAX,
            _ => Duration::from_millis(self.range_u64(100, 60_000)),
        };
        self.note(format!("{what} = {value:?}"));
        value
    }

    /// A time in epoch milliseconds around `now`, or far outside.
    pub fn timestamp(&mut self, what: &str, now: i64) -> i64 {
        let value = match self.below(8) {
            0 => now,
            1 => now.saturating_add(self.range_u64(1, 120_000) as i64),
            2 => now.saturating_sub(self.range_u64(1, 1_000_000) as i64),
            3 => -1,
            4 => i64::MIN,
            5 => i64::MAX,
            6 => (1 << 53) - 1,
            _ => now.saturating_add(self.range_u64(0, 86_400_000) as i64),
        };
        self.note(format!("{what} = {value}"));
        value
    }

    fn delay_ms(&mut self) -> f64 {
        match self.below(9) {
            0 => 0.0,
            1 => f64::NAN,
            2 => f64::INFINITY,
            3 => -1.0,
            4 => 1e300,
            5 => 0.5,
            6 => 2f64.powi(31),
            7 => self.range_u64(1, 10_000) as f64,
            _ => self.unit() * 60_000.0,
        }
    }

    /// A retry delay: exponential, fixed or a custom function with any
    /// output (NaN, negative, huge, an error).
    pub fn delay(&mut self, what: &str) -> Delay {
        match self.below(3) {
            0 => {
                let (initial_ms, max_ms) = (self.delay_ms(), self.delay_ms());
                self.note(format!(
                    "{what} = Exponential {{ initial_ms: {initial_ms}, max_ms: {max_ms} }}"
                ));
                Delay::Exponential { initial_ms, max_ms }
            }
            1 => {
                let ms = self.delay_ms();
                self.note(format!("{what} = Fixed {{ ms: {ms} }}"));
                Delay::Fixed { ms }
            }
            _ => {
                let output = self.delay_ms();
                let fails = self.chance(0.2);
                self.note(format!(
                    "{what} = Custom(returns {})",
                    if fails {
                        "Err".to_owned()
                    } else {
                        output.to_string()
                    }
                ));
                Delay::custom(move |_, _| {
                    if fails {
                        Err(durability::HandlerError::new("the delay function failed"))
                    } else {
                        Ok(output)
                    }
                })
            }
        }
    }

    /// A per-method policy with any combination of overrides.
    pub fn method_policy(&mut self, what: &str) -> MethodPolicy {
        let mut policy = MethodPolicy::new();
        if self.chance(0.5) {
            let ms = match self.below(4) {
                0 => 0,
                1 => u64::MAX,
                2 => 1 << 31,
                _ => self.range_u64(1, 120_000),
            };
            self.note(format!("{what}.attempt_timeout_ms = {ms}"));
            policy = policy.attempt_timeout_ms(ms);
        }
        if self.chance(0.5) {
            policy = policy.max_attempts(self.count_u32(&format!("{what}.max_attempts")));
        }
        if self.chance(0.5) {
            policy = policy.delay(self.delay(&format!("{what}.delay")));
        }
        if self.chance(0.3) {
            let retry = self.chance(0.5);
            self.note(format!("{what}.retry_timeouts = {retry}"));
            policy = policy.retry_timeouts(retry);
        }
        policy
    }

    /// An id, key or name: empty, ordinary, hostile text, or very long.
    pub fn name(&mut self, what: &str) -> String {
        let value = match self.below(12) {
            0 => String::new(),
            1 => "a".to_owned(),
            2 => format!("id-{}", self.range_u64(0, 50)),
            3 => "\0".to_owned(),
            4 => "x\0y".to_owned(),
            5 => "../../etc/passwd".to_owned(),
            6 => "Ω≈ç√∫˜µ≤ 🦀 \u{202e}".to_owned(),
            7 => "'; DROP TABLE durability_calls; --".to_owned(),
            8 => "k".repeat(self.range_u64(1_000, 70_000) as usize),
            9 => "k".repeat(self.pick(&[255, 256, 1023, 1024, 1025, 4096, 4097])),
            10 if self.chance(0.05) => "K".repeat(2_000_000),
            _ => format!("n{}", self.any_u64()),
        };
        self.note(format!("{what} = {}", shown_str(&value)));
        value
    }

    /// A JSON body: scalars at the edges, hostile strings, wide or deep
    /// nesting (up to 10,000 levels), or large.
    pub fn body(&mut self, what: &str) -> Value {
        let value = self.body_value();
        self.note(format!("{what} = {}", shown_value(&value)));
        value
    }

    fn body_value(&mut self) -> Value {
        match self.below(14) {
            0 => Value::Null,
            1 => json!(true),
            2 => json!(u64::MAX),
            3 => json!(i64::MIN),
            4 => json!(f64::MAX),
            5 => json!(-0.0),
            6 => json!(5e-324),
            7 => json!("\0\u{1b}[2J\u{202e}"),
            8 => {
                let depth =
                    self.pick(&[10, 63, 64, 65, 100, 126, 127, 128, 129, 200, 1_000, 10_000]);
                deep(depth, self.chance(0.5))
            }
            9 => {
                let mut map = Map::new();
                for i in 0..self.range_u64(0, 300) {
                    map.insert(format!("k{i}"), json!(i));
                }
                Value::Object(map)
            }
            10 => {
                let len = self.pick(&[1_000, 65_536, 1_048_560, 1_048_576, 1_048_577, 1_100_000]);
                json!("b".repeat(len))
            }
            11 if self.chance(0.02) => json!("B".repeat(12 * 1024 * 1024)),
            12 => json!({"n": self.range_u64(0, 10)}),
            _ => json!({"n": self.range_u64(0, 1_000), "text": "ordinary"}),
        }
    }

    /// A garbage SQLite value for a malformed row.
    pub fn garbage(&mut self) -> durability::platform::Value {
        use durability::platform::Value as V;
        match self.below(12) {
            0 => V::Null,
            1 => V::Text(String::new()),
            2 => V::Text("{\"unterminated".into()),
            3 => V::Text("not json at all".into()),
            4 => V::Text("[]".into()),
            5 => V::Integer(-1),
            6 => V::Integer(i64::MAX),
            7 => V::Integer(i64::MIN),
            8 => V::Real(1.5),
            9 => V::Blob(vec![0, 159, 146, 150]),
            10 => V::Text("pending".into()),
            _ => V::Text(deep(5_000, true).to_string()),
        }
    }
}

/// `[[[...0...]]]` or `{"a":{"a":...}}`, `depth` levels, built without
/// recursion.
fn deep(depth: usize, arrays: bool) -> Value {
    let mut value = json!(0);
    for _ in 0..depth {
        value = if arrays {
            Value::Array(vec![value])
        } else {
            let mut map = Map::new();
            map.insert("a".into(), value);
            Value::Object(map)
        };
    }
    value
}

/// How deep `value` nests, without recursion.
fn depth_of(value: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((value, depth)) = stack.pop() {
        deepest = deepest.max(depth);
        match value {
            Value::Array(items) => stack.extend(items.iter().map(|v| (v, depth + 1))),
            Value::Object(map) => stack.extend(map.values().map(|v| (v, depth + 1))),
            _ => {}
        }
    }
    deepest
}

/// A value as a trace shows it: short ones whole, deep or long ones by
/// their shape.
pub fn shown_value(value: &Value) -> String {
    let depth = depth_of(value);
    if depth > 20 {
        return format!("<JSON nested {depth} levels>");
    }
    let text = value.to_string();
    if text.chars().count() > SHOWN_CHARS {
        let head: String = text.chars().take(SHOWN_CHARS).collect();
        format!("{head}… ({} bytes of JSON)", text.len())
    } else {
        text
    }
}

/// A string as a trace shows it.
pub fn shown_str(text: &str) -> String {
    if text.chars().count() > SHOWN_CHARS {
        let head: String = text.chars().take(40).collect();
        format!("{head:?}… ({} bytes)", text.len())
    } else {
        format!("{text:?}")
    }
}

/// Drops a value that may nest deeply without recursing (serde_json's own
/// drop recurses once per level).
pub fn drop_flat(value: Value) {
    let mut stack = vec![value];
    while let Some(value) = stack.pop() {
        match value {
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => stack.extend(map.into_iter().map(|(_, v)| v)),
            _ => {}
        }
    }
}

/// A canonical text of `value`, built without recursion: equal values give
/// equal texts (to compare a body read back with the one appended, however
/// deep; serde_json's own `==`, `clone` and `to_string` recurse per level).
pub fn fingerprint(value: &Value) -> String {
    enum Step<'a> {
        Value(&'a Value),
        Text(&'static str),
        Key(&'a str),
    }
    let mut out = String::new();
    let mut stack = vec![Step::Value(value)];
    while let Some(step) = stack.pop() {
        match step {
            Step::Text(text) => out.push_str(text),
            Step::Key(key) => {
                out.push_str(&format!("{key:?}"));
                out.push(':');
            }
            Step::Value(Value::Array(items)) => {
                out.push('[');
                stack.push(Step::Text("]"));
                for item in items.iter().rev() {
                    stack.push(Step::Text(","));
                    stack.push(Step::Value(item));
                }
            }
            Step::Value(Value::Object(map)) => {
                out.push('{');
                stack.push(Step::Text("}"));
                for (key, item) in map.iter().rev() {
                    stack.push(Step::Text(","));
                    stack.push(Step::Value(item));
                    stack.push(Step::Key(key));
                }
            }
            Step::Value(scalar) => out.push_str(&scalar.to_string()),
        }
    }
    out
}
