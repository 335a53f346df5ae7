//! The admin actions and their guard.
//!
//! The library cannot reach into an application's objects by itself (a
//! fanout lives inside the user's object type), so each action that needs
//! one is a closure the application gives: it receives the object the
//! operator chose and calls its stub, the same way a request handler does.
//! `evict` needs no closure: the dashboard evicts through the host.
//!
//! Every admin route needs `Authorization: Bearer <token>`. The token is
//! compared as SHA-256 digests with a constant-time equality, so neither
//! the content nor the length of the configured token leaks through the
//! time a refusal takes. There is no default token: without an [`Admin`]
//! the routes are not mounted at all.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use durability_platform::EpochMs;
use serde::Serialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::DashboardError;

/// The shortest admin token accepted, in bytes.
pub const MIN_TOKEN_BYTES: usize = 16;

/// The object an admin action is for, as its file records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ObjectRef {
    /// The object id.
    pub id: String,
    /// Its namespace.
    pub namespace: Option<String>,
    /// Its name (what `Namespace::stub` takes).
    pub name: Option<String>,
}

/// Why an admin action failed; its message is returned to the operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct AdminError {
    message: String,
}

impl AdminError {
    /// An error with `message`.
    pub fn new(message: impl Into<String>) -> Self {
        AdminError {
            message: message.into(),
        }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
/// An action over a list of parked delivery ids; returns how many it
/// changed.
pub(crate) type IdsAction =
    Arc<dyn Fn(ObjectRef, Vec<String>) -> BoxFuture<Result<u64, AdminError>> + Send + Sync>;
/// An action with a cutoff time; returns how many it removed.
type BeforeAction =
    Arc<dyn Fn(ObjectRef, EpochMs) -> BoxFuture<Result<u64, AdminError>> + Send + Sync>;

/// Enables the admin routes: a token and the actions the application
/// wires to its objects. Cloning is a few reference-count increments.
#[derive(Clone)]
pub struct Admin {
    token_digest: [u8; 32],
    pub(crate) redrive_parked: Option<IdsAction>,
    pub(crate) purge_parked: Option<IdsAction>,
    pub(crate) purge_operations: Option<BeforeAction>,
    /// Where `POST /api/backup` writes its backups, if enabled.
    pub(crate) backups: Option<PathBuf>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin")
            .field("redrive_parked", &self.redrive_parked.is_some())
            .field("purge_parked", &self.purge_parked.is_some())
            .field("purge_operations", &self.purge_operations.is_some())
            .field("backups", &self.backups)
            .finish_non_exhaustive()
    }
}

impl Admin {
    /// Admin routes guarded by `token` (at least [`MIN_TOKEN_BYTES`]
    /// bytes). Only `evict` is enabled until actions are added.
    pub fn new(token: impl AsRef<[u8]>) -> Result<Admin, DashboardError> {
        let token = token.as_ref();
        if token.len() < MIN_TOKEN_BYTES {
            return Err(DashboardError::Invalid {
                field: "admin token",
                rule: "must be at least 16 bytes",
            });
        }
        Ok(Admin {
            token_digest: Sha256::digest(token).into(),
            redrive_parked: None,
            purge_parked: None,
            purge_operations: None,
            backups: None,
        })
    }

    /// `POST /api/objects/{id}/parked/redrive` with `{"ids": [...]}` calls
    /// `action` (typically `Fanout::redrive_parked` through the object's
    /// stub).
    pub fn on_redrive_parked<F, Fut>(mut self, action: F) -> Self
    where
        F: Fn(ObjectRef, Vec<String>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<u64, AdminError>> + Send + 'static,
    {
        self.redrive_parked = Some(Arc::new(move |o, ids| Box::pin(action(o, ids))));
        self
    }

    /// `POST /api/objects/{id}/parked/purge` with `{"ids": [...]}` calls
    /// `action` (typically `Fanout::purge_parked`).
    pub fn on_purge_parked<F, Fut>(mut self, action: F) -> Self
    where
        F: Fn(ObjectRef, Vec<String>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<u64, AdminError>> + Send + 'static,
    {
        self.purge_parked = Some(Arc::new(move |o, ids| Box::pin(action(o, ids))));
        self
    }

    /// `POST /api/objects/{id}/operations/purge` with `{"before_ms": N}`
    /// calls `action` (typically `Operations::purge_before`).
    pub fn on_purge_operations<F, Fut>(mut self, action: F) -> Self
    where
        F: Fn(ObjectRef, EpochMs) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<u64, AdminError>> + Send + 'static,
    {
        self.purge_operations = Some(Arc::new(move |o, before| Box::pin(action(o, before))));
        self
    }

    /// `POST /api/backup` backs up every object of the data directory
    /// (`Host::backup` with a host, `durability_host::backup_dir`
    /// without) into a new directory `backup-<epoch ms>` under `dir`, and
    /// replies with `objects`, `bytes`, `seconds`, `manifest` and `dest`.
    /// The request names no path: only `dir`, chosen here, is written.
    pub fn backups_to(mut self, dir: impl Into<PathBuf>) -> Self {
        self.backups = Some(dir.into());
        self
    }

    /// Whether `presented` is the configured token, in time that does not
    /// depend on either token.
    pub(crate) fn accepts(&self, presented: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        bool::from(digest.ct_eq(&self.token_digest))
    }
}
