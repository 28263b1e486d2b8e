//! Functional tests of volumes on both backends (RAM and sparse files in a tempdir), with
//! the real redb: read-your-writes, holes, block status, trim/zero release, resize, delete,
//! reopen, placement, quarantine, and error cases.

// Helpers outside `#[test]` functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

mod common;

use common::pattern;
use std::sync::Arc;

use headroom_store::{
    EXTENT_SIZE_BYTES, Extent, NewVolume, Store, StoreConfig, StoreError, Volume,
};
use tempfile::TempDir;

const E: u64 = EXTENT_SIZE_BYTES;
const MIB: u64 = 1 << 20;

struct Fixture {
    store: Store,
    dir: Option<TempDir>,
}

fn file_config(dir: &TempDir) -> StoreConfig {
    StoreConfig {
        device_count: 2,
        device_capacity_bytes: 32 * MIB,
        ..StoreConfig::new(dir.path())
    }
}

fn memory() -> Fixture {
    Fixture {
        store: Store::open_memory(64 * MIB).unwrap(),
        dir: None,
    }
}

fn file() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&file_config(&dir)).unwrap();
    Fixture {
        store,
        dir: Some(dir),
    }
}

fn each_backend(f: impl Fn(&Fixture)) {
    f(&memory());
    f(&file());
}

fn read_vec(v: &Volume, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xEEu8; len];
    v.read_at(offset, &mut buf).unwrap();
    buf
}

fn physical_used(store: &Store) -> u64 {
    store
        .pool_info()
        .devices
        .iter()
        .map(|d| d.physical_used_bytes.unwrap())
        .sum()
}

fn covered(runs: &[Extent]) -> u64 {
    runs.iter().map(|r| r.length).sum()
}

#[test]
fn store_and_volume_are_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<Store>();
    check::<Arc<Volume>>();
}

#[test]
fn read_your_writes_across_extent_boundaries() {
    each_backend(|fx| {
        fx.store.create_volume("v", 10 * MIB).unwrap();
        let v = fx.store.open_volume("v").unwrap();
        let mut model = vec![0u8; (10 * MIB) as usize];
        let writes = [
            (E - 100, 300usize),
            (MIB + 7, (5 * MIB) as usize),
            (10 * MIB - 512, 512),
            (0, 1),
        ];
        for (i, &(off, len)) in writes.iter().enumerate() {
            let data = pattern(i as u64 + 1, len);
            v.write_at(off, &data, false).unwrap();
            model[off as usize..off as usize + len].copy_from_slice(&data);
            assert_eq!(read_vec(&v, off, len), data);
        }
        assert_eq!(read_vec(&v, 0, model.len()), model);
        // 10 MiB = 5 extents, all touched by the writes above.
        assert_eq!(v.info().allocated_bytes, 5 * E);
    });
}

#[test]
fn holes_read_zero_and_reads_never_allocate() {
    each_backend(|fx| {
        fx.store.create_volume("v", 8 * MIB).unwrap();
        let v = fx.store.open_volume("v").unwrap();
        assert!(read_vec(&v, 0, (8 * MIB) as usize).iter().all(|&b| b == 0));
        v.cache(0, 8 * MIB).unwrap();
        v.write_zeroes(0, 8 * MIB, true, false).unwrap();
        v.trim(0, 8 * MIB, false).unwrap();
        assert_eq!(v.info().allocated_bytes, 0);
        assert_eq!(fx.store.pool_info().allocated_extents, 0);
        assert_eq!(
            v.block_status(0, 8 * MIB).unwrap(),
            vec![Extent {
                length: 8 * MIB,
                hole: true,
                zero: true
            }]
        );
    });
}

#[test]
fn block_status_reports_holes_and_data() {
    each_backend(|fx| {
        fx.store.create_volume("v", 8 * MIB).unwrap();
        let v = fx.store.open_volume("v").unwrap();
        let off = E + 64 * 1024;
        v.write_at(off, &pattern(9, 4096), false).unwrap();
        let runs = v.block_status(0, 8 * MIB).unwrap();
        assert_eq!(covered(&runs), 8 * MIB);
        // Runs alternate (adjacent equal runs are merged) and hole implies zero.
        for w in runs.windows(2) {
            assert_ne!(w[0].hole, w[1].hole);
        }
        let mut pos = 0;
        for r in &runs {
            assert_eq!(r.hole, r.zero);
            if r.hole {
                assert!(read_vec(&v, pos, r.length as usize).iter().all(|&b| b == 0));
                // The written block is never inside a hole run.
                assert!(pos + r.length <= off || pos >= off + 4096);
            }
            pos += r.length;
        }
        // Extent 0 and extents 2..4 are unallocated: first and last runs are holes.
        assert!(runs[0].hole && runs[0].length >= E);
        assert!(runs.last().unwrap().hole && runs.last().unwrap().length >= 2 * E);
        // Clipped to the end; past the end is an error.
        assert_eq!(
            covered(&v.block_status(6 * MIB, 10 * MIB).unwrap()),
            2 * MIB
        );
        assert!(matches!(
            v.block_status(8 * MIB, 1),
            Err(StoreError::OutOfRange { .. })
        ));
        assert!(v.block_status(8 * MIB, 0).unwrap().is_empty());
    });
}

