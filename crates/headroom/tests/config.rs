//! `serve --config`, `--policy`, the data directory's calibration file and `headroom
//! calibrate`, end to end through the binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{BIN, Server, api_get, have_tool, run_ok, start_fails};

fn write(path: &Path, text: &str) -> PathBuf {
    std::fs::write(path, text).expect("write config");
    path.to_path_buf()
}

fn volume_policy(server: &Server) -> String {
    server.create_volume("v", "64MiB");
    api_get(server, "/v1/volumes/v")["policy"]
        .as_str()
        .expect("policy field")
        .to_string()
}

#[test]
fn bad_configs_fail_at_start_with_key_value_and_what_is_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cases = [
        (
            "workers.toml",
            "[qos]\nworkers = 0\n",
            vec!["workers.toml", "qos.workers = 0: must be between 1 and 64"],
        ),
        (
            "unknown.toml",
            "[server]\nio_threads = 2\n\n[qos]\nwrkers = 2\n",
            vec!["unknown.toml", "line 5", "unknown field `wrkers`"],
        ),
        (
            "policy.toml",
            "[qos]\npolicy = \"fast\"\n",
            vec![
                "policy.toml",
                "qos.policy = \"fast\": expected off, wild, base, credit, burst, mclock or drr-vop",
            ],
        ),
        (
            "size.toml",
            "[storage]\nmemory = \"lots\"\n",
            vec!["size.toml", "line 2", "invalid size \"lots\""],
        ),
        (
            "budget.toml",
            "[limits]\nmax_inflight_bytes = \"1MiB\"\n",
            vec![
                "budget.toml",
                "limits.max_inflight_bytes = \"1MiB\": must be at least 32MiB, the buffer a \
                 request of limits.max_request_bytes (32MiB) occupies",
            ],
        ),
        (
            "node-budget.toml",
            "[limits]\nmax_inflight_bytes_per_node = \"128MiB\"\n",
            vec![
                "node-budget.toml",
                "limits.max_inflight_bytes_per_tenant = \"256MiB\": must be at most \
                 limits.max_inflight_bytes_per_node (128MiB)",
            ],
        ),
    ];
    for (name, text, wanted) in cases {
        let path = write(&dir.path().join(name), text);
        let stderr = start_fails(
            &data,
            &["--memory", "64MiB", "--config", path.to_str().unwrap()],
        );
        for want in wanted {
            assert!(
                stderr.contains(want),
                "{name}: wanted {want:?} in:\n{stderr}"
            );
        }
    }
    let stderr = start_fails(
        &data,
        &["--memory", "64MiB", "--config", "/nonexistent/node.toml"],
    );
    assert!(stderr.contains("/nonexistent/node.toml"), "{stderr}");
}

#[test]
fn policy_flag_overrides_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(
        &dir.path().join("node.toml"),
        "[storage]\nmemory = \"256MiB\"\n[qos]\npolicy = \"mclock\"\nworkers = 1\n",
    );
    let config = config.to_str().unwrap();

    let server = Server::start_with(
        &dir.path().join("off"),
        &["--config", config, "--policy", "off"],
    );
    let log = server.log();
    assert!(log.contains("policy off"), "{log}");
    assert!(
        log.contains("configuration file") && log.contains(config),
        "{log}"
    );
    assert_eq!(volume_policy(&server), "off");
    server.stop();

    let server = Server::start_with(&dir.path().join("file"), &["--config", config]);
    assert!(server.log().contains("policy mclock"), "{}", server.log());
    assert_eq!(volume_policy(&server), "mclock");
    server.stop();
}

#[test]
fn calibration_file_in_the_data_dir_is_loaded_under_the_flags() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    write(
        &data.join("calibration.toml"),
        "[qos]\npolicy = \"wild\"\n[qos.capacity]\ncpu_ns_per_s = 2_000_000_000\n",
    );
    let server = Server::start_with(&data, &["--memory", "256MiB"]);
    let log = server.log();
    assert!(
        log.contains("calibration") && log.contains("calibration.toml"),
        "{log}"
    );
    assert!(log.contains("policy wild"), "{log}");
    server.stop();

    let server = Server::start_with(&data, &["--memory", "256MiB", "--policy", "credit"]);
    assert!(server.log().contains("policy credit"), "{}", server.log());
    server.stop();

    // A broken calibration file stops the start, naming it.
    write(&data.join("calibration.toml"), "[qos]\nworkers = 100\n");
    let stderr = start_fails(&data, &["--memory", "256MiB"]);
    assert!(
        stderr.contains("calibration.toml") && stderr.contains("qos.workers = 100"),
        "{stderr}"
    );
}

