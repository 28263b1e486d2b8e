//! Device signatures at open and device admission, on real files in a tempdir: every new
//! device is signed at byte 0 and its first extent never allocated; a device path that leads
//! to another pool's (or another device's) disk is refused and not written; a damaged
//! signature on our own device fails that device without stopping the pool; the caps.

#![allow(clippy::unwrap_used)]

use std::path::Path;

use headroom_store::{AdmissionPolicy, EXTENT_SIZE_BYTES, Store, StoreConfig, StoreError};

const E: u64 = EXTENT_SIZE_BYTES;
const MAGIC: &[u8] = b"HEADROOM-DEVICE\0";

fn config(data: &Path, devices: &[&Path]) -> StoreConfig {
    StoreConfig {
        device_paths: devices.iter().map(|p| p.to_path_buf()).collect(),
        device_capacity_bytes: 8 * E,
        ..StoreConfig::new(data)
    }
}

fn fill(store: &Store, name: &str, extents: u64) {
    store.create_volume(name, extents * E).unwrap();
    let v = store.open_volume(name).unwrap();
    for e in 0..extents {
        v.write_at(e * E, &[7u8; 4096], false).unwrap();
        let at = v.extent_location(e).unwrap();
        assert_ne!(at.offset_bytes, 0, "extent {e} was placed on a signature");
    }
    v.flush().unwrap();
}

#[test]
fn new_devices_are_signed_and_their_first_extent_is_never_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("d0.img");
    let store = Store::open(&config(&dir.path().join("data"), &[&dev])).unwrap();
    // 8 extents, 7 for volumes: all of them fill up without touching extent 0.
    assert_eq!(store.pool_info().free_extents, 7);
    fill(&store, "v", 7);
    assert_eq!(store.pool_info().free_extents, 0);
    let added = store.add_device(None, 4 * E).unwrap();
    assert_eq!((added.extent_count, added.reserved_extents), (3, 1));
    assert!(added.checksums, "{added:?}");
    drop(store);
    let head = std::fs::read(&dev).unwrap();
    assert_eq!(&head[..16], MAGIC);
    let added = std::fs::read(dir.path().join("data/devices/dev-1.img")).unwrap();
    assert_eq!(&added[..16], MAGIC);
    // Both name the same pool (bytes 24..32) and their own device ids (32..36).
    assert_eq!(head[24..32], added[24..32]);
    assert_eq!((head[32], added[32]), (0, 1));
    // And the pool reopens with both.
    let store = Store::open(&config(&dir.path().join("data"), &[&dev])).unwrap();
    assert_eq!(store.pool_info().devices.len(), 2);
    assert!(store.pool_info().devices.iter().all(|d| !d.failed));
}

#[test]
fn a_path_that_leads_to_another_pools_disk_is_refused_and_not_written() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.img");
    let b = dir.path().join("b.img");
    let cfg_a = config(&dir.path().join("pool-a"), &[&a]);
    let cfg_b = config(&dir.path().join("pool-b"), &[&b]);
    drop(Store::open(&cfg_a).unwrap());
    {
        let store = Store::open(&cfg_b).unwrap();
        fill(&store, "b", 2);
    }
    // "After a reboot the disks were renamed": pool A's path now leads to pool B's disk.
    std::fs::rename(&a, dir.path().join("a.saved")).unwrap();
    std::fs::copy(&b, &a).unwrap();
    let before = std::fs::read(&a).unwrap();
    let err = Store::open(&cfg_a).unwrap_err();
    assert!(
        matches!(&err, StoreError::InvalidConfig(m) if m.contains("another disk")),
        "{err}"
    );
    assert!(
        std::fs::read(&a).unwrap() == before,
        "pool B's disk was written"
    );

    // Two devices of one pool swapped: refused too.
    let dir = tempfile::tempdir().unwrap();
    let d0 = dir.path().join("d0.img");
    let d1 = dir.path().join("d1.img");
    let cfg = config(&dir.path().join("data"), &[&d0, &d1]);
    drop(Store::open(&cfg).unwrap());
    let swap = dir.path().join("swap");
    std::fs::rename(&d0, &swap).unwrap();
    std::fs::rename(&d1, &d0).unwrap();
    std::fs::rename(&swap, &d1).unwrap();
    let err = Store::open(&cfg).unwrap_err();
    assert!(err.to_string().contains("signature of device 1"), "{err}");
}

