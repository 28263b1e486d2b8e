//! The node's own state over the API: what runs (`GET /v1/node`: version, policy, workers,
//! capacity, configuration files, uptime), the storage pool (`GET /v1/pool`), its devices
//! (`GET /v1/devices`) and cross-node arbitration of a shared backend (`GET /v1/arbitration`).
//!
//! Why a module: these views are the operator's picture of the machine (capacity, devices),
//! apart from the volume routes; their JSON types are defined here, not in the store, so the
//! store stays free of HTTP and OpenAPI concerns.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use headroom_store::{DeviceInfo, PoolInfo};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{ApiErrorBody, ApiResult, ApiState, blocking};
use crate::sync::lock;

/// The routes of this module (merged into `api::routes`).
pub(super) fn routes() -> Router<ApiState> {
    Router::new()
        .route("/v1/pool", get(pool))
        .route("/v1/devices", get(devices).post(add_device))
        .route("/v1/devices/{id}/fail", axum::routing::post(fail_device))
        .route(
            "/v1/devices/{id}/restore",
            axum::routing::post(restore_device),
        )
        .route("/v1/node", get(node))
        .route("/v1/arbitration", get(arbitration))
}

/// What the node was started with, for `GET /v1/node` (fixed for the process's life).
#[derive(Debug, Clone)]
pub struct NodeFacts {
    pub started: Instant,
    pub started_unix_s: u64,
    /// The NBD TCP listener's address; `None`: no TCP listener (`nbd_listen = "off"`).
    pub nbd_addr: Option<SocketAddr>,
    /// The NBD Unix socket's path, if there is one.
    pub nbd_unix: Option<PathBuf>,
    pub api_addr: SocketAddr,
    /// `memory`, `files` or `rados`.
    pub backend: &'static str,
    pub data_dir: Option<PathBuf>,
    pub io_threads: usize,
    pub tls: bool,
    /// The `--config` file, if any.
    pub config_file: Option<PathBuf>,
    /// The data directory's `calibration.toml`, if it was loaded.
    pub calibration_file: Option<PathBuf>,
}

impl NodeFacts {
    /// Facts with the clock read now.
    pub fn now(nbd_addr: Option<SocketAddr>, api_addr: SocketAddr) -> NodeFacts {
        NodeFacts {
            started: Instant::now(),
            started_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            nbd_addr,
            nbd_unix: None,
            api_addr,
            backend: "memory",
            data_dir: None,
            io_threads: 0,
            tls: false,
            config_file: None,
            calibration_file: None,
        }
    }
}

/// The scheduler's capacity per second, per dimension; `null`: unlimited.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct CapacityView {
    pub cpu_ns: Option<u64>,
    pub ingress_bytes: Option<u64>,
    pub egress_bytes: Option<u64>,
    pub device_units: Option<u64>,
}

/// Body of `GET /v1/node`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct NodeView {
    /// Headroom's version.
    pub version: String,
    /// The scheduling policy (`off`: unscheduled).
    pub policy: String,
    /// Scheduler workers (0 when the policy is off).
    pub workers: usize,
    /// Threads executing block I/O (0: inline on the network threads).
    pub io_threads: usize,
    /// What the scheduler shares per second; `null` when the policy is off.
    pub capacity_per_second: Option<CapacityView>,
    /// `memory`, `files` or `rados`.
    pub backend: String,
    pub data_dir: Option<String>,
    pub config_file: Option<String>,
    /// The calibration the scheduler's cost model came from, if one was loaded.
    pub calibration_file: Option<String>,
    /// The NBD TCP address; `null` when the TCP listener is off.
    pub nbd_listen: Option<String>,
    /// The NBD Unix socket's path; `null` when there is none.
    pub nbd_unix: Option<String>,
    pub api_listen: String,
    /// TLS is offered on the NBD port.
    pub tls: bool,
    pub started_unix_s: u64,
    pub uptime_s: u64,
    pub volumes: usize,
    pub tenants: usize,
}

