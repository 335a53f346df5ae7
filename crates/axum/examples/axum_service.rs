//! A mail service in axum, with durability inside: the shape most
//! applications take.
//!
//! - `POST /mail` (`{"to": "...", "subject": "..."}`) pushes the mail
//!   through a load-aware routing client into one of many `mailbox`
//!   objects, and answers `202 Accepted` only after the mailbox committed
//!   it: from then on a crash cannot lose it.
//! - Each mailbox delivers with fanout to its `inbox` (a table in the
//!   object) and retries failures; mail to `nobody@...` is dead-lettered
//!   and parked in the object, where the dashboard shows it.
//! - `/durability` is the dashboard, `/durability/api/objects` its JSON,
//!   `/durability/metrics` the Prometheus metrics; with
//!   `DURABILITY_ADMIN_TOKEN` set, the admin routes redrive and purge the
//!   parked mail.
//! - Ctrl-C stops accepting, lets requests in flight finish, then shuts
//!   the host down (calls and background deliveries finish up to the
//!   grace; what remains runs again at the next start).
//!
//! ```sh
//! cargo run -p durability-axum --example axum_service -- --listen 127.0.0.1:3000
//! curl -X POST localhost:3000/mail -H 'content-type: application/json' \
//!      -d '{"to":"ada@example.test","subject":"hello"}'
//! open http://localhost:3000/durability
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use durability::fanout::{
    EnqueueOptions, EnqueueResult, Fanout, FanoutError, FanoutInput, FanoutMessage, Target,
};
use durability::platform::{Context, params};
use durability::routing::{CallContext, RoutingClient, RoutingTarget, ShardCaller};
use durability::{HandlerError, Scheduler};
use durability_axum::{Admin, AdminError, Dashboard};
use durability_host::{
    AlarmInfo, BoxError, CallError, DurableObject, Host, HostError, Namespace, ObjectContext,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// One mail, as the API accepts it and the fanout stores it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Mail {
    to: String,
    subject: String,
}

// ------------------------------------------------------------- the object

/// A mailbox shard. Its capabilities are built in its constructor, so an
/// alarm that wakes it finds its scheduler and fanout already there.
/// Objects are not `Send`: they live on one executor thread of the host.
struct Mailbox {
    scheduler: Scheduler,
    fanout: Fanout<Mail>,
}

impl Mailbox {
    fn new(ctx: ObjectContext) -> Result<Mailbox, BoxError> {
        ctx.storage().execute_script(
            "CREATE TABLE IF NOT EXISTS inbox (id TEXT PRIMARY KEY, recipient TEXT, subject TEXT)",
        )?;
        let ctx = ctx.into_dyn();
        let scheduler = Scheduler::new(Rc::clone(&ctx))?;
        let inbox_ctx = Rc::clone(&ctx);
        let fanout = Fanout::<Mail>::builder(&scheduler)
            .target(
                "inbox",
                Target::consumer(move |batch: Vec<FanoutMessage<Mail>>| {
                    let ctx = Rc::clone(&inbox_ctx);
                    async move {
                        for message in &batch {
                            if message.body.to.starts_with("nobody@") {
                                let _ = message.dead_letter().await;
                                continue;
                            }
                            // Idempotent: a redelivery after a crash files
                            // the same row once.
                            ctx.storage().execute(
                                "INSERT OR IGNORE INTO inbox (id, recipient, subject) VALUES (?1, ?2, ?3)",
                                &params![
                                    message.id.as_str(),
                                    message.body.to.as_str(),
                                    message.body.subject.as_str()
                                ],
                            )?;
                        }
                        Ok::<_, HandlerError>(())
                    }
                })
                .ack_on_return(true),
            )
            .max_attempts(5)
            .build()?;
        Ok(Mailbox { scheduler, fanout })
    }
}

impl DurableObject for Mailbox {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        Ok(self.scheduler.alarm(Some(info)).await?)
    }
}

// ------------------------------------------------------------- the client

#[derive(Debug, thiserror::Error)]
enum PushError {
    #[error(transparent)]
    Host(#[from] HostError),
    #[error(transparent)]
    Call(#[from] CallError),
    #[error(transparent)]
    Fanout(#[from] FanoutError),
}

/// How the routing client reaches a mailbox: one stub call per push. The
/// closure given to `call` is `Send` (it carries the mail); the future it
/// returns runs on the object's thread and need not be.
#[derive(Clone)]
struct Mailboxes(Namespace<Mailbox>);

impl ShardCaller for Mailboxes {
    type Input = Mail;
    type Output = EnqueueResult<Vec<String>>;
    type Error = PushError;

    fn call(
        &self,
        target: &RoutingTarget,
        mail: Mail,
        _: &CallContext,
    ) -> impl Future<Output = Result<Self::Output, PushError>> + Send {
        let stub = self.0.stub(&target.shard);
        async move {
            let reply = stub?
                .call(move |mailbox: Rc<Mailbox>| async move {
                    let input = FanoutInput::new(mail);
                    mailbox
                        .fanout
                        .enqueue(vec![input], &EnqueueOptions::all())
                        .await
                })
                .await??;
            Ok(reply)
        }
    }
}

// --------------------------------------------------------------- handlers

/// What the handlers share: `Send + Sync` handles only (stubs, the client).
#[derive(Clone)]
struct App {
    client: Arc<RoutingClient<Mailboxes>>,
}

async fn accept_mail(
    State(app): State<App>,
    Json(mail): Json<Mail>,
) -> (StatusCode, Json<serde_json::Value>) {
    if mail.to.is_empty() || !mail.to.contains('@') {
        let error = json!({ "error": "`to` must be an address" });
        return (StatusCode::UNPROCESSABLE_ENTITY, Json(error));
    }
    match app.client.push(mail, CallContext::new()).await {
        Ok(EnqueueResult::Accepted { value, .. }) => {
            (StatusCode::ACCEPTED, Json(json!({ "ids": value })))
        }
        Ok(EnqueueResult::Rejected { error, .. }) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({ "error": error.to_string() })),
        ),
        // The push may or may not have committed: the client may retry.
        Err(error) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "error": error.to_string() })),
        ),
    }
}

