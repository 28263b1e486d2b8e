//! `GET /metrics` end to end: the real server, real fio, the real scrape.
//!
//! * Operation and byte counts equal exactly what fio did (its JSON report), on a memory node
//!   with a scheduler and on a file-backed one without (`--policy off`: the statistics do not
//!   depend on it); device counters see every write, and file devices time theirs.
//! * Rates from two scrapes match the rate fio was told to keep (`--rate_iops`) within 5 %.
//! * 10,000 volumes: per-volume series only for the busiest 1,000, the rest summed into
//!   `volume="_other"` (so sums over volumes stay exact), the folded gauge right, the scrape
//!   bounded in size and time; idle volumes leave their series after `volume_series_idle_s`.
//!
//! Tenants and their volumes are created too (through the CLI: `tenant create`, then
//! `volume create --tenant`), but fio drives volumes without one: a tenant's volume is served over TLS only
//! to its identity, and fio's NBD engine refuses a PSK file in a URI (libnbd's
//! `nbd_set_uri_allow_local_file` is off).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::openmetrics::{Sample, parse, value};
use common::raw::Client;
use common::{Server, TEST_TOKEN, have_tool, run_ok};
use serde_json::Value;

/// `GET /metrics` with the bearer token; the body and how long it took.
fn scrape(server: &Server) -> (String, Duration) {
    let started = Instant::now();
    let mut response = ureq::get(format!("{}/metrics", server.api))
        .header("Authorization", format!("Bearer {TEST_TOKEN}"))
        .call()
        .expect("GET /metrics");
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "content type {content_type}"
    );
    let body = response
        .body_mut()
        .with_config()
        .limit(256 << 20)
        .read_to_string()
        .expect("body");
    assert!(body.ends_with("# EOF\n"), "no EOF marker");
    (body, started.elapsed())
}

