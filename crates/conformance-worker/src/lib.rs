//! The conformance test worker: the shared [`Fixture`] as a Durable Object
//! (`ConformanceObject`), and a front Worker that forwards
//! `POST /object/<name>` with a JSON [`Command`] to the object named `<name>`.
//!
//! Only the wasm32 build has content; `src/main.rs` is the runner.
#![cfg(target_arch = "wasm32")]

use std::rc::Rc;

use durability_cloudflare::{AlarmInfo, CloudflareContext, DurableObject, durable_object};
use durability_conformance::{Command, Fixture};
use durability_platform::Context;
use serde_json::json;
use worker::{Env, Request, Response, event};

struct Conformance {
    fixture: Fixture,
}

impl DurableObject for Conformance {
    fn new(ctx: Rc<CloudflareContext>, _env: Env) -> worker::Result<Self> {
        let ctx: Rc<dyn Context> = ctx;
        let fixture = Fixture::new(ctx).map_err(worker::Error::RustError)?;
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
    let stub = env.durable_object("CONFORMANCE")?.get_by_name(name)?;
    stub.fetch_with_request(req).await
}
