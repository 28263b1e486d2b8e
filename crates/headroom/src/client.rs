//! A small blocking client of the node's `/v1/` API, used by `headroom volume ...`.
//!
//! Errors from the server arrive as `{"error": .., "kind": ..}` and are shown as they are, so
//! the operator sees the server's reason (name taken, pool full, invalid QoS) rather than a
//! status code.

use std::time::Duration;

use anyhow::{Context, Result};
use headroom_node::api::{ApiErrorBody, CreateVolume, UpdateVolume, VolumeView};
use headroom_qos::QosSpec;
use serde::de::DeserializeOwned;
use serde_json::Value;
use ureq::Agent;
use ureq::http::Response;

pub struct Api {
    base: String,
    agent: Agent,
}

impl Api {
    pub fn new(base: &str) -> Api {
        let agent: Agent = Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        Api {
            base: base.trim_end_matches('/').to_string(),
            agent,
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
            .agent
            .post(self.url("/v1/volumes"))
            .send_json(body)
            .with_context(|| self.unreachable())?;
        decode(response)
    }

    /// `GET /v1/volumes` (`?tenant=` when given: that tenant's volumes), as the API answered.
    pub fn list_json(&self, tenant: Option<&str>) -> Result<Value> {
        let mut request = self.agent.get(self.url("/v1/volumes"));
        if let Some(tenant) = tenant {
            request = request.query("tenant", tenant);
        }
        let response = request.call().with_context(|| self.unreachable())?;
        decode(response)
    }

    pub fn list(&self, tenant: Option<&str>) -> Result<Vec<VolumeView>> {
        parse(self.list_json(tenant)?)
    }

    /// `GET /v1/volumes/{name}`, as the API answered it.
    pub fn show_json(&self, name: &str) -> Result<Value> {
        let response = self
            .agent
            .get(self.volume_url(name))
            .call()
            .with_context(|| self.unreachable())?;
        decode(response)
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
            .agent
            .patch(self.volume_url(name))
            .send_json(body)
            .with_context(|| self.unreachable())?;
        decode(response)
    }

    pub fn delete(&self, name: &str) -> Result<()> {
        let response = self
            .agent
            .delete(self.volume_url(name))
            .call()
            .with_context(|| self.unreachable())?;
        if response.status().is_success() {
            return Ok(());
        }
        Err(server_error(response))
    }

    fn unreachable(&self) -> String {
        format!(
            "cannot reach the Headroom API at {} (is `headroom serve` running? set --api or HEADROOM_API)",
            self.base
        )
    }
}

fn decode<T: DeserializeOwned>(mut response: Response<ureq::Body>) -> Result<T> {
    if !response.status().is_success() {
        return Err(server_error(response));
    }
    response
        .body_mut()
        .read_json::<T>()
        .context("reading the API's answer")
}

fn parse<T: DeserializeOwned>(value: Value) -> Result<T> {
    serde_json::from_value(value)
        .context("reading the API's answer (is the server the same version?)")
}

fn server_error(mut response: Response<ureq::Body>) -> anyhow::Error {
    let status = response.status();
    let text = response.body_mut().read_to_string().unwrap_or_default();
    match serde_json::from_str::<ApiErrorBody>(&text) {
        Ok(body) if body.kind == "invalid_qos" => {
            // The reason may already say so ("invalid QoS: ceiling_iops ..."): say it once.
            let reason = body
                .error
                .strip_prefix("invalid QoS: ")
                .unwrap_or(&body.error);
            anyhow::anyhow!("invalid QoS: {reason}")
        }
        Ok(body) => anyhow::anyhow!("{} ({status})", body.error),
        // Not our error format (a request the server's router rejected before us).
        Err(_) if !text.trim().is_empty() => anyhow::anyhow!("{} ({status})", text.trim()),
        Err(_) => anyhow::anyhow!("the API answered {status}"),
    }
}

impl Api {
    /// `GET /v1/pool`, as the API answered it (for `headroom pool`).
    pub fn pool_json(&self) -> Result<Value> {
        let response = self
            .agent
            .get(self.url("/v1/pool"))
            .call()
            .with_context(|| self.unreachable())?;
        decode(response)
    }
}
