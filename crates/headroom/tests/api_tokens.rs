//! Scoped API tokens and the audit log, end to end against the real server:
//!
//! * `headroom token create --scope read|admin --name NAME` prints a secret once; the token
//!   works at once, `token revoke` refuses it at once (no restart), and tokens survive a
//!   restart (kept hashed in `DATA_DIR/api-tokens.json`, without the secret);
//! * a `read` token gets 403 on every operation of the OpenAPI document (the route table)
//!   whose method is not GET, and on every such method of every path, so a route added later
//!   cannot slip through; its GETs work; the bootstrap token stays `admin`;
//! * `DATA_DIR/audit.log` gains exactly one JSON line per mutating request (who, route, path,
//!   target, status), already there when the response arrives, and none per GET.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use common::{BIN, Server, TEST_TOKEN, agent, text};
use serde_json::{Value, json};

/// Status and JSON body (`Null` when none) of `method url` with `token` and `body`.
fn call(method: &str, url: &str, token: &str, body: Option<&Value>) -> (u16, Value) {
    let a = agent();
    let auth = format!("Bearer {token}");
    let result = match (method, body) {
        ("get", _) => a.get(url).header("authorization", &auth).call(),
        ("delete", _) => a.delete(url).header("authorization", &auth).call(),
        ("post", Some(b)) => a.post(url).header("authorization", &auth).send_json(b),
        ("post", None) => a
            .post(url)
            .header("authorization", &auth)
            .header("content-type", "application/json")
            .send("{}"),
        ("put", b) => a
            .put(url)
            .header("authorization", &auth)
            .send_json(b.cloned().unwrap_or(json!({}))),
        ("patch", b) => a
            .patch(url)
            .header("authorization", &auth)
            .send_json(b.cloned().unwrap_or(json!({}))),
        (other, _) => panic!("unknown method {other}"),
    };
    let mut response = result.unwrap();
    let status = response.status().as_u16();
    let text = response.body_mut().read_to_string().unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// `headroom token ...` against `server`, with `token` as HEADROOM_TOKEN.
fn token_cli(server: &Server, token: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(BIN)
        .arg("token")
        .args(args)
        .env("HEADROOM_API", &server.api)
        .env("HEADROOM_TOKEN", token)
        .output()
        .unwrap()
}

fn create_token(server: &Server, scope: &str, name: &str) -> String {
    let out = token_cli(
        server,
        TEST_TOKEN,
        &["create", "--scope", scope, "--name", name],
    );
    assert!(out.status.success(), "{}", text(&out));
    let secret = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(
        secret.starts_with("hrt_") && secret.len() == 68,
        "{secret:?}"
    );
    secret
}

/// Every (method, path) of the OpenAPI document.
fn operations(server: &Server) -> Vec<(String, String)> {
    let (status, doc) = call(
        "get",
        &format!("{}/openapi.json", server.api),
        TEST_TOKEN,
        None,
    );
    assert_eq!(status, 200);
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            ops.push((method.clone(), path.clone()));
        }
    }
    ops
}

/// `path` with its `{parameters}` filled in.
fn concrete(path: &str) -> String {
    path.split('/')
        .map(|s| if s.starts_with('{') { "x" } else { s })
        .collect::<Vec<_>>()
        .join("/")
}

