//! The store's half of read routing on replicated volumes: the node picks the copy a read
//! tries first (`Volume::read_at_from`, from `headroom_qos::routing`), sees every copy's
//! location and health (`Volume::copies`), and a copy on a failed device is never read while
//! another one is healthy. Checked on the real redb and device files through each device's
//! read counter.

// Helpers outside `#[test]` functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use headroom_store::{DeviceOp, NewVolume, Store, StoreConfig};
use tempfile::TempDir;

const MIB: u64 = 1 << 20;

fn reads_per_device(store: &Store) -> Vec<u64> {
    let read = DeviceOp::ALL
        .iter()
        .position(|op| *op == DeviceOp::Read)
        .unwrap();
    store
        .device_stats()
        .iter()
        .map(|d| d.ops[read].ops)
        .collect()
}

#[test]
fn a_read_goes_to_the_copy_the_node_chose_unless_its_device_failed() {
    let dir = TempDir::new().unwrap();
    let store = Store::open(&StoreConfig {
        device_count: 3,
        device_capacity_bytes: 32 * MIB,
        ..StoreConfig::new(dir.path())
    })
    .unwrap();
    store
        .create_volume_with(
            "v",
            8 * MIB,
            NewVolume {
                replicas: 2,
                ..NewVolume::default()
            },
        )
        .unwrap();
    let v = store.open_volume("v").unwrap();
    let data = vec![0x5Au8; 4096];
    v.write_at(0, &data, false).unwrap();
    let copies = v.copies(0);
    let (c0, ok0) = copies[0].unwrap();
    let (c1, ok1) = copies[1].unwrap();
    assert!(ok0 && ok1);
    assert_ne!(c0.device, c1.device);
    assert!(copies[2].is_none());
    assert!(v.copies(3).iter().all(Option::is_none)); // a hole
    let (d0, d1) = (c0.device as usize, c1.device as usize);

    let mut buf = vec![0u8; 4096];
    for (first, device) in [(0u8, d0), (1, d1), (0, d0), (1, d1)] {
        let before = reads_per_device(&store);
        v.read_at_from(0, &mut buf, first).unwrap();
        assert_eq!(buf, data);
        let after = reads_per_device(&store);
        let delta: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        let mut expect = vec![0; 3];
        expect[device] = 1;
        assert_eq!(delta, expect, "first copy {first}");
    }
    // Past the last copy wraps around instead of failing.
    let before = reads_per_device(&store);
    assert!(!v.read_at_unless_hole_from(0, &mut buf, 3).unwrap());
    assert_eq!(reads_per_device(&store)[d1] - before[d1], 1);

    // Copy 1's device fails: a read that prefers it is served by copy 0.
    store.fail_device(c1.device).unwrap();
    assert!(!v.copies(0)[1].unwrap().1);
    let before = reads_per_device(&store);
    v.read_at_from(0, &mut buf, 1).unwrap();
    assert_eq!(buf, data);
    let after = reads_per_device(&store);
    assert_eq!(after[d0] - before[d0], 1);
    assert_eq!(after[d1], before[d1]);
}
