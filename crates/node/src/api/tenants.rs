//! Tenants over the API: `POST /v1/tenants`, `GET /v1/tenants`, `GET /v1/tenants/{id}`,
//! `DELETE /v1/tenants/{id}`.
//!
//! Why tenants are created explicitly: a volume's tenant decides which TLS clients see it (their
//! PSK identity or certificate CN) and whose byte budget its I/O is charged to. A typo in
//! `--tenant` used to create a tenant silently, leaving a volume nobody could reach; now a
//! volume can only name a tenant that exists (404 `unknown_tenant` otherwise), and a tenant can
//! only go once it has no volume (409 `tenant_has_volumes`). The store keeps them in its redb.
//!
//! A tenant's view sums its volumes: count, provisioned and allocated bytes, and baselines (the
//! capacity promised to it). A per-tenant credit pool shared by its volumes is not built.

use std::sync::Arc;

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use headroom_store::{TenantInfo, VolumeInfo};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{ApiErrorBody, ApiPath, ApiResult, ApiState, blocking, stored_qos};

/// The routes of this module (merged into `api::routes`).
pub(super) fn routes() -> Router<ApiState> {
    Router::new()
        .route("/v1/tenants", get(list_tenants).post(create_tenant))
        .route("/v1/tenants/{id}", get(show_tenant).delete(delete_tenant))
}

/// Body of `POST /v1/tenants`.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    /// 1-128 printable ASCII characters, no leading or trailing space: the TLS PSK identity
    /// or certificate CN of the tenant's NBD clients.
    pub id: String,
}

/// A tenant and what its volumes add up to.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct TenantView {
    pub id: String,
    pub created_unix_s: u64,
    /// Volumes that belong to it.
    pub volumes: usize,
    /// Sum of their sizes.
    pub provisioned_bytes: u64,
    /// Sum of the space they take in the pool.
    pub allocated_bytes: u64,
    /// Sum of their baseline IOPS (what the node promised the tenant).
    pub baseline_iops: u64,
    /// Sum of their baseline bytes per second.
    pub baseline_bytes_per_s: u64,
}

impl TenantView {
    fn new(info: TenantInfo, volumes: &[VolumeInfo]) -> TenantView {
        let (mut iops, mut bytes) = (0u64, 0u64);
        for volume in volumes
            .iter()
            .filter(|v| v.tenant.as_deref() == Some(info.id.as_str()))
        {
            if let Some(stored) = stored_qos(volume) {
                let base = stored.qos.baseline;
                // u64::MAX is "unlimited", which a baseline never is; guard the sum anyway.
                if base.iops != u64::MAX {
                    iops = iops.saturating_add(base.iops);
                }
                if base.bytes_per_s != u64::MAX {
                    bytes = bytes.saturating_add(base.bytes_per_s);
                }
            }
        }
        TenantView {
            id: info.id,
            created_unix_s: info.created_unix_s,
            volumes: info.volumes,
            provisioned_bytes: info.provisioned_bytes,
            allocated_bytes: info.allocated_bytes,
            baseline_iops: iops,
            baseline_bytes_per_s: bytes,
        }
    }
}

/// Every tenant, sorted by id.
#[utoipa::path(get, path = "/v1/tenants", tag = "tenants",
    responses((status = 200, body = Vec<TenantView>),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
pub(super) async fn list_tenants(State(state): State<ApiState>) -> Json<Vec<TenantView>> {
    let volumes = state.store.list_volumes();
    let views = state
        .store
        .list_tenants()
        .into_iter()
        .map(|t| TenantView::new(t, &volumes))
        .collect();
    Json(views)
}

/// Creates a tenant (volumes can then name it).
#[utoipa::path(post, path = "/v1/tenants", tag = "tenants", request_body = CreateTenant,
    responses((status = 201, body = TenantView),
        (status = 400, description = "Bad tenant id", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 409, description = "The tenant exists", body = ApiErrorBody),
        (status = 413, description = "Body over 2 MiB", body = ApiErrorBody),
        (status = 415, description = "Not JSON", body = ApiErrorBody),
        (status = 422, description = "Wrong shape or unknown field", body = ApiErrorBody)))]
pub(super) async fn create_tenant(
    State(state): State<ApiState>,
    body: Result<Json<CreateTenant>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<TenantView>)> {
    let Json(body) = body?;
    let store = Arc::clone(&state.store);
    let info = blocking(move || store.create_tenant(&body.id)).await?;
    Ok((StatusCode::CREATED, Json(TenantView::new(info, &[]))))
}

/// One tenant with its volumes' sums.
#[utoipa::path(get, path = "/v1/tenants/{id}", tag = "tenants",
    params(("id" = String, Path, description = "Tenant id (percent-encoded)")),
    responses((status = 200, body = TenantView),
        (status = 400, description = "A path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "No such tenant", body = ApiErrorBody)))]
pub(super) async fn show_tenant(
    State(state): State<ApiState>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Json<TenantView>> {
    let info = state.store.tenant_info(&id)?;
    Ok(Json(TenantView::new(info, &state.store.list_volumes())))
}

/// Deletes a tenant that has no volume left.
#[utoipa::path(delete, path = "/v1/tenants/{id}", tag = "tenants",
    params(("id" = String, Path, description = "Tenant id (percent-encoded)")),
    responses((status = 204, description = "Deleted"),
        (status = 400, description = "A path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "No such tenant", body = ApiErrorBody),
        (status = 409, description = "The tenant still has volumes", body = ApiErrorBody)))]
pub(super) async fn delete_tenant(
    State(state): State<ApiState>,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<StatusCode> {
    let store = Arc::clone(&state.store);
    blocking(move || store.delete_tenant(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}
