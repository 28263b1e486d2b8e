//! Whether one volume's syncs and zeroing slow another volume's reads inside the store, with
//! no scheduler, network or client in between (ignored in CI: it takes tens of seconds and
//! prints numbers rather than asserting them):
//!
//! `cargo test -p headroom-store --test sync_interference -- --ignored --nocapture`
//!
//! A 2-device file pool in a temporary directory on disk (`/var/tmp`, not tmpfs: the syncs
//! must reach a device). The victim reads 4 KiB at random offsets of a volume it filled (so
//! the page cache serves it); next to it a thread loops one neighbour on a volume of its own:
//! a write and a FLUSH, a FUA write, a NO_HOLE WRITE_ZEROES of 256 MiB, a TRIM of 256 MiB.
//! Printed: the victim's p50, p99 and worst read latency per neighbour, checksums on and off,
//! and the neighbour thread's CPU per operation (what the scheduler should charge it).

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use headroom_store::sim_disk::SimRng;
use headroom_store::{Store, StoreConfig, Volume};

const MIB: u64 = 1 << 20;
const VICTIM_BYTES: u64 = 256 * MIB;
const NOISY_BYTES: u64 = 4096 * MIB;
const RUN: Duration = Duration::from_secs(3);

#[derive(Clone, Copy, Debug)]
enum Neighbour {
    Alone,
    WriteFlush,
    FuaWrite,
    ZeroNoHole,
    Trim,
}

/// On-CPU nanoseconds of the calling thread (the system calls' kernel time included).
fn thread_cpu_ns() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    s.split_whitespace().next().unwrap().parse().unwrap()
}

