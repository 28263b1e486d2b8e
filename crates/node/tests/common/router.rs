//! The management API called in process: the node's real router (`api::router`, a `tower`
//! service) called with one request, no HTTP client and no socket. One helper for every
//! in-process API test.

use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use headroom_node::server::RunningNode;
use serde_json::Value;

/// What a call sends: method, path, token, and a body (JSON unless `raw`).
pub struct Call<'a> {
    pub method: Method,
    pub path: &'a str,
    pub token: Option<&'a str>,
    pub body: Option<Vec<u8>>,
    pub content_type: Option<&'a str>,
}

impl<'a> Call<'a> {
    pub fn new(method: Method, path: &'a str, token: Option<&'a str>) -> Call<'a> {
        Call {
            method,
            path,
            token,
            body: None,
            content_type: None,
        }
    }

    pub fn json(mut self, body: &Value) -> Call<'a> {
        self.body = Some(serde_json::to_vec(body).unwrap());
        self.content_type = Some("application/json");
        self
    }

    pub fn raw(mut self, body: &[u8], content_type: Option<&'a str>) -> Call<'a> {
        self.body = Some(body.to_vec());
        self.content_type = content_type;
        self
    }
}

/// Calls the node's router once: the status and the body as text.
pub async fn call_text(node: &RunningNode, call: Call<'_>) -> (StatusCode, String) {
    let mut router = headroom_node::api::router(node.api_state().clone());
    let mut request = Request::builder().method(call.method).uri(call.path);
    if let Some(token) = call.token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    if let Some(content_type) = call.content_type {
        request = request.header(header::CONTENT_TYPE, content_type);
    }
    let request = request
        .body(call.body.map_or_else(Body::empty, Body::from))
        .expect("a request");
    let response = match tower_service::Service::call(&mut router, request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 4 << 20)
        .await
        .expect("the body");
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// Calls the node's router once: the status and the body as JSON (`Null` if it is not).
pub async fn call(node: &RunningNode, call: Call<'_>) -> (StatusCode, Value) {
    let (status, text) = call_text(node, call).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// A GET of `path` with `token`: the status and the body as JSON.
pub async fn get(node: &RunningNode, path: &str, token: Option<&str>) -> (StatusCode, Value) {
    call(node, Call::new(Method::GET, path, token)).await
}