#[test]
fn file_block_status_sees_holes_inside_an_allocated_extent() {
    let fx = file();
    fx.store.create_volume("v", 4 * MIB).unwrap();
    let v = fx.store.open_volume("v").unwrap();
    v.write_at(64 * 1024, &pattern(1, 4096), false).unwrap();
    let runs = v.block_status(0, E).unwrap();
    assert_eq!(
        runs,
        vec![
            Extent {
                length: 64 * 1024,
                hole: true,
                zero: true
            },
            Extent {
                length: 4096,
                hole: false,
                zero: false
            },
            Extent {
                length: E - 64 * 1024 - 4096,
                hole: true,
                zero: true
            },
        ]
    );
}

#[test]
fn trim_releases_whole_extents_and_frees_device_space() {
    // A larger (sparse) pool, so that two freed extents stay below the quarantine bound.
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        device_capacity_bytes: 256 * MIB,
        ..file_config(&dir)
    };
    let fx = Fixture {
        store: Store::open(&cfg).unwrap(),
        dir: Some(dir),
    };
    fx.store.create_volume("v", 16 * MIB).unwrap();
    let v = fx.store.open_volume("v").unwrap();
    let data = pattern(3, (3 * E) as usize);
    v.write_at(0, &data, false).unwrap();
    v.flush().unwrap();
    let used_before = physical_used(&fx.store);
    assert!(used_before >= 3 * E, "{used_before}");
    let free_before = fx.store.pool_info().free_extents;

    // Extents 0 and 1 are covered whole and give their blocks back; 4 KiB of extent 2 is
    // zeroed, its blocks kept (the extent's reservation: a later write there needs no space).
    v.trim(0, 2 * E + 4096, false).unwrap();
    assert_eq!(v.info().allocated_bytes, E);
    assert!(v.extent_location(0).is_none() && v.extent_location(1).is_none());
    let used_after = physical_used(&fx.store);
    assert!(
        used_after + 2 * E <= used_before,
        "{used_after} {used_before}"
    );
    assert!(
        used_after >= E,
        "the partly trimmed extent keeps its blocks: {used_after}"
    );
    assert!(
        read_vec(&v, 0, (2 * E + 4096) as usize)
            .iter()
            .all(|&b| b == 0)
    );
    assert_eq!(
        read_vec(&v, 2 * E + 4096, (E - 4096) as usize),
        &data[(2 * E + 4096) as usize..]
    );

    // Freed extents are quarantined until the free is durable.
    let pool = fx.store.pool_info();
    assert_eq!(pool.quarantined_extents, 2);
    assert_eq!(pool.free_extents, free_before);
    v.flush().unwrap();
    let pool = fx.store.pool_info();
    assert_eq!(pool.quarantined_extents, 0);
    assert_eq!(pool.free_extents, free_before + 2);
}

#[test]
fn write_zeroes_releases_unless_no_hole() {
    each_backend(|fx| {
        fx.store.create_volume("v", 8 * MIB).unwrap();
        let v = fx.store.open_volume("v").unwrap();
        v.write_at(0, &pattern(4, (3 * E) as usize), false).unwrap();
        // NO_HOLE: allocation stays, content becomes zero (partial and whole extents).
        v.write_zeroes(100, 2 * E, false, false).unwrap();
        assert_eq!(v.info().allocated_bytes, 3 * E);
        assert!(read_vec(&v, 100, (2 * E) as usize).iter().all(|&b| b == 0));
        assert_ne!(read_vec(&v, 0, 100), vec![0u8; 100]);
        // NO_HOLE over a hole provisions it (reads zero, and later writes need no allocation).
        v.write_zeroes(3 * E + 10, 20, false, true).unwrap();
        assert_eq!(v.info().allocated_bytes, 4 * E);
        assert!(v.extent_location(3).unwrap().committed);
        assert!(read_vec(&v, 3 * E, E as usize).iter().all(|&b| b == 0));
        // May release: whole extents 2 and 3 go away; a partial piece of extent 1 reads zero.
        v.write_zeroes(E + 5, 3 * E - 5, true, true).unwrap();
        assert_eq!(v.info().allocated_bytes, 2 * E);
        assert!(v.extent_location(2).is_none() && v.extent_location(3).is_none());
        assert!(
            read_vec(&v, 100, (4 * E - 100) as usize)
                .iter()
                .all(|&b| b == 0)
        );
        // Releasing zeroes over holes allocates nothing.
        v.write_zeroes(2 * E, 2 * E, true, false).unwrap();
        assert_eq!(v.info().allocated_bytes, 2 * E);
        // FUA made the frees durable, so nothing waits in quarantine.
        assert_eq!(fx.store.pool_info().quarantined_extents, 0);
        // RAM and ext4/tmpfs-backed files zero by metadata operations.
        assert!(v.is_zero_fast());
    });
}

