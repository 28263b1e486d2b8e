//! Durable metadata in redb: format, devices, volumes and extent maps.
//!
//! Why: the extent maps are what make a volume's bytes findable after a restart, so they
//! live in a crash-safe transactional store. redb commits with `Durability::Immediate`
//! (checksummed commit slot + fsync), so a commit that returned is on disk, and a crash mid-
//! commit leaves the previous state. This module only encodes and decodes; *when* to commit
//! is the store's protocol (see `store.rs`).
//!
//! Tables:
//! - `meta`: `&str -> u64` (`format_version`, `extent_size_bytes`, `next_volume_id`, `clean`)
//! - `devices`: `u32 -> JSON DeviceRecord`
//! - `volumes`: `u64 -> JSON VolumeRecord` (the record carries the volume's QoS as an opaque
//!   string: the store must not depend on the QoS crate, so the node layer owns its meaning)
//! - `extents`: `(volume id, logical extent) -> (device << 32 | physical extent)`: replica 0
//!   of every volume (the only copy of a 1-replica volume)
//! - `replica_extents`: `(volume id, replica, logical extent) -> (device << 32 | physical
//!   extent)`: replicas 1 and 2 of replicated volumes. A logical extent's rows of every
//!   replica are written and removed in the same transaction. Absent (empty) in databases
//!   of builds before replication and in pools without replicated volumes.
//! - `tenants`: `&str (tenant id) -> JSON TenantRecord`: the tenants the operator created. A
//!   database of a build before this table has none; opening it registers every tenant its
//!   volumes name, so old data directories keep working.
//! - `credits`: `u64 (volume id) -> opaque bytes`: the node's runtime QoS state (credit
//!   balances), saved about once a second in its own transaction. It is kept apart from
//!   `volumes` so that a save rewrites small rows and never the volume records, and a row goes
//!   away in the same transaction as its volume.
//!
//! The additions are backward compatible, so `FORMAT_VERSION` stays 1: a record without
//! `qos`, `tenant` or `read_only` loads as no QoS, no tenant and writable, a missing `credits`
//! table reads as empty, and a record without them is written exactly as before (so an older
//! build still reads it). An older build reading a record *with* `tenant` or `read_only`
//! ignores them (serde skips unknown fields) and would serve the volume to everyone,
//! writable: do not downgrade a node that has tenant volumes. The same holds for
//! `replicas` (a volume record field, absent for 1 replica) and `failure_domain` / `failed`
//! (device record fields): an older build would serve replica 0 only and count the other
//! replicas' extents as free space, so do not downgrade a node with replicated volumes.

use std::path::Path;

use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::error::{MetadataError, StoreError};
use crate::layout::{EXTENT_SIZE_BYTES, PhysExtent};

const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const DEVICES: TableDefinition<u32, &str> = TableDefinition::new("devices");
const VOLUMES: TableDefinition<u64, &str> = TableDefinition::new("volumes");
const EXTENTS: TableDefinition<(u64, u64), u64> = TableDefinition::new("extents");
const REPLICA_EXTENTS: TableDefinition<(u64, u64, u64), u64> =
    TableDefinition::new("replica_extents");
const CREDITS: TableDefinition<u64, &[u8]> = TableDefinition::new("credits");
const TENANTS: TableDefinition<&str, &str> = TableDefinition::new("tenants");

/// Version of the table layout above; bump on any incompatible change.
pub(crate) const FORMAT_VERSION: u64 = 1;

pub(crate) const KEY_FORMAT: &str = "format_version";
pub(crate) const KEY_EXTENT_SIZE: &str = "extent_size_bytes";
pub(crate) const KEY_NEXT_VOLUME_ID: &str = "next_volume_id";
pub(crate) const KEY_CLEAN: &str = "clean";

