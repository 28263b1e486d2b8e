//! A small blocking client of the node's `/v1/` API, used by `headroom volume ...` and
//! `headroom tenant ...`.
//!
//! Errors from the server arrive as `{"error": .., "kind": ..}` and are shown as they are, so
//! the operator sees the server's reason (name taken, pool full, invalid QoS) rather than a
//! status code. They are typed ([`ApiCallError`]) so that the binary can turn them into the
//! documented exit codes (3 not found, 4 unreachable, 5 authentication failed, 6 conflict).
//!
//! Every request carries the API's bearer token, found by [`ApiArgs::client`]:
//! `$HEADROOM_TOKEN`, else `--token-file`, else the `api-token` file in `--data-dir` (the same
//! default directory as `serve`), so on the server's machine no flag is needed.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use headroom_node::api::tenants::{CreateTenant, TenantView};
use headroom_node::api::{ApiErrorBody, CreateVolume, UpdateVolume, VolumeView};
use headroom_qos::QosSpec;
use serde::de::DeserializeOwned;
use serde_json::Value;
use ureq::Agent;
use ureq::http::Response;

use crate::token::{self, TOKEN_ENV};

/// How the CLI reaches the API: its URL and where the token comes from.
#[derive(Args, Debug, Clone)]
pub struct ApiArgs {
    /// Base URL of the management API.
    #[arg(
        long = "api",
        env = "HEADROOM_API",
        default_value = "http://127.0.0.1:10810"
    )]
    pub url: String,
    /// Read the API token from this file (when HEADROOM_TOKEN is not set).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// The server's data directory, whose `api-token` file holds the token (when
    /// HEADROOM_TOKEN and --token-file are not given).
    #[arg(long, value_name = "DIR", default_value = crate::serve_config::DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
}

impl ApiArgs {
    /// A client with the token found as the module doc says (none found: requests go without
    /// one, and a 401 explains where the token lives).
    pub fn client(&self) -> Result<Api> {
        let found = token::client_token(self.token_file.as_deref(), &self.data_dir)?;
        Ok(Api::new(&self.url, found))
    }
}

/// Exit codes of the CLI's contract (`headroom --help` lists them; 2 is clap's usage error).
pub const EXIT_FAILURE: u8 = 1;
pub const EXIT_NOT_FOUND: u8 = 3;
pub const EXIT_UNREACHABLE: u8 = 4;
pub const EXIT_UNAUTHORIZED: u8 = 5;
pub const EXIT_CONFLICT: u8 = 6;

/// A failed API call, by what the operator should do about it.
#[derive(Debug, thiserror::Error)]
pub enum ApiCallError {
    /// No HTTP answer at all (connection refused, DNS, timeout).
    #[error(
        "cannot reach the Headroom API at {url} (is `headroom serve` running? set --api or HEADROOM_API): {reason}"
    )]
    Unreachable { url: String, reason: String },
    /// 401: no token, or not the server's.
    #[error("{message}")]
    Unauthorized { message: String },
    /// 404: no such volume, tenant or route.
    #[error("{message}")]
    NotFound { kind: String, message: String },
    /// 409: the name is taken, or the tenant still has volumes.
    #[error("{message}")]
    Conflict { kind: String, message: String },
    /// Any other failure status.
    #[error("{message}")]
    Server {
        status: u16,
        kind: String,
        message: String,
    },
}

impl ApiCallError {
    /// The CLI's exit code for this failure (the documented contract).
    pub fn exit_code(&self) -> u8 {
        match self {
            ApiCallError::NotFound { .. } => EXIT_NOT_FOUND,
            ApiCallError::Unreachable { .. } => EXIT_UNREACHABLE,
            ApiCallError::Unauthorized { .. } => EXIT_UNAUTHORIZED,
            ApiCallError::Conflict { .. } => EXIT_CONFLICT,
            ApiCallError::Server { .. } => EXIT_FAILURE,
        }
    }
}

/// The exit code for any error of a CLI command: an [`ApiCallError`]'s anywhere in the chain,
/// else 1.
pub fn exit_code_of(err: &anyhow::Error) -> u8 {
    err.chain()
        .find_map(|cause| cause.downcast_ref::<ApiCallError>())
        .map_or(EXIT_FAILURE, ApiCallError::exit_code)
}

