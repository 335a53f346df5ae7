//! What a torture run concludes: per-workload tallies of facts and
//! violations, what the run's durability mode lets a power cut undo
//! ([`Allowance`]), and the verdict over all of them as a table or one
//! JSON object.

use std::collections::BTreeMap;
use std::time::Duration;

use comfy_table::{CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use durability_host::Synchronous;
use serde_json::{Map, Value, json};

use crate::modes::Mode;

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
    /// An object's database fails `PRAGMA integrity_check` or cannot be
    /// read.
    Corrupt,
    /// An item accepted before its object was copied by a backup taken
    /// during the run (`--backup-during`) is not in the restored copy.
    MissingFromBackup,
    /// Another invariant of the workload, by name.
    Broken(&'static str),
}

/// How many more handler runs than `max_attempts` a record may see.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ExtraRuns {
    /// None: every claimed attempt number is durable before its handler
    /// runs.
    #[default]
    None,
    /// One per claim a power cut took back: group commit may lose the
    /// claimed attempts of a record that were not flushed yet (every claim
    /// of the last flush window, 50 ms), so each of those numbers runs
    /// again after the cut. Attempt numbers still never exceed
    /// `max_attempts`.
    Reclaimed,
    /// Any number: `synchronous=NORMAL` may lose the last commits,
    /// settlements included, so the work runs again.
    Unbounded,
}

/// What the durability-mode table of docs/guarantees.md lets a power cut
/// undo in the run's mode. A kill allows nothing: every mode keeps every
/// commit across a process crash.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Allowance {
    /// An accepted item may be lost (`normal`: "an `Accepted` may
    /// vanish").
    pub lost: bool,
    /// Extra handler runs of one record beyond its `max_attempts`, and
    /// repeats of an attempt number in a later life.
    pub extra_runs: ExtraRuns,
    /// Work the host ran by itself may run again after a cut as if it had
    /// not run (group commit: "an alarm or in-process delivery may run
    /// again"): a recurring tick under a new occurrence, a missed count
    /// that does not know the cut-off run.
    pub reruns: bool,
    /// A settlement whose reply was seen may be undone (`normal`: "an ack
    /// or completion may be undone"): a committed log cursor goes back.
    pub undone_settlements: bool,
}

impl Allowance {
    /// The allowance of a run in `mode`, with or without power cuts.
    pub fn for_run(power_cut: bool, mode: Mode) -> Allowance {
        if !power_cut {
            return Allowance::default();
        }
        match mode.synchronous() {
            Synchronous::Batched => Allowance {
                lost: false,
                extra_runs: ExtraRuns::Reclaimed,
                reruns: true,
                undone_settlements: false,
            },
            Synchronous::Normal => Allowance {
                lost: true,
                extra_runs: ExtraRuns::Unbounded,
                reruns: true,
                undone_settlements: true,
            },
            Synchronous::Full => Allowance::default(),
        }
    }
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
    /// Object databases that fail `PRAGMA integrity_check` or cannot be
    /// read.
    pub corrupt: u64,
    /// Accepted items lost where the mode allows it (not violations).
    pub lost_allowed: u64,
    /// Handler runs beyond `max_attempts` within the mode's allowance (not
    /// violations).
    pub over_attempts_allowed: u64,
    /// Backups taken during the run and restored (`--backup-during`).
    pub backups: u64,
    /// Items the restored copies had to record: accepted before their
    /// object was copied.
    pub backup_items_checked: u64,
    /// Of those, items a copy did not record.
    pub backup_items_missing: u64,
    /// Other broken invariants, by name.
    pub broken: BTreeMap<&'static str, u64>,
    /// Other findings the allowance permits (not violations), by name.
    pub allowed: BTreeMap<&'static str, u64>,
    /// Workload-specific counts (outcomes, retries seen, torn lines).
    pub detail: Map<String, Value>,
    allowance: Allowance,
    examples: Vec<String>,
    allowed_examples: Vec<String>,
}

impl Tally {
    /// An empty tally whose checks apply `allowance`.
    pub fn allowing(allowance: Allowance) -> Tally {
        Tally {
            allowance,
            ..Tally::default()
        }
    }

    /// What the run's mode lets a power cut undo.
    pub fn allowance(&self) -> Allowance {
        self.allowance
    }

