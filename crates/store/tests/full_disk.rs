//! Full disks degrade, they do not break: ENOSPC from a device (on a write or on a sync) is
//! never a device error and never fails the device; a new extent's blocks are reserved when
//! it is allocated and a partial discard keeps them; and a device failed by errors or by the
//! operator returns to service with `Store::restore_device`, its replicated copies made equal
//! to the healthy ones first. The end-to-end test on a real full filesystem is
//! `crates/headroom/tests/full_disk.rs`.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::pattern;
use headroom_store::{
    DeviceOp, EXTENT_SIZE_BYTES, FaultConfig, FaultRule, FaultScope, NewVolume, StoreConfig,
    StoreError, Volume, VolumeHealth,
};
use headroom_store::{RebuildStep, Store};

const E: u64 = EXTENT_SIZE_BYTES;
const MIB: u64 = 1 << 20;

fn install(store: &Store, seed: u64, rule: FaultRule) {
    store
        .inject_faults(&FaultConfig {
            seed,
            rules: vec![rule],
        })
        .unwrap();
}

fn file_store(dir: &tempfile::TempDir, devices: u32) -> Store {
    Store::open(&StoreConfig {
        device_count: devices,
        device_capacity_bytes: 32 * MIB,
        ..StoreConfig::new(dir.path())
    })
    .unwrap()
}

fn replicated(store: &Store, name: &str, size_bytes: u64, replicas: u8) -> Arc<Volume> {
    store
        .create_volume_with(
            name,
            size_bytes,
            NewVolume {
                replicas,
                ..NewVolume::default()
            },
        )
        .unwrap();
    store.open_volume(name).unwrap()
}

fn read_replica(v: &Volume, replica: u8, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    v.read_replica_at(replica, offset, &mut buf).unwrap();
    buf
}

fn op(store: &Store, device: usize, op: DeviceOp) -> headroom_store::DeviceOpStats {
    store.device_stats()[device].ops[op as usize]
}

#[test]
fn enospc_on_writes_is_no_space_and_never_a_device_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir, 1);
    store.create_volume("v", 8 * MIB).unwrap();
    let v = store.open_volume("v").unwrap();
    v.write_at(0, &[1u8; 4096], false).unwrap();
    let mut rule = FaultRule::new(FaultScope::Device(0));
    rule.enospc_write_permille = 1000;
    install(&store, 7, rule);
    for i in 0..40u64 {
        let r = v.write_at(i * 4096, &[2u8; 4096], i % 5 == 0);
        assert!(matches!(r, Err(StoreError::NoSpace)), "write {i}: {r:?}");
    }
    let w = op(&store, 0, DeviceOp::Write);
    assert_eq!(w.errors, 0, "ENOSPC counted as a device error");
    assert_eq!(w.no_space, 40);
    assert_eq!(store.device_stats()[0].errors_in_service, 0);
    assert!(!store.pool_info().devices[0].failed);
    // The device still serves: reads, and a FLUSH of what is there.
    let mut buf = [0u8; 4096];
    v.read_at(0, &mut buf).unwrap();
    assert_eq!(buf, [1u8; 4096]);
    v.flush().unwrap();
    assert_eq!(v.info().health, VolumeHealth::Healthy);
}