#[test]
fn resize_grow_and_shrink() {
    each_backend(|fx| {
        fx.store.create_volume("v", 4 * MIB).unwrap();
        let v = fx.store.open_volume("v").unwrap();
        v.write_at(0, &pattern(5, (4 * MIB) as usize), false)
            .unwrap();
        assert!(matches!(
            v.write_at(4 * MIB, &[1], false),
            Err(StoreError::OutOfRange { .. })
        ));

        let info = fx.store.resize_volume("v", 9 * MIB).unwrap();
        assert_eq!(info.size_bytes, 9 * MIB);
        assert_eq!(v.size_bytes(), 9 * MIB);
        assert!(
            read_vec(&v, 4 * MIB, (5 * MIB) as usize)
                .iter()
                .all(|&b| b == 0)
        );
        v.write_at(8 * MIB, &pattern(6, MIB as usize), false)
            .unwrap();
        assert_eq!(v.info().allocated_bytes, 3 * E);

        // Shrink to a size inside extent 1: extents 2.. are released, the tail of extent 1 zeroed.
        let new_size = E + 512;
        fx.store.resize_volume("v", new_size).unwrap();
        assert_eq!(v.info().allocated_bytes, 2 * E);
        assert!(matches!(
            v.read_at(new_size, &mut [0u8; 1]),
            Err(StoreError::OutOfRange { .. })
        ));
        let before = pattern(5, (4 * MIB) as usize);
        assert_eq!(
            read_vec(&v, 0, new_size as usize),
            &before[..new_size as usize]
        );
        fx.store.resize_volume("v", 8 * MIB).unwrap();
        assert!(
            read_vec(&v, new_size, (8 * MIB - new_size) as usize)
                .iter()
                .all(|&b| b == 0)
        );
        assert!(matches!(
            fx.store.resize_volume("v", 1000),
            Err(StoreError::InvalidSize { .. })
        ));
        assert!(matches!(
            fx.store.resize_volume("nope", 4096),
            Err(StoreError::NotFound(_))
        ));
    });
}

#[test]
fn delete_frees_space_and_invalidates_handles() {
    each_backend(|fx| {
        let total = fx.store.pool_info().free_extents;
        fx.store.create_volume("v", 16 * MIB).unwrap();
        let v = fx.store.open_volume("v").unwrap();
        v.write_at(0, &pattern(7, (6 * E) as usize), false).unwrap();
        assert_eq!(fx.store.pool_info().free_extents, total - 6);
        let used = fx.dir.as_ref().map(|_| physical_used(&fx.store));
        fx.store.delete_volume("v").unwrap();
        // Delete is durable at once: no quarantine left, all space free again.
        let pool = fx.store.pool_info();
        assert_eq!(pool.free_extents, total);
        assert_eq!(pool.quarantined_extents, 0);
        if let Some(used) = used {
            assert!(physical_used(&fx.store) + 6 * E <= used);
        }
        assert!(matches!(
            v.read_at(0, &mut [0u8; 8]),
            Err(StoreError::VolumeDeleted(_))
        ));
        assert!(matches!(
            v.write_at(0, &[1], false),
            Err(StoreError::VolumeDeleted(_))
        ));
        assert!(matches!(v.flush(), Err(StoreError::VolumeDeleted(_))));
        assert!(matches!(
            fx.store.open_volume("v"),
            Err(StoreError::NotFound(_))
        ));
        assert!(matches!(
            fx.store.delete_volume("v"),
            Err(StoreError::NotFound(_))
        ));
        // The name can be reused, and the new volume sees only zeros.
        fx.store.create_volume("v", 16 * MIB).unwrap();
        let w = fx.store.open_volume("v").unwrap();
        assert!(read_vec(&w, 0, (16 * MIB) as usize).iter().all(|&b| b == 0));
    });
}

#[test]
fn management_validation() {
    let fx = memory();
    assert!(matches!(
        fx.store.create_volume("-x", MIB),
        Err(StoreError::InvalidName { .. })
    ));
    assert!(matches!(
        fx.store.create_volume("x", 0),
        Err(StoreError::InvalidSize { .. })
    ));
    assert!(matches!(
        fx.store.create_volume("x", 1000),
        Err(StoreError::InvalidSize { .. })
    ));
    assert!(matches!(
        fx.store.create_volume("x", 1 << 60),
        Err(StoreError::InvalidSize { .. })
    ));
    let a = fx.store.create_volume("b", MIB).unwrap();
    let b = fx.store.create_volume("a", 2 * MIB).unwrap();
    assert_ne!(a.id, b.id);
    assert!(matches!(
        fx.store.create_volume("a", MIB),
        Err(StoreError::AlreadyExists(_))
    ));
    let names: Vec<String> = fx
        .store
        .list_volumes()
        .into_iter()
        .map(|v| v.name)
        .collect();
    assert_eq!(names, vec!["a", "b"]);
    assert_eq!(fx.store.volume_info("a").unwrap().size_bytes, 2 * MIB);
    assert!(matches!(
        fx.store.volume_info("zz"),
        Err(StoreError::NotFound(_))
    ));
    assert!(Arc::ptr_eq(
        &fx.store.open_volume("a").unwrap(),
        &fx.store.open_volume("a").unwrap()
    ));
    let v = fx.store.open_volume("a").unwrap();
    assert!(matches!(
        v.write_at(u64::MAX - 1, &[0; 4], false),
        Err(StoreError::OutOfRange { .. })
    ));
    assert!(matches!(
        v.trim(MIB, 2 * MIB, false),
        Err(StoreError::OutOfRange { .. })
    ));
    assert!(matches!(
        v.write_zeroes(2 * MIB, 1, true, false),
        Err(StoreError::OutOfRange { .. })
    ));
    v.write_at(2 * MIB, &[], false).unwrap();
}

#[test]
fn new_extents_spread_over_devices() {
    each_backend(|fx| {
        fx.store.create_volume("v", 16 * MIB).unwrap();
        let v = fx.store.open_volume("v").unwrap();
        for i in 0..4 {
            v.write_at(i * E, &[1], false).unwrap();
        }
        let devices: Vec<u32> = (0..4)
            .map(|i| v.extent_location(i).unwrap().device)
            .collect();
        assert_eq!(devices, vec![0, 1, 0, 1]);
        let pool = fx.store.pool_info();
        assert!(
            pool.devices
                .iter()
                .all(|d| d.free_extents == d.extent_count - 2)
        );
    });
}