    /// Counts one violation and keeps its message if there is room. A loss
    /// the allowance permits is counted in `lost_allowed` instead.
    pub fn flag(&mut self, violation: Violation, message: impl Into<String>) {
        match violation {
            Violation::Lost if self.allowance.lost => {
                self.lost_allowed += 1;
                self.keep_allowed(message.into());
                return;
            }
            Violation::Lost => self.lost += 1,
            Violation::OverAttempts => self.over_attempts += 1,
            Violation::StaleSettlement => self.stale_settlements += 1,
            Violation::Corrupt => self.corrupt += 1,
            Violation::MissingFromBackup => self.backup_items_missing += 1,
            Violation::Broken(name) => *self.broken.entry(name).or_default() += 1,
        }
        if self.examples.len() < MAX_EXAMPLES {
            self.examples.push(message.into());
        }
    }

    /// Counts a handler run beyond `max_attempts` that the allowance
    /// permits (the caller checked [`Tally::allowance`]).
    pub fn allow_extra_run(&mut self, message: impl Into<String>) {
        self.over_attempts_allowed += 1;
        self.keep_allowed(message.into());
    }

    /// Counts a finding under `name` in `allowed` when `allowed_here`
    /// (the caller's reading of [`Tally::allowance`]), else flags it as
    /// `violation`.
    pub fn flag_or_allow(
        &mut self,
        allowed_here: bool,
        name: &'static str,
        violation: Violation,
        message: impl Into<String>,
    ) {
        if allowed_here {
            *self.allowed.entry(name).or_default() += 1;
            self.keep_allowed(message.into());
        } else {
            self.flag(violation, message);
        }
    }

    fn keep_allowed(&mut self, message: String) {
        if self.allowed_examples.len() < MAX_EXAMPLES {
            self.allowed_examples.push(message);
        }
    }

    /// Adds one workload-specific figure.
    pub fn detail(&mut self, key: &str, value: impl Into<Value>) {
        self.detail.insert(key.to_owned(), value.into());
    }

    /// Every violation counted.
    pub fn violations(&self) -> u64 {
        self.lost
            + self.over_attempts
            + self.stale_settlements
            + self.corrupt
            + self.backup_items_missing
            + self.broken.values().sum::<u64>()
    }

    /// Lives whose host refused to start with no injected fault to explain
    /// it (counted among the violations too).
    pub fn refused_starts(&self) -> u64 {
        self.broken
            .get(super::supervisor::REFUSED_STARTS)
            .copied()
            .unwrap_or(0)
    }

    /// The kept violation messages.
    pub fn examples(&self) -> &[String] {
        &self.examples
    }

    /// The kept messages of what the allowance permitted.
    pub fn allowed_examples(&self) -> &[String] {
        &self.allowed_examples
    }
}

/// One workload's run: how it was tortured and what the checker found.
#[derive(Debug)]
pub struct WorkloadReport {
    pub workload: &'static str,
    pub kills: u32,
    /// Power cuts applied, by fault name (empty without `--power-cut`).
    pub faults: BTreeMap<String, u32>,
    pub elapsed: Duration,
    pub tally: Tally,
}

impl WorkloadReport {
    fn cuts(&self) -> u64 {
        self.faults.values().map(|&n| u64::from(n)).sum()
    }
}

/// The verdict of a whole `durability torture` run.
#[derive(Debug)]
pub struct Verdict {
    pub seed: u64,
    /// Whether every death was a power cut.
    pub power_cut: bool,
    /// The host's durability mode.
    pub mode: Mode,
    pub reports: Vec<WorkloadReport>,
    pub elapsed: Duration,
}

impl Verdict {
    fn sum(&self, field: impl Fn(&Tally) -> u64) -> u64 {
        self.reports.iter().map(|r| field(&r.tally)).sum()
    }

    fn kills(&self) -> u64 {
        self.reports.iter().map(|r| u64::from(r.kills)).sum()
    }

    fn cuts(&self) -> u64 {
        self.reports.iter().map(WorkloadReport::cuts).sum()
    }

