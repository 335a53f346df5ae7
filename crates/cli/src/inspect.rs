//! `durability inspect DIR`: lists every object of a data directory, one
//! row per object with the figures that matter (what its capabilities owe,
//! hold parked or failed, how far its log consumers lag); `--wide` adds the
//! id and the rows of every table, `--json` prints everything.
//!
//! It reads the files through `durability_host::inspect`, which opens them
//! read-only and never constructs an object, so inspecting a directory that
//! a running host serves changes nothing in it, and a read-only data
//! directory (a mounted backup) can be listed.
//!
//! Exit code: non-zero when the directory is not a data directory (none of
//! `objects/`, `index.sqlite`, `host.lock` in it) or when any object file
//! could not be read; the listing is printed first either way.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use comfy_table::{CellAlignment, ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use durability::state::CapabilityState;
use durability_host::inspect::{ObjectSummary, list_objects, read_object};
use serde_json::json;

/// Arguments of `durability inspect`.
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// The data directory to list (as given to `durability demo --data-dir`).
    #[arg(value_name = "DIR")]
    dir: PathBuf,
    /// Print one JSON object (`data_dir`, `objects`, each object with its
    /// `tables` and its `capabilities`' state) instead of a table.
    #[arg(long, conflicts_with = "wide")]
    json: bool,
    /// Show every column: the id and the rows of each table.
    #[arg(long)]
    wide: bool,
}

/// Why a data directory could not be listed. A single unreadable object file
/// is not an error: it is listed with its reason.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("cannot list the objects of {}", dir.display())]
    List {
        dir: PathBuf,
        #[source]
        source: durability_host::HostError,
    },
    #[error(
        "{} is not a durability data directory: it holds none of objects/, journal/, index.sqlite, host.lock",
        dir.display()
    )]
    NotADataDir { dir: PathBuf },
    #[error("{unreadable} of {total} object files in {} could not be read (see the listing)", dir.display())]
    Unreadable {
        dir: PathBuf,
        unreadable: usize,
        total: usize,
    },
    #[error("cannot encode the listing as JSON")]
    Json {
        #[source]
        source: serde_json::Error,
    },
}

/// Names longer than this are cut in the table (JSON has them whole).
const TABLE_NAME_CHARS: usize = 40;

/// Id digits shown in the table: enough to tell objects apart by eye.
const TABLE_ID_CHARS: usize = 12;

/// What `durability inspect` prints, and why it fails after printing it.
pub struct Listing {
    pub text: String,
    pub problem: Option<InspectError>,
}

/// Runs `durability inspect` and returns what to print.
pub fn run(args: &InspectArgs) -> Result<Listing, InspectError> {
    let objects = list_objects(&args.dir).map_err(|source| InspectError::List {
        dir: args.dir.clone(),
        source,
    })?;
    if objects.is_empty() && !durability_host::is_data_dir(&args.dir) {
        return Err(InspectError::NotADataDir {
            dir: args.dir.clone(),
        });
    }
    let states: Vec<Result<CapabilityState, String>> = objects
        .iter()
        .map(|object| capabilities(&args.dir, object))
        .collect();
    let text = if args.json {
        let mut entries = Vec::with_capacity(objects.len());
        for (object, state) in objects.iter().zip(&states) {
            let mut entry =
                serde_json::to_value(object).map_err(|source| InspectError::Json { source })?;
            if let Some(fields) = entry.as_object_mut() {
                let state = match state {
                    Ok(state) => serde_json::to_value(state)
                        .map_err(|source| InspectError::Json { source })?,
                    Err(_) => serde_json::Value::Null,
                };
                fields.insert("capabilities".into(), state);
            }
            entries.push(entry);
        }
        let listing = json!({
            "data_dir": args.dir.display().to_string(),
            "objects": entries,
        });
        serde_json::to_string_pretty(&listing).map_err(|source| InspectError::Json { source })?
    } else if args.wide {
        render_wide(&args.dir, &objects, now_ms())
    } else {
        render(&args.dir, &objects, &states, now_ms())
    };
    let unreadable = objects.iter().filter(|o| o.error.is_some()).count();
    Ok(Listing {
        text,
        problem: (unreadable > 0).then(|| InspectError::Unreadable {
            dir: args.dir.clone(),
            unreadable,
            total: objects.len(),
        }),
    })
}

/// What the capabilities of `object` hold, read without constructing it.
fn capabilities(dir: &std::path::Path, object: &ObjectSummary) -> Result<CapabilityState, String> {
    if let Some(error) = &object.error {
        return Err(error.clone());
    }
    match read_object(dir, &object.id, durability::state::read) {
        Ok(Some(Ok(state))) => Ok(state),
        Ok(Some(Err(error))) | Err(error) => Err(error.to_string()),
        Ok(None) => Err("the object's file disappeared".into()),
    }
}

