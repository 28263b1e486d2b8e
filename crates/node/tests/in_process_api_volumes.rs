//! The management API's volume routes, metrics and probes on a node started in this process
//! (`tests/common`), called through the real router (`api::router`, a `tower` service) with
//! the node's token: the whole create/list/show/resize/delete cycle, each kind of bad input
//! answered with a 4xx and a JSON error body, the token check on every route that needs it,
//! and what the API shows agreeing with what NBD serves.

#![allow(clippy::unwrap_used)] // helpers too: a failed decode is a failed test

mod common;

use axum::http::{Method, StatusCode};
use common::router::{Call, call, call_text};
use headroom_node::server::RunningNode;
use serde_json::{Value, json};

/// Asserts a JSON error body of `kind` with a message.
#[track_caller]
fn assert_error(body: &Value, kind: &str) {
    assert_eq!(body["kind"], kind, "{body}");
    assert!(
        body["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{body}"
    );
}

fn token(node: &RunningNode) -> String {
    node.api_token().expose().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_is_created_listed_shown_resized_and_deleted() {
    let node = common::start(common::config()).await;
    let token = token(&node);
    let t = Some(token.as_str());
    let (status, body) = call(
        &node,
        Call::new(Method::POST, "/v1/volumes", t)
            .json(&json!({"name": "data", "size_bytes": 4 << 20})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["name"], "data", "{body}");
    assert_eq!(body["size_bytes"], 4 << 20, "{body}");

    let (status, body) = call(&node, Call::new(Method::GET, "/v1/volumes", t)).await;
    assert_eq!(status, StatusCode::OK);
    let names: Vec<&str> = body
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["data"]);

    let (status, body) = call(&node, Call::new(Method::GET, "/v1/volumes/data", t)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["name"], "data");
    assert_eq!(body["read_only"], false);

    let (status, body) = call(
        &node,
        Call::new(Method::PATCH, "/v1/volumes/data", t).json(&json!({"size_bytes": 8 << 20})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["size_bytes"], 8 << 20);
    assert_eq!(
        node.store().volume_info("data").unwrap().size_bytes,
        8 << 20
    );

    let (status, _) = call(&node, Call::new(Method::DELETE, "/v1/volumes/data", t)).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, body) = call(&node, Call::new(Method::GET, "/v1/volumes/data", t)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_error(&body, "not_found");
    let (status, body) = call(&node, Call::new(Method::DELETE, "/v1/volumes/data", t)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_error(&body, "not_found");
    let (_, body) = call(&node, Call::new(Method::GET, "/v1/volumes", t)).await;
    assert_eq!(body, json!([]));
    assert!(node.store().list_volumes().is_empty());
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_created_through_the_api_is_served_over_nbd_as_created() {
    let node = common::start(common::config()).await;
    let token = token(&node);
    let t = Some(token.as_str());
    for body in [
        json!({"name": "rw", "size_bytes": 2 << 20}),
        json!({"name": "ro", "size_bytes": 1 << 20, "read_only": true}),
        json!({"name": "q", "size_bytes": 1 << 20, "qos": {"baseline_iops": 500, "ceiling_iops": 5000}}),
    ] {
        let (status, reply) =
            call(&node, Call::new(Method::POST, "/v1/volumes", t).json(&body)).await;
        assert_eq!(status, StatusCode::CREATED, "{body} -> {reply}");
    }
    let mut rw = common::connect(&node, "rw").await.expect("rw");
    assert_eq!((rw.size_bytes, rw.read_only), (2 << 20, false));
    assert_eq!(rw.write(0, &[1u8; 4096]).await, 0);
    let mut ro = common::connect(&node, "ro").await.expect("ro");
    assert_eq!((ro.size_bytes, ro.read_only), (1 << 20, true));
    assert_eq!(
        ro.write(0, &[1u8; 4096]).await,
        headroom_nbd::consts::NBD_EPERM
    );
    let mut q = common::connect(&node, "q").await.expect("q");
    assert_eq!(q.write(0, &[1u8; 4096]).await, 0);
    let (status, body) = call(&node, Call::new(Method::GET, "/v1/volumes/q", t)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        !body["qos_class"].is_null(),
        "the QoS class is not shown: {body}"
    );
    for client in [rw, ro, q] {
        client.disconnect().await;
    }
    // Deleted: no longer offered.
    let (status, _) = call(&node, Call::new(Method::DELETE, "/v1/volumes/rw", t)).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(
        common::connect(&node, "rw").await.is_err(),
        "a deleted volume was offered"
    );
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_volume_input_is_a_4xx_with_a_json_error_and_changes_nothing() {
    let node = common::start_with_volume("taken", 1 << 20).await;
    let token = token(&node);
    let t = Some(token.as_str());
    let cases: [(Value, StatusCode, &str); 5] = [
        (
            json!({"name": "taken", "size_bytes": 1 << 20}),
            StatusCode::CONFLICT,
            "already_exists",
        ),
        (
            json!({"name": "bad/name", "size_bytes": 1 << 20}),
            StatusCode::BAD_REQUEST,
            "invalid_name",
        ),
        (
            json!({"name": ".hidden", "size_bytes": 1 << 20}),
            StatusCode::BAD_REQUEST,
            "invalid_name",
        ),
        (
            json!({"name": "odd", "size_bytes": 1000}),
            StatusCode::BAD_REQUEST,
            "invalid_size",
        ),
        (
            json!({"name": "x", "size_bytes": 1 << 20, "colour": "red"}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
        ),
    ];
    for (body, expected, kind) in cases {
        let (status, reply) =
            call(&node, Call::new(Method::POST, "/v1/volumes", t).json(&body)).await;
        assert_eq!(status, expected, "{body} -> {reply}");
        assert_error(&reply, kind);
    }
    let (status, reply) = call(
        &node,
        Call::new(Method::POST, "/v1/volumes", t).raw(b"{\"name\": ", Some("application/json")),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_error(&reply, "malformed_json");
    let (status, reply) = call(
        &node,
        Call::new(Method::POST, "/v1/volumes", t).raw(b"name=x", Some("text/plain")),
    )
    .await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_error(&reply, "unsupported_media_type");
    let (status, reply) = call(
        &node,
        Call::new(Method::POST, "/v1/volumes", t)
            .json(&json!({"name": "qq", "size_bytes": 1 << 20, "qos": {"baseline_iops": 10, "ceiling_iops": 5}})),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{reply}");
    assert_error(&reply, "invalid_qos");
    let (status, reply) = call(
        &node,
        Call::new(Method::PATCH, "/v1/volumes/taken", t).json(&json!({"size_bytes": 1001})),
    )
    .await;
    assert!(status.is_client_error(), "{status} {reply}");
    assert_error(&reply, "invalid_size");
    // Nothing was created or changed.
    let names: Vec<String> = node
        .store()
        .list_volumes()
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(names, ["taken"]);
    assert_eq!(
        node.store().volume_info("taken").unwrap().size_bytes,
        1 << 20
    );
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_volume_route_and_metrics_need_the_token_and_nothing_changes_without_it() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let create = json!({"name": "w", "size_bytes": 1 << 20});
    for token in [None, Some("hrt_not_the_token")] {
        let calls = [
            Call::new(Method::GET, "/v1/volumes", token),
            Call::new(Method::POST, "/v1/volumes", token).json(&create),
            Call::new(Method::GET, "/v1/volumes/v", token),
            Call::new(Method::PATCH, "/v1/volumes/v", token).json(&json!({"size_bytes": 2 << 20})),
            Call::new(Method::DELETE, "/v1/volumes/v", token),
            Call::new(Method::GET, "/v1/connections", token),
            Call::new(Method::GET, "/metrics", token),
        ];
        for c in calls {
            let what = format!("{} {} with {token:?}", c.method, c.path);
            let (status, body) = call(&node, c).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{what}: {body}");
            assert_error(&body, "unauthorized");
        }
    }
    let names: Vec<String> = node
        .store()
        .list_volumes()
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(names, ["v"]);
    assert_eq!(node.store().volume_info("v").unwrap().size_bytes, 1 << 20);
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_readiness_answer_without_a_token() {
    let node = common::start(common::config()).await;
    let (status, body) = call(&node, Call::new(Method::GET, "/healthz", None)).await;
    assert_eq!((status, &body["status"]), (StatusCode::OK, &json!("ok")));
    let (status, body) = call(&node, Call::new(Method::GET, "/readyz", None)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "ready");
    assert_eq!(body["reasons"], json!([]));
    // The token-checked twin of /healthz.
    let (status, _) = call(&node, Call::new(Method::GET, "/v1/health", None)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let token = token(&node);
    let (status, body) = call(&node, Call::new(Method::GET, "/v1/health", Some(&token))).await;
    assert_eq!((status, &body["status"]), (StatusCode::OK, &json!("ok")));
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_the_volume_and_the_io_done_to_it_over_nbd() {
    let node = common::start_with_volume("metered", 1 << 20).await;
    let token = token(&node);
    let mut client = common::connect(&node, "metered").await.expect("served");
    for i in 0..5u64 {
        assert_eq!(client.write(i * 4096, &[1u8; 4096]).await, 0);
    }
    assert_eq!(client.read(0, 4096).await.0, 0);
    client.disconnect().await;
    let (status, text) = call_text(&node, Call::new(Method::GET, "/metrics", Some(&token))).await;
    assert_eq!(status, StatusCode::OK);
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains("volume=\"metered\""))
        .collect();
    assert!(!lines.is_empty(), "no series of the volume:\n{text}");
    // A counter of write operations of this volume says 5.
    let writes = lines.iter().find(|l| {
        l.contains("op=\"write\"")
            && l.contains("_total")
            && !l.contains("bytes")
            && !l.contains("error")
    });
    let writes =
        writes.unwrap_or_else(|| panic!("no write counter of the volume:\n{}", lines.join("\n")));
    let value: f64 = writes.rsplit(' ').next().unwrap().parse().unwrap();
    assert_eq!(value, 5.0, "{writes}");
    assert!(text.trim_end().ends_with("# EOF"), "not OpenMetrics text");
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_report_the_nbd_sessions_and_the_memory_budget() {
    let node = common::start_with_volume("v", 1 << 20).await;
    let token = token(&node);
    let client = common::connect(&node, "v").await.expect("served");
    let (status, body) = call(
        &node,
        Call::new(Method::GET, "/v1/connections", Some(&token)),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["open"], 1, "{body}");
    assert_eq!(body["transmitting"], 1, "{body}");
    assert_eq!(body["connections"][0]["volume"], "v", "{body}");
    assert_eq!(body["memory"]["inflight_bytes"], 0, "{body}");
    assert_eq!(
        body["memory"]["max_inflight_bytes_per_node"],
        common::config().limits.max_inflight_bytes_per_node,
        "{body}"
    );
    client.disconnect().await;
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_and_methods_are_json_404_and_405() {
    let node = common::start(common::config()).await;
    let token = token(&node);
    let t = Some(token.as_str());
    let (status, body) = call(&node, Call::new(Method::GET, "/v1/nothing-here", t)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_error(&body, "unknown_route");
    let (status, body) = call(&node, Call::new(Method::PUT, "/v1/volumes", t)).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_error(&body, "method_not_allowed");
    node.shutdown().await.expect("a clean stop");
}
