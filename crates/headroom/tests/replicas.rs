//! Replicated volumes end to end: `headroom volume create --replicas 2` on a server with
//! three device files, written and verified by fio over NBD, then the copies compared
//! directly (the store opened on the stopped server's data directory); and `headroom device
//! fail` in the middle of an fio verify run on a 2-replica volume: zero verify errors, the
//! rebuild of the lost copies onto the third device at the rate it was given (`rebuilding`,
//! then `healthy`), a scrub that finds the copies equal, and both copies equal and off the
//! failed device after the restart.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Server, have_tool, text};
use headroom_store::{EXTENT_SIZE_BYTES, Store, StoreConfig};
use serde_json::Value;

const E: u64 = EXTENT_SIZE_BYTES;
const VOLUME_BYTES: u64 = 32 << 20;

fn start(dir: &std::path::Path) -> Server {
    Server::start_with(dir, &["--devices", "3", "--device-size", "256MiB"])
}

fn show(server: &Server, name: &str) -> Value {
    let out = server.cli(&["volume", "show", name, "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn fio(server: &Server, volume: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=replicas",
        "--ioengine=nbd",
        &format!("--uri={}", server.uri(volume)),
        "--bs=4k",
        "--iodepth=8",
        &format!("--size={VOLUME_BYTES}"),
        "--fsync=32",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--verify_state_save=0",
        "--output-format=json",
    ])
    .args(extra)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    cmd
}

/// Opens the stopped server's store and returns, per logical extent of `volume` that is
/// allocated, whether its two copies hold the same bytes, skipping extents with a copy on a
/// device in `skip_devices`.
fn compare_copies(data_dir: &std::path::Path, volume: &str, skip_devices: &[u32]) -> (u64, u64) {
    let store = Store::open(&StoreConfig::new(data_dir)).unwrap();
    let v = store.open_volume(volume).unwrap();
    assert_eq!(v.replicas(), 2);
    let (mut compared, mut differing) = (0, 0);
    let mut a = vec![0u8; E as usize];
    let mut b = vec![0u8; E as usize];
    for extent in 0..VOLUME_BYTES / E {
        let (Some(l0), Some(l1)) = (v.replica_location(0, extent), v.replica_location(1, extent))
        else {
            continue;
        };
        assert_ne!(
            l0.device, l1.device,
            "extent {extent}: both copies on one device"
        );
        if skip_devices.contains(&l0.device) || skip_devices.contains(&l1.device) {
            continue;
        }
        v.read_replica_at(0, extent * E, &mut a).unwrap();
        v.read_replica_at(1, extent * E, &mut b).unwrap();
        compared += 1;
        if a != b {
            differing += 1;
        }
    }
    (compared, differing)
}

/// Whether a connection to volume `r` is transmitting and has had requests in flight.
fn fio_is_running(server: &Server) -> bool {
    let Ok(mut response) = common::agent()
        .get(format!("{}/v1/connections", server.api))
        .header("authorization", common::bearer())
        .call()
    else {
        return false;
    };
    let view: Value = response.body_mut().read_json().unwrap_or_default();
    view["connections"].as_array().is_some_and(|conns| {
        conns.iter().any(|c| {
            c["volume"] == "r"
                && c["phase"] == "transmitting"
                && c["peak_inflight_requests"].as_u64().unwrap_or(0) > 0
        })
    })
}

