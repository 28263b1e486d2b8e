//! `GET /v1/node` and `GET /v1/devices`: what the node runs (version, policy, workers,
//! capacity, the calibration it loaded, uptime) and its devices (path, capacity, allocated
//! bytes, failed), as the operator sees them.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use common::Server;
use common::raw::Client;
use serde_json::Value;

fn get(server: &Server, path: &str) -> Value {
    let mut response = ureq::get(format!("{}{path}", server.api))
        .header("authorization", common::bearer())
        .call()
        .unwrap_or_else(|err| panic!("GET {path}: {err}"));
    response.body_mut().read_json().unwrap()
}

#[test]
fn the_node_reports_its_version_policy_capacity_and_calibration() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "1GiB");
    server.create_tenant("acme");
    server.create_volume_with("a", "64MiB", &["--tenant", "acme"]);
    server.create_volume("b", "64MiB");
    let node = get(&server, "/v1/node");
    assert_eq!(node["version"], env!("CARGO_PKG_VERSION"), "{node}");
    assert_eq!(node["policy"], "burst", "{node}");
    let workers = node["workers"].as_u64().unwrap();
    assert!(workers >= 1, "{node}");
    // The default CPU capacity is one core per worker.
    assert_eq!(
        node["capacity_per_second"]["cpu_ns"].as_u64(),
        Some(workers * 1_000_000_000),
        "{node}"
    );
    assert_eq!(node["capacity_per_second"]["device_units"], Value::Null);
    assert_eq!(node["backend"], "memory");
    assert_eq!(node["calibration_file"], Value::Null);
    assert_eq!(
        (node["volumes"].as_u64(), node["tenants"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(node["api_listen"], server.api.trim_start_matches("http://"));
    assert!(node["uptime_s"].as_u64().unwrap() < 600, "{node}");
    server.stop();

    // A data directory with a calibration file: the node says it loaded it, and its
    // settings (here 3 workers) are in force.
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("calibration.toml"), "[qos]\nworkers = 3\n").unwrap();
    let server = Server::start_with(
        &data,
        &[
            "--devices",
            "2",
            "--device-size",
            "1GiB",
            "--policy",
            "credit",
        ],
    );
    let node = get(&server, "/v1/node");
    assert_eq!(
        (node["policy"].as_str(), node["workers"].as_u64()),
        (Some("credit"), Some(3)),
        "{node}"
    );
    assert!(
        node["calibration_file"]
            .as_str()
            .is_some_and(|p| p.ends_with("calibration.toml")),
        "{node}"
    );
    assert_eq!(node["backend"], "files");
    server.stop();
}

#[test]
fn devices_show_path_capacity_and_what_is_allocated_on_them() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(
        &dir.path().join("data"),
        &["--devices", "2", "--device-size", "1GiB"],
    );
    let devices = get(&server, "/v1/devices");
    let devices = devices.as_array().unwrap();
    assert_eq!(devices.len(), 2, "{devices:?}");
    for (i, d) in devices.iter().enumerate() {
        assert!(
            d["path"]
                .as_str()
                .unwrap()
                .ends_with(&format!("dev-{i}.img")),
            "{d}"
        );
        assert_eq!(d["capacity_bytes"], 1u64 << 30, "{d}");
        assert_eq!(d["allocated_bytes"], 0, "{d}");
        assert!(d.get("failed").is_none(), "{d}");
    }
    server.create_volume("v", "256MiB");
    let mut client = Client::open(server.nbd, "v");
    let block = vec![0x5a_u8; 64 << 10];
    for i in 0..16u64 {
        assert_eq!(client.write(i, i * (16 << 20), &block, 0), 0);
    }
    assert_eq!(client.flush(99), 0);
    client.disconnect();
    let devices = get(&server, "/v1/devices");
    let allocated: u64 = devices
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["allocated_bytes"].as_u64().unwrap())
        .sum();
    let volume = get(&server, "/v1/volumes/v");
    assert!(allocated > 0, "{devices}");
    assert_eq!(
        allocated,
        volume["allocated_bytes"].as_u64().unwrap(),
        "{devices} {volume}"
    );
    // The pool view carries the same devices.
    assert_eq!(get(&server, "/v1/pool")["devices"], devices);
    server.stop();
}

#[test]
fn the_overcommit_ratio_refuses_volumes_past_it_with_507_and_the_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("mem");
    std::fs::create_dir_all(&data).unwrap();
    let config = dir.path().join("node.toml");
    std::fs::write(&config, "[storage]\novercommit_ratio = 1.5\n").unwrap();
    let server = Server::start_with(
        &data,
        &["--memory", "1GiB", "--config", config.to_str().unwrap()],
    );
    server.create_volume("a", "1GiB");
    let pool = get(&server, "/v1/pool");
    assert_eq!(pool["overcommit_ratio"], 1.5, "{pool}");
    assert_eq!(pool["provisioned_bytes"], 1u64 << 30, "{pool}");
    let capacity = pool["capacity_bytes"].as_u64().unwrap();
    assert_eq!(
        pool["provisionable_bytes"].as_u64(),
        Some(capacity * 3 / 2),
        "{pool}"
    );

    // Half a GiB more fits (1.5 GiB <= 1.5 x 1 GiB); one more extent does not.
    server.create_volume("b", "512MiB");
    let agent = common::agent();
    let mut response = agent
        .post(format!("{}/v1/volumes", server.api))
        .header("authorization", common::bearer())
        .send_json(serde_json::json!({"name": "c", "size_bytes": 1u64 << 20}))
        .unwrap();
    assert_eq!(response.status().as_u16(), 507);
    let body: Value = response.body_mut().read_json().unwrap();
    assert_eq!(body["kind"], "overcommitted", "{body}");
    let message = body["error"].as_str().unwrap();
    assert!(
        message.contains("1.50 GiB") && message.contains("overcommit_ratio 1.5"),
        "{message}"
    );
    // Growing is refused the same way, through the CLI too; shrinking is not.
    let out = server.cli(&["volume", "resize", "a", "--size", "2GiB"]);
    assert_eq!(out.status.code(), Some(1), "{}", common::text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("overcommitted"),
        "{}",
        common::text(&out)
    );
    let out = server.cli(&["volume", "resize", "b", "--size", "256MiB"]);
    assert!(out.status.success(), "{}", common::text(&out));
    server.create_volume("c", "256MiB");
    assert_eq!(
        get(&server, "/v1/pool")["provisioned_bytes"],
        3u64 << 29,
        "a, b and c: 1.5 GiB"
    );
    server.stop();
}
