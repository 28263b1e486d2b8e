//! `GET /openapi.json`: an OpenAPI 3 document generated from the code. It parses, every
//! `$ref` in it resolves, every operation it lists is served by the router (not `unknown_route`
//! or `method_not_allowed`), and every route this test knows the router serves is listed, with
//! the bearer security on all but `/healthz` and `/readyz`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use common::Server;
use serde_json::Value;

/// The routes of the volume, tenant and node API (method, OpenAPI path).
const KNOWN_ROUTES: &[(&str, &str)] = &[
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/v1/health"),
    ("get", "/openapi.json"),
    ("get", "/v1/pool"),
    ("get", "/v1/devices"),
    ("post", "/v1/devices/{id}/fail"),
    ("post", "/v1/devices/{id}/restore"),
    ("get", "/v1/node"),
    ("get", "/v1/connections"),
    ("get", "/v1/volumes"),
    ("post", "/v1/volumes"),
    ("get", "/v1/volumes/{name}"),
    ("patch", "/v1/volumes/{name}"),
    ("delete", "/v1/volumes/{name}"),
    ("get", "/v1/volumes/{name}/attachments"),
    ("post", "/v1/volumes/{name}/attachments"),
    ("delete", "/v1/volumes/{name}/attachments"),
    ("get", "/v1/tenants"),
    ("post", "/v1/tenants"),
    ("get", "/v1/tenants/{id}"),
    ("delete", "/v1/tenants/{id}"),
    ("get", "/v1/tokens"),
    ("post", "/v1/tokens"),
    ("delete", "/v1/tokens/{id}"),
    ("get", "/metrics"),
    ("get", "/v1/stats"),
];

use common::agent;

/// Every `"$ref": "#/..."` in `value`.
fn refs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("$ref", Value::String(r)) => out.push(r.clone()),
                    _ => refs(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

/// Status and `kind` (if the body is our JSON error) of `method path` with the token.
fn call(server: &Server, method: &str, path: &str) -> (u16, Option<String>) {
    let url = format!("{}{path}", server.api);
    let a = agent();
    let auth = common::bearer();
    let result = match method {
        "get" => a.get(&url).header("authorization", &auth).call(),
        "delete" => a.delete(&url).header("authorization", &auth).call(),
        "post" => a
            .post(&url)
            .header("authorization", &auth)
            .header("content-type", "application/json")
            .send("{}"),
        "patch" => a
            .patch(&url)
            .header("authorization", &auth)
            .header("content-type", "application/json")
            .send("{}"),
        "put" => a
            .put(&url)
            .header("authorization", &auth)
            .header("content-type", "application/json")
            .send("{}"),
        other => panic!("the document has a method this test does not know: {other}"),
    };
    let mut response = result.unwrap();
    let status = response.status().as_u16();
    let text = response.body_mut().read_to_string().unwrap_or_default();
    let kind = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v["kind"].as_str().map(str::to_string));
    (status, kind)
}

#[test]
fn the_openapi_document_matches_the_routes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "1GiB");

    // Behind the token like everything but /healthz.
    let response = agent()
        .get(format!("{}/openapi.json", server.api))
        .call()
        .unwrap();
    assert_eq!(response.status().as_u16(), 401);
    let mut response = agent()
        .get(format!("{}/openapi.json", server.api))
        .header("authorization", common::bearer())
        .call()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let doc: Value = response.body_mut().read_json().unwrap();
    let version = doc["openapi"].as_str().unwrap();
    assert!(version.starts_with("3."), "openapi {version}");
    assert!(doc["info"]["title"].is_string() && doc["info"]["version"].is_string());
    let paths = doc["paths"].as_object().expect("paths");

    let mut all_refs = Vec::new();
    refs(&doc, &mut all_refs);
    for r in &all_refs {
        let pointer = r.strip_prefix('#').expect("a local $ref");
        assert!(doc.pointer(pointer).is_some(), "$ref {r} does not resolve");
    }

    // Every operation listed is served.
    let mut operations = 0;
    for (path, item) in paths {
        for (method, op) in item.as_object().unwrap() {
            if !["get", "put", "post", "patch", "delete"].contains(&method.as_str()) {
                continue;
            }
            operations += 1;
            let concrete = path.replace('{', "no-such-").replace('}', "");
            let (status, kind) = call(&server, method, &concrete);
            assert!(
                status != 405 && kind.as_deref() != Some("unknown_route"),
                "{method} {path} is in the document but the router answers {status} {kind:?}"
            );
            let security = &op["security"];
            if path == "/healthz" || path == "/readyz" {
                assert_eq!(security, &serde_json::json!([{}]), "{path} must be public");
            } else {
                // Either on the operation or inherited from the document.
                let effective = if security.is_null() {
                    &doc["security"]
                } else {
                    security
                };
                assert!(
                    effective.to_string().contains("bearer"),
                    "{method} {path}: no bearer security ({effective})"
                );
            }
        }
    }
    // Every route known to be served is listed.
    for (method, path) in KNOWN_ROUTES {
        assert!(
            paths
                .get(*path)
                .is_some_and(|item| item[*method].is_object()),
            "{method} {path} is served but missing from the document"
        );
    }
    println!(
        "openapi {version}: {} paths, {operations} operations, {} $refs resolved",
        paths.len(),
        all_refs.len()
    );
    server.stop();
}
