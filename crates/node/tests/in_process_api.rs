//! The management API of a node started in this process (`tests/common`), called in process
//! through its real router (`api::router`): authentication, and a volume created over NBD's
//! side of the node seen through the API. No HTTP client and no socket: the router is a
//! `tower` service called with a request.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};

/// Calls the node's router once: the status and the body.
async fn call(
    node: &headroom_node::server::RunningNode,
    path: &str,
    token: Option<&str>,
) -> (StatusCode, serde_json::Value) {
    let mut router = headroom_node::api::router(node.api_state().clone());
    let mut request = Request::builder().uri(path);
    if let Some(token) = token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request.body(Body::empty()).expect("a request");
    let response = match tower_service::Service::call(&mut router, request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("the body");
    let body = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_volume_list_needs_the_token_and_shows_what_the_node_holds() {
    let node = common::start_with_volume("v", 2 << 20).await;
    let token = node.api_token().expose().to_string();

    let (status, body) = call(&node, "/v1/volumes", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert_eq!(body["kind"], "unauthorized", "{body}");
    let (status, _) = call(&node, "/v1/volumes", Some("hrt_wrong")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    let (status, body) = call(&node, "/v1/volumes", Some(&token)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let names: Vec<&str> = body
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["v"], "{body}");
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_public_and_a_volume_no_one_has_is_a_json_404() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let token = node.api_token().expose().to_string();
    let (status, body) = call(&node, "/healthz", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "ok", "{body}");
    let (status, body) = call(&node, "/v1/volumes/nope", Some(&token)).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert!(
        body["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{body}"
    );
    node.shutdown().await.expect("a clean stop");
}