#[test]
fn allocation_commits_on_flush_and_fua() {
    each_backend(|fx| {
        fx.store.create_volume("v", 8 * MIB).unwrap();
        let v = fx.store.open_volume("v").unwrap();
        v.write_at(0, &[1; 512], false).unwrap();
        assert!(!v.extent_location(0).unwrap().committed);
        v.flush().unwrap();
        assert!(v.extent_location(0).unwrap().committed);
        v.write_at(E, &[2; 512], true).unwrap();
        assert!(v.extent_location(1).unwrap().committed);
        // A FUA write into an extent with a committed allocation needs no commit.
        v.write_at(E + 512, &[3; 512], true).unwrap();
        assert_eq!(
            read_vec(&v, E, 1024),
            [vec![2u8; 512], vec![3u8; 512]].concat()
        );
    });
}

#[test]
fn freed_extent_is_not_reused_before_the_free_is_durable() {
    let fx = memory();
    fx.store.create_volume("x", 8 * MIB).unwrap();
    fx.store.create_volume("y", 8 * MIB).unwrap();
    let x = fx.store.open_volume("x").unwrap();
    let y = fx.store.open_volume("y").unwrap();
    x.write_at(0, &[9; 4096], false).unwrap();
    x.flush().unwrap();
    let freed = x.extent_location(0).unwrap();
    x.trim(0, E, false).unwrap();
    assert_eq!(fx.store.pool_info().quarantined_extents, 1);
    for i in 0..4 {
        y.write_at(i * E, &[1], false).unwrap();
        let loc = y.extent_location(i).unwrap();
        assert!((loc.device, loc.offset_bytes) != (freed.device, freed.offset_bytes));
    }
    fx.store.flush_all().unwrap();
    assert_eq!(fx.store.pool_info().quarantined_extents, 0);
}

#[test]
fn full_pool_reclaims_quarantine_then_reports_no_space() {
    // 32 extents: the quarantine bound is 2, so one trimmed extent stays quarantined.
    let store = Store::open_memory(32 * E).unwrap();
    store.create_volume("x", 32 * E).unwrap();
    store.create_volume("y", 8 * MIB).unwrap();
    let x = store.open_volume("x").unwrap();
    let y = store.open_volume("y").unwrap();
    for i in 0..32 {
        x.write_at(i * E, &[1], false).unwrap();
    }
    assert!(matches!(
        y.write_at(0, &[1], false),
        Err(StoreError::NoSpace)
    ));
    x.trim(0, E, false).unwrap();
    let pool = store.pool_info();
    assert_eq!((pool.free_extents, pool.quarantined_extents), (0, 1));
    // The allocation commits the quarantined free and then succeeds.
    y.write_at(0, &[5; 100], false).unwrap();
    assert!(matches!(
        y.write_at(E, &[6], false),
        Err(StoreError::NoSpace)
    ));
    assert_eq!(
        read_vec(&y, 0, 200),
        [vec![5u8; 100], vec![0u8; 100]].concat()
    );
    assert!(read_vec(&x, 0, E as usize).iter().all(|&b| b == 0));
}

#[test]
fn quarantine_is_bounded_without_flush() {
    // 32 extents: a release that leaves 2 or more extents quarantined commits at once.
    let store = Store::open_memory(32 * E).unwrap();
    store.create_volume("x", 8 * E).unwrap();
    let x = store.open_volume("x").unwrap();
    x.write_at(0, &pattern(2, (4 * E) as usize), false).unwrap();
    x.trim(0, E, false).unwrap();
    assert_eq!(store.pool_info().quarantined_extents, 1);
    x.trim(E, E, false).unwrap();
    let pool = store.pool_info();
    assert_eq!(pool.quarantined_extents, 0);
    assert_eq!(pool.free_extents, 32 - 2);
    // That commit also made the remaining allocations durable.
    assert!(x.extent_location(2).unwrap().committed);
}

#[test]
fn reopen_keeps_volumes_and_data() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = file_config(&dir);
    let a = pattern(11, (3 * MIB) as usize);
    let b = pattern(12, 8192);
    let infos = {
        let store = Store::open(&cfg).unwrap();
        store.create_volume("a", 8 * MIB).unwrap();
        store.create_volume("b", 4 * MIB).unwrap();
        store.create_volume("gone", 4 * MIB).unwrap();
        store
            .open_volume("gone")
            .unwrap()
            .write_at(0, &[1; 10], false)
            .unwrap();
        store.delete_volume("gone").unwrap();
        let va = store.open_volume("a").unwrap();
        va.write_at(MIB, &a, false).unwrap();
        va.flush().unwrap();
        // Not flushed: a clean close (dropping the store) still commits it.
        store
            .open_volume("b")
            .unwrap()
            .write_at(E - 4096, &b, false)
            .unwrap();
        store.resize_volume("b", 6 * MIB).unwrap();
        store.list_volumes()
    };
    assert!(Store::open_memory(0).is_ok());
    let store = Store::open(&cfg).unwrap();
    assert_eq!(store.list_volumes(), infos);
    let va = store.open_volume("a").unwrap();
    assert_eq!(read_vec(&va, MIB, a.len()), a);
    assert!(read_vec(&va, 0, MIB as usize).iter().all(|&x| x == 0));
    let vb = store.open_volume("b").unwrap();
    assert_eq!(vb.size_bytes(), 6 * MIB);
    assert_eq!(read_vec(&vb, E - 4096, b.len()), b);
    assert!(vb.extent_location(0).unwrap().committed);
    assert!(matches!(
        store.open_volume("gone"),
        Err(StoreError::NotFound(_))
    ));
    // New volumes get fresh ids and the allocator knows which extents are used.
    let c = store.create_volume("c", 4 * MIB).unwrap();
    assert!(infos.iter().all(|i| i.id < c.id));
    let pool = store.pool_info();
    assert_eq!(pool.allocated_extents, 2 + 2);
    assert_eq!(pool.free_extents, pool.total_extents - 4);
    // A second open of the same data dir is refused while this one is alive.
    assert!(matches!(Store::open(&cfg), Err(StoreError::Metadata(_))));
}

