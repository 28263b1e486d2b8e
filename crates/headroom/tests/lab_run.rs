//! `headroom lab run` end to end: the real binary starts its own server (an emulated device
//! from the scenario), creates the volumes through the API, drives them over loopback and
//! prints `sim run`'s JSON shape.
//!
//! * A 2-second scenario (an open-loop victim at a fixed rate, a closed-loop burster) under
//!   `burst`: the JSON has the required shape; the victim gets its rate; the generator's read
//!   and write counts equal the server's `/metrics` counters for the group's volumes; the
//!   server the lab started is gone by the time it prints; keys the lab does not honour are
//!   listed in the JSON and on stderr; `--out` holds the SVG plots.
//! * Peer rows (qemu-storage-daemon, nbdkit) hold the bursters to their baseline and are gone
//!   after the run; `--target` runs against a server already running, with its own policy,
//!   and removes the volumes it created; a `--policy` the target does not run is refused.
//! * A device with a measured (non-linear) curve is emulated as that curve and the server
//!   charges the variant's estimator: VOP costs give equal device time, constant costs equal
//!   IOPS.
//! * A scenario with a misspelt key, and ones with workloads the lab cannot generate (a queue
//!   deeper than a connection holds, a trace replay), fail before any server starts, naming the
//!   file, the key and the reason.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::BIN;
use serde_json::Value;

const SHORT: &str = r#"
name = "lab-short"
duration_s = 2.0
warmup_s = 0.5
timeline_ms = 100.0

[node]
workers = 2

[[node.devices]]
iocost = { rbps = 400e6, rseqiops = 100000.0, rrandiops = 40000.0, wbps = 300e6, wseqiops = 75000.0, wrandiops = 30000.0 }
parallelism = 4
latency_ns = 75000

[[groups]]
name = "victim"
volume_gib = 0.0625
qos = { baseline_iops = 2000.0, baseline_mib_s = 20.0, burst = "on_demand" }
workload = { mode = "open", rate_iops = 400.0, arrival = "uniform", qd = 4, sizes = "4k", read_fraction = 1.0 }

[[groups]]
name = "burster"
tenants = 2
volume_gib = 0.0625
qos = { baseline_iops = 1000.0, baseline_mib_s = 10.0, ceiling_iops = 20000.0, ceiling_mib_s = 400.0, burst = "on_demand" }
workload = { mode = "closed", qd = 8, sizes = [[4.0, 1.0], [64.0, 1.0]], read_fraction = 0.5 }
"#;

