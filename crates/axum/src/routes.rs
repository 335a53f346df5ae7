//! The routes and their handlers. File reads run on tokio's blocking pool:
//! SQLite calls must not stall the application's async workers.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{OriginalUri, Path, State as Extract};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use durability_host::{Host, ObjectId};
use durability_platform::EpochMs;
use serde::Deserialize;
use serde_json::json;

use crate::admin::{Admin, ObjectRef};
use crate::view::{self, ObjectView};
use crate::page;

/// Everything a handler needs; shared by every request.
pub(crate) struct State {
    pub data_dir: PathBuf,
    pub host: Option<Host>,
    pub title: String,
    pub refresh: Duration,
    pub admin: Option<Admin>,
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

/// A JSON error response: `{"error": message}`.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

async fn read_objects(state: &Shared) -> Result<Vec<ObjectView>, Response> {
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

fn context(state: &State, base: String) -> page::Context<'_> {
    page::Context {
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

async fn index(Extract(state): Extract<Shared>, OriginalUri(uri): OriginalUri) -> Response {
    match read_objects(&state).await {
        Ok(objects) => Html(page::full(&context(&state, base_of(&uri)), &objects)).into_response(),
        Err(response) => response,
    }
}

async fn fragment(Extract(state): Extract<Shared>) -> Response {
    match read_objects(&state).await {
        Ok(objects) => Html(page::body(&context(&state, String::new()), &objects)).into_response(),
        Err(response) => response,
    }
}

async fn list(Extract(state): Extract<Shared>) -> Response {
    match read_objects(&state).await {
        Ok(objects) => Json(json!({
            "now_ms": now_ms(&state),
            "overview": view::overview(&objects),
            "objects": objects,
        }))
        .into_response(),
        Err(response) => response,
    }
}

async fn one(Extract(state): Extract<Shared>, Path(id): Path<String>) -> Response {
    match find(&state, &id).await {
        Ok(object) => Json(object).into_response(),
        Err(response) => response,
    }
}

async fn find(state: &Shared, id: &str) -> Result<ObjectView, Response> {
    read_objects(state)
        .await?
        .into_iter()
        .find(|o| o.id == id)
        .ok_or_else(|| error(StatusCode::NOT_FOUND, format!("no object with id {id:?}")))
}

/// Checks the bearer token; `Err` is the refusal to send.
fn authorize(state: &State, headers: &HeaderMap) -> Result<(), Response> {
    let Some(admin) = &state.admin else {
        return Err(error(StatusCode::NOT_FOUND, "admin routes are not enabled"));
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.as_bytes().strip_prefix(b"Bearer "));
    match presented {
        Some(token) if admin.accepts(token) => Ok(()),
        Some(_) => Err(error(StatusCode::FORBIDDEN, "the admin token is wrong")),
        None => Err((
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            Json(json!({ "error": "an admin token is required (Authorization: Bearer ...)" })),
        )
            .into_response()),
    }
}

fn object_ref(object: &ObjectView) -> ObjectRef {
    ObjectRef {
        id: object.id.clone(),
        namespace: object.namespace.clone(),
        name: object.name.clone(),
    }
}

async fn evict(
    Extract(state): Extract<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(refusal) = authorize(&state, &headers) {
        return refusal;
    }
    let Some(host) = &state.host else {
        return error(
            StatusCode::CONFLICT,
            "no host serves this data directory here: nothing to evict",
        );
    };
    if let Err(response) = find(&state, &id).await {
        return response;
    }
    match host.evict(&ObjectId::new(id.clone())).await {
        Ok(()) => Json(json!({ "evicted": id })).into_response(),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
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

fn check_ids(ids: &[String]) -> Result<(), Response> {
    if ids.is_empty() || ids.len() > MAX_IDS {
        return Err(error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "`ids` must list 1 to 1000 parked delivery ids",
        ));
    }
    Ok(())
}

async fn redrive_parked(
    Extract(state): Extract<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Result<Json<Ids>, axum::extract::rejection::JsonRejection>,
) -> Response {
    ids_action(&state, &headers, &id, body, "redriven", |admin| {
        admin.redrive_parked.clone()
    })
    .await
}

async fn purge_parked(
    Extract(state): Extract<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Result<Json<Ids>, axum::extract::rejection::JsonRejection>,
) -> Response {
    ids_action(&state, &headers, &id, body, "purged", |admin| {
        admin.purge_parked.clone()
    })
    .await
}

async fn ids_action(
    state: &Shared,
    headers: &HeaderMap,
    id: &str,
    body: Result<Json<Ids>, axum::extract::rejection::JsonRejection>,
    done: &str,
    action: impl Fn(&Admin) -> Option<crate::admin::IdsActionRef>,
) -> Response {
    if let Err(refusal) = authorize(state, headers) {
        return refusal;
    }
    let Json(Ids { ids }) = match body {
        Ok(body) => body,
        Err(rejection) => return error(StatusCode::UNPROCESSABLE_ENTITY, rejection.body_text()),
    };
    if let Err(response) = check_ids(&ids) {
        return response;
    }
    let Some(action) = state.admin.as_ref().and_then(action) else {
        return error(
            StatusCode::NOT_IMPLEMENTED,
            "this action was not wired by the application",
        );
    };
    let object = match find(state, id).await {
        Ok(object) => object,
        Err(response) => return response,
    };
    match action(object_ref(&object), ids).await {
        Ok(count) => Json(json!({ done: count })).into_response(),
        Err(e) => error(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()),
    }
}

async fn purge_operations(
    Extract(state): Extract<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Result<Json<Before>, axum::extract::rejection::JsonRejection>,
) -> Response {
    if let Err(refusal) = authorize(&state, &headers) {
        return refusal;
    }
    let Json(Before { before_ms }) = match body {
        Ok(body) => body,
        Err(rejection) => return error(StatusCode::UNPROCESSABLE_ENTITY, rejection.body_text()),
    };
    if before_ms < 0 {
        return error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "`before_ms` must be a non-negative epoch time in milliseconds",
        );
    }
    let Some(action) = state.admin.as_ref().and_then(|a| a.purge_operations.clone()) else {
        return error(
            StatusCode::NOT_IMPLEMENTED,
            "this action was not wired by the application",
        );
    };
    let object = match find(&state, &id).await {
        Ok(object) => object,
        Err(response) => return response,
    };
    match action(object_ref(&object), before_ms).await {
        Ok(count) => Json(json!({ "purged": count })).into_response(),
        Err(e) => error(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()),
    }
}

#[cfg(feature = "prometheus")]
async fn metrics(Extract(state): Extract<Shared>) -> Response {
    match &state.prometheus {
        Some(handle) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            handle.render(),
        )
            .into_response(),
        None => error(StatusCode::NOT_FOUND, "metrics are not enabled"),
    }
}