#[test]
fn a_damaged_signature_fails_that_device_only_and_it_is_not_written() {
    let dir = tempfile::tempdir().unwrap();
    let d0 = dir.path().join("d0.img");
    let d1 = dir.path().join("d1.img");
    let cfg = config(&dir.path().join("data"), &[&d0, &d1]);
    {
        let store = Store::open(&cfg).unwrap();
        fill(&store, "v", 4);
    }
    // One byte of device 1's signature flipped (the pool id): the CRC catches it.
    let mut bytes = std::fs::read(&d1).unwrap();
    bytes[25] ^= 0x01;
    std::fs::write(&d1, &bytes).unwrap();
    let before = std::fs::read(&d1).unwrap();
    {
        let store = Store::open(&cfg).unwrap();
        let pool = store.pool_info();
        assert!(!pool.devices[0].failed);
        assert!(pool.devices[1].failed, "{pool:?}");
        // New extents go to device 0 only; device 1 is not written (nor punched).
        store.create_volume("w", 2 * E).unwrap();
        let w = store.open_volume("w").unwrap();
        for e in 0..2 {
            w.write_at(e * E, &[9u8; 4096], false).unwrap();
            assert_eq!(w.extent_location(e).unwrap().device, 0);
        }
        w.flush().unwrap();
    }
    assert!(
        std::fs::read(&d1).unwrap() == before,
        "device 1 was written"
    );
    // Repaired (the byte put back): the next open takes it back.
    bytes[25] ^= 0x01;
    std::fs::write(&d1, &bytes).unwrap();
    let store = Store::open(&cfg).unwrap();
    assert!(store.pool_info().devices.iter().all(|d| !d.failed));
}

#[test]
fn the_size_caps_are_checked_before_anything_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&StoreConfig {
        device_count: 1,
        device_capacity_bytes: 4 * E,
        ..StoreConfig::new(dir.path())
    })
    .unwrap();
    store.set_admission_policy(AdmissionPolicy {
        max_device_bytes: 16 * E,
        max_volume_bytes: 8 * E,
        ..AdmissionPolicy::default()
    });
    let err = store.add_device(None, 17 * E).unwrap_err();
    assert!(err.to_string().contains("max_device_bytes"), "{err}");
    assert!(!dir.path().join("devices/dev-1.img").exists());
    // An existing file larger than the cap is refused too, and left as it was.
    let big = dir.path().join("devices/big.img");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(32 * E)
        .unwrap();
    let err = store.add_device(Some(&big), 4 * E).unwrap_err();
    assert!(err.to_string().contains("max_device_bytes"), "{err}");
    assert_eq!(std::fs::metadata(&big).unwrap().len(), 32 * E);
    // 8 PiB asked for: refused at once, nothing created.
    let err = store.add_device(None, 8 << 50).unwrap_err();
    assert!(err.to_string().contains("max_device_bytes"), "{err}");
    assert_eq!(store.pool_info().devices.len(), 1);
    // Volumes: creating or growing past the cap is refused.
    assert!(matches!(
        store.create_volume("v", 9 * E),
        Err(StoreError::InvalidSize { .. })
    ));
    store.create_volume("v", 8 * E).unwrap();
    assert!(matches!(
        store.resize_volume("v", 9 * E),
        Err(StoreError::InvalidSize { .. })
    ));
}