/// A sync that fails with ENOSPC (XFS, btrfs, NFS, thin LVM can report it at writeback): the
/// FLUSH gets ENOSPC, the device stays in service, and every volume with data on the device
/// fails its next FLUSH once (its writes before the failed sync may be lost); after that a
/// FLUSH succeeds when its own sync does. A model of exactly that is checked over 60 FLUSHes
/// of two volumes on one device, half of whose syncs fail.
#[test]
fn enospc_on_sync_fails_the_flush_of_each_volume_there_once_and_never_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir, 1);
    store.create_volume("a", 8 * MIB).unwrap();
    store.create_volume("b", 8 * MIB).unwrap();
    let a = store.open_volume("a").unwrap();
    let b = store.open_volume("b").unwrap();
    a.write_at(0, &[1u8; 4096], false).unwrap();
    b.write_at(0, &[1u8; 4096], false).unwrap();
    a.flush().unwrap();
    b.flush().unwrap();
    let mut rule = FaultRule::new(FaultScope::Device(0));
    rule.enospc_sync_permille = 500;
    install(&store, 3, rule);
    let volumes = [&a, &b];
    let mut loss_unseen = [false, false];
    let (mut ok, mut no_space) = (0, 0);
    for i in 0..60usize {
        for v in volumes {
            v.write_at((i as u64 % 512) * 4096, &[i as u8; 4096], false)
                .unwrap();
        }
        let k = i % 2;
        let lost_before = op(&store, 0, DeviceOp::Sync).no_space;
        let r = volumes[k].flush();
        let lost_now = op(&store, 0, DeviceOp::Sync).no_space > lost_before;
        if lost_now {
            loss_unseen = [true, true];
        }
        let expect_failure = loss_unseen[k];
        loss_unseen[k] = false;
        match r {
            Ok(()) => {
                assert!(!expect_failure, "flush {i} of volume {k} hid a lost sync");
                ok += 1;
            }
            Err(StoreError::NoSpace) => {
                assert!(expect_failure, "flush {i} of volume {k} failed for nothing");
                no_space += 1;
            }
            Err(e) => panic!("flush {i}: {e} (not ENOSPC)"),
        }
        assert!(!store.pool_info().devices[0].failed, "device failed at {i}");
    }
    assert!(ok >= 5 && no_space >= 5, "ok {ok}, no space {no_space}");
    let s = op(&store, 0, DeviceOp::Sync);
    assert_eq!(s.errors, 0);
    assert!(s.no_space > 0);
    assert_eq!(store.device_stats()[0].errors_in_service, 0);
    // A new volume allocates on the device: it is in service.
    store.create_volume("c", 4 * MIB).unwrap();
    let c = store.open_volume("c").unwrap();
    c.write_at(0, &[3u8; 4096], false).unwrap();
    assert_eq!(c.extent_location(0).unwrap().device, 0);
}

/// An EIO from a sync still fails the device for good (fsyncgate): ENOSPC is the exception,
/// not the rule.
#[test]
fn eio_on_sync_still_fails_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir, 1);
    store.create_volume("v", 8 * MIB).unwrap();
    let v = store.open_volume("v").unwrap();
    v.write_at(0, &[1u8; 4096], false).unwrap();
    let mut rule = FaultRule::new(FaultScope::Device(0));
    rule.eio_sync_permille = 1000;
    install(&store, 1, rule);
    assert!(matches!(v.flush(), Err(StoreError::Io(_))));
    assert!(store.pool_info().devices[0].failed);
}

/// A new extent's blocks are reserved at allocation (a 4 KiB write takes the whole 2 MiB on
/// the filesystem), the rest still reads as zeros and shows as a hole, and a partial TRIM
/// keeps the blocks.
#[test]
fn allocation_reserves_the_extent_and_a_partial_trim_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir, 1);
    let used = |s: &Store| s.pool_info().devices[0].physical_used_bytes.unwrap();
    let before = used(&store);
    store.create_volume("v", 8 * MIB).unwrap();
    let v = store.open_volume("v").unwrap();
    v.write_at(4096, &[5u8; 4096], false).unwrap();
    let reserved = used(&store) - before;
    assert!(
        reserved >= E,
        "a 4 KiB write reserved only {reserved} bytes"
    );
    let mut buf = vec![1u8; 8192];
    v.read_at(E - 8192, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    let status = v.block_status(0, E).unwrap();
    assert!(
        status.iter().any(|x| x.hole),
        "the unwritten rest should be a hole: {status:?}"
    );
    v.trim(4096, 4096, false).unwrap();
    assert!(
        used(&store) - before >= E,
        "a partial trim gave blocks back"
    );
    v.read_at(4096, &mut buf[..4096]).unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 0));
    // A whole-extent release still gives them back.
    v.trim(0, E, false).unwrap();
    v.flush().unwrap();
    assert!(
        used(&store) - before < E,
        "a whole-extent trim kept the blocks"
    );
}

