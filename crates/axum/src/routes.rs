//! The routes and their handlers. File reads run on tokio's blocking pool:
//! SQLite calls must not stall the application's async workers.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{OriginalUri, Path, State as Extract};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use durability_host::{Host, ObjectId};
use durability_platform::EpochMs;
use serde::Deserialize;
use serde_json::json;

use crate::admin::{Admin, IdsAction, ObjectRef};
use crate::page;
use crate::view::{self, ObjectView};

/// Everything a handler needs; shared by every request.
pub(crate) struct State {
    pub data_dir: PathBuf,
    pub host: Option<Host>,
    pub title: String,
    pub refresh: Duration,
    pub admin: Option<Admin>,
    pub archive: Option<Arc<durability_host::archive::Archive>>,
    #[cfg(feature = "prometheus")]
    pub prometheus: Option<metrics_exporter_prometheus::PrometheusHandle>,
}

type Shared = Arc<State>;

pub(crate) fn router(state: Shared) -> Router {
    let mut router = Router::new()
        .route("/", get(index))
        .route("/fragment", get(fragment))
        .route("/api/objects", get(list))
        .route("/api/objects/{id}", get(one));
    // One route per path: the admin's POST joins the GET on it.
    let backup_route = if state.admin.is_some() {
        get(last_backup).post(backup)
    } else {
        get(last_backup)
    };
    router = router.route("/api/backup", backup_route);
    if state.archive.is_some() {
        router = router.route("/api/archive", get(archive_status));
    }
    if state.admin.is_some() {
        router = router
            .route("/api/objects/{id}/evict", post(evict))
            .route("/api/objects/{id}/parked/redrive", post(redrive_parked))
            .route("/api/objects/{id}/parked/purge", post(purge_parked))
            .route("/api/objects/{id}/operations/purge", post(purge_operations));
    }
    #[cfg(feature = "prometheus")]
    if state.prometheus.is_some() {
        router = router.route("/metrics", get(metrics));
    }
    router.with_state(state)
}

/// Why a request was refused: sent as its status and `{"error": message}`
/// (with a `WWW-Authenticate: Bearer` challenge for a missing token).
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    message: String,
    challenge: bool,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let body = Json(json!({ "error": self.message }));
        if self.challenge {
            (self.status, [(header::WWW_AUTHENTICATE, "Bearer")], body).into_response()
        } else {
            (self.status, body).into_response()
        }
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        message: message.into(),
        challenge: false,
    }
}

async fn read_objects(state: &Shared) -> Result<Vec<ObjectView>, Refusal> {
    let dir = state.data_dir.clone();
    match tokio::task::spawn_blocking(move || view::objects(&dir)).await {
        Ok(Ok(objects)) => Ok(objects),
        Ok(Err(message)) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, message)),
        Err(join) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, join.to_string())),
    }
}

fn now_ms(state: &State) -> EpochMs {
    match &state.host {
        Some(host) => host.now_ms(),
        None => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
    }
}

/// The last backup the data directory records (a small file, read on the
/// blocking pool like the object files).
async fn read_last_backup(state: &Shared) -> Option<durability_host::backup::LastBackup> {
    let dir = state.data_dir.clone();
    tokio::task::spawn_blocking(move || durability_host::backup::last_backup(&dir))
        .await
        .ok()
        .flatten()
}

/// The archive's manifest (a small file, or one GET from object storage,
/// on the blocking pool).
async fn read_archive(state: &Shared) -> Option<page::ArchiveView> {
    let archive = Arc::clone(state.archive.as_ref()?);
    let url = archive.url();
    let manifest = tokio::task::spawn_blocking(move || archive.manifest())
        .await
        .map_err(|join| join.to_string())
        .and_then(|read| read.map_err(|e| e.to_string()));
    Some(page::ArchiveView { url, manifest })
}

fn context(
    state: &State,
    base: String,
    last_backup: Option<durability_host::backup::LastBackup>,
    archive: Option<page::ArchiveView>,
) -> page::Context<'_> {
    page::Context {
        last_backup,
        archive,
        archive_lag: state.host.as_ref().and_then(Host::archive_lag),
        base,
        title: &state.title,
        now_ms: now_ms(state),
        refresh_ms: u64::try_from(state.refresh.as_millis()).unwrap_or(u64::MAX),
        admin: state.admin.is_some(),
        metrics: cfg!(feature = "prometheus") && has_metrics(state),
        read_only: state.host.is_none(),
    }
}