/// redb page cache; the hot path never reads redb, so it can stay small.
const CACHE_SIZE_BYTES: usize = 32 << 20;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DeviceRecord {
    /// Path as given, or relative to the data directory when `relative` is set.
    pub path: String,
    pub relative: bool,
    pub capacity_bytes: u64,
    /// The failure domain the operator declared (a host, a shelf, a power feed): replicas
    /// of one extent go to distinct domains when the pool has enough. Absent: none declared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
    /// The operator failed the device (`headroom device fail`): it is never read, written
    /// or allocated on again. Absent (false) in records of older builds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct VolumeRecord {
    pub name: String,
    pub size_bytes: u64,
    pub created_unix_s: u64,
    /// Opaque QoS settings (JSON owned by the node layer); absent in records of older builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qos: Option<String>,
    /// The tenant the volume belongs to (a TLS client's PSK identity or certificate CN);
    /// absent in records of older builds and for volumes of no tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Exported read-only; absent (false) in records of older builds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// Copies of every extent, on distinct devices (1 to `MAX_REPLICAS`); absent (1) in
    /// records of older builds and of 1-replica volumes, so those are written as before.
    #[serde(default = "one_replica", skip_serializing_if = "is_one_replica")]
    pub replicas: u8,
}

fn one_replica() -> u8 {
    1
}

fn is_one_replica(n: &u8) -> bool {
    *n == 1
}

/// A tenant as stored (its id is the key).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TenantRecord {
    pub created_unix_s: u64,
}

/// Everything stored, as loaded at open.
#[derive(Debug, Default)]
pub(crate) struct Loaded {
    pub next_volume_id: u64,
    /// The previous process shut down after committing everything and punching all frees.
    pub clean: bool,
    pub devices: Vec<(u32, DeviceRecord)>,
    pub volumes: Vec<(u64, VolumeRecord)>,
    pub extents: Vec<(u64, u64, PhysExtent)>,
    /// Rows of replicas 1 and 2: (volume id, replica, logical extent, physical extent).
    pub replica_extents: Vec<(u64, u8, u64, PhysExtent)>,
    /// Empty for a database of a build before the `tenants` table.
    pub tenants: Vec<(String, TenantRecord)>,
}

/// One change to an extent map row (of replica `replica`: 0 is the `extents` table).
#[derive(Clone, Copy, Debug)]
pub(crate) enum ExtentChange {
    Map {
        volume_id: u64,
        replica: u8,
        extent: u64,
        phys: PhysExtent,
    },
    Unmap {
        volume_id: u64,
        replica: u8,
        extent: u64,
    },
}

/// A management change committed together with pending extent changes.
#[derive(Clone, Debug)]
pub(crate) enum MetaOp {
    Init,
    PutDevice(u32, DeviceRecord),
    PutVolume(u64, VolumeRecord),
    DeleteVolume(u64),
    SetNextVolumeId(u64),
    SetClean(bool),
    PutTenant(String, TenantRecord),
    DeleteTenant(String),
    /// Sets `failed` in the record of device `id` (which must exist).
    FailDevice(u32),
    /// Clears `failed` in the record of device `id` (`Store::restore_device`).
    RestoreDevice(u32),
}

/// Where the metadata lives: redb (file and RAM stores, and RADOS stores of the first
/// slice that kept `meta.redb`), or the omap of one RADOS object (`rados_meta.rs`).
#[derive(Debug)]
pub(crate) struct Meta {
    db: Database,
    #[cfg(feature = "rados")]
    rados: Option<crate::rados_meta::RadosMeta>,
}

#[cfg(feature = "rados")]
pub(crate) fn json_err_pub(e: serde_json::Error) -> StoreError {
    json_err(e)
}

fn redb_err(e: impl Into<redb::Error>) -> StoreError {
    StoreError::Metadata(MetadataError::Redb(e.into()))
}

fn json_err(e: serde_json::Error) -> StoreError {
    StoreError::Metadata(MetadataError::Encoding(e))
}

impl Meta {
    pub(crate) fn open_file(path: &Path) -> Result<Meta, StoreError> {
        let db = redb::Builder::new()
            .set_cache_size(CACHE_SIZE_BYTES)
            .create(path)
            .map_err(redb_err)?;
        Ok(Meta {
            db,
            #[cfg(feature = "rados")]
            rados: None,
        })
    }