/// Loops `kind` until `stop`; returns the thread's CPU ns per operation.
fn noisy_loop(v: &Volume, kind: Neighbour, stop: &AtomicBool, done: &AtomicU64) -> u64 {
    let cpu = thread_cpu_ns();
    let mut rng = SimRng::new(7);
    let data = vec![0x3cu8; 4096];
    let big = 256 * MIB;
    while !stop.load(Ordering::Relaxed) {
        match kind {
            Neighbour::Alone => return 0,
            Neighbour::WriteFlush => {
                v.write_at(rng.below(NOISY_BYTES / 4096) * 4096, &data, false)
                    .unwrap();
                v.flush().unwrap();
            }
            Neighbour::FuaWrite => {
                v.write_at(rng.below(NOISY_BYTES / 4096) * 4096, &data, true)
                    .unwrap();
            }
            Neighbour::ZeroNoHole => {
                let off = rng.below(NOISY_BYTES / big) * big;
                v.write_zeroes(off, big, false, false).unwrap();
            }
            Neighbour::Trim => {
                let off = rng.below(NOISY_BYTES / big) * big;
                v.trim(off, big, false).unwrap();
            }
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    (thread_cpu_ns() - cpu) / done.load(Ordering::Relaxed).max(1)
}

fn run(kind: Neighbour, checksums: bool) {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let store = Store::open(&StoreConfig {
        device_count: 2,
        device_capacity_bytes: 4 * 1024 * MIB,
        checksums,
        ..StoreConfig::new(dir.path())
    })
    .unwrap();
    store.create_volume("victim", VICTIM_BYTES).unwrap();
    store.create_volume("noisy", NOISY_BYTES).unwrap();
    let victim = store.open_volume("victim").unwrap();
    let noisy = Arc::new(store.open_volume("noisy").unwrap());
    let chunk = vec![0x5au8; MIB as usize];
    for off in (0..VICTIM_BYTES).step_by(MIB as usize) {
        victim.write_at(off, &chunk, false).unwrap();
    }
    victim.flush().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let t = {
        let (noisy, stop, done) = (noisy.clone(), stop.clone(), done.clone());
        std::thread::spawn(move || noisy_loop(&noisy, kind, &stop, &done))
    };
    let mut rng = SimRng::new(11);
    let mut buf = vec![0u8; 4096];
    let mut lat_ns = Vec::new();
    let start = Instant::now();
    while start.elapsed() < RUN {
        let t0 = Instant::now();
        victim
            .read_at(rng.below(VICTIM_BYTES / 4096) * 4096, &mut buf)
            .unwrap();
        lat_ns.push(t0.elapsed().as_nanos() as u64);
        // QD1 at a modest rate, as fio's victim: a read every 100 µs.
        while t0.elapsed() < Duration::from_micros(100) {
            std::hint::spin_loop();
        }
    }
    stop.store(true, Ordering::Relaxed);
    let cpu_per_op_ns = t.join().unwrap();
    lat_ns.sort_unstable();
    let q = |p: f64| lat_ns[((lat_ns.len() - 1) as f64 * p) as usize] as f64 / 1000.0;
    eprintln!(
        "{kind:<12?} checksums {checksums:<5}  reads {:>6}  p50 {:>8.1} us  p99 {:>8.1} us  max {:>9.1} us  neighbour ops {} ({:.1} us CPU each)",
        lat_ns.len(),
        q(0.5),
        q(0.99),
        q(1.0),
        done.load(Ordering::Relaxed),
        cpu_per_op_ns as f64 / 1000.0
    );
}

#[test]
#[ignore = "a measurement: run by hand with --ignored --nocapture"]
fn a_neighbours_syncs_and_zeroing_against_a_readers_latency() {
    for checksums in [true, false] {
        for kind in [
            Neighbour::Alone,
            Neighbour::WriteFlush,
            Neighbour::FuaWrite,
            Neighbour::ZeroNoHole,
            Neighbour::Trim,
        ] {
            run(kind, checksums);
        }
    }
}

/// On-CPU and wall nanoseconds of `f` on the calling thread.
fn cpu_and_wall<T>(f: impl FnOnce() -> T) -> (T, u64, u64) {
    let (cpu, t0) = (thread_cpu_ns(), Instant::now());
    let out = f();
    (out, thread_cpu_ns() - cpu, t0.elapsed().as_nanos() as u64)
}

/// Where a WRITE 4 KiB + FLUSH's time and CPU go, by what the FLUSH has to make durable:
/// writes that allocate an extent each (the FLUSH commits the metadata), writes into
/// extents allocated and written a moment ago (nothing in the metadata changed), and writes
/// into allocated extents quiet for longer than the write-intent bits' clear delay is not
/// covered here (5 s). Run under `strace -f -T -y` to split the FLUSH into its syscalls.
fn breakdown(checksums: bool, ops: u64) {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let store = Store::open(&StoreConfig {
        device_count: 2,
        device_capacity_bytes: 4 * 1024 * MIB,
        checksums,
        ..StoreConfig::new(dir.path())
    })
    .unwrap();
    store.create_volume("noisy", NOISY_BYTES).unwrap();
    let v = store.open_volume("noisy").unwrap();
    let data = vec![0x3cu8; 4096];
    let extent = 2 * MIB;
    let report = |label: &str, offsets: &mut dyn Iterator<Item = u64>| {
        let (mut wc, mut ww, mut fc, mut fw) = (0, 0, 0, 0);
        let mut n = 0;
        for off in offsets {
            let ((), c, w) = cpu_and_wall(|| v.write_at(off, &data, false).unwrap());
            wc += c;
            ww += w;
            let ((), c, w) = cpu_and_wall(|| v.flush().unwrap());
            fc += c;
            fw += w;
            n += 1;
        }
        eprintln!(
            "checksums {checksums:<5} {label:<34} n {n:>5}  write {:>6.1} us CPU {:>7.1} us wall  flush {:>6.1} us CPU {:>7.1} us wall",
            wc as f64 / n as f64 / 1000.0,
            ww as f64 / n as f64 / 1000.0,
            fc as f64 / n as f64 / 1000.0,
            fw as f64 / n as f64 / 1000.0,
        );
    };
    // Every write in a new extent: each FLUSH commits an allocation.
    report(
        "allocating (new extent each)",
        &mut (0..ops).map(|i| i * extent),
    );
    // The same extents again, at other blocks: allocated, bits still set.
    let mut rng = SimRng::new(3);
    report(
        "into allocated extents",
        &mut (0..ops).map(|_| rng.below(ops) * extent + rng.below(extent / 4096) * 4096),
    );
}

#[test]
#[ignore = "a measurement: run by hand with --ignored --nocapture"]
fn a_write_and_flush_by_what_the_flush_makes_durable() {
    let ops = std::env::var("HEADROOM_BREAKDOWN_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    for checksums in [true, false] {
        breakdown(checksums, ops);
    }
}
