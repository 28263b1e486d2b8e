//! The fault-injecting layer through the store's API, on RAM and on device files: volume
//! rules touch only their volume; device rules act on the device whichever volume uses it;
//! a failed or vanished device fails the FLUSH of the volumes with data on it and no other,
//! new extents avoid it, ENOSPC from a device is `NoSpace`, and the pool reopens afterwards.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use headroom_store::{
    EXTENT_SIZE_BYTES, FaultConfig, FaultRule, FaultScope, Store, StoreConfig, StoreError, Volume,
};

const E: u64 = EXTENT_SIZE_BYTES;
const MIB: u64 = 1 << 20;
const BLOCK: usize = 4096;

fn block(volume: u8, index: u64, version: u8) -> Vec<u8> {
    let mut b = vec![version; BLOCK];
    b[0] = volume;
    b[1..9].copy_from_slice(&index.to_le_bytes());
    b
}

fn rule(scope: FaultScope, f: impl FnOnce(&mut FaultRule)) -> FaultRule {
    let mut r = FaultRule::new(scope);
    f(&mut r);
    r
}

fn install(store: &Store, seed: u64, rules: Vec<FaultRule>) {
    store.inject_faults(&FaultConfig { seed, rules }).unwrap();
}

fn is_io(r: &Result<(), StoreError>) -> bool {
    matches!(r, Err(StoreError::Io(_)))
}

/// Two one-extent volumes: `a` on device 0, `b` on device 1 (placement: most free space,
/// then the lowest id), each with its first block written and flushed.
fn two_volumes_on_two_devices(store: &Store) -> (Arc<Volume>, Arc<Volume>) {
    store.create_volume("a", E).unwrap();
    store.create_volume("b", E).unwrap();
    let a = store.open_volume("a").unwrap();
    let b = store.open_volume("b").unwrap();
    a.write_at(0, &block(1, 0, 1), false).unwrap();
    b.write_at(0, &block(2, 0, 1), false).unwrap();
    a.flush().unwrap();
    assert_eq!(a.extent_location(0).unwrap().device, 0);
    assert_eq!(b.extent_location(0).unwrap().device, 1);
    (a, b)
}

#[test]
fn volume_rules_fail_only_their_volume_and_failed_writes_change_nothing() {
    let store = Store::open_memory(64 * MIB).unwrap();
    store.create_volume("faulty", 8 * MIB).unwrap();
    store.create_volume("healthy", 8 * MIB).unwrap();
    install(
        &store,
        11,
        vec![rule(FaultScope::Volume("faulty".into()), |r| {
            r.eio_read_permille = 200;
            r.eio_write_permille = 100;
            r.enospc_write_permille = 100;
        })],
    );
    let faulty = store.open_volume("faulty").unwrap();
    let healthy = store.open_volume("healthy").unwrap();
    let blocks = 8 * MIB / BLOCK as u64;
    let mut acked = Vec::new();
    let (mut eio, mut enospc) = (0, 0);
    for i in 0..blocks {
        let off = i * BLOCK as u64;
        healthy.write_at(off, &block(2, i, 1), false).unwrap();
        match faulty.write_at(off, &block(1, i, 1), false) {
            Ok(()) => acked.push(true),
            Err(StoreError::Io(e)) => {
                assert!(e.to_string().contains("injected fault"), "{e}");
                eio += 1;
                acked.push(false);
            }
            Err(StoreError::NoSpace) => {
                enospc += 1;
                acked.push(false);
            }
            Err(other) => panic!("unexpected {other}"),
        }
    }
    // 2,048 writes at 100 ‰ each: 205 ± 14 (σ).
    assert!((130..=280).contains(&eio), "{eio}");
    assert!((130..=280).contains(&enospc), "{enospc}");
    let mut read_eio = 0;
    let mut buf = vec![0u8; BLOCK];
    for i in 0..blocks {
        let off = i * BLOCK as u64;
        healthy.read_at(off, &mut buf).unwrap();
        assert_eq!(buf, block(2, i, 1));
        // A failed read is retried: each attempt draws anew.
        loop {
            match faulty.read_at(off, &mut buf) {
                Ok(()) => break,
                Err(StoreError::Io(_)) => read_eio += 1,
                Err(other) => panic!("unexpected {other}"),
            }
        }
        let expected = if acked[i as usize] {
            block(1, i, 1)
        } else {
            vec![0u8; BLOCK]
        };
        assert_eq!(buf, expected, "block {i}: acked {}", acked[i as usize]);
    }
    assert!(read_eio > 300, "{read_eio}");
    healthy.flush().unwrap();
    faulty.flush().unwrap(); // no sync faults in this rule
}

