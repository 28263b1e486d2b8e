//! Replicated volumes (2 or 3 copies of every extent) on the real redb and device files:
//! placement on distinct devices and failure domains, every write on every copy (each copy
//! read directly), release of every copy, reopen, refusal when the pool cannot hold the
//! copies, and reads and writes that continue when a device holding a copy disappears.

// Helpers outside `#[test]` functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod common;

use common::pattern;
use headroom_store::{
    DeviceOp, EXTENT_SIZE_BYTES, FaultConfig, FaultRule, FaultScope, NewVolume, RebuildStep,
    ScrubReport, Store, StoreConfig, StoreError, Volume, VolumeHealth,
};
use tempfile::TempDir;

const E: u64 = EXTENT_SIZE_BYTES;
const MIB: u64 = 1 << 20;

fn config(dir: &TempDir, devices: u32) -> StoreConfig {
    StoreConfig {
        device_count: devices,
        device_capacity_bytes: 32 * MIB, // 16 extents each
        ..StoreConfig::new(dir.path())
    }
}

fn replicated(store: &Store, name: &str, size_bytes: u64, replicas: u8) -> std::sync::Arc<Volume> {
    let info = store
        .create_volume_with(
            name,
            size_bytes,
            NewVolume {
                replicas,
                ..NewVolume::default()
            },
        )
        .unwrap();
    assert_eq!(info.replicas, replicas);
    store.open_volume(name).unwrap()
}

fn replica_bytes(v: &Volume, replica: u8, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xEEu8; len];
    v.read_replica_at(replica, offset, &mut buf).unwrap();
    buf
}

fn read_vec(v: &Volume, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xEEu8; len];
    v.read_at(offset, &mut buf).unwrap();
    buf
}

/// Devices holding the copies of logical extent `extent`, replica order.
fn copy_devices(v: &Volume, extent: u64) -> Vec<u32> {
    (0..v.replicas())
        .filter_map(|r| v.replica_location(r, extent).map(|l| l.device))
        .collect()
}

/// Writes at (offset, len): within an extent, across a boundary, whole extents.
const WRITES: [(u64, usize); 4] = [
    (4096, 8192),
    (E - 512, 4096),
    (2 * E, 2 * E as usize),
    (5 * E + 7 * 512, 512),
];

#[test]
fn every_write_reaches_every_copy_on_distinct_devices() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&config(&dir, 3)).unwrap();
    for replicas in [2u8, 3] {
        let name = format!("r{replicas}");
        let v = replicated(&store, &name, 16 * MIB, replicas);
        for (i, &(off, len)) in WRITES.iter().enumerate() {
            v.write_at(off, &pattern(i as u64, len), false).unwrap();
        }
        // Zeroing in place (NO_HOLE) and a FUA write reach every copy too.
        v.write_zeroes(4096, 1024, false, false).unwrap();
        v.write_at(6 * E, &pattern(77, 4096), true).unwrap();
        let whole = read_vec(&v, 0, (8 * E) as usize);
        for extent in [0, 1, 2, 3, 5, 6] {
            let mut devices = copy_devices(&v, extent);
            assert_eq!(devices.len(), usize::from(replicas), "extent {extent}");
            devices.sort_unstable();
            devices.dedup();
            assert_eq!(
                devices.len(),
                usize::from(replicas),
                "copies share a device"
            );
        }
        for r in 0..replicas {
            assert_eq!(
                replica_bytes(&v, r, 0, (8 * E) as usize),
                whole,
                "replica {r} of {name}"
            );
        }
        assert_eq!(&whole[4096..5120], &[0u8; 1024][..]);
        assert_eq!(&whole[5120..12288], &pattern(0, 8192)[1024..]);
        // Pool space counts every copy.
        assert_eq!(v.info().allocated_bytes, 6 * E * u64::from(replicas));
        v.flush().unwrap();
        assert!(v.replica_location(replicas - 1, 6).unwrap().committed);
    }
    let one = store.create_volume("one", 4 * MIB).unwrap();
    assert_eq!(one.replicas, 1);
    let one = store.open_volume("one").unwrap();
    assert!(matches!(
        one.read_replica_at(1, 0, &mut [0u8; 512]),
        Err(StoreError::NotFound(_))
    ));
}

