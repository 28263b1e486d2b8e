//! Repair over the API: the rebuild task's state and rate (`GET`/`PUT /v1/rebuild`), the
//! background scrub's (`GET`/`PUT`/`POST /v1/scrub`) and a volume's scrub on demand
//! (`POST /v1/volumes/{name}/scrub`). A module of its own so the volume routes
//! stay about volumes' configuration, and the rebuild's JSON types stay out of the store.

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use headroom_store::ScrubReport;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{ApiError, ApiErrorBody, ApiPath, ApiResult, ApiState, blocking};
use crate::repair::RebuildView;
use crate::scrub::ScrubStatus;

pub(super) fn routes() -> Router<ApiState> {
    Router::new()
        .route("/v1/rebuild", get(show_rebuild).put(set_rebuild))
        .route(
            "/v1/scrub",
            get(show_scrub).put(set_scrub).post(start_scrub),
        )
        .route("/v1/volumes/{name}/scrub", post(scrub_volume))
}

/// Body of `PUT /v1/rebuild`.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetRebuild {
    /// The rate the rebuild copies at, bytes per second (1 to 10 GiB/s).
    pub rate_bytes_per_s: u64,
}

/// Highest rate `PUT /v1/rebuild` and `PUT /v1/scrub` accept: 10 GiB/s, beyond any device a
/// node has.
const MAX_REBUILD_RATE_BYTES_PER_S: u64 = 10 << 30;

/// Body of `PUT /v1/scrub`.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetScrub {
    /// The rate the scrub reads at, bytes per second (1 to 10 GiB/s).
    pub rate_bytes_per_s: u64,
}

fn checked_rate(rate_bytes_per_s: u64) -> ApiResult<u64> {
    if (1..=MAX_REBUILD_RATE_BYTES_PER_S).contains(&rate_bytes_per_s) {
        return Ok(rate_bytes_per_s);
    }
    Err(ApiError::Request(
        StatusCode::BAD_REQUEST,
        "invalid_rate",
        format!("rate_bytes_per_s must be 1 to {MAX_REBUILD_RATE_BYTES_PER_S}"),
    ))
}

fn scrubber(state: &ApiState) -> ApiResult<&std::sync::Arc<crate::scrub::Scrubber>> {
    state.scrub.as_ref().ok_or_else(|| {
        ApiError::Request(
            StatusCode::NOT_FOUND,
            "not_found",
            "this node runs no scrub task".into(),
        )
    })
}

/// The background scrub: its rate and schedule, the running (or last) pass and what every
/// scrub since the node started found.
#[utoipa::path(get, path = "/v1/scrub", tag = "node",
    responses((status = 200, body = ScrubStatus),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
pub(super) async fn show_scrub(State(state): State<ApiState>) -> ApiResult<Json<ScrubStatus>> {
    Ok(Json(scrubber(&state)?.view()))
}

/// Changes the scrub's rate live; a running pass follows from its next extent (2 MiB).
#[utoipa::path(put, path = "/v1/scrub", tag = "node", request_body = SetScrub,
    responses((status = 200, body = ScrubStatus),
        (status = 400, description = "Rate out of range (`invalid_rate`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 413, description = "Body over 2 MiB", body = ApiErrorBody),
        (status = 415, description = "Not JSON", body = ApiErrorBody),
        (status = 422, description = "Wrong shape or unknown field", body = ApiErrorBody)))]
pub(super) async fn set_scrub(
    State(state): State<ApiState>,
    body: Result<Json<SetScrub>, JsonRejection>,
) -> ApiResult<Json<ScrubStatus>> {
    let Json(body) = body?;
    let rate = checked_rate(body.rate_bytes_per_s)?;
    let scrub = scrubber(&state)?;
    scrub.set_rate(rate);
    tracing::info!(rate_bytes_per_s = rate, "scrub rate changed");
    Ok(Json(scrub.view()))
}

