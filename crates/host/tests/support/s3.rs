//! A real S3-compatible server for the archive's tests: moto's server
//! (`moto[server]` from PyPI, installed by `scripts/s3-test-server` into
//! the target directory), started on 127.0.0.1 at a free port and stopped
//! by its pid when the handle drops. Never a mock of the API: the archive
//! talks to it through the same S3 client as to AWS.
//!
//! Shared by the host's and the CLI's tests (the CLI's include this file
//! by path). If the server cannot be installed or started, the test
//! fails with the reason: it never skips.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::TryStreamExt as _;
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::{ObjectStore as _, ObjectStoreExt as _};

/// How long an installed server may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A running moto server.
pub struct S3Server {
    child: Child,
    port: u16,
}

/// The repository's root, from this crate's manifest directory.
fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|dir| dir.join("scripts/s3-test-server").is_file())
        .expect("the repository holds scripts/s3-test-server")
        .to_path_buf()
}

/// Installs the server if needed; its command's path.
fn moto_server() -> PathBuf {
    let script = repository().join("scripts/s3-test-server");
    let out = Command::new(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed ({}): the S3 tests need moto's server from PyPI",
        script.display(),
        out.status
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// A port nothing listens on now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}

impl S3Server {
    /// Starts a server on a free port.
    pub fn start() -> S3Server {
        S3Server::start_on(free_port())
    }

    /// Starts a server on `port` (for a test that points a client there
    /// before anything listens).
    pub fn start_on(port: u16) -> S3Server {
        let program = moto_server();
        let child = Command::new(&program)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
        let mut server = S3Server { child, port };
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("moto_server exited before it listened: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "moto_server did not listen on 127.0.0.1:{port} within {START_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        endpoint(self.port)
    }

    /// Creates a bucket (moto takes an unsigned request for it).
    pub fn create_bucket(&self, bucket: &str) {
        let url = format!("{}/{bucket}", self.endpoint());
        ureq::put(&url)
            .send_empty()
            .unwrap_or_else(|e| panic!("PUT {url}: {e}"));
    }

    /// A client of `bucket` with the test's credentials, and a runtime to
    /// drive it: the bytes of the archive as the store holds them.
    fn client(&self, bucket: &str) -> (AmazonS3, tokio::runtime::Runtime) {
        let mut builder = AmazonS3Builder::new().with_bucket_name(bucket);
        for (key, value) in aws_env(self.port) {
            let key: AmazonS3ConfigKey = key.to_ascii_lowercase().parse().unwrap();
            builder = builder.with_config(key, value);
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        (builder.build().unwrap(), runtime)
    }

    /// Writes an object's bytes directly (to damage one, say).
    pub fn put(&self, bucket: &str, key: &str, bytes: &[u8]) {
        let (s3, runtime) = self.client(bucket);
        runtime
            .block_on(s3.put(&key.into(), bytes.to_vec().into()))
            .unwrap_or_else(|e| panic!("PUT {key}: {e}"));
    }

    /// Reads an object's bytes directly.
    pub fn get(&self, bucket: &str, key: &str) -> Vec<u8> {
        let (s3, runtime) = self.client(bucket);
        runtime
            .block_on(async { s3.get(&key.into()).await?.bytes().await })
            .unwrap_or_else(|e| panic!("GET {key}: {e}"))
            .to_vec()
    }

    /// The keys under `prefix`, sorted.
    pub fn keys(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let (s3, runtime) = self.client(bucket);
        let mut keys: Vec<String> = runtime
            .block_on(s3.list(Some(&prefix.into())).try_collect::<Vec<_>>())
            .unwrap_or_else(|e| panic!("LIST {prefix}: {e}"))
            .into_iter()
            .map(|meta| meta.location.to_string())
            .collect();
        keys.sort();
        keys
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        // By its pid (Child::kill sends SIGKILL to it), then reaped.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `http://127.0.0.1:PORT`.
pub fn endpoint(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

/// The AWS environment an S3 client needs to reach a server on `port`:
/// what an operator sets for a self-hosted S3-compatible store.
pub fn aws_env(port: u16) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL", endpoint(port)),
        ("AWS_ALLOW_HTTP", "true".into()),
        ("AWS_ACCESS_KEY_ID", "durability-test".into()),
        ("AWS_SECRET_ACCESS_KEY", "durability-test-secret".into()),
        ("AWS_REGION", "us-east-1".into()),
    ]
}