fn sum(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

/// (I/Os, bytes) of reads and writes in fio's report, over all its jobs.
fn fio_totals(report: &Value) -> [(u64, u64); 2] {
    let mut totals = [(0u64, 0u64); 2];
    for job in report["jobs"].as_array().expect("jobs") {
        for (i, dir) in ["read", "write"].into_iter().enumerate() {
            totals[i].0 += job[dir]["total_ios"].as_u64().expect("total_ios");
            totals[i].1 += job[dir]["io_bytes"].as_u64().expect("io_bytes");
        }
    }
    totals
}

/// Runs a mixed job of a fixed number of I/Os (4 KiB random read/write, then 64 KiB
/// sequential writes) on `volume` and checks `/metrics` counts exactly what fio did.
fn counts_match_fio(server: &Server, volume: &str) {
    let out = run_ok(Command::new("fio").args([
        "--ioengine=nbd",
        &format!("--uri={}", server.uri(volume)),
        "--output-format=json",
        "--size=64m",
        "--name=mixed",
        "--rw=randrw",
        "--bs=4k",
        "--iodepth=16",
        "--number_ios=3000",
        "--name=big",
        "--stonewall",
        "--rw=write",
        "--bs=64k",
        "--iodepth=4",
        "--number_ios=200",
    ]));
    let [(reads, read_bytes), (writes, write_bytes)] = fio_totals(&common::fio_report(&out));
    assert!(reads > 0 && writes > 0, "fio did nothing: {reads} {writes}");
    let (body, _) = scrape(server);
    let samples = parse(&body);
    let get = |name: &str, op: &str| {
        value(&samples, name, &[("volume", volume), ("op", op)])
            .unwrap_or_else(|| panic!("no {name}{{volume={volume},op={op}}} in\n{body}"))
            as u64
    };
    assert_eq!(get("headroom_volume_ops_total", "read"), reads);
    assert_eq!(get("headroom_volume_ops_total", "write"), writes);
    assert_eq!(get("headroom_volume_bytes_total", "read"), read_bytes);
    assert_eq!(get("headroom_volume_bytes_total", "write"), write_bytes);
    assert_eq!(get("headroom_volume_errors_total", "read"), 0);
    assert_eq!(get("headroom_volume_errors_total", "write"), 0);
    // The latency histogram counts every request once, and its +Inf bucket is its count.
    assert_eq!(
        get("headroom_volume_latency_seconds_count", "read"),
        reads,
        "histogram count"
    );
    let inf = samples
        .iter()
        .find(|s| {
            s.name == "headroom_volume_latency_seconds_bucket"
                && s.labels.get("volume").map(String::as_str) == Some(volume)
                && s.labels.get("op").map(String::as_str) == Some("write")
                && s.labels.get("le").map(String::as_str) == Some("+Inf")
        })
        .expect("+Inf bucket")
        .value as u64;
    assert_eq!(inf, writes);
    // Every request reached a device: reads of never-written blocks do not, so at least the
    // writes did, and nothing failed there.
    let device_writes = sum(&samples, "headroom_device_ops_total", &[("op", "write")]) as u64;
    assert!(
        device_writes >= writes,
        "{device_writes} device writes for {writes} volume writes"
    );
    assert_eq!(sum(&samples, "headroom_device_errors_total", &[]), 0.0);
    assert_eq!(
        sum(&samples, "headroom_device_checksum_errors_total", &[]),
        0.0
    );
    // File devices are timed (every operation in the histogram); RAM devices are not.
    let timed = sum(
        &samples,
        "headroom_device_latency_seconds_count",
        &[("op", "write")],
    ) as u64;
    let memory = samples.iter().any(|s| {
        s.labels
            .get("device")
            .is_some_and(|d| d.starts_with("memory:"))
    });
    assert_eq!(timed, if memory { 0 } else { device_writes });
}

#[test]
fn operation_and_byte_counts_equal_what_fio_did_with_and_without_a_scheduler() {
    if !have_tool("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for (i, flags) in [
        &["--memory", "2GiB"][..],
        &["--devices", "2", "--device-size", "4GiB", "--policy", "off"][..],
    ]
    .into_iter()
    .enumerate()
    {
        let server = Server::start_with(&dir.path().join(format!("data{i}")), flags);
        server.create_tenant("t1");
        server.create_volume("plain", "1GiB");
        server.create_volume_with("owned", "1GiB", &["--tenant", "t1"]);
        server.create_volume_with("limited", "1GiB", &["--baseline-iops", "20000"]);
        counts_match_fio(&server, "plain");
        counts_match_fio(&server, "limited");
        let (body, _) = scrape(&server);
        let samples = parse(&body);
        // The tenant's volume did nothing: no series of its own, folded into `_other`.
        assert!(
            value(
                &samples,
                "headroom_volume_ops_total",
                &[("volume", "owned")]
            )
            .is_none(),
            "an idle volume has series"
        );
        assert_eq!(
            value(&samples, "headroom_metrics_volumes_folded", &[]),
            Some(1.0)
        );
        assert_eq!(
            value(
                &samples,
                "headroom_volume_baseline_iops",
                &[("volume", "limited")]
            ),
            Some(20_000.0)
        );
        // The scheduler's series exist only with a scheduler.
        let scheduled = i == 0;
        assert_eq!(
            value(
                &samples,
                "headroom_node_dispatched_cost_total",
                &[("dimension", "egress_bytes")]
            )
            .is_some(),
            scheduled
        );
        if scheduled {
            let phases = sum(
                &samples,
                "headroom_volume_phase_ops_total",
                &[("volume", "plain")],
            );
            let ops = sum(
                &samples,
                "headroom_volume_ops_total",
                &[("volume", "plain")],
            );
            assert_eq!(phases, ops, "every request ran in one phase");
        }
        server.stop();
    }
}

#[test]
fn rates_from_two_scrapes_match_the_rate_fio_keeps_within_5_percent() {
    if !have_tool("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("data"), "1GiB");
    server.create_volume("paced", "512MiB");
    let rate_iops = 800u64;
    let mut fio = Command::new("fio")
        .args([
            "--name=paced",
            "--ioengine=nbd",
            &format!("--uri={}", server.uri("paced")),
            "--rw=randread",
            "--bs=4k",
            "--iodepth=4",
            &format!("--rate_iops={rate_iops}"),
            "--time_based",
            "--runtime=12",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let reads = |server: &Server| {
        let (body, _) = scrape(server);
        value(
            &parse(&body),
            "headroom_volume_ops_total",
            &[("volume", "paced"), ("op", "read")],
        )
        .unwrap_or(0.0)
    };
    // Wait until fio runs, and a second more for its pacing to settle.
    let deadline = Instant::now() + Duration::from_secs(20);
    while reads(&server) < rate_iops as f64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let first = (reads(&server), Instant::now());
    let interval = Duration::from_secs(6);
    while first.1.elapsed() < interval {
        std::thread::sleep(Duration::from_millis(100));
    }
    let second = (reads(&server), Instant::now());
    let rate = (second.0 - first.0) / (second.1 - first.1).as_secs_f64();
    assert!(
        (rate - rate_iops as f64).abs() <= rate_iops as f64 * 0.05,
        "{rate:.1} IOPS measured from two scrapes, fio keeps {rate_iops}"
    );
    assert!(fio.wait().unwrap().success());
    server.stop();
}

/// Creates `count` volumes through the API on one keep-alive connection.
fn create_many(server: &Server, prefix: &str, count: usize, tenant: Option<&str>) {
    let agent: ureq::Agent = ureq::Agent::config_builder().build().into();
    for i in 0..count {
        let mut body =
            serde_json::json!({"name": format!("{prefix}{i:05}"), "size_bytes": 4u64 << 20});
        if let Some(tenant) = tenant {
            body["tenant"] = tenant.into();
        }
        agent
            .post(format!("{}/v1/volumes", server.api))
            .header("Authorization", format!("Bearer {TEST_TOKEN}"))
            .send_json(&body)
            .unwrap_or_else(|err| panic!("creating volume {i}: {err}"));
    }
}

/// One 4 KiB read from each of `names`, over a fresh connection each.
fn read_once(server: &Server, names: impl Iterator<Item = String>) -> u64 {
    let mut reads = 0;
    for name in names {
        let mut client = Client::open(server.nbd, &name);
        client.read(1, 0, 4096).expect("read");
        client.disconnect();
        reads += 1;
    }
    reads
}

#[test]
fn ten_thousand_volumes_scrape_bounded_with_the_rest_folded_into_other() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("data"), "16GiB");
    server.create_tenant("t1");
    let total = 10_000usize;
    let created = Instant::now();
    create_many(&server, "v", total, None);
    eprintln!("created {total} volumes in {:?}", created.elapsed());
    // I/O on 1,200 of them, one more read on the first 10 (the busiest).
    let active = 1_200usize;
    let mut reads = read_once(&server, (0..active).map(|i| format!("v{i:05}")));
    reads += read_once(&server, (0..10).map(|i| format!("v{i:05}")));
    let (body, took) = scrape(&server);
    let samples = parse(&body);
    eprintln!(
        "scrape of {total} volumes: {} bytes, {} samples, {took:?}",
        body.len(),
        samples.len()
    );
    let shown: std::collections::BTreeSet<&str> = samples
        .iter()
        .filter(|s| s.name == "headroom_volume_ops_total")
        .filter_map(|s| s.labels.get("volume").map(String::as_str))
        .collect();
    // 1,000 volumes of their own (the default cap) and `_other`.
    assert_eq!(shown.len(), 1_001, "volumes with series");
    assert!(shown.contains("_other"));
    // The busiest are shown (they did 2 reads since the last scrape, the rest 1).
    for i in 0..10 {
        assert!(
            shown.contains(format!("v{i:05}").as_str()),
            "v{i:05} folded"
        );
    }
    assert_eq!(
        value(&samples, "headroom_metrics_volumes_folded", &[]),
        Some((total - 1_000) as f64)
    );
    // Folding keeps sums exact.
    assert_eq!(
        sum(&samples, "headroom_volume_ops_total", &[("op", "read")]) as u64,
        reads
    );
    assert!(
        body.len() < 8 << 20,
        "scrape of {} bytes for 1,000 shown volumes",
        body.len()
    );
    assert!(took < Duration::from_secs(2), "scrape took {took:?}");
    server.stop();
}

#[test]
fn idle_volumes_leave_their_series_after_the_idle_time() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("node.toml");
    std::fs::write(
        &config,
        "[metrics]\nvolume_series_idle_s = 2\nmax_volume_series = 2\n",
    )
    .unwrap();
    let server = Server::start_with(
        &dir.path().join("data"),
        &["--memory", "1GiB", "--config", config.to_str().unwrap()],
    );
    server.create_tenant("t1");
    for name in ["a", "b", "c"] {
        server.create_volume_with(name, "64MiB", &["--tenant", "t1"]);
    }
    server.create_volume("d", "64MiB");
    server.create_volume("e", "64MiB");
    server.create_volume("f", "64MiB");
    let folded = |server: &Server| {
        let (body, _) = scrape(server);
        value(&parse(&body), "headroom_metrics_volumes_folded", &[]).expect("folded gauge")
    };
    // Nothing did I/O: every volume is folded.
    assert_eq!(folded(&server), 6.0);
    read_once(&server, ["d", "e", "f"].into_iter().map(String::from));
    // Three active, at most two shown.
    assert_eq!(folded(&server), 4.0);
    // After the idle time all are folded again (the window is whole seconds of the node's
    // clock: allow one more).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut now = folded(&server);
    while now != 6.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        now = folded(&server);
    }
    assert_eq!(now, 6.0, "idle volumes still have series");
    server.stop();
}
