//! Many threads on one volume: private regions that share extents (so allocations race),
//! overlapping block writes checked for tearing, trims racing writes (pool accounting must
//! stay exact), and a delete while I/O is in flight.

// Helpers outside `#[test]` functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use headroom_store::{EXTENT_SIZE_BYTES, Store, StoreConfig, StoreError, Volume};

const E: u64 = EXTENT_SIZE_BYTES;
const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;

/// Small deterministic generator (xorshift64*), one per thread.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn stores() -> Vec<(Store, Option<tempfile::TempDir>)> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        device_count: 3,
        device_capacity_bytes: 32 * MIB,
        ..StoreConfig::new(dir.path())
    };
    vec![
        (Store::open_memory(96 * MIB).unwrap(), None),
        (Store::open(&cfg).unwrap(), Some(dir)),
    ]
}

#[test]
fn threads_with_private_regions_sharing_extents() {
    const THREADS: u64 = 6;
    // 1.5 extents per thread: neighbours share an extent, so they race to allocate it.
    const REGION: u64 = E + E / 2;
    for (store, _dir) in stores() {
        store.create_volume("v", THREADS * REGION).unwrap();
        let v = store.open_volume("v").unwrap();
        let models: Vec<Vec<u8>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let v = Arc::clone(&v);
                    s.spawn(move || region_worker(&v, t, t * REGION, REGION))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut all = vec![0u8; (THREADS * REGION) as usize];
        v.read_at(0, &mut all).unwrap();
        for (t, model) in models.iter().enumerate() {
            let start = t * REGION as usize;
            assert!(
                all[start..start + REGION as usize] == model[..],
                "region {t}"
            );
        }
        store.flush_all().unwrap();
        let pool = store.pool_info();
        assert_eq!(pool.allocated_extents * E, v.info().allocated_bytes);
        assert_eq!(pool.quarantined_extents, 0);
    }
}

/// Random writes, trims, zeroes and verifying reads inside `[base, base + len)`.
fn region_worker(v: &Volume, t: u64, base: u64, len: u64) -> Vec<u8> {
    let mut rng = Rng::new(t + 1);
    let mut model = vec![0u8; len as usize];
    let mut buf = vec![0u8; 64 * 1024];
    for i in 0..400 {
        let blocks = 1 + rng.below(16);
        let n = blocks * BLOCK;
        let off = rng.below((len - n) / BLOCK + 1) * BLOCK;
        let range = off as usize..(off + n) as usize;
        match rng.below(10) {
            0..=5 => {
                let byte = (t * 31 + i) as u8 | 1;
                buf[..n as usize].fill(byte);
                v.write_at(base + off, &buf[..n as usize], i % 50 == 0)
                    .unwrap();
                model[range].fill(byte);
            }
            6..=7 => {
                v.read_at(base + off, &mut buf[..n as usize]).unwrap();
                assert!(
                    buf[..n as usize] == model[range],
                    "thread {t} read at {off}"
                );
            }
            8 => {
                v.write_zeroes(base + off, n, rng.below(2) == 0, false)
                    .unwrap();
                model[range].fill(0);
            }
            _ => {
                // Large trims sometimes cover a whole extent inside this region.
                let big = rng.below(len / 2) / BLOCK * BLOCK;
                let off = rng.below((len - big) / BLOCK + 1) * BLOCK;
                v.trim(base + off, big, false).unwrap();
                model[off as usize..(off + big) as usize].fill(0);
                if i % 7 == 0 {
                    v.flush().unwrap();
                }
            }
        }
    }
    model
}

