//! `durability demo`: the first thing a new user runs, on an embedded data
//! directory (default `./durability-data`).
//!
//! The module owns the command's arguments, the host it runs on and how its
//! summary is printed. The workload itself is a separate module that gets a
//! built [`Host`] and returns a [`Summary`]: today the host smoke run of
//! [`smoke`]; the mailbox service on the capabilities replaces it without
//! changing this shape.

mod smoke;

use std::path::PathBuf;

use comfy_table::{CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use durability_host::Host;
use serde_json::{Map, Value};

/// Arguments of `durability demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// The data directory: one SQLite file per object plus the host's alarm
    /// index. Runs on the same directory continue where the last one stopped.
    #[arg(long, value_name = "DIR", default_value = "durability-data")]
    data_dir: PathBuf,
    /// How many objects the run creates (or reuses).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1_000))]
    objects: u32,
    /// Print the summary as one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Why the demo failed.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("cannot start the demo's tokio runtime")]
    Runtime {
        #[source]
        source: std::io::Error,
    },
    #[error("the object host failed")]
    Host {
        #[from]
        source: durability_host::HostError,
    },
    #[error("a call to a demo object failed")]
    Call {
        #[from]
        source: durability_host::CallError,
    },
    #[error("a demo object's storage failed")]
    Storage {
        #[from]
        source: durability_platform::StorageError,
    },
    #[error("only {fired} of {expected} alarms fired within {waited_s} s")]
    AlarmsMissing {
        fired: usize,
        expected: usize,
        waited_s: u64,
    },
    #[error("cannot encode the summary as JSON")]
    Json {
        #[source]
        source: serde_json::Error,
    },
}

/// What a demo run reports: ordered fields, each a JSON key with its unit in
/// the name, a label for the table, and a value.
#[derive(Debug, Default)]
pub struct Summary {
    fields: Vec<(&'static str, &'static str, Value)>,
}

impl Summary {
    /// Adds one field.
    pub fn field(&mut self, key: &'static str, label: &'static str, value: impl Into<Value>) {
        self.fields.push((key, label, value.into()));
    }

    fn to_json(&self) -> Value {
        let map: Map<String, Value> = self
            .fields
            .iter()
            .map(|(key, _, value)| ((*key).to_owned(), value.clone()))
            .collect();
        Value::Object(map)
    }

    fn render(&self) -> String {
        let mut table = Table::new();
        table.load_preset(UTF8_FULL_CONDENSED);
        for (_, label, value) in &self.fields {
            let shown = match value {
                Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            table.add_row(vec![(*label).to_owned(), shown]);
        }
        if let Some(column) = table.column_mut(1) {
            column.set_cell_alignment(CellAlignment::Right);
        }
        table.to_string()
    }
}

/// Runs `durability demo` and returns what to print.
pub fn run(args: &DemoArgs) -> Result<String, DemoError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| DemoError::Runtime { source })?;
    let summary = runtime.block_on(async {
        // Thread mode with the default thread count: the way a service runs.
        let host = Host::builder(&args.data_dir).build()?;
        let outcome = smoke::run(&host, args.objects as usize).await;
        // Shut down even after a failure, so every file is closed cleanly.
        host.shutdown().await;
        outcome
    })?;

    if args.json {
        serde_json::to_string_pretty(&summary.to_json())
            .map_err(|source| DemoError::Json { source })
    } else {
        Ok(format!(
            "{}\nlook inside: durability inspect {}",
            summary.render(),
            args.data_dir.display()
        ))
    }
}