#[test]
fn too_many_replicas_for_the_pool_are_refused() {
    let store = Store::open_memory(64 * MIB).unwrap(); // two devices
    for replicas in [3u8, 4] {
        let err = store
            .create_volume_with(
                "v",
                4 * MIB,
                NewVolume {
                    replicas,
                    ..NewVolume::default()
                },
            )
            .unwrap_err();
        assert!(
            matches!(err, StoreError::InvalidReplicas { replicas: r, .. } if r == replicas),
            "{err}"
        );
        assert!(err.to_string().contains("replicas"), "{err}");
    }
    assert!(store.list_volumes().is_empty());
    let v = replicated(&store, "v", 4 * MIB, 2);
    // The overcommit limit counts every copy: 2 x 4 MiB of 64 MiB at ratio 1.0 leaves 56 MiB.
    assert_eq!(store.provisioned_bytes(), 8 * MIB);
    store.set_overcommit_ratio(Some(1.0));
    let too_big = NewVolume {
        replicas: 2,
        ..NewVolume::default()
    };
    assert!(matches!(
        store.create_volume_with("big", 30 * MIB, too_big),
        Err(StoreError::Overcommitted { .. })
    ));
    assert!(matches!(
        store.resize_volume("v", 34 * MIB),
        Err(StoreError::Overcommitted { .. })
    ));
    store.resize_volume("v", 28 * MIB).unwrap();
    v.write_at(0, &pattern(1, 4096), false).unwrap();
    assert_eq!(replica_bytes(&v, 1, 0, 4096), pattern(1, 4096));
}

#[test]
fn a_full_device_fails_a_replicated_write_with_no_space_and_takes_nothing() {
    // Devices of 3 and 1 extents for volumes (each has one more, reserved for its signature):
    // the second extent of a 2-replica volume has no second device.
    let dir = tempfile::tempdir().unwrap();
    let dev0 = dir.path().join("d0.img");
    let dev1 = dir.path().join("d1.img");
    std::fs::write(&dev0, []).unwrap();
    std::fs::write(&dev1, []).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&dev0)
        .unwrap()
        .set_len(4 * E)
        .unwrap();
    std::fs::File::options()
        .write(true)
        .open(&dev1)
        .unwrap()
        .set_len(2 * E)
        .unwrap();
    let cfg = StoreConfig {
        device_paths: vec![dev0, dev1],
        ..StoreConfig::new(dir.path().join("data"))
    };
    let store = Store::open(&cfg).unwrap();
    let v = replicated(&store, "v", 8 * MIB, 2);
    v.write_at(0, &pattern(1, 4096), false).unwrap();
    let free = store.pool_info().free_extents;
    assert_eq!(free, 2);
    assert!(matches!(
        v.write_at(E, &pattern(2, 4096), false),
        Err(StoreError::NoSpace)
    ));
    assert_eq!(
        store.pool_info().free_extents,
        free,
        "a lone copy was taken"
    );
}

#[test]
fn trim_zeroes_shrink_and_delete_free_every_copy() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&config(&dir, 3)).unwrap();
    let total = store.pool_info().free_extents;
    let v = replicated(&store, "v", 16 * MIB, 3);
    v.write_at(0, &pattern(1, (6 * E) as usize), false).unwrap();
    v.flush().unwrap();
    assert_eq!(store.pool_info().free_extents, total - 18);
    // A partial trim punches every copy; a whole-extent trim releases every copy.
    v.trim(100 * 512, 4096, false).unwrap();
    v.trim(E, E, false).unwrap();
    // Releasing WRITE_ZEROES of a whole extent too.
    v.write_zeroes(2 * E, E, true, false).unwrap();
    v.flush().unwrap();
    assert_eq!(store.pool_info().free_extents, total - 12);
    for r in 0..3 {
        assert!(v.replica_location(r, 1).is_none() && v.replica_location(r, 2).is_none());
        let got = replica_bytes(&v, r, 0, (3 * E) as usize);
        assert!(got[100 * 512..100 * 512 + 4096].iter().all(|&b| b == 0));
        assert!(got[E as usize..].iter().all(|&b| b == 0));
        assert_eq!(&got[..100 * 512], &pattern(1, 100 * 512)[..]);
    }
    // Shrink into extent 3: extents 4 and 5 go, the tail of 3 is punched on every copy.
    store.resize_volume("v", 3 * E + 4096).unwrap();
    assert_eq!(store.pool_info().free_extents, total - 6);
    store.resize_volume("v", 4 * E).unwrap();
    for r in 0..3 {
        let got = replica_bytes(&v, r, 3 * E, E as usize);
        assert_eq!(
            &got[..4096],
            &pattern(1, (4 * E) as usize)[(3 * E) as usize..][..4096]
        );
        assert!(got[4096..].iter().all(|&b| b == 0), "replica {r}");
    }
    store.delete_volume("v").unwrap();
    assert_eq!(store.pool_info().free_extents, total);
}