#[test]
fn a_volume_that_disappears_fails_every_later_request_and_only_its_own() {
    let store = Store::open_memory(64 * MIB).unwrap();
    store.create_volume("gone", 4 * MIB).unwrap();
    store.create_volume("fine", 4 * MIB).unwrap();
    install(
        &store,
        1,
        vec![rule(FaultScope::Volume("gone".into()), |r| {
            r.disappear_after_ops = Some(3)
        })],
    );
    let gone = store.open_volume("gone").unwrap();
    let fine = store.open_volume("fine").unwrap();
    let mut buf = vec![0u8; BLOCK];
    gone.write_at(0, &block(1, 0, 1), false).unwrap();
    gone.read_at(0, &mut buf).unwrap();
    gone.flush().unwrap();
    assert!(is_io(&gone.read_at(0, &mut buf)));
    assert!(is_io(&gone.read_at(3 * MIB, &mut buf)), "holes too");
    assert!(is_io(&gone.write_at(0, &buf, false)));
    assert!(is_io(&gone.flush()));
    assert!(is_io(&gone.trim(0, E, false)));
    assert!(is_io(&gone.write_zeroes(0, 4096, true, false)));
    assert!(is_io(&gone.cache(0, 4096)));
    assert!(matches!(gone.block_status(0, E), Err(StoreError::Io(_))));
    for i in 0..100 {
        fine.write_at(i * 4096, &block(2, i, 1), i % 2 == 0)
            .unwrap();
    }
    fine.flush().unwrap();
    fine.read_at(99 * 4096, &mut buf).unwrap();
    assert_eq!(buf, block(2, 99, 1));
    // Requests that fail anyway keep their own error.
    assert!(matches!(
        gone.read_at(4 * MIB, &mut buf),
        Err(StoreError::OutOfRange { .. })
    ));
    store.flush_all().unwrap();
}

#[test]
fn a_device_that_disappears_fails_its_extents_and_spares_the_rest_of_the_pool() {
    let store = Store::open_memory(64 * MIB).unwrap();
    let (a, b) = two_volumes_on_two_devices(&store);
    install(
        &store,
        1,
        vec![rule(FaultScope::Device(0), |r| {
            r.disappear_after_ops = Some(0)
        })],
    );
    let mut buf = vec![0u8; BLOCK];
    let err = a.read_at(0, &mut buf).unwrap_err().to_string();
    assert!(err.contains("ENODEV") && err.contains("memory:0"), "{err}");
    assert!(is_io(&a.write_at(4096, &buf, false)));
    assert!(is_io(&a.flush()), "a has data on the failed device");
    // b lives on device 1: reads, writes, FUA, FLUSH all work.
    b.read_at(0, &mut buf).unwrap();
    assert_eq!(buf, block(2, 0, 1));
    b.write_at(4096, &block(2, 1, 1), true).unwrap();
    b.flush().unwrap();
    // New extents avoid the failed device, for every volume.
    store.create_volume("c", 8 * MIB).unwrap();
    let c = store.open_volume("c").unwrap();
    for i in 0..4 {
        c.write_at(i * E, &block(3, i, 1), false).unwrap();
        assert_eq!(c.extent_location(i).unwrap().device, 1);
    }
    c.flush().unwrap();
    let pool = store.pool_info();
    assert!(pool.devices[0].failed && !pool.devices[1].failed);
    // Management goes on; a shutdown flush cannot promise a's data.
    store.resize_volume("b", 2 * E).unwrap();
    store.delete_volume("c").unwrap();
    let err = store.flush_all().unwrap_err().to_string();
    assert!(err.contains("memory:0"), "{err}");
    assert!(is_io(&a.flush()));
    b.flush().unwrap();
}

