//! Fixtures of the dashboard tests: a real threaded host over a temp dir
//! with one "shop" object that uses every capability, a real HTTP server on
//! 127.0.0.1 serving the dashboard, and a plain HTTP client.

#![allow(dead_code)] // each test binary uses a different part of the support module

use std::rc::Rc;
use std::time::Duration;

use axum::Router;
use durability::fanout::{EnqueueOptions, Fanout, FanoutInput, FanoutMessage, Target};
use durability::log::AppendRecord;
use durability::{AlarmCall, Alarms, DurableCall, HandlerError, Log, Operations, Scheduler};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, Namespace, ObjectContext};
use tempfile::TempDir;
use tokio::sync::oneshot;

/// An object with a fanout, operations, named alarms and a log.
pub struct Shop {
    scheduler: Scheduler,
    pub fanout: Fanout<String>,
    pub ops: Operations,
    pub alarms: Alarms,
    pub log: Log<String>,
}

impl DurableObject for Shop {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        self.scheduler
            .alarm(Some(info))
            .await
            .map_err(|e| Box::new(e) as BoxError)
    }
}

fn build(ctx: ObjectContext) -> Result<Shop, BoxError> {
    let scheduler = Scheduler::new(ctx.into_dyn())?;
    let fanout = Fanout::<String>::builder(&scheduler)
        .target(
            "inbox",
            Target::consumer(|batch: Vec<FanoutMessage<String>>| {
                let settlements: Vec<_> = batch
                    .iter()
                    .map(|m| match m.body.as_str() {
                        "poison" => m.dead_letter(),
                        "slow" => m.retry_after(Duration::from_secs(3_600)),
                        _ => m.ack(),
                    })
                    .collect();
                async move {
                    for s in settlements {
                        s.await.map_err(|e| HandlerError::new(e.to_string()))?;
                    }
                    Ok(())
                }
            }),
        )
        .build()?;
    let ops = Operations::builder(&scheduler)
        .handler("charge", |call: DurableCall<String>| async move {
            if call.payload == "declined" {
                Err(HandlerError::non_retryable("card <declined>"))
            } else {
                Ok(())
            }
        })
        .build()?;
    let alarms = Alarms::builder(&scheduler)
        .handler("cleanup", |_: AlarmCall| async {
            Ok::<_, HandlerError>(())
        })
        .build()?;
    let log = Log::<String>::builder(&scheduler).build()?;
    Ok(Shop {
        scheduler,
        fanout,
        ops,
        alarms,
        log,
    })
}

/// A host with one populated "shop-1" object.
pub struct World {
    pub host: Host,
    pub shops: Namespace<Shop>,
    pub dir: TempDir,
    pub id: String,
}

impl World {
    /// Builds the host and fills shop-1: a parked delivery, a delivery
    /// waiting for its retry, a completed and a failed operation, an alarm
    /// in an hour, a log of three records with a consumer at offset 1.
    pub async fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let host = Host::builder(dir.path()).threads(1).build().unwrap();
        let shops = host.namespace("shops", build).unwrap();
        let stub = shops.stub("shop-1").unwrap();
        stub.call(|shop: Rc<Shop>| async move {
            let inputs = ["fine", "poison", "slow"]
                .map(|body| FanoutInput::new(body.to_owned()).id(format!("order-{body}")))
                .to_vec();
            shop.fanout
                .enqueue(inputs, &EnqueueOptions::all())
                .await
                .unwrap()
                .accepted()
                .unwrap();
            shop.ops.start("charge", "pay-1", "ok").await.unwrap();
            shop.ops.start("charge", "pay-2", "declined").await.unwrap();
            let at = shop.scheduler.now_ms() + 3_600_000;
            shop.alarms.schedule("cleanup", at).await.unwrap();
            shop.log
                .append(
                    ["a", "b", "c"]
                        .map(|s| AppendRecord::new(s.to_owned()))
                        .to_vec(),
                )
                .await
                .unwrap();
            shop.log.commit("indexer", 1).await.unwrap();
        })
        .await
        .unwrap();
        // Let the first deliveries and the operations settle.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let id = stub.id().to_string();
        World {
            host,
            shops,
            dir,
            id,
        }
    }
}

/// A dashboard served on 127.0.0.1 by a real server; stopped on drop.
pub struct Server {
    pub base: String,
    stop: Option<oneshot::Sender<()>>,
}

impl Server {
    pub async fn start(router: Router) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        Server {
            base: format!("http://{addr}"),
            stop: Some(stop),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A response: status, content type, body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub content_type: String,
    pub body: String,
    pub www_authenticate: Option<String>,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

fn reply(response: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Reply {
    let mut response = response.unwrap();
    let header = |name| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let content_type = header("content-type").unwrap_or_default();
    let www_authenticate = header("www-authenticate");
    Reply {
        status: response.status().as_u16(),
        content_type,
        www_authenticate,
        body: response.body_mut().read_to_string().unwrap(),
    }
}

/// `GET url`, on the blocking pool.
pub async fn get(url: String) -> Reply {
    tokio::task::spawn_blocking(move || reply(agent().get(&url).call()))
        .await
        .unwrap()
}

/// `POST url` with a JSON body and an optional bearer token.
pub async fn post(url: String, token: Option<&str>, body: &str) -> Reply {
    let token = token.map(str::to_owned);
    let body = body.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut request = agent().post(&url).content_type("application/json");
        if let Some(token) = token {
            request = request.header("Authorization", &format!("Bearer {token}"));
        }
        reply(request.send(body.as_str()))
    })
    .await
    .unwrap()
}
