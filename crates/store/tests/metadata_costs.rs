//! What the metadata's safety costs, measured by hand (ignored in CI: they take tens of
//! seconds and print numbers rather than assert them):
//!
//! `cargo test --release -p headroom-store --test metadata_costs -- --ignored --nocapture`
//!
//! - `open_cost_of_the_integrity_check`: redb's open of a `meta.redb` with 100,000 extent
//!   rows with and without `set_check_integrity_on_open`, and `Store::open` (which checks
//!   both files).
//! - `flush_latency_with_and_without_the_copy`: 1,000 cycles of a 4 KiB write into a new
//!   extent and a FLUSH (each commits one extent allocation), `metadata_copy` off and on.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use headroom_store::{EXTENT_SIZE_BYTES, Store, StoreConfig};

const GIB: u64 = 1 << 30;

fn stats(mut d: Vec<Duration>) -> String {
    d.sort();
    let us = |x: Duration| x.as_secs_f64() * 1e6;
    let mean = d.iter().map(|x| us(*x)).sum::<f64>() / d.len() as f64;
    format!(
        "mean {mean:.0} us, p50 {:.0} us, p99 {:.0} us",
        us(d[d.len() / 2]),
        us(d[d.len() * 99 / 100])
    )
}

#[test]
#[ignore = "a measurement: run by hand with --ignored --nocapture"]
fn open_cost_of_the_integrity_check() {
    const ROWS: u64 = 100_000;
    let tmp = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        device_count: 2,
        device_capacity_bytes: 128 * GIB,
        metadata_reserve_bytes: 0,
        ..StoreConfig::new(tmp.path())
    };
    {
        let store = Store::open(&cfg).unwrap();
        store
            .create_volume("big", ROWS * EXTENT_SIZE_BYTES)
            .unwrap();
        let v = store.open_volume("big").unwrap();
        let block = [0x5Au8; 512];
        for e in 0..ROWS {
            v.write_at(e * EXTENT_SIZE_BYTES, &block, false).unwrap();
            if e % 10_000 == 9_999 {
                v.flush().unwrap();
            }
        }
        v.flush().unwrap();
    }
    let meta = tmp.path().join("meta.redb");
    let len = std::fs::metadata(&meta).unwrap().len();
    for check in [false, true, false, true] {
        let t = Instant::now();
        let db = redb::Builder::new()
            .set_check_integrity_on_open(check)
            .create(&meta)
            .unwrap();
        let took = t.elapsed();
        drop(db);
        println!(
            "redb open of {len} bytes ({ROWS} extent rows), integrity check {check}: {took:?}"
        );
    }
    for _ in 0..2 {
        let t = Instant::now();
        let store = Store::open(&cfg).unwrap();
        println!(
            "Store::open (both files checked, rows rebuilt): {:?}",
            t.elapsed()
        );
        drop(store);
    }
}

#[test]
#[ignore = "a measurement: run by hand with --ignored --nocapture"]
fn flush_latency_with_and_without_the_copy() {
    const CYCLES: u64 = 1_000;
    for copy in [false, true, false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = StoreConfig {
            device_count: 1,
            device_capacity_bytes: 4 * GIB,
            metadata_reserve_bytes: 0,
            metadata_copy: copy,
            ..StoreConfig::new(tmp.path())
        };
        let store = Store::open(&cfg).unwrap();
        store
            .create_volume("v", CYCLES * EXTENT_SIZE_BYTES)
            .unwrap();
        let v = store.open_volume("v").unwrap();
        let block = [0xA5u8; 4096];
        let mut flushes = Vec::new();
        for e in 0..CYCLES {
            v.write_at(e * EXTENT_SIZE_BYTES, &block, false).unwrap();
            let t = Instant::now();
            v.flush().unwrap();
            flushes.push(t.elapsed());
        }
        println!(
            "metadata_copy {copy}: {CYCLES} write+FLUSH cycles (one new extent each): FLUSH {}",
            stats(flushes)
        );
    }
}