fn lab(dir: &Path, scenario: &str, args: &[&str]) -> (Output, String) {
    let file = dir.join("scenario.toml");
    std::fs::write(&file, scenario).unwrap();
    let file = file.to_str().unwrap().to_string();
    let out = Command::new(BIN)
        .args(["lab", "run", &file])
        .args(args)
        .env_remove("HEADROOM_TOKEN")
        .output()
        .expect("run headroom lab run");
    (out, file)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

#[test]
fn a_short_scenario_runs_end_to_end_and_counts_match_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let plots = dir.path().join("out");
    let (out, _) = lab(
        dir.path(),
        SHORT,
        &[
            "--policy",
            "burst",
            "--json",
            "--seed",
            "7",
            "--out",
            plots.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "lab run failed: {}", stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(report["scenario"], "lab-short");
    assert_eq!(report["seed"], 7);
    let results = report["results"].as_array().expect("results");
    assert_eq!(results.len(), 1);
    let burst = &results[0];
    assert_eq!(burst["policy"], "burst");
    let groups = burst["groups"].as_array().expect("groups");
    let names: Vec<&str> = groups.iter().map(|g| g["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["victim", "burster"]);
    for g in groups {
        for key in [
            "iops",
            "bytes_per_s",
            "lat_mean_us",
            "lat_p50_us",
            "lat_p99_us",
            "lat_p999_us",
        ] {
            assert!(num(g, key) > 0.0, "{key} of {g}");
        }
        assert!(num(g, "lat_p50_us") <= num(g, "lat_p99_us"), "{g}");
        assert!(num(g, "lat_p99_us") <= num(g, "lat_p999_us"), "{g}");
    }
    // The victim asks for 400 IOPS of 4 KiB at fixed gaps, far below the device's capacity.
    let victim = &groups[0];
    assert!(
        (num(victim, "iops") - 400.0).abs() < 40.0,
        "victim at {} IOPS",
        victim["iops"]
    );
    assert!((num(victim, "bytes_per_s") / num(victim, "iops") - 4096.0).abs() < 1.0);
    // What the generator completed is what the server counted, group by group.
    let details = burst["details"]["groups"]
        .as_array()
        .expect("details.groups");
    assert_eq!(details.len(), 2);
    for d in details {
        assert_eq!(d["errors"], 0, "{d}");
        let reads = d["generator_reads"].as_u64().unwrap();
        let writes = d["generator_writes"].as_u64().unwrap();
        assert_eq!(Some(reads), d["server_reads"].as_u64(), "{d}");
        assert_eq!(Some(writes), d["server_writes"].as_u64(), "{d}");
        assert!(reads > 0, "{d}");
    }
    assert_eq!(details[0]["generator_writes"], 0, "the victim only reads");
    assert!(details[1]["generator_writes"].as_u64().unwrap() > 0);
    assert_eq!(details[1]["tenants"], 2);
    // The server the lab started for the row was stopped before the report was printed.
    let pid = burst["details"]["server_pid"].as_u64().expect("server_pid");
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "server {pid} still running"
    );
    assert!(num(&burst["details"], "generator_cpu_ns_per_io") > 0.0);
    // The access latency is a simulator key the emulated device has no counterpart for.
    let not_honoured = report["not_honoured"].as_array().expect("not_honoured");
    assert!(
        not_honoured
            .iter()
            .any(|n| n["key"] == "node.devices.latency_ns"),
        "{not_honoured:?}"
    );
    assert!(
        stderr(&out).contains("not honoured: node.devices.latency_ns"),
        "{}",
        stderr(&out)
    );
    // Keys honoured exactly are not listed: the device's cost model, its parallelism.
    for honoured in [
        "node.devices.parallelism",
        "node.devices.iocost",
        "node.workers",
    ] {
        assert!(
            !not_honoured.iter().any(|n| n["key"] == honoured),
            "{honoured} listed: {not_honoured:?}"
        );
    }
    for svg in ["timeline_burst.svg", "latency_cdf_burst.svg"] {
        let text = std::fs::read_to_string(plots.join(svg)).expect(svg);
        assert!(text.starts_with("<svg") && text.contains("victim"), "{svg}");
    }
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(plots.join("report.json")).unwrap()).unwrap();
    assert_eq!(saved["results"][0]["groups"], burst["groups"]);
}

#[test]
fn a_misspelt_key_fails_with_the_file_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let bad = SHORT.replace("warmup_s", "warmup_seconds");
    let (out, file) = lab(dir.path(), &bad, &["--policy", "burst"]);
    assert!(!out.status.success(), "a misspelt key was accepted");
    let err = stderr(&out);
    assert!(err.contains(&file), "no file in: {err}");
    assert!(err.contains("warmup_seconds"), "no key in: {err}");
    assert!(err.contains("unknown field"), "no reason in: {err}");
    assert!(out.stdout.is_empty(), "printed a report");
}

#[test]
fn impossible_workloads_fail_with_the_file_the_key_and_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    for (scenario, key, reason) in [
        (
            SHORT.replace("qd = 8", "qd = 1000"),
            "groups.burster.workload.qd",
            "at most 256 requests in flight",
        ),
        (
            SHORT.replace(
                "workload = { mode = \"closed\", qd = 8, sizes = [[4.0, 1.0], [64.0, 1.0]], read_fraction = 0.5 }",
                "workload = { mode = \"trace\", trace = { path = \"t.csv\", format = \"msr\" } }",
            ),
            "groups.burster.workload.mode",
            "does not replay traces",
        ),
        (
            SHORT.replace("sizes = \"4k\"", "sizes = \"0.75k\""),
            "groups.victim.workload.sizes",
            "not a positive multiple of 512",
        ),
    ] {
        assert!(scenario != SHORT, "{key}: the replacement did not apply");
        let (out, file) = lab(dir.path(), &scenario, &["--policy", "burst", "--json"]);
        assert!(!out.status.success(), "{key}: accepted");
        let err = stderr(&out);
        assert!(err.contains(&file), "{key}: no file in: {err}");
        assert!(err.contains(key), "{key}: no key in: {err}");
        assert!(err.contains(reason), "{key}: no reason in: {err}");
        assert!(out.stdout.is_empty(), "{key}: printed a report");
    }
}

