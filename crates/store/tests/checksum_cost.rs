//! What per-block checksums cost, measured by hand (ignored in CI: it takes tens of seconds
//! and prints numbers rather than asserting them):
//!
//! `cargo test -p headroom-store --test checksum_cost -- --ignored --nocapture`
//!
//! 4 KiB random reads and writes on a 1-device file pool on tmpfs (`/dev/shm`: no disk
//! latency, so the CPU of the I/O path is all there is), checksums on and off in the same run
//! (`StoreConfig::checksums`, store-internal), alternating rounds. CPU per I/O is the calling
//! thread's on-CPU time (`/proc/thread-self/schedstat`) over the operations.

#![allow(clippy::unwrap_used)]

use std::time::Instant;

use headroom_store::sim_disk::SimRng;
use headroom_store::{Store, StoreConfig};

const MIB: u64 = 1 << 20;
const VOLUME_BYTES: u64 = 256 * MIB;
const READS: u64 = 200_000;
const WRITES: u64 = 100_000;
const ROUNDS: usize = 3;

/// On-CPU nanoseconds of the calling thread.
fn thread_cpu_ns() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    s.split_whitespace().next().unwrap().parse().unwrap()
}

/// (read CPU ns/op, read wall ns/op, write CPU ns/op, write wall ns/op).
fn measure(checksums: bool, seed: u64) -> [f64; 4] {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let store = Store::open(&StoreConfig {
        device_count: 1,
        device_capacity_bytes: VOLUME_BYTES + 64 * MIB,
        checksums,
        ..StoreConfig::new(dir.path())
    })
    .unwrap();
    assert_eq!(store.pool_info().devices[0].checksums, checksums);
    store.create_volume("v", VOLUME_BYTES).unwrap();
    let v = store.open_volume("v").unwrap();
    let chunk = vec![0x5au8; MIB as usize];
    for off in (0..VOLUME_BYTES).step_by(MIB as usize) {
        v.write_at(off, &chunk, false).unwrap();
    }
    v.flush().unwrap();
    let blocks = VOLUME_BYTES / 4096;
    let mut rng = SimRng::new(seed);
    let mut buf = vec![0u8; 4096];
    let (cpu, wall) = (thread_cpu_ns(), Instant::now());
    for _ in 0..READS {
        v.read_at(rng.below(blocks) * 4096, &mut buf).unwrap();
    }
    let read_cpu = (thread_cpu_ns() - cpu) as f64 / READS as f64;
    let read_wall = wall.elapsed().as_nanos() as f64 / READS as f64;
    let data = vec![0xa5u8; 4096];
    let (cpu, wall) = (thread_cpu_ns(), Instant::now());
    for _ in 0..WRITES {
        v.write_at(rng.below(blocks) * 4096, &data, false).unwrap();
    }
    let write_cpu = (thread_cpu_ns() - cpu) as f64 / WRITES as f64;
    let write_wall = wall.elapsed().as_nanos() as f64 / WRITES as f64;
    [read_cpu, read_wall, write_cpu, write_wall]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
#[ignore = "a measurement: run by hand with --ignored --nocapture"]
fn cpu_per_4k_io_with_and_without_checksums() {
    let mut on = Vec::new();
    let mut off = Vec::new();
    for round in 0..ROUNDS {
        let a = measure(false, round as u64);
        let b = measure(true, round as u64);
        eprintln!(
            "round {round}: read CPU {:.0} / {:.0} ns, write CPU {:.0} / {:.0} ns (off / on)",
            a[0], b[0], a[2], b[2]
        );
        off.push(a);
        on.push(b);
    }
    let names = ["read CPU", "read wall", "write CPU", "write wall"];
    for (i, name) in names.iter().enumerate() {
        let m_off = median(off.iter().map(|r| r[i]).collect());
        let m_on = median(on.iter().map(|r| r[i]).collect());
        eprintln!(
            "4 KiB random {name} per I/O: checksums off {m_off:.0} ns, on {m_on:.0} ns ({:.2}x)",
            m_on / m_off
        );
    }
}
