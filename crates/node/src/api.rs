//! The management API: HTTP/JSON on localhost under `/v1/`.
//!
//! It is the one way to change the node's state besides NBD traffic; the CLI is a thin client
//! of it. Errors come back as `{"error": "...", "kind": "..."}` with a status that says whose
//! fault it was (400 bad input, bad QoS or bad tenant id, 404 unknown volume or tenant, 409
//! name taken or tenant still in use, 507 over the overcommit ratio).
//!
//! Every route but `/healthz`, `/readyz` (and the dashboard's static files) needs the node's bearer
//! token (`auth`): without it the answer is 401 with the same JSON error body.
//!
//! Bad requests never get axum's plain-text rejections: malformed JSON (400), a body of the
//! wrong shape or with unknown fields (422), a body over the limit (413), a missing JSON
//! content type (415), a bad query (400), an unknown route (404) and a method a route does not
//! have (405) all answer the same JSON error body.
//!
//! A volume's QoS is set at creation (`qos` in `POST /v1/volumes`) and changed live
//! (`qos` in `PATCH /v1/volumes/{name}`): the change reaches the scheduler at once, without
//! reconnecting clients and without refilling credit buckets. A bad QoS changes nothing.
//!
//! A volume's tenant (`tenant`) and access mode (`read_only`) are set at creation and fixed
//! for its life; `GET /v1/volumes?tenant=ID` lists one tenant's volumes (see `session` for
//! what a tenant's NBD client may see).

mod attachments;
pub mod audit_log;
pub mod auth;
pub mod body;
pub mod conn;
pub mod dashboard;
pub mod metrics;
pub mod node;
pub mod openapi;
pub mod path;
mod repair;
pub mod tenants;
pub mod tokens;

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{Method, StatusCode, Uri};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use headroom_qos::QosSpec;
use headroom_store::{NewVolume, Store, StoreError, VolumeInfo};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::watch;
use utoipa::{IntoParams, ToSchema};

use crate::admission::{Connections, ConnectionsView};
use crate::budget::{Budget, BudgetView};
use crate::buffers::BufferPool;
use crate::pipeline::IoJob;
use crate::scheduler::Scheduler;
use crate::volume_qos::{CreditsView, PhasesView, QosView, StoredQos};

pub use auth::{ApiToken, TokenError};
pub use path::ApiPath;

/// Body of `POST /v1/volumes`.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateVolume {
    /// 1-64 characters of `[A-Za-z0-9._-]`, not starting with `.` or `-`; also the NBD
    /// export name.
    pub name: String,
    /// A multiple of 512.
    pub size_bytes: u64,
    /// QoS class; absent: unlimited (no baseline promise, no ceiling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<openapi::QosSpecSchema>)]
    pub qos: Option<QosSpec>,
    /// The tenant the volume belongs to: only TLS clients whose PSK identity or certificate
    /// CN is this id see it. Absent: no tenant (served to clients without an identity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Export it read-only (`NBD_FLAG_READ_ONLY`; writes, trims and zeroing get EPERM).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// Copies of every extent, each on a distinct device (1-3; absent: 1). More than the
    /// pool's healthy devices, or more than 1 on a RADOS store, is refused (422
    /// `invalid_replicas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u8>,
}

/// Query of `GET /v1/volumes`.
#[derive(Debug, Default, Deserialize, Serialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only this tenant's volumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// Body of `PATCH /v1/volumes/{name}`.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateVolume {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// Changes on top of the volume's current QoS (fields given replace those set; a preset
    /// replaces the class).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<openapi::QosSpecSchema>)]
    pub qos: Option<QosSpec>,
}

/// A volume as `GET /v1/volumes/{name}` shows it.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
pub struct VolumeView {
    #[serde(flatten)]
    pub info: VolumeSummary,
    /// The scheduler's policy (`off` when none runs).
    pub policy: String,
    /// Absent: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qos_class: Option<QosView>,
    pub credits: CreditsView,
    pub queued_requests: usize,
    pub phases: PhasesView,
    /// The promise audit (docs/operations.md, "Promise audit"); zero for a volume that has
    /// done no I/O since the node started.
    #[serde(default)]
    pub audit: crate::metrics::AuditView,
    /// The latest rebuild of its lost copies since the node started; absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<crate::repair::RebuildProgress>,
}

