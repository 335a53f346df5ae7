//! What a scenario returns and how it is shown: a summary table on the
//! terminal and one JSON object in a file.
//!
//! Every scenario reports a list of measurements (operations per second and
//! latency percentiles) and a list of single figures (memory, start-up time).
//! One measurement is the scenario's headline: its `ops_per_sec`, `p50_us` and
//! `p99_us` are repeated at the top of the JSON so that scripts comparing runs
//! need not know each scenario's shape.

use std::time::Duration;

use comfy_table::{CellAlignment, ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use serde_json::{Map, Value, json};

use super::latency::{Latency, LatencySummary};

/// One measured operation: how many ran, how fast, and how long each took.
#[derive(Debug, Clone)]
pub struct Measurement {
    /// A stable key, e.g. `full/enqueue`; JSON readers match on it.
    pub name: String,
    /// What one operation is, in words, for the table.
    pub what: String,
    pub ops: u64,
    pub elapsed: Duration,
    /// `None` when the operation has no per-operation latency (a derived rate).
    pub latency: Option<LatencySummary>,
    /// This measurement's rate divided by the rate of the comparable raw
    /// SQLite operation measured in the same run (1.0 = at the floor).
    pub floor_ratio: Option<f64>,
    /// Scenario-specific fields, added to this measurement's JSON.
    pub extra: Map<String, Value>,
}

impl Measurement {
    /// A measurement of `ops` operations that took `elapsed` in total.
    pub fn new(
        name: impl Into<String>,
        what: impl Into<String>,
        ops: u64,
        elapsed: Duration,
        latency: &Latency,
    ) -> Self {
        Measurement {
            name: name.into(),
            what: what.into(),
            ops,
            elapsed,
            latency: latency.summary(),
            floor_ratio: None,
            extra: Map::new(),
        }
    }

    /// Operations per second over the whole measurement.
    pub fn ops_per_sec(&self) -> f64 {
        let seconds = self.elapsed.as_secs_f64();
        if seconds > 0.0 {
            self.ops as f64 / seconds
        } else {
            0.0
        }
    }

    /// Records how this rate compares with `floor`, the raw SQLite rate of
    /// the same physical work.
    pub fn compare_with_floor(&mut self, floor: &Measurement) {
        let floor_rate = floor.ops_per_sec();
        if floor_rate > 0.0 {
            self.floor_ratio = Some(self.ops_per_sec() / floor_rate);
            self.extra
                .insert("floor".into(), Value::String(floor.name.clone()));
        }
    }

    /// Adds a scenario-specific field to the JSON.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(key.into(), value.into());
        self
    }

    fn to_json(&self) -> Value {
        let mut object = Map::new();
        object.insert("name".into(), json!(self.name));
        object.insert("what".into(), json!(self.what));
        object.insert("ops".into(), json!(self.ops));
        object.insert("elapsed_s".into(), json!(self.elapsed.as_secs_f64()));
        object.insert("ops_per_sec".into(), json!(round(self.ops_per_sec())));
        if let Some(latency) = self.latency {
            object.insert("p50_us".into(), json!(latency.p50_us));
            object.insert("p90_us".into(), json!(latency.p90_us));
            object.insert("p99_us".into(), json!(latency.p99_us));
            object.insert("max_us".into(), json!(latency.max_us));
            object.insert("mean_us".into(), json!(round(latency.mean_us)));
        }
        if let Some(ratio) = self.floor_ratio {
            object.insert("floor_ratio".into(), json!(round(ratio)));
        }
        object.extend(self.extra.clone());
        Value::Object(object)
    }
}

/// A single number a scenario found (memory per object, start-up time).
#[derive(Debug, Clone)]
pub struct Figure {
    /// The JSON key, with its unit in the name (`memory_per_live_object_bytes`).
    pub key: &'static str,
    /// The label shown in the table.
    pub label: String,
    pub value: f64,
    /// The unit shown in the table.
    pub unit: &'static str,
}

/// Everything one run of a scenario found.
#[derive(Debug, Clone)]
pub struct ScenarioReport {
    pub scenario: &'static str,
    pub quick: bool,
    /// The name of the measurement whose figures head the JSON.
    pub headline: String,
    pub measurements: Vec<Measurement>,
    pub figures: Vec<Figure>,
    /// Free-form remarks printed under the table (what a figure means).
    pub notes: Vec<String>,
}

impl ScenarioReport {
    /// The measurement called `headline`, if the scenario produced it.
    fn headline_measurement(&self) -> Option<&Measurement> {
        self.measurements.iter().find(|m| m.name == self.headline)
    }