#[test]
fn a_device_sync_fault_is_sticky_and_fails_only_volumes_with_data_there() {
    let store = Store::open_memory(64 * MIB).unwrap();
    let (a, b) = two_volumes_on_two_devices(&store);
    install(
        &store,
        1,
        vec![rule(FaultScope::Device(0), |r| r.eio_sync_permille = 1000)],
    );
    // Nothing dirty on device 0: no sync, no fault.
    a.flush().unwrap();
    a.write_at(4096, &block(1, 1, 1), false).unwrap();
    b.write_at(4096, &block(2, 1, 1), false).unwrap();
    assert!(is_io(&a.flush()));
    b.flush().unwrap();
    // fsyncgate: once failed, every later FLUSH of a fails, with nothing new written.
    assert!(is_io(&a.flush()));
    assert!(is_io(&a.write_at(8192, &block(1, 2, 1), true)), "FUA");
    // The device still reads.
    let mut buf = vec![0u8; BLOCK];
    a.read_at(4096, &mut buf).unwrap();
    assert_eq!(buf, block(1, 1, 1));
    b.write_at(8192, &block(2, 2, 1), true).unwrap();
    b.flush().unwrap();
}

#[test]
fn a_full_device_is_no_space_and_still_reads() {
    let store = Store::open_memory(64 * MIB).unwrap();
    let (a, b) = two_volumes_on_two_devices(&store);
    install(
        &store,
        1,
        vec![rule(FaultScope::Device(0), |r| {
            r.enospc_after_bytes = Some(16 * BLOCK as u64)
        })],
    );
    for i in 0..16 {
        a.write_at(i * 4096, &block(1, i, 2), false).unwrap();
    }
    assert!(matches!(
        a.write_at(16 * 4096, &block(1, 16, 2), false),
        Err(StoreError::NoSpace)
    ));
    assert!(matches!(
        a.write_zeroes(0, 4096, false, false),
        Err(StoreError::NoSpace)
    ));
    let mut buf = vec![0u8; BLOCK];
    a.read_at(15 * 4096, &mut buf).unwrap();
    assert_eq!(buf, block(1, 15, 2));
    a.flush().unwrap();
    b.write_at(16 * 4096, &block(2, 16, 1), false).unwrap();
}

#[test]
fn the_same_seed_gives_the_same_outcomes_through_the_store() {
    let run = |seed: u64| -> Vec<u8> {
        let store = Store::open_memory(16 * MIB).unwrap();
        store.create_volume("v", 4 * MIB).unwrap();
        install(
            &store,
            seed,
            vec![
                rule(FaultScope::Volume("v".into()), |r| {
                    r.eio_read_permille = 150;
                    r.eio_write_permille = 150;
                    r.eio_sync_permille = 150;
                }),
                rule(FaultScope::Device(0), |r| r.eio_read_permille = 100),
            ],
        );
        let v = store.open_volume("v").unwrap();
        let mut buf = vec![0u8; BLOCK];
        let mut out = Vec::new();
        for i in 0..400u64 {
            let off = (i % 1024) * 4096;
            let r = match i % 3 {
                0 => v.write_at(off, &block(1, i, 1), false),
                1 => v.read_at(off, &mut buf),
                _ => v.flush(),
            };
            out.push(match r {
                Ok(()) => b'.',
                Err(StoreError::Io(_)) => b'E',
                Err(_) => b'?',
            });
        }
        out
    };
    let first = run(5);
    assert_eq!(first, run(5));
    assert_ne!(first, run(6));
    assert!(first.contains(&b'E') && first.contains(&b'.'));
}

