//! Deployment: the systemd unit's readiness protocol (sd_notify) against the real server,
//! the sample configuration starting a server, logs without escape codes (text) or as JSON
//! lines, and the Grafana dashboard reading only the metric names of the shared contract.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{BIN, Server, TEST_TOKEN, have_tool, text};
use serde_json::Value;

const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

/// The metric names of the shared contract (docs/operations.md). The
/// metrics helper's tests check the server exposes them; this list must follow the brief.
const METRICS: &[&str] = &[
    "headroom_volume_ops_total",
    "headroom_volume_bytes_total",
    "headroom_volume_errors_total",
    "headroom_volume_latency_seconds",
    "headroom_volume_queue_depth",
    "headroom_volume_throttled_seconds_total",
    "headroom_volume_credits",
    "headroom_volume_phase_ops_total",
    "headroom_volume_phase_bytes_total",
    "headroom_volume_baseline_iops",
    "headroom_volume_baseline_bytes_per_second",
    "headroom_volume_promise_short_seconds_total",
    "headroom_volume_promise_shortfall_ops_total",
    "headroom_volume_promise_shortfall_bytes_total",
    "headroom_volume_own_limit_seconds_total",
    "headroom_node_capacity_per_second",
    "headroom_node_dispatched_cost_total",
    "headroom_device_ops_total",
    "headroom_device_errors_total",
    "headroom_device_latency_seconds",
    "headroom_metrics_volumes_folded",
];

/// Histograms: their series are NAME_bucket, NAME_sum and NAME_count.
const HISTOGRAMS: &[&str] = &[
    "headroom_volume_latency_seconds",
    "headroom_device_latency_seconds",
];

/// Every `headroom_...` identifier in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find("headroom_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

/// Every string under an `expr` or `query` key, anywhere in the dashboard.
fn queries(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr" | "query" | "definition", Value::String(q)) => out.push(q.clone()),
                    _ => queries(value, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| queries(v, out)),
        _ => {}
    }
}