#[test]
fn explicit_device_paths_and_bad_configs() {
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("outside.img");
    let cfg = StoreConfig {
        device_paths: vec![dev.clone()],
        device_capacity_bytes: 8 * MIB + 12345,
        ..StoreConfig::new(dir.path().join("data"))
    };
    {
        let store = Store::open(&cfg).unwrap();
        let pool = store.pool_info();
        assert_eq!(pool.devices.len(), 1);
        // 4 extents, the first reserved for the device's signature.
        assert_eq!(pool.capacity_bytes, 6 * MIB);
        assert_eq!(pool.devices[0].path, dev.display().to_string());
        store.create_volume("v", MIB).unwrap();
        store
            .open_volume("v")
            .unwrap()
            .write_at(0, &[3; 3], true)
            .unwrap();
    }
    let store = Store::open(&cfg).unwrap();
    assert_eq!(
        read_vec(&store.open_volume("v").unwrap(), 0, 4),
        vec![3, 3, 3, 0]
    );
    drop(store);
    let bad = StoreConfig {
        device_count: 0,
        ..StoreConfig::new(dir.path().join("other"))
    };
    assert!(matches!(
        Store::open(&bad),
        Err(StoreError::InvalidConfig(_))
    ));
    let tiny = StoreConfig {
        device_capacity_bytes: 4096,
        ..StoreConfig::new(dir.path().join("tiny"))
    };
    assert!(matches!(
        Store::open(&tiny),
        Err(StoreError::InvalidConfig(_))
    ));
}

const QOS_A: &str = r#"{"iops":500,"burst_iops":2000}"#;
const QOS_B: &str = r#"{"bandwidth_bytes_per_s":104857600}"#;

#[test]
fn qos_is_stored_with_the_volume_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = file_config(&dir);
    let infos = {
        let store = Store::open(&cfg).unwrap();
        let a = store
            .create_volume_with_qos("a", 4 * MIB, Some(QOS_A.into()))
            .unwrap();
        assert_eq!(a.qos.as_deref(), Some(QOS_A));
        assert_eq!(store.create_volume("b", 4 * MIB).unwrap().qos, None);
        store.create_volume("c", 4 * MIB).unwrap();
        let b = store.set_volume_qos("b", Some(QOS_B.into())).unwrap();
        assert_eq!(b.qos.as_deref(), Some(QOS_B));
        assert_eq!(
            store.open_volume("b").unwrap().qos().as_deref(),
            Some(QOS_B)
        );
        // Resizing rewrites the volume record: it must keep the QoS.
        store.resize_volume("a", 8 * MIB).unwrap();
        store.resize_volume("b", 2 * MIB).unwrap();
        store
            .create_volume_with_qos("d", 4 * MIB, Some(QOS_A.into()))
            .unwrap();
        assert_eq!(store.set_volume_qos("d", None).unwrap().qos, None);
        store.list_volumes()
    };
    let store = Store::open(&cfg).unwrap();
    assert_eq!(store.list_volumes(), infos);
    let qos = |name| store.volume_info(name).unwrap().qos;
    assert_eq!(qos("a").as_deref(), Some(QOS_A));
    assert_eq!(qos("b").as_deref(), Some(QOS_B));
    assert_eq!(qos("c"), None);
    assert_eq!(qos("d"), None);
    assert_eq!(store.volume_info("a").unwrap().size_bytes, 8 * MIB);
}

#[test]
fn tenant_and_read_only_are_stored_with_the_volume_and_survive_reopen_and_changes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = file_config(&dir);
    let infos = {
        let store = Store::open(&cfg).unwrap();
        store.create_tenant("alice").unwrap();
        store.create_tenant("Tenant B").unwrap();
        let a = store
            .create_volume_with(
                "a",
                4 * MIB,
                NewVolume {
                    qos: Some(QOS_A.into()),
                    tenant: Some("alice".into()),
                    read_only: false,
                    replicas: 1,
                },
            )
            .unwrap();
        assert_eq!((a.tenant.as_deref(), a.read_only), (Some("alice"), false));
        let b = store
            .create_volume_with(
                "b",
                4 * MIB,
                NewVolume {
                    tenant: Some("Tenant B".into()),
                    read_only: true,
                    ..NewVolume::default()
                },
            )
            .unwrap();
        assert_eq!((b.tenant.as_deref(), b.read_only), (Some("Tenant B"), true));
        let c = store.create_volume("c", 4 * MIB).unwrap();
        assert_eq!((c.tenant, c.read_only), (None, false));
        let handle = store.open_volume("b").unwrap();
        assert_eq!(
            (handle.tenant(), handle.read_only()),
            (Some("Tenant B"), true)
        );
        // Every later rewrite of the record (resize, QoS) keeps tenant and mode.
        store.resize_volume("a", 8 * MIB).unwrap();
        store.set_volume_qos("a", Some(QOS_B.into())).unwrap();
        store.resize_volume("b", 2 * MIB).unwrap();
        store.set_volume_qos("b", Some(QOS_A.into())).unwrap();
        store.list_volumes()
    };
    let store = Store::open(&cfg).unwrap();
    assert_eq!(store.list_volumes(), infos);
    let a = store.volume_info("a").unwrap();
    assert_eq!(
        (a.tenant.as_deref(), a.read_only, a.qos.as_deref()),
        (Some("alice"), false, Some(QOS_B))
    );
    let b = store.open_volume("b").unwrap();
    assert_eq!((b.tenant(), b.read_only()), (Some("Tenant B"), true));
    let c = store.open_volume("c").unwrap();
    assert_eq!((c.tenant(), c.read_only()), (None, false));
}