/// Starts a pass of the background scrub now (nothing changes while one runs); answers at
/// once, with 202: `GET /v1/scrub` follows the pass.
#[utoipa::path(post, path = "/v1/scrub", tag = "node",
    responses((status = 202, body = ScrubStatus),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
pub(super) async fn start_scrub(
    State(state): State<ApiState>,
) -> ApiResult<(StatusCode, Json<ScrubStatus>)> {
    let scrub = scrubber(&state)?;
    scrub.request_pass();
    tracing::info!("scrub pass asked for");
    Ok((StatusCode::ACCEPTED, Json(scrub.view())))
}

fn rebuilder(state: &ApiState) -> ApiResult<&std::sync::Arc<crate::repair::Rebuilder>> {
    state.rebuild.as_ref().ok_or_else(|| {
        ApiError::Request(
            StatusCode::NOT_FOUND,
            "not_found",
            "this node runs no rebuild task".into(),
        )
    })
}

/// The rebuild task: its rate, bytes copied, extents remaining and each volume's progress.
#[utoipa::path(get, path = "/v1/rebuild", tag = "node",
    responses((status = 200, body = RebuildView),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
pub(super) async fn show_rebuild(State(state): State<ApiState>) -> ApiResult<Json<RebuildView>> {
    Ok(Json(rebuilder(&state)?.view()))
}

/// Changes the rebuild's rate live; a running copy follows from its next extent (2 MiB).
#[utoipa::path(put, path = "/v1/rebuild", tag = "node", request_body = SetRebuild,
    responses((status = 200, body = RebuildView),
        (status = 400, description = "Rate out of range (`invalid_rate`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 413, description = "Body over 2 MiB", body = ApiErrorBody),
        (status = 415, description = "Not JSON", body = ApiErrorBody),
        (status = 422, description = "Wrong shape or unknown field", body = ApiErrorBody)))]
pub(super) async fn set_rebuild(
    State(state): State<ApiState>,
    body: Result<Json<SetRebuild>, JsonRejection>,
) -> ApiResult<Json<RebuildView>> {
    let Json(body) = body?;
    checked_rate(body.rate_bytes_per_s)?;
    let rebuild = rebuilder(&state)?;
    rebuild.set_rate(body.rate_bytes_per_s);
    tracing::info!(
        rate_bytes_per_s = body.rate_bytes_per_s,
        "rebuild rate changed"
    );
    Ok(Json(rebuild.view()))
}

/// Scrubs every allocated extent of a volume now, synchronously, like a pass of the
/// background scrub but unpaced: every block of every copy on a device with checksums is
/// read below the page cache and verified, a bad block is rewritten from a copy that
/// verifies; copies are compared (64 KiB chunks) and a chunk repaired from the majority
/// when there is one (3 copies).
#[utoipa::path(post, path = "/v1/volumes/{name}/scrub", tag = "volumes",
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 200, body = ScrubView),
        (status = 400, description = "A path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "No such volume", body = ApiErrorBody)))]
pub(super) async fn scrub_volume(
    State(state): State<ApiState>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<ScrubView>> {
    let volume = state.store.open_volume(&name)?;
    let report = blocking(move || volume.scrub()).await?;
    tracing::info!(volume = %name, ?report, "scrub done");
    if let Some(scrub) = &state.scrub {
        scrub.record(&report);
    }
    Ok(Json(report.into()))
}

/// Body of `POST /v1/volumes/{name}/scrub`.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
pub struct ScrubView {
    /// Allocated extents whose copies on healthy devices were compared.
    pub extents_checked: u64,
    /// 64 KiB chunks whose copies disagreed.
    pub mismatches: u64,
    /// Of those, chunks rewritten from the majority (3 copies; 2 disagreeing copies are
    /// reported only).
    pub repaired: u64,
    /// 4 KiB blocks verified against their checksums (every copy on a device with checksums).
    #[serde(default)]
    pub blocks_verified: u64,
    /// Blocks that failed verification.
    #[serde(default)]
    pub checksum_mismatches: u64,
    /// Of those, blocks rewritten from a copy whose block verifies.
    #[serde(default)]
    pub checksum_repaired: u64,
    /// Of those, blocks no copy of which verifies (their reads answer EIO).
    #[serde(default)]
    pub unrepairable: u64,
}

impl From<ScrubReport> for ScrubView {
    fn from(r: ScrubReport) -> Self {
        ScrubView {
            extents_checked: r.extents_checked,
            mismatches: r.mismatches,
            repaired: r.repaired,
            blocks_verified: r.blocks_verified,
            checksum_mismatches: r.checksum_mismatches,
            checksum_repaired: r.checksum_repaired,
            unrepairable: r.unrepairable,
        }
    }
}