/// Fail a device of a 2-copy volume, write while it is failed (only the other copy gets
/// it), restore it: the copies are equal to the model again, the device is in service
/// durably (a reopen keeps it), the volume is healthy, a restored device's error count
/// starts from zero; restoring a device in service does nothing; an unknown id is
/// `DeviceNotFound`.
#[test]
fn restore_makes_the_copies_equal_and_returns_the_device_to_service() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir, 2);
    let v = replicated(&store, "r", 8 * MIB, 2);
    let mut model = pattern(1, (4 * E) as usize);
    v.write_at(0, &model, false).unwrap();
    v.flush().unwrap();
    // A 1-replica volume with its extent on device 1, whose reads there fail: errors.
    store.create_volume("solo", 4 * MIB).unwrap();
    let solo = store.open_volume("solo").unwrap();
    solo.write_at(0, &[9u8; 4096], false).unwrap();
    let at = solo.extent_location(0).unwrap();
    let failing = at.device;
    let mut rule = FaultRule::new(FaultScope::Device(failing));
    rule.offset_bytes = at.offset_bytes;
    rule.length_bytes = Some(E);
    rule.eio_read_permille = 1000;
    install(&store, 5, rule);
    let mut buf = [0u8; 4096];
    assert!(solo.read_at(0, &mut buf).is_err());
    assert_eq!(store.device_stats()[failing as usize].errors_in_service, 1);

    store.fail_device(failing).unwrap();
    assert_eq!(v.info().health, VolumeHealth::Degraded);
    assert!(
        solo.flush().is_err(),
        "a 1-replica volume there cannot FLUSH"
    );
    // Writes while failed reach only the other copy.
    let new = pattern(2, (E + 8192) as usize);
    v.write_at(E - 4096, &new, false).unwrap();
    model[(E - 4096) as usize..(2 * E + 4096) as usize].copy_from_slice(&new);
    v.trim(3 * E, E, false).unwrap();
    model[(3 * E) as usize..].fill(0);
    v.flush().unwrap();
    let stale = if v.copies(1)[0].unwrap().0.device == failing {
        0
    } else {
        1
    };
    assert_ne!(
        read_replica(&v, stale, 0, model.len()),
        model,
        "the failed copy should have missed writes"
    );

    let r = store.restore_device(failing).unwrap();
    assert!(r.restored && !r.device.failed);
    assert!(r.copies_checked >= 2, "{r:?}");
    assert!(r.chunks_rewritten >= 2, "{r:?}");
    for replica in 0..2 {
        assert_eq!(
            read_replica(&v, replica, 0, model.len()),
            model,
            "replica {replica}"
        );
    }
    assert_eq!(v.info().health, VolumeHealth::Healthy);
    assert_eq!(store.device_stats()[failing as usize].errors_in_service, 0);
    solo.flush().unwrap();
    v.flush().unwrap();
    // New writes reach both copies again.
    v.write_at(0, &[7u8; 4096], false).unwrap();
    model[..4096].fill(7);
    for replica in 0..2 {
        assert_eq!(read_replica(&v, replica, 0, 4096), &model[..4096]);
    }
    // In service already: nothing to do. Unknown: not found.
    let again = store.restore_device(failing).unwrap();
    assert!(!again.restored && again.extents_reclaimed == 0);
    assert!(matches!(
        store.restore_device(9),
        Err(StoreError::DeviceNotFound(9))
    ));
    drop((v, solo));
    drop(store);
    let store = file_store(&dir, 2);
    assert!(!store.pool_info().devices[failing as usize].failed);
    let v = store.open_volume("r").unwrap();
    assert_eq!(v.info().health, VolumeHealth::Healthy);
    for replica in 0..2 {
        assert_eq!(read_replica(&v, replica, 0, model.len()), model);
    }
}

