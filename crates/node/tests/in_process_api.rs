//! The management API of a node started in this process (`tests/common`), called in process
//! through its real router (`api::router`): authentication, and a volume created over NBD's
//! side of the node seen through the API. No HTTP client and no socket: the router is a
//! `tower` service called with a request.

mod common;

use axum::http::StatusCode;
use common::router::get;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_volume_list_needs_the_token_and_shows_what_the_node_holds() {
    let node = common::start_with_volume("v", 2 << 20).await;
    let token = node.api_token().expose().to_string();

    let (status, body) = get(&node, "/v1/volumes", None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert_eq!(body["kind"], "unauthorized", "{body}");
    let (status, _) = get(&node, "/v1/volumes", Some("hrt_wrong")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    let (status, body) = get(&node, "/v1/volumes", Some(&token)).await;
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
    let (status, body) = get(&node, "/healthz", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "ok", "{body}");
    let (status, body) = get(&node, "/v1/volumes/nope", Some(&token)).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert!(
        body["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{body}"
    );
    node.shutdown().await.expect("a clean stop");
}