    /// The report as one JSON object: `scenario`, the headline's
    /// `ops_per_sec`, `p50_us`, `p99_us` and `floor_ratio`, then every
    /// measurement and figure.
    pub fn to_json(&self) -> Value {
        let headline = self.headline_measurement();
        let latency = headline.and_then(|m| m.latency);
        let mut figures = Map::new();
        for figure in &self.figures {
            figures.insert(figure.key.into(), json!(round(figure.value)));
        }
        json!({
            "scenario": self.scenario,
            "quick": self.quick,
            "headline": self.headline,
            "ops_per_sec": headline.map(|m| round(m.ops_per_sec())),
            "p50_us": latency.map(|l| l.p50_us),
            "p99_us": latency.map(|l| l.p99_us),
            "floor_ratio": headline.and_then(|m| m.floor_ratio).map(round),
            "measurements": self.measurements.iter().map(Measurement::to_json).collect::<Vec<_>>(),
            "figures": figures,
            "notes": self.notes,
            "environment": {
                "os": std::env::consts::OS,
                "arch": std::env::consts::ARCH,
                "cpus": std::thread::available_parallelism().map(usize::from).unwrap_or(1),
            },
        })
    }

    /// The summary table shown at the end of a run.
    pub fn render(&self) -> String {
        let mut table = Table::new();
        table
            .load_preset(UTF8_FULL_CONDENSED)
            .set_content_arrangement(ContentArrangement::Dynamic)
            .set_header(vec![
                "measurement",
                "one op is",
                "ops",
                "ops/s",
                "p50 µs",
                "p99 µs",
                "max µs",
                "÷ floor",
            ]);
        for m in &self.measurements {
            let (p50, p99, max) = match m.latency {
                Some(l) => (
                    format_us(l.p50_us),
                    format_us(l.p99_us),
                    format_us(l.max_us),
                ),
                None => ("-".into(), "-".into(), "-".into()),
            };
            let marker = if m.name == self.headline { " *" } else { "" };
            table.add_row(vec![
                format!("{}{marker}", m.name),
                m.what.clone(),
                m.ops.to_string(),
                format!("{:.0}", m.ops_per_sec()),
                p50,
                p99,
                max,
                m.floor_ratio
                    .map_or_else(|| "-".into(), |r| format!("{r:.2}")),
            ]);
        }
        for column in 2..8 {
            if let Some(column) = table.column_mut(column) {
                column.set_cell_alignment(CellAlignment::Right);
            }
        }
        let mut out = format!(
            "{}{}\n{table}\n* headline (top-level ops_per_sec, p50_us, p99_us of the JSON)\n",
            self.scenario,
            if self.quick { " (quick)" } else { "" }
        );
        if !self.figures.is_empty() {
            let mut figures = Table::new();
            figures
                .load_preset(UTF8_FULL_CONDENSED)
                .set_header(vec!["figure", "value", "unit"]);
            for figure in &self.figures {
                figures.add_row(vec![
                    figure.label.clone(),
                    format_figure(figure.value),
                    figure.unit.to_owned(),
                ]);
            }
            if let Some(column) = figures.column_mut(1) {
                column.set_cell_alignment(CellAlignment::Right);
            }
            out.push_str(&format!("{figures}\n"));
        }
        for note in &self.notes {
            out.push_str(&format!("note: {note}\n"));
        }
        out
    }
}

fn format_us(us: f64) -> String {
    if us >= 100.0 {
        format!("{us:.0}")
    } else {
        format!("{us:.1}")
    }
}

fn format_figure(value: f64) -> String {
    if value.abs() >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}")
    }
}

/// Three decimals are plenty for rates and ratios and keep the JSON readable.
fn round(value: f64) -> f64 {
    (value * 1_000.0).round() / 1_000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measurement(name: &str, ops: u64, micros: &[u64]) -> Measurement {
        let mut latency = match Latency::new() {
            Ok(latency) => latency,
            Err(error) => panic!("{error}"),
        };
        for &us in micros {
            latency.record(Duration::from_micros(us));
        }
        Measurement::new(name, "one op", ops, Duration::from_secs(2), &latency)
    }

    #[test]
    fn json_heads_with_the_headline_measurement() {
        let report = ScenarioReport {
            scenario: "example",
            quick: true,
            headline: "b".into(),
            measurements: vec![
                measurement("a", 10, &[1]),
                measurement("b", 100, &[100, 200]),
            ],
            figures: vec![Figure {
                key: "memory_per_live_object_bytes",
                label: "memory".into(),
                value: 1234.0,
                unit: "bytes",
            }],
            notes: Vec::new(),
        };
        let json = report.to_json();
        assert_eq!(json["scenario"], "example");
        assert_eq!(json["ops_per_sec"], 50.0);
        assert!(
            json["p50_us"]
                .as_f64()
                .is_some_and(|p| (99.0..=101.0).contains(&p))
        );
        assert!(
            json["p99_us"]
                .as_f64()
                .is_some_and(|p| (199.0..=201.0).contains(&p))
        );
        assert_eq!(json["measurements"][1]["name"], "b");
        assert_eq!(json["figures"]["memory_per_live_object_bytes"], 1234.0);
    }

    #[test]
    fn floor_ratio_divides_the_rate_by_the_floor_rate() {
        let floor = measurement("floor", 100, &[1]);
        let mut host = measurement("host", 50, &[1]);
        host.compare_with_floor(&floor);
        assert_eq!(host.floor_ratio, Some(0.5));
        assert_eq!(host.to_json()["floor"], "floor");
    }
}
