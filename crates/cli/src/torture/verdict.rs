//! What a torture run concludes: per-workload tallies of facts and
//! violations, and the verdict over all of them as a table or one JSON
//! object.

use std::collections::BTreeMap;
use std::time::Duration;

use comfy_table::{CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use serde_json::{Map, Value, json};

/// Violation messages kept per workload; the counts are always complete.
const MAX_EXAMPLES: usize = 12;

/// A broken guarantee, by the counter it goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Violation {
    /// An accepted item never reached its end.
    Lost,
    /// An attempt number above the maximum ran or was stored.
    OverAttempts,
    /// A settlement was applied by an attempt that no longer owned the
    /// record (an old generation, an old attempt, a regressed cursor).
    StaleSettlement,
    /// Another invariant of the workload, by name.
    Broken(&'static str),
}

/// The checker's findings for one workload.
#[derive(Debug, Default)]
pub struct Tally {
    /// Items the producer journaled as accepted.
    pub accepted: u64,
    /// Accepted items that reached their end.
    pub completed: u64,
    pub lost: u64,
    pub over_attempts: u64,
    pub stale_settlements: u64,
    /// Other broken invariants, by name.
    pub broken: BTreeMap<&'static str, u64>,
    /// Workload-specific counts (outcomes, retries seen, torn lines).
    pub detail: Map<String, Value>,
    examples: Vec<String>,
}

impl Tally {
    /// Counts one violation and keeps its message if there is room.
    pub fn flag(&mut self, violation: Violation, message: impl Into<String>) {
        match violation {
            Violation::Lost => self.lost += 1,
            Violation::OverAttempts => self.over_attempts += 1,
            Violation::StaleSettlement => self.stale_settlements += 1,
            Violation::Broken(name) => *self.broken.entry(name).or_default() += 1,
        }
        if self.examples.len() < MAX_EXAMPLES {
            self.examples.push(message.into());
        }
    }

    /// Adds one workload-specific figure.
    pub fn detail(&mut self, key: &str, value: impl Into<Value>) {
        self.detail.insert(key.to_owned(), value.into());
    }

    /// Every violation counted.
    pub fn violations(&self) -> u64 {
        self.lost + self.over_attempts + self.stale_settlements + self.broken.values().sum::<u64>()
    }

    /// The kept violation messages.
    pub fn examples(&self) -> &[String] {
        &self.examples
    }
}

/// One workload's run: how it was tortured and what the checker found.
#[derive(Debug)]
pub struct WorkloadReport {
    pub workload: &'static str,
    pub kills: u32,
    pub elapsed: Duration,
    pub tally: Tally,
}

/// The verdict of a whole `durability torture` run.
#[derive(Debug)]
pub struct Verdict {
    pub seed: u64,
    pub reports: Vec<WorkloadReport>,
    pub elapsed: Duration,
}

impl Verdict {
    fn sum(&self, field: impl Fn(&Tally) -> u64) -> u64 {
        self.reports.iter().map(|r| field(&r.tally)).sum()
    }

    /// Every violation of every workload.
    pub fn violations(&self) -> u64 {
        self.sum(Tally::violations)
    }

    /// Whether every guarantee held.
    pub fn passed(&self) -> bool {
        self.violations() == 0
    }

    /// The verdict as one JSON object: totals first, then each workload.
    pub fn to_json(&self) -> Value {
        let workloads: Map<String, Value> = self
            .reports
            .iter()
            .map(|report| {
                let tally = &report.tally;
                let value = json!({
                    "kills": report.kills,
                    "accepted": tally.accepted,
                    "completed": tally.completed,
                    "lost": tally.lost,
                    "over_attempts": tally.over_attempts,
                    "stale_settlements": tally.stale_settlements,
                    "other_violations": tally.broken,
                    "violations": tally.violations(),
                    "duration_ms": millis(report.elapsed),
                    "detail": tally.detail,
                    "examples": tally.examples(),
                });
                (report.workload.to_owned(), value)
            })
            .collect();
        json!({
            "verdict": if self.passed() { "pass" } else { "fail" },
            "seed": self.seed,
            "kills": self.reports.iter().map(|r| u64::from(r.kills)).sum::<u64>(),
            "accepted": self.sum(|t| t.accepted),
            "completed": self.sum(|t| t.completed),
            "lost": self.sum(|t| t.lost),
            "over_attempts": self.sum(|t| t.over_attempts),
            "stale_settlements": self.sum(|t| t.stale_settlements),
            "violations": self.violations(),
            "duration_ms": millis(self.elapsed),
            "workloads": workloads,
        })
    }

    /// The verdict as a table per workload and a closing line.
    pub fn render(&self) -> String {
        let mut table = Table::new();
        table.load_preset(UTF8_FULL_CONDENSED);
        table.set_header(vec![
            "workload",
            "kills",
            "accepted",
            "completed",
            "lost",
            "over attempts",
            "stale settlements",
            "other violations",
            "time",
        ]);
        for report in &self.reports {
            let tally = &report.tally;
            table.add_row(vec![
                report.workload.to_owned(),
                report.kills.to_string(),
                tally.accepted.to_string(),
                tally.completed.to_string(),
                tally.lost.to_string(),
                tally.over_attempts.to_string(),
                tally.stale_settlements.to_string(),
                tally.broken.values().sum::<u64>().to_string(),
                format!("{:.1} s", report.elapsed.as_secs_f64()),
            ]);
        }
        for column in 1..9 {
            if let Some(column) = table.column_mut(column) {
                column.set_cell_alignment(CellAlignment::Right);
            }
        }
        let mut text = table.to_string();
        for report in &self.reports {
            for (name, count) in &report.tally.broken {
                text.push_str(&format!("\n{}: {name}: {count}", report.workload));
            }
            for example in report.tally.examples() {
                text.push_str(&format!("\n{}: {example}", report.workload));
            }
        }
        let verdict = if self.passed() {
            format!(
                "PASS: every guarantee held over {} kills (seed {}, {:.1} s)",
                self.reports.iter().map(|r| u64::from(r.kills)).sum::<u64>(),
                self.seed,
                self.elapsed.as_secs_f64()
            )
        } else {
            format!(
                "FAIL: {} violations (seed {}, {:.1} s); rerun with --seed {} --data-dir DIR to keep the files",
                self.violations(),
                self.seed,
                self.elapsed.as_secs_f64(),
                self.seed
            )
        };
        text.push('\n');
        text.push_str(&verdict);
        text
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