#[cfg(feature = "prometheus")]
fn has_metrics(state: &State) -> bool {
    state.prometheus.is_some()
}

#[cfg(not(feature = "prometheus"))]
fn has_metrics(_: &State) -> bool {
    false
}

/// The page's own path with a trailing slash, whatever prefix the
/// application nested the router under (`/durability` gives
/// `/durability/`), so its links and fetches resolve below it.
fn base_of(uri: &axum::http::Uri) -> String {
    let path = uri.path();
    if path.ends_with('/') {
        path.to_owned()
    } else {
        format!("{path}/")
    }
}

type Reply = Result<Response, Refusal>;

async fn index(Extract(state): Extract<Shared>, OriginalUri(uri): OriginalUri) -> Reply {
    let objects = read_objects(&state).await?;
    let last = read_last_backup(&state).await;
    let archive = read_archive(&state).await;
    Ok(Html(page::full(
        &context(&state, base_of(&uri), last, archive),
        &objects,
    ))
    .into_response())
}

async fn fragment(Extract(state): Extract<Shared>) -> Reply {
    let objects = read_objects(&state).await?;
    let last = read_last_backup(&state).await;
    let archive = read_archive(&state).await;
    Ok(Html(page::body(
        &context(&state, String::new(), last, archive),
        &objects,
    ))
    .into_response())
}

async fn list(Extract(state): Extract<Shared>) -> Reply {
    let objects = read_objects(&state).await?;
    Ok(Json(json!({
        "now_ms": now_ms(&state),
        "overview": view::overview(&objects),
        "objects": objects,
    }))
    .into_response())
}

async fn one(Extract(state): Extract<Shared>, Path(id): Path<String>) -> Reply {
    Ok(Json(find(&state, &id).await?).into_response())
}

async fn find(state: &Shared, id: &str) -> Result<ObjectView, Refusal> {
    read_objects(state)
        .await?
        .into_iter()
        .find(|o| o.id == id)
        .ok_or_else(|| error(StatusCode::NOT_FOUND, format!("no object with id {id:?}")))
}

/// Checks the bearer token and returns the admin settings.
fn authorize<'a>(state: &'a State, headers: &HeaderMap) -> Result<&'a Admin, Refusal> {
    let Some(admin) = &state.admin else {
        return Err(error(StatusCode::NOT_FOUND, "admin routes are not enabled"));
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "));
    match presented {
        Some(token) if admin.accepts(token) => Ok(admin),
        Some(_) => Err(error(StatusCode::FORBIDDEN, "the admin token is wrong")),
        None => Err(Refusal {
            challenge: true,
            ..error(
                StatusCode::UNAUTHORIZED,
                "an admin token is required (Authorization: Bearer ...)",
            )
        }),
    }
}

fn object_ref(object: &ObjectView) -> ObjectRef {
    ObjectRef {
        id: object.id.clone(),
        namespace: object.namespace.clone(),
        name: object.name.clone(),
    }
}

/// A JSON body, or a 422 naming what is wrong with it.
fn body<T>(body: Result<Json<T>, JsonRejection>) -> Result<T, Refusal> {
    body.map(|Json(value)| value)
        .map_err(|rejection| error(StatusCode::UNPROCESSABLE_ENTITY, rejection.body_text()))
}

fn not_wired() -> Refusal {
    error(
        StatusCode::NOT_IMPLEMENTED,
        "this action was not wired by the application",
    )
}

async fn evict(
    Extract(state): Extract<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Reply {
    authorize(&state, &headers)?;
    let Some(host) = &state.host else {
        return Err(error(
            StatusCode::CONFLICT,
            "no host serves this data directory here: nothing to evict",
        ));
    };
    find(&state, &id).await?;
    host.evict(&ObjectId::new(id.clone()))
        .await
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(Json(json!({ "evicted": id })).into_response())
}

/// The body of the parked-delivery actions.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Ids {
    ids: Vec<String>,
}

