//! The store's metadata in RADOS (feature `rados`): what `meta.rs` keeps in redb for a file
//! store, kept as omap key/values of **one** object, `meta`, in the store's namespace.
//!
//! Why one object: RADOS applies one write operation on one object atomically (all of its
//! actions or none), so a commit — extent map changes plus management changes, however many —
//! is a single `rados_write_op_operate` with `omap_rm_range` / `omap_rm_keys` / `omap_set`,
//! and a crash of the node mid-commit leaves the previous state, as redb does. Any node that
//! can reach the pool can read it, so another node can open the store after this one died.
//! The cost: every extent row of the store is in that one object, and the OSDs warn about
//! omaps above 200,000 keys (`osd_deep_scrub_large_omap_object_key_threshold`), about
//! 400 GiB of written extents; sharding it per volume (with a commit that then spans objects)
//! is left for later.
//!
//! Keys (ASCII, so the omap's byte order is also id order):
//! - `m.format_version`, `m.extent_size_bytes`, `m.next_volume_id`, `m.clean`: decimal text
//! - `d.<device id as 8 hex>`: JSON `DeviceRecord`
//! - `v.<volume id as 16 hex>`: JSON `VolumeRecord`
//! - `e.<volume id as 16 hex>.<logical extent as 16 hex>`: the physical extent, 8 bytes LE
//!   (`PhysExtent::to_db`)
//! - `c.<volume id as 16 hex>`: the volume's opaque runtime QoS state (credit balances)
//! - `t.<tenant id>`: JSON `TenantRecord`
//!
//! Only the lease holder writes (lease.rs), so within the process a mutex orders commits and
//! credit saves, and the set of existing volume ids kept here is exact: a credit save skips
//! deleted volumes as the redb one does.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CStr;
use std::sync::{Arc, Mutex};

use crate::error::{MetadataError, StoreError};
use crate::layout::{EXTENT_SIZE_BYTES, PhysExtent};
use crate::meta::{
    DeviceRecord, ExtentChange, FORMAT_VERSION, KEY_CLEAN, KEY_EXTENT_SIZE, KEY_FORMAT,
    KEY_NEXT_VOLUME_ID, KEY_POOL_ID, Loaded, MetaOp, TenantRecord, VolumeRecord,
    json_err_pub as json_err,
};
use crate::rados::{OmapBatch, OmapEntries, Pool};

/// The object holding the metadata.
pub(crate) const META_OBJECT: &CStr = c"meta";

pub(crate) struct RadosMeta {
    pool: Arc<Pool>,
    /// Ids of the volumes that exist; also orders commits and saves.
    volumes: Mutex<BTreeSet<u64>>,
}

impl std::fmt::Debug for RadosMeta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RadosMeta")
            .field("pool", &self.pool.label)
            .finish()
    }
}

fn m_key(k: &str) -> Vec<u8> {
    format!("m.{k}").into_bytes()
}
fn vol_key(id: u64) -> Vec<u8> {
    format!("v.{id:016x}").into_bytes()
}
fn credit_key(id: u64) -> Vec<u8> {
    format!("c.{id:016x}").into_bytes()
}
fn extent_key(id: u64, extent: u64) -> Vec<u8> {
    format!("e.{id:016x}.{extent:016x}").into_bytes()
}

fn corrupt(what: String) -> StoreError {
    StoreError::Metadata(MetadataError::Corrupt(what))
}

/// Changes to the omap, in the order given: a later change of a key replaces an earlier
/// one, and a range removal drops the earlier changes it covers.
#[derive(Default)]
struct Pending {
    ranges: Vec<(Vec<u8>, Vec<u8>)>,
    keys: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
}

impl Pending {
    fn set(&mut self, k: Vec<u8>, v: Vec<u8>) {
        self.keys.insert(k, Some(v));
    }
    fn rm(&mut self, k: Vec<u8>) {
        self.keys.insert(k, None);
    }
    fn rm_range(&mut self, b: Vec<u8>, e: Vec<u8>) {
        self.keys.retain(|k, _| !(*k >= b && *k < e));
        self.ranges.push((b, e));
    }
    fn into_batch(self) -> OmapBatch {
        let mut batch = OmapBatch {
            rm_ranges: self.ranges,
            ..OmapBatch::default()
        };
        for (k, v) in self.keys {
            match v {
                Some(v) => batch.set.push((k, v)),
                None => batch.rm.push(k),
            }
        }
        batch
    }
}