#[test]
fn invalid_tenant_ids_are_refused_and_create_nothing() {
    each_backend(|fx| {
        for bad in ["", " alice", "alice ", "a\nb", "é", &"t".repeat(129)] {
            let options = NewVolume {
                tenant: Some(bad.to_string()),
                ..NewVolume::default()
            };
            assert!(
                matches!(
                    fx.store.create_volume_with("v", MIB, options),
                    Err(StoreError::InvalidTenant { .. })
                ),
                "{bad:?}"
            );
            assert!(matches!(
                fx.store.volume_info("v"),
                Err(StoreError::NotFound(_))
            ));
        }
        let options = NewVolume {
            tenant: Some("t".repeat(128)),
            ..NewVolume::default()
        };
        fx.store.create_tenant(&"t".repeat(128)).unwrap();
        fx.store.create_volume_with("v", MIB, options).unwrap();
    });
}

#[test]
fn set_volume_qos_needs_an_existing_volume() {
    each_backend(|fx| {
        assert!(matches!(
            fx.store.set_volume_qos("nope", Some(QOS_A.into())),
            Err(StoreError::NotFound(_))
        ));
        fx.store
            .create_volume_with_qos("v", MIB, Some(QOS_A.into()))
            .unwrap();
        let handle = fx.store.open_volume("v").unwrap();
        fx.store.delete_volume("v").unwrap();
        assert!(matches!(
            fx.store.set_volume_qos("v", None),
            Err(StoreError::NotFound(_))
        ));
        // A failed create leaves nothing behind; the name's next volume starts without QoS.
        assert!(matches!(
            fx.store
                .create_volume_with_qos("-bad", MIB, Some(QOS_A.into())),
            Err(StoreError::InvalidName { .. })
        ));
        assert_eq!(fx.store.create_volume("v", MIB).unwrap().qos, None);
        assert_eq!(handle.qos().as_deref(), Some(QOS_A));
    });
}

#[test]
fn volume_states_survive_reopen_and_vanish_with_their_volume() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = file_config(&dir);
    let (a, b) = {
        let store = Store::open(&cfg).unwrap();
        assert!(store.volume_states().unwrap().is_empty());
        let a = store.create_volume("a", MIB).unwrap().id;
        let b = store.create_volume("b", MIB).unwrap().id;
        let gone = store.create_volume("gone", MIB).unwrap().id;
        store
            .save_volume_states(&[(a, vec![1; 40]), (b, vec![2; 40]), (gone, vec![3])])
            .unwrap();
        // Upsert: only the rows given change.
        store.save_volume_states(&[(a, vec![9, 9])]).unwrap();
        store.delete_volume("gone").unwrap();
        assert_eq!(
            store.volume_states().unwrap(),
            vec![(a, vec![9, 9]), (b, vec![2; 40])]
        );
        // A save that still names the deleted volume (or one never created) skips it.
        store
            .save_volume_states(&[(gone, vec![4]), (b, vec![5]), (u64::MAX, vec![6])])
            .unwrap();
        store.save_volume_states(&[]).unwrap();
        (a, b)
    };
    let store = Store::open(&cfg).unwrap();
    assert_eq!(
        store.volume_states().unwrap(),
        vec![(a, vec![9, 9]), (b, vec![5])]
    );
    let ids: Vec<(String, u64)> = store
        .list_volumes()
        .into_iter()
        .map(|v| (v.name, v.id))
        .collect();
    assert_eq!(ids, vec![("a".to_string(), a), ("b".to_string(), b)]);
    store.delete_volume("a").unwrap();
    assert_eq!(store.volume_states().unwrap(), vec![(b, vec![5])]);
}

#[test]
fn memory_store_keeps_volume_states() {
    let fx = memory();
    let ids: Vec<u64> = (0..3)
        .map(|i| fx.store.create_volume(&format!("v{i}"), MIB).unwrap().id)
        .collect();
    let states: Vec<(u64, Vec<u8>)> = ids
        .iter()
        .map(|&id| (id, id.to_le_bytes().to_vec()))
        .collect();
    fx.store.save_volume_states(&states).unwrap();
    assert_eq!(fx.store.volume_states().unwrap(), states);
    fx.store.delete_volume("v1").unwrap();
    assert_eq!(
        fx.store.volume_states().unwrap(),
        vec![states[0].clone(), states[2].clone()]
    );
}

fn with_tenant(tenant: &str) -> NewVolume {
    NewVolume {
        tenant: Some(tenant.to_string()),
        ..NewVolume::default()
    }
}

