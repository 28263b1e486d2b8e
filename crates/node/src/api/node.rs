//! The node's own state over the API: the storage pool (`GET /v1/pool`).
//!
//! Why a module: these views are the operator's picture of the machine (capacity, devices),
//! apart from the volume routes; their JSON types are defined here, not in the store, so the
//! store stays free of HTTP and OpenAPI concerns.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use headroom_store::{DeviceInfo, PoolInfo};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{ApiErrorBody, ApiState};

/// The routes of this module (merged into `api::routes`).
pub(super) fn routes() -> Router<ApiState> {
    Router::new().route("/v1/pool", get(pool))
}

/// Body of `GET /v1/pool`: the pool's extents and devices.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct PoolView {
    /// Unit of allocation.
    pub extent_size_bytes: u64,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub total_extents: u64,
    pub free_extents: u64,
    pub allocated_extents: u64,
    /// Freed, waiting for the next durable commit before reuse.
    pub quarantined_extents: u64,
    /// Freed but their punch failed; reusable after a restart.
    pub leaked_extents: u64,
    pub devices: Vec<DeviceView>,
}

/// One device of the pool.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct DeviceView {
    pub id: u32,
    /// File or block device path, or `memory:<id>`.
    pub path: String,
    pub capacity_bytes: u64,
    pub extent_count: u64,
    pub free_extents: u64,
    /// Bytes of extents in use (allocated, quarantined or leaked).
    pub allocated_bytes: u64,
    /// Real space used (file blocks or RAM); `null` for block devices.
    pub physical_used_bytes: Option<u64>,
    /// A sync failed or the device disappeared: its data can no longer be made durable, and
    /// new extents go elsewhere. Absent from the JSON when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
}

impl DeviceView {
    fn new(device: &DeviceInfo, extent_size_bytes: u64) -> DeviceView {
        DeviceView {
            id: device.id,
            path: device.path.clone(),
            capacity_bytes: device.capacity_bytes,
            extent_count: device.extent_count,
            free_extents: device.free_extents,
            allocated_bytes: device
                .extent_count
                .saturating_sub(device.free_extents)
                .saturating_mul(extent_size_bytes),
            physical_used_bytes: device.physical_used_bytes,
            failed: device.failed,
        }
    }
}

impl From<PoolInfo> for PoolView {
    fn from(pool: PoolInfo) -> Self {
        let devices = pool
            .devices
            .iter()
            .map(|d| DeviceView::new(d, pool.extent_size_bytes))
            .collect();
        PoolView {
            extent_size_bytes: pool.extent_size_bytes,
            capacity_bytes: pool.capacity_bytes,
            free_bytes: pool.free_bytes,
            total_extents: pool.total_extents,
            free_extents: pool.free_extents,
            allocated_extents: pool.allocated_extents,
            quarantined_extents: pool.quarantined_extents,
            leaked_extents: pool.leaked_extents,
            devices,
        }
    }
}

/// The storage pool: capacity, free space, devices.
#[utoipa::path(get, path = "/v1/pool", tag = "node",
    responses((status = 200, body = PoolView),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
pub(super) async fn pool(State(state): State<ApiState>) -> Json<PoolView> {
    Json(state.store.pool_info().into())
}