/// The body of the purge of operations.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Before {
    before_ms: EpochMs,
}

/// Largest id list one admin request may carry.
const MAX_IDS: usize = 1_000;

async fn redrive_parked(
    Extract(state): Extract<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ids: Result<Json<Ids>, JsonRejection>,
) -> Reply {
    let admin = authorize(&state, &headers)?;
    let action = admin.redrive_parked.clone();
    ids_action(&state, &id, body(ids)?, action, "redriven").await
}

async fn purge_parked(
    Extract(state): Extract<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    ids: Result<Json<Ids>, JsonRejection>,
) -> Reply {
    let admin = authorize(&state, &headers)?;
    let action = admin.purge_parked.clone();
    ids_action(&state, &id, body(ids)?, action, "purged").await
}

async fn ids_action(
    state: &Shared,
    id: &str,
    Ids { ids }: Ids,
    action: Option<IdsAction>,
    done: &str,
) -> Reply {
    if ids.is_empty() || ids.len() > MAX_IDS {
        return Err(error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "`ids` must list 1 to 1000 parked delivery ids",
        ));
    }
    let action = action.ok_or_else(not_wired)?;
    let object = find(state, id).await?;
    let count = action(object_ref(&object), ids)
        .await
        .map_err(|e| error(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?;
    Ok(Json(json!({ done: count })).into_response())
}

async fn purge_operations(
    Extract(state): Extract<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    before: Result<Json<Before>, JsonRejection>,
) -> Reply {
    let admin = authorize(&state, &headers)?;
    let Before { before_ms } = body(before)?;
    if before_ms < 0 {
        return Err(error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "`before_ms` must be a non-negative epoch time in milliseconds",
        ));
    }
    let action = admin.purge_operations.clone().ok_or_else(not_wired)?;
    let object = find(&state, &id).await?;
    let count = action(object_ref(&object), before_ms)
        .await
        .map_err(|e| error(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?;
    Ok(Json(json!({ "purged": count })).into_response())
}

/// `GET /api/backup`: the last backup recorded in the data directory.
async fn last_backup(Extract(state): Extract<Shared>) -> Reply {
    let last = read_last_backup(&state).await;
    Ok(Json(json!({ "last_backup": last })).into_response())
}

/// `GET /api/archive`: how far the archive the dashboard was given reaches
/// and how far behind it is, as its manifest tells.
async fn archive_status(Extract(state): Extract<Shared>) -> Reply {
    let view = read_archive(&state).await.ok_or_else(not_wired)?;
    Ok(Json(view.json(now_ms(&state))).into_response())
}

/// `POST /api/backup`: a backup into a new directory under the admin's
/// backup directory.
async fn backup(Extract(state): Extract<Shared>, headers: HeaderMap) -> Reply {
    let admin = authorize(&state, &headers)?;
    let dir = admin.backups.clone().ok_or_else(not_wired)?;
    let dest = dir.join(format!("backup-{}", now_ms(&state)));
    let made = match &state.host {
        Some(host) => host.backup(&dest).await,
        None => {
            let (data_dir, dest) = (state.data_dir.clone(), dest.clone());
            tokio::task::spawn_blocking(move || durability_host::backup_dir(&data_dir, &dest))
                .await
                .map_err(|join| error(StatusCode::INTERNAL_SERVER_ERROR, join.to_string()))?
        }
    };
    let report = made.map_err(|e| {
        let status = match e {
            durability_host::backup::BackupError::DestinationExists { .. } => StatusCode::CONFLICT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        error(status, e.to_string())
    })?;
    Ok(Json(json!({
        "objects": report.objects,
        "bytes": report.bytes,
        "seconds": report.elapsed.as_secs_f64(),
        "manifest": report.manifest_path.display().to_string(),
        "dest": report.dest.display().to_string(),
    }))
    .into_response())
}

#[cfg(feature = "prometheus")]
async fn metrics(Extract(state): Extract<Shared>) -> Reply {
    let handle = state
        .prometheus
        .as_ref()
        .ok_or_else(|| error(StatusCode::NOT_FOUND, "metrics are not enabled"))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        handle.render(),
    )
        .into_response())
}