/// The default: one row per object, the columns that say whether it is
/// healthy.
fn render(
    dir: &std::path::Path,
    objects: &[ObjectSummary],
    states: &[Result<CapabilityState, String>],
    now_ms: i64,
) -> String {
    if objects.is_empty() {
        return format!("no objects in {}", dir.display());
    }
    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(vec![
            "namespace",
            "name",
            "alarm",
            "backlog",
            "parked",
            "ops pending",
            "ops failed",
            "log lag",
            "size",
        ]);
    for (object, state) in objects.iter().zip(states) {
        let mut row = vec![
            object
                .namespace
                .as_deref()
                .map_or_else(|| "?".into(), shown),
            object.name.as_deref().map_or_else(|| "-".into(), shown),
            object
                .alarm_ms
                .map_or_else(|| "-".into(), |at_ms| alarm_relative(at_ms, now_ms)),
        ];
        match state {
            Ok(state) => row.extend(figures(state)),
            Err(error) => {
                row.push(format!("unreadable: {error}"));
                row.extend(std::iter::repeat_n(String::new(), 4));
            }
        }
        row.push(size(object.file_bytes));
        table.add_row(row);
    }
    for column in 3..=8 {
        if let Some(column) = table.column_mut(column) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    format!(
        "{} objects in {} (--wide for ids and tables, --json for everything)\n{table}",
        objects.len(),
        dir.display()
    )
}

/// backlog, parked, ops pending, ops failed, log lag; `-` where the object
/// has no such capability.
fn figures(state: &CapabilityState) -> [String; 5] {
    let dash = || "-".to_owned();
    let (backlog, parked) = state.fanout.as_ref().map_or_else(
        || (dash(), dash()),
        |f| {
            (
                f.targets.iter().map(|t| t.backlog).sum::<u64>().to_string(),
                f.targets.iter().map(|t| t.parked).sum::<u64>().to_string(),
            )
        },
    );
    let (pending, failed) = state.operations.as_ref().map_or_else(
        || (dash(), dash()),
        |o| {
            let of = |status: &str| o.by_status.get(status).copied().unwrap_or(0).to_string();
            (of("pending"), of("failed"))
        },
    );
    let lag = state.log.as_ref().map_or_else(dash, |log| {
        log.consumers
            .iter()
            .map(|c| c.lag)
            .max()
            .map_or_else(dash, |lag| lag.to_string())
    });
    [backlog, parked, pending, failed, lag]
}

/// `in 3.2 s` or `12.0 s ago`.
fn alarm_relative(at_ms: i64, now_ms: i64) -> String {
    let delta_s = (at_ms - now_ms) as f64 / 1_000.0;
    if delta_s >= 0.0 {
        format!("in {delta_s:.1} s")
    } else {
        format!("{:.1} s ago", -delta_s)
    }
}

/// `--wide`: every object with its id and the rows of each table.
fn render_wide(dir: &std::path::Path, objects: &[ObjectSummary], now_ms: i64) -> String {
    if objects.is_empty() {
        return format!("no objects in {}", dir.display());
    }
    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(vec![
            "namespace",
            "name",
            "id",
            "alarm",
            "size",
            "rows per table",
        ]);
    for object in objects {
        let tables = match &object.error {
            Some(error) => format!("unreadable: {error}"),
            None if object.tables.is_empty() => "-".into(),
            None => object
                .tables
                .iter()
                .map(|t| format!("{}={}", t.table, t.rows))
                .collect::<Vec<_>>()
                .join(" "),
        };
        table.add_row(vec![
            object
                .namespace
                .as_deref()
                .map_or_else(|| "?".into(), shown),
            object.name.as_deref().map_or_else(|| "-".into(), shown),
            format!("{}…", object.id.get(..TABLE_ID_CHARS).unwrap_or(&object.id)),
            object
                .alarm_ms
                .map_or_else(|| "-".into(), |at_ms| alarm(at_ms, now_ms)),
            size(object.file_bytes),
            tables,
        ]);
    }
    if let Some(column) = table.column_mut(4) {
        column.set_cell_alignment(CellAlignment::Right);
    }
    format!("{} objects in {}\n{table}", objects.len(), dir.display())
}

/// A name as a terminal may show it: control characters escaped, cut to
/// [`TABLE_NAME_CHARS`].
fn shown(name: &str) -> String {
    let escaped: String = name.escape_debug().collect();
    if escaped.chars().count() > TABLE_NAME_CHARS {
        let cut: String = escaped.chars().take(TABLE_NAME_CHARS - 1).collect();
        format!("{cut}…")
    } else {
        escaped
    }
}

/// `<epoch ms> (in 3.2 s)` or `(12.0 s ago)`.
fn alarm(at_ms: i64, now_ms: i64) -> String {
    let delta_s = (at_ms - now_ms) as f64 / 1_000.0;
    if delta_s >= 0.0 {
        format!("{at_ms} (in {delta_s:.1} s)")
    } else {
        format!("{at_ms} ({:.1} s ago)", -delta_s)
    }
}

fn size(bytes: u64) -> String {
    const KIB: u64 = 1024;
    if bytes >= KIB * KIB {
        format!("{:.1} MiB", bytes as f64 / (KIB * KIB) as f64)
    } else if bytes >= KIB {
        format!("{:.1} KiB", bytes as f64 / KIB as f64)
    } else {
        format!("{bytes} B")
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_escaped_and_cut_for_the_terminal() {
        assert_eq!(shown("inbox"), "inbox");
        assert_eq!(shown("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        let long = "x".repeat(100);
        assert_eq!(shown(&long).chars().count(), TABLE_NAME_CHARS);
    }

    #[test]
    fn alarms_read_relative_to_now() {
        assert_eq!(alarm(10_000, 7_000), "10000 (in 3.0 s)");
        assert_eq!(alarm(7_000, 10_000), "7000 (3.0 s ago)");
        assert_eq!(alarm_relative(10_000, 7_000), "in 3.0 s");
        assert_eq!(alarm_relative(7_000, 10_000), "3.0 s ago");
    }

    #[test]
    fn an_object_without_a_capability_shows_dashes() {
        assert_eq!(
            figures(&CapabilityState::default()),
            ["-", "-", "-", "-", "-"].map(String::from)
        );
    }
}