    /// Metadata kept in the omap of the object `meta` of the pool's namespace.
    #[cfg(feature = "rados")]
    pub(crate) fn open_rados(pool: std::sync::Arc<crate::rados::Pool>) -> Result<Meta, StoreError> {
        let mut m = Meta::open_memory()?;
        m.rados = Some(crate::rados_meta::RadosMeta::new(pool));
        Ok(m)
    }

    pub(crate) fn open_memory() -> Result<Meta, StoreError> {
        let db = redb::Builder::new()
            .set_cache_size(CACHE_SIZE_BYTES)
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .map_err(redb_err)?;
        Ok(Meta {
            db,
            #[cfg(feature = "rados")]
            rados: None,
        })
    }

    /// Loads everything; `None` for a database that was never initialised.
    pub(crate) fn load(&self) -> Result<Option<Loaded>, StoreError> {
        #[cfg(feature = "rados")]
        if let Some(r) = &self.rados {
            return r.load();
        }
        let txn = self.db.begin_read().map_err(redb_err)?;
        let meta = match txn.open_table(META) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(redb_err(e)),
        };
        let get = |k: &str| -> Result<Option<u64>, StoreError> {
            Ok(meta.get(k).map_err(redb_err)?.map(|v| v.value()))
        };
        let Some(format) = get(KEY_FORMAT)? else {
            return Ok(None);
        };
        if format != FORMAT_VERSION {
            return Err(MetadataError::Unsupported(format!(
                "format version {format}, this build reads {FORMAT_VERSION}"
            ))
            .into());
        }
        let extent_size = get(KEY_EXTENT_SIZE)?.unwrap_or(0);
        if extent_size != EXTENT_SIZE_BYTES {
            return Err(MetadataError::Unsupported(format!(
                "extent size {extent_size}, this build uses {EXTENT_SIZE_BYTES}"
            ))
            .into());
        }
        let mut loaded = Loaded {
            next_volume_id: get(KEY_NEXT_VOLUME_ID)?.unwrap_or(1),
            clean: get(KEY_CLEAN)? == Some(1),
            ..Loaded::default()
        };
        let devices = txn.open_table(DEVICES).map_err(redb_err)?;
        for row in devices.iter().map_err(redb_err)? {
            let (k, v) = row.map_err(redb_err)?;
            let rec: DeviceRecord = serde_json::from_str(v.value()).map_err(json_err)?;
            loaded.devices.push((k.value(), rec));
        }
        let volumes = txn.open_table(VOLUMES).map_err(redb_err)?;
        for row in volumes.iter().map_err(redb_err)? {
            let (k, v) = row.map_err(redb_err)?;
            let rec: VolumeRecord = serde_json::from_str(v.value()).map_err(json_err)?;
            loaded.volumes.push((k.value(), rec));
        }
        match txn.open_table(TENANTS) {
            Ok(tenants) => {
                for row in tenants.iter().map_err(redb_err)? {
                    let (k, v) = row.map_err(redb_err)?;
                    let rec: TenantRecord = serde_json::from_str(v.value()).map_err(json_err)?;
                    loaded.tenants.push((k.value().to_string(), rec));
                }
            }
            Err(redb::TableError::TableDoesNotExist(_)) => {}
            Err(e) => return Err(redb_err(e)),
        }
        let extents = txn.open_table(EXTENTS).map_err(redb_err)?;
        for row in extents.iter().map_err(redb_err)? {
            let (k, v) = row.map_err(redb_err)?;
            let (volume_id, extent) = k.value();
            loaded
                .extents
                .push((volume_id, extent, PhysExtent::from_db(v.value())));
        }
        match txn.open_table(REPLICA_EXTENTS) {
            Ok(rows) => {
                for row in rows.iter().map_err(redb_err)? {
                    let (k, v) = row.map_err(redb_err)?;
                    let (volume_id, replica, extent) = k.value();
                    let replica = u8::try_from(replica).map_err(|_| {
                        MetadataError::Corrupt(format!(
                            "volume {volume_id} has a row of replica {replica}"
                        ))
                    })?;
                    loaded.replica_extents.push((
                        volume_id,
                        replica,
                        extent,
                        PhysExtent::from_db(v.value()),
                    ));
                }
            }
            Err(redb::TableError::TableDoesNotExist(_)) => {}
            Err(e) => return Err(redb_err(e)),
        }
        Ok(Some(loaded))
    }

    /// Applies `changes` in order, then `ops`, in one transaction committed with immediate
    /// durability. Nothing is applied if it fails.
    pub(crate) fn commit(
        &self,
        changes: &[ExtentChange],
        ops: &[MetaOp],
    ) -> Result<(), StoreError> {
        #[cfg(feature = "rados")]
        if let Some(r) = &self.rados {
            return r.commit(changes, ops);
        }
        let txn = self.db.begin_write().map_err(redb_err)?;
        {
            let mut meta = txn.open_table(META).map_err(redb_err)?;
            let mut devices = txn.open_table(DEVICES).map_err(redb_err)?;
            let mut volumes = txn.open_table(VOLUMES).map_err(redb_err)?;
            let mut extents = txn.open_table(EXTENTS).map_err(redb_err)?;
            let mut credits = txn.open_table(CREDITS).map_err(redb_err)?;
            let mut tenants = txn.open_table(TENANTS).map_err(redb_err)?;
            let mut replica_extents = txn.open_table(REPLICA_EXTENTS).map_err(redb_err)?;
            for c in changes {
                match *c {
                    ExtentChange::Map {
                        volume_id,
                        replica: 0,
                        extent,
                        phys,
                    } => {
                        extents
                            .insert((volume_id, extent), phys.to_db())
                            .map_err(redb_err)?;
                    }
                    ExtentChange::Map {
                        volume_id,
                        replica,
                        extent,
                        phys,
                    } => {
                        replica_extents
                            .insert((volume_id, u64::from(replica), extent), phys.to_db())
                            .map_err(redb_err)?;
                    }
                    ExtentChange::Unmap {
                        volume_id,
                        replica: 0,
                        extent,
                    } => {
                        extents.remove((volume_id, extent)).map_err(redb_err)?;
                    }
                    ExtentChange::Unmap {
                        volume_id,
                        replica,
                        extent,
                    } => {
                        replica_extents
                            .remove((volume_id, u64::from(replica), extent))
                            .map_err(redb_err)?;
                    }
                }
            }
            for op in ops {
                match op {
                    MetaOp::Init => {
                        meta.insert(KEY_FORMAT, FORMAT_VERSION).map_err(redb_err)?;
                        meta.insert(KEY_EXTENT_SIZE, EXTENT_SIZE_BYTES)
                            .map_err(redb_err)?;
                        meta.insert(KEY_NEXT_VOLUME_ID, 1).map_err(redb_err)?;
                    }
                    MetaOp::PutDevice(id, rec) => {
                        let json = serde_json::to_string(rec).map_err(json_err)?;
                        devices.insert(*id, json.as_str()).map_err(redb_err)?;
                    }
                    MetaOp::PutVolume(id, rec) => {
                        let json = serde_json::to_string(rec).map_err(json_err)?;
                        volumes.insert(*id, json.as_str()).map_err(redb_err)?;
                    }
                    MetaOp::DeleteVolume(id) => {
                        volumes.remove(*id).map_err(redb_err)?;
                        credits.remove(*id).map_err(redb_err)?;
                        extents
                            .retain_in((*id, 0u64)..=(*id, u64::MAX), |_, _| false)
                            .map_err(redb_err)?;
                        replica_extents
                            .retain_in((*id, 0u64, 0u64)..=(*id, u64::MAX, u64::MAX), |_, _| false)
                            .map_err(redb_err)?;
                    }
                    MetaOp::SetNextVolumeId(n) => {
                        meta.insert(KEY_NEXT_VOLUME_ID, *n).map_err(redb_err)?;
                    }
                    MetaOp::SetClean(clean) => {
                        meta.insert(KEY_CLEAN, u64::from(*clean))
                            .map_err(redb_err)?;
                    }
                    MetaOp::PutTenant(id, rec) => {
                        let json = serde_json::to_string(rec).map_err(json_err)?;
                        tenants
                            .insert(id.as_str(), json.as_str())
                            .map_err(redb_err)?;
                    }
                    MetaOp::DeleteTenant(id) => {
                        tenants.remove(id.as_str()).map_err(redb_err)?;
                    }
                    MetaOp::FailDevice(id) | MetaOp::RestoreDevice(id) => {
                        let json = devices
                            .get(*id)
                            .map_err(redb_err)?
                            .map(|v| v.value().to_string())
                            .ok_or_else(|| {
                                MetadataError::Corrupt(format!("no record of device {id}"))
                            })?;
                        let mut rec: DeviceRecord =
                            serde_json::from_str(&json).map_err(json_err)?;
                        rec.failed = matches!(op, MetaOp::FailDevice(_));
                        let json = serde_json::to_string(&rec).map_err(json_err)?;
                        devices.insert(*id, json.as_str()).map_err(redb_err)?;
                    }
                }
            }
        }
        txn.commit().map_err(redb_err)
    }

    /// Upserts the state row of every listed volume that still exists, in one transaction
    /// committed with immediate durability; rows of unknown (deleted) volumes are skipped.
    /// Returns how many rows were written. The existence check runs inside the transaction,
    /// and redb serialises write transactions, so a save can never resurrect the row of a
    /// volume whose deletion committed first (and a row saved just before a deletion is
    /// removed by it).
    pub(crate) fn save_states(&self, states: &[(u64, Vec<u8>)]) -> Result<usize, StoreError> {
        if states.is_empty() {
            return Ok(0);
        }
        #[cfg(feature = "rados")]
        if let Some(r) = &self.rados {
            return r.save_states(states);
        }
        let mut txn = self.db.begin_write().map_err(redb_err)?;
        txn.set_durability(Durability::Immediate)
            .map_err(redb_err)?;
        let mut saved = 0;
        {
            let volumes = txn.open_table(VOLUMES).map_err(redb_err)?;
            let mut credits = txn.open_table(CREDITS).map_err(redb_err)?;
            for (id, bytes) in states {
                if volumes.get(*id).map_err(redb_err)?.is_none() {
                    continue;
                }
                credits.insert(*id, bytes.as_slice()).map_err(redb_err)?;
                saved += 1;
            }
        }
        txn.commit().map_err(redb_err)?;
        Ok(saved)
    }

    /// Every state row of an existing volume, by volume id. (Rows of unknown volumes exist
    /// only if an older build, which does not know the table, deleted the volume; volume ids
    /// are never reused, so they are skipped rather than reported.)
    pub(crate) fn load_states(&self) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        #[cfg(feature = "rados")]
        if let Some(r) = &self.rados {
            return r.load_states();
        }
        let txn = self.db.begin_read().map_err(redb_err)?;
        let credits = match txn.open_table(CREDITS) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(redb_err(e)),
        };
        let volumes = txn.open_table(VOLUMES).map_err(redb_err)?;
        let mut out = Vec::new();
        for row in credits.iter().map_err(redb_err)? {
            let (k, v) = row.map_err(redb_err)?;
            let id = k.value();
            if volumes.get(id).map_err(redb_err)?.is_some() {
                out.push((id, v.value().to_vec()));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_in_memory() {
        let m = Meta::open_memory().unwrap();
        assert!(m.load().unwrap().is_none());
        let dev = DeviceRecord {
            path: "devices/dev-0.img".into(),
            relative: true,
            capacity_bytes: 8 * EXTENT_SIZE_BYTES,
            failure_domain: None,
            failed: false,
        };
        let vol = VolumeRecord {
            name: "v".into(),
            size_bytes: 4096,
            created_unix_s: 7,
            qos: Some(r#"{"iops":100}"#.into()),
            tenant: Some("alice".into()),
            read_only: true,
            replicas: 1,
        };
        let p = PhysExtent {
            device: 0,
            index: 5,
        };
        m.commit(
            &[
                ExtentChange::Map {
                    volume_id: 3,
                    replica: 0,
                    extent: 0,
                    phys: p,
                },
                ExtentChange::Map {
                    volume_id: 3,
                    replica: 0,
                    extent: 1,
                    phys: PhysExtent {
                        device: 0,
                        index: 6,
                    },
                },
                ExtentChange::Unmap {
                    volume_id: 3,
                    replica: 0,
                    extent: 1,
                },
            ],
            &[
                MetaOp::Init,
                MetaOp::PutDevice(0, dev.clone()),
                MetaOp::PutVolume(3, vol.clone()),
                MetaOp::SetNextVolumeId(4),
                MetaOp::SetClean(true),
            ],
        )
        .unwrap();
        let l = m.load().unwrap().unwrap();
        assert_eq!(l.next_volume_id, 4);
        assert!(l.clean);
        assert_eq!(l.devices, vec![(0, dev)]);
        assert_eq!(l.volumes, vec![(3, vol)]);
        assert_eq!(l.extents, vec![(3, 0, p)]);
        assert_eq!(m.save_states(&[(3, vec![1, 2]), (9, vec![3])]).unwrap(), 1);
        assert_eq!(m.load_states().unwrap(), vec![(3, vec![1, 2])]);
        m.commit(&[], &[MetaOp::DeleteVolume(3)]).unwrap();
        let l = m.load().unwrap().unwrap();
        assert!(l.volumes.is_empty() && l.extents.is_empty());
        assert!(m.load_states().unwrap().is_empty());
    }

    #[test]
    fn volume_record_without_qos_loads_as_none_and_is_written_unchanged() {
        let old_json = r#"{"name":"v","size_bytes":4096,"created_unix_s":7}"#;
        let m = Meta::open_memory().unwrap();
        {
            // A database written by a build before the `qos` field and the `credits` table.
            let txn = m.db.begin_write().unwrap();
            {
                let mut meta = txn.open_table(META).unwrap();
                meta.insert(KEY_FORMAT, FORMAT_VERSION).unwrap();
                meta.insert(KEY_EXTENT_SIZE, EXTENT_SIZE_BYTES).unwrap();
                txn.open_table(DEVICES).unwrap();
                txn.open_table(EXTENTS).unwrap();
                txn.open_table(VOLUMES)
                    .unwrap()
                    .insert(3, old_json)
                    .unwrap();
            }
            txn.commit().unwrap();
        }
        assert!(m.load_states().unwrap().is_empty());
        let l = m.load().unwrap().unwrap();
        let rec = VolumeRecord {
            name: "v".into(),
            size_bytes: 4096,
            created_unix_s: 7,
            qos: None,
            tenant: None,
            read_only: false,
            replicas: 1,
        };
        assert_eq!(l.volumes, vec![(3, rec.clone())]);
        assert_eq!(serde_json::to_string(&rec).unwrap(), old_json);
    }

    #[test]
    fn volume_record_tenant_and_read_only_round_trip_and_old_records_have_neither() {
        // A record of the build that added QoS, before tenants: no tenant, writable.
        let qos_only = r#"{"name":"v","size_bytes":4096,"created_unix_s":7,"qos":"{}"}"#;
        let rec: VolumeRecord = serde_json::from_str(qos_only).unwrap();
        assert_eq!(rec.tenant, None);
        assert!(!rec.read_only);
        assert_eq!(serde_json::to_string(&rec).unwrap(), qos_only);
        // With both fields, through redb and back.
        let rec = VolumeRecord {
            tenant: Some("Tenant A".into()),
            read_only: true,
            ..rec
        };
        let json = serde_json::to_string(&rec).unwrap();
        assert!(
            json.contains(r#""tenant":"Tenant A""#) && json.contains(r#""read_only":true"#),
            "{json}"
        );
        let m = Meta::open_memory().unwrap();
        m.commit(&[], &[MetaOp::Init, MetaOp::PutVolume(5, rec.clone())])
            .unwrap();
        assert_eq!(m.load().unwrap().unwrap().volumes, vec![(5, rec)]);
    }
}
