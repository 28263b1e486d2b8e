//! The live views' HTTP side: `GET /v1/stats` (the timeline as JSON) and the dashboard at `/`.
//!
//! The dashboard is three files compiled into the binary (`include_str!`): plain HTML, CSS and
//! JavaScript with hand-drawn SVG charts, no CDN and no build step, so a node on an isolated
//! network serves it as it is. The page holds no data: it is public, and every data request it
//! makes carries the operator's bearer token, which the page reads from the URL fragment
//! (`/#token=...`, never sent to the server) or a form, and keeps in `sessionStorage`. A strict
//! Content-Security-Policy (scripts and styles from this origin only) keeps a hostile volume
//! name from running script; the page also only ever sets text, never HTML.

use axum::Json;
use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};

use crate::api::{ApiError, ApiState};
use crate::timeline::{HISTORY_SAMPLES, MAX_VOLUMES, StatsReport};

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const STYLE_CSS: &str = include_str!("assets/style.css");

/// Default `seconds` of `GET /v1/stats`.
pub const DEFAULT_STATS_SECONDS: u64 = 60;
/// Default `limit` of `GET /v1/stats`.
pub const DEFAULT_STATS_LIMIT: usize = 100;

/// Query of `GET /v1/stats`.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StatsQuery {
    /// History to return, seconds (1 up to the history kept; default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<u64>,
    /// Rows per latest-interval list (1-10,000; default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
}

/// The dashboard's and the stats' routes (merged into the API's router).
pub fn routes() -> Router<ApiState> {
    Router::new()
        .route("/", get(index))
        .route("/assets/{file}", get(asset))
        .route("/v1/stats", get(stats))
}

fn bad_query(reason: String) -> ApiError {
    ApiError::Request(StatusCode::BAD_REQUEST, "invalid_query", reason)
}

/// The node's recent history: utilisation per dimension and per volume rates, latency,
/// credits, phases, who bursts and who lends (docs/operations.md, "Dashboard and
/// `headroom top`").
#[utoipa::path(get, path = "/v1/stats", tag = "node",
    params(
        ("seconds" = Option<u64>, Query, description = "Samples of the last N seconds (1-600; default 60)"),
        ("limit" = Option<usize>, Query, description = "Rows at most in each latest-interval list (1-10000)"),
    ),
    responses(
        (status = 200, description = "The samples and the latest interval", body = StatsReport),
        (status = 400, description = "seconds or limit out of range", body = crate::api::ApiErrorBody),
        (status = 401, description = "No or wrong token", body = crate::api::ApiErrorBody)))]
pub(crate) async fn stats(
    State(state): State<ApiState>,
    query: Result<Query<StatsQuery>, QueryRejection>,
) -> Result<Json<StatsReport>, ApiError> {
    let Query(query) = query?;
    let timeline = &state.timeline;
    let max_seconds = (HISTORY_SAMPLES as u64)
        .saturating_mul(timeline.interval_ms())
        .div_ceil(1000);
    let seconds = query.seconds.unwrap_or(DEFAULT_STATS_SECONDS);
    if seconds == 0 || seconds > max_seconds {
        return Err(bad_query(format!(
            "seconds must be 1 to {max_seconds} (the history kept), not {seconds}"
        )));
    }
    let limit = query.limit.unwrap_or(DEFAULT_STATS_LIMIT);
    if limit == 0 || limit > MAX_VOLUMES {
        return Err(bad_query(format!(
            "limit must be 1 to {MAX_VOLUMES}, not {limit}"
        )));
    }
    Ok(Json(timeline.report(seconds, limit)))
}

/// A static file: never cached stale across upgrades, never sniffed, never framed.
fn static_file(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
             img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
    );
    response
}

async fn index() -> Response {
    static_file("text/html; charset=utf-8", INDEX_HTML)
}

async fn asset(
    crate::api::ApiPath(file): crate::api::ApiPath<String>,
) -> Result<Response, ApiError> {
    match file.as_str() {
        "app.js" => Ok(static_file("text/javascript; charset=utf-8", APP_JS)),
        "style.css" => Ok(static_file("text/css; charset=utf-8", STYLE_CSS)),
        _ => Err(ApiError::Request(
            StatusCode::NOT_FOUND,
            "unknown_route",
            format!("no asset {file:?}"),
        )),
    }
}

/// `GET /v1/stats`'s document is defined by `timeline`'s types; it is described as an object
/// here (docs/operations.md lists its fields).
impl utoipa::PartialSchema for StatsReport {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::Object)
            .description(Some(
                "policy, scheduler, interval_ms, capacity_per_second, volumes_total, \
                 volumes_tracked, samples (node utilisation and per-volume rows per interval), \
                 volumes, bursting, lending and spare for the latest interval",
            ))
            .into()
    }
}

impl utoipa::ToSchema for StatsReport {}
