//! The conformance scenarios on the embedded host: the same bodies that
//! `scripts/workerd-conformance` runs inside workerd.

use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durability_conformance::scenarios::{self, Driver};
use durability_conformance::{Command, Fixture, PeerCall, Peers};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, Namespace, StorageLimits};
use durability_platform::LocalBoxFuture;
use serde_json::Value;

struct HostFixture(Fixture);

impl DurableObject for HostFixture {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        self.0.alarm(info).await.map_err(BoxError::from)
    }
}

/// The namespace, once it exists, for objects that call other objects (the
/// routing client). Cleared at shutdown so no object keeps the host alive.
type Slot = Arc<Mutex<Option<Namespace<HostFixture>>>>;

/// Other objects of the namespace, reached by name through host stubs.
struct HostPeers(Slot);

impl Peers for HostPeers {
    fn call(&self, object: &str, command: Command) -> PeerCall {
        let stub = match self.0.lock() {
            Ok(slot) => slot.as_ref().map(|namespace| namespace.stub(object)),
            Err(_) => None,
        };
        Box::pin(async move {
            let stub = stub
                .ok_or("the host is shutting down")?
                .map_err(|e| e.to_string())?;
            stub.call(
                move |fixture: Rc<HostFixture>| async move { fixture.0.handle(command).await },
            )
            .await
            .map_err(|e| e.to_string())?
        })
    }
}

struct HostDriver {
    dir: PathBuf,
    running: RefCell<Option<(Host, Namespace<HostFixture>, Slot)>>,
}

impl HostDriver {
    fn open(dir: PathBuf) -> Result<(Host, Namespace<HostFixture>, Slot), String> {
        // Cloudflare's storage limits, so the limit scenarios meet the
        // same typed refusals as inside workerd.
        let host = Host::builder(&dir)
            .threads(2)
            .storage_limits(StorageLimits::CLOUDFLARE)
            .build()
            .map_err(|e| e.to_string())?;
        let slot: Slot = Arc::default();
        let peers = Arc::clone(&slot);
        let namespace = host
            .namespace("conformance", move |ctx| {
                Fixture::new(ctx.into_dyn(), Arc::new(HostPeers(Arc::clone(&peers))))
                    .map(HostFixture)
                    .map_err(BoxError::from)
            })
            .map_err(|e| e.to_string())?;
        if let Ok(mut guard) = slot.lock() {
            *guard = Some(namespace.clone());
        }
        Ok((host, namespace, slot))
    }
}

impl Driver for HostDriver {
    fn call<'a>(
        &'a self,
        object: &'a str,
        command: Command,
    ) -> LocalBoxFuture<'a, Result<Value, String>> {
        Box::pin(async move {
            let stub = {
                let running = self.running.borrow();
                let (_, namespace, _) = running.as_ref().ok_or("the host is not running")?;
                namespace.stub(object).map_err(|e| e.to_string())?
            };
            stub.call(
                move |fixture: Rc<HostFixture>| async move { fixture.0.handle(command).await },
            )
            .await
            .map_err(|e| e.to_string())?
        })
    }

    fn sleep(&self, duration: Duration) -> LocalBoxFuture<'_, ()> {
        Box::pin(tokio::time::sleep(duration))
    }

    fn restart_after(&self, downtime: Duration) -> LocalBoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let old = self.running.borrow_mut().take();
            if let Some((host, _, slot)) = old {
                if let Ok(mut guard) = slot.lock() {
                    guard.take();
                }
                // In-process, the closest to a kill: in-memory timers and
                // tasks are dropped; only storage and the alarm index stay.
                host.shutdown().await;
                drop(host);
            }
            tokio::time::sleep(downtime).await;
            *self.running.borrow_mut() = Some(Self::open(self.dir.clone())?);
            Ok(())
        })
    }
}

#[tokio::test(flavor = "current_thread")]
async fn every_conformance_scenario_passes_on_the_embedded_host() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let driver = HostDriver {
        dir: dir.path().to_path_buf(),
        running: RefCell::new(Some(
            HostDriver::open(dir.path().to_path_buf()).expect("host opens"),
        )),
    };
    // `CONFORMANCE_ONLY=name,name` runs only those scenarios.
    let only = std::env::var("CONFORMANCE_ONLY").ok();
    let mut failures = Vec::new();
    let mut ran = 0;
    for (name, scenario) in scenarios::ALL {
        if only
            .as_deref()
            .is_some_and(|only| !only.split(',').any(|n| n == *name))
        {
            continue;
        }
        ran += 1;
        let started = std::time::Instant::now();
        let outcome = scenario(&driver, name).await;
        eprintln!(
            "{} {name} ({:.1} s)",
            if outcome.is_ok() { "ok    " } else { "FAILED" },
            started.elapsed().as_secs_f64()
        );
        if let Err(error) = outcome {
            failures.push(format!("{name}: {error}"));
        }
    }
    eprintln!("{} passed, {} failed", ran - failures.len(), failures.len());
    assert!(
        failures.is_empty(),
        "failed scenarios:\n{}",
        failures.join("\n")
    );
}