#[test]
fn peers_are_extra_rows_started_and_stopped_by_the_lab() {
    if !common::have_tool("qemu-storage-daemon") || !common::have_tool("nbdkit") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (out, _) = lab(
        dir.path(),
        SHORT,
        &[
            "--policy",
            "qsd-static",
            "--policy",
            "nbdkit-rate",
            "--json",
        ],
    );
    assert!(out.status.success(), "lab run failed: {}", stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let results = report["results"].as_array().expect("results");
    let policies: Vec<&str> = results
        .iter()
        .map(|r| r["policy"].as_str().unwrap())
        .collect();
    assert_eq!(policies, ["qsd-static", "nbdkit-rate"]);
    // Each burster is sold 10 MiB/s; qsd's throttle group holds it there, nbdkit's rate filter
    // too, after the bucket it starts with (2 s of rate by default, so up to ~2.5x over a 1.5 s
    // window). Unthrottled, two QD-8 bursters of 4/64 KiB move hundreds of MB/s here.
    let baseline = 2.0 * 10.0 * 1_048_576.0;
    for (r, slack) in results.iter().zip([1.3, 2.6]) {
        let burster = &r["groups"][1];
        assert_eq!(burster["name"], "burster");
        let bps = num(burster, "bytes_per_s");
        assert!(
            bps > 0.0 && bps <= slack * baseline,
            "{}: bursters at {bps} B/s",
            r["policy"]
        );
        let victim = &r["groups"][0];
        assert!(
            (num(victim, "iops") - 400.0).abs() < 40.0,
            "{}: victim at {}",
            r["policy"],
            victim["iops"]
        );
        assert!(
            r["details"]["server"]
                .as_str()
                .unwrap()
                .contains("no emulated device")
        );
        let pid = r["details"]["server_pid"].as_u64().expect("server_pid");
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "{}: peer {pid} still running",
            r["policy"]
        );
    }
    let not_honoured = report["not_honoured"].as_array().expect("not_honoured");
    assert!(
        not_honoured
            .iter()
            .any(|n| n["key"] == "node.devices (peer rows)"),
        "{not_honoured:?}"
    );
}