#[test]
fn reopen_keeps_every_copy_and_the_failure_domains() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, 1);
    let (locations, data) = {
        let store = Store::open(&cfg).unwrap();
        // Device 0 declares no domain (its own), devices 1 and 2 share rack "a": every
        // extent of a 2-replica volume keeps one copy on device 0.
        for _ in 0..2 {
            let d = store
                .add_device_in_domain(None, 32 * MIB, Some("a".into()))
                .unwrap();
            assert_eq!(d.failure_domain.as_deref(), Some("a"));
        }
        assert!(
            store
                .add_device_in_domain(None, 32 * MIB, Some(" ".into()))
                .is_err()
        );
        let v = replicated(&store, "v", 32 * MIB, 2);
        let data = pattern(5, (8 * E) as usize);
        v.write_at(0, &data, false).unwrap();
        v.flush().unwrap();
        let mut locations = Vec::new();
        for extent in 0..8 {
            let devices = copy_devices(&v, extent);
            assert_eq!(
                devices.iter().filter(|&&d| d == 0).count(),
                1,
                "extent {extent}: {devices:?}"
            );
            locations.push((v.replica_location(0, extent), v.replica_location(1, extent)));
        }
        (locations, data)
    };
    let store = Store::open(&cfg).unwrap();
    let domains: Vec<Option<String>> = store
        .pool_info()
        .devices
        .into_iter()
        .map(|d| d.failure_domain)
        .collect();
    assert_eq!(domains, vec![None, Some("a".into()), Some("a".into())]);
    let v = store.open_volume("v").unwrap();
    assert_eq!(v.info().replicas, 2);
    for (extent, loc) in locations.iter().enumerate() {
        let extent = extent as u64;
        assert_eq!(
            &(v.replica_location(0, extent), v.replica_location(1, extent)),
            loc
        );
    }
    for r in 0..2 {
        assert_eq!(replica_bytes(&v, r, 0, data.len()), data);
    }
    // Deleting after the reopen frees both copies.
    let before = store.pool_info().free_extents;
    store.delete_volume("v").unwrap();
    assert_eq!(store.pool_info().free_extents, before + 16);
}

#[test]
fn reads_and_writes_continue_when_a_device_with_copies_disappears() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&config(&dir, 3)).unwrap();
    let v = replicated(&store, "v", 16 * MIB, 2);
    let single = store.create_volume("single", 4 * MIB).unwrap();
    assert_eq!(single.replicas, 1);
    let data = pattern(9, (6 * E) as usize);
    v.write_at(0, &data, false).unwrap();
    v.flush().unwrap();
    // The device that holds replica 0 of extent 0 disappears.
    let gone = v.replica_location(0, 0).unwrap().device;
    let mut rule = FaultRule::new(FaultScope::Device(gone));
    rule.disappear_after_ops = Some(0);
    store
        .inject_faults(&FaultConfig {
            seed: 1,
            rules: vec![rule],
        })
        .unwrap();
    // Every byte still reads, from the surviving copies.
    assert_eq!(read_vec(&v, 0, data.len()), data);
    // Writes go on to the surviving copy; new extents avoid the failed device.
    let more = pattern(10, (2 * E) as usize);
    v.write_at(E / 2, &more, false).unwrap();
    v.write_at(7 * E, &more[..4096], true).unwrap();
    assert!(
        copy_devices(&v, 7).iter().all(|&d| d != gone),
        "a new extent went to the failed device"
    );
    let mut expected = data.clone();
    expected[(E / 2) as usize..(E / 2) as usize + more.len()].copy_from_slice(&more);
    assert_eq!(read_vec(&v, 0, expected.len()), expected);
    // FLUSH succeeds: every extent keeps a copy on a healthy device.
    v.flush().unwrap();
    assert_eq!(v.info().health, VolumeHealth::Degraded);
    assert_eq!(
        store.volume_info("single").unwrap().health,
        VolumeHealth::Healthy
    );
    assert!(store.pool_info().devices[gone as usize].failed);
    // Creating a 3-replica volume needs three healthy devices: refused now.
    assert!(matches!(
        store.create_volume_with(
            "three",
            4 * MIB,
            NewVolume {
                replicas: 3,
                ..NewVolume::default()
            }
        ),
        Err(StoreError::InvalidReplicas { .. })
    ));
}

