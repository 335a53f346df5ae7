//! A mailbox service on Cloudflare: the shape of `durability demo`, with the
//! same capability code, inside Durable Objects.
//!
//! - [`mailbox`]: the `Mailbox` Durable Object, one shard (fanout to an
//!   inbox and to an archive log, a cleanup named alarm, digest operations).
//! - This module: the front Worker. `POST /mail` takes a JSON array of mails
//!   and pushes it through the routing client, which spreads producers over
//!   `shard-0 .. shard-N` and widens when a shard reports a backlog; `GET
//!   /stats?shards=N` sums the shards' stats; `POST /stamp?shard=K` and
//!   `POST /digest?shard=K` reach one shard (the benchmark's entry points).
//!
//! Only the wasm32 build has content. See README.md beside this crate for
//! running it under workerd locally and deploying it.
#![cfg(target_arch = "wasm32")]

mod mailbox;

use std::cell::OnceCell;

use durability::load::{LoadSnapshot, OutboundProcessing, Processing};
use durability::routing::{CallContext, ReportsLoad, RoutingClient, RoutingTarget, ShardCaller};
use durability_cloudflare::durable_object;
use serde_json::{Value, json};
use worker::send::SendFuture;
use worker::{Env, Method, Request, RequestInit, Response, event};

use mailbox::{Mail, Mailbox};

durable_object!(MailboxObject, Mailbox);

/// The Durable Object binding in wrangler.toml.
const BINDING: &str = "MAILBOX";

/// A shard's answer to `/push`: the enqueue result as JSON, and its load.
struct PushReply {
    body: Value,
    load: Option<LoadSnapshot>,
}

impl ReportsLoad for PushReply {
    fn load_snapshot(&self) -> Option<LoadSnapshot> {
        self.load
    }
}

#[derive(Debug)]
struct CallFailed(String);

impl std::fmt::Display for CallFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CallFailed {}

/// Reaches mailbox shards through the Durable Object namespace.
struct Shards {
    env: Env,
}

impl ShardCaller for Shards {
    type Input = Vec<Mail>;
    type Output = PushReply;
    type Error = CallFailed;

    fn call(
        &self,
        target: &RoutingTarget,
        input: Vec<Mail>,
        _context: &CallContext,
    ) -> impl Future<Output = Result<PushReply, CallFailed>> + Send {
        let stub = self
            .env
            .durable_object(BINDING)
            .and_then(|namespace| namespace.get_by_name(&target.shard));
        // A Worker runs on one thread; the client asks for Send futures.
        SendFuture::new(async move {
            let stub = stub.map_err(|e| CallFailed(e.to_string()))?;
            let body = serde_json::to_string(&input).map_err(|e| CallFailed(e.to_string()))?;
            let mut init = RequestInit::new();
            init.with_method(Method::Post).with_body(Some(body.into()));
            let request = Request::new_with_init("https://mailbox/push", &init)
                .map_err(|e| CallFailed(e.to_string()))?;
            let mut response = stub
                .fetch_with_request(request)
                .await
                .map_err(|e| CallFailed(e.to_string()))?;
            let body: Value = response
                .json()
                .await
                .map_err(|e| CallFailed(e.to_string()))?;
            let load = load_from_json(&body["load"]);
            Ok(PushReply { body, load })
        })
    }
}

/// A load snapshot from its JSON shape (the reference library's camelCase).
fn load_from_json(load: &Value) -> Option<LoadSnapshot> {
    let processing = |p: &Value| {
        Some(Processing {
            in_flight: p["inFlight"].as_u64()?,
            completed: p["completed"].as_u64()?,
            average_processing_ms: p["averageProcessingMs"].as_f64(),
        })
    };
    let inbound = processing(&load["inbound"])?;
    let outbound = &load["outbound"];
    Some(LoadSnapshot {
        observed_at: load["observedAt"].as_i64()?,
        window_ms: load["windowMs"].as_u64()?,
        inbound,
        outbound: OutboundProcessing {
            in_flight: outbound["inFlight"].as_u64()?,
            completed: outbound["completed"].as_u64()?,
            average_processing_ms: outbound["averageProcessingMs"].as_f64(),
            pending_deliveries: outbound["pendingDeliveries"].as_u64()?,
        },
    })
}

thread_local! {
    /// One routing client per isolate: its observations and width persist
    /// across the requests this isolate serves.
    static CLIENT: OnceCell<RoutingClient<Shards>> = const { OnceCell::new() };
}

fn client(env: &Env) -> worker::Result<RoutingClient<Shards>> {
    CLIENT.with(|cell| {
        if let Some(client) = cell.get() {
            return Ok(client.clone());
        }
        let clock = || {
            // Whole milliseconds, far below 2^53.
            #[allow(clippy::cast_possible_truncation)] // see above
            let now = worker::js_sys::Date::now() as i64;
            now
        };
        let client = RoutingClient::builder(Shards { env: env.clone() }, clock)
            .build()
            .map_err(|e| worker::Error::RustError(e.to_string()))?;
        Ok(cell.get_or_init(|| client).clone())
    })
}

/// The `shard` (default 0) and `shards` (default 1) query parameters.
fn query_number(req: &Request, name: &str, default: u64) -> worker::Result<u64> {
    let url = req.url()?;
    match url.query_pairs().find(|(key, _)| key == name) {
        None => Ok(default),
        Some((_, value)) => value.parse().map_err(|_| {
            worker::Error::RustError(format!("query parameter {name} must be a number"))
        }),
    }
}

async fn forward(
    env: &Env,
    shard: &str,
    path: &str,
    method: Method,
    body: Option<String>,
) -> worker::Result<Response> {
    let stub = env.durable_object(BINDING)?.get_by_name(shard)?;
    let mut init = RequestInit::new();
    init.with_method(method).with_body(body.map(Into::into));
    let request = Request::new_with_init(&format!("https://mailbox{path}"), &init)?;
    stub.fetch_with_request(request).await
}

#[event(fetch)]
async fn fetch(mut req: Request, env: Env, _ctx: worker::Context) -> worker::Result<Response> {
    match (req.method(), req.path().as_str()) {
        (Method::Post, "/mail") => {
            let mails: Vec<Mail> = match req.json().await {
                Ok(mails) => mails,
                Err(e) => return Response::error(format!("body: a JSON array of mails: {e}"), 400),
            };
            match client(&env)?.push(mails, CallContext::new()).await {
                Ok(reply) => Response::from_json(&reply.body),
                Err(error) => Response::error(error.to_string(), 502),
            }
        }
        (Method::Get, "/stats") => {
            let shards = query_number(&req, "shards", 1)?;
            let mut all = Vec::new();
            for n in 0..shards {
                let shard = durability::routing::shard_key(n);
                let mut response = forward(&env, &shard, "/stats", Method::Get, None).await?;
                let stats: Value = response.json().await?;
                all.push(json!({ "shard": shard, "stats": stats }));
            }
            Response::from_json(&all)
        }
        (Method::Post, path @ ("/stamp" | "/digest")) => {
            let shard = durability::routing::shard_key(query_number(&req, "shard", 0)?);
            let body = req.text().await?;
            forward(&env, &shard, path, Method::Post, Some(body)).await
        }
        _ => Response::error(
            "POST /mail, GET /stats?shards=N, POST /stamp?shard=K, POST /digest?shard=K",
            404,
        ),
    }
}