#[test]
fn bad_rules_and_a_second_installation_are_refused() {
    let store = Store::open_memory(16 * MIB).unwrap();
    let err = store
        .inject_faults(&FaultConfig {
            seed: 0,
            rules: vec![rule(FaultScope::Device(2), |r| r.eio_read_permille = 1)],
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("rule[0].device = 2"), "{err}");
    let err = store
        .inject_faults(&FaultConfig {
            seed: 0,
            rules: vec![rule(FaultScope::Device(0), |r| r.eio_read_permille = 2000)],
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("rule[0].eio_read_permille = 2000"), "{err}");
    install(&store, 0, Vec::new());
    assert!(store.inject_faults(&FaultConfig::default()).is_err());
}

#[test]
fn the_pool_reopens_after_a_device_failed_and_keeps_what_was_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        device_count: 2,
        device_capacity_bytes: 32 * MIB,
        ..StoreConfig::new(dir.path())
    };
    {
        let store = Store::open(&config).unwrap();
        let (a, b) = two_volumes_on_two_devices(&store);
        b.flush().unwrap();
        install(
            &store,
            1,
            vec![rule(FaultScope::Device(0), |r| r.eio_sync_permille = 1000)],
        );
        // a releases its extent on device 0: the punch lands, its sync fails.
        a.trim(0, E, false).unwrap();
        b.write_at(4096, &block(2, 1, 2), false).unwrap();
        b.flush().unwrap();
        let pool = store.pool_info();
        assert!(pool.devices[0].failed);
        // The free is committed, but the extent is not reused before a restart punches it.
        assert_eq!((pool.leaked_extents, pool.quarantined_extents), (1, 0));
        assert_eq!(pool.allocated_extents, 1);
        assert!(store.flush_all().is_err());
        drop((a, b));
    }
    // The device files are intact (the failure was injected), but a device whose sync failed
    // may have dropped acknowledged data: the commit that saw it recorded it failed, so the
    // restart keeps it out of service and serves what was committed.
    let store = Store::open(&config).unwrap();
    let pool = store.pool_info();
    assert!(pool.devices[0].failed, "a sync-failed device stays failed");
    assert!(!pool.devices[1].failed);
    let mut buf = vec![1u8; BLOCK];
    let a = store.open_volume("a").unwrap();
    a.read_at(0, &mut buf).unwrap();
    assert_eq!(buf, vec![0u8; BLOCK], "the trim was committed");
    let b = store.open_volume("b").unwrap();
    b.read_at(4096, &mut buf).unwrap();
    assert_eq!(buf, block(2, 1, 2));
    // Only the operator returns it to service (after its scrub). Nothing to reclaim: the
    // freed extent was free already, and the signature's reserved extent is not an orphan.
    let done = store.restore_device(0).unwrap();
    assert_eq!(done.extents_reclaimed, 0);
    let pool = store.pool_info();
    // 2 × 16 extents, less each device's reserved first extent and b's one extent.
    assert_eq!((pool.leaked_extents, pool.free_extents), (0, 29));
    a.write_at(4096, &block(1, 1, 3), true).unwrap();
    store.flush_all().unwrap();
    assert!(store.pool_info().devices.iter().all(|d| !d.failed));
}

