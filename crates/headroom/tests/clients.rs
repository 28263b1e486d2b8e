//! End-to-end: the real clients (nbdinfo, qemu-img, qemu-io, nbdcopy, fio) against the real
//! server binary over loopback.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::process::Command;

use common::{Server, have_tool, random_file, run_ok, text};
use serde_json::Value;

#[test]
fn nbdinfo_lists_exports_with_size_and_flags() {
    if !have_tool("nbdinfo") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    server.create_volume("alpha", "64MiB");
    server.create_volume("beta", "1GiB");

    let out = run_ok(Command::new("nbdinfo").args(["--list", "--json", &server.uri("")]));
    let listing: Value = serde_json::from_slice(&out.stdout).unwrap();
    let exports = listing["exports"].as_array().expect("exports array");
    let mut seen: Vec<(String, u64)> = exports
        .iter()
        .map(|e| {
            (
                e["export-name"].as_str().unwrap().to_string(),
                e["export-size"].as_u64().unwrap(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        vec![
            ("alpha".to_string(), 64 << 20),
            ("beta".to_string(), 1 << 30)
        ]
    );

    let out = run_ok(Command::new("nbdinfo").args(["--json", &server.uri("alpha")]));
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    let export = &info["exports"][0];
    assert_eq!(export["export-size"].as_u64(), Some(64 << 20));
    assert_eq!(export["is_read_only"], Value::Bool(false));
    for flag in [
        "can_flush",
        "can_fua",
        "can_trim",
        "can_zero",
        "can_multi_conn",
        "can_cache",
        "can_fast_zero",
    ] {
        assert_eq!(export[flag], Value::Bool(true), "{flag} in {export}");
    }
    assert_eq!(export["block_size_maximum"].as_u64(), Some(32 << 20));
    assert_eq!(info["protocol"].as_str(), Some("newstyle-fixed"));

    // An unknown export is refused, not served.
    let out = Command::new("nbdinfo")
        .arg(server.uri("missing"))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "nbdinfo on a missing export: {}",
        text(&out)
    );
    server.stop();
}

#[test]
fn map_shows_holes_where_unwritten_and_data_where_written() {
    if !have_tool("nbdinfo") || !have_tool("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    server.create_volume("sparse", "64MiB");
    let uri = server.uri("sparse");

    let map = |uri: &str| -> Vec<(u64, u64, u64)> {
        let out = run_ok(Command::new("nbdinfo").args(["--map", "--json", uri]));
        let entries: Value = serde_json::from_slice(&out.stdout).unwrap();
        entries
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["offset"].as_u64().unwrap(),
                    e["length"].as_u64().unwrap(),
                    e["type"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    // Fresh volume: one hole (type 3 = hole|zero) covering everything.
    assert_eq!(map(&uri), vec![(0, 64 << 20, 3)]);

    run_ok(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0xab 8M 64k", &uri]));
    let entries = map(&uri);
    let data: Vec<_> = entries.iter().filter(|e| e.2 == 0).collect();
    assert_eq!(data.len(), 1, "one data run in {entries:?}");
    let (offset, length, _) = *data[0];
    assert!(
        offset <= 8 << 20 && offset + length >= (8 << 20) + (64 << 10),
        "{entries:?}"
    );
    assert!(
        length <= 4 << 20,
        "data run no larger than the touched extents: {entries:?}"
    );
    let hole_bytes: u64 = entries.iter().filter(|e| e.2 == 3).map(|e| e.1).sum();
    assert_eq!(hole_bytes + length, 64 << 20, "{entries:?}");

    // Reading back through another client sees the pattern, and zeros elsewhere.
    run_ok(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read -P 0xab 8M 64k",
        "-c",
        "read -P 0 0 8M",
        &uri,
    ]));

    // Trimming the whole range turns it back into a hole.
    run_ok(Command::new("qemu-io").args(["-f", "raw", "-c", "discard 0 64M", &uri]));
    assert_eq!(map(&uri), vec![(0, 64 << 20, 3)]);

    // A BLOCK_STATUS answer covers at most 128 MiB: on a 1 GiB volume nbdinfo asks again
    // from where each answer ends and still finds data at 500 MiB and 900 MiB.
    server.create_volume("big", "1GiB");
    let big = server.uri("big");
    run_ok(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 1 500M 4k",
        "-c",
        "write -P 1 900M 1M",
        &big,
    ]));
    const MIB: u64 = 1 << 20;
    assert_eq!(
        map(&big),
        // Files: the data runs are what was written (the device files' own holes).
        vec![
            (0, 500 * MIB, 3),
            (500 * MIB, 4096, 0),
            (500 * MIB + 4096, 400 * MIB - 4096, 3),
            (900 * MIB, MIB, 0),
            (901 * MIB, 123 * MIB, 3),
        ]
    );
    server.stop();
}

#[test]
fn qemu_img_and_nbdcopy_round_trip_256mib() {
    if !have_tool("qemu-img") || !have_tool("nbdcopy") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    let image = dir.path().join("random.raw");
    random_file(&image, 256 << 20, 42);

    server.create_volume("viaqemu", "256MiB");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&image)
            .arg(server.uri("viaqemu")),
    );
    let back = dir.path().join("back-qemu.raw");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw", &server.uri("viaqemu")])
            .arg(&back),
    );
    let out = run_ok(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&image)
            .arg(&back),
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("identical"),
        "{}",
        text(&out)
    );
    std::fs::remove_file(&back).unwrap();

    server.create_volume("viacopy", "256MiB");
    run_ok(
        Command::new("nbdcopy")
            .arg(&image)
            .arg(server.uri("viacopy")),
    );
    let back = dir.path().join("back-copy.raw");
    run_ok(
        Command::new("nbdcopy")
            .arg(server.uri("viacopy"))
            .arg(&back),
    );
    let original = std::fs::read(&image).unwrap();
    let copied = std::fs::read(&back).unwrap();
    assert_eq!(original.len(), copied.len());
    assert!(original == copied, "nbdcopy round trip differs");
    server.stop();
}

