//! The vhost-user-blk load generator (`headroom lab vhost-load`, the lab's
//! `vhost_user::load`) against real backends, run as the binary's CLI with `--json`:
//!
//! * Headroom (`serve --memory`, a volume attached with two queues): random 4 KiB writes on
//!   both queues, then random 4 KiB reads and sequential 128 KiB reads on one; no request
//!   fails, and every request the generator says completed is one the server counted
//!   (`headroom_volume_ops_total` and `headroom_volume_bytes_total` in `GET /metrics` equal
//!   its `all_completions` and `all_bytes` exactly, per operation).
//! * qemu-storage-daemon's vhost-user-blk export of a file (skipped with the reason when it
//!   is not installed; a failure when HEADROOM_REQUIRE_TOOLS is set): its export counts
//!   nothing (`query-blockstats` reports no operations for it), so what is checked is the
//!   data: sequential 4 KiB writes confined by `--size` to the first 1 MiB of a 16 MiB file
//!   wrap over that range, so every block of it holds the generator's data afterwards and
//!   everything past it is still zeros; then random reads with no error.
//!
//! The generator is also what proves it speaks vhost-user-blk as a driver does, not as
//! Headroom's backend happens to accept: qemu-storage-daemon is the other implementation.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use common::{BIN, Server, have_tool, openmetrics, text};
use serde_json::Value;

/// `headroom lab vhost-load --socket SOCK ARGS --json`, which must succeed; its report.
fn vhost_load(sock: &Path, args: &[&str]) -> Value {
    let out = Command::new(BIN)
        .args([
            "lab",
            "vhost-load",
            "--socket",
            sock.to_str().unwrap(),
            "--json",
        ])
        .args(args)
        .output()
        .expect("run headroom lab vhost-load");
    assert!(out.status.success(), "vhost-load {args:?}: {}", text(&out));
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    common::report(&format!(
        "vhost-load {args:?}: {} IOPS, p50 {} us, p99 {} us, {} in the window, {} in all",
        report["iops"],
        report["p50_us"],
        report["p99_us"],
        report["completions"],
        report["all_completions"]
    ));
    report
}

fn u(report: &Value, key: &str) -> u64 {
    report[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in {report}"))
}

/// What holds for every report: nothing failed, something ran, the window is part of the
/// whole and its bytes are its requests' sizes.
fn assert_clean(report: &Value) {
    assert_eq!(u(report, "errors"), 0, "{report}");
    let (window, all) = (u(report, "completions"), u(report, "all_completions"));
    assert!(window > 0 && window <= all, "{report}");
    assert_eq!(u(report, "bytes"), window * u(report, "block_bytes"));
    assert_eq!(u(report, "all_bytes"), all * u(report, "block_bytes"));
}

/// The value of `name{volume="VOLUME",op="OP"}` in the server's `GET /metrics`.
fn volume_series(server: &Server, name: &str, volume: &str, op: &str) -> u64 {
    let body = common::metrics_text(&server.api);
    openmetrics::value(
        &openmetrics::parse(&body),
        name,
        &[("volume", volume), ("op", op)],
    )
    .unwrap_or_else(|| panic!("no {name}{{volume={volume},op={op}}}")) as u64
}

#[test]
fn the_generator_counts_what_headroom_counted() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("data"), "1GiB");
    server.create_volume_with(
        "disk",
        "64MiB",
        &["--baseline-iops", "1000000", "--baseline-mbps", "100000"],
    );
    let sock = dir.path().join("disk.sock");
    let out = server.cli(&[
        "volume",
        "attach",
        "disk",
        "--vhost-user",
        sock.to_str().unwrap(),
        "--num-queues",
        "2",
    ]);
    assert!(out.status.success(), "{}", text(&out));

    let writes = vhost_load(
        &sock,
        &[
            "--rw",
            "randwrite",
            "--queues",
            "2",
            "--iodepth",
            "16",
            "--runtime-s",
            "1",
            "--ramp-s",
            "0.2",
        ],
    );
    assert_clean(&writes);
    assert_eq!(u(&writes, "capacity_bytes"), 64 << 20);
    let series = |name: &str, op: &str| volume_series(&server, name, "disk", op);
    assert_eq!(
        series("headroom_volume_ops_total", "write"),
        u(&writes, "all_completions")
    );
    assert_eq!(
        series("headroom_volume_bytes_total", "write"),
        u(&writes, "all_bytes")
    );

    let reads = vhost_load(
        &sock,
        &["--rw", "randread", "--runtime-s", "1", "--ramp-s", "0.2"],
    );
    assert_clean(&reads);
    let seq = vhost_load(
        &sock,
        &[
            "--rw",
            "read",
            "--bs",
            "128k",
            "--iodepth",
            "8",
            "--runtime-s",
            "0.5",
            "--ramp-s",
            "0",
        ],
    );
    assert_clean(&seq);
    assert_eq!(
        series("headroom_volume_ops_total", "read"),
        u(&reads, "all_completions") + u(&seq, "all_completions")
    );
    assert_eq!(
        series("headroom_volume_bytes_total", "read"),
        u(&reads, "all_bytes") + u(&seq, "all_bytes")
    );
    assert_eq!(
        series("headroom_volume_ops_total", "write"),
        u(&writes, "all_completions"),
        "reads counted as writes"
    );
    for op in ["read", "write"] {
        assert_eq!(series("headroom_volume_errors_total", op), 0);
    }

    // More queues than attached: refused at connect, nothing sent.
    let out = Command::new(BIN)
        .args(["lab", "vhost-load", "--socket", sock.to_str().unwrap()])
        .args(["--queues", "3", "--runtime-s", "0.1"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("queues"), "{}", text(&out));
    server.stop();
}