#[test]
fn fio_verify_on_a_two_replica_volume_leaves_equal_copies() {
    if !have_tool("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = start(&data);
    server.create_volume_with("r", "32MiB", &["--replicas", "2"]);
    let view = show(&server, "r");
    assert_eq!(view["replicas"], 2, "{view}");
    assert_eq!(view["health"], "healthy", "{view}");
    // Three copies fit on three devices; four are refused by the CLI (1 to 3).
    let out = server.cli(&[
        "volume",
        "create",
        "four",
        "--size",
        "1GiB",
        "--replicas",
        "3",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let out = server.cli(&["volume", "create", "x", "--size", "1GiB", "--replicas", "4"]);
    assert!(!out.status.success(), "4 replicas accepted: {}", text(&out));

    let out = fio(&server, "r", &["--rw=randwrite", "--do_verify=1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "fio failed: {}", text(&out));
    let job = common::fio_job(&out);
    assert_eq!(job["error"].as_u64(), Some(0), "{job}");
    let writes = job["write"]["total_ios"].as_u64().unwrap();
    let verified = job["read"]["total_ios"].as_u64().unwrap();
    assert!(writes > 0 && verified > 0, "{job}");
    // Pool space counts both copies.
    let allocated = show(&server, "r")["allocated_bytes"].as_u64().unwrap();
    assert_eq!(allocated, 2 * VOLUME_BYTES);
    server.stop();

    let (compared, differing) = compare_copies(&data, "r", &[]);
    assert_eq!(compared, VOLUME_BYTES / E);
    assert_eq!(differing, 0);
    eprintln!(
        "fio on a 2-replica volume: {writes} writes, {verified} verified, {compared} extents \
         compared copy against copy, 0 differ"
    );
}

/// The rebuild rate of the acceptance test: 32 MiB of lost copies take about 2 s, so the
/// rebuild runs while fio does and its measured rate can be compared with this.
const REBUILD_RATE_BYTES_PER_S: u64 = 16 << 20;

#[test]
fn a_device_failed_mid_fio_verify_costs_no_errors_and_is_rebuilt_at_its_rate() {
    if !have_tool("fio") {
        return;
    }
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = start(&data);
    server.create_volume_with("r", "32MiB", &["--replicas", "2"]);
    let out = server.cli(&["rebuild", "set", "--rate", "16MiB", "--json"]);
    assert!(out.status.success(), "rebuild set: {}", text(&out));
    let rebuild: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        rebuild["rate_bytes_per_s"], REBUILD_RATE_BYTES_PER_S,
        "{rebuild}"
    );
    // Write every block first so the run reads and rewrites data on all three devices.
    let out = fio(&server, "r", &["--rw=write", "--do_verify=0"])
        .output()
        .unwrap();
    assert!(out.status.success(), "fio fill failed: {}", text(&out));

    let run = fio(
        &server,
        "r",
        &[
            "--rw=randrw",
            "--time_based",
            "--runtime=4",
            "--verify_backlog=64",
        ],
    )
    .spawn()
    .unwrap();
    // Fail device 0 once fio's run is under way: a connection to r has had requests in
    // flight.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !fio_is_running(&server) {
        assert!(Instant::now() < deadline, "fio never started");
        std::thread::yield_now();
    }
    let out = server.cli(&["device", "fail", "0", "--json"]);
    assert!(out.status.success(), "device fail: {}", text(&out));
    let device: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(device["failed"], true, "{device}");
    // The rebuild starts at once and runs while fio does.
    let view = show(&server, "r");
    assert_ne!(view["health"], "healthy", "{view}");

    let out = run.wait_with_output().unwrap();
    assert!(out.status.success(), "fio failed: {}", text(&out));
    let job = common::fio_job(&out);
    assert_eq!(job["error"].as_u64(), Some(0), "{job}");
    let verified = job["read"]["total_ios"].as_u64().unwrap();
    assert!(verified > 0, "{job}");

    // The rebuild runs to full redundancy.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen_rebuilding = view["health"] == "rebuilding";
    let view = loop {
        let view = show(&server, "r");
        seen_rebuilding |= view["health"] == "rebuilding";
        if view["health"] == "healthy" {
            break view;
        }
        assert!(Instant::now() < deadline, "rebuild never finished: {view}");
        std::thread::sleep(Duration::from_millis(50)); // polling interval, not a synchronisation
    };
    assert!(seen_rebuilding, "never saw health rebuilding");
    let progress = &view["rebuild"];
    assert_eq!(progress["state"], "done", "{view}");
    let total = progress["extents_total"].as_u64().unwrap();
    assert!(total > 0, "{view}");
    assert_eq!(progress["extents_done"].as_u64(), Some(total), "{view}");
    // The rate followed the one it was given (paced per 2 MiB extent; ±25%).
    let rate = progress["bytes_per_s"].as_u64().unwrap();
    let given = REBUILD_RATE_BYTES_PER_S as f64;
    assert!(
        (rate as f64) < given * 1.25 && (rate as f64) > given * 0.5,
        "rebuild at {rate} B/s, given {given}: {view}"
    );
    let out = server.cli(&["rebuild", "show", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let rebuild: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        rebuild["bytes_total"].as_u64(),
        Some(total * E),
        "{rebuild}"
    );
    assert_eq!(rebuild["extents_remaining"], 0, "{rebuild}");
    let metrics = common::agent()
        .get(format!("{}/metrics", server.api))
        .header("authorization", common::bearer())
        .call()
        .expect("GET /metrics")
        .body_mut()
        .read_to_string()
        .unwrap();
    assert!(
        metrics.contains(&format!("headroom_rebuild_bytes_total {}", total * E)),
        "{metrics}"
    );
    assert!(
        metrics.contains("headroom_rebuild_extents_remaining 0"),
        "{metrics}"
    );

    // A scrub finds the copies equal.
    let out = server.cli(&["volume", "scrub", "r", "--json"]);
    assert!(out.status.success(), "scrub: {}", text(&out));
    let scrub: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(scrub["extents_checked"], VOLUME_BYTES / E, "{scrub}");
    assert_eq!(scrub["mismatches"], 0, "{scrub}");
    // Three copies need three healthy devices: 422 now.
    let out = server.cli(&[
        "volume",
        "create",
        "three",
        "--size",
        "4MiB",
        "--replicas",
        "3",
    ]);
    assert!(!out.status.success());
    assert!(text(&out).contains("replicas"), "{}", text(&out));
    server.stop();

    // After the restart: every extent has both copies, none on device 0, and they agree.
    let (compared, differing) = compare_copies(&data, "r", &[]);
    assert_eq!(compared, VOLUME_BYTES / E);
    assert_eq!(differing, 0);
    {
        let store = Store::open(&StoreConfig::new(&data)).unwrap();
        let v = store.open_volume("r").unwrap();
        for extent in 0..VOLUME_BYTES / E {
            for r in 0..2 {
                assert_ne!(v.replica_location(r, extent).unwrap().device, 0);
            }
        }
    }
    eprintln!(
        "device 0 failed mid fio verify on a 2-replica volume: 0 errors, {verified} verify \
         reads; {total} extents rebuilt at {rate} B/s (given {REBUILD_RATE_BYTES_PER_S}); \
         scrub 0 mismatches ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
}
