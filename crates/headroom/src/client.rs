//! A small blocking client of the node's `/v1/` API, used by `headroom volume ...`.
//!
//! Errors from the server arrive as `{"error": .., "kind": ..}` and are shown as they are, so
//! the operator sees the server's reason (name taken, pool full) rather than a status code.

use std::time::Duration;

use anyhow::{Context, Result};
use headroom_node::api::{ApiErrorBody, CreateVolume, UpdateVolume};
use headroom_store::VolumeInfo;
use serde::de::DeserializeOwned;
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

    pub fn create(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo> {
        let body = CreateVolume {
            name: name.to_string(),
            size_bytes,
        };
        let response = self
            .agent
            .post(self.url("/v1/volumes"))
            .send_json(&body)
            .with_context(|| self.unreachable())?;
        decode(response)
    }

    pub fn list(&self) -> Result<Vec<VolumeInfo>> {
        let response = self
            .agent
            .get(self.url("/v1/volumes"))
            .call()
            .with_context(|| self.unreachable())?;
        decode(response)
    }

    pub fn show(&self, name: &str) -> Result<VolumeInfo> {
        let response = self
            .agent
            .get(self.url(&format!("/v1/volumes/{name}")))
            .call()
            .with_context(|| self.unreachable())?;
        decode(response)
    }

    pub fn resize(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo> {
        let body = UpdateVolume {
            size_bytes: Some(size_bytes),
        };
        let response = self
            .agent
            .patch(self.url(&format!("/v1/volumes/{name}")))
            .send_json(&body)
            .with_context(|| self.unreachable())?;
        decode(response)
    }

    pub fn delete(&self, name: &str) -> Result<()> {
        let response = self
            .agent
            .delete(self.url(&format!("/v1/volumes/{name}")))
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

fn server_error(mut response: Response<ureq::Body>) -> anyhow::Error {
    let status = response.status();
    match response.body_mut().read_json::<ApiErrorBody>() {
        Ok(body) => anyhow::anyhow!("{} ({status})", body.error),
        Err(_) => anyhow::anyhow!("the API answered {status}"),
    }
}
