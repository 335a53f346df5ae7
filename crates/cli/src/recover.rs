//! `durability recover DATA_DIR`: the way out when a host refuses to start
//! because its journal lost synced records (`HostError::JournalLost`).
//! It runs `durability_host::recover_journal`, which applies every journal
//! record it can prove whole, moves the damaged segments aside under
//! `journal/damaged/` and reports per object what it could not apply;
//! afterwards a host starts on the directory. `--json` prints the report as
//! one JSON object.
//!
//! Exit code: 0 once the directory is recovered (whether or not anything
//! was damaged), non-zero with the typed error when it cannot be (a host
//! holds the directory, I/O). A recovery stopped halfway (a crash, a full
//! disk) is finished by running this again.

use std::fmt::Write as _;
use std::path::PathBuf;

use comfy_table::{CellAlignment, ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use durability_host::{ByteRange, RecoveryReport};

/// Arguments of `durability recover`.
#[derive(Debug, clap::Args)]
pub struct RecoverArgs {
    /// The data directory whose journal to recover (no host may serve it).
    #[arg(value_name = "DATA_DIR")]
    dir: PathBuf,
    /// Print the report as one JSON object (`data_dir`, `segments`,
    /// `damaged`, `moved_to`, `records_applied`, `records_skipped`,
    /// `objects`, one entry per object) instead of text.
    #[arg(long)]
    json: bool,
}

/// Why a data directory could not be recovered. Nothing is half written
/// when it fails: a host refuses the directory until a recovery ends.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error(
        "{} is not a durability data directory: it holds none of objects/, journal/, index.sqlite, host.lock",
        dir.display()
    )]
    NotADataDir { dir: PathBuf },
    #[error("cannot recover the journal of {}", dir.display())]
    Recover {
        dir: PathBuf,
        #[source]
        source: durability_host::HostError,
    },
    #[error("cannot encode the report as JSON")]
    Json {
        #[source]
        source: serde_json::Error,
    },
}

/// Runs `durability recover` and returns what to print.
pub fn run(args: &RecoverArgs) -> Result<String, RecoverError> {
    if !durability_host::is_data_dir(&args.dir) {
        return Err(RecoverError::NotADataDir {
            dir: args.dir.clone(),
        });
    }
    let report =
        durability_host::recover_journal(&args.dir).map_err(|source| RecoverError::Recover {
            dir: args.dir.clone(),
            source,
        })?;
    if args.json {
        return serde_json::to_string_pretty(&report)
            .map_err(|source| RecoverError::Json { source });
    }
    Ok(text(&report))
}

fn range(range: Option<ByteRange>) -> String {
    range.map_or_else(String::new, |r| format!("{}..{}", r.start, r.end))
}

/// The report for a terminal: what was damaged, then one row per object.
fn text(report: &RecoveryReport) -> String {
    let mut out = String::new();
    let dir = report.data_dir.display();
    if report.is_whole() {
        let _ = writeln!(
            out,
            "{dir}: the journal was whole ({} segments): {} records replayed, as a start replays them.",
            report.segments, report.records_applied
        );
    } else {
        let _ = writeln!(
            out,
            "{dir}: {} of {} journal segments damaged; {} records applied, {} left out.",
            report.damaged.len(),
            report.segments,
            report.records_applied,
            report.records_skipped
        );
        for segment in &report.damaged {
            let lost: Vec<String> = segment
                .lost
                .iter()
                .map(|r| format!("{}..{}", r.start, r.end))
                .collect();
            let _ = writeln!(
                out,
                "  {} ({} bytes): {} whole passes; lost bytes {}{}",
                segment.segment,
                segment.bytes,
                segment.whole_passes,
                if lost.is_empty() {
                    "none".to_owned()
                } else {
                    lost.join(", ")
                },
                if segment.refused_records > 0 {
                    format!(
                        "; {} records naming files outside the data directory refused",
                        segment.refused_records
                    )
                } else {
                    String::new()
                }
            );
        }
        if let Some(moved_to) = &report.moved_to {
            let _ = writeln!(
                out,
                "Moved aside (kept, never deleted) with the alarm index, which the next start rebuilds: {}",
                moved_to.display()
            );
        }
        let _ = writeln!(
            out,
            "Whatever the lost bytes held is gone for any object; the commits of the records left out below are gone too."
        );
    }
    if !report.objects.is_empty() {
        let mut table = Table::new();
        table
            .load_preset(UTF8_FULL_CONDENSED)
            .set_content_arrangement(ContentArrangement::Disabled)
            .set_header([
                "object",
                "applied",
                "applied bytes",
                "skipped",
                "skipped bytes",
                "skipped pages",
                "skipped WAL range",
                "started over",
            ]);
        for object in &report.objects {
            table.add_row([
                object.object_file.display().to_string(),
                object.applied_records.to_string(),
                object.applied_bytes.to_string(),
                object.skipped_records.to_string(),
                object.skipped_bytes.to_string(),
                object
                    .skipped_pages
                    .map_or_else(String::new, |pages| pages.to_string()),
                range(object.skipped_wal_range),
                if object.started_over_after_loss {
                    "yes".to_owned()
                } else {
                    String::new()
                },
            ]);
        }
        for column in 1..6 {
            if let Some(column) = table.column_mut(column) {
                column.set_cell_alignment(CellAlignment::Right);
            }
        }
        let _ = write!(out, "{table}");
    }
    out.trim_end().to_owned()
}
