//! `GET /v1/node` and `GET /v1/devices`: what the node runs (version, policy, workers,
//! capacity, the calibration it loaded, uptime) and its devices (path, capacity, allocated
//! bytes, failed, and their telemetry: smoothed rates, latencies and write cost, also in
//! `headroom device list` and `/metrics`), as the operator sees them.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use common::raw::Client;
use common::{Server, api_get};
use serde_json::Value;

#[test]
fn the_node_reports_its_version_policy_capacity_and_calibration() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "1GiB");
    server.create_tenant("acme");
    server.create_volume_with("a", "64MiB", &["--tenant", "acme"]);
    server.create_volume("b", "64MiB");
    let node = api_get(&server, "/v1/node");
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
    // Cross-node arbitration is off without --rados-arbitration: said so, nothing else.
    let arbitration = api_get(&server, "/v1/arbitration");
    assert_eq!(arbitration["enabled"], false, "{arbitration}");
    assert_eq!(arbitration["is_arbiter"], false, "{arbitration}");
    assert_eq!(arbitration["nodes"], serde_json::json!([]), "{arbitration}");
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
    let node = api_get(&server, "/v1/node");
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
    let devices = api_get(&server, "/v1/devices");
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
    let devices = api_get(&server, "/v1/devices");
    let allocated: u64 = devices
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["allocated_bytes"].as_u64().unwrap())
        .sum();
    let volume = api_get(&server, "/v1/volumes/v");
    assert!(allocated > 0, "{devices}");
    assert_eq!(
        allocated,
        volume["allocated_bytes"].as_u64().unwrap(),
        "{devices} {volume}"
    );
    // The pool view carries the same devices (but for their telemetry, which the sampler
    // may move on between the two requests).
    let without_telemetry = |mut devices: Value| {
        for d in devices.as_array_mut().unwrap() {
            d.as_object_mut().unwrap().remove("telemetry");
        }
        devices
    };
    assert_eq!(
        without_telemetry(api_get(&server, "/v1/pool")["devices"].clone()),
        without_telemetry(devices)
    );
    server.stop();
}

/// Sum of `headroom_device_bytes{op}` over the devices.
fn device_bytes(server: &Server, op: &str) -> f64 {
    common::openmetrics::parse(&common::metrics_text(&server.api))
        .iter()
        .filter(|s| {
            s.name == "headroom_device_bytes_total"
                && s.labels.get("op").map(String::as_str) == Some(op)
        })
        .map(|s| s.value)
        .sum()
}