/// The store's view of a volume, with the QoS record left out (it is shown parsed).
#[derive(Debug, Deserialize, Serialize, ToSchema)]
pub struct VolumeSummary {
    pub name: String,
    pub id: u64,
    pub size_bytes: u64,
    pub allocated_bytes: u64,
    pub created_unix_s: u64,
    /// `null`: no tenant.
    #[serde(default)]
    pub tenant: Option<String>,
    #[serde(default)]
    pub read_only: bool,
    /// Copies of every extent, on distinct devices (1-3).
    #[serde(default = "one_replica")]
    pub replicas: u8,
    /// `healthy`, `degraded` while some of its extents are on a failed device (a replicated
    /// volume then serves them from its other copies), or `rebuilding` while the node copies
    /// them again onto healthy devices.
    #[serde(default = "healthy")]
    pub health: String,
}

fn one_replica() -> u8 {
    1
}

fn healthy() -> String {
    "healthy".to_string()
}

impl From<&VolumeInfo> for VolumeSummary {
    fn from(info: &VolumeInfo) -> Self {
        VolumeSummary {
            name: info.name.clone(),
            id: info.id,
            size_bytes: info.size_bytes,
            allocated_bytes: info.allocated_bytes,
            created_unix_s: info.created_unix_s,
            tenant: info.tenant.clone(),
            read_only: info.read_only,
            replicas: info.replicas,
            health: match info.health {
                headroom_store::VolumeHealth::Healthy => "healthy",
                headroom_store::VolumeHealth::Degraded => "degraded",
                headroom_store::VolumeHealth::Rebuilding => "rebuilding",
            }
            .to_string(),
        }
    }
}

/// What the API handlers share.
#[derive(Clone, Debug)]
pub struct ApiState {
    pub store: Arc<Store>,
    /// The rebuild task (`/v1/rebuild`, a volume's `rebuild`); `None`: none runs.
    pub rebuild: Option<Arc<crate::repair::Rebuilder>>,
    /// The background scrub (`/v1/scrub`); `None`: none runs.
    pub scrub: Option<Arc<crate::scrub::Scrubber>>,
    pub scheduler: Option<Arc<Scheduler<IoJob>>>,
    /// The NBD connections (`GET /v1/connections`).
    pub connections: Arc<Connections>,
    /// The payload byte budget (`GET /v1/connections`).
    pub budget: Arc<Budget>,
    /// Payload buffers (their idle bytes, `GET /v1/connections`).
    pub buffers: Arc<BufferPool>,
    /// Open connections per connection thread (`GET /v1/connections`; empty: connections
    /// share the runtime).
    pub connection_threads: crate::net_threads::OpenConnections,
    /// The sampled history (`GET /v1/stats`, the dashboard, `headroom top`).
    pub timeline: Arc<crate::timeline::Timeline>,
    /// Per-volume statistics and the promise audit (`GET /metrics`, `audit` in a volume).
    pub metrics: Arc<crate::metrics::MetricsRegistry>,
    /// The bearer tokens, one of which every request but the public ones must carry, and
    /// their scopes (see `auth`, `tokens`).
    pub tokens: Arc<tokens::Tokens>,
    /// Where changes are recorded (`audit_log`); `None`: not recorded.
    pub audit: Option<Arc<audit_log::AuditLog>>,
    /// What the node was started with (`GET /v1/node`).
    pub node: Arc<node::NodeFacts>,
    /// Cross-node arbitration's state (`GET /v1/arbitration`).
    pub arbitration: crate::arbitration::SharedStatus,
    /// The API's own connections (`api` in `GET /v1/connections`; see `conn`).
    pub api_connections: Arc<conn::ApiConnections>,
    /// The bounded readiness probe of `GET /readyz`.
    pub readiness: Arc<crate::readiness::ReadinessProbe>,
    /// The vhost-user-blk attachments (`/v1/volumes/{name}/attachments`).
    pub attachments: Arc<crate::vhost_user::Attachments>,
}

/// Body of `GET /v1/connections`: the NBD connections and what they hold.
#[derive(Debug, Serialize)]
pub struct ConnectionsReport {
    #[serde(flatten)]
    pub connections: ConnectionsView,
    /// Payload bytes in flight against the node's and each tenant's budget.
    pub memory: BudgetView,
    /// Bytes of idle payload buffers kept for reuse (outside the budget; at most 64 MiB).
    pub idle_buffer_bytes: usize,
    /// Open connections and vhost-user-blk queues on each connection thread, in thread
    /// order (`[server] net_threads`; empty when connections share the runtime).
    pub threads: Vec<usize>,
    /// The management API's own connections: cap, timeouts, evictions.
    pub api: conn::ApiConnectionsView,
}

