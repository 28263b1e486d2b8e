//! Every bad request to the management API gets a JSON body `{"error", "kind"}` with the
//! status that says what was wrong: malformed JSON, unknown fields, a body too large, no JSON
//! content type, a bad query, an unknown route or method, bad sizes and names, a name taken.
//! (Volumes are thin: creating one larger than the free pool succeeds, and a full pool fails
//! the NBD write that finds no free extent with ENOSPC, not the creation.)

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use common::Server;
use serde_json::{Value, json};

use common::agent;

/// Status and JSON body of a response; fails if the body is not the JSON error shape.
fn error_of(mut response: ureq::http::Response<ureq::Body>) -> (u16, Value) {
    let status = response.status().as_u16();
    let text = response.body_mut().read_to_string().unwrap();
    let body: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("status {status}: not JSON ({e}): {text:?}"));
    assert!(
        body["error"].as_str().is_some_and(|e| !e.is_empty()) && body["kind"].is_string(),
        "status {status}: not an error body: {body}"
    );
    (status, body)
}

#[test]
fn bad_requests_get_a_json_error_with_the_right_status() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "4GiB");
    let a = agent();
    let volumes = format!("{}/v1/volumes", server.api);
    let post_raw = |body: &str| {
        a.post(&volumes)
            .header("authorization", common::bearer())
            .header("content-type", "application/json")
            .send(body)
            .unwrap()
    };
    let mut cases = 0;
    let mut check = |what: &str, response, status: u16, kind: &str| {
        let (got, body) = error_of(response);
        assert_eq!(
            (got, body["kind"].as_str()),
            (status, Some(kind)),
            "{what}: {body}"
        );
        cases += 1;
    };

    check(
        "malformed JSON",
        post_raw("{\"name\": "),
        400,
        "malformed_json",
    );
    check(
        "unknown field",
        post_raw(r#"{"name": "v", "size_bytes": 1048576, "colour": "red"}"#),
        422,
        "invalid_body",
    );
    check(
        "wrong type",
        post_raw(r#"{"name": "v", "size_bytes": "big"}"#),
        422,
        "invalid_body",
    );
    check(
        "no content type",
        a.post(&volumes)
            .header("authorization", common::bearer())
            .send(r#"{"name":"v","size_bytes":1048576}"#)
            .unwrap(),
        415,
        "unsupported_media_type",
    );
    let huge = format!(
        r#"{{"name": "v", "size_bytes": 1048576, "tenant": "{}"}}"#,
        "x".repeat(3 << 20)
    );
    check("oversized body", post_raw(&huge), 413, "body_too_large");
    check(
        "bad query",
        a.get(format!("{volumes}?bogus=1"))
            .header("authorization", common::bearer())
            .call()
            .unwrap(),
        400,
        "invalid_query",
    );
    check(
        "unknown route",
        a.get(format!("{}/v1/nothing", server.api))
            .header("authorization", common::bearer())
            .call()
            .unwrap(),
        404,
        "unknown_route",
    );
    check(
        "method a route does not take",
        a.put(&volumes)
            .header("authorization", common::bearer())
            .send("")
            .unwrap(),
        405,
        "method_not_allowed",
    );
    check(
        "size zero",
        post_raw(r#"{"name": "v", "size_bytes": 0}"#),
        400,
        "invalid_size",
    );
    check(
        "name with a path character",
        post_raw(r#"{"name": "a/b", "size_bytes": 1048576}"#),
        400,
        "invalid_name",
    );
    for (what, name) in [
        ("a parent-directory name", ".."),
        ("a dot name", "."),
        ("an encoded slash", "a%2Fb"),
        ("a backslash", "a\\\\b"),
        ("a leading dash", "-v"),
        ("an empty name", ""),
    ] {
        check(
            what,
            post_raw(&format!(r#"{{"name": "{name}", "size_bytes": 1048576}}"#)),
            400,
            "invalid_name",
        );
    }
    check(
        "size not a multiple of 512",
        post_raw(r#"{"name": "v", "size_bytes": 1000}"#),
        400,
        "invalid_size",
    );
    check(
        "negative size",
        post_raw(r#"{"name": "v", "size_bytes": -1}"#),
        422,
        "invalid_body",
    );
    check(
        "size given as a string",
        post_raw(r#"{"name": "v", "size_bytes": "1GiB"}"#),
        422,
        "invalid_body",
    );
    // An encoded slash in the path is one segment: a name no volume can have.
    check(
        "an encoded slash in the path",
        a.get(format!("{volumes}/a%2Fb"))
            .header("authorization", common::bearer())
            .call()
            .unwrap(),
        404,
        "not_found",
    );
    check(
        "unknown volume",
        a.get(format!("{volumes}/missing"))
            .header("authorization", common::bearer())
            .call()
            .unwrap(),
        404,
        "not_found",
    );
    let created = a
        .post(&volumes)
        .header("authorization", common::bearer())
        .send_json(json!({"name": "v", "size_bytes": 1u64 << 20}))
        .unwrap();
    assert_eq!(created.status().as_u16(), 201);
    check(
        "name taken",
        post_raw(r#"{"name": "v", "size_bytes": 1048576}"#),
        409,
        "already_exists",
    );
    check(
        "unknown field in a change",
        a.patch(format!("{volumes}/v"))
            .header("authorization", common::bearer())
            .header("content-type", "application/json")
            .send(r#"{"size": 5}"#)
            .unwrap(),
        422,
        "invalid_body",
    );
    check(
        "size over the largest volume",
        post_raw(r#"{"name": "w", "size_bytes": 1099511627776000}"#),
        400,
        "invalid_size",
    );
    // Path parameters that do not parse got axum's plain-text 400 (schemathesis found the
    // first, the `router` fuzz target checks both; fuzz/corpus/router/regression-path-not-u32).
    let base = server.api.clone();
    let post_empty = |path: &str| {
        a.post(format!("{base}{path}"))
            .header("authorization", common::bearer())
            .send_empty()
            .unwrap()
    };
    check(
        "a device id that is not a u32",
        post_empty("/v1/devices/-1/fail"),
        400,
        "invalid_path",
    );
    check(
        "a device id over u32",
        post_empty("/v1/devices/4294967296/restore"),
        400,
        "invalid_path",
    );
    check(
        "a volume name that is not UTF-8",
        a.get(format!("{volumes}/%FF"))
            .header("authorization", common::bearer())
            .call()
            .unwrap(),
        400,
        "invalid_path",
    );
    check(
        "a tenant id that is not UTF-8",
        a.delete(format!("{base}/v1/tenants/%C3%28"))
            .header("authorization", common::bearer())
            .call()
            .unwrap(),
        400,
        "invalid_path",
    );
    println!("api errors: {cases} bad requests, each a JSON error with its status");
    // Nothing above changed the volume list but the one create.
    let mut listed = a
        .get(&volumes)
        .header("authorization", common::bearer())
        .call()
        .unwrap();
    let list: Value = listed.body_mut().read_json().unwrap();
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    server.stop();
}

/// A body declared far over the limit is not read: 413 JSON at once, and `Connection: close`
/// since the unread bytes make the connection unusable.
#[test]
fn a_huge_declared_body_is_refused_without_reading_it() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "1GiB");
    let addr = server.api.strip_prefix("http://").unwrap();
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "POST /v1/volumes HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{{\"name\":",
        common::bearer(),
        1u64 << 30
    )
    .unwrap();
    // The answer comes without the gigabyte having been sent, and the server closes.
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("HTTP response");
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
    let body: Value = serde_json::from_str(body).unwrap();
    assert_eq!(body["kind"], "body_too_large", "{body}");
    server.stop();
}
