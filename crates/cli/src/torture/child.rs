//! The child's side of a torture run: one life of a workload on the
//! thread-mode host, in the run's durability mode, over the run's data
//! directory.
//!
//! An ordinary life produces its quota and keeps its consumers and handlers
//! running until the supervisor kills it; it never ends by itself (except
//! after [`ORPHAN_AFTER`], when its supervisor must be gone). The final life
//! finishes production, then waits until the workload reports no unsettled
//! work, bounded by [`SETTLE_TIMEOUT`], shuts the host down and exits.

use std::cell::Cell;
use std::fs;
use std::process::ExitCode;
use std::time::Duration;

use durability::fanout::INFRASTRUCTURE_RETRY;
use durability_host::Host;
use tokio::time::Instant;

use super::TortureError;
use super::journal::Journal;
use super::workload::{Files, HandlerEnv, Life, Manifest, Objects, Workload};

/// How long the final life waits for accepted work to settle once its
/// production is done. Exceeding it is a violation, not an error. Above the
/// longest wait the capabilities may legitimately impose after a kill: a
/// fanout DLQ write cut off by a kill comes back after the library's
/// infrastructure retry. Normally a final life settles in a few seconds and
/// ends at once.
pub const SETTLE_TIMEOUT: Duration = INFRASTRUCTURE_RETRY.saturating_add(Duration::from_secs(30));

/// An ordinary life is killed within a few hundred milliseconds; one that
/// is still alive after this has lost its supervisor and stops.
const ORPHAN_AFTER: Duration = Duration::from_secs(120);

/// Executor threads of the child's host: more than one, so objects run in
/// parallel as they do in a service.
const HOST_THREADS: usize = 2;

/// How long consumers rest after a pass that found nothing to do.
const IDLE_PASS: Duration = Duration::from_millis(20);

/// The exit code of a final life whose work did not settle in time.
pub const EXIT_UNSETTLED: u8 = 3;

/// How a final life ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Every accepted item settled.
    Settled,
    /// [`SETTLE_TIMEOUT`] passed with work still unsettled.
    Unsettled,
}

impl Ending {
    pub fn exit_code(self) -> ExitCode {
        match self {
            Ending::Settled => ExitCode::SUCCESS,
            Ending::Unsettled => ExitCode::from(EXIT_UNSETTLED),
        }
    }
}

/// Runs one life of workload `W`.
pub fn live<W: Workload>(life: &Life) -> Result<Ending, TortureError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| TortureError::Runtime { source })?;
    runtime.block_on(async {
        // In every mode what a producer journals as accepted is a reply the
        // host returned, and a SIGKILL must lose none of it; a power cut
        // may lose what the mode's table says (default: nothing a
        // released reply depended on).
        let mut builder = life.mode.builder(&life.files.data()).threads(HOST_THREADS);
        // With power cuts the supervisor keeps a boot id of its own, new
        // at every cut, as a reboot after a real power loss would be.
        let boot_id = life.files.boot_id();
        if boot_id.exists() {
            builder = builder.boot_id_file(boot_id);
        }
        let host = builder.build()?;
        let started = life.files.started();
        fs::write(&started, life.index.to_string()).map_err(|source| TortureError::Io {
            what: "cannot mark the life's host as started",
            path: started,
            source,
        })?;
        let outcome = run_life::<W>(&host, life).await;
        // Only a final life gets here normally; it closes every file cleanly
        // so the checker reads settled databases.
        host.shutdown().await;
        outcome
    })
}

async fn run_life<W: Workload>(host: &Host, life: &Life) -> Result<Ending, TortureError> {
    let handled = Journal::open(&life.files.handled())?;
    let env = HandlerEnv {
        journal: handled.clone(),
        seed: life.seed,
        life: life.index,
        items: life.items,
        files: life.files.clone(),
    };
    let namespace = host.namespace(&format!("torture-{}", W::NAME), move |ctx| {
        W::construct(ctx, &env)
    })?;
    let objects = Objects::new(host, &namespace, W::NAME, W::OBJECTS)?;
    write_manifest(&life.files, &objects.manifest())?;
    let produced = Journal::open(&life.files.produced())?;
    if life.is_final {
        return finish::<W>(&objects, &produced, &handled, life).await;
    }
    let work = async {
        tokio::try_join!(
            W::produce(&objects, &produced, life),
            consume_until_killed::<W>(&objects, &handled, life)
        )
    };
    match tokio::time::timeout(ORPHAN_AFTER, work).await {
        Ok(Err(error)) => Err(error),
        Ok(Ok(_)) | Err(_) => Err(TortureError::Orphaned {
            seconds: ORPHAN_AFTER.as_secs(),
        }),
    }
}

async fn consume_until_killed<W: Workload>(
    objects: &Objects<W::Object>,
    handled: &Journal,
    life: &Life,
) -> Result<(), TortureError> {
    loop {
        if !W::consume(objects, handled, life).await? {
            tokio::time::sleep(IDLE_PASS).await;
        }
    }
}

/// The final life: production to the end, then consumers until nothing is
/// unsettled or the settle timeout passed.
async fn finish<W: Workload>(
    objects: &Objects<W::Object>,
    produced: &Journal,
    handled: &Journal,
    life: &Life,
) -> Result<Ending, TortureError> {
    let produced_all = Cell::new(false);
    let producing = async {
        W::produce(objects, produced, life).await?;
        produced_all.set(true);
        Ok::<_, TortureError>(())
    };
    let settling = async {
        let mut deadline = None;
        loop {
            let worked = W::consume(objects, handled, life).await?;
            if produced_all.get() {
                let deadline = *deadline.get_or_insert_with(|| Instant::now() + SETTLE_TIMEOUT);
                if !worked && W::unsettled(objects).await? == 0 {
                    return Ok(Ending::Settled);
                }
                if Instant::now() >= deadline {
                    return Ok(Ending::Unsettled);
                }
            }
            if !worked {
                tokio::time::sleep(IDLE_PASS).await;
            }
        }
    };
    let ((), ending) = tokio::try_join!(producing, settling)?;
    Ok(ending)
}

/// Writes the manifest through a temporary file and a rename, so a kill
/// never leaves half of one.
fn write_manifest(files: &Files, manifest: &Manifest) -> Result<(), TortureError> {
    let text = serde_json::to_vec_pretty(manifest).map_err(|source| TortureError::Encode {
        what: "the object manifest",
        source,
    })?;
    let path = files.manifest();
    let temporary = path.with_extension("json.tmp");
    fs::write(&temporary, text).map_err(|source| TortureError::Io {
        what: "cannot write the object manifest",
        path: temporary.clone(),
        source,
    })?;
    fs::rename(&temporary, &path).map_err(|source| TortureError::Io {
        what: "cannot write the object manifest",
        path,
        source,
    })
}