/// Error body.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
pub struct ApiErrorBody {
    /// What went wrong, for people.
    pub error: String,
    /// What went wrong, for programs: `unauthorized`, `not_found`, `already_exists`,
    /// `invalid_name`, `invalid_size`, `invalid_qos`, `invalid_tenant`, `no_space`,
    /// `malformed_json`, `invalid_body`, `body_too_large`, `unknown_route`, ...
    pub kind: String,
}

/// A store or QoS error with the HTTP status it deserves.
#[derive(Debug)]
pub enum ApiError {
    Store(StoreError),
    /// The QoS asked for is invalid; nothing was changed.
    Qos(String),
    /// The request itself is wrong (body, query, route, method): its status, kind and reason.
    Request(StatusCode, &'static str, String),
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        let status = rejection.status();
        let kind = match &rejection {
            JsonRejection::JsonSyntaxError(_) => "malformed_json",
            JsonRejection::JsonDataError(_) => "invalid_body",
            JsonRejection::MissingJsonContentType(_) => "unsupported_media_type",
            _ if status == StatusCode::PAYLOAD_TOO_LARGE => "body_too_large",
            _ => "invalid_body",
        };
        ApiError::Request(status, kind, rejection.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError::Request(
            StatusCode::BAD_REQUEST,
            "invalid_query",
            rejection.body_text(),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let store_err = match self {
            ApiError::Store(err) => err,
            ApiError::Qos(reason) => {
                let body = ApiErrorBody {
                    error: reason,
                    kind: "invalid_qos".to_string(),
                };
                return (StatusCode::BAD_REQUEST, Json(body)).into_response();
            }
            ApiError::Request(status, kind, reason) => {
                let body = ApiErrorBody {
                    error: reason,
                    kind: kind.to_string(),
                };
                return (status, Json(body)).into_response();
            }
        };
        let (status, kind) = match &store_err {
            StoreError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            StoreError::AlreadyExists(_) => (StatusCode::CONFLICT, "already_exists"),
            StoreError::DeviceExists(_) => (StatusCode::CONFLICT, "already_exists"),
            StoreError::InvalidDevice { .. } => (StatusCode::BAD_REQUEST, "invalid_device"),
            StoreError::InvalidName { .. } => (StatusCode::BAD_REQUEST, "invalid_name"),
            StoreError::InvalidSize { .. } => (StatusCode::BAD_REQUEST, "invalid_size"),
            StoreError::InvalidTenant { .. } => (StatusCode::BAD_REQUEST, "invalid_tenant"),
            StoreError::InvalidReplicas { .. } => {
                (StatusCode::UNPROCESSABLE_ENTITY, "invalid_replicas")
            }
            StoreError::DeviceNotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            StoreError::TenantNotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            StoreError::TenantExists(_) => (StatusCode::CONFLICT, "already_exists"),
            StoreError::TenantHasVolumes { .. } => (StatusCode::CONFLICT, "tenant_has_volumes"),
            StoreError::UnknownTenant(_) => (StatusCode::NOT_FOUND, "unknown_tenant"),
            StoreError::NoSpace => (StatusCode::INSUFFICIENT_STORAGE, "no_space"),
            StoreError::Overcommitted { .. } => (StatusCode::INSUFFICIENT_STORAGE, "overcommitted"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        let error = match &store_err {
            StoreError::UnknownTenant(id) => format!(
                "{store_err}: create it first (`headroom tenant create {}` or POST /v1/tenants)",
                shell_word(id)
            ),
            _ => store_err.to_string(),
        };
        let body = ApiErrorBody {
            error,
            kind: kind.to_string(),
        };
        (status, Json(body)).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> Self {
        ApiError::Store(err)
    }
}

/// `text` as one shell word (quoted unless it is plain), for commands in messages.
fn shell_word(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:@".contains(&b));
    if plain {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
}

fn qos_error(err: headroom_qos::QosError) -> ApiError {
    ApiError::Qos(err.to_string())
}

type ApiResult<T> = Result<T, ApiError>;

/// The API's routes, without the authentication layer. Add routes (or `.merge(...)` a
/// module's router) here: [`router`] puts every one of them behind the token check.
fn routes() -> Router<ApiState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/health", get(health))
        .route("/openapi.json", get(openapi::serve_json))
        .merge(node::routes())
        .merge(tenants::routes())
        .merge(tokens::routes())
        .merge(repair::routes())
        .merge(attachments::routes())
        .route("/v1/connections", get(connections))
        .route("/v1/volumes", get(list_volumes).post(create_volume))
        .route(
            "/v1/volumes/{name}",
            get(show_volume).patch(update_volume).delete(delete_volume),
        )
        .merge(dashboard::routes())
        .merge(metrics::routes())
}

/// The API: [`routes`] and the JSON fallbacks, all behind the bearer-token check
/// (`auth::require_token`; only `auth::is_public` paths pass without a token) and the
/// oversized-body refusal (`body`). The layers are applied last so that they cover every route
/// above them; the token is checked first.
pub fn router(state: ApiState) -> Router {
    routes()
        .fallback(unknown_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(body::refuse_oversized))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ))
        .with_state(state)
}

async fn unknown_route(method: Method, uri: Uri) -> ApiError {
    ApiError::Request(
        StatusCode::NOT_FOUND,
        "unknown_route",
        format!("no route {method} {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::Request(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{} does not take {method}", uri.path()),
    )
}

/// Serves the API until `stop` turns true, with the timeouts and the connection cap of
/// `state.api_connections` (see `conn`).
pub async fn serve(listener: TcpListener, state: ApiState, stop: watch::Receiver<bool>) {
    let connections = Arc::clone(&state.api_connections);
    conn::serve(listener, router(state), connections, stop).await;
}

/// Body of `/healthz` and `/v1/health`.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
pub struct HealthBody {
    /// Always `ok`: the process answers.
    pub status: String,
}

/// Liveness, without a token (for probes).
#[utoipa::path(get, path = "/healthz", tag = "node", security(()),
    responses((status = 200, description = "The server answers", body = HealthBody)))]
async fn healthz() -> Json<HealthBody> {
    Json(HealthBody {
        status: "ok".to_string(),
    })
}

/// Body of `/readyz`.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
pub struct ReadyBody {
    /// `ready`, or `not_ready` when any reason below holds.
    pub status: String,
    /// Why the node should not be given new work, one sentence each (empty when ready):
    /// metadata commits fail, the metadata reserve is in use because the disk is full, a
    /// metadata commit has not finished for more than 2 s (a disk that stopped answering),
    /// the metadata store does not answer within 2 s, or the store's lease was lost.
    pub reasons: Vec<String>,
    /// Set once this node lost the lease of its RADOS store: it serves nothing any more and
    /// exits soon (status 3) for its supervisor to restart it as a standby.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_lost: Option<LeaseLostBody>,
}

/// When and why a node lost its store's lease (`ReadyBody::lease_lost`).
#[derive(Debug, Deserialize, Serialize, ToSchema)]
pub struct LeaseLostBody {
    /// One sentence: why the lease counts as lost.
    pub why: String,
    /// When the node noticed, RFC 3339 in UTC.
    pub at: String,
    /// The same instant, milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
}

/// Readiness, without a token (for probes and load balancers): 200 while the node can
/// commit metadata (the last commit, or a probe commit now, succeeded and the metadata
/// reserve is intact), 503 with the reasons otherwise, within 2 s (a probe commit that takes
/// longer: "metadata store not answering"). A node that is alive but not ready still serves
/// reads; writes that need a metadata commit (FLUSH, allocation by FUA) fail. A node that
/// lost its RADOS store's lease serves nothing; the body names the loss (`lease_lost`).
#[utoipa::path(get, path = "/readyz", tag = "node", security(()),
    responses((status = 200, description = "The node can commit metadata", body = ReadyBody),
        (status = 503, description = "Not ready; `reasons` says why", body = ReadyBody)))]