fn fio_verify(server: &Server, export: &str, rw: &str) {
    common::fio_verify(&server.uri(export), rw);
}

#[test]
fn fio_randwrite_and_randrw_verify_over_two_connections() {
    if !have_tool("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"));
    server.create_volume("fio", "128MiB");
    fio_verify(&server, "fio", "randwrite");
    fio_verify(&server, "fio", "randrw");
    server.stop();
}

/// The default puts every connection on a thread of its own (`[server] net_threads`, one per
/// CPU); both other layouts keep the data intact: connections on the shared runtime (0), and
/// fio's two connections sharing one connection thread (1).
#[test]
fn fio_verify_with_connections_on_the_shared_runtime_and_on_one_thread() {
    if !have_tool("fio") {
        return;
    }
    for (threads, rw, logged, open_when_done) in [
        ("0", "randwrite", "connection threads: none", vec![]),
        ("1", "randrw", "connection threads: 1 ", vec![0]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let server = Server::start_with(&dir.path().join("data"), &["--net-threads", threads]);
        server.create_volume("fio", "128MiB");
        fio_verify(&server, "fio", rw);
        let log = server.log();
        assert!(log.contains(logged), "--net-threads {threads}: {log}");
        // Every connection fio opened is counted back when it closes (the server sees the
        // close after fio has exited: polled, with a deadline).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let mut response = common::agent()
                .get(format!("{}/v1/connections", server.api))
                .header("authorization", common::bearer())
                .call()
                .unwrap();
            let view: Value = response.body_mut().read_json().unwrap();
            let open: Vec<u64> = view["threads"]
                .as_array()
                .unwrap_or_else(|| panic!("no threads in {view}"))
                .iter()
                .map(|n| n.as_u64().unwrap())
                .collect();
            if open == open_when_done {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "--net-threads {threads}: open per thread {open:?} 10 s after fio ended"
            );
            std::thread::yield_now();
        }
        server.stop();
    }
}