#[test]
fn an_operator_failed_device_stays_failed_and_replicated_volumes_go_on_degraded() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, 3);
    let data = pattern(21, (4 * E) as usize);
    let failed = {
        let store = Store::open(&cfg).unwrap();
        let v = replicated(&store, "v", 16 * MIB, 2);
        v.write_at(0, &data, false).unwrap();
        v.flush().unwrap();
        assert_eq!(v.info().health, VolumeHealth::Healthy);
        assert!(matches!(
            store.fail_device(9),
            Err(StoreError::DeviceNotFound(9))
        ));
        let failed = v.replica_location(0, 0).unwrap().device;
        let info = store.fail_device(failed).unwrap();
        assert!(info.failed);
        // Again: nothing changes.
        assert!(store.fail_device(failed).unwrap().failed);
        assert_eq!(v.info().health, VolumeHealth::Degraded);
        assert_eq!(read_vec(&v, 0, data.len()), data);
        // Writes skip the failed copy; new extents avoid the device; FLUSH and FUA succeed.
        v.write_at(E + 4096, &pattern(22, 4096), true).unwrap();
        v.write_at(5 * E, &pattern(23, 4096), false).unwrap();
        assert!(copy_devices(&v, 5).iter().all(|&d| d != failed));
        v.flush().unwrap();
        store.flush_all().unwrap();
        failed
    };
    let store = Store::open(&cfg).unwrap();
    assert!(store.pool_info().devices[failed as usize].failed);
    let v = store.open_volume("v").unwrap();
    assert_eq!(v.info().health, VolumeHealth::Degraded);
    let mut expected = data.clone();
    expected[(E + 4096) as usize..(E + 8192) as usize].copy_from_slice(&pattern(22, 4096));
    assert_eq!(read_vec(&v, 0, data.len()), expected);
    assert_eq!(read_vec(&v, 5 * E, 4096), pattern(23, 4096));
    // Only two healthy devices are left: 3 replicas are refused, 2 are fine.
    let three = NewVolume {
        replicas: 3,
        ..NewVolume::default()
    };
    assert!(matches!(
        store.create_volume_with("three", 4 * MIB, three),
        Err(StoreError::InvalidReplicas { .. })
    ));
    replicated(&store, "two", 4 * MIB, 2);
}