#[test]
fn tenants_are_created_counted_and_deleted_only_when_empty() {
    each_backend(|fx| {
        let store = &fx.store;
        // A volume of a tenant that was never created is refused, and nothing is created.
        assert!(matches!(
            store.create_volume_with("v", 4 * MIB, with_tenant("acme")),
            Err(StoreError::UnknownTenant(t)) if t == "acme"
        ));
        assert!(store.list_volumes().is_empty());
        assert!(matches!(
            store.create_tenant("a\nb"),
            Err(StoreError::InvalidTenant { .. })
        ));
        let created = store.create_tenant("acme").unwrap();
        assert_eq!((created.volumes, created.provisioned_bytes), (0, 0));
        assert!(matches!(
            store.create_tenant("acme"),
            Err(StoreError::TenantExists(_))
        ));
        store.create_tenant("zeta corp").unwrap();
        store
            .create_volume_with("v", 4 * MIB, with_tenant("acme"))
            .unwrap();
        store
            .create_volume_with("w", 8 * MIB, with_tenant("acme"))
            .unwrap();
        store.create_volume("untenanted", 2 * MIB).unwrap();
        let acme = store.tenant_info("acme").unwrap();
        assert_eq!((acme.volumes, acme.provisioned_bytes), (2, 12 * MIB));
        let ids: Vec<String> = store.list_tenants().into_iter().map(|t| t.id).collect();
        assert_eq!(ids, ["acme", "zeta corp"]);
        assert!(matches!(
            store.delete_tenant("acme"),
            Err(StoreError::TenantHasVolumes { volumes: 2, .. })
        ));
        assert!(matches!(
            store.delete_tenant("nobody"),
            Err(StoreError::TenantNotFound(_))
        ));
        store.delete_volume("v").unwrap();
        store.delete_volume("w").unwrap();
        store.delete_tenant("acme").unwrap();
        assert!(matches!(
            store.tenant_info("acme"),
            Err(StoreError::TenantNotFound(_))
        ));
        assert_eq!(store.list_tenants().len(), 1);
    });
}

#[test]
fn tenants_survive_reopen_and_old_data_gets_its_tenants_registered() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = file_config(&dir);
    {
        let store = Store::open(&cfg).unwrap();
        store.create_tenant("empty").unwrap();
        store.create_tenant("old").unwrap();
        store
            .create_volume_with("v", 4 * MIB, with_tenant("old"))
            .unwrap();
    }
    {
        let store = Store::open(&cfg).unwrap();
        let ids: Vec<String> = store.list_tenants().into_iter().map(|t| t.id).collect();
        assert_eq!(ids, ["empty", "old"]);
    }
    // A data directory of a build before the tenants table: drop the table behind the
    // store's back. Opening registers the tenant its volume names (and only that one).
    {
        let db = redb::Database::open(cfg.meta_path()).unwrap();
        let txn = db.begin_write().unwrap();
        let table: redb::TableDefinition<&str, &str> = redb::TableDefinition::new("tenants");
        assert!(txn.delete_table(table).unwrap());
        txn.commit().unwrap();
    }
    let store = Store::open(&cfg).unwrap();
    let tenants = store.list_tenants();
    assert_eq!(tenants.len(), 1, "{tenants:?}");
    assert_eq!((tenants[0].id.as_str(), tenants[0].volumes), ("old", 1));
    drop(store);
    // Registered durably: still there on the next open.
    let store = Store::open(&cfg).unwrap();
    assert_eq!(store.tenant_info("old").unwrap().volumes, 1);
}

#[test]
fn the_overcommit_ratio_limits_creating_and_growing_but_not_shrinking() {
    each_backend(|fx| {
        let store = &fx.store;
        let capacity = store.pool_info().capacity_bytes;
        // No limit by default: thin volumes may exceed the pool.
        store.create_volume("big", 4 * capacity).unwrap();
        store.delete_volume("big").unwrap();
        store.set_overcommit_ratio(Some(2.0));
        assert_eq!(store.overcommit_ratio(), Some(2.0));
        store.create_volume("a", capacity).unwrap();
        store.create_volume("b", capacity / 2).unwrap();
        // Exactly at the limit is allowed; one extent more is not.
        store.create_volume("c", capacity / 2).unwrap();
        assert_eq!(store.provisioned_bytes(), 2 * capacity);
        let err = store.create_volume("d", E).unwrap_err();
        match &err {
            StoreError::Overcommitted {
                provisioned_bytes,
                after_bytes,
                limit_bytes,
                ..
            } => {
                assert_eq!(
                    (*provisioned_bytes, *after_bytes, *limit_bytes),
                    (2 * capacity, 2 * capacity + E, 2 * capacity)
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("overcommit_ratio 2"), "{err}");
        assert!(matches!(
            store.volume_info("d"),
            Err(StoreError::NotFound(_))
        ));
        assert!(matches!(
            store.resize_volume("a", capacity + E),
            Err(StoreError::Overcommitted { .. })
        ));
        assert_eq!(store.volume_info("a").unwrap().size_bytes, capacity);
        // Shrinking makes room, which growing may use again.
        store.resize_volume("b", capacity / 4).unwrap();
        store.resize_volume("a", capacity + capacity / 4).unwrap();
        // A lower ratio keeps what exists but refuses any growth.
        store.set_overcommit_ratio(Some(1.0));
        assert!(matches!(
            store.resize_volume("c", capacity / 2 + E),
            Err(StoreError::Overcommitted { .. })
        ));
        store.resize_volume("c", capacity / 4).unwrap();
        store.set_overcommit_ratio(None);
        store.create_volume("d", 8 * capacity).unwrap();
    });
}

/// Extents allocated on each device (from the pool view).
fn allocated_per_device(store: &Store) -> Vec<u64> {
    store
        .pool_info()
        .devices
        .iter()
        .map(|d| d.extent_count - d.free_extents)
        .collect()
}

#[test]
fn placement_steers_new_extents_away_from_a_busy_device() {
    for busy in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&file_config(&dir)).unwrap();
        let hot = store.create_volume("hot", 4 * MIB).unwrap();
        let hot = store.open_volume(&hot.name).unwrap();
        // Its only extent: the first allocation of an empty pool goes to device 0.
        hot.write_at(0, &pattern(1, 4096), false).unwrap();
        assert_eq!(allocated_per_device(&store), vec![1, 0]);
        // Telemetry over a window of 1 ms (time is an argument): 20,000 reads of device 0
        // "in" it keep the device busy many times over, so its load is 1.
        store.observe_devices(1_000_000);
        if busy {
            let mut buf = vec![0u8; 4096];
            for _ in 0..20_000 {
                hot.read_at(0, &mut buf).unwrap();
            }
        }
        store.observe_devices(2_000_000);
        let telemetry = store.device_telemetry();
        assert_eq!(telemetry[0].read_iops > 0.0, busy, "{telemetry:?}");
        let fresh = store.create_volume("fresh", 8 * MIB).unwrap();
        let fresh = store.open_volume(&fresh.name).unwrap();
        for e in 0..4u64 {
            fresh.write_at(e * E, &pattern(e, 4096), false).unwrap();
        }
        let placed = allocated_per_device(&store);
        if busy {
            // All four new extents avoid the busy device.
            assert_eq!(placed, vec![1, 4], "busy device 0: {telemetry:?}");
        } else {
            // Idle devices: the new volume stripes over both.
            assert_eq!(placed, vec![3, 2]);
        }
    }
}

