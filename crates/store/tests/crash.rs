//! Crash durability: a child process writes, flushes, writes more without flushing, trims
//! without flushing, and is killed with SIGKILL. The parent reopens the store and checks that
//! every flushed (or FUA) block survived, that allocations never made durable are gone, and
//! that their data can never surface in another volume (the startup punch).
//!
//! A second pair does the same to a 2-replica volume with writers running at the kill, and
//! checks that after the reopen every flushed block is intact on every replica and that the
//! replicas are equal (the resync of an unclean start), also after the parent damaged one
//! copy the way a write that reached only the other copy would.
//!
//! The child is this test binary re-executed with `--ignored --exact crash_child` and an env
//! variable naming the data directory; it reports progress on stdout.

// Helpers outside `#[test]` functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod common;

use common::pattern;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};

use headroom_store::{EXTENT_SIZE_BYTES, NewVolume, Store, StoreConfig, StoreError, Volume};

const E: u64 = EXTENT_SIZE_BYTES;
const MIB: u64 = 1 << 20;
const CHILD_ENV: &str = "HEADROOM_STORE_CRASH_CHILD_DIR";

/// Writes made before the flush: (offset, length), some crossing extent boundaries.
const FLUSHED: [(u64, usize); 4] = [
    (0, 4096),
    (E - 1000, 5000),
    (3 * E + 12345, 1 << 20),
    (4 * E + 100, 700),
];
/// A FUA write into a fresh extent, after the flush and with no flush after it.
const FUA_OFFSET: u64 = 7 * E + 8192;
/// Extents of `a` first written after the flush (never flushed).
const UNFLUSHED: std::ops::Range<u64> = 10..16;

fn config(dir: &Path) -> StoreConfig {
    StoreConfig {
        device_count: 2,
        device_capacity_bytes: 24 * MIB, // 12 extents each
        ..StoreConfig::new(dir)
    }
}

fn read_vec(v: &Volume, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xEEu8; len];
    v.read_at(offset, &mut buf).unwrap();
    buf
}

#[test]
#[ignore = "child process of kill9_keeps_flushed_data_and_never_leaks_unflushed_allocations"]
fn crash_child() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let store = Store::open(&config(Path::new(&dir))).unwrap();
    store.create_volume("a", 64 * MIB).unwrap();
    store.create_volume("q", 16 * MIB).unwrap();
    let a = store.open_volume("a").unwrap();
    let q = store.open_volume("q").unwrap();
    for (i, &(off, len)) in FLUSHED.iter().enumerate() {
        a.write_at(off, &pattern(i as u64, len), false).unwrap();
    }
    q.write_at(0, &pattern(50, (4 * E) as usize), false)
        .unwrap();
    a.flush().unwrap();
    a.write_at(FUA_OFFSET, &pattern(100, 4096), true).unwrap();
    // Not flushed from here on.
    q.trim(0, 2 * E, false).unwrap();
    println!("MARK flushed");
    for i in UNFLUSHED {
        a.write_at(i * E, &pattern(200 + i, E as usize), false)
            .unwrap();
    }
    a.write_at(0, &pattern(999, 4096), false).unwrap();
    println!("MARK ready");
    loop {
        std::thread::park();
    }
}