    /// The cuts of every workload, by fault name.
    fn faults(&self) -> BTreeMap<&str, u64> {
        let mut faults = BTreeMap::new();
        for report in &self.reports {
            for (name, &count) in &report.faults {
                *faults.entry(name.as_str()).or_default() += u64::from(count);
            }
        }
        faults
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
                    "cuts": report.cuts(),
                    "faults": report.faults,
                    "accepted": tally.accepted,
                    "completed": tally.completed,
                    "lost": tally.lost,
                    "lost_allowed": tally.lost_allowed,
                    "over_attempts": tally.over_attempts,
                    "over_attempts_allowed": tally.over_attempts_allowed,
                    "stale_settlements": tally.stale_settlements,
                    "corrupt": tally.corrupt,
                    "refused_starts": tally.refused_starts(),
                    "backups": tally.backups,
                    "backup_items_checked": tally.backup_items_checked,
                    "backup_items_missing": tally.backup_items_missing,
                    "other_violations": tally.broken,
                    "other_allowed": tally.allowed,
                    "violations": tally.violations(),
                    "duration_ms": millis(report.elapsed),
                    "detail": tally.detail,
                    "examples": tally.examples(),
                    "allowed_examples": tally.allowed_examples(),
                });
                (report.workload.to_owned(), value)
            })
            .collect();
        json!({
            "verdict": if self.passed() { "pass" } else { "fail" },
            "seed": self.seed,
            "power_cut": self.power_cut,
            "mode": self.mode.key,
            "kills": self.kills(),
            "cuts": self.cuts(),
            "faults": self.faults(),
            "accepted": self.sum(|t| t.accepted),
            "completed": self.sum(|t| t.completed),
            "lost": self.sum(|t| t.lost),
            "lost_allowed": self.sum(|t| t.lost_allowed),
            "over_attempts": self.sum(|t| t.over_attempts),
            "over_attempts_allowed": self.sum(|t| t.over_attempts_allowed),
            "stale_settlements": self.sum(|t| t.stale_settlements),
            "corrupt": self.sum(|t| t.corrupt),
            "refused_starts": self.sum(Tally::refused_starts),
            "backups": self.sum(|t| t.backups),
            "backup_items_checked": self.sum(|t| t.backup_items_checked),
            "backup_items_missing": self.sum(|t| t.backup_items_missing),
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
            "cuts",
            "accepted",
            "completed",
            "lost",
            "over attempts",
            "stale settlements",
            "corrupt",
            "other violations",
            "time",
        ]);
        for report in &self.reports {
            let tally = &report.tally;
            table.add_row(vec![
                report.workload.to_owned(),
                report.kills.to_string(),
                report.cuts().to_string(),
                tally.accepted.to_string(),
                tally.completed.to_string(),
                tally.lost.to_string(),
                tally.over_attempts.to_string(),
                tally.stale_settlements.to_string(),
                tally.corrupt.to_string(),
                tally.broken.values().sum::<u64>().to_string(),
                format!("{:.1} s", report.elapsed.as_secs_f64()),
            ]);
        }
        for column in 1..11 {
            if let Some(column) = table.column_mut(column) {
                column.set_cell_alignment(CellAlignment::Right);
            }
        }
        let mut text = table.to_string();
        for report in &self.reports {
            let tally = &report.tally;
            if tally.backups > 0 {
                text.push_str(&format!(
                    "\n{}: {} backups taken during the run and restored: {} items accepted before their copy checked, {} missing",
                    report.workload,
                    tally.backups,
                    tally.backup_items_checked,
                    tally.backup_items_missing
                ));
            }
            for (name, count) in &report.tally.broken {
                text.push_str(&format!("\n{}: {name}: {count}", report.workload));
            }
            for example in report.tally.examples() {
                text.push_str(&format!("\n{}: {example}", report.workload));
            }
            let tally = &report.tally;
            let others: u64 = tally.allowed.values().sum();
            if tally.lost_allowed + tally.over_attempts_allowed + others > 0 {
                text.push_str(&format!(
                    "\n{}: allowed in mode {}: {} lost, {} runs over max_attempts, {others} other ({:?})",
                    report.workload,
                    self.mode.key,
                    tally.lost_allowed,
                    tally.over_attempts_allowed,
                    tally.allowed
                ));
            }
        }
        let faults: Vec<String> = self
            .faults()
            .iter()
            .map(|(name, count)| format!("{name} {count}"))
            .collect();
        let deaths = if self.power_cut {
            format!(
                "{} kills and {} power cuts ({})",
                self.kills(),
                self.cuts(),
                faults.join(", ")
            )
        } else {
            format!("{} kills", self.kills())
        };
        let verdict = if self.passed() {
            format!(
                "PASS: every guarantee held over {deaths}, mode {} (seed {}, {:.1} s)",
                self.mode.key,
                self.seed,
                self.elapsed.as_secs_f64()
            )
        } else {
            format!(
                "FAIL: {} violations over {deaths}, mode {} (seed {}, {:.1} s); rerun with --seed {} --data-dir DIR to keep the files",
                self.violations(),
                self.mode.key,
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
