//! The API's OpenAPI 3 description, generated from the code (`utoipa`): the handlers carry
//! `#[utoipa::path]` and the bodies `#[derive(ToSchema)]`, so the document cannot drift from
//! what the router serves without the `openapi` test noticing. Served at `GET /openapi.json`
//! (behind the token like everything but `/healthz`).
//!
//! Adding routes elsewhere: annotate the handler with `#[utoipa::path(...)]`, list it in a
//! `#[derive(OpenApi)] #[openapi(paths(...))]` struct of that module, and merge that struct's
//! document in [`openapi`] (one line).

use std::sync::LazyLock;

use axum::http::header;
use axum::response::IntoResponse;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

use super::{ApiErrorBody, ConnectionsReport, CreateVolume, UpdateVolume, VolumeView};
pub use crate::volume_qos::{BurstSchema, QosSpecSchema};

/// `GET /v1/connections`' body is large and owned by the admission and budget modules; it is
/// described as an object here (docs/operations.md has its fields).
impl utoipa::PartialSchema for ConnectionsReport {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::Object)
            .description(Some(
                "NBD connections (limits, counters, one entry per connection), the payload \
                 budget (`memory`), `idle_buffer_bytes` and the open connections per \
                 connection thread (`threads`)",
            ))
            .into()
    }
}

impl ToSchema for ConnectionsReport {}

/// The bearer token scheme, required by every operation that does not say otherwise.
#[derive(Debug)]
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Headroom management API",
        description = "Volumes, tenants and the node's state. Every operation but /healthz and /readyz \
                       needs `Authorization: Bearer <token>` (docs/operations.md, \
                       \"Management API\"); a token of scope `read` may only GET (403 \
                       `forbidden` otherwise), and every other authenticated request is \
                       recorded in the audit log. Errors are `{\"error\", \"kind\"}`."
    ),
    paths(
        super::healthz,
        super::readyz,
        super::health,
        super::connections,
        super::list_volumes,
        super::create_volume,
        super::show_volume,
        super::update_volume,
        super::delete_volume,
        super::node::pool,
        super::node::devices,
        super::node::add_device,
        super::node::fail_device,
        super::node::restore_device,
        super::repair::show_rebuild,
        super::repair::set_rebuild,
        super::repair::show_scrub,
        super::repair::set_scrub,
        super::repair::start_scrub,
        super::repair::scrub_volume,
        super::attachments::list_attachments,
        super::attachments::attach_volume,
        super::attachments::detach_volume,
        super::node::node,
        super::node::arbitration,
        super::tenants::list_tenants,
        super::tenants::create_tenant,
        super::tenants::show_tenant,
        super::tenants::delete_tenant,
        super::tokens::list_tokens,
        super::tokens::create_token,
        super::tokens::revoke_token,
        crate::api::metrics::metrics,
        crate::api::dashboard::stats,
        serve_json,
    ),
    components(schemas(ApiErrorBody, CreateVolume, UpdateVolume, VolumeView)),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    tags(
        (name = "volumes", description = "Volumes: create, list, show, resize, QoS, delete"),
        (name = "tenants", description = "Tenants: the owners volumes name"),
        (name = "tokens", description = "Scoped API tokens: create (admin or read), list, revoke"),
        (name = "node", description = "The node: health, version and configuration, pool, devices, connections"),
    )
)]
struct ApiDoc;

/// The whole document: this module's paths and those other modules merge in.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    doc
}

/// The document as JSON, built once.
static JSON: LazyLock<String> = LazyLock::new(|| {
    openapi()
        .to_pretty_json()
        .unwrap_or_else(|err| format!("{{\"error\": \"OpenAPI document: {err}\"}}"))
});

/// This document (OpenAPI 3.1, JSON).
#[utoipa::path(get, path = "/openapi.json", tag = "node",
    responses((status = 200, description = "The OpenAPI document", content_type = "application/json"),
        (status = 401, description = "No or wrong token", body = ApiErrorBody)))]
pub(super) async fn serve_json() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], JSON.as_str())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_document_is_openapi_3_with_bearer_security() {
        let doc: serde_json::Value = serde_json::from_str(&JSON).unwrap();
        assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{doc}");
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        assert!(doc["paths"]["/v1/volumes"]["post"].is_object());
        assert_eq!(
            doc["paths"]["/healthz"]["get"]["security"],
            serde_json::json!([{}])
        );
    }
}