#[test]
fn device_telemetry_shows_what_each_device_is_doing_now() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(
        &dir.path().join("data"),
        &["--devices", "2", "--device-size", "1GiB"],
    );
    // Before any I/O: no rates, no latency, version 0 (or no telemetry yet at all).
    for d in api_get(&server, "/v1/devices").as_array().unwrap() {
        let version = d["telemetry"]["version"].as_u64().unwrap_or(0);
        assert_eq!(version, 0, "{d}");
    }
    server.create_volume("v", "256MiB");
    let mut client = Client::open(server.nbd, "v");
    let block = vec![0xa5_u8; 64 << 10];
    for i in 0..16u64 {
        assert_eq!(client.write(i, i * (16 << 20), &block, 0), 0);
    }
    for i in 0..16u64 {
        let data = client.read(100 + i, i * (16 << 20), 64 << 10).unwrap();
        assert!(data == block, "read {i} differs");
    }
    assert_eq!(client.flush(99), 0);
    client.disconnect();
    // The device counters have the bytes exactly: 1 MiB written, 1 MiB read.
    assert_eq!(device_bytes(&server, "write"), f64::from(16 << 16));
    assert_eq!(device_bytes(&server, "read"), f64::from(16 << 16));

    // The sampler takes them into the telemetry at its next interval (1 s): poll for it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let devices = loop {
        let devices = api_get(&server, "/v1/devices");
        let seen = devices
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["telemetry"]["version"].as_u64().unwrap_or(0) >= 1);
        if seen {
            break devices;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no device telemetry after 20 s: {devices}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100)); // polling, with a deadline
    };
    let busy: Vec<&Value> = devices
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["telemetry"]["version"].as_u64().unwrap_or(0) >= 1)
        .collect();
    for d in &busy {
        let t = &d["telemetry"];
        // File devices are timed: both latencies, hence a write cost, are known and positive.
        assert!(t["write_bytes_per_s"].as_f64().unwrap() > 0.0, "{d}");
        assert!(t["read_bytes_per_s"].as_f64().unwrap() > 0.0, "{d}");
        assert!(t["write_iops"].as_f64().unwrap() > 0.0, "{d}");
        assert!(t["read_latency_us"].as_f64().unwrap() > 0.0, "{d}");
        assert!(t["write_latency_us"].as_f64().unwrap() > 0.0, "{d}");
        assert!(t["write_cost"].as_f64().unwrap() > 0.0, "{d}");
        assert!(t["interval_ms"].as_f64().unwrap() > 0.0, "{d}");
    }
    // The CLI shows the same devices.
    let out = server.cli(&["device", "list", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");
    let out = server.cli(&["device", "list"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && table.contains("WRITE COST"),
        "{table}"
    );
    // And /metrics has the smoothed gauges for the busy devices.
    let text = common::metrics_text(&server.api);
    assert!(
        text.contains("headroom_device_telemetry_iops{"),
        "no telemetry gauges in {text}"
    );
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
    let pool = api_get(&server, "/v1/pool");
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
        api_get(&server, "/v1/pool")["provisioned_bytes"],
        3u64 << 29,
        "a, b and c: 1.5 GiB"
    );
    server.stop();
}

#[test]
fn a_device_added_to_the_running_pool_takes_writes_at_once_and_stays_after_a_restart() {
    const E: u64 = 2 << 20;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start_with(&data, &["--devices", "1", "--device-size", "10MiB"]);
    server.create_volume("v", "64MiB");
    let mut client = Client::open(server.nbd, "v");
    let block = |i: u64| vec![i as u8 + 1; 4096];
    for i in 0..4u64 {
        assert_eq!(client.write(i, i * E, &block(i), 0), 0);
    }
    // The pool's 4 extents are taken (10 MiB: 5 extents, the first reserved for the device's
    // signature): the next new extent has no room (ENOSPC = 28).
    assert_eq!(client.write(4, 4 * E, &block(4), 0), 28);

    // Added while the client stays connected.
    let out = server.cli(&["device", "add", "--size", "32MiB", "--json"]);
    assert!(out.status.success(), "{}", common::text(&out));
    let added: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (added["id"].as_u64(), added["extent_count"].as_u64()),
        (Some(1), Some(15)),
        "{added}"
    );
    assert!(
        added["path"]
            .as_str()
            .unwrap()
            .ends_with("devices/dev-1.img"),
        "{added}"
    );
    for i in 4..8u64 {
        assert_eq!(client.write(i, i * E, &block(i), 0), 0, "write {i}");
    }
    assert_eq!(client.flush(99), 0);
    let devices = api_get(&server, "/v1/devices");
    assert_eq!(devices.as_array().unwrap().len(), 2, "{devices}");
    assert_eq!(
        devices[1]["allocated_bytes"].as_u64(),
        Some(4 * E),
        "{devices}"
    );

    // The same path again: 409; a body with an unknown field: 422.
    let path = added["path"].as_str().unwrap();
    let again = ureq::post(format!("{}/v1/devices", server.api))
        .header("authorization", common::bearer())
        .config()
        .http_status_as_error(false)
        .build()
        .send_json(serde_json::json!({ "path": path }))
        .unwrap();
    assert_eq!(again.status(), 409);
    let unknown = ureq::post(format!("{}/v1/devices", server.api))
        .header("authorization", common::bearer())
        .config()
        .http_status_as_error(false)
        .build()
        .send_json(serde_json::json!({ "sise_bytes": 1 }))
        .unwrap();
    assert_eq!(unknown.status(), 422);
    client.disconnect();
    server.stop();

    // After a restart with the same flags (one device), the pool has both and the data is
    // where it was written.
    let server = Server::start_with(&data, &["--devices", "1", "--device-size", "10MiB"]);
    assert_eq!(api_get(&server, "/v1/devices").as_array().unwrap().len(), 2);
    let mut client = Client::open(server.nbd, "v");
    for i in 0..8u64 {
        assert_eq!(client.read(i, i * E, 4096).unwrap(), block(i), "extent {i}");
    }
    client.disconnect();
    server.stop();

    // A RAM pool cannot grow: 400 with the reason.
    let server = Server::start_memory(&dir.path().join("mem"), "64MiB");
    let out = server.cli(&["device", "add"]);
    assert!(!out.status.success());
    assert!(
        common::text(&out).contains("fixed size"),
        "{}",
        common::text(&out)
    );
    server.stop();
}

#[test]
fn the_rebuild_rate_is_set_live_and_out_of_range_rates_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "256MiB");
    let rebuild = api_get(&server, "/v1/rebuild");
    assert_eq!(rebuild["rate_bytes_per_s"], 64u64 << 20, "{rebuild}");
    assert_eq!(rebuild["extents_remaining"], 0, "{rebuild}");
    let agent = common::agent();
    let put = |body: Value| {
        agent
            .put(format!("{}/v1/rebuild", server.api))
            .header("authorization", common::bearer())
            .send_json(body)
            .unwrap()
    };
    for (body, status, kind) in [
        (
            serde_json::json!({"rate_bytes_per_s": 0}),
            400,
            "invalid_rate",
        ),
        (
            serde_json::json!({"rate_bytes_per_s": 11u64 << 30}),
            400,
            "invalid_rate",
        ),
        (serde_json::json!({"rate": 1}), 422, "invalid_body"),
    ] {
        let mut response = put(body.clone());
        assert_eq!(response.status().as_u16(), status, "{body}");
        let error: Value = response.body_mut().read_json().unwrap();
        assert_eq!(error["kind"], kind, "{body}: {error}");
    }
    assert_eq!(
        api_get(&server, "/v1/rebuild")["rate_bytes_per_s"],
        64u64 << 20
    );
    let mut response = put(serde_json::json!({"rate_bytes_per_s": 1u64 << 20}));
    assert_eq!(response.status().as_u16(), 200);
    let view: Value = response.body_mut().read_json().unwrap();
    assert_eq!(view["rate_bytes_per_s"], 1u64 << 20, "{view}");
    assert_eq!(
        api_get(&server, "/v1/rebuild")["rate_bytes_per_s"],
        1u64 << 20
    );
    // A volume never written has nothing to scrub; an unknown one is 404.
    server.create_volume("one", "16MiB");
    let scrub = |name: &str| {
        agent
            .post(format!("{}/v1/volumes/{name}/scrub", server.api))
            .header("authorization", common::bearer())
            .send_empty()
            .unwrap()
    };
    let mut response = scrub("one");
    assert_eq!(response.status().as_u16(), 200);
    let report: Value = response.body_mut().read_json().unwrap();
    assert_eq!(report["extents_checked"], 0, "{report}");
    assert_eq!(scrub("nope").status().as_u16(), 404);
}