#[test]
fn a_running_server_is_a_target_with_its_own_policy() {
    let dir = tempfile::tempdir().unwrap();
    let server = common::Server::start_memory(&dir.path().join("data"), "1GiB");
    let file = dir.path().join("scenario.toml");
    std::fs::write(&file, SHORT).unwrap();
    let run = |extra: &[&str]| {
        Command::new(BIN)
            .args([
                "lab",
                "run",
                file.to_str().unwrap(),
                "--json",
                "--target",
                &server.api,
            ])
            .args(extra)
            .env("HEADROOM_TOKEN", common::TEST_TOKEN)
            .output()
            .expect("run headroom lab run")
    };
    let out = run(&[]);
    assert!(
        out.status.success(),
        "lab run --target failed: {}",
        stderr(&out)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let results = report["results"].as_array().expect("results");
    assert_eq!(results.len(), 1, "one row: the target's policy");
    assert_eq!(results[0]["policy"], "burst", "the server's default policy");
    assert!(
        report["not_honoured"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["key"] == "policies")
    );
    assert!(
        report["not_honoured"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["key"] == "node")
    );
    for d in results[0]["details"]["groups"].as_array().unwrap() {
        assert_eq!(d["generator_reads"], d["server_reads"], "{d}");
        assert_eq!(d["generator_writes"], d["server_writes"], "{d}");
    }
    // The lab's volumes are gone again.
    let volumes = common::agent()
        .get(format!("{}/v1/volumes", server.api))
        .header("Authorization", common::bearer())
        .call()
        .expect("GET /v1/volumes")
        .body_mut()
        .read_to_string()
        .unwrap();
    let volumes: Value = serde_json::from_str(&volumes).unwrap();
    assert_eq!(volumes.as_array().map(Vec::len), Some(0), "{volumes}");
    // A policy the target does not run cannot be honoured.
    let out = run(&["--policy", "wild"]);
    assert!(
        !out.status.success(),
        "--policy wild against a burst server accepted"
    );
    let err = stderr(&out);
    assert!(
        err.contains("runs policy burst") && err.contains("wild"),
        "{err}"
    );
    server.stop();
}

/// A device whose cost is not linear in size: 4 KiB reads at 4,000/s, 64 KiB at 500/s (a
/// linear model through 4 and 16 KiB would put 64 KiB at 667/s). Slow, so that the run does not
/// depend on the machine's CPU (the other tests run servers at the same time); 16 channels and
/// the scheduler at 0.8 of the device, because the server's burst gate lets these
/// baseline-less tenants hold only 15 of the 16 (docs/results.md, Libra (f)).
const CURVE: &str = r#"
name = "lab-curve"
duration_s = 3.0
warmup_s = 1.5
policies = ["drr-vop"]
invariants = "warn"

[node]
workers = 1
capacity = { scale = 0.8 }

[[node.devices]]
parallelism = 16
curve = [
  { size_kib = 4.0, read_iops = 4000.0, write_iops = 2000.0 },
  { size_kib = 16.0, read_iops = 2000.0, write_iops = 1000.0 },
  { size_kib = 64.0, read_iops = 500.0, write_iops = 250.0 },
]

[[groups]]
name = "small"
volume_gib = 0.0625
workload = { mode = "closed", qd = 128, sizes = "4k", read_fraction = 1.0 }

[[groups]]
name = "large"
volume_gib = 0.0625
workload = { mode = "closed", qd = 128, sizes = "64k", read_fraction = 1.0 }

[cost]
device = "vop"
write_cost_aimd = false

[[variants]]
name = "vop"
[[variants]]
name = "constant"
set = { "cost.device" = "constant" }
"#;

#[test]
fn a_curve_device_is_emulated_and_charged_as_the_scenario_says() {
    let dir = tempfile::tempdir().unwrap();
    let (out, _) = lab(dir.path(), CURVE, &["--json"]);
    assert!(out.status.success(), "lab run failed: {}", stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let results = report["results"].as_array().expect("results");
    assert_eq!(results.len(), 2);
    let iops = |variant: &str| -> (f64, f64) {
        let r = results
            .iter()
            .find(|r| r["variant"] == variant)
            .unwrap_or_else(|| panic!("no {variant} row"));
        for d in r["details"]["groups"].as_array().unwrap() {
            assert_eq!(d["generator_reads"], d["server_reads"], "{d}");
        }
        let g = r["groups"].as_array().unwrap();
        (num(&g[0], "iops"), num(&g[1], "iops"))
    };
    // VOP costs from the same curve as the device: equal device time (the curve's IOPS at each
    // size), so the 4 KiB tenant gets 8x the 64 KiB tenant's IOPS; the device is 80 % busy
    // (the scheduler is told 0.8 of it).
    let (small, large) = iops("vop");
    let (t_small, t_large) = (small / 4000.0, large / 500.0);
    assert!(
        (0.7..1.43).contains(&(t_small / t_large)),
        "vop: {small} and {large} IOPS, device time {t_small} vs {t_large}"
    );
    assert!(
        (0.65..0.95).contains(&(t_small + t_large)),
        "vop: device {} busy",
        t_small + t_large
    );
    // Every request charged the same: equal IOPS, so the 64 KiB tenant takes ~8/9 of the device.
    let (small, large) = iops("constant");
    assert!(
        (0.7..1.43).contains(&(small / large)),
        "constant: {small} and {large} IOPS"
    );
    let not_honoured = report["not_honoured"].as_array().expect("not_honoured");
    assert!(
        not_honoured.iter().any(|n| n["key"] == "node.devices.curve"
            && n["reason"].as_str().unwrap().contains("VOP curve")),
        "{not_honoured:?}"
    );
    assert!(
        !not_honoured.iter().any(|n| n["key"] == "cost"),
        "{not_honoured:?}"
    );
}