#[test]
fn a_pool_of_an_older_build_loads_unchanged_and_its_devices_are_not_checked() {
    use redb::{ReadableDatabase, ReadableTable, TableDefinition};
    const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
    const DEVICES: TableDefinition<u32, &str> = TableDefinition::new("devices");
    let dir = tempfile::tempdir().unwrap();
    let dev = dir.path().join("d0.img");
    let data = dir.path().join("data");
    drop(Store::open(&config(&data, &[&dev])).unwrap());
    // Make it what a build before signatures wrote: no pool id, a device record without
    // reserved_extents, and no signature on the device (its first bytes are data).
    {
        let db = redb::Database::open(data.join("meta.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        {
            txn.open_table(META).unwrap().remove("pool_id").unwrap();
            let mut devices = txn.open_table(DEVICES).unwrap();
            let json = devices.get(0).unwrap().unwrap().value().to_string();
            assert!(json.contains("\"reserved_extents\":1"), "{json}");
            let old = json.replace(",\"reserved_extents\":1", "");
            devices.insert(0, old.as_str()).unwrap();
        }
        txn.commit().unwrap();
    }
    let mut bytes = std::fs::read(&dev).unwrap();
    bytes[..4096].fill(0x5a);
    std::fs::write(&dev, &bytes).unwrap();
    let store = Store::open(&config(&data, &[&dev])).unwrap();
    let pool = store.pool_info();
    assert!(!pool.devices[0].failed, "{pool:?}");
    // No room was reserved for checksums on it: it serves without them, and says so.
    assert!(!pool.devices[0].checksums, "{pool:?}");
    // All 8 extents are the volumes' (nothing reserved), extent 0 included.
    assert_eq!(
        (pool.devices[0].reserved_extents, pool.free_extents),
        (0, 8)
    );
    fill_from_zero(&store);
    drop(store);
    // The pool got an id, recorded; the old device stays unsigned and is not checked.
    let db = redb::Database::open(data.join("meta.redb")).unwrap();
    let txn = db.begin_read().unwrap();
    assert!(
        txn.open_table(META)
            .unwrap()
            .get("pool_id")
            .unwrap()
            .is_some()
    );
}

/// One extent written: on a device without reserved extents it lands at offset 0.
fn fill_from_zero(store: &Store) {
    store.create_volume("old", E).unwrap();
    let v = store.open_volume("old").unwrap();
    v.write_at(0, &[1u8; 4096], false).unwrap();
    assert_eq!(v.extent_location(0).unwrap().offset_bytes, 0);
    v.flush().unwrap();
}

#[test]
fn a_file_left_signed_by_a_failed_add_needs_force_and_a_pool_device_is_refused_even_then() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let store = Store::open(&StoreConfig {
        device_count: 1,
        device_capacity_bytes: 4 * E,
        ..StoreConfig::new(&data)
    })
    .unwrap();
    let dev0 = data.join("devices/dev-0.img");
    let head = std::fs::read(&dev0).unwrap()[..64].to_vec();
    // This pool's signature naming device 5, which the pool does not have (an add that
    // failed after signing): a signature like any other, taken with force only.
    let sig = signature_naming(&head, 5);
    let leftover = data.join("devices/leftover.img");
    let mut bytes = vec![0u8; (4 * E) as usize];
    bytes[..64].copy_from_slice(&sig);
    std::fs::write(&leftover, &bytes).unwrap();
    let err = store.add_device(Some(&leftover), 4 * E).unwrap_err();
    assert!(err.to_string().contains("Headroom signature"), "{err}");
    assert!(std::fs::read(&leftover).unwrap() == bytes);
    store
        .add_device_with(Some(&leftover), 4 * E, None, true)
        .unwrap();
    // Device 0 under another name (a hard link): refused even with force.
    let alias = data.join("devices/alias.img");
    std::fs::hard_link(&dev0, &alias).unwrap();
    let err = store
        .add_device_with(Some(&alias), 4 * E, None, true)
        .unwrap_err();
    assert!(err.to_string().contains("device 0 of this pool"), "{err}");
    assert_eq!(&std::fs::read(&dev0).unwrap()[..64], &head[..]);
}

/// An add that stopped after it signed the device and before its record was committed (the
/// crash harness kills the server there) leaves this pool's signature naming the next
/// device id: a retried `device add` takes it back without `force`, unless something other
/// than zeros lies past the reserved extent.
#[test]
fn a_file_left_signed_by_an_unfinished_add_of_the_next_device_is_taken_back() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let store = Store::open(&StoreConfig {
        device_count: 1,
        device_capacity_bytes: 4 * E,
        ..StoreConfig::new(&data)
    })
    .unwrap();
    let head = std::fs::read(data.join("devices/dev-0.img")).unwrap()[..64].to_vec();
    let sig = signature_naming(&head, 1);
    let next = data.join("devices/dev-1.img");
    // With data past the reserved extent: refused, untouched.
    let mut bytes = vec![0u8; (4 * E) as usize];
    bytes[..64].copy_from_slice(&sig);
    bytes[(E + 4096) as usize] = 1;
    std::fs::write(&next, &bytes).unwrap();
    let err = store.add_device(None, 4 * E).unwrap_err();
    assert!(err.to_string().contains("holds data"), "{err}");
    assert!(std::fs::read(&next).unwrap() == bytes);
    // Only the signature: taken back.
    bytes[(E + 4096) as usize] = 0;
    std::fs::write(&next, &bytes).unwrap();
    let info = store.add_device(None, 4 * E).unwrap();
    assert_eq!(info.id, 1);
}

/// The first 64 bytes of a device signature of this pool (`head`, device 0's) made to name
/// device `id`, with its CRC32C recomputed.
fn signature_naming(head: &[u8], id: u32) -> Vec<u8> {
    let mut sig = head.to_vec();
    sig[32..36].copy_from_slice(&id.to_le_bytes());
    let crc = crc32c::crc32c(&sig[..60]);
    sig[60..64].copy_from_slice(&crc.to_le_bytes());
    sig
}
