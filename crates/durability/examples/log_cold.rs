//! Cold segments in a directory: a trim moves old records out of the
//! object's database into one file per segment, reads below the hot offset
//! rehydrate them transparently, and forgetting old segments (the way a
//! lifecycle rule expires objects in a bucket) makes reads below the new
//! floor fail with `Truncated` rather than skip.
//!
//! Run with `cargo run -p durability --example log_cold`.

use std::error::Error;
use std::path::PathBuf;
use std::rc::Rc;

use durability::Scheduler;
use durability::log::{
    AppendRecord, ColdError, ColdStorage, Log, LogError, Read, Retention, Segment,
};
use durability::platform::LocalBoxFuture;
use durability_host::{DurableObject, Host, ObjectContext};

/// Segments as files in one directory.
///
/// The file name holds both offsets: after a crash between the write and
/// the index, the log writes the segment again, perhaps with another last
/// offset if the retention changed, and must never overwrite a file the
/// index points at. An existing file is therefore kept (at-least-once
/// writes), and a file appears only whole: written to a temporary name,
/// synced, then renamed.
struct DirectoryCold {
    dir: PathBuf,
}

impl ColdStorage for DirectoryCold {
    fn write<'a>(&'a self, segment: &'a Segment) -> LocalBoxFuture<'a, Result<String, ColdError>> {
        Box::pin(async move {
            let locator = format!(
                "{:020}-{:020}.json",
                segment.first_offset, segment.last_offset
            );
            let path = self.dir.join(&locator);
            if !path.exists() {
                let temporary = self.dir.join(format!("{locator}.tmp"));
                std::fs::write(&temporary, segment.to_json()?)?;
                std::fs::File::open(&temporary)?.sync_all()?;
                std::fs::rename(&temporary, &path)?;
            }
            Ok(locator)
        })
    }

    fn read<'a>(
        &'a self,
        locator: &'a str,
    ) -> LocalBoxFuture<'a, Result<Option<Segment>, ColdError>> {
        Box::pin(async move {
            match std::fs::read(self.dir.join(locator)) {
                Ok(bytes) => Segment::from_json(&bytes).map(Some),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(error) => Err(error.into()),
            }
        })
    }
}

struct Archive {
    log: Log<String>,
    segments: PathBuf,
}

impl DurableObject for Archive {}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let cold_dir = dir.path().join("segments");
    std::fs::create_dir_all(&cold_dir)?;
    let host = Host::builder(dir.path().join("objects"))
        .threads(1)
        .build()?;
    let archives = host.namespace("archives", {
        let cold_dir = cold_dir.clone();
        move |ctx: ObjectContext| {
            let scheduler = Scheduler::new(ctx.into_dyn())?;
            let log = Log::<String>::builder(&scheduler)
                .max_batch_size(100)
                .retention(Retention::new().max_records(100))
                .cold(Rc::new(DirectoryCold {
                    dir: cold_dir.clone(),
                }))
                .build()?;
            Ok(Archive {
                log,
                segments: cold_dir.clone(),
            })
        }
    })?;
    let archive = archives.stub("audit-trail")?;

    let report =
        archive
            .call(|a: Rc<Archive>| async move {
                run(&a.log, &a.segments).await.map_err(|e| e.to_string())
            })
            .await??;
    println!("{report}");
    let files = std::fs::read_dir(&cold_dir)?.count();
    println!("{files} segment files remain in {}", cold_dir.display());
    host.shutdown().await;
    Ok(())
}

async fn run(log: &Log<String>, segments: &std::path::Path) -> Result<String, Box<dyn Error>> {
    for batch in 0..10 {
        let records = (0..100)
            .map(|i| AppendRecord::new(format!("entry {}", batch * 100 + i)))
            .collect();
        log.append(records).await?;
    }
    let flushed = log.trim().await?;
    let bounds = log.bounds().await?;
    println!(
        "trim flushed {flushed} records; readable from {}, hot from {}, next {}",
        bounds.oldest_offset, bounds.hot_offset, bounds.next_offset
    );

    // Below the hot offset a read goes to the segment file, transparently.
    let page = log.read(Read::from_offset(250).limit(3)).await?;
    let bodies: Vec<&str> = page.records.iter().map(|r| r.body.as_str()).collect();
    println!(
        "read from 250 (cold): {bodies:?}, next {}",
        page.next_offset
    );

    // Expire everything below 500, then delete the files the log let go of.
    let forgotten = log.forget_cold_before(500).await?;
    for segment in &forgotten {
        std::fs::remove_file(segments.join(&segment.locator))?;
    }
    println!("forgot {} segments below offset 500", forgotten.len());
    match log.read_from(250).await {
        Err(LogError::Truncated { requested, oldest }) => {
            println!("read from {requested}: truncated, the oldest readable offset is {oldest}");
        }
        other => return Err(format!("expected truncation, got {other:?}").into()),
    }
    Ok(format!(
        "bounds now {:?}",
        log.bounds().await.map_err(|e| e.to_string())?
    ))
}