#[test]
fn overlapping_concurrent_writes_leave_the_copies_equal() {
    // Threads rewrite the same blocks with their own patterns at once: NBD leaves open which
    // write wins, but every copy must hold the same winner (without the copy locks, dozens
    // of the 128 blocks differ here).
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&config(&dir, 2)).unwrap();
    let v = replicated(&store, "v", 4 * MIB, 2);
    v.write_at(0, &pattern(0, (2 * E) as usize), false).unwrap();
    // Stall some writes to the device of extent 0's second copy, so that a writer often waits
    // between its two copies while another one overtakes it.
    let mut rule = FaultRule::new(FaultScope::Device(v.replica_location(1, 0).unwrap().device));
    rule.latency_spike_permille = 300;
    rule.latency_spike_ms = 2;
    store
        .inject_faults(&FaultConfig {
            seed: 7,
            rules: vec![rule],
        })
        .unwrap();
    let threads: Vec<_> = (0..6u64)
        .map(|t| {
            let v = std::sync::Arc::clone(&v);
            std::thread::spawn(move || {
                let block = pattern(100 + t, 256 * 1024);
                for i in 0..100u64 {
                    // Writes inside extent 0 and across the boundary into extent 1.
                    let offset = (i * 7 % 8) * 4096 + if i % 3 == 0 { E - 128 * 1024 } else { 0 };
                    v.write_at(offset, &block, false).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let a = replica_bytes(&v, 0, 0, (2 * E) as usize);
    let b = replica_bytes(&v, 1, 0, (2 * E) as usize);
    let differing = a
        .chunks(4096)
        .zip(b.chunks(4096))
        .filter(|(x, y)| x != y)
        .count();
    assert_eq!(differing, 0, "blocks that differ between the copies");
}

/// Syncs each device has done (`DeviceOp::Sync`, the last of `DeviceOp::ALL`).
fn syncs(store: &Store) -> Vec<u64> {
    store
        .device_stats()
        .iter()
        .map(|d| d.ops[DeviceOp::ALL.len() - 1].ops)
        .collect()
}

#[test]
fn fua_and_flush_sync_the_device_of_every_copy() {
    assert!(matches!(
        DeviceOp::ALL[DeviceOp::ALL.len() - 1],
        DeviceOp::Sync
    ));
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&config(&dir, 3)).unwrap();
    let v = replicated(&store, "v", 4 * MIB, 2);
    v.write_at(0, &pattern(1, 4096), false).unwrap();
    v.flush().unwrap();
    let copies = copy_devices(&v, 0);
    let other = (0..3).find(|d| !copies.contains(d)).unwrap() as usize;
    // A FUA write into the committed extent syncs both copies' devices, not the third.
    let before = syncs(&store);
    v.write_at(8192, &pattern(2, 4096), true).unwrap();
    let after = syncs(&store);
    for &d in &copies {
        assert!(
            after[d as usize] > before[d as usize],
            "device {d}: {before:?} -> {after:?}"
        );
    }
    assert_eq!(after[other], before[other]);
    // A FLUSH after a plain write syncs both too.
    v.write_at(16384, &pattern(3, 4096), false).unwrap();
    let before = syncs(&store);
    v.flush().unwrap();
    let after = syncs(&store);
    for &d in &copies {
        assert!(
            after[d as usize] > before[d as usize],
            "device {d}: {before:?} -> {after:?}"
        );
    }
    for r in 0..2 {
        assert_eq!(replica_bytes(&v, r, 16384, 4096), pattern(3, 4096));
    }
}

/// Rebuilds every lost copy of `v` (what the node's rebuild task does, unpaced).
fn rebuild_all(v: &Volume) -> u64 {
    let mut bytes = 0;
    for extent in v.extents_to_rebuild() {
        match v.rebuild_extent(extent).unwrap() {
            RebuildStep::Rebuilt { bytes: b } => bytes += b,
            RebuildStep::Complete => {}
            other => panic!("extent {extent}: {other:?}"),
        }
    }
    bytes
}

#[test]
fn a_rebuild_under_concurrent_writes_restores_equal_copies_on_healthy_devices() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, 3);
    let extents = 8u64;
    let failed;
    let expected;
    {
        let store = Store::open(&cfg).unwrap();
        let v = replicated(&store, "v", extents * E, 2);
        let base = pattern(31, (extents * E) as usize);
        v.write_at(0, &base, false).unwrap();
        v.flush().unwrap();
        failed = v.replica_location(1, 0).unwrap().device;
        store.fail_device(failed).unwrap();
        let todo = v.extents_to_rebuild();
        assert!(!todo.is_empty(), "no extent had a copy on device {failed}");
        assert_eq!(v.info().health, VolumeHealth::Degraded);
        v.set_rebuilding(true);
        assert_eq!(v.info().health, VolumeHealth::Rebuilding);
        // A writer overwrites 4 KiB blocks all over the volume while the rebuild runs; it
        // keeps the model of what the volume must read afterwards.
        let stop = std::sync::atomic::AtomicBool::new(false);
        let model = std::thread::scope(|s| {
            let writer = s.spawn(|| {
                let mut model = base.clone();
                let mut i = 0u64;
                let blocks = extents * E / 4096;
                // At least 200 writes, and on until the rebuild is done.
                while i < 200 || !stop.load(std::sync::atomic::Ordering::Acquire) {
                    let block = (i * 7919) % blocks;
                    let data = pattern(1000 + i, 4096);
                    v.write_at(block * 4096, &data, false).unwrap();
                    let at = (block * 4096) as usize;
                    model[at..at + 4096].copy_from_slice(&data);
                    i += 1;
                }
                model
            });
            let bytes = rebuild_all(&v);
            assert_eq!(bytes, todo.len() as u64 * E);
            stop.store(true, std::sync::atomic::Ordering::Release);
            writer.join().unwrap()
        });
        v.set_rebuilding(false);
        assert!(v.extents_to_rebuild().is_empty());
        assert_eq!(v.info().health, VolumeHealth::Healthy);
        for extent in 0..extents {
            let devices = copy_devices(&v, extent);
            assert_eq!(devices.len(), 2);
            assert!(
                !devices.contains(&failed),
                "extent {extent} still on {failed}"
            );
            assert_ne!(
                devices[0], devices[1],
                "extent {extent}: both copies on one device"
            );
        }
        let len = (extents * E) as usize;
        assert!(
            replica_bytes(&v, 0, 0, len) == model,
            "replica 0 differs from the model"
        );
        assert!(
            replica_bytes(&v, 1, 0, len) == model,
            "replica 1 differs from the model"
        );
        let report = v.scrub().unwrap();
        assert_eq!(report.extents_checked, extents);
        assert_eq!(report.mismatches, 0);
        v.flush().unwrap();
        expected = model;
    }
    // The swapped map entries are durable.
    let store = Store::open(&cfg).unwrap();
    let v = store.open_volume("v").unwrap();
    assert_eq!(v.info().health, VolumeHealth::Healthy);
    assert!(v.extents_to_rebuild().is_empty());
    let len = expected.len();
    assert!(replica_bytes(&v, 0, 0, len) == expected);
    assert!(replica_bytes(&v, 1, 0, len) == expected);
}

#[test]
fn a_rebuild_without_a_free_healthy_device_leaves_the_volume_degraded() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&config(&dir, 2)).unwrap();
    let v = replicated(&store, "v", 4 * E, 2);
    v.write_at(0, &pattern(41, E as usize), false).unwrap();
    v.flush().unwrap();
    store.fail_device(1).unwrap();
    assert_eq!(v.extents_to_rebuild(), vec![0]);
    assert_eq!(v.rebuild_extent(0).unwrap(), RebuildStep::NoPlacement);
    assert_eq!(v.info().health, VolumeHealth::Degraded);
    assert_eq!(read_vec(&v, 0, E as usize), pattern(41, E as usize));
}

