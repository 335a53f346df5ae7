//! `durability-axum`: an axum [`Router`] to mount in your own service, that
//! shows what the objects of a data directory hold and, if you enable it,
//! lets an operator act on them.
//!
//! - `GET /`: a server-rendered page (no JavaScript build step) listing
//!   every object and, per object, each capability's state: fanout backlog
//!   per target, parked dead letters with their last error, operations by
//!   status, upcoming named alarms, log bounds and consumer lag. A few lines
//!   of inline script re-fetch `GET /fragment` every
//!   [`DashboardBuilder::refresh_interval`] and swap it in, so the figures
//!   move without a full reload (the page works without script, too).
//! - `GET /api/objects` (`{"objects": [...]}`) and `GET /api/objects/{id}`:
//!   the same state as JSON; `GET /api/backup` the last backup of the data
//!   directory (`{"last_backup": ... | null}`), which the page shows too.
//! - `POST /api/backup` (admin, with [`Admin::backups_to`]): a backup of
//!   every object into a new directory, see `durability_host::backup`.
//! - `GET /api/archive`, with [`DashboardBuilder::archive`]: how far a
//!   continuous archive reaches and how far behind it is (`url`,
//!   `earliest_ms`, `through_ms`, `shipping`, `lag_seconds`, `lives`,
//!   `gaps`, `error`), read from its manifest; the page shows it too.
//! - Admin actions, only when [`DashboardBuilder::admin`] was given an
//!   [`Admin`]: every one is a `POST` that needs `Authorization: Bearer
//!   <token>`, compared in constant time. Without an `Admin` the routes do
//!   not exist (404).
//! - `GET /metrics` in Prometheus text format, with the `prometheus`
//!   feature and [`DashboardBuilder::prometheus`].
//!
//! The state is read from the object files through read-only connections
//! (`durability_host::inspect`), so the page never constructs an object,
//! never wakes an evicted one, and works the same over a running host's
//! directory and over a directory no process serves (`durability serve`).
//!
//! ```no_run
//! # async fn example(host: durability_host::Host) -> Result<(), Box<dyn std::error::Error>> {
//! use durability_axum::{Admin, Dashboard};
//!
//! let dashboard = Dashboard::for_host(&host)
//!     .title("mail service")
//!     .admin(Admin::new(std::env::var("DURABILITY_ADMIN_TOKEN")?)?)
//!     .build()?;
//! let app = axum::Router::new().nest("/durability", dashboard);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod admin;
mod page;
mod routes;
mod view;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use durability_host::Host;
use durability_host::archive::Archive;

pub use admin::{Admin, AdminError, ObjectRef};
pub use view::{ObjectView, Overview, objects, overview};

/// How often the page refreshes its figures by default.
pub const DEFAULT_REFRESH_INTERVAL: Duration = Duration::from_secs(2);
/// The shortest refresh interval accepted.
pub const MIN_REFRESH_INTERVAL: Duration = Duration::from_millis(250);
/// The longest refresh interval accepted.
pub const MAX_REFRESH_INTERVAL: Duration = Duration::from_secs(3_600);
/// The page's title by default.
pub const DEFAULT_TITLE: &str = "durability";

/// Why a dashboard could not be built.
#[derive(Debug, thiserror::Error)]
pub enum DashboardError {
    /// A setting is out of its bounds.
    #[error("invalid dashboard setting `{field}`: {rule}")]
    Invalid {
        /// The builder setting.
        field: &'static str,
        /// The rule it broke.
        rule: &'static str,
    },
}

/// Builds the dashboard's [`Router`].
pub struct Dashboard;

impl Dashboard {
    /// A read-only dashboard over a data directory no host of this process
    /// serves (what `durability serve` mounts). `evict` is not available.
    pub fn builder(data_dir: impl Into<PathBuf>) -> DashboardBuilder {
        DashboardBuilder {
            data_dir: data_dir.into(),
            host: None,
            title: DEFAULT_TITLE.to_owned(),
            refresh: DEFAULT_REFRESH_INTERVAL,
            admin: None,
            archive: None,
            #[cfg(feature = "prometheus")]
            prometheus: None,
        }
    }

    /// A dashboard over `host`'s data directory. With an [`Admin`], the
    /// `evict` action evicts through this host.
    pub fn for_host(host: &Host) -> DashboardBuilder {
        let mut builder = Dashboard::builder(host.data_dir());
        builder.host = Some(host.clone());
        builder
    }
}

/// Settings of the dashboard; [`build`](Self::build) validates them.
pub struct DashboardBuilder {
    data_dir: PathBuf,
    host: Option<Host>,
    title: String,
    refresh: Duration,
    admin: Option<Admin>,
    archive: Option<Arc<Archive>>,
    #[cfg(feature = "prometheus")]
    prometheus: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

impl DashboardBuilder {
    /// The page's title (default [`DEFAULT_TITLE`]); 1 to 200 characters.
    pub fn title(mut self, title: impl Into<String>) -> Self {
        self.title = title.into();
        self
    }

    /// How often the page re-fetches its figures (default
    /// [`DEFAULT_REFRESH_INTERVAL`], between [`MIN_REFRESH_INTERVAL`] and
    /// [`MAX_REFRESH_INTERVAL`]).
    pub fn refresh_interval(mut self, interval: Duration) -> Self {
        self.refresh = interval;
        self
    }

    /// Enables the admin routes, guarded by `admin`'s token (default: off).
    pub fn admin(mut self, admin: Admin) -> Self {
        self.admin = Some(admin);
        self
    }

    /// Shows the continuous archive `archive` on the page and at `GET
    /// /api/archive`: how far back it reaches, up to when, and how far
    /// behind the host shipping to it is, as its manifest tells (read at
    /// each request; default: no archive shown). This is how
    /// `durability serve --archive URL` watches a host of another process.
    pub fn archive(mut self, archive: Archive) -> Self {
        self.archive = Some(Arc::new(archive));
        self
    }

    /// Serves `GET /metrics` from `handle` (default: no `/metrics` route).
    /// Install the recorder yourself (`PrometheusBuilder::install_recorder`)
    /// so that the library's metrics reach it.
    #[cfg(feature = "prometheus")]
    pub fn prometheus(mut self, handle: metrics_exporter_prometheus::PrometheusHandle) -> Self {
        self.prometheus = Some(handle);
        self
    }

    /// Validates the settings and returns the router, ready to `nest` or
    /// `merge` into an application's router.
    pub fn build(self) -> Result<Router, DashboardError> {
        let chars = self.title.chars().count();
        if chars == 0 || chars > 200 {
            return Err(DashboardError::Invalid {
                field: "title",
                rule: "must be 1 to 200 characters",
            });
        }
        if self.refresh < MIN_REFRESH_INTERVAL || self.refresh > MAX_REFRESH_INTERVAL {
            return Err(DashboardError::Invalid {
                field: "refresh_interval",
                rule: "must be between 250 ms and 1 hour",
            });
        }
        let state = Arc::new(routes::State {
            data_dir: self.data_dir,
            host: self.host,
            title: self.title,
            refresh: self.refresh,
            admin: self.admin,
            archive: self.archive,
            #[cfg(feature = "prometheus")]
            prometheus: self.prometheus,
        });
        Ok(routes::router(state))
    }
}

/// The Rust excerpts of `docs/axum.md`, compiled as doctests of this crate:
/// they use the dashboard and axum, which the `durability` crate (where the
/// rest of the guide is compiled) does not depend on.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/axum.md")]
mod guide_axum {}