/// The node: version, policy, workers, capacity, configuration, uptime.
#[utoipa::path(get, path = "/v1/node", tag = "node",
    responses((status = 200, body = NodeView),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
pub(super) async fn node(State(state): State<ApiState>) -> Json<NodeView> {
    let facts = &state.node;
    let finite = |v: u64| (v != u64::MAX).then_some(v);
    let capacity_per_second = state.scheduler.as_ref().map(|s| {
        let c = s.capacity_per_second();
        CapacityView {
            cpu_ns: finite(c.cpu_ns),
            ingress_bytes: finite(c.ingress_bytes),
            egress_bytes: finite(c.egress_bytes),
            device_units: finite(c.device_units),
        }
    });
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    Json(NodeView {
        version: env!("CARGO_PKG_VERSION").to_string(),
        policy: state
            .scheduler
            .as_ref()
            .map_or("off", |s| s.policy_name())
            .to_string(),
        workers: state.scheduler.as_ref().map_or(0, |s| s.worker_count()),
        io_threads: facts.io_threads,
        capacity_per_second,
        backend: facts.backend.to_string(),
        data_dir: path(&facts.data_dir),
        config_file: path(&facts.config_file),
        calibration_file: path(&facts.calibration_file),
        nbd_listen: facts.nbd_addr.map(|a| a.to_string()),
        nbd_unix: path(&facts.nbd_unix),
        api_listen: facts.api_addr.to_string(),
        tls: facts.tls,
        started_unix_s: facts.started_unix_s,
        uptime_s: facts.started.elapsed().as_secs(),
        volumes: state.store.list_volumes().len(),
        tenants: state.store.list_tenants().len(),
    })
}

/// Cross-node arbitration of the shared RADOS backend: enabled, epoch, whether this node is
/// the arbiter, its demand and share, and the newest split of all nodes (`enabled: false`
/// and zeros when arbitration is off).
#[utoipa::path(get, path = "/v1/arbitration", tag = "node",
    responses((status = 200, body = crate::arbitration::ArbitrationStatus),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
pub(super) async fn arbitration(
    State(state): State<ApiState>,
) -> Json<crate::arbitration::ArbitrationStatus> {
    Json(lock(&state.arbitration).clone())
}

/// The pool's devices: path, capacity, allocated bytes, failed, and what each is doing now
/// (telemetry).
#[utoipa::path(get, path = "/v1/devices", tag = "node",
    responses((status = 200, body = Vec<DeviceView>),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
pub(super) async fn devices(State(state): State<ApiState>) -> Json<Vec<DeviceView>> {
    Json(PoolView::of(&state.store).devices)
}

/// Body of `POST /v1/devices`: the device to add to the running pool.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddDevice {
    /// A regular file under one of the node's device directories (`[storage] device_dirs`,
    /// default `DATA_DIR/devices/`; created there when it does not exist) or a block device
    /// named in `[storage] block_devices`; absent: a new sparse file `devices/dev-N.img` in
    /// the data directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Length of a file that is created or empty (an existing one keeps its length); rounded
    /// down to whole 2 MiB extents. Default 64 GiB (sparse).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// The failure domain the device is in (a host, a shelf, a power feed): copies of one
    /// extent of a replicated volume go to distinct domains when the pool has enough.
    /// Absent: none (the device is its own domain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
    /// Take a device that holds a filesystem, partition table or other signature, or any
    /// data: its contents are destroyed. Without it such a device is refused and left as it
    /// was. A device carrying this pool's own signature is refused even with it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// Adds a device to the running pool: new extents may go there at once (placement prefers
/// the emptier device); it is recorded durably and stays after a restart. File pools only.
#[utoipa::path(post, path = "/v1/devices", tag = "node", request_body = AddDevice,
    responses((status = 201, body = DeviceView),
        (status = 400, description = "A RAM or RADOS pool; a path outside the device directories and not a configured block device; a symlink, directory, character device, FIFO or socket (refused without being opened); a block device in use (EBUSY); a device holding a signature or data without `force`; a size below two extents or above `max_device_bytes`; or the pool at 64 devices (`invalid_device`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 409, description = "The path is a device of the pool already", body = ApiErrorBody),
        (status = 413, description = "Body over 2 MiB", body = ApiErrorBody),
        (status = 415, description = "Not JSON", body = ApiErrorBody),
        (status = 422, description = "Wrong shape or unknown field", body = ApiErrorBody)))]
pub(super) async fn add_device(
    State(state): State<ApiState>,
    body: Result<Json<AddDevice>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<DeviceView>)> {
    let Json(body) = body?;
    let store = std::sync::Arc::clone(&state.store);
    let size = body
        .size_bytes
        .unwrap_or(headroom_store::DEFAULT_DEVICE_CAPACITY_BYTES);
    let info = blocking(move || {
        store.add_device_with(
            body.path.as_deref().map(std::path::Path::new),
            size,
            body.failure_domain,
            body.force,
        )
    })
    .await?;
    let extent_size_bytes = state.store.pool_info().extent_size_bytes;
    Ok((
        StatusCode::CREATED,
        Json(DeviceView::new(&info, extent_size_bytes)),
    ))
}

/// Fails a device for good (the operator's decision; recorded durably): it is never
/// allocated on, written or, while another copy exists, read again. Replicated volumes go on
/// from their other copies (`health`: `degraded`); a 1-replica volume with extents there
/// fails its FLUSHes from now on. Failing a failed device again changes nothing.
#[utoipa::path(post, path = "/v1/devices/{id}/fail", tag = "node",
    params(("id" = u32, Path, description = "Device id (`GET /v1/devices`)")),
    responses((status = 200, body = DeviceView),
        (status = 400, description = "The device of a RADOS store (`invalid_device`); or a path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "No such device", body = ApiErrorBody)))]
pub(super) async fn fail_device(
    State(state): State<ApiState>,
    super::ApiPath(id): super::ApiPath<u32>,
) -> ApiResult<Json<DeviceView>> {
    let store = std::sync::Arc::clone(&state.store);
    let info = blocking(move || store.fail_device(id)).await?;
    if let Some(rebuild) = &state.rebuild {
        rebuild.wake(); // its lost copies are rebuilt from now
    }
    let extent_size_bytes = state.store.pool_info().extent_size_bytes;
    Ok(Json(DeviceView::new(&info, extent_size_bytes)))
}

/// Body of the answer to `POST /v1/devices/{id}/restore`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct DeviceRestoreView {
    /// The device, as it is now.
    pub device: DeviceView,
    /// False: it was in service already and nothing was done.
    pub restored: bool,
    /// Extents on it no volume mapped any more (copies a rebuild moved away, frees that
    /// could not be made durable there): punched and returned to the free pool.
    pub extents_reclaimed: u64,
    /// Copies of replicated volumes on it compared with a copy on a healthy device.
    pub copies_checked: u64,
    /// 64 KiB chunks of those that differed (writes it missed while failed), rewritten.
    pub chunks_rewritten: u64,
    /// Copies with no other copy on a healthy device to compare with, left as they were.
    pub copies_without_source: u64,
}

/// Returns a failed device to service (the operator's decision, after the cause was fixed,
/// e.g. a full filesystem given space): the device is probed (a read and a sync; one that
/// still fails is refused and stays failed), every extent on it no volume maps is punched and
/// freed, every copy of a replicated volume on it is made equal to a healthy copy, and then
/// its `failed` flag is cleared durably and its error count starts again from zero. Its
/// volumes are healthy again; a 1-replica volume there can FLUSH again (what it wrote and
/// never flushed before the failure may be lost). Restoring a device in service does nothing
/// (`restored: false`).
#[utoipa::path(post, path = "/v1/devices/{id}/restore", tag = "node",
    params(("id" = u32, Path, description = "Device id (`GET /v1/devices`)")),
    responses((status = 200, body = DeviceRestoreView),
        (status = 400, description = "The device of a RADOS store, or a device that still fails (`invalid_device`); or a path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "No such device", body = ApiErrorBody)))]
pub(super) async fn restore_device(
    State(state): State<ApiState>,
    super::ApiPath(id): super::ApiPath<u32>,
) -> ApiResult<Json<DeviceRestoreView>> {
    let store = std::sync::Arc::clone(&state.store);
    let r = blocking(move || store.restore_device(id)).await?;
    let extent_size_bytes = state.store.pool_info().extent_size_bytes;
    Ok(Json(DeviceRestoreView {
        device: DeviceView::new(&r.device, extent_size_bytes),
        restored: r.restored,
        extents_reclaimed: r.extents_reclaimed,
        copies_checked: r.copies_checked,
        chunks_rewritten: r.chunks_rewritten,
        copies_without_source: r.copies_without_source,
    }))
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
    /// Sum of the volume sizes, each times its replica count (volumes are thin: this may exceed the capacity).
    pub provisioned_bytes: u64,
    /// Most volume bytes per pool byte (`[storage] overcommit_ratio`); `null`: no limit.
    pub overcommit_ratio: Option<f64>,
    /// `overcommit_ratio` times the capacity: the most `provisioned_bytes` may reach;
    /// `null`: no limit.
    pub provisionable_bytes: Option<u64>,
    pub devices: Vec<DeviceView>,
}

/// One device of the pool.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct DeviceView {
    pub id: u32,
    /// File or block device path, or `memory:<id>`.
    pub path: String,
    pub capacity_bytes: u64,
    /// Extents volumes may use (reserved ones excluded).
    pub extent_count: u64,
    /// Extents at the device's start kept for its Headroom signature, never allocated;
    /// absent for devices of older builds, RAM and RADOS devices.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reserved_extents: u64,
    pub free_extents: u64,
    /// Bytes of extents in use (allocated, quarantined or leaked).
    pub allocated_bytes: u64,
    /// Real space used (file blocks or RAM); `null` for block devices.
    pub physical_used_bytes: Option<u64>,
    /// A sync failed or the device disappeared: its data can no longer be made durable, and
    /// new extents go elsewhere. Absent from the JSON when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
    /// The failure domain declared for it; absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
    /// Its data carries per-block checksums, verified on every read (file and block devices
    /// of this build). False: unprotected (devices of older builds, RAM; RADOS is checksummed
    /// by Ceph).
    #[serde(default)]
    pub checksums: bool,
    /// What the device is doing now, smoothed over the node's sampling intervals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<DeviceTelemetryView>,
}

/// A device's smoothed view (the store's `telemetry` module): rates and mean latencies as
/// exponentially weighted moving averages over the sampling intervals (weight 0.3 for the
/// newest), with a version that grows with every interval in which the device did work.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, ToSchema)]
pub struct DeviceTelemetryView {
    /// Intervals in which the device completed at least one operation.
    pub version: u64,
    pub read_iops: f64,
    pub write_iops: f64,
    pub read_bytes_per_s: f64,
    /// Written and zeroed bytes per second.
    pub write_bytes_per_s: f64,
    /// Mean time of a read on the device, µs; `null` until timed (RAM devices never are).
    pub read_latency_us: Option<f64>,
    /// Mean time of a write on the device, µs; `null` until timed.
    pub write_latency_us: Option<f64>,
    /// Time per KiB written over time per KiB read; `null` until both were timed.
    pub write_cost: Option<f64>,
    pub errors_per_s: f64,
    /// Length of the last interval, ms.
    pub interval_ms: f64,
}

impl From<headroom_store::DeviceTelemetry> for DeviceTelemetryView {
    fn from(t: headroom_store::DeviceTelemetry) -> Self {
        DeviceTelemetryView {
            version: t.version,
            read_iops: t.read_iops,
            write_iops: t.write_iops,
            read_bytes_per_s: t.read_bytes_per_s,
            write_bytes_per_s: t.write_bytes_per_s,
            read_latency_us: t.read_latency_us,
            write_latency_us: t.write_latency_us,
            write_cost: t.write_cost,
            errors_per_s: t.errors_per_s,
            interval_ms: t.window_ns as f64 / 1e6,
        }
    }
}

impl DeviceView {
    fn new(device: &DeviceInfo, extent_size_bytes: u64) -> DeviceView {
        DeviceView {
            id: device.id,
            path: device.path.clone(),
            capacity_bytes: device.capacity_bytes,
            extent_count: device.extent_count,
            reserved_extents: device.reserved_extents,
            free_extents: device.free_extents,
            allocated_bytes: device
                .extent_count
                .saturating_sub(device.free_extents)
                .saturating_mul(extent_size_bytes),
            physical_used_bytes: device.physical_used_bytes,
            failed: device.failed,
            failure_domain: device.failure_domain.clone(),
            checksums: device.checksums,
            telemetry: None,
        }
    }
}

impl PoolView {
    /// The store's pool, with what is provisioned against it.
    pub fn of(store: &headroom_store::Store) -> PoolView {
        let mut view = PoolView::from(store.pool_info());
        let telemetry = store.device_telemetry();
        for device in &mut view.devices {
            device.telemetry = usize::try_from(device.id)
                .ok()
                .and_then(|i| telemetry.get(i))
                .map(|&t| t.into());
        }
        view.provisioned_bytes = store.provisioned_bytes();
        view.overcommit_ratio = store.overcommit_ratio();
        view.provisionable_bytes = view
            .overcommit_ratio
            .map(|ratio| (view.capacity_bytes as f64 * ratio) as u64);
        view
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
            provisioned_bytes: 0,
            overcommit_ratio: None,
            provisionable_bytes: None,
            devices,
        }
    }
}

/// The storage pool: capacity, free space, provisioned bytes and the overcommit ratio, devices.
#[utoipa::path(get, path = "/v1/pool", tag = "node",
    responses((status = 200, body = PoolView),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
pub(super) async fn pool(State(state): State<ApiState>) -> Json<PoolView> {
    Json(PoolView::of(&state.store))
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