#[test]
fn a_device_added_to_a_running_pool_takes_new_extents_and_stays_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        device_count: 1,
        // 4 extents for volumes, and the first one reserved for the device's signature.
        device_capacity_bytes: 5 * E,
        ..StoreConfig::new(dir.path())
    };
    let store = Store::open(&cfg).unwrap();
    store.create_volume("v", 16 * E).unwrap();
    let v = store.open_volume("v").unwrap();
    for e in 0..4 {
        v.write_at(e * E, &pattern(e, 4096), false).unwrap();
    }
    // Full: the fifth extent has nowhere to go.
    assert!(matches!(
        v.write_at(4 * E, &pattern(4, 4096), false),
        Err(StoreError::NoSpace)
    ));
    let added = store.add_device(None, 8 * E).unwrap();
    assert_eq!(
        (
            added.id,
            added.extent_count,
            added.reserved_extents,
            added.free_extents
        ),
        (1, 7, 1, 7)
    );
    assert!(added.path.ends_with("devices/dev-1.img"), "{added:?}");
    // The same volume grows onto it at once, and nothing written before moved.
    for e in 4..8 {
        v.write_at(e * E, &pattern(e, 4096), false).unwrap();
        assert_eq!(v.extent_location(e).unwrap().device, 1);
    }
    v.flush().unwrap();
    assert_eq!(allocated_per_device(&store), vec![4, 4]);
    // A path already in the pool, a RAM pool and a device too small are refused clearly.
    let dev0 = dir.path().join("devices/dev-0.img");
    assert!(matches!(
        store.add_device(Some(&dev0), 8 * E),
        Err(StoreError::DeviceExists(_))
    ));
    let small = store
        .add_device(Some(&dir.path().join("small.img")), 4096)
        .unwrap_err();
    assert!(
        matches!(&small, StoreError::InvalidDevice { reason, .. } if reason.contains("two")),
        "{small}"
    );
    let ram = Store::open_memory(64 * MIB).unwrap();
    assert!(matches!(
        ram.add_device(None, 8 * E),
        Err(StoreError::InvalidDevice { .. })
    ));
    drop(v);
    drop(store);
    // After a restart with the same configuration (one device), the pool has both, and every
    // byte written is where it was.
    let store = Store::open(&cfg).unwrap();
    assert_eq!(store.pool_info().devices.len(), 2);
    let v = store.open_volume("v").unwrap();
    for e in 0..8 {
        assert_eq!(read_vec(&v, e * E, 4096), pattern(e, 4096), "extent {e}");
    }
}

/// A FLUSH syncs only the devices that writes made dirty: the lazy clearing of write-intent
/// bits after a sync (written without sync: a lost clear costs a recompute) does not make
/// its device dirty again, so a loop of one 4 KiB write and one FLUSH syncs one device per
/// FLUSH, not every device it ever wrote to.
#[test]
fn clearing_write_intent_bits_after_a_sync_leaves_nothing_to_sync() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&StoreConfig {
        device_count: 1,
        ..file_config(&dir)
    })
    .unwrap();
    store.create_volume("v", 4 * E).unwrap();
    let v = store.open_volume("v").unwrap();
    let block = pattern(1, 4096);
    // Extent 0 written and synced; then extent 1, whose FLUSH's sync finds extent 0 quiet
    // for a whole sync period and clears its bit.
    v.write_at(0, &block, false).unwrap();
    v.flush().unwrap();
    assert_eq!(v.unsynced_devices(), 0);
    for extent in 1..4 {
        v.write_at(extent * E, &block, false).unwrap();
        assert_eq!(v.unsynced_devices(), 1);
        v.flush().unwrap();
        assert_eq!(
            v.unsynced_devices(),
            0,
            "the sync's own clearing of write-intent bits left the device to sync again"
        );
    }
    assert_eq!(read_vec(&v, 3 * E, 4096), block);
}
