//! The management API: HTTP/JSON on localhost under `/v1/`.
//!
//! It is the one way to change the node's state besides NBD traffic; the CLI is a thin client
//! of it. Errors come back as `{"error": "...", "kind": "..."}` with a status that says whose
//! fault it was (400 bad input, 404 unknown volume, 409 name taken, 507 pool full).

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use headroom_store::{Store, StoreError, VolumeInfo};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Body of `POST /v1/volumes`.
#[derive(Debug, Deserialize, Serialize)]
pub struct CreateVolume {
    pub name: String,
    pub size_bytes: u64,
}

/// Body of `PATCH /v1/volumes/{name}`.
#[derive(Debug, Deserialize, Serialize)]
pub struct UpdateVolume {
    pub size_bytes: Option<u64>,
}

/// Error body.
#[derive(Debug, Deserialize, Serialize)]
pub struct ApiErrorBody {
    pub error: String,
    pub kind: String,
}

/// A store error with the HTTP status it deserves.
#[derive(Debug)]
pub struct ApiError(StoreError);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind) = match &self.0 {
            StoreError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            StoreError::AlreadyExists(_) => (StatusCode::CONFLICT, "already_exists"),
            StoreError::InvalidName { .. } => (StatusCode::BAD_REQUEST, "invalid_name"),
            StoreError::InvalidSize { .. } => (StatusCode::BAD_REQUEST, "invalid_size"),
            StoreError::NoSpace => (StatusCode::INSUFFICIENT_STORAGE, "no_space"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        let body = ApiErrorBody {
            error: self.0.to_string(),
            kind: kind.to_string(),
        };
        (status, Json(body)).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> Self {
        ApiError(err)
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// The API's routes over a store.
pub fn router(store: Arc<Store>) -> Router {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/pool", get(pool))
        .route("/v1/volumes", get(list_volumes).post(create_volume))
        .route(
            "/v1/volumes/{name}",
            get(show_volume).patch(update_volume).delete(delete_volume),
        )
        .with_state(store)
}

/// Serves the API until `stop` turns true.
pub async fn serve(listener: TcpListener, store: Arc<Store>, mut stop: watch::Receiver<bool>) {
    let shutdown = async move {
        // Either a stop or the sender going away ends the server.
        let _ = stop.changed().await;
    };
    if let Err(err) = axum::serve(listener, router(store))
        .with_graceful_shutdown(shutdown)
        .await
    {
        tracing::error!("API server failed: {err}");
    }
}

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn pool(State(store): State<Arc<Store>>) -> Json<serde_json::Value> {
    Json(serde_json::to_value(store.pool_info()).unwrap_or(serde_json::Value::Null))
}

async fn list_volumes(State(store): State<Arc<Store>>) -> Json<Vec<VolumeInfo>> {
    Json(store.list_volumes())
}

async fn create_volume(
    State(store): State<Arc<Store>>,
    Json(body): Json<CreateVolume>,
) -> ApiResult<(StatusCode, Json<VolumeInfo>)> {
    let info = blocking(move || store.create_volume(&body.name, body.size_bytes)).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

async fn show_volume(
    State(store): State<Arc<Store>>,
    Path(name): Path<String>,
) -> ApiResult<Json<VolumeInfo>> {
    Ok(Json(store.volume_info(&name)?))
}

async fn update_volume(
    State(store): State<Arc<Store>>,
    Path(name): Path<String>,
    Json(body): Json<UpdateVolume>,
) -> ApiResult<Json<VolumeInfo>> {
    let info = match body.size_bytes {
        Some(size_bytes) => blocking(move || store.resize_volume(&name, size_bytes)).await?,
        None => store.volume_info(&name)?,
    };
    Ok(Json(info))
}

async fn delete_volume(
    State(store): State<Arc<Store>>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    blocking(move || store.delete_volume(&name)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Metadata changes commit durably (fsync); keep them off the runtime threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|err| StoreError::Io(std::io::Error::other(err)))?
}
