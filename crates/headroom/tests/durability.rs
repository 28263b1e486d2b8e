//! End-to-end durability: volumes and data survive a clean restart, and every block covered by
//! an acknowledged FLUSH survives `kill -9` — including writes made on another connection
//! (NBD_FLAG_CAN_MULTI_CONN promises a FLUSH covers every connection's completed writes).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::process::Command;

use common::raw::Client;
use common::{Server, have_tool, run_ok, text};
use headroom_nbd::consts::NBD_CMD_FLAG_FUA;
use serde_json::Value;

/// Deterministic block content for (seed, block index).
fn pattern(seed: u64, index: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ index.wrapping_add(1);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Offsets spread over many 2 MiB extents (so the allocations themselves must be durable).
fn offsets(count: u64, stride: u64) -> Vec<u64> {
    (0..count).map(|i| i * stride + (i % 7) * 4096).collect()
}

#[test]
fn volumes_and_data_survive_a_clean_restart() {
    if !have_tool("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let server = Server::start(&data_dir);
    server.create_volume("keep", "32MiB");
    server.create_volume("gone", "16MiB");
    run_ok(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x3c 1M 3M",
        &server.uri("keep"),
    ]));
    let out = server.cli(&["volume", "delete", "gone"]);
    assert!(out.status.success(), "{}", text(&out));
    server.stop();

    let server = Server::start(&data_dir);
    let out = server.cli(&["volume", "list", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let volumes: Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = volumes
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["keep"]);
    assert_eq!(volumes[0]["size_bytes"].as_u64(), Some(32 << 20));
    run_ok(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read -P 0x3c 1M 3M",
        "-c",
        "read -P 0 0 1M",
        &server.uri("keep"),
    ]));
    server.stop();
}

#[test]
fn flushed_blocks_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let server = Server::start(&data_dir);
    server.create_volume("crash", "256MiB");

    const BLOCK: usize = 64 << 10;
    let flushed = offsets(60, 4 << 20);
    let mut writer = Client::open(server.nbd, "crash");
    let mut other = Client::open(server.nbd, "crash");
    for (i, &offset) in flushed.iter().enumerate() {
        // Half the blocks go through a second connection; the FLUSH is sent on the first.
        let client = if i % 2 == 0 { &mut writer } else { &mut other };
        assert_eq!(
            client.write(i as u64, offset, &pattern(1, i as u64, BLOCK), 0),
            0
        );
    }
    // One FUA write is durable on its own, without the flush.
    let fua_offset = 250 << 20;
    assert_eq!(
        other.write(999, fua_offset, &pattern(2, 0, BLOCK), NBD_CMD_FLAG_FUA),
        0
    );
    assert_eq!(writer.flush(1000), 0);
    // Unflushed writes after the flush may or may not survive; they must not corrupt others.
    for i in 0..8u64 {
        assert_eq!(
            writer.write(2000 + i, (i * 4 + 1) << 20, &pattern(3, i, BLOCK), 0),
            0
        );
    }
    server.kill9();

    let server = Server::start(&data_dir);
    let mut reader = Client::open(server.nbd, "crash");
    assert_eq!(reader.size_bytes, 256 << 20);
    for (i, &offset) in flushed.iter().enumerate() {
        let data = reader
            .read(i as u64, offset, BLOCK as u32)
            .expect("read back");
        assert!(
            data == pattern(1, i as u64, BLOCK),
            "flushed block {i} at {offset} lost after kill -9"
        );
    }
    let data = reader
        .read(5000, fua_offset, BLOCK as u32)
        .expect("read FUA block");
    assert!(data == pattern(2, 0, BLOCK), "FUA block lost after kill -9");
    reader.disconnect();
    server.stop();
}

#[test]
fn explicit_devices_back_the_pool_and_keep_data_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let devices: Vec<_> = (0..2)
        .map(|i| dir.path().join(format!("disk{i}.img")))
        .collect();
    for device in &devices {
        let file = std::fs::File::create(device).unwrap();
        file.set_len(64 << 20).unwrap();
    }
    let args: Vec<String> = devices
        .iter()
        .flat_map(|d| ["--device".to_string(), d.display().to_string()])
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let data_dir = dir.path().join("data");
    let server = Server::start_with(&data_dir, &args);
    server.create_volume("ondisk", "96MiB");
    let mut client = Client::open(server.nbd, "ondisk");
    // 48 extents of 2 MiB: more than one 64 MiB device holds, so both are used.
    for i in 0..48u64 {
        assert_eq!(client.write(i, i << 21, &pattern(9, i, 4096), 0), 0);
    }
    assert_eq!(client.flush(100), 0);
    client.disconnect();
    let out = server.cli(&["volume", "create", "toobig", "--size", "64MiB"]);
    assert!(out.status.success(), "{}", text(&out));
    let mut filler = Client::open(server.nbd, "toobig");
    // The pool (128 MiB, 62 extents for volumes: each device's first is reserved for its
    // signature) has 28 MiB left: the 15th new extent finds no space.
    let mut errors = Vec::new();
    for i in 0..15u64 {
        errors.push(filler.write(i, i << 21, &[1u8; 512], 0));
    }
    assert!(errors[..14].iter().all(|&e| e == 0), "{errors:?}");
    assert_eq!(errors[14], headroom_nbd::consts::NBD_ENOSPC);
    filler.disconnect();
    server.stop();
    for device in &devices {
        assert!(std::fs::metadata(device).unwrap().len() >= 64 << 20);
    }

    let server = Server::start_with(&data_dir, &args);
    let mut reader = Client::open(server.nbd, "ondisk");
    for i in 0..48u64 {
        let data = reader.read(i, i << 21, 4096).unwrap();
        assert!(data == pattern(9, i, 4096), "extent {i} lost");
    }
    reader.disconnect();
    server.stop();
}