/// A device whose sync fails stays failed across a restart: otherwise, after an unclean
/// stop, the replica resync took the copy on it (which missed every write since it failed)
/// as the source and copied it over the good copy, losing FLUSHed data of a replicated
/// volume. Found by the power-cut work (its first model counted replies after the cut).
#[test]
fn a_sync_failed_device_is_recorded_failed_and_its_stale_copy_never_wins_the_resync() {
    let dir = tempfile::tempdir().unwrap();
    let config = StoreConfig {
        device_count: 2,
        device_capacity_bytes: 32 * MIB,
        ..StoreConfig::new(dir.path())
    };
    let first;
    {
        let store = Store::open(&config).unwrap();
        store
            .create_volume_with(
                "r",
                E,
                headroom_store::NewVolume {
                    replicas: 2,
                    ..Default::default()
                },
            )
            .unwrap();
        let r = store.open_volume("r").unwrap();
        r.write_at(0, &block(3, 0, 1), false).unwrap();
        r.flush().unwrap();
        first = r.replica_location(0, 0).unwrap().device;
        // Replica 0's device starts failing its syncs: v2 reaches both copies, the FLUSH is
        // acknowledged from the other copy; v3 skips the failed copy.
        install(
            &store,
            1,
            vec![rule(FaultScope::Device(first), |r| {
                r.eio_sync_permille = 1000
            })],
        );
        r.write_at(0, &block(3, 0, 2), false).unwrap();
        r.flush().unwrap();
        assert!(store.pool_info().devices[first as usize].failed);
        r.write_at(0, &block(3, 0, 3), false).unwrap();
        r.flush().unwrap();
        // An unclean stop: the failed device makes the close unclean.
        drop(r);
    }
    let store = Store::open(&config).unwrap();
    assert!(store.pool_info().devices[first as usize].failed);
    let r = store.open_volume("r").unwrap();
    let mut buf = vec![0u8; BLOCK];
    r.read_at(0, &mut buf).unwrap();
    assert!(
        buf == block(3, 0, 3),
        "the FLUSHed version 3 must survive the restart; found version {}",
        buf[9]
    );
    let other = 1 - first as u8;
    let replica = (0..2u8)
        .find(|&i| r.replica_location(i, 0).unwrap().device == u32::from(other))
        .unwrap();
    r.read_replica_at(replica, 0, &mut buf).unwrap();
    assert!(
        buf == block(3, 0, 3),
        "the good copy was overwritten with version {}",
        buf[9]
    );
}

#[test]
fn a_device_gone_by_time_is_failed_before_anything_touches_it() {
    let store = Store::open_memory(64 * MIB).unwrap();
    let (a, b) = two_volumes_on_two_devices(&store);
    install(
        &store,
        1,
        vec![rule(FaultScope::Device(0), |r| {
            r.disappear_after_ms = Some(0)
        })],
    );
    // Nothing is dirty on device 0 and nothing reads it: the FLUSH still knows it is gone.
    assert!(is_io(&a.flush()));
    b.flush().unwrap();
    assert!(store.pool_info().devices[0].failed);
    store.create_volume("c", 4 * MIB).unwrap();
    let c = store.open_volume("c").unwrap();
    c.write_at(0, &block(3, 0, 1), false).unwrap();
    c.write_at(E, &block(3, 1, 1), false).unwrap();
    assert_eq!(c.extent_location(0).unwrap().device, 1);
    assert_eq!(c.extent_location(1).unwrap().device, 1);
}

/// A FUA write of a replicated volume keeps its promise when one copy's device fails before
/// that copy is durable (its sync fails here; in the crash harness the operator failed the
/// device while the write was in flight), as the volume's FLUSH does: the other copy's sync
/// covered it. Before, the FUA write answered EIO. Both paths: an overwrite (the write's own
/// syncs) and a write that allocates (the commit's syncs).
#[test]
fn a_fua_write_of_a_replicated_volume_survives_a_copy_whose_device_fails() {
    for allocating in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&StoreConfig {
            device_count: 2,
            device_capacity_bytes: 32 * MIB,
            ..StoreConfig::new(dir.path())
        })
        .unwrap();
        store
            .create_volume_with(
                "r",
                4 * E,
                headroom_store::NewVolume {
                    replicas: 2,
                    ..Default::default()
                },
            )
            .unwrap();
        let r = store.open_volume("r").unwrap();
        let at = if allocating { 2 * E } else { 0 };
        if !allocating {
            r.write_at(0, &block(4, 0, 1), false).unwrap();
            r.flush().unwrap();
        }
        // Device 0 starts failing its syncs; the write reaches both copies (2 devices, 2
        // copies), then device 0's sync fails.
        install(
            &store,
            1,
            vec![rule(FaultScope::Device(0), |r| r.eio_sync_permille = 1000)],
        );
        r.write_at(at, &block(4, 0, 2), true)
            .unwrap_or_else(|e| panic!("allocating {allocating}: {e}"));
        assert!(
            store.pool_info().devices[0].failed,
            "allocating {allocating}"
        );
        let mut buf = vec![0u8; BLOCK];
        r.read_at(at, &mut buf).unwrap();
        assert_eq!(buf, block(4, 0, 2), "allocating {allocating}");
        r.flush().unwrap();
    }
}