/// Overwrites `data` at byte `offset` of replica `replica` of logical extent `extent` in its
/// device file, behind the store's back (a silent corruption).
fn corrupt_copy(dir: &TempDir, v: &Volume, replica: u8, extent: u64, offset: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let loc = v.replica_location(replica, extent).unwrap();
    let path = dir.path().join(format!("devices/dev-{}.img", loc.device));
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, loc.offset_bytes + offset).unwrap();
}

#[test]
fn a_scrub_repairs_corrupted_blocks_from_a_copy_that_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&config(&dir, 3)).unwrap();
    let v = replicated(&store, "three", 4 * E, 3);
    let data = pattern(51, (2 * E) as usize);
    v.write_at(0, &data, false).unwrap();
    v.flush().unwrap();
    assert_eq!(v.scrub().unwrap().mismatches, 0);
    // Two blocks of replica 2 and one of replica 0 go bad.
    corrupt_copy(&dir, &v, 2, 0, 4096, &[0xAB; 512]);
    corrupt_copy(&dir, &v, 2, 1, 700 * 1024, &[0xCD; 4096]);
    corrupt_copy(&dir, &v, 0, 1, 0, &[0xEF; 100]);
    // A read of the bad copy alone is refused (checksum), never the corrupted bytes.
    let mut buf = vec![0u8; 512];
    assert!(matches!(
        v.read_replica_at(2, 4096, &mut buf),
        Err(StoreError::Io(_))
    ));
    let report = v.scrub().unwrap();
    assert_eq!(report.extents_checked, 2);
    assert_eq!(report.blocks_verified, 2 * 3 * 512);
    assert_eq!(report.checksum_mismatches, 3);
    assert_eq!(report.checksum_repaired, 3);
    assert_eq!(report.unrepairable, 0);
    // Repaired before the comparison: the copies agree.
    assert_eq!(report.mismatches, 0);
    for r in 0..3 {
        assert!(
            replica_bytes(&v, r, 0, data.len()) == data,
            "replica {r} not repaired"
        );
    }
    assert_eq!(
        v.scrub().unwrap(),
        ScrubReport {
            extents_checked: 2,
            blocks_verified: 2 * 3 * 512,
            ..ScrubReport::default()
        }
    );

    // Two copies: the checksum says which one is right, so this repairs too (without
    // checksums two disagreeing copies had no majority).
    let two = replicated(&store, "two", 4 * E, 2);
    two.write_at(0, &data[..E as usize], false).unwrap();
    two.flush().unwrap();
    corrupt_copy(&dir, &two, 1, 0, 8192, &[0x11; 4096]);
    let report = two.scrub().unwrap();
    assert_eq!(
        report,
        ScrubReport {
            extents_checked: 1,
            blocks_verified: 2 * 512,
            checksum_mismatches: 1,
            checksum_repaired: 1,
            ..ScrubReport::default()
        }
    );
    assert!(replica_bytes(&two, 1, 0, E as usize) == data[..E as usize]);
    let errors: u64 = store.device_stats().iter().map(|d| d.checksum_errors).sum();
    // The refused read of replica 2, the three blocks of the first scrub, the one of the second.
    assert_eq!(errors, 5);
}
