//! The lab's load generator (`headroom-lab`) against the real server: what it says it did
//! is exactly what the server counted.
//!
//! * A closed-loop group of a fixed count (3,000 random 4 KiB I/Os, half reads, QD 8) on a
//!   64 MiB volume: its read/write operation and byte counts equal the volume's series in
//!   `GET /metrics`, its latency histogram holds one sample per I/O, and nothing failed.
//! * A spec with queue depth 0 or a block size that is not a multiple of 512 is refused
//!   with a clear error before anything touches the network.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use common::{Server, openmetrics};
use headroom_lab::{ClosedLoopSpec, LabError, Target, closed_loop};

/// The value of `name{volume="VOLUME",op="OP"}` in an OpenMetrics exposition.
fn volume_series(body: &str, name: &str, volume: &str, op: &str) -> u64 {
    openmetrics::value(
        &openmetrics::parse(body),
        name,
        &[("volume", volume), ("op", op)],
    )
    .unwrap_or_else(|| panic!("no {name}{{volume={volume},op={op}}} in\n{body}")) as u64
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

#[test]
fn a_closed_loop_group_counts_exactly_what_the_server_counted() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("data"), "1GiB");
    server.create_volume("lab", "64MiB");
    let spec = ClosedLoopSpec {
        queue_depth: 8,
        block_size_bytes: 4096,
        read_permille: 500,
        region_bytes: 64 << 20,
        total_ios: 3_000,
        seed: 7,
    };
    let target = Target {
        addr: server.nbd.to_string(),
        export: "lab".to_string(),
    };
    let result = runtime()
        .block_on(closed_loop(&target, &spec))
        .unwrap_or_else(|err| panic!("closed loop failed: {err}; log:\n{}", server.log()));
    eprintln!(
        "lab: {} reads, {} writes in {:?}: {:.0} IOPS, p50 {} us, p99 {} us, generator CPU {:.0} ns/I/O",
        result.ios_read,
        result.ios_written,
        result.elapsed,
        result.iops(),
        result.latency_us.value_at_quantile(0.5),
        result.latency_us.value_at_quantile(0.99),
        result.cpu_ns_per_io()
    );
    assert_eq!(result.errors, 0);
    assert_eq!(result.ios_read + result.ios_written, spec.total_ios);
    assert_eq!(result.latency_us.len(), spec.total_ios);
    assert!(
        result.ios_read > 1_000 && result.ios_written > 1_000,
        "a 50 % mix: {} reads, {} writes",
        result.ios_read,
        result.ios_written
    );
    assert_eq!(result.bytes_read, result.ios_read * 4096);
    assert_eq!(result.bytes_written, result.ios_written * 4096);
    assert!(result.cpu_ns > 0, "no CPU time measured");

    let body = common::metrics_text(&server.api);
    let get = |name: &str, op: &str| volume_series(&body, name, "lab", op);
    assert_eq!(get("headroom_volume_ops_total", "read"), result.ios_read);
    assert_eq!(
        get("headroom_volume_ops_total", "write"),
        result.ios_written
    );
    assert_eq!(
        get("headroom_volume_bytes_total", "read"),
        result.bytes_read
    );
    assert_eq!(
        get("headroom_volume_bytes_total", "write"),
        result.bytes_written
    );
    assert_eq!(get("headroom_volume_errors_total", "read"), 0);
    assert_eq!(get("headroom_volume_errors_total", "write"), 0);

    // The same seed issues the same I/Os: a second run splits reads and writes identically.
    let again = runtime().block_on(closed_loop(&target, &spec)).unwrap();
    assert_eq!(
        (again.ios_read, again.ios_written),
        (result.ios_read, result.ios_written)
    );
    server.stop();
}

#[test]
fn a_zero_queue_depth_or_an_unaligned_block_size_is_refused_before_connecting() {
    let good = ClosedLoopSpec {
        queue_depth: 8,
        block_size_bytes: 4096,
        read_permille: 500,
        region_bytes: 64 << 20,
        total_ios: 10,
        seed: 7,
    };
    // Nothing listens on port 1: a spec that got as far as connecting would fail with Io.
    let target = Target {
        addr: "127.0.0.1:1".to_string(),
        export: "lab".to_string(),
    };
    for (spec, expected) in [
        (
            ClosedLoopSpec {
                queue_depth: 0,
                ..good
            },
            "invalid load spec: queue_depth 0 is outside 1..=256",
        ),
        (
            ClosedLoopSpec {
                block_size_bytes: 1000,
                ..good
            },
            "invalid load spec: block_size_bytes 1000 is not a positive multiple of 512",
        ),
    ] {
        let err = runtime()
            .block_on(closed_loop(&target, &spec))
            .expect_err("an invalid spec was accepted");
        assert!(matches!(err, LabError::InvalidSpec(_)), "{err:?}");
        assert_eq!(err.to_string(), expected);
    }
}