/// qemu-storage-daemon with a vhost-user-blk export of `image` at `sock` and its QMP monitor
/// on stdio; returned once the monitor's greeting is read, which qsd sends after it has
/// set up every option before it (the export is listening).
fn start_qsd(image: &Path, sock: &Path) -> Child {
    let mut child = Command::new("qemu-storage-daemon")
        .arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=f0,filename={}",
            image.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path={},writable=on,num-queues=1",
            sock.display()
        ))
        .args(["--chardev", "stdio,id=m", "--monitor", "chardev=m"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn qemu-storage-daemon");
    let stdout = child.stdout.take().unwrap();
    let mut greeting = String::new();
    BufReader::new(stdout).read_line(&mut greeting).unwrap();
    assert!(
        greeting.contains("QMP"),
        "qemu-storage-daemon did not start: {greeting:?}"
    );
    child
}

#[test]
fn the_generator_drives_qemu_storage_daemon() {
    if !have_tool("qemu-storage-daemon") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let sock = dir.path().join("qsd.sock");
    let mut qsd = start_qsd(&image, &sock);
    let writes = vhost_load(
        &sock,
        &[
            "--rw",
            "write",
            "--size",
            "1MiB",
            "--iodepth",
            "8",
            "--runtime-s",
            "0.5",
            "--ramp-s",
            "0",
        ],
    );
    assert_clean(&writes);
    assert_eq!(u(&writes, "capacity_bytes"), 16 << 20);
    assert_eq!(u(&writes, "size_bytes"), 1 << 20);
    let reads = vhost_load(&sock, &["--runtime-s", "0.5", "--ramp-s", "0.1"]);
    assert_clean(&reads);
    common::signal(qsd.id(), "TERM");
    qsd.wait().unwrap();

    let data = std::fs::read(&image).unwrap();
    assert!(
        u(&writes, "all_completions") >= 256,
        "the writes wrapped the 1 MiB range at least once: {writes}"
    );
    for (i, block) in data[..1 << 20].chunks(4096).enumerate() {
        assert!(
            block.iter().any(|b| *b != 0),
            "block {i} of the written range holds no data"
        );
    }
    assert!(
        data[1 << 20..].iter().all(|b| *b == 0),
        "a write landed past --size"
    );
}