pub struct Api {
    base: String,
    agent: Agent,
    token: token::Found,
}

impl Api {
    pub fn new(base: &str, token: token::Found) -> Api {
        let agent: Agent = Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        Api {
            base: base.trim_end_matches('/').to_string(),
            agent,
            token,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    fn volume_url(&self, name: &str) -> String {
        self.url(&format!("/v1/volumes/{name}"))
    }

    /// `POST /v1/volumes` (`qos` absent: unlimited; `tenant` absent: no tenant).
    pub fn create(&self, body: &CreateVolume) -> Result<VolumeView> {
        let response = self
            .authorized(self.agent.post(self.url("/v1/volumes")))
            .send_json(body)
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// `GET /v1/volumes` (`?tenant=` when given: that tenant's volumes), as the API answered.
    pub fn list_json(&self, tenant: Option<&str>) -> Result<Value> {
        let mut request = self.authorized(self.agent.get(self.url("/v1/volumes")));
        if let Some(tenant) = tenant {
            request = request.query("tenant", tenant);
        }
        let response = request.call().map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    pub fn list(&self, tenant: Option<&str>) -> Result<Vec<VolumeView>> {
        parse(self.list_json(tenant)?)
    }

    /// `GET /v1/volumes/{name}`, as the API answered it.
    pub fn show_json(&self, name: &str) -> Result<Value> {
        let response = self
            .authorized(self.agent.get(self.volume_url(name)))
            .call()
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    pub fn show(&self, name: &str) -> Result<VolumeView> {
        parse(self.show_json(name)?)
    }

    pub fn resize(&self, name: &str, size_bytes: u64) -> Result<VolumeView> {
        self.update(
            name,
            &UpdateVolume {
                size_bytes: Some(size_bytes),
                qos: None,
            },
        )
    }

    /// Changes a volume's QoS live: `change` is merged over its current spec by the server.
    pub fn set_qos(&self, name: &str, change: QosSpec) -> Result<VolumeView> {
        self.update(
            name,
            &UpdateVolume {
                size_bytes: None,
                qos: Some(change),
            },
        )
    }

    fn update(&self, name: &str, body: &UpdateVolume) -> Result<VolumeView> {
        let response = self
            .authorized(self.agent.patch(self.volume_url(name)))
            .send_json(body)
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    pub fn delete(&self, name: &str) -> Result<()> {
        let response = self
            .authorized(self.agent.delete(self.volume_url(name)))
            .call()
            .map_err(|err| self.unreachable(err))?;
        self.expect_success(response)
    }

    /// `POST /v1/volumes/{name}/attachments`: serves the volume on a vhost-user-blk socket;
    /// the volume's attachments as the API answered.
    pub fn attach(&self, name: &str, attachment: &Value) -> Result<Value> {
        let url = format!("{}/attachments", self.volume_url(name));
        let response = self
            .authorized(self.agent.post(url))
            .send_json(attachment)
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// `DELETE /v1/volumes/{name}/attachments` of the socket at `vhost_user`.
    pub fn detach(&self, name: &str, vhost_user: &str) -> Result<()> {
        let url = format!("{}/attachments", self.volume_url(name));
        let response = self
            .authorized(self.agent.delete(url))
            .force_send_body()
            .send_json(serde_json::json!({ "vhost_user": vhost_user }))
            .map_err(|err| self.unreachable(err))?;
        self.expect_success(response)
    }

    /// `POST /v1/tenants`.
    pub fn create_tenant(&self, id: &str) -> Result<TenantView> {
        let response = self
            .authorized(self.agent.post(self.url("/v1/tenants")))
            .send_json(CreateTenant { id: id.to_string() })
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// `GET /v1/tenants`, as the API answered.
    pub fn tenants_json(&self) -> Result<Value> {
        self.get_json("/v1/tenants")
    }

    /// `GET /v1/tenants/{id}`, as the API answered.
    pub fn tenant_json(&self, id: &str) -> Result<Value> {
        self.get_json(&format!("/v1/tenants/{}", path_segment(id)))
    }

    /// `DELETE /v1/tenants/{id}`.
    pub fn delete_tenant(&self, id: &str) -> Result<()> {
        let url = self.url(&format!("/v1/tenants/{}", path_segment(id)));
        let response = self
            .authorized(self.agent.delete(url))
            .call()
            .map_err(|err| self.unreachable(err))?;
        self.expect_success(response)
    }

    /// `POST /v1/tokens`: a new scoped token, with its secret (shown this once).
    pub fn create_token(
        &self,
        body: &headroom_node::api::tokens::CreateToken,
    ) -> Result<headroom_node::api::tokens::CreatedToken> {
        let response = self
            .authorized(self.agent.post(self.url("/v1/tokens")))
            .send_json(body)
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// `DELETE /v1/tokens/{id}` (an id or a name): the token revoked.
    pub fn revoke_token(&self, id_or_name: &str) -> Result<Value> {
        let url = self.url(&format!("/v1/tokens/{}", path_segment(id_or_name)));
        let response = self
            .authorized(self.agent.delete(url))
            .call()
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// `POST /v1/devices`: adds a device to the running pool; the new device as the API
    /// answered it.
    pub fn add_device(
        &self,
        path: Option<&str>,
        size_bytes: Option<u64>,
        failure_domain: Option<&str>,
        force: bool,
    ) -> Result<Value> {
        let mut body = serde_json::Map::new();
        if force {
            body.insert("force".into(), Value::from(true));
        }
        if let Some(path) = path {
            body.insert("path".into(), Value::from(path));
        }
        if let Some(size) = size_bytes {
            body.insert("size_bytes".into(), Value::from(size));
        }
        if let Some(domain) = failure_domain {
            body.insert("failure_domain".into(), Value::from(domain));
        }
        let response = self
            .authorized(self.agent.post(self.url("/v1/devices")))
            .send_json(Value::Object(body))
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// `POST /v1/devices/{id}/fail`: the device as the API answered (for `headroom device
    /// fail`).
    pub fn fail_device(&self, id: u32) -> Result<Value> {
        let response = self
            .authorized(self.agent.post(self.url(&format!("/v1/devices/{id}/fail"))))
            .send_empty()
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// `POST /v1/devices/{id}/restore`: the restore's report (for `headroom device restore`).
    pub fn restore_device(&self, id: u32) -> Result<Value> {
        let response = self
            .authorized(
                self.agent
                    .post(self.url(&format!("/v1/devices/{id}/restore"))),
            )
            .send_empty()
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// `POST /v1/volumes/{name}/scrub`: the scrub's report (for `headroom volume scrub`).
    pub fn scrub(&self, name: &str) -> Result<Value> {
        let path = format!("/v1/volumes/{}/scrub", path_segment(name));
        let response = self
            .authorized(self.agent.post(self.url(&path)))
            .send_empty()
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// `PUT /v1/rebuild`: sets the rebuild's rate; the rebuild as the API answered.
    pub fn set_rebuild_rate(&self, rate_bytes_per_s: u64) -> Result<Value> {
        self.set_rate("/v1/rebuild", rate_bytes_per_s)
    }

    /// `PUT /v1/scrub`: sets the background scrub's rate; the scrub as the API answered.
    pub fn set_scrub_rate(&self, rate_bytes_per_s: u64) -> Result<Value> {
        self.set_rate("/v1/scrub", rate_bytes_per_s)
    }

    fn set_rate(&self, path: &str, rate_bytes_per_s: u64) -> Result<Value> {
        let response = self
            .authorized(self.agent.put(self.url(path)))
            .send_json(serde_json::json!({ "rate_bytes_per_s": rate_bytes_per_s }))
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// `POST /v1/scrub`: starts a pass of the background scrub; the scrub as the API answered.
    pub fn start_scrub(&self) -> Result<Value> {
        let response = self
            .authorized(self.agent.post(self.url("/v1/scrub")))
            .send_empty()
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// `GET /v1/pool`, as the API answered it (for `headroom pool`).
    pub fn pool_json(&self) -> Result<Value> {
        self.get_json("/v1/pool")
    }

    /// `GET path`, as JSON.
    pub fn get_json(&self, path: &str) -> Result<Value> {
        let response = self
            .authorized(self.agent.get(self.url(path)))
            .call()
            .map_err(|err| self.unreachable(err))?;
        self.decode(response)
    }

    /// Adds `Authorization: Bearer` when a token was found.
    fn authorized<B>(&self, request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match self.token.token() {
            Some(token) => request.header("Authorization", format!("Bearer {}", token.expose())),
            None => request,
        }
    }

    fn unreachable(&self, err: ureq::Error) -> ApiCallError {
        ApiCallError::Unreachable {
            url: self.base.clone(),
            reason: err.to_string(),
        }
    }

    fn decode<T: DeserializeOwned>(&self, mut response: Response<ureq::Body>) -> Result<T> {
        if !response.status().is_success() {
            return Err(self.server_error(response).into());
        }
        response
            .body_mut()
            .read_json::<T>()
            .context("reading the API's answer")
    }

    /// Ok for a 2xx answer with no body we need (`204 No Content`).
    fn expect_success(&self, response: Response<ureq::Body>) -> Result<()> {
        if response.status().is_success() {
            return Ok(());
        }
        Err(self.server_error(response).into())
    }

    /// The server's error body as an [`ApiCallError`]; a 401 also says where the token was
    /// looked for and what to try.
    fn server_error(&self, response: Response<ureq::Body>) -> ApiCallError {
        let error = server_error(response);
        match error {
            ApiCallError::Unauthorized { message } => ApiCallError::Unauthorized {
                message: format!(
                    "{message}\n{}. Set {TOKEN_ENV} to the server's token, or point --data-dir at \
                     the server's data directory (its {} file), or give --token-file FILE",
                    self.token.describe(),
                    token::TOKEN_FILE
                ),
            },
            other => other,
        }
    }
}

fn parse<T: DeserializeOwned>(value: Value) -> Result<T> {
    serde_json::from_value(value)
        .context("reading the API's answer (is the server the same version?)")
}

/// The server's error body (`{"error", "kind"}`) as an [`ApiCallError`] by status.
fn server_error(mut response: Response<ureq::Body>) -> ApiCallError {
    let status = response.status();
    let text = response.body_mut().read_to_string().unwrap_or_default();
    let (kind, message) = match serde_json::from_str::<ApiErrorBody>(&text) {
        Ok(body) if body.kind == "invalid_qos" => {
            // The reason may already say so ("invalid QoS: ceiling_iops ..."): say it once.
            let reason = body
                .error
                .strip_prefix("invalid QoS: ")
                .unwrap_or(&body.error);
            (body.kind.clone(), format!("invalid QoS: {reason}"))
        }
        Ok(body) => (body.kind, format!("{} ({status})", body.error)),
        // Not our error format (a proxy, or a server of another version).
        Err(_) if !text.trim().is_empty() => (String::new(), format!("{} ({status})", text.trim())),
        Err(_) => (String::new(), format!("the API answered {status}")),
    };
    match status.as_u16() {
        401 => ApiCallError::Unauthorized { message },
        404 => ApiCallError::NotFound { kind, message },
        409 => ApiCallError::Conflict { kind, message },
        code => ApiCallError::Server {
            status: code,
            kind,
            message,
        },
    }
}

/// `text` percent-encoded as one URL path segment (tenant ids may hold spaces, `/`, `%`, ...):
/// everything but RFC 3986's unreserved characters is escaped.
/// A segment of dots only (`.`, `..`) is escaped whole, or URL normalisation would eat it.
pub fn path_segment(text: &str) -> String {
    let dots_only = text.bytes().all(|b| b == b'.');
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if !dots_only && (byte.is_ascii_alphanumeric() || b"-._~".contains(&byte)) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_segments_escape_everything_but_unreserved() {
        assert_eq!(path_segment("acme-1.x_y~z"), "acme-1.x_y~z");
        assert_eq!(path_segment("Tenant A/b%c"), "Tenant%20A%2Fb%25c");
        assert_eq!(path_segment(".."), "%2E%2E");
        assert_eq!(path_segment("a.b"), "a.b");
    }
}
