//! The conformance test worker: the shared [`Fixture`] as a Durable Object
//! (`ConformanceObject`), and a front Worker that forwards
//! `POST /object/<name>` with a JSON [`Command`] to the object named `<name>`.
//! Objects reach each other (the routing scenarios) through the same
//! binding, by name.
//!
//! Only the wasm32 build has content; `src/main.rs` is the runner.
#![cfg(target_arch = "wasm32")]

use std::rc::Rc;
use std::sync::Arc;

use durability_cloudflare::{AlarmInfo, CloudflareContext, DurableObject, durable_object};
use durability_conformance::{Command, Fixture, PeerCall, Peers};
use durability_platform::Context;
use serde_json::{Value, json};
use worker::send::SendFuture;
use worker::{Env, Method, Request, RequestInit, Response, event};

/// The Durable Object binding of the fixture class.
const BINDING: &str = "CONFORMANCE";

struct Conformance {
    fixture: Fixture,
}

/// Other fixture objects, reached by name through the binding, with the
/// same JSON commands the runner sends.
struct Binding(Env);

impl Peers for Binding {
    fn call(&self, object: &str, command: Command) -> PeerCall {
        let stub = self
            .0
            .durable_object(BINDING)
            .and_then(|namespace| namespace.get_by_name(object));
        // A Worker runs on one thread; the routing client asks for Send.
        Box::pin(SendFuture::new(async move {
            let stub = stub.map_err(|e| e.to_string())?;
            let body = serde_json::to_string(&command).map_err(|e| e.to_string())?;
            let mut init = RequestInit::new();
            init.with_method(Method::Post).with_body(Some(body.into()));
            let request = Request::new_with_init("https://conformance/object", &init)
                .map_err(|e| e.to_string())?;
            let mut response = stub
                .fetch_with_request(request)
                .await
                .map_err(|e| e.to_string())?;
            let text = response.text().await.map_err(|e| e.to_string())?;
            let answer: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
            match (answer.get("ok"), answer.get("error")) {
                (Some(ok), _) => Ok(ok.clone()),
                (_, Some(error)) => Err(error.to_string()),
                _ => Err(format!("unexpected answer: {answer}")),
            }
        }))
    }
}

impl DurableObject for Conformance {
    fn new(ctx: Rc<CloudflareContext>, env: Env) -> worker::Result<Self> {
        let limited = Rc::clone(&ctx);
        let ctx: Rc<dyn Context> = ctx;
        let fixture = Fixture::new(ctx, Arc::new(Binding(env)))
            .map_err(worker::Error::RustError)?
            .on_cpu_limit(move |limit| limited.set_invocation_cpu_limit(limit));
        Ok(Conformance { fixture })
    }

    async fn fetch(&self, mut req: Request) -> worker::Result<Response> {
        // Parsed in Rust: JSON.parse would round integers beyond 2^53.
        let text = req.text().await?;
        let command: Command = match serde_json::from_str(&text) {
            Ok(command) => command,
            Err(error) => {
                return Response::from_json(&json!({ "error": format!("bad command: {error}") }))
                    .map(|r| r.with_status(400));
            }
        };
        match self.fixture.handle(command).await {
            Ok(value) => Response::from_json(&json!({ "ok": value })),
            Err(error) => Response::from_json(&json!({ "error": error })),
        }
    }

    async fn alarm(&self, info: AlarmInfo) -> worker::Result<()> {
        self.fixture
            .alarm(info)
            .await
            .map_err(worker::Error::RustError)
    }
}

durable_object!(ConformanceObject, Conformance);

#[event(fetch)]
async fn fetch(req: Request, env: Env, _ctx: worker::Context) -> worker::Result<Response> {
    let path = req.path();
    let Some(name) = path.strip_prefix("/object/").filter(|n| !n.is_empty()) else {
        return Response::error("POST /object/<name> with a JSON command", 404);
    };
    let stub = env.durable_object(BINDING)?.get_by_name(name)?;
    stub.fetch_with_request(req).await
}
