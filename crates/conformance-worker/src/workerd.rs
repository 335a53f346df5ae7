//! One `workerd` process serving a worker built by `scripts/build-worker`,
//! on 127.0.0.1 with a local disk directory for Durable Object storage;
//! started, SIGKILLed and restarted by process id. Shared by the
//! conformance runner and the benchmark (`#[path]`-included by both).

use std::cell::RefCell;
use std::fs;
use std::io::Read as _;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Process, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long workerd may take to start listening (cold wasm compile included).
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// One workerd process serving the test worker.
/// The Durable Object class a worker exports, and its binding name.
pub struct Namespace {
    pub class: &'static str,
    pub binding: &'static str,
}

/// A workerd process (when started) and the scratch directory holding its
/// config, log and storage, removed on drop.
pub struct Workerd {
    binary: PathBuf,
    scratch: tempfile::TempDir,
    config: PathBuf,
    log: PathBuf,
    port: u16,
    child: RefCell<Option<Child>>,
}

impl Workerd {
    /// Writes the config for the worker in `build` with a fresh storage
    /// directory and a free port, and starts workerd.
    pub fn launch(binary: &Path, build: &Path, namespace: &Namespace) -> Result<Self, String> {
        let build = fs::canonicalize(build).map_err(|e| format!("{}: {e}", build.display()))?;
        let scratch = tempfile::tempdir().map_err(|e| e.to_string())?;
        let data = scratch.path().join("do-storage");
        fs::create_dir_all(&data).map_err(|e| e.to_string())?;
        let port = free_port()?;
        let config_path = build.join("workerd.capnp");
        let snippets = snippet_modules(&build)?;
        fs::write(&config_path, config(&data, port, namespace, &snippets))
            .map_err(|e| e.to_string())?;
        let workerd = Workerd {
            binary: binary.to_path_buf(),
            log: scratch.path().join("workerd.log"),
            scratch,
            config: config_path,
            port,
            child: RefCell::new(None),
        };
        workerd.start()?;
        Ok(workerd)
    }

    /// Where the Durable Objects' storage lives.
    pub fn storage_dir(&self) -> PathBuf {
        self.scratch.path().join("do-storage")
    }

    /// The port workerd listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Starts workerd and waits until it listens.
    pub fn start(&self) -> Result<(), String> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("workerd log {}: {e}", self.log.display()))?;
        let err_log = log.try_clone().map_err(|e| e.to_string())?;
        let child = Process::new(&self.binary)
            .arg("serve")
            .arg(&self.config)
            .arg("--verbose")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        *self.child.borrow_mut() = Some(child);
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while Instant::now() < deadline {
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            if let Some(child) = self.child.borrow_mut().as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(format!(
                    "workerd exited at start: {status}\n{}",
                    self.log_tail(40).join("\n")
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err("workerd did not listen in time".into())
    }

    /// SIGKILL by process id, then reap it.
    pub fn kill(&self) -> Result<(), String> {
        if let Some(mut child) = self.child.borrow_mut().take() {
            child
                .kill()
                .map_err(|e| format!("kill workerd {}: {e}", child.id()))?;
            child.wait().map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// `POST path` (or `GET` without a body) and the JSON answer.
    pub fn request(&self, path: &str, body: Option<String>) -> Result<(u16, Value), String> {
        let url = format!("http://127.0.0.1:{}{path}", self.port);
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        let mut response = match body {
            Some(body) => agent
                .post(&url)
                .header("content-type", "application/json")
                .send(body),
            None => agent.get(&url).call(),
        }
        .map_err(|e| format!("{url}: {e}"))?;
        let status = response.status().as_u16();
        let mut text = String::new();
        response
            .body_mut()
            .as_reader()
            .read_to_string(&mut text)
            .map_err(|e| e.to_string())?;
        let answer =
            serde_json::from_str(&text).map_err(|_| format!("{url}: HTTP {status}: {text}"))?;
        Ok((status, answer))
    }

    /// The last lines of workerd's log, for a failure report.
    pub fn log_tail(&self, lines: usize) -> Vec<String> {
        let log = fs::read_to_string(&self.log).unwrap_or_default();
        let mut tail: Vec<String> = log.lines().rev().take(lines).map(str::to_owned).collect();
        tail.reverse();
        tail
    }
}

impl Drop for Workerd {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// The capnp config: the worker, its Durable Object namespace with SQL,
/// and local disk storage in `data`. Embeds resolve relative to the config
/// file, which is written into the build directory beside them.
fn config(data: &Path, port: u16, namespace: &Namespace, snippets: &[String]) -> String {
    let embed = |file: &str| format!("{file:?}");
    let snippets: String = snippets
        .iter()
        .map(|name| format!("    (name = {name:?}, esModule = embed {}),\n", embed(name)))
        .collect();
    format!(
        r#"using Workerd = import "/workerd/workerd.capnp";

const config :Workerd.Config = (
  services = [
    (name = "main", worker = .worker),
    (name = "disk", disk = (path = {data:?}, writable = true)),
  ],
  sockets = [(name = "http", address = "127.0.0.1:{port}", http = (), service = "main")],
);

const worker :Workerd.Worker = (
  modules = [
    (name = "worker.mjs", esModule = embed {entry}),
    (name = "index.js", esModule = embed {glue}),
    (name = "index_bg.wasm", wasm = embed {wasm}),
{snippets}  ],
  compatibilityDate = "2025-09-01",
  durableObjectNamespaces = [
    (className = "{class}", uniqueKey = "durability-{class}", enableSql = true),
  ],
  durableObjectStorage = (localDisk = "disk"),
  bindings = [(name = "{binding}", durableObjectNamespace = "{class}")],
);
"#,
        data = data.display().to_string(),
        entry = embed("worker.mjs"),
        glue = embed("index.js"),
        wasm = embed("index_bg.wasm"),
        class = namespace.class,
        binding = namespace.binding,
    )
}

/// The JavaScript snippets wasm-bindgen wrote under `build/snippets/`
/// (inline JS of the crates), as module names relative to `build`.
fn snippet_modules(build: &Path) -> Result<Vec<String>, String> {
    let mut modules = Vec::new();
    let mut pending = vec![build.join("snippets")];
    while let Some(dir) = pending.pop() {
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("{}: {e}", dir.display())),
        };
        for entry in entries {
            let path = entry.map_err(|e| e.to_string())?.path();
            if path.is_dir() {
                pending.push(path);
            } else if let Ok(relative) = path.strip_prefix(build) {
                modules.push(relative.display().to_string());
            }
        }
    }
    modules.sort();
    Ok(modules)
}

fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}
