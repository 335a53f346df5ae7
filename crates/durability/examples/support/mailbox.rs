//! The mailbox object shared by the `mailbox` and `redrive` examples.
//!
//! One object per mailbox owner, on an embedded host in a directory. Its
//! fanout delivers each mail to two targets:
//! - `inbox`, a consumer that hands mail to known recipients and
//!   dead-letters mail to anyone else;
//! - `archive`, a storage target writing each mail as a JSON file.
//!
//! Dead letters go to a DLQ that is a directory of JSON files, one per
//! delivery, keyed by the delivery identity and never overwritten, so a
//! repeated write (after a crash) is harmless.

use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use durability::fanout::{Fanout, FanoutMessage, StoredMessage, Target};
use durability::{HandlerError, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, Namespace, ObjectContext};
use serde::{Deserialize, Serialize};

/// One mail.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mail {
    pub to: String,
    pub subject: String,
}

/// A mailbox object: its scheduler and its fanout.
pub struct Mailbox {
    scheduler: Scheduler,
    pub mail: Fanout<Mail>,
}

impl DurableObject for Mailbox {
    // The object's one alarm runs the scheduler: that is how delivery
    // resumes after a restart.
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        self.scheduler
            .alarm(Some(info))
            .await
            .map_err(|e| Box::new(e) as BoxError)
    }
}

/// The directory of dead letters under `dir`.
pub fn dlq_dir(dir: &Path) -> PathBuf {
    dir.join("dlq")
}

/// The directory of archived mail under `dir`.
pub fn archive_dir(dir: &Path) -> PathBuf {
    dir.join("archive")
}

/// Opens the host in `dir` (inline: call it inside a `LocalSet`) with the
/// mailbox namespace; `recipients` are the addresses the inbox knows.
pub fn open(
    dir: &Path,
    recipients: &[&str],
) -> Result<(Host, Namespace<Mailbox>), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(dlq_dir(dir))?;
    std::fs::create_dir_all(archive_dir(dir))?;
    let host = Host::builder(dir.join("objects")).threads(0).build()?;
    let known: BTreeSet<String> = recipients.iter().map(|r| (*r).to_owned()).collect();
    let dir = dir.to_path_buf();
    let mailboxes = host.namespace("mailbox", move |ctx| build(ctx, &dir, known.clone()))?;
    Ok((host, mailboxes))
}

fn build(ctx: ObjectContext, dir: &Path, known: BTreeSet<String>) -> Result<Mailbox, BoxError> {
    let scheduler = Scheduler::new(ctx.into_dyn())?;
    let known = Rc::new(known);
    let (archive, dlq) = (archive_dir(dir), dlq_dir(dir));
    let mail = Fanout::<Mail>::builder(&scheduler)
        .target(
            "inbox",
            Target::consumer(move |batch: Vec<FanoutMessage<Mail>>| {
                let known = Rc::clone(&known);
                async move {
                    for message in &batch {
                        if known.contains(&message.body.to) {
                            println!(
                                "  inbox: {} gets \"{}\" (attempt {})",
                                message.body.to, message.body.subject, message.attempt
                            );
                        } else {
                            println!("  inbox: no mailbox for {}; dead-lettered", message.body.to);
                            // Settled explicitly; the rest are acked on return.
                            let _ = message.dead_letter().await;
                        }
                    }
                    Ok::<_, HandlerError>(())
                }
            })
            .ack_on_return(true),
        )
        .target(
            "archive",
            Target::storage(move |stored: StoredMessage<Mail>| {
                let written = write_once(&archive, &stored);
                async move { written }
            }),
        )
        .dlq(move |stored: StoredMessage<Mail>| {
            let written = write_once(&dlq, &stored);
            async move { written }
        })
        .build()?;
    Ok(Mailbox { scheduler, mail })
}

/// Writes `stored` as `<dir>/<delivery identity>.json` unless it exists:
/// entries are keyed by delivery and never overwritten.
fn write_once(dir: &Path, stored: &StoredMessage<Mail>) -> Result<(), HandlerError> {
    let path = dir.join(format!("{}.json", file_name(&stored.id)));
    let text = serde_json::to_string_pretty(stored)?;
    match OpenOptions::new().write(true).create_new(true).open(&path) {
        Ok(mut file) => {
            file.write_all(text.as_bytes())?;
            file.sync_all()?;
            Ok(())
        }
        // Written before (a retried write): the same delivery, keep it.
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// A file name for a delivery identity `["<generation>","<target>"]`.
fn file_name(delivery_id: &str) -> String {
    delivery_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect::<String>()
        .trim_matches('_')
        .to_owned()
}

/// The directory given on the command line, or one under the system's
/// temporary directory.
pub fn data_dir() -> PathBuf {
    std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("durability-mailbox"))
}

/// Waits (real time) until the mailbox has no delivery left.
pub async fn drained(
    mailbox: &durability_host::Stub<Mailbox>,
) -> Result<(), Box<dyn std::error::Error>> {
    loop {
        let pending = mailbox
            .call(|m: Rc<Mailbox>| async move {
                m.mail
                    .load()
                    .map(|load| load.outbound.pending_deliveries)
                    .map_err(|e| e.to_string())
            })
            .await??;
        if pending == 0 {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