fn audit_lines(server: &Server) -> Vec<Value> {
    std::fs::read_to_string(server.data_dir.join("audit.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn tokens_are_scoped_revocable_and_rotatable_without_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let args = ["--devices", "1", "--device-size", "1GiB"];
    let server = Server::start_with(&data, &args);
    let volumes = format!("{}/v1/volumes", server.api);
    let read = create_token(&server, "read", "grafana");
    let ci = create_token(&server, "admin", "ci");

    // read: GETs yes, changes no.
    assert_eq!(call("get", &volumes, &read, None).0, 200);
    assert_eq!(
        call("get", &format!("{}/metrics", server.api), &read, None).0,
        200
    );
    let body = json!({"name": "v", "size_bytes": 1u64 << 20});
    let (status, error) = call("post", &volumes, &read, Some(&body));
    assert_eq!(
        (status, &error["kind"]),
        (403, &json!("forbidden")),
        "{error}"
    );
    // A read token cannot mint itself an admin one.
    let out = token_cli(&server, &read, &["create", "--scope", "admin"]);
    assert!(!out.status.success(), "{}", text(&out));
    // admin: changes yes.
    assert_eq!(call("post", &volumes, &ci, Some(&body)).0, 201);

    // The list shows ids, names and scopes, never a secret.
    let out = token_cli(&server, &read, &["list", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<(&str, &str)> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["name"].as_str().unwrap(), t["scope"].as_str().unwrap()))
        .collect();
    assert_eq!(
        names,
        [
            ("bootstrap token", "admin"),
            ("grafana", "read"),
            ("ci", "admin")
        ]
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains(&read[4..]));

    // Rotation: a new admin token, then the old one revoked; no restart.
    let ci2 = create_token(&server, "admin", "ci-2");
    let out = token_cli(&server, &ci2, &["revoke", "ci"]);
    assert!(out.status.success(), "{}", text(&out));
    let (status, error) = call("get", &volumes, &ci, None);
    assert_eq!((status, &error["kind"]), (401, &json!("unauthorized")));
    assert_eq!(call("delete", &format!("{volumes}/v"), &ci2, None).0, 204);
    // The bootstrap token is configuration: not revocable here, and still admin.
    let out = token_cli(&server, &ci2, &["revoke", "bootstrap"]);
    assert!(!out.status.success(), "{}", text(&out));
    assert_eq!(call("post", &volumes, TEST_TOKEN, Some(&body)).0, 201);

    // Only hashes on disk; after a restart the same tokens hold.
    let stored = std::fs::read_to_string(data.join("api-tokens.json")).unwrap();
    for secret in [&read, &ci, &ci2] {
        assert!(!stored.contains(&secret[4..]), "a secret on disk: {stored}");
    }
    server.stop();
    let server = Server::start_with(&data, &args);
    let volumes = format!("{}/v1/volumes", server.api);
    assert_eq!(call("get", &volumes, &read, None).0, 200);
    assert_eq!(call("get", &volumes, &ci, None).0, 401);
    assert_eq!(call("delete", &format!("{volumes}/v"), &ci2, None).0, 204);
    server.stop();
}

#[test]
fn a_read_token_is_refused_on_every_route_that_is_not_a_get() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("data"), "1GiB");
    server.create_volume("x", "64MiB");
    let read = create_token(&server, "read", "viewer");
    let ops = operations(&server);
    let mutating: Vec<_> = ops.iter().filter(|(m, _)| m != "get").collect();
    assert!(mutating.len() >= 12, "the route table: {ops:?}");
    for (method, path) in &mutating {
        let url = format!("{}{}", server.api, concrete(path));
        let (status, error) = call(method, &url, &read, None);
        assert_eq!(status, 403, "{method} {path} with a read token: {error}");
        assert_eq!(error["kind"], "forbidden", "{method} {path}");
    }
    // Every method that is not GET on every path, routed or not: refused before routing.
    let mut paths: Vec<&String> = ops.iter().map(|(_, p)| p).collect();
    paths.dedup();
    for path in paths {
        for method in ["post", "put", "patch", "delete"] {
            let url = format!("{}{}", server.api, concrete(path));
            assert_eq!(call(method, &url, &read, None).0, 403, "{method} {path}");
        }
    }
    // Its GETs are answered, and nothing was changed.
    for (method, path) in ops.iter().filter(|(m, _)| m == "get") {
        if path.contains('{') {
            continue;
        }
        let url = format!("{}{path}", server.api);
        assert_eq!(call(method, &url, &read, None).0, 200, "GET {path}");
    }
    let out = server.cli(&["volume", "show", "x"]);
    assert!(out.status.success(), "the volume survived: {}", text(&out));
    server.stop();
}

#[test]
fn each_mutating_request_appends_one_audit_record_and_a_get_none() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("data"), "1GiB");
    let ops = operations(&server);

    // GETs: nothing.
    let before = audit_lines(&server).len();
    for (method, path) in ops.iter().filter(|(m, _)| m == "get") {
        call(
            method,
            &format!("{}{}", server.api, concrete(path)),
            TEST_TOKEN,
            None,
        );
    }
    assert_eq!(audit_lines(&server).len(), before, "a GET was audited");

    // Every mutating operation of the route table: one record each, there when the
    // response is, saying who, what and how it ended.
    let mut audited = 0;
    for (method, path) in ops.iter().filter(|(m, _)| m != "get") {
        let url = format!("{}{}", server.api, concrete(path));
        let before = audit_lines(&server).len();
        let (status, _) = call(method, &url, TEST_TOKEN, None);
        let lines = audit_lines(&server);
        assert_eq!(lines.len(), before + 1, "{method} {path}: {lines:?}");
        let record = &lines[before];
        assert_eq!(record["method"], method.to_uppercase(), "{record}");
        assert_eq!(record["route"], path.as_str(), "{record}");
        assert_eq!(record["path"], concrete(path), "{record}");
        assert_eq!(record["status"], status, "{record}");
        assert_eq!(record["token_id"], "bootstrap", "{record}");
        assert_eq!(record["token_name"], "bootstrap token", "{record}");
        assert!(
            record["unix_ms"].as_u64().unwrap() > 1_600_000_000_000,
            "{record}"
        );
        assert!(record["time"].as_str().unwrap().ends_with('Z'), "{record}");
        if path.contains('{') {
            assert_eq!(record["target"], "x", "{record}");
        }
        audited += 1;
    }
    assert!(audited >= 12, "{ops:?}");

    // A real change names its target and token; a read token's refusal is recorded too.
    let read = create_token(&server, "read", "viewer");
    let volumes = format!("{}/v1/volumes", server.api);
    let body = json!({"name": "db1", "size_bytes": 1u64 << 20});
    assert_eq!(call("post", &volumes, TEST_TOKEN, Some(&body)).0, 201);
    assert_eq!(call("post", &volumes, &read, Some(&body)).0, 403);
    // Unauthenticated attempts have no "who" and are not recorded.
    assert_eq!(
        call(
            "delete",
            &format!("{volumes}/db1"),
            "not-a-token-at-all",
            None
        )
        .0,
        401
    );
    let lines = audit_lines(&server);
    let tail: Vec<(&str, &str, u64, &str)> = lines[lines.len() - 3..]
        .iter()
        .map(|r| {
            (
                r["token_name"].as_str().unwrap(),
                r["route"].as_str().unwrap(),
                r["status"].as_u64().unwrap(),
                r["target"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        tail,
        [
            ("bootstrap token", "/v1/tokens", 201, "viewer"),
            ("bootstrap token", "/v1/volumes", 201, "db1"),
            ("viewer", "/v1/volumes", 403, "db1"),
        ]
    );
    assert_eq!(lines[lines.len() - 1]["scope"], "read");
    server.stop();
}