#[test]
fn interference_example_starts() {
    let dir = tempfile::tempdir().unwrap();
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/interference-node.toml");
    let server = Server::start_with(
        &dir.path().join("data"),
        &["--config", example.to_str().unwrap()],
    );
    let log = server.log();
    assert!(log.contains("policy burst"), "{log}");
    assert!(!log.contains("WARN"), "{log}");
    assert_eq!(volume_policy(&server), "burst");
    server.stop();
}

/// `cpu_ns(len)` of a `{ base_ns, per_kib_ps }` table.
fn cpu_ns(line: &toml::Value, len: u64) -> u64 {
    let base = line["base_ns"].as_integer().expect("base_ns");
    let per_kib_ps = line["per_kib_ps"].as_integer().expect("per_kib_ps");
    u64::try_from(base).unwrap() + (len * u64::try_from(per_kib_ps).unwrap()).div_ceil(1024 * 1000)
}

#[test]
fn calibrate_writes_a_config_that_serve_starts_with() {
    if !have_tool("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("calibration.toml");
    let out = run_ok(
        Command::new(BIN)
            .args([
                "calibrate",
                "--memory",
                "256MiB",
                "--seconds-per-point",
                "1",
            ])
            .args(["--sizes", "4k,64k", "--out"])
            .arg(&out_path)
            .current_dir(dir.path()),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("wrote"), "{stdout}");
    // Nothing was written outside --out.
    assert!(!dir.path().join("headroom-data").exists());

    let text = std::fs::read_to_string(&out_path).unwrap();
    assert!(text.starts_with("# Headroom calibration"), "{text}");
    let doc: toml::Table = toml::from_str(&text).unwrap();
    assert_eq!(
        doc.keys().collect::<Vec<_>>(),
        vec!["qos"],
        "only [qos.capacity] and [qos.cost]: {text}"
    );
    let qos = &doc["qos"];
    let cpu = &qos["cost"]["cpu"];
    let (read_4k, read_64k) = (cpu_ns(&cpu["read"], 4096), cpu_ns(&cpu["read"], 65_536));
    assert!(read_4k > 0, "{text}");
    assert!(
        read_64k > read_4k,
        "reads must cost more CPU when larger: {text}"
    );
    assert!(cpu_ns(&cpu["write"], 4096) > 0, "{text}");
    // A sync is measured (writes with and without a FLUSH after each), at least 1 ns.
    assert!(cpu_ns(&cpu["sync"], 4096) >= 1, "{text}");
    assert!(text.contains("with a FLUSH after each"), "{text}");
    let vop = &qos["cost"]["device"]["vop"];
    assert_eq!(vop["read"].as_array().map(Vec::len), Some(2), "{text}");
    assert_eq!(vop["write"].as_array().map(Vec::len), Some(2), "{text}");
    let capacity = &qos["capacity"];
    assert!(capacity["cpu_ns_per_s"].as_integer().unwrap() >= 1_000_000_000);
    assert_eq!(
        capacity["device_units_per_s"].as_integer(),
        vop["max_iops"].as_integer().map(|n| n * 1000)
    );

    let server = Server::start_with(
        &dir.path().join("data"),
        &["--memory", "256MiB", "--config", out_path.to_str().unwrap()],
    );
    let log = server.log();
    assert!(log.contains("policy burst"), "{log}");
    assert_eq!(volume_policy(&server), "burst");
    server.stop();
}

#[test]
fn calibrate_refuses_bad_sizes() {
    let out = Command::new(BIN)
        .args(["calibrate", "--memory", "64MiB", "--sizes", "4k,64MiB"])
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--sizes") && stderr.contains("64MiB"),
        "{stderr}"
    );
}
