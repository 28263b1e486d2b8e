//! Tenants and read-only exports for clients without a TLS identity, in
//! every build: a plaintext client sees, lists and opens only volumes without a tenant, and a
//! tenant's volume is answered exactly like a missing one (byte for byte at the protocol level;
//! the same exit status and error text from nbdinfo and qemu-img). Read-only volumes advertise
//! `NBD_FLAG_READ_ONLY` and refuse writes, trims and zeroing with EPERM. The TLS side (PSK
//! identities and certificate CNs as tenants) is in `tls.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::process::{Command, Output};

use common::raw::*;
use common::{Server, have_tool, random_file, text};
use headroom_nbd::consts::*;
use serde_json::Value;

const FLAG_READ_ONLY: u16 = 1 << 1;
const FLAG_SEND_TRIM: u16 = 1 << 5;
const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;

fn start() -> (tempfile::TempDir, Server) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "1GiB");
    (dir, server)
}

/// Everything a plaintext client can learn about `export` in negotiation: the replies to INFO,
/// LIST_META_CONTEXT, SET_META_CONTEXT and GO (after structured replies), and whether
/// EXPORT_NAME on a second connection is answered or closed.
fn negotiation_answers(server: &Server, export: &str) -> (Vec<OptionReplies>, bool) {
    let mut stream = connect(server.nbd);
    greet(&mut stream);
    send_option(&mut stream, NBD_OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(read_option_reply(&mut stream).reply_type, NBD_REP_ACK);
    let mut answers = Vec::new();
    for (option, data) in [
        (NBD_OPT_INFO, go_payload(export)),
        (
            NBD_OPT_LIST_META_CONTEXT,
            meta_payload(export, &["base:allocation"]),
        ),
        (
            NBD_OPT_SET_META_CONTEXT,
            meta_payload(export, &["base:allocation"]),
        ),
        (NBD_OPT_GO, go_payload(export)),
    ] {
        send_option(&mut stream, option, &data);
        answers.push(read_option_replies(&mut stream));
    }
    drop(stream);
    let mut stream = connect(server.nbd);
    greet(&mut stream);
    send_option(&mut stream, NBD_OPT_EXPORT_NAME, export.as_bytes());
    let mut byte = [0u8; 1];
    let closed = matches!(std::io::Read::read(&mut stream, &mut byte), Ok(0) | Err(_));
    (answers, closed)
}

fn plaintext_list(server: &Server) -> Vec<String> {
    let mut stream = connect(server.nbd);
    greet(&mut stream);
    let mut names = list_exports(&mut stream);
    names.sort();
    names
}

/// (status, stdout, stderr) of a client run, to compare two runs exactly.
fn outcome(out: &Output) -> (Option<i32>, String, String) {
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn timeout(args: &[&str]) -> Output {
    Command::new("timeout")
        .arg("60")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn plaintext_clients_see_only_volumes_without_a_tenant_and_others_look_missing() {
    let (_dir, server) = start();
    server.create_volume("shared", "16MiB");
    server.create_tenant("alice");
    server.create_tenant("bob");
    server.create_volume_with("a1", "16MiB", &["--tenant", "alice"]);
    server.create_volume_with("b1", "8MiB", &["--tenant", "bob"]);

    // LIST names only the volume without a tenant.
    assert_eq!(plaintext_list(&server), vec!["shared"]);

    // The shared volume is served as before.
    let (answers, closed) = negotiation_answers(&server, "shared");
    assert!(
        answers.iter().all(|replies| replies
            .last()
            .is_some_and(|(_, reply_type, _)| *reply_type == NBD_REP_ACK)),
        "every option on the shared volume is acknowledged"
    );
    assert!(!closed, "EXPORT_NAME of the shared volume is answered");

    // A tenant's volume: every option gets NBD_REP_ERR_UNKNOWN, EXPORT_NAME closes, and all
    // of it is, byte for byte, what the same name gets once no volume has it.
    let foreign = negotiation_answers(&server, "a1");
    for replies in &foreign.0 {
        assert_eq!(
            replies.len(),
            1,
            "one error reply, nothing about the volume"
        );
        assert_eq!(replies[0].1, NBD_REP_ERR_UNKNOWN);
    }
    assert!(foreign.1, "EXPORT_NAME of another tenant's volume closes");

    // Real clients: nbdinfo (libnbd) and qemu-img fail on b1 exactly as on a missing b1.
    let tools = have_tool("nbdinfo") && have_tool("qemu-img");
    let probe = |server: &Server| {
        let uri = server.uri("b1");
        (
            outcome(&timeout(&["nbdinfo", &uri])),
            outcome(&timeout(&["qemu-img", "info", &uri])),
        )
    };
    let foreign_b1 = tools.then(|| probe(&server));
    if tools {
        let out = timeout(&["nbdinfo", "--list", "--json", &server.uri("")]);
        assert!(out.status.success(), "{}", text(&out));
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        let names: Vec<&str> = json["exports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|export| export["export-name"].as_str().unwrap())
            .collect();
        assert_eq!(names, vec!["shared"], "nbdinfo --list");
        let out = timeout(&["nbdinfo", &server.uri("shared")]);
        assert!(out.status.success(), "{}", text(&out));
    }

    for name in ["a1", "b1"] {
        let out = server.cli(&["volume", "delete", name]);
        assert!(out.status.success(), "{}", text(&out));
    }
    assert_eq!(
        foreign,
        negotiation_answers(&server, "a1"),
        "another tenant's volume is answered exactly like a missing one"
    );
    if let Some(foreign_b1) = foreign_b1 {
        let missing_b1 = probe(&server);
        assert_ne!(
            foreign_b1.0.0,
            Some(0),
            "nbdinfo opened another tenant's volume"
        );
        assert_ne!(
            foreign_b1.1.0,
            Some(0),
            "qemu-img opened another tenant's volume"
        );
        assert_eq!(
            foreign_b1, missing_b1,
            "(nbdinfo, qemu-img): foreign vs missing"
        );
    }
    server.stop();
}

#[test]
fn read_only_volumes_advertise_it_and_refuse_changes_with_eperm() {
    let (dir, server) = start();
    server.create_volume_with("ro", "16MiB", &["--read-only"]);
    server.create_volume("rw", "16MiB");

    let mut rw = Client::open(server.nbd, "rw");
    assert_eq!(rw.transmission_flags & FLAG_READ_ONLY, 0);
    assert_eq!(rw.write(1, 0, &[0x5a; 4096], 0), 0);

    let mut ro = Client::open(server.nbd, "ro");
    let flags = ro.transmission_flags;
    assert_ne!(flags & FLAG_READ_ONLY, 0, "NBD_FLAG_READ_ONLY advertised");
    assert_eq!(
        flags & (FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES),
        0,
        "no TRIM or WRITE_ZEROES offered on a read-only export"
    );
    assert_eq!(ro.write(1, 0, &[0xa5; 4096], 0), NBD_EPERM, "WRITE");
    assert_eq!(
        ro.write(2, 4096, &[0xa5; 4096], NBD_CMD_FLAG_FUA),
        NBD_EPERM,
        "FUA WRITE"
    );
    for (cookie, command) in [(3, NBD_CMD_TRIM), (4, NBD_CMD_WRITE_ZEROES)] {
        ro.send_request(0, command, cookie, 0, 1 << 20);
        let reply = ro.read_simple_reply();
        assert_eq!(
            (reply.cookie, reply.error),
            (cookie, NBD_EPERM),
            "command {command}"
        );
    }
    // The session goes on: reads and flushes work, and nothing was written.
    assert_eq!(ro.read(5, 0, 8192).unwrap(), vec![0; 8192]);
    assert_eq!(ro.flush(6), 0);

    if have_tool("nbdinfo") && have_tool("qemu-img") {
        let out = timeout(&["nbdinfo", "--json", &server.uri("ro")]);
        assert!(out.status.success(), "{}", text(&out));
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["exports"][0]["is_read_only"], Value::Bool(true));
        let source = dir.path().join("source.raw");
        random_file(&source, 1 << 20, 3);
        let out = Command::new("timeout")
            .args(["60", "qemu-img", "convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&source)
            .arg(server.uri("ro"))
            .output()
            .unwrap();
        assert!(
            !out.status.success(),
            "qemu-img wrote to a read-only export: {}",
            text(&out)
        );
    }
    assert_eq!(ro.read(7, 0, 1 << 20).unwrap(), vec![0; 1 << 20]);
    assert_eq!(rw.read(2, 0, 4096).unwrap(), vec![0x5a; 4096]);
    ro.disconnect();
    rw.disconnect();
    server.stop();
}

#[test]
fn tenant_and_access_mode_in_the_cli_and_the_api() {
    let (_dir, server) = start();
    for tenant in ["Tenant A", "bob", "carol"] {
        server.create_tenant(tenant);
    }
    let out = server.cli(&[
        "volume",
        "create",
        "a1",
        "--size",
        "1GiB",
        "--tenant",
        "Tenant A",
        "--read-only",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("tenant Tenant A, read-only"),
        "{}",
        text(&out)
    );
    server.create_volume_with("b1", "1GiB", &["--tenant", "bob"]);
    server.create_volume("shared", "1GiB");

    let json = |args: &[&str]| -> Value {
        let out = server.cli(args);
        assert!(out.status.success(), "{}", text(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let shown = json(&["volume", "show", "a1", "--json"]);
    assert_eq!(shown["tenant"], "Tenant A");
    assert_eq!(shown["read_only"], true);
    let shown = json(&["volume", "show", "shared", "--json"]);
    assert_eq!(shown["tenant"], Value::Null);
    assert_eq!(shown["read_only"], false);
    let names = |list: Value| -> Vec<String> {
        let mut names: Vec<String> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap().to_string())
            .collect();
        names.sort();
        names
    };
    assert_eq!(
        names(json(&["volume", "list", "--json"])),
        vec!["a1", "b1", "shared"]
    );
    // `--tenant` filters (the id has a space: the query is encoded).
    assert_eq!(
        names(json(&["volume", "list", "--json", "--tenant", "Tenant A"])),
        vec!["a1"]
    );
    assert_eq!(
        names(json(&["volume", "list", "--json", "--tenant", "nobody"])),
        Vec::<String>::new()
    );

    // Human output.
    let out = server.cli(&["volume", "list"]);
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = listing.lines();
    assert!(
        lines
            .next()
            .is_some_and(|header| header.split_whitespace().eq([
                "NAME",
                "TENANT",
                "ACCESS",
                "REPLICAS",
                "HEALTH",
                "SIZE",
                "ALLOCATED",
                "CREDITS",
                "QOS"
            ])),
        "{listing}"
    );
    let row = |name: &str| {
        listing
            .lines()
            .find(|line| line.starts_with(name))
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        row("a1").contains("Tenant A") && row("a1").contains(" ro "),
        "{listing}"
    );
    assert!(
        row("b1").contains("bob") && row("b1").contains(" rw "),
        "{listing}"
    );
    let out = server.cli(&["volume", "show", "a1"]);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("tenant:      Tenant A") && shown.contains("access:      read-only"),
        "{shown}"
    );

    // Bad tenant ids: a clear 400 that names the rule, and nothing created.
    for bad in ["", " alice", "tab\there", "caf\u{e9}", &"t".repeat(129)] {
        let out = server.cli(&["volume", "create", "bad", "--size", "1GiB", "--tenant", bad]);
        assert!(!out.status.success(), "{bad:?}: {}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("invalid tenant id") && err.contains("400"),
            "{bad:?}: {err}"
        );
    }
    let out = server.cli(&["volume", "show", "bad"]);
    assert!(!out.status.success(), "{}", text(&out));

    // The raw API: fields in the POST body, kind `invalid_tenant`, and the list filter.
    let agent = common::agent();
    let volumes = format!("{}/v1/volumes", server.api);
    let mut response = agent
        .post(&volumes)
        .header("authorization", common::bearer())
        .send_json(serde_json::json!({
            "name": "raw", "size_bytes": 1u64 << 30, "tenant": "carol", "read_only": true
        }))
        .unwrap();
    assert_eq!(response.status().as_u16(), 201);
    let body: Value = response.body_mut().read_json().unwrap();
    assert_eq!(body["tenant"], "carol");
    assert_eq!(body["read_only"], true);
    let mut response = agent
        .post(&volumes)
        .header("authorization", common::bearer())
        .send_json(serde_json::json!({"name": "raw2", "size_bytes": 1u64 << 30, "tenant": "a\nb"}))
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = response.body_mut().read_json().unwrap();
    assert_eq!(body["kind"], "invalid_tenant", "{body}");
    let mut response = agent
        .get(format!("{volumes}?tenant="))
        .header("authorization", common::bearer())
        .call()
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = response.body_mut().read_json().unwrap();
    assert_eq!(body["kind"], "invalid_tenant", "{body}");
    let mut response = agent
        .get(format!("{volumes}?tenant=carol"))
        .header("authorization", common::bearer())
        .call()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(names(response.body_mut().read_json().unwrap()), vec!["raw"]);
    server.stop();
}

#[test]
fn tenant_and_access_mode_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data);
    server.create_tenant("alice");
    server.create_volume_with("a1", "16MiB", &["--tenant", "alice", "--read-only"]);
    server.create_volume("shared", "16MiB");
    server.stop();
    let server = Server::start(&data);
    let out = server.cli(&["volume", "show", "a1", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["tenant"], "alice");
    assert_eq!(shown["read_only"], true);
    // The tenant itself is kept too.
    let out = server.cli(&["tenant", "show", "alice", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let tenant: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (tenant["id"].as_str(), tenant["volumes"].as_u64()),
        (Some("alice"), Some(1))
    );
    assert_eq!(plaintext_list(&server), vec!["shared"]);
    let client = Client::open(server.nbd, "shared");
    assert_eq!(client.transmission_flags & FLAG_READ_ONLY, 0);
    client.disconnect();
    server.stop();
}

#[test]
fn tenants_are_created_before_their_volumes_and_deleted_after_them() {
    let (_dir, server) = start();
    let json = |args: &[&str]| -> Value {
        let out = server.cli(args);
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };

    // A volume of a tenant that does not exist: 404 `unknown_tenant`, exit 3, and the hint.
    let out = server.cli(&[
        "volume", "create", "v1", "--size", "1GiB", "--tenant", "acme",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("headroom tenant create acme"),
        "{}",
        text(&out)
    );
    let agent = common::agent();
    let mut response = agent
        .post(format!("{}/v1/volumes", server.api))
        .header("authorization", common::bearer())
        .send_json(serde_json::json!({"name": "v1", "size_bytes": 1u64 << 30, "tenant": "acme"}))
        .unwrap();
    assert_eq!(response.status().as_u16(), 404);
    let body: Value = response.body_mut().read_json().unwrap();
    assert_eq!(body["kind"], "unknown_tenant", "{body}");
    assert!(
        json(&["volume", "list", "--json"])
            .as_array()
            .unwrap()
            .is_empty()
    );

    // Created once; a second create is a conflict (exit 6).
    server.create_tenant("acme");
    let out = server.cli(&["tenant", "create", "acme"]);
    assert_eq!(out.status.code(), Some(6), "{}", text(&out));
    // An id with a space and a slash travels percent-encoded in the path.
    server.create_tenant("Team A/B");
    let bad = server.cli(&["tenant", "create", " padded"]);
    assert_eq!(bad.status.code(), Some(1), "{}", text(&bad));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("invalid tenant id"));

    // Two volumes with baselines, one without QoS: the tenant sums them.
    let class = [
        "--baseline-iops",
        "300",
        "--baseline-mbps",
        "10",
        "--ceiling-iops",
        "600",
    ];
    server.create_volume_with("v1", "1GiB", &[&["--tenant", "acme"][..], &class].concat());
    server.create_volume_with("v2", "2GiB", &[&["--tenant", "acme"][..], &class].concat());
    server.create_volume_with("v3", "512MiB", &["--tenant", "acme"]);
    server.create_volume_with("t1", "1GiB", &["--tenant", "Team A/B"]);
    server.create_volume("shared", "1GiB");
    let acme = json(&["tenant", "show", "acme", "--json"]);
    assert_eq!(acme["volumes"], 3, "{acme}");
    assert_eq!(
        acme["provisioned_bytes"],
        (3u64 << 30) + (512 << 20),
        "{acme}"
    );
    assert_eq!(acme["baseline_iops"], 600, "{acme}");
    assert_eq!(acme["baseline_bytes_per_s"], 20_000_000, "{acme}");
    let team = json(&["tenant", "show", "Team A/B", "--json"]);
    assert_eq!(
        (team["id"].as_str(), team["volumes"].as_u64()),
        (Some("Team A/B"), Some(1))
    );
    let listed = json(&["tenant", "list", "--json"]);
    let ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["Team A/B", "acme"]);
    let out = server.cli(&["tenant", "list"]);
    assert!(out.status.success(), "{}", text(&out));
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(table.starts_with("TENANT"), "{table}");
    let acme_row = table
        .lines()
        .find(|l| l.starts_with("acme"))
        .expect("acme row");
    assert!(
        acme_row.contains("3.5GiB") && acme_row.contains("600 IOPS, 20 MB/s"),
        "{table}"
    );

    // Not deleted while it has volumes (409, exit 6); deleted once they are gone.
    let out = server.cli(&["tenant", "delete", "acme"]);
    assert_eq!(out.status.code(), Some(6), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("delete them first"));
    for v in ["v1", "v2", "v3"] {
        let out = server.cli(&["volume", "delete", v]);
        assert!(out.status.success(), "{}", text(&out));
    }
    let out = server.cli(&["tenant", "delete", "acme"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = server.cli(&["tenant", "show", "acme"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let out = server.cli(&["tenant", "delete", "acme"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));

    // The raw API's bad inputs.
    let tenants = format!("{}/v1/tenants", server.api);
    for (what, body, status, kind) in [
        (
            "unknown field",
            r#"{"id": "x", "colour": 1}"#,
            422,
            "invalid_body",
        ),
        ("no id", r#"{}"#, 422, "invalid_body"),
        ("malformed JSON", r#"{"id": "#, 400, "malformed_json"),
        (
            "control character",
            r#"{"id": "a\nb"}"#,
            400,
            "invalid_tenant",
        ),
        ("empty id", r#"{"id": ""}"#, 400, "invalid_tenant"),
    ] {
        let mut response = agent
            .post(&tenants)
            .header("authorization", common::bearer())
            .header("content-type", "application/json")
            .send(body)
            .unwrap();
        let got: Value = response.body_mut().read_json().unwrap();
        assert_eq!(
            (response.status().as_u16(), got["kind"].as_str()),
            (status, Some(kind)),
            "{what}: {got}"
        );
    }
    let ids: Vec<String> = json(&["tenant", "list", "--json"])
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["Team A/B"], "bad requests created nothing");
    server.stop();
}