#[test]
fn kill9_keeps_flushed_data_and_never_leaks_unflushed_allocations() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "crash_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut marks = Vec::new();
    for line in stdout.lines() {
        let line = line.unwrap();
        if line.contains("MARK flushed") {
            marks.push("flushed");
        }
        if line.contains("MARK ready") {
            marks.push("ready");
            break;
        }
    }
    assert_eq!(
        marks,
        vec!["flushed", "ready"],
        "child did not reach the crash point"
    );
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(9));

    let store = Store::open(&config(dir.path())).unwrap();
    let a = store.open_volume("a").unwrap();
    let q = store.open_volume("q").unwrap();

    // Every flushed block, and the FUA block, survived (block 0 may hold either version).
    let block0 = read_vec(&a, 0, 4096);
    assert!(block0 == pattern(0, 4096) || block0 == pattern(999, 4096));
    for (i, &(off, len)) in FLUSHED.iter().enumerate().skip(1) {
        assert_eq!(
            read_vec(&a, off, len),
            pattern(i as u64, len),
            "flushed write {i}"
        );
    }
    assert_eq!(read_vec(&a, FUA_OFFSET, 4096), pattern(100, 4096));
    assert!(a.extent_location(FUA_OFFSET / E).unwrap().committed);

    // Allocations never committed are gone: holes that read zero.
    for i in UNFLUSHED {
        assert!(
            a.extent_location(i).is_none(),
            "extent {i} should not be mapped"
        );
        assert!(read_vec(&a, i * E, E as usize).iter().all(|&b| b == 0));
    }

    // The unflushed trim may or may not have happened; each block is old data or zeros.
    let q_data = pattern(50, (4 * E) as usize);
    let q_now = read_vec(&q, 0, (4 * E) as usize);
    for (now, old) in q_now.chunks(4096).zip(q_data.chunks(4096)) {
        assert!(now == old || now.iter().all(|&b| b == 0));
    }
    assert_eq!(&q_now[(2 * E) as usize..], &q_data[(2 * E) as usize..]);

    // Fill every free extent of the pool with a new volume that writes only 512 bytes per
    // extent: the rest of each extent must read zero, although the physical extents of the
    // unflushed allocations held data before the crash.
    let free = store.pool_info().free_extents;
    assert!(free >= (UNFLUSHED.end - UNFLUSHED.start), "free {free}");
    store.create_volume("b", 48 * MIB).unwrap();
    let b = store.open_volume("b").unwrap();
    let mut allocated = 0;
    for i in 0..24 {
        match b.write_at(i * E, &pattern(300 + i, 512), false) {
            Ok(()) => allocated += 1,
            Err(StoreError::NoSpace) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(allocated, free);
    assert_eq!(store.pool_info().free_extents, 0);
    for i in 0..allocated {
        let got = read_vec(&b, i * E, E as usize);
        assert_eq!(&got[..512], &pattern(300 + i, 512)[..]);
        assert!(
            got[512..].iter().all(|&x| x == 0),
            "extent {i} of b leaks old data"
        );
    }
}

/// The replicated child: extents `0..FLUSHED_EXTENTS` written and flushed, then writers
/// rewriting 4 KiB blocks of the extents after them until the kill.
const FLUSHED_EXTENTS: u64 = 2;
const HOT_EXTENTS: u64 = 4;
const BLOCK: usize = 4096;
const REPLICATED_CHILD_ENV: &str = "HEADROOM_STORE_CRASH_REPLICATED_DIR";

/// A block of generation `generation`: its index and generation, then a pattern of both.
fn versioned_block(block: u64, generation: u64) -> Vec<u8> {
    let mut b = pattern(block * 1_000_003 + generation, BLOCK);
    b[..8].copy_from_slice(&block.to_le_bytes());
    b[8..16].copy_from_slice(&generation.to_le_bytes());
    b
}

/// Whether `data` is block `block` of some generation (or was never written: zeros).
fn is_some_version(block: u64, data: &[u8]) -> bool {
    if data.iter().all(|&b| b == 0) {
        return true;
    }
    let index = u64::from_le_bytes(data[..8].try_into().unwrap());
    let generation = u64::from_le_bytes(data[8..16].try_into().unwrap());
    index == block && data == versioned_block(block, generation).as_slice()
}

fn replicated_config(dir: &Path) -> StoreConfig {
    StoreConfig {
        device_count: 2,
        device_capacity_bytes: 16 * MIB,
        ..StoreConfig::new(dir)
    }
}

#[test]
#[ignore = "child process of kill9_mid_writes_leaves_replicas_equal_with_flushed_data_intact"]
fn crash_child_replicated() {
    let Ok(dir) = std::env::var(REPLICATED_CHILD_ENV) else {
        return;
    };
    let store = Store::open(&replicated_config(Path::new(&dir))).unwrap();
    let options = NewVolume {
        replicas: 2,
        ..NewVolume::default()
    };
    store
        .create_volume_with("r", (FLUSHED_EXTENTS + HOT_EXTENTS) * E, options)
        .unwrap();
    let r = store.open_volume("r").unwrap();
    r.write_at(0, &pattern(1, (FLUSHED_EXTENTS * E) as usize), false)
        .unwrap();
    // Every hot extent allocated (and committed) before the writers start.
    for i in FLUSHED_EXTENTS..FLUSHED_EXTENTS + HOT_EXTENTS {
        r.write_at(i * E, &versioned_block(i * E / BLOCK as u64, 0), false)
            .unwrap();
    }
    r.flush().unwrap();
    let loc = r.replica_location(1, FLUSHED_EXTENTS).unwrap();
    println!("LOC {} {}", loc.device, loc.offset_bytes);
    let blocks = HOT_EXTENTS * E / BLOCK as u64;
    let first = FLUSHED_EXTENTS * E / BLOCK as u64;
    for t in 0..2u64 {
        let r = std::sync::Arc::clone(&r);
        std::thread::spawn(move || {
            let mut x = 0x1234_5678_u64 + t;
            for generation in 1.. {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let block = first + x % blocks;
                r.write_at(
                    block * BLOCK as u64,
                    &versioned_block(block, generation),
                    false,
                )
                .unwrap();
            }
        });
    }
    // Let the writers run a little, then report; they keep writing until the kill.
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(300);
    while std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    println!("MARK ready");
    loop {
        std::thread::park();
    }
}

#[test]
fn kill9_mid_writes_leaves_replicas_equal_with_flushed_data_intact() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "crash_child_replicated",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(REPLICATED_CHILD_ENV, dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut loc = None;
    let mut ready = false;
    for line in stdout.lines() {
        let line = line.unwrap();
        // (libtest may print the test's name on the same line first.)
        if let Some((_, rest)) = line.split_once("LOC ") {
            let (d, off) = rest.split_once(' ').unwrap();
            loc = Some((d.parse::<u32>().unwrap(), off.parse::<u64>().unwrap()));
        }
        if line.contains("MARK ready") {
            ready = true;
            break;
        }
    }
    assert!(ready, "child did not reach the crash point");
    child.kill().unwrap(); // SIGKILL, writers running
    assert_eq!(child.wait().unwrap().signal(), Some(9));

    // Make replica 1 of the first hot extent disagree, as a write that reached replica 0
    // and not replica 1 would leave it.
    let (device, offset) = loc.unwrap();
    let path = dir.path().join(format!("devices/dev-{device}.img"));
    let file = std::fs::File::options().write(true).open(&path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &[0xA5; BLOCK], offset + 3 * BLOCK as u64)
        .unwrap();
    drop(file);

    let store = Store::open(&replicated_config(dir.path())).unwrap();
    let r = store.open_volume("r").unwrap();
    assert_eq!(r.replicas(), 2);
    let size = ((FLUSHED_EXTENTS + HOT_EXTENTS) * E) as usize;
    let mut copies = Vec::new();
    for replica in 0..2 {
        let mut buf = vec![0xEE; size];
        r.read_replica_at(replica, 0, &mut buf).unwrap();
        copies.push(buf);
    }
    let flushed = (FLUSHED_EXTENTS * E) as usize;
    for (replica, copy) in copies.iter().enumerate() {
        assert!(
            copy[..flushed] == pattern(1, flushed)[..],
            "flushed data of replica {replica} damaged"
        );
    }
    let differing = copies[0]
        .chunks(BLOCK)
        .zip(copies[1].chunks(BLOCK))
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(differing, 0, "replicas disagree after recovery");
    for (i, block) in copies[0][flushed..].chunks(BLOCK).enumerate() {
        let index = (flushed / BLOCK + i) as u64;
        assert!(is_some_version(index, block), "block {index} is torn");
    }
    assert_eq!(read_vec(&r, 0, size), copies[0]);
}