impl RadosMeta {
    pub(crate) fn new(pool: Arc<Pool>) -> RadosMeta {
        RadosMeta {
            pool,
            volumes: Mutex::new(BTreeSet::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<u64>> {
        self.volumes.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn entries(&self, prefix: &CStr) -> Result<Option<OmapEntries>, StoreError> {
        Ok(self.pool.omap_load(META_OBJECT, prefix)?)
    }

    pub(crate) fn load(&self) -> Result<Option<Loaded>, StoreError> {
        // An object without entries is a new store: the lease takes its lock on the object
        // before the first commit (lease.rs), which creates it empty.
        let Some(entries) = self.entries(c"")?.filter(|e| !e.is_empty()) else {
            return Ok(None);
        };
        let mut meta: BTreeMap<String, u64> = BTreeMap::new();
        let mut loaded = Loaded::default();
        for (k, v) in entries {
            let key = String::from_utf8(k).map_err(|_| corrupt("omap key not UTF-8".into()))?;
            let hex = |s: &str| {
                u64::from_str_radix(s, 16).map_err(|_| corrupt(format!("bad omap key {key}")))
            };
            if let Some(name) = key.strip_prefix("m.") {
                let n = std::str::from_utf8(&v)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| corrupt(format!("bad value of {key}")))?;
                meta.insert(name.to_string(), n);
            } else if let Some(id) = key.strip_prefix("d.") {
                let rec: DeviceRecord = serde_json::from_slice(&v).map_err(json_err)?;
                loaded.devices.push((hex(id)? as u32, rec));
            } else if let Some(id) = key.strip_prefix("v.") {
                let rec: VolumeRecord = serde_json::from_slice(&v).map_err(json_err)?;
                loaded.volumes.push((hex(id)?, rec));
            } else if let Some(rest) = key.strip_prefix("e.") {
                let (vol, ext) = rest
                    .split_once('.')
                    .ok_or_else(|| corrupt(format!("bad omap key {key}")))?;
                let raw: [u8; 8] = v
                    .as_slice()
                    .try_into()
                    .map_err(|_| corrupt(format!("bad value of {key}")))?;
                loaded.extents.push((
                    hex(vol)?,
                    hex(ext)?,
                    PhysExtent::from_db(u64::from_le_bytes(raw)),
                ));
            } else if let Some(id) = key.strip_prefix("t.") {
                let rec: TenantRecord = serde_json::from_slice(&v).map_err(json_err)?;
                loaded.tenants.push((id.to_string(), rec));
            }
        }
        let Some(&format) = meta.get(KEY_FORMAT) else {
            return Ok(None);
        };
        if format != FORMAT_VERSION {
            return Err(MetadataError::Unsupported(format!(
                "format version {format}, this build reads {FORMAT_VERSION}"
            ))
            .into());
        }
        let extent_size = meta.get(KEY_EXTENT_SIZE).copied().unwrap_or(0);
        if extent_size != EXTENT_SIZE_BYTES {
            return Err(MetadataError::Unsupported(format!(
                "extent size {extent_size}, this build uses {EXTENT_SIZE_BYTES}"
            ))
            .into());
        }
        loaded.next_volume_id = meta.get(KEY_NEXT_VOLUME_ID).copied().unwrap_or(1);
        loaded.clean = meta.get(KEY_CLEAN) == Some(&1);
        loaded.pool_id = meta.get(KEY_POOL_ID).copied();
        *self.lock() = loaded.volumes.iter().map(|(id, _)| *id).collect();
        Ok(Some(loaded))
    }

    pub(crate) fn commit(
        &self,
        changes: &[ExtentChange],
        ops: &[MetaOp],
    ) -> Result<(), StoreError> {
        let mut volumes = self.lock();
        let mut after = volumes.clone();
        let mut p = Pending::default();
        for c in changes {
            match *c {
                ExtentChange::Map {
                    volume_id,
                    replica: 0,
                    extent,
                    phys,
                } => p.set(
                    extent_key(volume_id, extent),
                    phys.to_db().to_le_bytes().to_vec(),
                ),
                ExtentChange::Unmap {
                    volume_id,
                    replica: 0,
                    extent,
                } => p.rm(extent_key(volume_id, extent)),
                // A RADOS store refuses replicated volumes (Ceph keeps the copies).
                ExtentChange::Map { volume_id, .. } | ExtentChange::Unmap { volume_id, .. } => {
                    return Err(corrupt(format!(
                        "volume {volume_id}: a RADOS store keeps one replica of each extent"
                    )));
                }
            }
        }
        let num = |n: u64| n.to_string().into_bytes();
        for op in ops {
            match op {
                MetaOp::Init => {
                    p.set(m_key(KEY_FORMAT), num(FORMAT_VERSION));
                    p.set(m_key(KEY_EXTENT_SIZE), num(EXTENT_SIZE_BYTES));
                    p.set(m_key(KEY_NEXT_VOLUME_ID), num(1));
                }
                MetaOp::PutDevice(id, rec) => p.set(
                    format!("d.{id:08x}").into_bytes(),
                    serde_json::to_vec(rec).map_err(json_err)?,
                ),
                MetaOp::PutVolume(id, rec) => {
                    p.set(vol_key(*id), serde_json::to_vec(rec).map_err(json_err)?);
                    after.insert(*id);
                }
                MetaOp::DeleteVolume(id) => {
                    p.rm(vol_key(*id));
                    p.rm(credit_key(*id));
                    // Every "e.<id>." key: '/' is the byte after '.'.
                    p.rm_range(
                        format!("e.{id:016x}.").into_bytes(),
                        format!("e.{id:016x}/").into_bytes(),
                    );
                    after.remove(id);
                }
                MetaOp::SetNextVolumeId(n) => p.set(m_key(KEY_NEXT_VOLUME_ID), num(*n)),
                MetaOp::SetClean(clean) => p.set(m_key(KEY_CLEAN), num(u64::from(*clean))),
                MetaOp::SetPoolId(id) => p.set(m_key(KEY_POOL_ID), num(*id)),
                MetaOp::PutTenant(id, rec) => p.set(
                    format!("t.{id}").into_bytes(),
                    serde_json::to_vec(rec).map_err(json_err)?,
                ),
                MetaOp::DeleteTenant(id) => p.rm(format!("t.{id}").into_bytes()),
                // The store refuses to fail the one device of a RADOS pool.
                MetaOp::FailDevice(id) | MetaOp::RestoreDevice(id) => {
                    return Err(corrupt(format!(
                        "device {id}: a RADOS store does not fail or restore its device"
                    )));
                }
            }
        }
        self.pool.omap_commit(META_OBJECT, &p.into_batch())?;
        *volumes = after;
        Ok(())
    }

    pub(crate) fn save_states(&self, states: &[(u64, Vec<u8>)]) -> Result<usize, StoreError> {
        let volumes = self.lock();
        let mut p = Pending::default();
        let mut saved = 0;
        for (id, bytes) in states {
            if volumes.contains(id) {
                p.set(credit_key(*id), bytes.clone());
                saved += 1;
            }
        }
        if saved > 0 {
            self.pool.omap_commit(META_OBJECT, &p.into_batch())?;
        }
        Ok(saved)
    }

    pub(crate) fn load_states(&self) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let volumes = self.lock().clone();
        let mut out = Vec::new();
        for (k, v) in self.entries(c"c.")?.unwrap_or_default() {
            if let Some(id) = k.strip_prefix(b"c.")
                && let Some(id) = std::str::from_utf8(id)
                    .ok()
                    .and_then(|s| u64::from_str_radix(s, 16).ok())
                && volumes.contains(&id)
            {
                out.push((id, v));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_keeps_the_last_change_and_a_range_drops_what_it_covers() {
        let mut p = Pending::default();
        p.set(extent_key(1, 0), vec![1]);
        p.set(extent_key(2, 0), vec![2]);
        p.rm(extent_key(2, 0));
        p.rm_range(
            b"e.0000000000000001.".to_vec(),
            b"e.0000000000000001/".to_vec(),
        );
        p.set(vol_key(3), vec![3]);
        let b = p.into_batch();
        assert_eq!(b.rm_ranges.len(), 1);
        assert_eq!(b.rm, vec![extent_key(2, 0)]);
        assert_eq!(b.set, vec![(vol_key(3), vec![3])]);
        // Extent keys sort by volume, then extent; the range of volume 1 holds exactly its keys.
        assert!(extent_key(1, u64::MAX) < b"e.0000000000000001/".to_vec());
        assert!(extent_key(2, 0) > b"e.0000000000000001/".to_vec());
    }

    /// Against the cluster of `HEADROOM_TEST_CEPH_CONF` (as `scripts/test` sets); skipped
    /// without one. The same round trip as meta.rs's redb test, in a namespace of its own.
    #[test]
    fn round_trip_in_rados() {
        let Some(conf) = std::env::var_os("HEADROOM_TEST_CEPH_CONF") else {
            eprintln!("SKIPPED: no HEADROOM_TEST_CEPH_CONF");
            return;
        };
        let pool = std::env::var("HEADROOM_TEST_CEPH_POOL").unwrap_or_else(|_| "headroom".into());
        let ns = crate::rados::new_namespace().unwrap();
        let id = std::env::var("HEADROOM_TEST_CEPH_ID").unwrap_or_else(|_| "admin".into());
        let p = Arc::new(Pool::connect(std::path::Path::new(&conf), &id, &pool, &ns).unwrap());
        let m = RadosMeta::new(Arc::clone(&p));
        assert!(m.load().unwrap().is_none());
        let dev = DeviceRecord {
            path: format!("rados:{pool}/{ns}"),
            relative: false,
            capacity_bytes: 8 * EXTENT_SIZE_BYTES,
            failure_domain: None,
            failed: false,
            reserved_extents: 0,
        };
        let vol = VolumeRecord {
            name: "v".into(),
            size_bytes: 4096,
            created_unix_s: 7,
            qos: Some(r#"{"iops":100}"#.into()),
            tenant: Some("alice".into()),
            read_only: true,
            replicas: 1,
            attachments: None,
        };
        let phys = |index| PhysExtent { device: 0, index };
        m.commit(
            &[
                ExtentChange::Map {
                    volume_id: 3,
                    replica: 0,
                    extent: 0,
                    phys: phys(5),
                },
                ExtentChange::Map {
                    volume_id: 3,
                    replica: 0,
                    extent: 1,
                    phys: phys(6),
                },
                ExtentChange::Unmap {
                    volume_id: 3,
                    replica: 0,
                    extent: 1,
                },
                ExtentChange::Map {
                    volume_id: 4,
                    replica: 0,
                    extent: 2,
                    phys: phys(7),
                },
            ],
            &[
                MetaOp::Init,
                MetaOp::PutDevice(0, dev.clone()),
                MetaOp::PutVolume(3, vol.clone()),
                MetaOp::PutVolume(4, vol.clone()),
                MetaOp::SetNextVolumeId(5),
                MetaOp::SetClean(true),
                MetaOp::PutTenant("alice".into(), TenantRecord { created_unix_s: 1 }),
            ],
        )
        .unwrap();
        // A second reader (another node) sees the same.
        let other = RadosMeta::new(Arc::clone(&p));
        let l = other.load().unwrap().unwrap();
        assert_eq!(l.next_volume_id, 5);
        assert!(l.clean);
        assert_eq!(l.devices, vec![(0, dev)]);
        assert_eq!(l.volumes, vec![(3, vol.clone()), (4, vol)]);
        assert_eq!(l.extents, vec![(3, 0, phys(5)), (4, 2, phys(7))]);
        assert_eq!(l.tenants.len(), 1);
        assert_eq!(m.save_states(&[(3, vec![1, 2]), (9, vec![3])]).unwrap(), 1);
        assert_eq!(other.load_states().unwrap(), vec![(3, vec![1, 2])]);
        m.commit(
            &[],
            &[
                MetaOp::DeleteVolume(3),
                MetaOp::DeleteTenant("alice".into()),
            ],
        )
        .unwrap();
        let l = other.load().unwrap().unwrap();
        assert_eq!(l.volumes.len(), 1);
        assert_eq!(l.extents, vec![(4, 2, phys(7))]);
        assert!(l.tenants.is_empty());
        assert!(other.load_states().unwrap().is_empty());
        assert_eq!(m.save_states(&[(3, vec![1])]).unwrap(), 0);
        p.remove(META_OBJECT).unwrap();
    }
}
