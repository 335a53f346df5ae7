//! The conformance scenarios on the embedded host: the same bodies that
//! `scripts/workerd-conformance` runs inside workerd.

use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Duration;

use durability_conformance::scenarios::{self, Driver};
use durability_conformance::{Command, Fixture};
use durability_host::{AlarmInfo, BoxError, DurableObject, Host, Namespace};
use durability_platform::LocalBoxFuture;
use serde_json::Value;

struct HostFixture(Fixture);

impl DurableObject for HostFixture {
    async fn alarm(&self, info: AlarmInfo) -> Result<(), BoxError> {
        self.0.alarm(info).await.map_err(BoxError::from)
    }
}

struct HostDriver {
    dir: PathBuf,
    running: RefCell<Option<(Host, Namespace<HostFixture>)>>,
}

impl HostDriver {
    fn open(dir: PathBuf) -> Result<(Host, Namespace<HostFixture>), String> {
        let host = Host::builder(&dir)
            .threads(2)
            .build()
            .map_err(|e| e.to_string())?;
        let namespace = host
            .namespace("conformance", |ctx| {
                Fixture::new(ctx.into_dyn())
                    .map(HostFixture)
                    .map_err(BoxError::from)
            })
            .map_err(|e| e.to_string())?;
        Ok((host, namespace))
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
                let (_, namespace) = running.as_ref().ok_or("the host is not running")?;
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

    fn restart(&self) -> LocalBoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let old = self.running.borrow_mut().take();
            if let Some((host, _)) = old {
                // In-process, the closest to a kill: in-memory timers and
                // tasks are dropped; only storage and the alarm index stay.
                host.shutdown().await;
                drop(host);
            }
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
    let mut failures = Vec::new();
    for (name, scenario) in scenarios::ALL {
        if let Err(error) = scenario(&driver, name).await {
            failures.push(format!("{name}: {error}"));
        }
    }
    assert!(
        failures.is_empty(),
        "failed scenarios:\n{}",
        failures.join("\n")
    );
}
