//! The management API's bearer token, end to end: every route but `/healthz` refuses a
//! request without the right `Authorization: Bearer` header (401, JSON error body,
//! `WWW-Authenticate: Bearer`); the token comes from HEADROOM_TOKEN or from the data
//! directory's `api-token` file (created mode 0600, reused on restart); the CLI finds that file
//! through `--data-dir`, and a wrong token makes it exit with code 5.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};

use common::{BIN, Server, TEST_TOKEN, text};
use serde_json::Value;

use common::agent;

/// Status, `WWW-Authenticate` and JSON body of a GET with these headers.
fn get(url: &str, authorization: Option<&str>) -> (u16, Option<String>, Value) {
    let mut request = agent().get(url);
    if let Some(value) = authorization {
        request = request.header("authorization", value);
    }
    let mut response = request.call().unwrap();
    let status = response.status().as_u16();
    let challenge = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_string());
    let text = response.body_mut().read_to_string().unwrap();
    let body = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{url}: status {status}, not JSON ({e}): {text:?}"));
    (status, challenge, body)
}

fn assert_unauthorized(what: &str, (status, challenge, body): (u16, Option<String>, Value)) {
    assert_eq!(status, 401, "{what}: {body}");
    assert_eq!(body["kind"], "unauthorized", "{what}: {body}");
    assert!(
        body["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{what}: {body}"
    );
    assert!(
        challenge
            .as_deref()
            .is_some_and(|c| c.starts_with("Bearer")),
        "{what}: WWW-Authenticate {challenge:?}"
    );
}

#[test]
fn every_route_but_healthz_needs_the_bearer_token() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "1GiB");
    server.create_volume("v", "64MiB");
    let volumes = format!("{}/v1/volumes", server.api);
    let good = format!("Bearer {TEST_TOKEN}");

    // The public probe.
    let (status, _, body) = get(&format!("{}/healthz", server.api), None);
    assert_eq!((status, &body), (200, &serde_json::json!({"status": "ok"})));
    let (status, _, body) = get(&format!("{}/readyz", server.api), None);
    assert_eq!(
        (status, &body),
        (200, &serde_json::json!({"status": "ready", "reasons": []}))
    );

    let refusals: [(&str, Option<String>); 7] = [
        ("no header", None),
        (
            "wrong token",
            Some("Bearer not-the-servers-token-at-all".into()),
        ),
        (
            "the token with one byte changed",
            Some(format!("Bearer {}X", &TEST_TOKEN[..TEST_TOKEN.len() - 1])),
        ),
        (
            "a prefix of the token",
            Some(format!("Bearer {}", &TEST_TOKEN[..8])),
        ),
        ("another scheme", Some(format!("Basic {TEST_TOKEN}"))),
        ("a scheme and no token", Some("Bearer ".into())),
        (
            "no space after the scheme",
            Some(format!("Bearer{TEST_TOKEN}")),
        ),
    ];
    let routes = [
        volumes.clone(),
        format!("{volumes}/v"),
        format!("{}/v1/pool", server.api),
        format!("{}/v1/health", server.api),
        format!("{}/v1/connections", server.api),
        // Unknown routes too: nothing tells a stranger which routes exist.
        format!("{}/v1/nothing", server.api),
    ];
    let mut cases = 0;
    for route in &routes {
        for (what, header) in &refusals {
            assert_unauthorized(
                &format!("GET {route} with {what}"),
                get(route, header.as_deref()),
            );
            cases += 1;
        }
    }
    // Writes are refused before the body is read: nothing is created or deleted.
    let mut response = agent()
        .post(&volumes)
        .header("authorization", "Bearer wrong-token-wrong-token")
        .send_json(serde_json::json!({"name": "w", "size_bytes": 1u64 << 20}))
        .unwrap();
    assert_eq!(response.status().as_u16(), 401);
    let body: Value = response.body_mut().read_json().unwrap();
    assert_eq!(body["kind"], "unauthorized");
    let response = agent().delete(format!("{volumes}/v")).call().unwrap();
    assert_eq!(response.status().as_u16(), 401);

    // The right token, with the scheme in any case, is let through.
    let (status, _, list) = get(&volumes, Some(&good));
    assert_eq!(status, 200, "{list}");
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["v"], "the refused POST and DELETE changed nothing");
    let (status, _, _) = get(&volumes, Some(&format!("bearer {TEST_TOKEN}")));
    assert_eq!(status, 200);
    println!("auth: {cases} refused GETs, each 401 with a JSON body and a Bearer challenge");
    server.stop();
}