#[test]
fn grafana_dashboard_reads_only_the_contracts_metrics() {
    let path = Path::new(REPO).join("deploy/grafana-dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    assert_eq!(dashboard["title"], "Headroom");
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    for panel in panels {
        assert!(
            ids.insert(panel["id"].as_u64().unwrap()),
            "duplicate panel id"
        );
        if panel["type"] != "row" {
            let targets = panel["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "{} has no query", panel["title"]);
            for target in targets {
                assert!(target["expr"].as_str().is_some_and(|e| !e.is_empty()));
            }
        }
    }
    let mut all = Vec::new();
    queries(&dashboard, &mut all);
    let mut used = BTreeSet::new();
    for query in &all {
        let names = metric_names(query);
        assert!(!names.is_empty() || !query.contains("headroom"), "{query}");
        for name in names {
            let base = HISTOGRAMS
                .iter()
                .find(|h| {
                    ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|suffix| name == format!("{h}{suffix}"))
                })
                .map_or(name.as_str(), |h| h);
            assert!(
                METRICS.contains(&base),
                "the dashboard reads {name}, which is not a metric of the contract: {query}"
            );
            assert!(
                !HISTOGRAMS.contains(&name.as_str()),
                "a histogram is read through _bucket/_sum/_count, not {name}: {query}"
            );
            used.insert(base.to_string());
        }
    }
    // What the dashboard is for: utilisation per dimension, latency p99, credits, phases,
    // the promise audit.
    assert!(
        all.iter().any(|q| q.contains(
            "rate(headroom_node_dispatched_cost_total[1m]) / on(instance, dimension) headroom_node_capacity_per_second"
        )),
        "utilisation per dimension"
    );
    assert!(all.iter().any(|q| q.starts_with("histogram_quantile(0.99")
        && q.contains("headroom_volume_latency_seconds_bucket")));
    for name in [
        "headroom_volume_credits",
        "headroom_volume_phase_ops_total",
        "headroom_volume_promise_short_seconds_total",
        "headroom_volume_promise_shortfall_ops_total",
    ] {
        assert!(used.contains(name), "{name} is not shown");
    }
}

/// `headroom serve` with `NOTIFY_SOCKET` set, as systemd starts it; its NBD address and API
/// URL from the ready line.
fn spawn_notified(dir: &Path, notify_socket: &str) -> (Child, String, String) {
    let mut child = Command::new(BIN)
        .args(["serve", "--memory", "256MiB", "--data-dir"])
        .arg(dir)
        .args(["--nbd-listen", "127.0.0.1:0", "--api-listen", "127.0.0.1:0"])
        .env("NOTIFY_SOCKET", notify_socket)
        .env("HEADROOM_TOKEN", TEST_TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines
        .find_map(|line| line.ok().filter(|l| l.starts_with("nbd://")))
        .expect("the ready line");
    std::thread::spawn(move || for _ in lines {});
    let mut words = ready.split_whitespace();
    let nbd = words
        .next()
        .unwrap()
        .trim_start_matches("nbd://")
        .to_string();
    let api = words.nth(1).unwrap().to_string();
    (child, nbd, api)
}

fn receive(socket: &UnixDatagram) -> String {
    let mut buf = [0u8; 256];
    let n = socket
        .recv(&mut buf)
        .expect("a notification within the deadline");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn sigterm_and_wait(mut child: Child) -> std::process::ExitStatus {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    child.wait().unwrap()
}

#[test]
fn serve_tells_systemd_it_is_ready_and_stopping() {
    let dir = tempfile::tempdir().unwrap();
    // A path socket, and an abstract one (`@name`, as systemd may pass).
    let path = dir.path().join("notify.sock");
    let by_path = UnixDatagram::bind(&path).unwrap();
    let abstract_name = format!("headroom-notify-test-{}", std::process::id());
    let by_name = {
        use std::os::linux::net::SocketAddrExt;
        let addr =
            std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes()).unwrap();
        UnixDatagram::bind_addr(&addr).unwrap()
    };
    for (socket, env) in [
        (&by_path, path.to_str().unwrap().to_string()),
        (&by_name, format!("@{abstract_name}")),
    ] {
        // A deadline for each datagram, not a sleep.
        socket
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let (child, nbd, api) = spawn_notified(&dir.path().join("data"), &env);
        let ready = receive(socket);
        let mut lines = ready.lines();
        assert_eq!(lines.next(), Some("READY=1"), "{env}: {ready:?}");
        // What `systemctl status` shows: where it serves.
        assert_eq!(
            lines.next(),
            Some(format!("STATUS=serving NBD on {nbd}, API on {api}").as_str()),
            "{ready:?}"
        );
        // Ready means serving: the API answers.
        let pool: Value = ureq::get(format!("{api}/v1/pool"))
            .header("Authorization", format!("Bearer {TEST_TOKEN}"))
            .call()
            .unwrap()
            .body_mut()
            .read_json()
            .unwrap();
        assert_eq!(pool["capacity_bytes"].as_u64(), Some(256 << 20));
        let status = sigterm_and_wait(child);
        let stopping = receive(socket);
        assert_eq!(
            stopping.lines().next(),
            Some("STOPPING=1"),
            "{env}: {stopping:?}"
        );
        assert!(status.success(), "{status}");
    }
}

#[test]
fn the_sample_deployment_starts_and_logs_json_lines() {
    let unit = std::fs::read_to_string(Path::new(REPO).join("deploy/headroom.service")).unwrap();
    assert!(unit.contains("\nType=notify\n"), "{unit}");
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("ExecStart");
    let mut words = exec.split_whitespace();
    assert_eq!(words.next(), Some("/usr/local/bin/headroom"));
    let args: Vec<&str> = words.collect();
    assert_eq!(
        &args[..3],
        ["serve", "--config", "/etc/headroom/headroom.toml"]
    );

    // systemd's own check of the unit, with the binary at a path that exists.
    if have_tool("systemd-analyze") {
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("headroom.service");
        std::fs::write(&copy, unit.replace("/usr/local/bin/headroom", BIN)).unwrap();
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(&copy)
            .output()
            .unwrap();
        assert!(
            out.status.success() && out.stderr.is_empty(),
            "{}",
            text(&out)
        );
    }

    // The unit's flags with the repository's sample configuration, in RAM and on free ports.
    let dir = tempfile::tempdir().unwrap();
    let sample = Path::new(REPO).join("deploy/headroom.toml");
    let mut flags: Vec<&str> = args[1..].to_vec();
    flags[1] = sample.to_str().unwrap();
    flags.extend(["--memory", "256MiB"]);
    let server = Server::start_with(&dir.path().join("data"), &flags);
    server.create_volume("v1", "64MiB");
    let log = server.log();
    server.stop();
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 2, "{log}");
    for line in &lines {
        let event: Value = serde_json::from_str(line)
            .unwrap_or_else(|err| panic!("not a JSON log line ({err}): {line}"));
        assert!(
            event["timestamp"].is_string() && event["level"].is_string(),
            "{line}"
        );
        assert!(event["fields"].is_object(), "{line}");
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains("volume created") && l.contains("\"v1\"")),
        "{log}"
    );
    assert!(!log.contains('\x1b'), "{log}");
}

#[test]
fn text_logs_to_a_file_have_no_escape_codes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "256MiB");
    server.create_volume("v1", "64MiB");
    let log = server.log();
    server.stop();
    assert!(log.contains("volume created"), "{log}");
    assert!(!log.contains('\x1b'), "escape codes in a log file: {log:?}");
    assert!(
        log.lines().all(|l| !l.starts_with('{')),
        "text, not JSON: {log}"
    );
}
