//! What a finished demo run reports: one JSON object (`--json`, and the
//! run's `summary.json`) or a table for people.

use std::collections::BTreeMap;

use comfy_table::{CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;

use super::mailbox::TARGETS;

/// The summary of one run. Counts of messages come from the run's files,
/// never from counters kept in memory.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub run: u32,
    /// This invocation finished a run that an earlier one left unfinished.
    pub resumed: bool,
    /// Messages the interrupted run had accepted before this invocation.
    pub resumed_accepted: u64,
    /// Deliveries those still owed when this invocation started.
    pub resumed_owed: u64,
    /// The plan: messages and shards.
    pub messages: u64,
    pub shards: u32,
    /// Messages accepted (journaled by the producer after `Accepted`).
    pub accepted: u64,
    /// Accepted messages delivered, per target.
    pub delivered: BTreeMap<&'static str, u64>,
    /// Accepted messages dead-lettered (DLQ files), all targets.
    pub dead_lettered: u64,
    pub dead_lettered_by_target: BTreeMap<&'static str, u64>,
    /// Terminal deliveries parked in an object (none with a DLQ).
    pub parked: u64,
    /// Accepted messages that reached no end on some target.
    pub lost: u64,
    /// The first of them (at most `LOST_SHOWN`), with the target where
    /// each reached no end.
    pub lost_examples: Vec<LostDelivery>,
    /// Deliveries the shards still owed at the end.
    pub owed: u64,
    /// Inbox deliveries repeated after a crash (at-least-once delivery).
    pub redelivered: u64,
    /// Retries the inbox asked for.
    pub retries: u64,
    /// Settled (message, target) pairs per second in this invocation:
    /// delivered or dead-lettered, from its start to the last settlement.
    pub deliveries_per_sec: f64,
    /// Messages accepted per second by this invocation's producer.
    pub accepted_per_sec: f64,
    /// Latency of one enqueue call (a push of one batch), milliseconds.
    pub enqueue_p50_ms: Option<f64>,
    pub enqueue_p99_ms: Option<f64>,
    /// Messages per enqueue call.
    pub enqueue_batch: u64,
    /// Digest operations completed, one per shard.
    pub digests_completed: u64,
    /// Runs of the cleanup alarm and the inbox rows they trimmed, over the
    /// life of the data directory.
    pub cleanup_runs: u64,
    pub inbox_rows_trimmed: u64,
    pub elapsed_s: f64,
    pub data_dir: String,
}

/// An accepted message that reached no end on one target.
#[derive(Debug, Clone, Serialize)]
pub struct LostDelivery {
    pub message: String,
    pub target: &'static str,
}

impl Summary {
    /// What was lost, in words, when anything was: the demo then exits
    /// non-zero, since "nothing accepted is dropped" did not hold.
    pub fn loss(&self) -> Option<String> {
        if self.lost == 0 {
            return None;
        }
        let shown = self
            .lost_examples
            .iter()
            .map(|l| format!("{} on {}", l.message, l.target))
            .collect::<Vec<_>>()
            .join(", ");
        let more = self.lost.saturating_sub(self.lost_examples.len() as u64);
        Some(format!(
            "{} accepted messages of run {} reached no end (neither delivered, dead-lettered nor \
             parked): {shown}{}",
            grouped(self.lost),
            self.run,
            if more > 0 {
                format!(" and {} more", grouped(more))
            } else {
                String::new()
            }
        ))
    }

    /// The summary as a table, with a line that says what to look at next.
    pub fn render(&self) -> String {
        let mut table = Table::new();
        table.load_preset(UTF8_FULL_CONDENSED);
        let mut row = |label: &str, value: String| {
            table.add_row(vec![label.to_owned(), value]);
        };
        row(
            "run",
            if self.resumed {
                format!("{} (resumed)", self.run)
            } else {
                self.run.to_string()
            },
        );
        row(
            "plan",
            format!(
                "{} messages on {} shards",
                grouped(self.messages),
                self.shards
            ),
        );
        row("accepted", grouped(self.accepted));
        for target in TARGETS {
            row(
                &format!("delivered: {target}"),
                grouped(self.delivered.get(target).copied().unwrap_or(0)),
            );
        }
        for target in TARGETS {
            row(
                &format!("dead-lettered: {target}"),
                grouped(
                    self.dead_lettered_by_target
                        .get(target)
                        .copied()
                        .unwrap_or(0),
                ),
            );
        }
        row("parked", grouped(self.parked));
        row("lost", grouped(self.lost));
        row("still owed", grouped(self.owed));
        row("retries (inbox)", grouped(self.retries));
        row("redelivered (at least once)", grouped(self.redelivered));
        row("deliveries/s", format!("{:.0}", self.deliveries_per_sec));
        row("accepted/s", format!("{:.0}", self.accepted_per_sec));
        let ms = |value: Option<f64>| value.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"));
        row(
            &format!("enqueue p50 ms ({} msgs)", self.enqueue_batch),
            ms(self.enqueue_p50_ms),
        );
        row(
            &format!("enqueue p99 ms ({} msgs)", self.enqueue_batch),
            ms(self.enqueue_p99_ms),
        );
        row(
            "digests (operations)",
            format!("{} of {}", self.digests_completed, self.shards),
        );
        row("cleanup alarm runs", grouped(self.cleanup_runs));
        row("inbox rows trimmed", grouped(self.inbox_rows_trimmed));
        row("elapsed s", format!("{:.1}", self.elapsed_s));
        if let Some(column) = table.column_mut(1) {
            column.set_cell_alignment(CellAlignment::Right);
        }
        let mut text = table.to_string();
        if self.resumed {
            text.push_str(&format!(
                "\nresumed run {}: finished the {} messages it had accepted ({} deliveries \
                 still owed) before accepting the rest",
                self.run,
                grouped(self.resumed_accepted),
                grouped(self.resumed_owed)
            ));
        }
        text.push_str(&format!(
            "\nfacts: {dir}/runs/{run}/ (accepted.jsonl, inbox.jsonl, archive/, dlq/, digests/)\
             \nobjects: durability inspect {dir}",
            dir = self.data_dir,
            run = self.run
        ));
        text
    }
}

/// `1234567` as `1,234,567`.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::grouped;

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1_000), "1,000");
        assert_eq!(grouped(100_000), "100,000");
        assert_eq!(grouped(1_234_567), "1,234,567");
    }
}