/// The admin actions wired to the mailboxes' fanout (only when a token is
/// configured).
fn admin(token: &str, mailboxes: &Namespace<Mailbox>) -> Result<Admin, BoxError> {
    let (redrive, purge) = (mailboxes.clone(), mailboxes.clone());
    Ok(Admin::new(token)?
        .on_redrive_parked(move |object, ids| {
            let stub = redrive.stub(object.name.as_deref().unwrap_or_default());
            async move {
                let stub = stub.map_err(|e| AdminError::new(e.to_string()))?;
                stub.call(move |mailbox: Rc<Mailbox>| async move {
                    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
                    match mailbox.fanout.redrive_parked(&ids).await {
                        Ok(EnqueueResult::Accepted { value, .. }) => Ok(value.len() as u64),
                        Ok(EnqueueResult::Rejected { error, .. }) => {
                            Err(AdminError::new(error.to_string()))
                        }
                        Err(error) => Err(AdminError::new(error.to_string())),
                    }
                })
                .await
                .map_err(|e| AdminError::new(e.to_string()))?
            }
        })
        .on_purge_parked(move |object, ids| {
            let stub = purge.stub(object.name.as_deref().unwrap_or_default());
            async move {
                let stub = stub.map_err(|e| AdminError::new(e.to_string()))?;
                stub.call(move |mailbox: Rc<Mailbox>| async move {
                    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
                    mailbox
                        .fanout
                        .purge_parked(&ids)
                        .map_err(|e| AdminError::new(e.to_string()))
                })
                .await
                .map_err(|e| AdminError::new(e.to_string()))?
            }
        }))
}

// ------------------------------------------------------------------- main

/// `--listen ADDR` (default 127.0.0.1:3000) and `--data-dir DIR` (default
/// a fresh temporary directory).
fn arguments() -> Result<(SocketAddr, Option<PathBuf>), BoxError> {
    let mut listen: SocketAddr = "127.0.0.1:3000".parse()?;
    let mut data_dir = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--listen", Some(addr)) => listen = addr.parse()?,
            ("--data-dir", Some(dir)) => data_dir = Some(PathBuf::from(dir)),
            _ => {
                return Err(format!(
                    "usage: axum_service [--listen ADDR] [--data-dir DIR]; got {arg:?}"
                )
                .into());
            }
        }
    }
    Ok((listen, data_dir))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let (listen, data_dir) = arguments()?;
    let temporary = tempfile::tempdir()?;
    let data_dir = data_dir.unwrap_or_else(|| temporary.path().to_path_buf());

    // The library reports through the `metrics` facade; the application
    // picks the exporter, before the host starts counting.
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;

    let host = Host::builder(&data_dir)
        .shutdown_grace(Duration::from_secs(10))
        .build()?;
    let mailboxes = host.namespace("mailbox", Mailbox::new)?;
    let clock = host.clone();
    let client =
        RoutingClient::builder(Mailboxes(mailboxes.clone()), move || clock.now_ms()).build()?;

    let mut dashboard = Dashboard::for_host(&host)
        .title("mail service")
        .prometheus(metrics);
    if let Ok(token) = std::env::var("DURABILITY_ADMIN_TOKEN") {
        dashboard = dashboard.admin(admin(&token, &mailboxes)?);
    }
    let app = Router::new()
        .route("/mail", post(accept_mail))
        .with_state(App {
            client: Arc::new(client),
        })
        .nest("/durability", dashboard.build()?);

    let listener = tokio::net::TcpListener::bind(listen).await?;
    eprintln!(
        "listening on http://{}/ (dashboard at /durability, data in {})",
        listener.local_addr()?,
        data_dir.display()
    );
    // Ctrl-C: stop accepting, let the requests in flight finish...
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("shutting down: finishing the requests in flight");
        })
        .await?;
    // ...then the host: calls and background work finish up to the grace,
    // and every object file is closed cleanly.
    host.shutdown().await;
    eprintln!("host shut down cleanly");
    Ok(())
}