/// Extents a rebuild moved off a failed device are mapped by nothing; the restore punches
/// them and returns them to the free pool.
#[test]
fn restore_reclaims_the_extents_a_rebuild_moved_away() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir, 3);
    let v = replicated(&store, "r", 8 * MIB, 2);
    let model = pattern(3, (4 * E) as usize);
    v.write_at(0, &model, false).unwrap();
    v.flush().unwrap();
    let free_at_start = store.pool_info().free_extents;
    let on0 = (0..4).filter(|&e| v.copies(e).iter().flatten().any(|(l, _)| l.device == 0));
    let moved = on0.count() as u64;
    assert!(moved > 0);
    store.fail_device(0).unwrap();
    for e in 0..4 {
        assert!(matches!(
            v.rebuild_extent(e).unwrap(),
            RebuildStep::Rebuilt { .. } | RebuildStep::Complete
        ));
    }
    assert_eq!(v.info().health, VolumeHealth::Healthy);
    let info = store.pool_info();
    assert_eq!(info.free_extents, free_at_start - moved);
    assert_eq!(info.leaked_extents, moved);
    let r = store.restore_device(0).unwrap();
    assert!(r.restored);
    assert_eq!(r.extents_reclaimed, moved);
    let info = store.pool_info();
    assert_eq!(info.free_extents, free_at_start);
    assert_eq!(info.leaked_extents, 0);
    assert!(!info.devices[0].failed);
    let mut buf = vec![0u8; model.len()];
    v.read_at(0, &mut buf).unwrap();
    assert_eq!(buf, model);
}

/// A device that still fails is refused and stays failed.
#[test]
fn a_device_that_still_fails_is_not_restored() {
    let store = Store::open_memory(64 * MIB).unwrap();
    let mut rule = FaultRule::new(FaultScope::Device(1));
    rule.disappear_after_ops = Some(0);
    install(&store, 1, rule);
    store.create_volume("v", 4 * MIB).unwrap();
    let v = store.open_volume("v").unwrap();
    let _ = v.write_at(0, &[1u8; 4096], false);
    store.fail_device(1).unwrap();
    let r = store.restore_device(1);
    assert!(matches!(r, Err(StoreError::InvalidDevice { .. })), "{r:?}");
    assert!(store.pool_info().devices[1].failed);
}

/// A FUA write is durable when answered: if a sync fails with ENOSPC while it is made
/// durable (its own sync, or the commit of the extent it allocated), it gets ENOSPC, never
/// success, and the device stays in service.
#[test]
fn a_fua_write_whose_sync_failed_with_enospc_is_not_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(&dir, 1);
    store.create_volume("v", 16 * MIB).unwrap();
    let v = store.open_volume("v").unwrap();
    v.write_at(0, &[1u8; 4096], false).unwrap();
    v.flush().unwrap();
    let mut rule = FaultRule::new(FaultScope::Device(0));
    rule.enospc_sync_permille = 1000;
    install(&store, 2, rule);
    // Into the allocated extent (its own sync), then into new extents (a commit).
    for e in 0..4u64 {
        let r = v.write_at(e * E + 8192, &[2u8; 4096], true);
        assert!(
            matches!(r, Err(StoreError::NoSpace)),
            "FUA write {e}: {r:?}"
        );
        let r = v.write_zeroes(e * E + 16384, 4096, false, true);
        assert!(
            matches!(r, Err(StoreError::NoSpace)),
            "FUA zeroes {e}: {r:?}"
        );
    }
    assert!(!store.pool_info().devices[0].failed);
    assert_eq!(op(&store, 0, DeviceOp::Sync).errors, 0);
}
