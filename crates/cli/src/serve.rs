//! `durability serve DATA_DIR --listen ADDR`, and the dashboard that
//! `durability demo --serve ADDR` mounts.
//!
//! `serve` shows the read-only view of a data directory for when no
//! application is running (or one is: it takes no lock and opens every
//! object file read-only, so it constructs no object and changes nothing).
//! `/` is the page and `/api/objects` the JSON (`{"objects": [...]}`); there
//! is no admin route, since no host of this process could act.
//!
//! `serve DATA_DIR --archive URL` also watches the continuous archive that
//! a host of another process ships to `URL` (`HostBuilder::archive`, or
//! `durability demo --archive URL`): the page and `/api/archive` say how
//! far back it reaches, up to when, and how far behind it is, read from
//! its manifest. Shipping itself happens in the process that runs the
//! host, since only it sees the journal's passes as they become durable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use axum::Router;
use durability_axum::{Dashboard, DashboardError};
use durability_host::archive::Archive;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Arguments of `durability serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The data directory to show (as given to `durability demo --data-dir`).
    #[arg(value_name = "DATA_DIR")]
    data_dir: PathBuf,
    /// The address to listen on.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Also show the continuous archive at URL (`file:///DIR` or
    /// `s3://bucket/prefix`, credentials and endpoint from the AWS
    /// environment variables): how far back it reaches and how far behind
    /// it is, on the page and at `/api/archive`.
    #[arg(long, value_name = "URL")]
    archive: Option<String>,
}

/// Why the dashboard could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot start the tokio runtime")]
    Runtime {
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a readable directory", dir.display())]
    DataDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid --archive {url:?}")]
    Archive {
        url: String,
        #[source]
        source: durability_host::archive::ArchiveError,
    },
    #[error("cannot build the dashboard")]
    Dashboard {
        #[source]
        source: DashboardError,
    },
    #[error("cannot install the Prometheus recorder")]
    Metrics {
        #[source]
        source: metrics_exporter_prometheus::BuildError,
    },
    #[error("the HTTP server failed")]
    Server {
        #[source]
        source: std::io::Error,
    },
    #[error("cannot listen for Ctrl-C")]
    Signal {
        #[source]
        source: std::io::Error,
    },
}

/// Runs `durability serve` until Ctrl-C; prints nothing on stdout.
pub fn run(args: &ServeArgs) -> Result<String, ServeError> {
    let dir = &args.data_dir;
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(ServeError::DataDir {
                dir: dir.clone(),
                source: std::io::Error::other("not a directory"),
            });
        }
        Err(source) => {
            return Err(ServeError::DataDir {
                dir: dir.clone(),
                source,
            });
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| ServeError::Runtime { source })?;
    let archive = args
        .archive
        .as_deref()
        .map(|url| {
            Archive::open_url(url).map_err(|source| ServeError::Archive {
                url: url.to_owned(),
                source,
            })
        })
        .transpose()?;
    runtime.block_on(async {
        let mut builder = Dashboard::builder(dir).title(format!("durability · {}", dir.display()));
        if let Some(archive) = archive {
            builder = builder.archive(archive);
        }
        let router = builder
            .build()
            .map_err(|source| ServeError::Dashboard { source })?;
        let serving = Serving::start(args.listen, router).await?;
        eprintln!(
            "serving the read-only view of {} at http://{}/ (JSON at /api/objects); Ctrl-C stops",
            dir.display(),
            serving.addr
        );
        tokio::signal::ctrl_c()
            .await
            .map_err(|source| ServeError::Signal { source })?;
        serving.stop().await?;
        Ok(String::new())
    })
}

/// Installs the process-wide Prometheus recorder, so that the library's
/// metrics reach `GET /metrics`, and keeps its histograms trimmed.
pub fn install_metrics() -> Result<PrometheusHandle, ServeError> {
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|source| ServeError::Metrics { source })?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// A server running in the background until [`Serving::stop`].
pub struct Serving {
    pub addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Serving {
    /// Binds `addr` and serves `router` on it.
    pub async fn start(addr: SocketAddr, router: Router) -> Result<Serving, ServeError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Listen { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| ServeError::Listen { addr, source })?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
        });
        Ok(Serving { addr, stop, task })
    }

    /// Stops accepting, lets requests in flight finish, and returns.
    pub async fn stop(self) -> Result<(), ServeError> {
        let _ = self.stop.send(());
        match self.task.await {
            Ok(result) => result.map_err(|source| ServeError::Server { source }),
            Err(join) => Err(ServeError::Server {
                source: std::io::Error::other(join.to_string()),
            }),
        }
    }
}