async fn readyz(State(state): State<ApiState>) -> (StatusCode, Json<ReadyBody>) {
    let reasons = state.readiness.reasons(&state.store).await;
    let lease_lost = state.store.lease_lost().map(|loss| {
        let at_unix_ms = loss
            .at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        LeaseLostBody {
            why: loss.why,
            at: audit_log::rfc3339_utc(at_unix_ms),
            at_unix_ms,
        }
    });
    let ready = reasons.is_empty() && lease_lost.is_none();
    let body = ReadyBody {
        status: if ready { "ready" } else { "not_ready" }.to_string(),
        reasons,
        lease_lost,
    };
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body))
}

/// Liveness, with the token (checks the token too).
#[utoipa::path(get, path = "/v1/health", tag = "node",
    responses((status = 200, description = "The server answers and the token is right", body = HealthBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
async fn health() -> Json<HealthBody> {
    healthz().await
}

/// The NBD connections, their requests and bytes in flight, and the payload budget.
#[utoipa::path(get, path = "/v1/connections", tag = "node",
    responses((status = 200, body = ConnectionsReport),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
async fn connections(State(state): State<ApiState>) -> Json<ConnectionsReport> {
    Json(ConnectionsReport {
        connections: state.connections.view(),
        memory: state.budget.view(),
        idle_buffer_bytes: state.buffers.idle_bytes(),
        threads: state.connection_threads.per_thread(),
        api: state.api_connections.view(),
    })
}

/// Every volume (or one tenant's), sorted by name.
#[utoipa::path(get, path = "/v1/volumes", tag = "volumes", params(ListQuery),
    responses((status = 200, body = Vec<VolumeView>),
        (status = 400, description = "Bad query or tenant id", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
async fn list_volumes(
    State(state): State<ApiState>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> ApiResult<Json<Vec<VolumeView>>> {
    let Query(query) = query?;
    if let Some(tenant) = &query.tenant {
        headroom_store::validate_tenant_id(tenant)?;
    }
    let views = state
        .store
        .list_volumes()
        .iter()
        .filter(|info| query.tenant.is_none() || info.tenant == query.tenant)
        .map(|info| view(&state, info))
        .collect();
    Ok(Json(views))
}

/// Parses a stored QoS record (absent or unreadable: none).
fn stored_qos(info: &VolumeInfo) -> Option<StoredQos> {
    info.qos.as_deref().and_then(StoredQos::from_json)
}

fn view(state: &ApiState, info: &VolumeInfo) -> VolumeView {
    let stored = stored_qos(info);
    let handle = state
        .scheduler
        .as_ref()
        .and_then(|s| s.handle(info.id).map(|h| (s, h)));
    let (credits, queued_requests, phases) = match &handle {
        Some((scheduler, handle)) => {
            let (iops, bytes) = scheduler.credits(handle);
            (
                CreditsView { iops, bytes },
                scheduler.queued_requests(handle),
                handle.counters.snapshot().into(),
            )
        }
        None => (CreditsView::default(), 0, PhasesView::default()),
    };
    let audit = state
        .metrics
        .get(info.id)
        .map(|stats| stats.audit(&state.metrics, state.metrics.clock().now_ns()))
        .unwrap_or_default();
    VolumeView {
        audit,
        rebuild: state.rebuild.as_ref().and_then(|r| r.progress(&info.name)),
        info: info.into(),
        policy: state
            .scheduler
            .as_ref()
            .map_or("off", |s| s.policy_name())
            .to_string(),
        qos_class: stored.map(|s| QosView::new(s.spec, &s.qos)),
        credits,
        queued_requests,
        phases,
    }
}

/// Creates a volume (thin: no space is taken until written).
#[utoipa::path(post, path = "/v1/volumes", tag = "volumes", request_body = CreateVolume,
    responses((status = 201, body = VolumeView),
        (status = 400, description = "Bad name, size, QoS or tenant id", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "The tenant does not exist (`unknown_tenant`)", body = ApiErrorBody),
        (status = 409, description = "The name is taken", body = ApiErrorBody),
        (status = 507, description = "Over the overcommit ratio (`overcommitted`)", body = ApiErrorBody),
        (status = 413, description = "Body over 2 MiB", body = ApiErrorBody),
        (status = 415, description = "Not JSON", body = ApiErrorBody),
        (status = 422, description = "Wrong shape or unknown field, or more replicas than the pool can hold (`invalid_replicas`)", body = ApiErrorBody)))]
async fn create_volume(
    State(state): State<ApiState>,
    body: Result<Json<CreateVolume>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<VolumeView>)> {
    let Json(body) = body?;
    let stored = match body.qos {
        Some(spec) if !spec.is_empty() => {
            Some(StoredQos::resolve(spec, body.size_bytes).map_err(qos_error)?)
        }
        _ => None,
    };
    let store = Arc::clone(&state.store);
    let options = NewVolume {
        qos: stored.as_ref().map(StoredQos::to_json),
        tenant: body.tenant,
        read_only: body.read_only,
        replicas: body.replicas.unwrap_or(1),
    };
    let info =
        blocking(move || store.create_volume_with(&body.name, body.size_bytes, options)).await?;
    let qos = stored.map_or_else(headroom_qos::VolumeQos::default, |s| s.qos);
    if let Some(scheduler) = &state.scheduler {
        scheduler.add_volume(info.id, &qos);
    }
    state.metrics.volume(info.id, &info.name, &qos);
    Ok((StatusCode::CREATED, Json(view(&state, &info))))
}

/// One volume: size, QoS class, credit balances, per-phase counters.
#[utoipa::path(get, path = "/v1/volumes/{name}", tag = "volumes",
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 200, body = VolumeView),
        (status = 400, description = "A path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "No such volume", body = ApiErrorBody)))]
async fn show_volume(
    State(state): State<ApiState>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<VolumeView>> {
    let info = state.store.volume_info(&name)?;
    Ok(Json(view(&state, &info)))
}

/// Resizes a volume and/or changes its QoS live.
#[utoipa::path(patch, path = "/v1/volumes/{name}", tag = "volumes", request_body = UpdateVolume,
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 200, body = VolumeView),
        (status = 400, description = "Bad size or QoS (nothing changed); or a path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "No such volume", body = ApiErrorBody),
        (status = 413, description = "Body over 2 MiB", body = ApiErrorBody),
        (status = 415, description = "Not JSON", body = ApiErrorBody),
        (status = 422, description = "Wrong shape or unknown field", body = ApiErrorBody),
        (status = 507, description = "Growing it would exceed the overcommit ratio (`overcommitted`)", body = ApiErrorBody)))]
async fn update_volume(
    State(state): State<ApiState>,
    ApiPath(name): ApiPath<String>,
    body: Result<Json<UpdateVolume>, JsonRejection>,
) -> ApiResult<Json<VolumeView>> {
    let Json(body) = body?;
    let current = state.store.volume_info(&name)?;
    let size_bytes = body.size_bytes.unwrap_or(current.size_bytes);
    let old = stored_qos(&current);
    // Resolve first: a QoS that is invalid (or a class that does not fit the new size)
    // changes nothing, not even the size.
    let new_qos: Option<StoredQos> = match (&body.qos, &old) {
        (Some(change), Some(old)) => {
            Some(StoredQos::resolve(change.merged_over(&old.spec), size_bytes).map_err(qos_error)?)
        }
        (Some(change), None) => {
            Some(StoredQos::resolve(change.clone(), size_bytes).map_err(qos_error)?)
        }
        // A resize re-derives a size-dependent class (gp2: 3 IOPS per GiB).
        (None, Some(old)) if size_bytes != current.size_bytes => {
            Some(StoredQos::resolve(old.spec.clone(), size_bytes).map_err(qos_error)?)
        }
        _ => None,
    };
    let mut info = current;
    if size_bytes != info.size_bytes {
        let store = Arc::clone(&state.store);
        let name = name.clone();
        info = blocking(move || store.resize_volume(&name, size_bytes)).await?;
    }
    if let Some(new_qos) = new_qos
        && Some(&new_qos) != old.as_ref()
    {
        let store = Arc::clone(&state.store);
        let record = new_qos.to_json();
        let name = name.clone();
        info = blocking(move || store.set_volume_qos(&name, Some(record))).await?;
        if let Some(stats) = state.metrics.get(info.id) {
            stats.set_qos(&new_qos.qos);
        }
        if let Some(scheduler) = &state.scheduler {
            match scheduler.handle(info.id) {
                Some(handle) => scheduler.update_qos(&handle, &new_qos.qos),
                None => {
                    scheduler.add_volume(info.id, &new_qos.qos);
                }
            }
        }
    }
    Ok(Json(view(&state, &info)))
}

/// Deletes a volume and frees its space.
#[utoipa::path(delete, path = "/v1/volumes/{name}", tag = "volumes",
    params(("name" = String, Path, description = "Volume name")),
    responses((status = 204, description = "Deleted"),
        (status = 400, description = "A path parameter that does not parse (`invalid_path`)", body = ApiErrorBody),
        (status = 401, description = "No or wrong token", body = ApiErrorBody),
        (status = 404, description = "No such volume", body = ApiErrorBody)))]
async fn delete_volume(
    State(state): State<ApiState>,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<StatusCode> {
    let info = state.store.volume_info(&name)?;
    let store = Arc::clone(&state.store);
    blocking(move || store.delete_volume(&name)).await?;
    if let Some(scheduler) = &state.scheduler {
        scheduler.remove_volume(info.id);
    }
    state.metrics.remove(info.id);
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