#[test]
fn the_token_file_is_private_reused_on_restart_and_found_by_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let flags = ["--devices", "1", "--device-size", "1GiB"];
    let server = Server::start_without_token(&data, &flags);
    let path = data.join("api-token");
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "token file mode {:o}", mode & 0o777);
    let token = std::fs::read_to_string(&path).unwrap().trim().to_string();
    assert_eq!(token.len(), 64, "{token:?}");
    assert!(token.bytes().all(|b| b.is_ascii_hexdigit()), "{token:?}");
    let volumes = format!("{}/v1/volumes", server.api);
    assert_eq!(get(&volumes, Some(&format!("Bearer {token}"))).0, 200);
    assert_unauthorized(
        "the test token",
        get(&volumes, Some(&format!("Bearer {TEST_TOKEN}"))),
    );

    // The CLI without HEADROOM_TOKEN finds the file through --data-dir.
    let cli = |args: &[&str], token: Option<&str>| {
        let mut command = Command::new(BIN);
        command.args(args).env("HEADROOM_API", &server.api);
        match token {
            Some(token) => command.env("HEADROOM_TOKEN", token),
            None => command.env_remove("HEADROOM_TOKEN"),
        };
        command.current_dir(dir.path()).output().unwrap()
    };
    let data_arg = data.to_str().unwrap();
    let out = cli(
        &[
            "volume",
            "create",
            "a",
            "--size",
            "16MiB",
            "--data-dir",
            data_arg,
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out));
    let out = cli(&["volume", "list", "--data-dir", data_arg], None);
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains('a'));
    let out = cli(
        &["volume", "list", "--token-file", path.to_str().unwrap()],
        None,
    );
    assert!(out.status.success(), "{}", text(&out));

    // A wrong token: exit code 5 and a hint at what to try.
    let out = cli(&["volume", "list"], Some("a-wrong-token-0123456789"));
    assert_eq!(out.status.code(), Some(5), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("HEADROOM_TOKEN") && stderr.contains("--data-dir"),
        "{stderr}"
    );
    // No token at all (the default data directory, relative to the working directory, has no
    // token file): also 5, saying that no token was sent.
    let out = cli(&["volume", "list"], None);
    assert_eq!(out.status.code(), Some(5), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("No token was sent"),
        "{}",
        text(&out)
    );
    server.stop();

    // Restarted, the server reuses the file.
    let server = Server::start_without_token(&data, &flags);
    assert_eq!(
        std::fs::read_to_string(&path).unwrap().trim(),
        token,
        "the token changed on restart"
    );
    let volumes = format!("{}/v1/volumes", server.api);
    assert_eq!(get(&volumes, Some(&format!("Bearer {token}"))).0, 200);
    server.stop();
}

#[test]
fn the_cli_exits_4_when_the_server_is_unreachable() {
    let out = Command::new(BIN)
        .args(["volume", "list", "--api", "http://127.0.0.1:9"])
        .env("HEADROOM_TOKEN", TEST_TOKEN)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
}

#[test]
fn a_memory_server_without_a_data_dir_prints_its_generated_token_once() {
    let dir = tempfile::tempdir().unwrap();
    let stderr_path = dir.path().join("stderr.log");
    let mut child = Command::new(BIN)
        .args(["serve", "--memory", "256MiB"])
        .args(["--nbd-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"])
        .env_remove("HEADROOM_TOKEN")
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = loop {
        match lines.next() {
            Some(Ok(line)) if line.starts_with("nbd://") => break line,
            Some(Ok(_)) => continue,
            _ => panic!(
                "server exited: {}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            ),
        }
    };
    let api = ready.split_whitespace().nth(2).unwrap().to_string();
    // The token line is printed before the ready line.
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    let token_lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("API token for this run"))
        .collect();
    assert_eq!(token_lines.len(), 1, "{stderr}");
    let token = token_lines[0].rsplit(' ').next().unwrap();
    assert_eq!(token.len(), 64, "{stderr}");
    assert_eq!(
        get(&format!("{api}/v1/pool"), Some(&format!("Bearer {token}"))).0,
        200
    );
    assert!(
        !dir.path().join("headroom-data").exists(),
        "a memory server without --data-dir wrote a data directory"
    );
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
}
