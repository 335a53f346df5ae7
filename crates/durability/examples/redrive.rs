//! Redrive from a dead-letter directory (queues.md §3.17): every entry the
//! `mailbox` example dead-lettered is enqueued again, for its one target,
//! keyed by its delivery identity, and its file is deleted only once the
//! enqueue was accepted.
//!
//! ```text
//! cargo run -p durability --example mailbox -- /tmp/mail
//! cargo run -p durability --example redrive -- /tmp/mail
//! ```
//!
//! The delivery identity as deduplication key makes the redriven delivery
//! new work (attempt 0, a fresh retry budget) that does not collide with the
//! original message, which may still be owed to other targets. A crash
//! between the acceptance and the delete redrives the entry again next time:
//! at least once, as everything in a queue.

#[path = "support/mailbox.rs"]
mod support;

use std::rc::Rc;

use durability::fanout::{EnqueueOptions, EnqueueResult, FanoutInput, StoredMessage};
use support::{Mail, Mailbox};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = support::data_dir();
    tokio::task::LocalSet::new()
        .run_until(async move {
            // Carol has a mailbox now.
            let (host, mailboxes) = support::open(&dir, &["alice", "bob", "carol"])?;
            let office = mailboxes.stub("office")?;
            let mut entries = Vec::new();
            for file in std::fs::read_dir(support::dlq_dir(&dir))? {
                let path = file?.path();
                let entry: StoredMessage<Mail> =
                    serde_json::from_str(&std::fs::read_to_string(&path)?)?;
                entries.push((path, entry));
            }
            println!("{} dead letter(s) to redrive", entries.len());
            for (path, entry) in entries {
                let failure = entry.failure.as_ref().map(|f| f.reason.as_str());
                println!(
                    "redrive {} to {} (was {:?} after {} attempt(s))",
                    entry.message_id, entry.target, failure, entry.attempts
                );
                let input = FanoutInput::new(entry.body.clone())
                    .id(entry.message_id.clone())
                    .deduplication_key(entry.id.clone());
                let options = EnqueueOptions::to([entry.target.clone()]);
                let accepted = office
                    .call(move |m: Rc<Mailbox>| async move {
                        match m.mail.enqueue(vec![input], &options).await {
                            Ok(EnqueueResult::Accepted { .. }) => Ok(true),
                            Ok(EnqueueResult::Rejected { error, .. }) => {
                                println!("  rejected, kept: {error}");
                                Ok(false)
                            }
                            Err(error) => Err(error.to_string()),
                        }
                    })
                    .await?;
                match accepted {
                    // Only a definite acceptance removes the entry.
                    Ok(true) => std::fs::remove_file(&path)?,
                    Ok(false) => {}
                    Err(uncertain) => println!("  uncertain, kept for next time: {uncertain}"),
                }
            }
            support::drained(&office).await?;
            host.shutdown().await;
            Ok::<_, Box<dyn std::error::Error>>(())
        })
        .await
}
