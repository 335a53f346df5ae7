//! A mailbox: a fanout that delivers each mail to an inbox consumer and to
//! an archive (JSON files), with a dead-letter queue in a directory.
//!
//! ```text
//! cargo run -p durability --example mailbox -- /tmp/mail
//! cargo run -p durability --example redrive -- /tmp/mail
//! ```
//!
//! The inbox knows alice and bob; the mail to carol is dead-lettered into
//! `<dir>/dlq`. The `redrive` example then enqueues it again, once carol
//! has a mailbox.

#[path = "support/mailbox.rs"]
mod support;

use std::rc::Rc;

use durability::fanout::{EnqueueOptions, FanoutInput};
use support::{Mail, Mailbox};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = support::data_dir();
    println!("data directory: {}", dir.display());
    tokio::task::LocalSet::new()
        .run_until(async move {
            let (host, mailboxes) = support::open(&dir, &["alice", "bob"])?;
            let office = mailboxes.stub("office")?;
            let accepted = office
                .call(|m: Rc<Mailbox>| async move {
                    let mails = [
                        ("welcome-alice", "alice", "Welcome"),
                        ("welcome-bob", "bob", "Welcome"),
                        ("welcome-carol", "carol", "Welcome"),
                        ("minutes", "alice", "Minutes of Monday"),
                    ]
                    .into_iter()
                    .map(|(id, to, subject)| {
                        FanoutInput::new(Mail {
                            to: to.into(),
                            subject: subject.into(),
                        })
                        .id(id)
                    })
                    .collect();
                    // Accepted once the batch and its targets are committed,
                    // before anything is delivered.
                    let result = m.mail.enqueue(mails, &EnqueueOptions::all()).await;
                    result
                        .map(|r| serde_json::to_string(&r).unwrap_or_default())
                        .map_err(|e| e.to_string())
                })
                .await??;
            println!("enqueue: {accepted}");
            support::drained(&office).await?;
            for (what, path) in [
                ("archive", support::archive_dir(&dir)),
                ("dlq", support::dlq_dir(&dir)),
            ] {
                let mut files: Vec<_> = std::fs::read_dir(&path)?
                    .filter_map(Result::ok)
                    .map(|entry| entry.file_name().to_string_lossy().into_owned())
                    .collect();
                files.sort();
                println!("{what}: {} file(s) in {}", files.len(), path.display());
            }
            host.shutdown().await;
            Ok::<_, Box<dyn std::error::Error>>(())
        })
        .await
}
