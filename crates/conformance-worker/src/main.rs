//! The workerd conformance runner.
//!
//! `workerd-conformance WORKERD BUILD_DIR` starts the real `workerd` binary
//! on 127.0.0.1 (a free port) with the test worker in `BUILD_DIR` (made by
//! `scripts/build-worker`) and a fresh local disk directory for Durable
//! Object storage, runs every scenario of `durability_conformance` against
//! it over HTTP, and stops it by its process id. A restart is a SIGKILL of
//! that process and a new one on the same directory. The last line is
//! `N passed, N failed`; the exit code is non-zero on any failure.

#[path = "workerd.rs"]
mod workerd;

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use durability_conformance::Command;
use durability_conformance::scenarios::{self, Driver};
use durability_platform::LocalBoxFuture;
use serde_json::Value;

use workerd::{Namespace, Workerd};

/// The test worker's Durable Object class and binding.
const NAMESPACE: Namespace = Namespace {
    class: "ConformanceObject",
    binding: "CONFORMANCE",
};

/// The scenarios' driver: commands go to `/object/<name>` as JSON.
struct Conformance(Workerd);

fn call(workerd: &Workerd, object: &str, command: &Command) -> Result<Value, String> {
    let body = serde_json::to_string(command).map_err(|e| e.to_string())?;
    let (status, answer) = workerd.request(&format!("/object/{object}"), Some(body))?;
    match (answer.get("ok"), answer.get("error")) {
        (Some(ok), _) => Ok(ok.clone()),
        (_, Some(error)) => Err(format!("{command:?}: {error}")),
        _ => Err(format!("{command:?}: HTTP {status}: {answer}")),
    }
}

impl Driver for Conformance {
    fn call<'a>(
        &'a self,
        object: &'a str,
        command: Command,
    ) -> LocalBoxFuture<'a, Result<Value, String>> {
        Box::pin(async move { call(&self.0, object, &command) })
    }

    fn sleep(&self, duration: Duration) -> LocalBoxFuture<'_, ()> {
        Box::pin(async move { std::thread::sleep(duration) })
    }

    fn restart_after(&self, downtime: Duration) -> LocalBoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            self.0.kill()?;
            std::thread::sleep(downtime);
            self.0.start()
        })
    }
}

fn run() -> Result<(usize, usize), String> {
    let mut args = std::env::args().skip(1);
    let (Some(binary), Some(build)) = (args.next(), args.next()) else {
        return Err("usage: workerd-conformance WORKERD BUILD_DIR".into());
    };
    let driver = Conformance(Workerd::launch(
        Path::new(&binary),
        Path::new(&build),
        &NAMESPACE,
    )?);
    println!(
        "workerd on 127.0.0.1:{}, storage in {}",
        driver.0.port(),
        driver.0.storage_dir().display()
    );
    let (mut passed, mut failed) = (0, 0);
    // `CONFORMANCE_ONLY=name,name` runs only those scenarios, as on the host.
    let only = std::env::var("CONFORMANCE_ONLY").ok();
    for (name, scenario) in scenarios::ALL {
        if only
            .as_deref()
            .is_some_and(|only| !only.split(',').any(|n| n == *name))
        {
            continue;
        }
        let started = Instant::now();
        match futures::executor::block_on(scenario(&driver, name)) {
            Ok(()) => {
                passed += 1;
                println!("ok     {name} ({:.1} s)", started.elapsed().as_secs_f64());
            }
            Err(error) => {
                failed += 1;
                println!(
                    "FAILED {name} ({:.1} s): {error}",
                    started.elapsed().as_secs_f64()
                );
            }
        }
    }
    driver.0.kill()?;
    if failed > 0 {
        println!("--- last lines of the workerd log ---");
        for line in driver.0.log_tail(80) {
            println!("{line}");
        }
    }
    Ok((passed, failed))
}

fn main() -> ExitCode {
    match run() {
        Ok((passed, failed)) => {
            println!("{passed} passed, {failed} failed");
            if failed == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("workerd-conformance: {error}");
            println!("0 passed, 1 failed");
            ExitCode::FAILURE
        }
    }
}