#[test]
fn overlapping_block_writes_never_tear() {
    let store = Store::open_memory(32 * MIB).unwrap();
    store.create_volume("v", 4 * E).unwrap();
    let v = store.open_volume("v").unwrap();
    let blocks = 4 * E / BLOCK;
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..4u64)
            .map(|t| {
                let v = Arc::clone(&v);
                s.spawn(move || {
                    let mut rng = Rng::new(100 + t);
                    let mut buf = vec![0u8; BLOCK as usize];
                    for seq in 0..3000u64 {
                        let stamp = (t << 32) | (seq + 1);
                        for w in buf.chunks_mut(8) {
                            w.copy_from_slice(&stamp.to_le_bytes());
                        }
                        let b = rng.below(blocks);
                        v.write_at(b * BLOCK, &buf, false).unwrap();
                    }
                })
            })
            .collect();
        let readers: Vec<_> = (0..2u64)
            .map(|t| {
                let v = Arc::clone(&v);
                let done = &done;
                s.spawn(move || {
                    let mut rng = Rng::new(200 + t);
                    let mut buf = vec![0u8; BLOCK as usize];
                    let mut reads = 0u64;
                    while !done.load(Ordering::Acquire) || reads < 100 {
                        v.read_at(rng.below(blocks) * BLOCK, &mut buf).unwrap();
                        let first = &buf[..8];
                        assert!(buf.chunks(8).all(|w| w == first), "torn block");
                        reads += 1;
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Release);
        for r in readers {
            r.join().unwrap();
        }
    });
    assert_eq!(v.info().allocated_bytes, 4 * E);
}

#[test]
fn trims_racing_writes_keep_pool_accounting_exact() {
    for (store, _dir) in stores() {
        store.create_volume("v", 8 * E).unwrap();
        let v = store.open_volume("v").unwrap();
        let total = store.pool_info().total_extents;
        std::thread::scope(|s| {
            for t in 0..3u64 {
                let v = Arc::clone(&v);
                s.spawn(move || {
                    let mut rng = Rng::new(300 + t);
                    for _ in 0..600 {
                        let e = rng.below(8);
                        match rng.below(4) {
                            0 => v.trim(e * E, E, false).unwrap(),
                            1 => v
                                .write_zeroes(e * E, (2 * E).min((8 - e) * E), true, false)
                                .unwrap(),
                            _ => v
                                .write_at(e * E + rng.below(E / BLOCK) * BLOCK, &[7u8; 4096], false)
                                .unwrap(),
                        }
                    }
                });
            }
        });
        v.flush().unwrap();
        let pool = store.pool_info();
        let mapped = (0..8).filter(|&i| v.extent_location(i).is_some()).count() as u64;
        assert_eq!(v.info().allocated_bytes, mapped * E);
        assert_eq!(pool.allocated_extents, mapped);
        assert_eq!(pool.quarantined_extents, 0);
        assert_eq!(pool.free_extents + mapped, total);
        // Every mapped extent is distinct.
        let mut locs: Vec<_> = (0..8)
            .filter_map(|i| v.extent_location(i))
            .map(|l| (l.device, l.offset_bytes))
            .collect();
        locs.sort_unstable();
        locs.dedup();
        assert_eq!(locs.len() as u64, mapped);
    }
}

#[test]
fn delete_while_io_in_flight() {
    for (store, _dir) in stores() {
        store.create_volume("v", 16 * E).unwrap();
        let total = store.pool_info().free_extents;
        let v = store.open_volume("v").unwrap();
        let started = std::sync::Barrier::new(4);
        std::thread::scope(|s| {
            for t in 0..3u64 {
                let v = Arc::clone(&v);
                let started = &started;
                s.spawn(move || {
                    let mut rng = Rng::new(400 + t);
                    for _ in 0..10 {
                        v.write_at(rng.below(16) * E, &[1u8; 4096], false).unwrap();
                    }
                    started.wait();
                    loop {
                        match v.write_at(rng.below(16) * E, &[1u8; 4096], false) {
                            Ok(()) => {}
                            Err(StoreError::VolumeDeleted(_)) => return,
                            Err(e) => panic!("{e}"),
                        }
                    }
                });
            }
            started.wait();
            store.delete_volume("v").unwrap();
        });
        let pool = store.pool_info();
        assert_eq!(pool.free_extents, total);
        assert_eq!(pool.quarantined_extents + pool.allocated_extents, 0);
    }
}
