//! The store: opening a pool, recovery, the commit protocol, and volume management.
//!
//! Why this module holds the commit protocol: every durability promise of the crate is kept
//! by one routine, `Shared::commit`, which (1) takes the pending extent-map changes, (2) syncs
//! every device written or punched since its last sync, then (3) commits those changes (and
//! any management change) in one redb transaction with immediate durability, then (4)
//! releases extents whose free just became durable. Because the batch is taken before the
//! device sync and the sync comes before the redb commit, an allocation is never durable
//! before the data, reservation, write-intent bit and punches that preceded it, and a freed
//! extent is never reused before both its punch and its unmapping are on disk. FLUSH, FUA (when the extent's allocation is
//! not yet committed), create, resize, delete, QoS changes and shutdown all go through it.
//! Saves of the node's runtime QoS state (`save_volume_states`) do not: they touch no device
//! and no extent map, so they run as their own redb transaction outside the commit mutex.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::alloc::Allocator;
use crate::checksum::Layout;
use crate::config::{MAX_DEVICES, StoreConfig};
use crate::device::{Device, open_device_file};
use crate::device_admission::{AdmissionContext, AdmissionError, AdmissionPolicy};
use crate::devices::Devices;
use crate::error::{MetadataError, StoreError};
use crate::extent_map::ExtentMap;
use crate::fault::{ActiveRule, FaultConfig, FaultScope};
use crate::layout::{
    EXTENT_SIZE_BYTES, MAX_REPLICAS, MAX_VOLUME_SIZE_BYTES, PhysExtent, VOLUME_SIZE_ALIGN_BYTES,
    extent_count,
};
use crate::meta::{DeviceRecord, ExtentChange, Meta, MetaOp, TenantRecord, VolumeRecord};
use crate::name::{validate_tenant_id, validate_volume_name};
use crate::signature::{RESERVED_EXTENTS, SIGNATURE_LEN, Signature};
use crate::sync::{lock, read, write};
use crate::volume::{Volume, VolumeInfo};

/// A change to an extent map that is in memory but not yet committed to redb.
#[derive(Debug)]
pub(crate) enum Change {
    Alloc {
        volume: Weak<Volume>,
        volume_id: u64,
        replica: u8,
        extent: u64,
        phys: PhysExtent,
    },
    Free {
        volume_id: u64,
        replica: u8,
        extent: u64,
        phys: PhysExtent,
        /// The extent was punched (reads zero); false if the punch failed (leaked until restart).
        reusable: bool,
    },
}

/// Everything behind the pool mutex.
#[derive(Debug)]
pub(crate) struct PoolState {
    pub allocator: Allocator,
    /// Extent-map changes in the order they happened.
    pub pending: Vec<Change>,
    /// Management changes already applied in memory whose commit failed; retried first.
    pub pending_ops: Vec<MetaOp>,
    /// Extents freed but not yet durably unmapped: not free, not owned.
    pub quarantined: u64,
    /// Extents whose punch failed: kept out of the free pool until a restart punches them.
    pub leaked: u64,
    /// A release that leaves more than this many extents quarantined commits at once, so
    /// TRIM churn without FLUSH cannot starve other volumes' allocations.
    pub quarantine_limit: u64,
}

/// Upper bound of `PoolState::quarantine_limit` (1024 extents = 2 GiB).
const MAX_QUARANTINE_EXTENTS: u64 = 1024;

/// State shared by the store and every volume handle.
pub(crate) struct Shared {
    pub devices: Devices,
    meta: Meta,
    pub pool: Mutex<PoolState>,
    /// Serialises commits so that a commit's device syncs and its transaction stay ordered.
    commit_lock: Mutex<()>,
    /// Fault rules scoped to volumes (`Store::inject_faults`); unset: none.
    pub volume_faults: OnceLock<Vec<ActiveRule>>,
    /// Devices the operator failed (`Store::fail_device`, recorded durably): a bit set. They
    /// are failed devices, but no surprise: a shutdown with only these failed is clean.
    pub retired: std::sync::atomic::AtomicU64,
    /// Devices recorded failed in the metadata (by the operator, or by the commit that found
    /// their sync failing): a bit set. A restart keeps them failed until `restore_device`.
    pub recorded_failed: std::sync::atomic::AtomicU64,
}

/// The failed devices a store opens with: `retired` (failed by the operator, or unsigned:
/// a shutdown with only these failed is clean) and `recorded` (recorded failed in the
/// metadata, by the operator or by a failed sync).
#[derive(Clone, Copy, Debug, Default)]
struct FailedAtOpen {
    retired: DeviceSet,
    recorded: DeviceSet,
}

/// A set of device ids (ids are < `MAX_DEVICES` = 64).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct DeviceSet(pub u64);

impl DeviceSet {
    pub(crate) fn insert(&mut self, device: u32) {
        self.0 |= 1u64 << (device % 64);
    }

    pub(crate) fn contains(self, device: u32) -> bool {
        self.0 & (1u64 << (device % 64)) != 0
    }

    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub(crate) fn iter(self) -> impl Iterator<Item = usize> {
        (0..64).filter(move |d| self.0 & (1u64 << d) != 0)
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("devices", &self.devices.len())
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(crate) fn device(&self, phys: PhysExtent) -> Result<&Device, StoreError> {
        self.devices.get(phys.device as usize).ok_or_else(|| {
            StoreError::Metadata(MetadataError::Corrupt(format!(
                "extent on unknown device {}",
                phys.device
            )))
        })
    }

    /// The devices that are failed (a sync failed, or they disappeared).
    pub(crate) fn failed_devices(&self) -> DeviceSet {
        let mut set = DeviceSet::default();
        for d in self.devices.iter().filter(|d| d.is_failed()) {
            set.insert(d.id);
        }
        set
    }

    /// The error for data on failed device `id`.
    pub(crate) fn failed_error(&self, id: usize) -> StoreError {
        match self.devices.get(id) {
            Some(d) => StoreError::Io(d.failed_error()),
            None => StoreError::Io(std::io::Error::other(format!("device {id} failed"))),
        }
    }

    /// The durability point. Makes every write, punch and extent-map change that completed
    /// before the call durable, together with `ops`, and returns the devices whose data could
    /// not be made durable (failed: a sync failed now or earlier, or the device is gone).
    /// Extent-map changes are committed whatever the devices did, so one failed device does
    /// not stop the pool: callers that promise durability check the failed set against what
    /// they promise it for (a FLUSH: the volume's extents). Committing an allocation whose
    /// data could not be synced is safe: the extent read zeros durably before it was
    /// allocated, so after a crash it holds zeros or its own volume's unflushed data. A free
    /// on a failed device may not have its punch on disk, so the extent is not reused (it
    /// counts as leaked until the next start punches it). If the transaction fails, the
    /// pending changes stay pending (and `ops` too when `retain_ops_on_failure`, for changes
    /// already applied in memory) so that a later commit retries them.
    pub(crate) fn commit(
        &self,
        ops: &[MetaOp],
        retain_ops_on_failure: bool,
    ) -> Result<DeviceSet, StoreError> {
        let _serial = lock(&self.commit_lock);
        // From before the device syncs: a disk that stops answering hangs them first.
        let _in_progress = self.meta.commit_in_progress();
        let sync_after = crate::mutants::active(crate::mutants::Mutant::SyncAfterCommit);
        // The batch is taken before the devices are synced, so the sync covers everything
        // written for it before it was pending: a new extent's write-intent bit
        // (`Sums::set_for_new_extent`, written without a sync of its own), its reservation,
        // a freed extent's punch.
        let (batch, mut all_ops) = {
            let mut pool = lock(&self.pool);
            (
                std::mem::take(&mut pool.pending),
                std::mem::take(&mut pool.pending_ops),
            )
        };
        // Devices whose sync failed with ENOSPC: in service, not failed, but what this sync
        // was to make durable may be lost (the volumes' FLUSH checks `Device::lost_syncs`).
        let (mut failed, mut lost) = if sync_after {
            (DeviceSet::default(), DeviceSet::default())
        } else {
            self.sync_devices()
        };
        let retried_ops = all_ops.len();
        all_ops.extend_from_slice(ops);
        // A device whose sync failed (not with ENOSPC) may have dropped acknowledged data:
        // record it failed in this very commit, so a restart does not take it back and, above
        // all, does not resynchronise a replicated volume's copies from its stale copy (its
        // copies missed every write since). Not the devices failed in memory only (unsigned,
        // taken back when their signature is found again).
        let retired = self.retired.load(Ordering::Acquire);
        let recorded = self.recorded_failed.load(Ordering::Acquire);
        let to_record = DeviceSet(failed.0 & !retired & !recorded);
        all_ops.extend(to_record.iter().map(|d| MetaOp::FailDevice(d as u32)));
        if batch.is_empty() && all_ops.is_empty() {
            if sync_after {
                (failed, lost) = self.sync_devices();
            }
            let _ = lost;
            return Ok(failed);
        }
        let changes: Vec<ExtentChange> = batch
            .iter()
            .map(|c| match *c {
                Change::Alloc {
                    volume_id,
                    replica,
                    extent,
                    phys,
                    ..
                } => ExtentChange::Map {
                    volume_id,
                    replica,
                    extent,
                    phys,
                },
                Change::Free {
                    volume_id,
                    replica,
                    extent,
                    ..
                } => ExtentChange::Unmap {
                    volume_id,
                    replica,
                    extent,
                },
            })
            .collect();
        if let Err(e) = self.meta.commit(&changes, &all_ops) {
            tracing::error!(error = %e, "metadata commit failed; changes stay pending");
            let mut pool = lock(&self.pool);
            let newer = std::mem::replace(&mut pool.pending, batch);
            pool.pending.extend(newer);
            let keep = if retain_ops_on_failure {
                all_ops.len()
            } else {
                retried_ops
            };
            all_ops.truncate(keep);
            let newer_ops = std::mem::replace(&mut pool.pending_ops, all_ops);
            pool.pending_ops.extend(newer_ops);
            return Err(e);
        }
        if !to_record.is_empty() {
            self.recorded_failed.fetch_or(to_record.0, Ordering::AcqRel);
            for d in to_record.iter() {
                tracing::error!(
                    device = d,
                    "device failed by a sync error: recorded failed (restore it with `headroom device restore`)"
                );
            }
        }
        if sync_after {
            (failed, lost) = self.sync_devices();
        }
        // The allocations are durable: clear their pending bits so FUA skips the commit.
        for c in &batch {
            if let Change::Alloc {
                volume,
                replica,
                extent,
                phys,
                ..
            } = c
                && let Some(v) = volume.upgrade()
            {
                v.mark_committed(*replica, *extent, *phys);
            }
        }
        let mut pool = lock(&self.pool);
        for c in batch {
            if let Change::Free {
                phys,
                reusable: true,
                ..
            } = c
            {
                pool.quarantined = pool.quarantined.saturating_sub(1);
                if failed.contains(phys.device) || lost.contains(phys.device) {
                    pool.leaked += 1;
                } else {
                    pool.allocator.release(phys);
                }
            }
        }
        Ok(failed)
    }

    /// Step 1 of the commit: syncs every device written or punched since its last sync;
    /// returns the failed ones and those whose sync failed with ENOSPC (not failed).
    fn sync_devices(&self) -> (DeviceSet, DeviceSet) {
        let mut failed = DeviceSet::default();
        let mut lost = DeviceSet::default();
        if crate::mutants::active(crate::mutants::Mutant::SkipDeviceSync) {
            return (failed, lost);
        }
        for d in &self.devices {
            match d.sync_if_dirty() {
                Ok(()) => {}
                Err(e) if crate::stats::is_no_space(&e) => lost.insert(d.id),
                Err(_) => failed.insert(d.id),
            }
        }
        (failed, lost)
    }

    /// A commit that promises the durability of everything: any failed device is an error,
    /// except the devices the operator failed (`Store::fail_device`), whose loss is known.
    pub(crate) fn commit_all(&self, ops: &[MetaOp]) -> Result<(), StoreError> {
        let failed = self.commit(ops, false)?;
        let retired = self.retired.load(Ordering::Acquire);
        match DeviceSet(failed.0 & !retired).iter().next() {
            Some(id) => Err(self.failed_error(id)),
            None => Ok(()),
        }
    }
}

impl Shared {
    /// The metadata reserve is in use (`Meta::reserve_in_use`): new data extents are refused
    /// with `NoSpace` until it is taken again, so data does not take the room it freed for
    /// the metadata's commits.
    pub(crate) fn metadata_reserve_in_use(&self) -> bool {
        self.meta.reserve_in_use()
    }

    /// Whether enough freed extents wait in quarantine that the releaser should commit.
    pub(crate) fn quarantine_full(&self) -> bool {
        let pool = lock(&self.pool);
        pool.quarantined >= pool.quarantine_limit
    }
}

impl Drop for Shared {
    /// Last handle gone: commit what is pending and, if every free extent is known to read
    /// zero (no failed punch), record a clean shutdown so the next open skips the free-space
    /// punch.
    fn drop(&mut self) {
        let retired = self.retired.load(Ordering::Acquire);
        let clean = lock(&self.pool).leaked == 0 && self.failed_devices().0 & !retired == 0;
        match self.commit(&[MetaOp::SetClean(clean)], false) {
            // A device failed in this very commit (or a free on it leaked): not clean after all.
            Ok(failed) if clean && (failed.0 & !retired != 0 || lock(&self.pool).leaked > 0) => {
                if let Err(e) = self.commit(&[MetaOp::SetClean(false)], false) {
                    tracing::error!(error = %e, "final commit at close failed");
                }
                tracing::debug!(clean = false, "store closed");
            }
            Ok(_) => tracing::debug!(clean, "store closed"),
            Err(e) => tracing::error!(error = %e, "final commit at close failed"),
        }
    }
}

/// Pool-wide numbers for operators and the management API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolInfo {
    pub extent_size_bytes: u64,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub total_extents: u64,
    pub free_extents: u64,
    pub allocated_extents: u64,
    /// Freed, waiting for the next durable commit before reuse.
    pub quarantined_extents: u64,
    /// Freed but their punch failed; reusable after a restart.
    pub leaked_extents: u64,
    pub devices: Vec<DeviceInfo>,
}

/// One device of the pool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub id: u32,
    /// File or block device path, or `memory:<id>`.
    pub path: String,
    pub capacity_bytes: u64,
    /// Extents volumes may use (the device's extents less the reserved ones).
    pub extent_count: u64,
    /// Extents at the device's start kept for Headroom's own structures (its signature):
    /// never allocated, not in `extent_count`. Absent from the JSON when 0 (devices of older
    /// builds, RAM and RADOS devices).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub reserved_extents: u64,
    pub free_extents: u64,
    /// Real space used (file blocks or RAM); `None` for block devices.
    pub physical_used_bytes: Option<u64>,
    /// A sync failed or the device disappeared: its data can no longer be made durable, and
    /// new extents go elsewhere. Absent from the JSON when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
    /// The failure domain declared for it (`add_device_in_domain`): copies of one extent of
    /// a replicated volume go to distinct domains when the pool has enough. Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
    /// Its data carries per-block checksums, verified on every read (file and block devices
    /// added by this build, simulated disks). False: unprotected (unsigned devices of older
    /// builds, RAM, and RADOS, which Ceph checksums itself).
    #[serde(default)]
    pub checksums: bool,
}

/// What `Store::restore_device` did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRestore {
    /// The device, as it is now.
    pub device: DeviceInfo,
    /// False: it was in service already, nothing was done.
    pub restored: bool,
    /// Extents on it that no volume mapped (copies moved away by a rebuild, frees that
    /// could not be made durable), punched and returned to the free pool.
    pub extents_reclaimed: u64,
    /// Copies of replicated volumes on it compared with a healthy copy.
    pub copies_checked: u64,
    /// 64 KiB chunks of those that differed (writes it missed) and were rewritten.
    pub chunks_rewritten: u64,
    /// Copies with no other copy on a healthy device to compare with, left as they were.
    pub copies_without_source: u64,
}

/// What a new volume is created with besides its name and size.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewVolume {
    /// Opaque QoS settings (the node layer's JSON; the store does not interpret it).
    pub qos: Option<String>,
    /// The tenant it belongs to (checked with `validate_tenant_id`); `None`: no tenant.
    pub tenant: Option<String>,
    /// Export it read-only.
    pub read_only: bool,
    /// Copies of every extent, each on a distinct device (1 to `MAX_REPLICAS`); 0 means 1
    /// (the default). More than the pool's healthy devices is refused (`InvalidReplicas`),
    /// and so is more than 1 on a RADOS store (Ceph keeps its own copies).
    pub replicas: u8,
}

/// A pool of devices and the volumes on it. `Send + Sync`; share it behind an `Arc`.
pub struct Store {
    shared: Arc<Shared>,
    /// Name -> volume. Held only briefly, never across a commit, so lookups (NBD handshakes)
    /// never wait for a management operation's fsyncs.
    volumes: RwLock<BTreeMap<String, Arc<Volume>>>,
    /// Serialises management operations (create, resize, delete); holds the next volume id.
    management: Mutex<u64>,
    /// The tenants created (id -> record). Changed only under `management`.
    tenants: RwLock<BTreeMap<String, TenantRecord>>,
    /// Most volume bytes per pool byte (`None`: no limit); read under `management`.
    overcommit_ratio: RwLock<Option<f64>>,
    /// Each device's smoothed view, in device order (`observe_devices`).
    telemetry: Mutex<Vec<crate::telemetry::TelemetryState>>,
    /// The data directory of a file store (`None`: RAM), for devices added later.
    data_dir: Option<PathBuf>,
    /// The disks of a simulated pool (`open_simulated`), for devices added later.
    sim: Option<Arc<crate::sim_disk::SimPool>>,
    /// What `add_device` may take and the size caps (`set_admission_policy`).
    admission: RwLock<AdmissionPolicy>,
    /// The pool's random id, written on its device signatures (0: a RAM pool).
    pool_id: u64,
    /// The lease of a store whose metadata is in RADOS, released when the store is dropped.
    #[cfg(feature = "rados")]
    lease: Option<crate::lease::Lease>,
}

/// A tenant and what it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantInfo {
    pub id: String,
    pub created_unix_s: u64,
    /// Volumes that belong to it.
    pub volumes: usize,
    /// Sum of their sizes.
    pub provisioned_bytes: u64,
    /// Sum of their allocated bytes.
    pub allocated_bytes: u64,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("devices", &self.shared.devices.len())
            .field("volumes", &read(&self.volumes).len())
            .finish()
    }
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

fn now_unix_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn corrupt(msg: String) -> StoreError {
    StoreError::Metadata(MetadataError::Corrupt(msg))
}

fn validate_size(size_bytes: u64, max_bytes: u64) -> Result<(), StoreError> {
    let invalid = |reason| StoreError::InvalidSize { size_bytes, reason };
    if size_bytes == 0 {
        return Err(invalid("must be greater than zero"));
    }
    if !size_bytes.is_multiple_of(VOLUME_SIZE_ALIGN_BYTES) {
        return Err(invalid("must be a multiple of 512 bytes"));
    }
    if size_bytes > MAX_VOLUME_SIZE_BYTES {
        return Err(invalid("larger than the 64 TiB maximum"));
    }
    if size_bytes > max_bytes {
        return Err(invalid(
            "larger than the node's largest volume ([storage] max_volume_bytes)",
        ));
    }
    Ok(())
}

/// The device record path of a new RADOS device: `rados:<pool>/<namespace>`, in the
/// namespace of the store's RADOS session, or a fresh one (see rados.rs for the naming).
fn rados_record_path(pool: &str, session: Option<&RadosSession>) -> Result<String, StoreError> {
    if pool.is_empty() || pool.contains('/') || pool.contains('\0') {
        return Err(StoreError::InvalidConfig(format!(
            "RADOS pool name {pool:?} must be non-empty, without '/' or NUL"
        )));
    }
    #[cfg(feature = "rados")]
    {
        let ns = match session {
            Some(s) => s.namespace.clone(),
            None => crate::rados::new_namespace()?,
        };
        Ok(format!("rados:{pool}/{ns}"))
    }
    #[cfg(not(feature = "rados"))]
    {
        let _ = session;
        Err(no_rados())
    }
}

/// The connection and lease of a store whose metadata is in RADOS (`rados_meta.rs`).
#[cfg(feature = "rados")]
struct RadosSession {
    pool: Arc<crate::rados::Pool>,
    namespace: String,
    lease: crate::lease::Lease,
}

/// Never made without the `rados` feature.
#[cfg(not(feature = "rados"))]
enum RadosSession {}

/// Opens the metadata: in RADOS for a RADOS store (after taking its lease and fencing the
/// previous holder: lease.rs), except a RADOS store of the first slice, whose data directory
/// has `meta.redb` and no namespace was named; in `meta.redb` otherwise.
fn open_meta(cfg: &StoreConfig) -> Result<(Meta, Option<RadosSession>), StoreError> {
    if cfg.rados.is_none()
        && let Ok(ns) = std::fs::read_to_string(cfg.rados_namespace_path())
    {
        // Without this check a new, empty file store would be made beside it.
        return Err(StoreError::InvalidConfig(format!(
            "{} is the local state of a RADOS store (namespace {}): start with its pool \
             (--rados-conf, --rados-pool)",
            cfg.data_dir.display(),
            ns.trim()
        )));
    }
    if let Some(target) = &cfg.rados
        && (target.namespace.is_some() || !cfg.meta_path().exists())
    {
        #[cfg(feature = "rados")]
        {
            let ns_file = cfg.rados_namespace_path();
            let recorded = match std::fs::read_to_string(&ns_file) {
                Ok(s) => Some(s.trim().to_string()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(e.into()),
            };
            let namespace = match (&target.namespace, &recorded) {
                (Some(ns), _) | (None, Some(ns)) => ns.clone(),
                (None, None) => crate::rados::new_namespace()?,
            };
            if namespace.is_empty() || namespace.contains(['\0', '/']) {
                return Err(StoreError::InvalidConfig(format!(
                    "RADOS namespace {namespace:?} must be non-empty, without '/' or NUL"
                )));
            }
            let pool = Arc::new(crate::rados::Pool::connect(
                &target.conf,
                &target.id,
                &target.pool,
                &namespace,
            )?);
            // A named namespace must hold a store: a mistyped name would otherwise make a
            // new, empty one.
            if target.namespace.is_some() && !pool.exists(crate::rados_meta::META_OBJECT)? {
                return Err(StoreError::InvalidConfig(format!(
                    "there is no Headroom store in namespace {namespace} of RADOS pool {} (no \
                     object `meta`); check --rados-namespace",
                    target.pool
                )));
            }
            let lease = crate::lease::Lease::acquire(
                Arc::clone(&pool),
                std::time::Duration::from_millis(target.lease_ms.max(1)),
                target.lease_wait_ms.map(std::time::Duration::from_millis),
            )?;
            let meta = Meta::open_rados(Arc::clone(&pool))?;
            if recorded.as_deref() != Some(namespace.as_str()) {
                std::fs::write(&ns_file, format!("{namespace}\n"))?;
                std::fs::File::open(&ns_file)?.sync_all()?;
            }
            return Ok((
                meta,
                Some(RadosSession {
                    pool,
                    namespace,
                    lease,
                }),
            ));
        }
        #[cfg(not(feature = "rados"))]
        {
            let _ = target;
            return Err(no_rados());
        }
    }
    Ok((
        Meta::open_file(
            &cfg.meta_path(),
            cfg.metadata_reserve_bytes,
            cfg.metadata_copy.then(|| cfg.meta_copy_path()).as_deref(),
        )?,
        None,
    ))
}

/// (pool, namespace) of a RADOS device record, `None` for a file or block device.
fn parse_rados_record(path: &str) -> Option<(&str, &str)> {
    path.strip_prefix("rados:")?.split_once('/')
}

#[cfg(not(feature = "rados"))]
fn no_rados() -> StoreError {
    StoreError::InvalidConfig(
        "this build has no RADOS backend; rebuild with --features rados (needs librados-dev)"
            .into(),
    )
}

/// Connects to the pool of a RADOS device record; the configuration must name that pool.
fn open_rados_device(
    cfg: &StoreConfig,
    session: Option<&RadosSession>,
    id: u32,
    pool: &str,
    namespace: &str,
    extent_count: u32,
) -> Result<Device, StoreError> {
    let Some(target) = &cfg.rados else {
        return Err(StoreError::InvalidConfig(format!(
            "{} keeps its extents in RADOS pool {pool}: start with that pool (--rados-conf, \
             --rados-pool {pool})",
            cfg.data_dir.display()
        )));
    };
    if target.pool != pool {
        return Err(StoreError::InvalidConfig(format!(
            "{} keeps its extents in RADOS pool {pool}, not {}",
            cfg.data_dir.display(),
            target.pool
        )));
    }
    #[cfg(feature = "rados")]
    {
        let p = match session {
            // One connection for metadata and data: fencing blocklists one client address.
            Some(s) if s.namespace == namespace => Arc::clone(&s.pool),
            Some(s) => {
                return Err(corrupt(format!(
                    "the device record names namespace {namespace}, the store is in {}",
                    s.namespace
                )));
            }
            None => Arc::new(crate::rados::Pool::connect(
                &target.conf,
                &target.id,
                pool,
                namespace,
            )?),
        };
        Ok(Device::rados(id, p, extent_count))
    }
    #[cfg(not(feature = "rados"))]
    {
        let _ = (session, id, namespace, extent_count);
        Err(no_rados())
    }
}

fn extents_of(capacity_bytes: u64) -> Result<u32, StoreError> {
    u32::try_from(capacity_bytes / EXTENT_SIZE_BYTES)
        .map_err(|_| StoreError::InvalidConfig("device larger than 8 PiB".into()))
}

/// Loads the metadata and checks the device ids; (loaded, fresh: never initialised).
fn load_checked(
    meta: &Meta,
    meta_path: Option<&Path>,
) -> Result<(crate::meta::Loaded, bool), StoreError> {
    // A page that fails its checksum when read, or a redb panic on a malformed one: the
    // file is damaged (the integrity check at open should have caught it first). With the
    // file's path (file stores), the error names it and says what to do.
    let damaged = |e: StoreError| match meta_path {
        Some(path) => crate::meta::damaged_if_corrupt(e, path),
        None => e,
    };
    let stored = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| meta.load())) {
        Ok(Err(e)) => Err(damaged(e)),
        Ok(other) => other,
        Err(_) => Err(damaged(StoreError::Metadata(MetadataError::Redb(
            redb::Error::Corrupted("redb panicked reading it".into()),
        )))),
    }?;
    let fresh = stored.is_none();
    let mut loaded = stored.unwrap_or_default();
    if fresh {
        loaded.next_volume_id = 1;
    }
    loaded.devices.sort_by_key(|(id, _)| *id);
    for (i, (id, _)) in loaded.devices.iter().enumerate() {
        if *id as usize != i {
            return Err(corrupt(format!("device ids are not contiguous at {id}")));
        }
    }
    Ok((loaded, fresh))
}

/// fsync a directory so that entries created in it survive a power loss.
fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// Volumes rebuilt from metadata, before the shared state exists.
struct LoadedVolume {
    id: u64,
    record: VolumeRecord,
    map: ExtentMap,
    /// Maps of replicas 1.. (empty for a 1-replica volume).
    replicas: Vec<ExtentMap>,
    allocated_extents: u64,
}

impl Store {
    /// Opens (creating if needed) the store in `cfg.data_dir`. After a crash, every free
    /// extent is punched (and synced) before the store is returned, so data written into
    /// allocations that never became durable cannot surface in another volume.
    ///
    /// With `cfg.rados`, the pool is one device whose extents are objects of that RADOS pool
    /// (feature `rados`); a data directory is created for RADOS or for device files and
    /// stays that way.
    pub fn open(cfg: &StoreConfig) -> Result<Store, StoreError> {
        let explicit = !cfg.device_paths.is_empty();
        if cfg.rados.is_some() && explicit {
            return Err(StoreError::InvalidConfig(
                "device paths and a RADOS pool exclude each other".into(),
            ));
        }
        let wanted_count = if cfg.rados.is_some() {
            1
        } else if explicit {
            cfg.device_paths.len()
        } else {
            cfg.device_count as usize
        };
        if wanted_count == 0 || wanted_count > MAX_DEVICES as usize {
            return Err(StoreError::InvalidConfig(format!(
                "device count must be between 1 and {MAX_DEVICES}, got {wanted_count}"
            )));
        }
        std::fs::create_dir_all(&cfg.data_dir)?;
        let (meta, session) = open_meta(cfg)?;
        let meta_path = session.is_none().then(|| cfg.meta_path());
        let (loaded, fresh) = load_checked(&meta, meta_path.as_deref())?;
        // The pool's id (written on its device signatures): new pools and pools of builds
        // before signatures get a random one, recorded with this open's first commit.
        let new_pool_id = match loaded.pool_id {
            Some(_) => None,
            None => Some(random_pool_id()?),
        };
        let pool_id = loaded.pool_id.or(new_pool_id).unwrap_or_default();

        // Stored devices are authoritative; configured devices beyond them are added.
        let mut records: Vec<(DeviceRecord, bool)> = loaded
            .devices
            .iter()
            .map(|(_, r)| (r.clone(), false))
            .collect();
        if wanted_count < records.len() {
            // Listed paths that miss a device deserve a warning; a device count (a default for
            // new pools) below the devices added since does not.
            if explicit {
                tracing::warn!(
                    configured = wanted_count,
                    stored = records.len(),
                    "configuration lists fewer devices than the pool holds; keeping all"
                );
            } else {
                tracing::info!(
                    stored = records.len(),
                    "the pool holds more devices than the configured count; keeping all"
                );
            }
        }
        for i in records.len()..wanted_count {
            let (path, relative) = if let Some(target) = &cfg.rados {
                (rados_record_path(&target.pool, session.as_ref())?, false)
            } else if explicit {
                // Stored absolute: a later start may run from another working directory.
                let abs = std::path::absolute(&cfg.device_paths[i])?;
                let p = abs
                    .to_str()
                    .ok_or_else(|| StoreError::InvalidConfig("device path is not UTF-8".into()))?;
                (p.to_string(), false)
            } else {
                (format!("devices/dev-{i}.img"), true)
            };
            let rec = DeviceRecord {
                path,
                relative,
                capacity_bytes: 0,
                failure_domain: None,
                failed: false,
                reserved_extents: 0,
            };
            records.push((rec, true));
        }
        if records.len() > MAX_DEVICES as usize {
            return Err(StoreError::InvalidConfig(format!(
                "more than {MAX_DEVICES} devices"
            )));
        }

        let mut devices = Vec::with_capacity(records.len());
        let mut new_device_ops = Vec::new();
        let mut created_relative = false;
        // Devices recorded as signed whose signature is missing or damaged (see below).
        let mut unsigned = DeviceSet::default();
        for (i, (rec, is_new)) in records.iter_mut().enumerate() {
            if let Some((pool, namespace)) = parse_rados_record(&rec.path) {
                let capacity = if *is_new {
                    cfg.device_capacity_bytes
                } else {
                    rec.capacity_bytes
                };
                if capacity < EXTENT_SIZE_BYTES {
                    return Err(StoreError::InvalidConfig(format!(
                        "RADOS device capacity {capacity} holds less than one \
                         {EXTENT_SIZE_BYTES}-byte extent"
                    )));
                }
                if *is_new {
                    rec.capacity_bytes = capacity - capacity % EXTENT_SIZE_BYTES;
                    new_device_ops.push(MetaOp::PutDevice(i as u32, rec.clone()));
                }
                let extent_count = extents_of(rec.capacity_bytes)?;
                devices.push(open_rados_device(
                    cfg,
                    session.as_ref(),
                    i as u32,
                    pool,
                    namespace,
                    extent_count,
                )?);
                continue;
            }
            if let Some(target) = &cfg.rados {
                return Err(StoreError::InvalidConfig(format!(
                    "{} keeps its extents in device files, not in RADOS pool {}; a RADOS \
                     store needs a new data directory",
                    cfg.data_dir.display(),
                    target.pool
                )));
            }
            let path: PathBuf = if rec.relative {
                cfg.data_dir.join(&rec.path)
            } else {
                PathBuf::from(&rec.path)
            };
            if *is_new && rec.relative {
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                created_relative = true;
            }
            let mut checksums = false;
            let (file, capacity, is_block) =
                open_device_file(&path, cfg.device_capacity_bytes, *is_new).map_err(|e| {
                    StoreError::Io(std::io::Error::new(
                        e.kind(),
                        format!("device {}: {e}", path.display()),
                    ))
                })?;
            if *is_new {
                let least = u64::from(RESERVED_EXTENTS + 1) * EXTENT_SIZE_BYTES;
                if capacity < least {
                    return Err(StoreError::InvalidConfig(format!(
                        "device {} holds less than {least} bytes (two {EXTENT_SIZE_BYTES}-byte \
                         extents, one of them reserved for its signature)",
                        path.display()
                    )));
                }
                rec.capacity_bytes = capacity - capacity % EXTENT_SIZE_BYTES;
                rec.reserved_extents = if cfg.checksums {
                    Layout::for_extents(extents_of(rec.capacity_bytes)?)
                        .reserved_extents
                        .max(RESERVED_EXTENTS)
                } else {
                    RESERVED_EXTENTS
                };
                if u64::from(rec.reserved_extents) * EXTENT_SIZE_BYTES >= rec.capacity_bytes {
                    return Err(StoreError::InvalidConfig(format!(
                        "device {} holds no extent beside the {} reserved for its signature \
                         and checksums",
                        path.display(),
                        rec.reserved_extents
                    )));
                }
                checksums = cfg.checksums;
                // Signed (and synced) before the record that names it is committed.
                write_signature(&file, pool_id, i as u32, rec, checksums).map_err(|e| {
                    StoreError::Io(std::io::Error::new(
                        e.kind(),
                        format!("device {}: writing its signature: {e}", path.display()),
                    ))
                })?;
                new_device_ops.push(MetaOp::PutDevice(i as u32, rec.clone()));
            } else if capacity < rec.capacity_bytes {
                return Err(StoreError::InvalidConfig(format!(
                    "device {} is {capacity} bytes, smaller than the recorded {}",
                    path.display(),
                    rec.capacity_bytes
                )));
            } else if rec.reserved_extents > 0 {
                match check_signature(&file, pool_id, i as u32) {
                    SignatureCheck::Ours(sig) => {
                        checksums = sig.checksums
                            && Layout::for_extents(extents_of(rec.capacity_bytes)?)
                                .reserved_extents
                                <= rec.reserved_extents;
                    }
                    SignatureCheck::Foreign(sig) => {
                        return Err(StoreError::InvalidConfig(format!(
                            "device {i} ({}) carries the signature of device {} of pool \
                             {:016x}, not of device {i} of this pool ({pool_id:016x}): the path \
                             leads to another disk (renamed after a reboot?). Nothing was \
                             written to it; point the configuration at the right device (a \
                             stable name such as /dev/disk/by-id/...)",
                            path.display(),
                            sig.device_id,
                            sig.pool_id
                        )));
                    }
                    SignatureCheck::Unreadable(reason) => {
                        tracing::error!(
                            device = i,
                            path = %path.display(),
                            %reason,
                            "device recorded as signed has no valid signature: it is treated \
                             as failed (not written, not allocated on) until a restart finds \
                             its signature"
                        );
                        unsigned.insert(i as u32);
                    }
                }
            }
            let extent_count = extents_of(rec.capacity_bytes)?;
            let device = Device::from_file(
                i as u32,
                path.display().to_string(),
                file,
                is_block,
                extent_count,
            );
            let device = if checksums && !unsigned.contains(i as u32) {
                if *is_new {
                    // Nothing left of what the space held before: a fresh bitmap, zero entries.
                    device.zero_checksum_region()?;
                }
                device.with_checksums().map_err(|e| {
                    StoreError::Io(std::io::Error::new(
                        e.kind(),
                        format!(
                            "device {}: reading its write-intent bitmap: {e}",
                            path.display()
                        ),
                    ))
                })?
            } else {
                device
            };
            devices.push(device);
        }
        if created_relative {
            sync_dir(&cfg.data_dir.join("devices"))?;
        }
        if fresh {
            sync_dir(&cfg.data_dir)?;
        }
        // The pool id first: the signatures written above carry it.
        let mut ops: Vec<MetaOp> = new_pool_id.map(MetaOp::SetPoolId).into_iter().collect();
        ops.extend(new_device_ops);
        let mut store = Store::recover(meta, &loaded, fresh, &records, devices, ops, unsigned)?;
        store.data_dir = Some(cfg.data_dir.clone());
        store.pool_id = pool_id;
        #[cfg(feature = "rados")]
        {
            store.lease = session.map(|s| s.lease);
        }
        #[cfg(not(feature = "rados"))]
        let _ = session;
        Ok(store)
    }

    /// Recovery, shared by every way to open a stored pool (`open`, `open_simulated`): checks
    /// the loaded metadata and rebuilds the maps, punches all free space after an unclean
    /// shutdown (and on new devices), resynchronises the replicas, and commits `clean = 0`
    /// (with `new_device_ops`) before anything is served. Devices in `unsigned` (recorded as
    /// signed, their signature missing or damaged) count as failed for this run.
    fn recover(
        meta: Meta,
        loaded: &crate::meta::Loaded,
        fresh: bool,
        records: &[(DeviceRecord, bool)],
        devices: Vec<Device>,
        new_device_ops: Vec<MetaOp>,
        unsigned: DeviceSet,
    ) -> Result<Store, StoreError> {
        let reserved: Vec<u32> = records.iter().map(|(r, _)| r.reserved_extents).collect();
        let (mut allocator, volumes) = rebuild(&devices, &reserved, loaded)?;
        let mut retired = DeviceSet::default();
        let mut recorded = DeviceSet::default();
        for (d, (rec, _)) in records.iter().enumerate() {
            allocator.set_failure_domain(d, rec.failure_domain.clone());
            if rec.failed {
                recorded.insert(d as u32);
            }
            // An unsigned device counts like one the operator failed, in memory only: a
            // restart that finds its signature takes it back.
            if rec.failed || unsigned.contains(d as u32) {
                devices[d].mark_failed();
                retired.insert(d as u32);
            }
        }

        // Recovery: after an unclean shutdown (or on devices new to the pool) a free extent
        // may hold data of an allocation that never became durable. Punch all free space and
        // make the punches durable before anything can be allocated.
        let punch_all = fresh || !loaded.clean;
        // Checksums: after an unclean start, the entries of the allocated extents written
        // since their last sync may not match their data (checksum.rs): recompute them from
        // the data before anything is read. Free extents are punched below (entries zeroed).
        let mut recomputed = 0;
        for d in devices
            .iter()
            .filter(|d| d.has_checksums() && !d.is_failed())
        {
            if !loaded.clean && !fresh {
                let free = allocator.free_runs(d.id as usize);
                recomputed += d.recompute_dirty(&|ext| {
                    let i = free.partition_point(|&(first, _)| first <= ext);
                    !(i > 0 && ext - free[i - 1].0 < free[i - 1].1)
                })?;
            }
        }
        for (d, (_, is_new)) in devices.iter().zip(records.iter()) {
            if (punch_all || *is_new) && !d.is_failed() {
                d.punch_free_runs(&allocator.free_runs(d.id as usize))?;
                d.sync_if_dirty()?;
            }
            // Everything is durable and consistent now (after a clean stop it was already).
            if d.has_checksums() && !d.is_failed() {
                d.sync_if_dirty()?;
                d.clear_intent_bits()?;
            }
        }
        if recomputed > 0 {
            tracing::info!(
                extents = recomputed,
                "unclean shutdown: recomputed the checksums of the extents written since their last sync"
            );
        }
        if punch_all && !fresh {
            tracing::info!("unclean shutdown detected: punched all free extents");
            // Writes in flight at the crash may have reached some copies of an extent and not
            // others: make every copy equal to the first readable one before serving.
            let started = Instant::now();
            let (extents, chunks) = resync_replicas(&devices, &volumes)?;
            if extents > 0 {
                tracing::info!(
                    extents,
                    chunks_repaired = chunks,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "unclean shutdown: resynchronised the replicas of replicated volumes"
                );
            }
        }

        let mut ops = Vec::new();
        if fresh {
            ops.push(MetaOp::Init);
        }
        ops.extend(new_device_ops);
        // Tenants named by volumes but never created (a database of a build before the
        // tenants table) are registered, so every volume's tenant exists.
        let mut tenants: BTreeMap<String, TenantRecord> = loaded.tenants.iter().cloned().collect();
        for v in &volumes {
            if let Some(tenant) = &v.record.tenant
                && !tenants.contains_key(tenant)
            {
                let rec = TenantRecord {
                    created_unix_s: v.record.created_unix_s,
                };
                tenants.insert(tenant.clone(), rec.clone());
                ops.push(MetaOp::PutTenant(tenant.clone(), rec));
                tracing::info!(
                    tenant = tenant.as_str(),
                    "registered the tenant of a stored volume"
                );
            }
        }
        ops.push(MetaOp::SetClean(false));
        meta.commit(&[], &ops)?;
        Ok(Store::assemble(
            meta,
            FailedAtOpen { retired, recorded },
            devices,
            allocator,
            volumes,
            loaded.next_volume_id,
            tenants,
        ))
    }

    /// Opens (creating on first use) the store of a simulated pool (`sim_disk.rs`): the
    /// power-cut test's way in. Devices are the pool's disks (`sim:<id>`), the metadata is
    /// redb on its metadata disk, and opening runs the same load checks and recovery as
    /// `open` (`load_checked`, `recover`). The pool grows (`add_device`) by new disks.
    #[doc(hidden)]
    pub fn open_simulated(pool: &Arc<crate::sim_disk::SimPool>) -> Result<Store, StoreError> {
        let meta = Meta::open_simulated(pool.meta_disk())?;
        let (loaded, fresh) = load_checked(&meta, None)?;
        let mut records: Vec<(DeviceRecord, bool)> = loaded
            .devices
            .iter()
            .map(|(_, r)| (r.clone(), false))
            .collect();
        if fresh {
            for i in 0..pool.initial_devices() {
                let rec = DeviceRecord {
                    path: format!("sim:{i}"),
                    relative: false,
                    capacity_bytes: pool.device_bytes() - pool.device_bytes() % EXTENT_SIZE_BYTES,
                    failure_domain: None,
                    failed: false,
                    reserved_extents: Layout::for_extents(extents_of(
                        pool.device_bytes() - pool.device_bytes() % EXTENT_SIZE_BYTES,
                    )?)
                    .reserved_extents,
                };
                records.push((rec, true));
            }
        }
        let mut devices = Vec::with_capacity(records.len());
        let mut new_device_ops = Vec::new();
        for (i, (rec, is_new)) in records.iter().enumerate() {
            if rec.path != format!("sim:{i}") {
                return Err(corrupt(format!(
                    "device {i} of a simulated pool is {}",
                    rec.path
                )));
            }
            let extent_count = extents_of(rec.capacity_bytes)?;
            let device =
                Device::simulated(i as u32, pool.disk(i, rec.capacity_bytes), extent_count);
            // Simulated disks carry checksums when their record reserves room for them.
            let device = if rec.reserved_extents > 0 {
                device.with_checksums()?
            } else {
                device
            };
            devices.push(device);
            if *is_new {
                new_device_ops.push(MetaOp::PutDevice(i as u32, rec.clone()));
            }
        }
        let mut store = Store::recover(
            meta,
            &loaded,
            fresh,
            &records,
            devices,
            new_device_ops,
            DeviceSet::default(),
        )?;
        store.sim = Some(Arc::clone(pool));
        Ok(store)
    }

    /// `add_device` on a simulated pool: the next disk of the pool joins, the same way a
    /// file joins (punched, synced, recorded durably, then placed on).
    fn add_simulated_device(
        &self,
        pool: &crate::sim_disk::SimPool,
        capacity_bytes: u64,
        failure_domain: Option<String>,
    ) -> Result<DeviceInfo, StoreError> {
        let id = self.shared.devices.len();
        let invalid = |reason: String| StoreError::InvalidDevice {
            path: format!("sim:{id}"),
            reason,
        };
        if id >= MAX_DEVICES as usize {
            return Err(invalid(format!(
                "the pool has {MAX_DEVICES} devices, the most it may"
            )));
        }
        let capacity = capacity_bytes - capacity_bytes % EXTENT_SIZE_BYTES;
        if capacity < EXTENT_SIZE_BYTES {
            return Err(invalid(format!(
                "{capacity_bytes} bytes hold less than one {EXTENT_SIZE_BYTES}-byte extent"
            )));
        }
        let rec = DeviceRecord {
            path: format!("sim:{id}"),
            relative: false,
            capacity_bytes: capacity,
            failure_domain: failure_domain.clone(),
            failed: false,
            reserved_extents: Layout::for_extents(extents_of(capacity)?).reserved_extents,
        };
        let reserved = rec.reserved_extents;
        let extent_count = extents_of(capacity)?;
        let device = Device::simulated(id as u32, pool.disk(id, capacity), extent_count);
        device.punch_extents(0, extent_count)?;
        let device = device.with_checksums()?;
        device.sync_if_dirty()?;
        self.shared
            .commit(&[MetaOp::PutDevice(id as u32, rec)], false)?;
        self.shared
            .devices
            .push(device)
            .map_err(|_| invalid("the device list changed underneath".into()))?;
        {
            let mut p = lock(&self.shared.pool);
            p.allocator.add_device(extent_count, failure_domain);
            p.allocator.reserve_prefix(id, reserved);
        }
        self.pool_info()
            .devices
            .into_iter()
            .find(|d| d.id as usize == id)
            .ok_or_else(|| invalid("the device vanished after it was added".into()))
    }

    /// Adds a device to the running pool: the file or block device at `path`, or with `None`
    /// a new sparse file `devices/dev-N.img` in the data directory. Only what the admission
    /// policy allows is taken (`set_admission_policy`, `device_admission.rs`): a regular file
    /// under an allowed directory (created `capacity_bytes` long when it does not exist or is
    /// empty; an existing one keeps its length, rounded down to whole extents) or a block
    /// device the configuration names, holding no signature and no data. Everything on it is
    /// punched (it joins as free space), its first extent is reserved for its signature
    /// (written and synced first), the pool's metadata records it durably, and from then on
    /// new extents may go there (placement prefers the emptier device). Only file stores
    /// grow: a RAM pool has a fixed size. Serialised with the other management operations.
    pub fn add_device(
        &self,
        path: Option<&Path>,
        capacity_bytes: u64,
    ) -> Result<DeviceInfo, StoreError> {
        self.add_device_with(path, capacity_bytes, None, false)
    }

    /// `add_device` with the device's failure domain (`None`: none declared; see
    /// `DeviceInfo::failure_domain`). An empty domain is refused.
    pub fn add_device_in_domain(
        &self,
        path: Option<&Path>,
        capacity_bytes: u64,
        failure_domain: Option<String>,
    ) -> Result<DeviceInfo, StoreError> {
        self.add_device_with(path, capacity_bytes, failure_domain, false)
    }

    /// `add_device_in_domain`; with `force`, a device holding a foreign signature or data is
    /// taken too (its contents are destroyed). A device carrying this pool's own signature is
    /// refused even then.
    pub fn add_device_with(
        &self,
        path: Option<&Path>,
        capacity_bytes: u64,
        failure_domain: Option<String>,
        force: bool,
    ) -> Result<DeviceInfo, StoreError> {
        let _management = lock(&self.management);
        let id = self.shared.devices.len();
        let shown = path.map_or_else(
            || format!("devices/dev-{id}.img"),
            |p| p.display().to_string(),
        );
        let invalid = |reason: String| StoreError::InvalidDevice {
            path: shown.clone(),
            reason,
        };
        if let Some(domain) = &failure_domain
            && (domain.trim().is_empty() || domain.len() > 128 || domain.contains('\0'))
        {
            return Err(invalid(format!(
                "failure domain {domain:?}: 1-128 characters, not blank, no NUL"
            )));
        }
        if let Some(pool) = &self.sim {
            return self.add_simulated_device(pool, capacity_bytes, failure_domain);
        }
        let policy = read(&self.admission).clone();
        let least = u64::from(RESERVED_EXTENTS + 1) * EXTENT_SIZE_BYTES;
        if capacity_bytes < least || capacity_bytes > policy.max_device_bytes {
            return Err(invalid(format!(
                "size {capacity_bytes} bytes: from {least} (two {EXTENT_SIZE_BYTES}-byte \
                 extents, one reserved for the device's signature) to {} ([storage] \
                 max_device_bytes)",
                policy.max_device_bytes
            )));
        }
        let Some(data_dir) = &self.data_dir else {
            return Err(invalid("a RAM pool has a fixed size".into()));
        };
        if self.shared.devices.iter().any(|d| !d.is_file_backed()) {
            return Err(invalid(
                "only a pool of device files or block devices grows".into(),
            ));
        }
        if id >= MAX_DEVICES as usize {
            return Err(invalid(format!(
                "the pool has {MAX_DEVICES} devices, the most it may"
            )));
        }
        let relative = format!("devices/dev-{id}.img");
        let request = match path {
            Some(p) => p.to_path_buf(),
            None => {
                // The pool's own device directory is the one directory made here.
                match std::fs::create_dir(data_dir.join("devices")) {
                    Ok(()) => sync_dir(data_dir)?,
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(e.into()),
                }
                data_dir.join(&relative)
            }
        };
        let existing: Vec<PathBuf> = self
            .shared
            .devices
            .iter()
            .map(|d| std::fs::canonicalize(&d.label).unwrap_or_else(|_| PathBuf::from(&d.label)))
            .collect();
        let ctx = AdmissionContext {
            policy: &policy,
            data_dir,
            existing: &existing,
            pool_id: self.pool_id,
        };
        let admitted = ctx
            .admit(&request, capacity_bytes, force)
            .map_err(|e| match e {
                AdmissionError::AlreadyInPool(p) => StoreError::DeviceExists(p),
                AdmissionError::Refused(reason) => invalid(reason),
            })?;
        let abs = admitted.path.clone();
        let capacity = admitted.capacity_bytes;
        if capacity < least {
            return Err(invalid(format!(
                "{capacity} bytes hold fewer than two {EXTENT_SIZE_BYTES}-byte extents (one is \
                 reserved for the device's signature)"
            )));
        }
        let text = abs
            .to_str()
            .ok_or_else(|| invalid("the path is not UTF-8".into()))?
            .to_owned();
        let (record_path, is_relative) = match path {
            None => (relative, true),
            Some(_) => (text, false),
        };
        let extent_count = extents_of(capacity - capacity % EXTENT_SIZE_BYTES)?;
        let reserved = Layout::for_extents(extent_count)
            .reserved_extents
            .max(RESERVED_EXTENTS);
        if reserved >= extent_count {
            return Err(invalid(format!(
                "{capacity} bytes hold no extent beside the {reserved} reserved for the \
                 device's signature and checksums"
            )));
        }
        let rec = DeviceRecord {
            path: record_path,
            relative: is_relative,
            capacity_bytes: capacity - capacity % EXTENT_SIZE_BYTES,
            failure_domain: failure_domain.clone(),
            failed: false,
            reserved_extents: reserved,
        };
        let created = admitted.created;
        let device = Device::from_file(
            id as u32,
            abs.display().to_string(),
            admitted.file,
            admitted.is_block,
            extent_count,
        );
        // It joins as free space: nothing written on it before may surface in a volume. The
        // signature goes on the reserved first extent, durable before the record is.
        device.punch_extents(0, extent_count)?;
        let sig = Signature {
            pool_id: self.pool_id,
            device_id: id as u32,
            reserved_extents: reserved,
            capacity_bytes: rec.capacity_bytes,
            checksums: true,
        };
        device.write(0, 0, &sig.encode())?;
        let device = device.with_checksums()?;
        device.sync_if_dirty()?;
        if created && let Some(parent) = abs.parent() {
            sync_dir(parent)?;
        }
        self.shared
            .commit(&[MetaOp::PutDevice(id as u32, rec)], false)?;
        self.shared
            .devices
            .push(device)
            .map_err(|_| invalid("the device list changed underneath".into()))?;
        {
            let mut pool = lock(&self.shared.pool);
            pool.allocator.add_device(extent_count, failure_domain);
            pool.allocator.reserve_prefix(id, reserved);
        }
        tracing::info!(device = id, path = %abs.display(), extents = extent_count, forced = force, "device added to the pool");
        self.pool_info()
            .devices
            .into_iter()
            .find(|d| d.id as usize == id)
            .ok_or_else(|| invalid("the device vanished after it was added".into()))
    }

    /// Sets what `add_device` may take and the size caps (`AdmissionPolicy`); until called,
    /// the defaults (files under `DATA_DIR/devices/` only, no block device, 64 TiB caps).
    pub fn set_admission_policy(&self, policy: AdmissionPolicy) {
        *write(&self.admission) = policy;
    }

    /// The admission policy in force.
    pub fn admission_policy(&self) -> AdmissionPolicy {
        read(&self.admission).clone()
    }

    /// Fails device `id` for good, durably (`headroom device fail`): it is never allocated
    /// on, written or (while another copy exists) read again, and stays failed after a
    /// restart. Replicated volumes go on from their other copies (`degraded`); a 1-replica
    /// volume with extents there keeps reading them while the device answers, but its FLUSH
    /// fails from now on (its data there is not durable any more). Failing a failed device
    /// again does nothing. Not on a RADOS store (Ceph handles its own failures).
    pub fn fail_device(&self, id: u32) -> Result<DeviceInfo, StoreError> {
        let _management = lock(&self.management);
        let invalid = |reason: String| StoreError::InvalidDevice {
            path: format!("device {id}"),
            reason,
        };
        let Some(device) = self.shared.devices.get(id as usize) else {
            return Err(StoreError::DeviceNotFound(id));
        };
        if !device.is_memory() && !device.is_file_backed() && !device.is_simulated() {
            return Err(invalid(
                "a RADOS store has one device, whose failures Ceph handles".into(),
            ));
        }
        let bit = 1u64 << (id % 64);
        if self.shared.retired.load(Ordering::Acquire) & bit == 0 {
            self.shared.commit(&[MetaOp::FailDevice(id)], false)?;
            device.mark_failed();
            self.shared.retired.fetch_or(bit, Ordering::AcqRel);
            self.shared.recorded_failed.fetch_or(bit, Ordering::AcqRel);
            tracing::warn!(device = id, path = %device.label, "device failed by the operator");
        }
        self.pool_info()
            .devices
            .into_iter()
            .find(|d| d.id == id)
            .ok_or(StoreError::DeviceNotFound(id))
    }

    /// Returns device `id`, failed by errors (a sync or I/O errors) or by the operator, to
    /// service (`headroom device restore`), after a scrub:
    ///
    /// 1. the device is probed (a read and, for files, an `fdatasync`): one that still
    ///    fails is refused and stays failed;
    /// 2. every extent on it that no volume maps any more (copies a rebuild moved away,
    ///    frees that could not be made durable there) is punched, and returned to the free
    ///    pool once the punch is synced;
    /// 3. the device takes writes again, and every copy of a replicated volume on it is made
    ///    equal to a copy on a healthy device (it missed the writes made while it was
    ///    failed); meanwhile reads of those volumes go to the other copies;
    /// 4. the device is synced, its record's `failed` flag cleared durably, its error count
    ///    (what `fail_device_after_errors` counts) starts from zero, and its volumes are
    ///    healthy again.
    ///
    /// A 1-replica volume with data on it can FLUSH again; what it wrote before the failure
    /// and never flushed may be lost (a failed sync may have dropped it), which is why its
    /// FLUSHes failed. Restoring a device in service does nothing (`restored: false`).
    /// Unknown ids are `DeviceNotFound`; a RADOS store refuses (Ceph handles its own
    /// failures). Serialised with the other management operations.
    pub fn restore_device(&self, id: u32) -> Result<DeviceRestore, StoreError> {
        let _management = lock(&self.management);
        let invalid = |reason: String| StoreError::InvalidDevice {
            path: format!("device {id}"),
            reason,
        };
        let Some(device) = self.shared.devices.get(id as usize) else {
            return Err(StoreError::DeviceNotFound(id));
        };
        if !device.is_memory() && !device.is_file_backed() {
            return Err(invalid(
                "a RADOS store has one device, whose failures Ceph handles".into(),
            ));
        }
        let bit = 1u64 << (id % 64);
        let retired = self.shared.retired.load(Ordering::Acquire) & bit != 0;
        let info = |restored: bool, reclaimed: u64, resync: crate::volume::Resync| {
            let device = self
                .pool_info()
                .devices
                .into_iter()
                .find(|d| d.id == id)
                .ok_or(StoreError::DeviceNotFound(id))?;
            Ok(DeviceRestore {
                device,
                restored,
                extents_reclaimed: reclaimed,
                copies_checked: resync.extents_checked,
                chunks_rewritten: resync.chunks_rewritten,
                copies_without_source: resync.without_source,
            })
        };
        let mut resync = crate::volume::Resync::default();
        if !device.is_failed() && !retired {
            return info(false, 0, resync);
        }
        device
            .probe()
            .map_err(|e| invalid(format!("still failing, left failed: {e}")))?;
        // Frees pending on the device become leaked (it is failed), so that what is not free
        // and not mapped below is exactly what no durable map entry points at.
        self.shared.commit(&[], false)?;
        let volumes: Vec<Arc<Volume>> = read(&self.volumes).values().cloned().collect();
        let mut mapped = std::collections::BTreeSet::new();
        let mut replicated = Vec::new();
        for v in &volumes {
            let on = v.extents_on(id);
            if !on.is_empty() && v.replicas() > 1 {
                v.set_stale(id, true);
                replicated.push(Arc::clone(v));
            }
            mapped.extend(on);
        }
        // Nothing new is mapped on a failed device, so an extent unmapped now stays so. With
        // the commit lock no commit is half done: every free not yet durable is pending.
        let orphans: Vec<u32> = {
            let _serial = lock(&self.shared.commit_lock);
            let pool = lock(&self.shared.pool);
            let pending: std::collections::BTreeSet<u32> = pool
                .pending
                .iter()
                .filter_map(|c| match c {
                    Change::Free { phys, .. } if phys.device == id => Some(phys.index),
                    _ => None,
                })
                .collect();
            // The reserved prefix (the device's signature) is Headroom's own, never a volume's.
            let reserved = u64::from(device.extent_count)
                .saturating_sub(pool.allocator.usable_extents(id as usize));
            let reserved = u32::try_from(reserved).unwrap_or(device.extent_count);
            (reserved..device.extent_count)
                .filter(|e| {
                    !mapped.contains(e)
                        && !pending.contains(e)
                        && !pool.allocator.is_free(PhysExtent {
                            device: id,
                            index: *e,
                        })
                })
                .collect()
        };
        let fail_again = |e: StoreError| {
            for v in &replicated {
                v.set_stale(id, false);
            }
            device.mark_failed();
            e
        };
        let mut i = 0;
        while i < orphans.len() {
            let mut j = i + 1;
            while j < orphans.len() && orphans[j] == orphans[j - 1] + 1 {
                j += 1;
            }
            device
                .punch_extents(orphans[i], (j - i) as u32)
                .map_err(|e| fail_again(e.into()))?;
            i = j;
        }
        device.restore();
        for v in &replicated {
            let done = v.resync_copies_on(id).map_err(fail_again)?;
            resync.extents_checked += done.extents_checked;
            resync.chunks_rewritten += done.chunks_rewritten;
            resync.without_source += done.without_source;
        }
        device.sync_now().map_err(|e| fail_again(e.into()))?;
        for v in &replicated {
            v.set_stale(id, false);
        }
        let recorded = self.shared.recorded_failed.load(Ordering::Acquire) & bit != 0;
        let ops: Vec<MetaOp> = if retired || recorded {
            vec![MetaOp::RestoreDevice(id)]
        } else {
            Vec::new()
        };
        self.shared.commit(&ops, false).map_err(fail_again)?;
        self.shared.retired.fetch_and(!bit, Ordering::AcqRel);
        self.shared
            .recorded_failed
            .fetch_and(!bit, Ordering::AcqRel);
        {
            let mut pool = lock(&self.shared.pool);
            for &e in &orphans {
                pool.allocator.release(PhysExtent {
                    device: id,
                    index: e,
                });
            }
            pool.leaked = pool.leaked.saturating_sub(orphans.len() as u64);
        }
        tracing::warn!(
            device = id,
            path = %device.label,
            reclaimed = orphans.len(),
            copies_checked = resync.extents_checked,
            chunks_rewritten = resync.chunks_rewritten,
            "device returned to service by the operator"
        );
        info(true, orphans.len() as u64, resync)
    }

    /// A store whose devices and metadata live in RAM (tests, benchmarks). `capacity_bytes`
    /// is rounded down to whole extents and split over two devices (one if it holds a single
    /// extent). Same code paths as the file store except device I/O and redb's backend.
    pub fn open_memory(capacity_bytes: u64) -> Result<Store, StoreError> {
        let total = capacity_bytes / EXTENT_SIZE_BYTES;
        let counts: Vec<u64> = if total >= 2 {
            vec![total.div_ceil(2), total / 2]
        } else {
            vec![total]
        };
        let meta = Meta::open_memory()?;
        let mut devices = Vec::new();
        let mut ops = vec![MetaOp::Init];
        for (i, &n) in counts.iter().enumerate() {
            let n = u32::try_from(n)
                .map_err(|_| StoreError::InvalidConfig("memory device too large".into()))?;
            devices.push(Device::memory(i as u32, n));
            ops.push(MetaOp::PutDevice(
                i as u32,
                DeviceRecord {
                    path: format!("memory:{i}"),
                    relative: false,
                    capacity_bytes: u64::from(n) * EXTENT_SIZE_BYTES,
                    failure_domain: None,
                    failed: false,
                    reserved_extents: 0,
                },
            ));
        }
        meta.commit(&[], &ops)?;
        let counts: Vec<u32> = devices.iter().map(|d| d.extent_count).collect();
        Ok(Store::assemble(
            meta,
            FailedAtOpen::default(),
            devices,
            Allocator::new(&counts),
            Vec::new(),
            1,
            BTreeMap::new(),
        ))
    }

    fn assemble(
        meta: Meta,
        failed: FailedAtOpen,
        devices: Vec<Device>,
        allocator: Allocator,
        volumes: Vec<LoadedVolume>,
        next_volume_id: u64,
        tenants: BTreeMap<String, TenantRecord>,
    ) -> Store {
        let total_extents: u64 = devices.iter().map(|d| u64::from(d.extent_count)).sum();
        let shared = Arc::new(Shared {
            devices: Devices::new(devices),
            meta,
            pool: Mutex::new(PoolState {
                allocator,
                pending: Vec::new(),
                pending_ops: Vec::new(),
                quarantined: 0,
                leaked: 0,
                quarantine_limit: (total_extents / 16).clamp(1, MAX_QUARANTINE_EXTENTS),
            }),
            commit_lock: Mutex::new(()),
            volume_faults: OnceLock::new(),
            retired: std::sync::atomic::AtomicU64::new(failed.retired.0),
            recorded_failed: std::sync::atomic::AtomicU64::new(failed.recorded.0),
        });
        let by_name = volumes
            .into_iter()
            .map(|v| {
                let name = v.record.name.clone();
                let vol = Volume::new(
                    Arc::clone(&shared),
                    v.id,
                    v.record,
                    v.map,
                    v.replicas,
                    v.allocated_extents,
                );
                (name, vol)
            })
            .collect();
        Store {
            shared,
            volumes: RwLock::new(by_name),
            management: Mutex::new(next_volume_id),
            tenants: RwLock::new(tenants),
            overcommit_ratio: RwLock::new(None),
            telemetry: Mutex::new(Vec::new()),
            data_dir: None,
            sim: None,
            admission: RwLock::new(AdmissionPolicy::default()),
            pool_id: 0,
            #[cfg(feature = "rados")]
            lease: None,
        }
    }

    /// Creates an empty (fully unallocated) volume without QoS settings; durable when this
    /// returns.
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo, StoreError> {
        self.create_volume_with_qos(name, size_bytes, None)
    }

    /// Creates an empty (fully unallocated) volume with opaque QoS settings (`qos` is the
    /// node layer's JSON; the store does not interpret it). The volume and its QoS become
    /// durable in the same commit, before this returns, so no restart can see one without
    /// the other.
    pub fn create_volume_with_qos(
        &self,
        name: &str,
        size_bytes: u64,
        qos: Option<String>,
    ) -> Result<VolumeInfo, StoreError> {
        let options = NewVolume {
            qos,
            ..NewVolume::default()
        };
        self.create_volume_with(name, size_bytes, options)
    }

    /// Creates an empty (fully unallocated) volume with QoS settings, a tenant and an access
    /// mode (`NewVolume`); everything is durable in one commit before this returns. The
    /// tenant and the access mode are fixed for the volume's life.
    pub fn create_volume_with(
        &self,
        name: &str,
        size_bytes: u64,
        options: NewVolume,
    ) -> Result<VolumeInfo, StoreError> {
        validate_volume_name(name)?;
        validate_size(size_bytes, read(&self.admission).max_volume_bytes)?;
        if let Some(tenant) = &options.tenant {
            validate_tenant_id(tenant)?;
        }
        let mut next_volume_id = lock(&self.management);
        if read(&self.volumes).contains_key(name) {
            return Err(StoreError::AlreadyExists(name.to_string()));
        }
        if let Some(tenant) = &options.tenant
            && !read(&self.tenants).contains_key(tenant)
        {
            return Err(StoreError::UnknownTenant(tenant.clone()));
        }
        let replicas = options.replicas.max(1);
        self.check_replicas(replicas)?;
        self.check_overcommit(0, size_bytes.saturating_mul(u64::from(replicas)))?;
        let id = *next_volume_id;
        let record = VolumeRecord {
            name: name.to_string(),
            size_bytes,
            created_unix_s: now_unix_s(),
            qos: options.qos,
            tenant: options.tenant,
            read_only: options.read_only,
            replicas,
            attachments: None,
        };
        // Failed devices do not matter here: the new volume has no data yet.
        self.shared.commit(
            &[
                MetaOp::PutVolume(id, record.clone()),
                MetaOp::SetNextVolumeId(id + 1),
            ],
            false,
        )?;
        *next_volume_id = id + 1;
        let replica_maps = (1..replicas)
            .map(|_| ExtentMap::new(extent_count(size_bytes)))
            .collect();
        let vol = Volume::new(
            Arc::clone(&self.shared),
            id,
            record,
            ExtentMap::new(extent_count(size_bytes)),
            replica_maps,
            0,
        );
        let info = vol.info();
        write(&self.volumes).insert(name.to_string(), vol);
        tracing::info!(
            volume = name,
            id,
            size_bytes,
            tenant = info.tenant.as_deref().unwrap_or("-"),
            read_only = info.read_only,
            replicas,
            "volume created"
        );
        Ok(info)
    }

    /// Refuses a replica count the pool cannot hold: more than `MAX_REPLICAS`, more than 1
    /// on RADOS, or more than the healthy devices.
    fn check_replicas(&self, replicas: u8) -> Result<(), StoreError> {
        let invalid = |reason: String| StoreError::InvalidReplicas { replicas, reason };
        if replicas > MAX_REPLICAS {
            return Err(invalid(format!("at most {MAX_REPLICAS} replicas")));
        }
        if replicas == 1 {
            return Ok(());
        }
        if self
            .shared
            .devices
            .iter()
            .any(|d| !d.is_memory() && !d.is_file_backed() && !d.is_simulated())
        {
            return Err(invalid(
                "a RADOS store keeps one copy of each extent: Ceph replicates the pool \
                 itself (set the pool's size instead)"
                    .into(),
            ));
        }
        let healthy = self
            .shared
            .devices
            .iter()
            .filter(|d| !d.is_failed())
            .count();
        if usize::from(replicas) > healthy {
            return Err(invalid(format!(
                "replicas go to distinct devices and the pool has {healthy} healthy device(s)"
            )));
        }
        Ok(())
    }

    /// All volumes, sorted by name.
    pub fn list_volumes(&self) -> Vec<VolumeInfo> {
        read(&self.volumes).values().map(|v| v.info()).collect()
    }

    pub fn volume_info(&self, name: &str) -> Result<VolumeInfo, StoreError> {
        Ok(self.lookup(name)?.info())
    }

    /// A shared handle to the volume; every handle of a name is the same `Volume`.
    pub fn open_volume(&self, name: &str) -> Result<Arc<Volume>, StoreError> {
        self.lookup(name)
    }

    fn lookup(&self, name: &str) -> Result<Arc<Volume>, StoreError> {
        read(&self.volumes)
            .get(name)
            .cloned()
            .ok_or_else(|| StoreError::NotFound(name.to_string()))
    }

    /// Grows or shrinks a volume; durable when this returns. Shrinking releases (and punches)
    /// every extent past the new end and zeroes the rest of the last extent, so a later grow
    /// exposes zeros.
    pub fn resize_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo, StoreError> {
        validate_size(size_bytes, read(&self.admission).max_volume_bytes)?;
        let _serial = lock(&self.management);
        let vol = self.lookup(name)?;
        let copies = u64::from(vol.replicas());
        self.check_overcommit(
            vol.size_bytes().saturating_mul(copies),
            size_bytes.saturating_mul(copies),
        )?;
        vol.resize(size_bytes)?;
        tracing::info!(volume = name, size_bytes, "volume resized");
        Ok(vol.info())
    }

    /// Replaces a volume's opaque QoS settings (`None` clears them); durable when this returns.
    /// `NotFound` for an unknown name.
    pub fn set_volume_qos(
        &self,
        name: &str,
        qos: Option<String>,
    ) -> Result<VolumeInfo, StoreError> {
        let _serial = lock(&self.management);
        let vol = self.lookup(name)?;
        vol.set_qos(qos)?;
        tracing::info!(volume = name, "volume QoS set");
        Ok(vol.info())
    }

    /// Replaces where a volume is attached besides NBD (opaque JSON of the node's, `None`
    /// clears it); durable when this returns. `NotFound` for an unknown name.
    pub fn set_volume_attachments(
        &self,
        name: &str,
        attachments: Option<String>,
    ) -> Result<VolumeInfo, StoreError> {
        let _serial = lock(&self.management);
        let vol = self.lookup(name)?;
        vol.set_attachments(attachments)?;
        tracing::info!(volume = name, "volume attachments set");
        Ok(vol.info())
    }

    /// Whether the store can commit metadata now (for a readiness probe): the last metadata
    /// write succeeded (or a probe commit does now) and the metadata reserve is intact.
    /// After a failed write or with the reserve released it commits an empty transaction
    /// (reopening a poisoned database) and tries to take the reserve again, so the answer
    /// turns ready again once the cause is gone without waiting for a FLUSH. Cheap when
    /// healthy (no I/O); one redb commit otherwise. Call it from a blocking thread. A
    /// metadata commit in progress for [`crate::COMMIT_HUNG_AFTER_MS`] or more is a reason
    /// ("a metadata commit has not finished for N ms"), and then nothing is probed.
    /// A RADOS store whose lease is lost is not ready, with the loss as its one reason, and
    /// probes nothing (its pool refuses every operation then).
    pub fn commit_health(&self) -> crate::meta::CommitHealth {
        if let Some(loss) = self.lease_lost() {
            return crate::meta::CommitHealth {
                reasons: vec![format!(
                    "lost the store's lease ({}): another node may serve it now; this node \
                     serves nothing",
                    loss.why
                )],
            };
        }
        self.shared.meta.health(true)
    }

    /// What [`Store::commit_health`] knows without a probe commit: no I/O, so it never
    /// blocks on a device or a cluster that does not answer (the metrics' readiness gauge;
    /// `/readyz` probes, within its bound).
    pub fn commit_health_known(&self) -> crate::meta::CommitHealth {
        if self.lease_lost().is_some() {
            return self.commit_health();
        }
        self.shared.meta.health(false)
    }

    /// How long the oldest metadata commit in progress has run, when that is
    /// [`crate::COMMIT_HUNG_AFTER_MS`] or more (the storage under the metadata stopped
    /// answering: `commit_watch.rs`); `None` otherwise. No I/O: `/readyz` asks it first, and
    /// answers with [`Store::commit_health_known`] without probing while it is `Some`.
    pub fn commit_hung_for(&self) -> Option<std::time::Duration> {
        self.shared.meta.commit_hung_for()
    }

    /// Counts a metadata commit that started at `at` as in progress until the guard drops,
    /// as if it hung since then: for tests of what readiness says, without a disk that
    /// stops answering.
    #[doc(hidden)]
    pub fn commit_in_progress_since(&self, at: Instant) -> crate::CommitInProgress<'_> {
        self.shared.meta.commit_in_progress_since(at)
    }

    /// Releases the lease of a RADOS store at the end of a clean shutdown, after the last
    /// flush (lease.rs): the next node takes it at once and fences nobody; the store takes
    /// no I/O after this. Nothing for other stores.
    pub fn release_lease(&self) {
        #[cfg(feature = "rados")]
        if let Some(lease) = &self.lease {
            lease.release();
        }
    }

    /// Why and when this node lost the lease of its RADOS store (lease.rs); `None` while it
    /// holds it, and for every other store. Once lost, every later I/O of the store fails.
    pub fn lease_lost(&self) -> Option<crate::lease_loss::LeaseLoss> {
        #[cfg(feature = "rados")]
        {
            self.lease.as_ref().and_then(crate::lease::Lease::loss)
        }
        #[cfg(not(feature = "rados"))]
        None
    }

    /// Saves the node's runtime QoS state (opaque bytes, e.g. credit balances) for each
    /// `(volume id, bytes)`, replacing earlier rows, in one redb transaction committed with
    /// immediate durability. Rows naming a volume that no longer exists are skipped, so a
    /// save racing a deletion cannot resurrect the deleted volume's row; ids are never reused.
    ///
    /// Cost and locking: one redb write transaction and one fsync of the metadata file (a
    /// few thousand rows are a few milliseconds), so call it from a blocking thread, not an
    /// async worker. It takes none of the store's locks (no pool mutex, no volume lock, not
    /// the commit mutex, not the management mutex): it touches neither devices nor extent
    /// maps, so it needs no ordering with the commit protocol. The only contention is redb's
    /// own single-writer lock: a FLUSH that reaches its metadata transaction while a save is
    /// committing waits for that one transaction, and vice versa.
    pub fn save_volume_states(&self, states: &[(u64, Vec<u8>)]) -> Result<(), StoreError> {
        let saved = self.shared.meta.save_states(states)?;
        tracing::trace!(given = states.len(), saved, "volume states saved");
        Ok(())
    }

    /// Every saved state row, as `(volume id, bytes)` sorted by id, of volumes that exist
    /// (map ids to names with `list_volumes`). A volume's row is deleted in the same commit
    /// as the volume.
    pub fn volume_states(&self) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        self.shared.meta.load_states()
    }

    /// Deletes a volume and frees (punches) all its space; durable when this returns. Its
    /// saved state row (`save_volume_states`) goes in the same commit. Open handles fail
    /// every later call with `VolumeDeleted`.
    pub fn delete_volume(&self, name: &str) -> Result<(), StoreError> {
        let _serial = lock(&self.management);
        let vol = write(&self.volumes)
            .remove(name)
            .ok_or_else(|| StoreError::NotFound(name.to_string()))?;
        vol.destroy()?;
        tracing::info!(volume = name, "volume deleted");
        Ok(())
    }

    /// Limits the sum of the volume sizes to `ratio` times the pool capacity (`None`: no
    /// limit). Volumes already over it stay; only creating or growing one is refused
    /// (`Overcommitted`). Shrinking and deleting always work.
    pub fn set_overcommit_ratio(&self, ratio: Option<f64>) {
        *write(&self.overcommit_ratio) = ratio;
    }

    /// Whether every device keeps its data in RAM (RAM devices, files on tmpfs or ramfs):
    /// then no block operation waits for a disk, and the node may run them inline on its
    /// network threads.
    pub fn is_memory_resident(&self) -> bool {
        self.shared.devices.iter().all(|d| d.is_memory_resident())
    }

    /// The ratio in force (`None`: no limit).
    pub fn overcommit_ratio(&self) -> Option<f64> {
        *read(&self.overcommit_ratio)
    }

    /// Sum of the volume sizes, each times its replica count (the pool space the volumes
    /// can take when full).
    pub fn provisioned_bytes(&self) -> u64 {
        read(&self.volumes).values().fold(0u64, |sum, v| {
            sum.saturating_add(v.size_bytes().saturating_mul(u64::from(v.replicas())))
        })
    }

    /// Refuses a change from `old_bytes` to `new_bytes` of one volume's size that would take
    /// the provisioned sum over the limit. Call under `management`.
    fn check_overcommit(&self, old_bytes: u64, new_bytes: u64) -> Result<(), StoreError> {
        let Some(ratio) = self.overcommit_ratio() else {
            return Ok(());
        };
        if new_bytes <= old_bytes {
            return Ok(());
        }
        let provisioned_bytes = self.provisioned_bytes();
        let after_bytes = provisioned_bytes
            .saturating_sub(old_bytes)
            .saturating_add(new_bytes);
        let capacity_bytes = self.capacity_bytes();
        // f64 to u64 saturates; capacities are far below 2^53, so the product is exact enough.
        let limit_bytes = (capacity_bytes as f64 * ratio) as u64;
        if after_bytes > limit_bytes {
            return Err(StoreError::Overcommitted {
                provisioned_bytes,
                after_bytes,
                limit_bytes,
                capacity_bytes,
                ratio,
            });
        }
        Ok(())
    }

    /// The pool's capacity: every device's extents.
    /// The bytes volumes may use: every device's extents less its reserved ones.
    fn capacity_bytes(&self) -> u64 {
        let pool = lock(&self.shared.pool);
        (0..self.shared.devices.len())
            .map(|d| pool.allocator.usable_extents(d) * EXTENT_SIZE_BYTES)
            .sum()
    }

    /// Creates a tenant (checked with `validate_tenant_id`); durable when this returns.
    pub fn create_tenant(&self, id: &str) -> Result<TenantInfo, StoreError> {
        validate_tenant_id(id)?;
        let _serial = lock(&self.management);
        if read(&self.tenants).contains_key(id) {
            return Err(StoreError::TenantExists(id.to_string()));
        }
        let rec = TenantRecord {
            created_unix_s: now_unix_s(),
        };
        self.shared
            .commit(&[MetaOp::PutTenant(id.to_string(), rec.clone())], false)?;
        write(&self.tenants).insert(id.to_string(), rec);
        tracing::info!(tenant = id, "tenant created");
        self.tenant_info(id)
    }

    /// Every tenant with its volume count and sizes, sorted by id.
    pub fn list_tenants(&self) -> Vec<TenantInfo> {
        let tenants = read(&self.tenants).clone();
        let volumes = self.list_volumes();
        tenants
            .into_iter()
            .map(|(id, rec)| tenant_info(id, &rec, &volumes))
            .collect()
    }

    /// One tenant; `TenantNotFound` for an unknown id.
    pub fn tenant_info(&self, id: &str) -> Result<TenantInfo, StoreError> {
        let rec = read(&self.tenants)
            .get(id)
            .cloned()
            .ok_or_else(|| StoreError::TenantNotFound(id.to_string()))?;
        Ok(tenant_info(id.to_string(), &rec, &self.list_volumes()))
    }

    /// Deletes a tenant that has no volume left; durable when this returns.
    pub fn delete_tenant(&self, id: &str) -> Result<(), StoreError> {
        let _serial = lock(&self.management);
        if !read(&self.tenants).contains_key(id) {
            return Err(StoreError::TenantNotFound(id.to_string()));
        }
        let volumes = read(&self.volumes)
            .values()
            .filter(|v| v.tenant() == Some(id))
            .count();
        if volumes > 0 {
            return Err(StoreError::TenantHasVolumes {
                tenant: id.to_string(),
                volumes,
            });
        }
        self.shared
            .commit(&[MetaOp::DeleteTenant(id.to_string())], false)?;
        write(&self.tenants).remove(id);
        tracing::info!(tenant = id, "tenant deleted");
        Ok(())
    }

    /// Makes everything acknowledged so far durable (used at shutdown). Fails if a device is
    /// failed (other than by the operator, `fail_device`): its acknowledged data may be lost.
    pub fn flush_all(&self) -> Result<(), StoreError> {
        self.shared.commit_all(&[])
    }

    /// Installs fault injection (a testing tool; `crate::fault`): rules scoped to a volume
    /// act on that volume's requests, rules scoped to a device on every operation of that
    /// device. Once per store; time-based rules count from this call. `InvalidConfig` for a
    /// rule out of range, an unknown device id, or a second call.
    pub fn inject_faults(&self, config: &FaultConfig) -> Result<(), StoreError> {
        config
            .validate()
            .map_err(|e| StoreError::InvalidConfig(format!("faults: {e}")))?;
        let started = Instant::now();
        let mut per_device: Vec<Vec<ActiveRule>> =
            self.shared.devices.iter().map(|_| Vec::new()).collect();
        let mut per_volume = Vec::new();
        for (index, rule) in config.rules.iter().enumerate() {
            let active = ActiveRule::new(rule.clone(), index, config.seed, started);
            match &rule.scope {
                FaultScope::Volume(_) => per_volume.push(active),
                FaultScope::Device(id) => per_device
                    .get_mut(*id as usize)
                    .ok_or_else(|| {
                        StoreError::InvalidConfig(format!(
                            "faults: rule[{index}].device = {id}: the pool has devices 0 to {}",
                            self.shared.devices.len().saturating_sub(1)
                        ))
                    })?
                    .push(active),
            }
        }
        let already = || StoreError::InvalidConfig("faults: already installed".into());
        if self.shared.volume_faults.set(per_volume).is_err() {
            return Err(already());
        }
        for (device, rules) in self.shared.devices.iter().zip(per_device) {
            if !device.install_faults(rules) {
                return Err(already());
            }
        }
        for rule in &config.rules {
            tracing::warn!(
                seed = config.seed,
                "fault injection on {}: {rule:?}",
                rule.scope
            );
        }
        Ok(())
    }

    pub fn pool_info(&self) -> PoolInfo {
        let (per_device_free, free, quarantined, leaked) = {
            let pool = lock(&self.shared.pool);
            let per: Vec<(u64, u64, Option<String>)> = (0..self.shared.devices.len())
                .map(|d| {
                    (
                        pool.allocator.free_extents(d),
                        pool.allocator.usable_extents(d),
                        pool.allocator.failure_domain(d).map(str::to_owned),
                    )
                })
                .collect();
            (
                per,
                pool.allocator.total_free_extents(),
                pool.quarantined,
                pool.leaked,
            )
        };
        let devices: Vec<DeviceInfo> = self
            .shared
            .devices
            .iter()
            .zip(per_device_free)
            .map(|(d, (free_extents, usable, failure_domain))| DeviceInfo {
                id: d.id,
                path: d.label.clone(),
                capacity_bytes: d.capacity_bytes(),
                extent_count: usable,
                reserved_extents: u64::from(d.extent_count).saturating_sub(usable),
                free_extents,
                physical_used_bytes: d.physical_used_bytes(),
                failed: d.is_failed(),
                failure_domain,
                checksums: d.has_checksums(),
            })
            .collect();
        let total: u64 = devices.iter().map(|d| d.extent_count).sum();
        PoolInfo {
            extent_size_bytes: EXTENT_SIZE_BYTES,
            capacity_bytes: total * EXTENT_SIZE_BYTES,
            free_bytes: free * EXTENT_SIZE_BYTES,
            total_extents: total,
            free_extents: free,
            allocated_extents: total.saturating_sub(free + quarantined + leaked),
            quarantined_extents: quarantined,
            leaked_extents: leaked,
            devices,
        }
    }

    /// Every device's operation counters (operations, errors, latency per operation), read
    /// now: what `/metrics` reports per device.
    pub fn device_stats(&self) -> Vec<crate::stats::DeviceStats> {
        self.shared
            .devices
            .iter()
            .map(|d| crate::stats::DeviceStats {
                device: d.label.clone(),
                ops: d.stats(),
                timed: !d.is_memory(),
                errors_in_service: d.errors_in_service(),
                checksum_errors: d.checksum_errors(),
                repaired_blocks: d.repaired_blocks(),
            })
            .collect()
    }

    /// Takes every device's counters into its telemetry at `now_ns` (a monotonic clock of
    /// the caller's, the same origin every call): the node's sampler calls it once per
    /// interval. See `telemetry` for what is smoothed and how.
    pub fn observe_devices(&self, now_ns: u64) {
        let mut states = self.telemetry.lock().unwrap_or_else(|p| p.into_inner());
        states.resize_with(self.shared.devices.len(), Default::default);
        for (state, device) in states.iter_mut().zip(&self.shared.devices) {
            state.observe(now_ns, &device.stats());
        }
        // Placement weighs each device's load: the time it spends busy per second.
        let load: Vec<f64> = states.iter().map(|s| s.current().busy_fraction()).collect();
        drop(states);
        lock(&self.shared.pool).allocator.set_load(&load);
    }

    /// Every device's telemetry as of the last `observe_devices`, in device order (the id is
    /// the index); all zero and unknown before two observations.
    pub fn device_telemetry(&self) -> Vec<crate::telemetry::DeviceTelemetry> {
        let states = self.telemetry.lock().unwrap_or_else(|p| p.into_inner());
        (0..self.shared.devices.len())
            .map(|i| states.get(i).map(|s| s.current()).unwrap_or_default())
            .collect()
    }

    /// Whether the devices live in RAM (`open_memory`).
    pub fn is_memory(&self) -> bool {
        self.shared.devices.iter().all(Device::is_memory)
    }
}

fn tenant_info(id: String, rec: &TenantRecord, volumes: &[VolumeInfo]) -> TenantInfo {
    let own = volumes
        .iter()
        .filter(|v| v.tenant.as_deref() == Some(id.as_str()));
    let (count, provisioned_bytes, allocated_bytes) = own.fold((0, 0u64, 0u64), |acc, v| {
        (
            acc.0 + 1,
            acc.1.saturating_add(v.size_bytes),
            acc.2.saturating_add(v.allocated_bytes),
        )
    });
    TenantInfo {
        id,
        created_unix_s: rec.created_unix_s,
        volumes: count,
        provisioned_bytes,
        allocated_bytes,
    }
}

/// Unit of comparison of the replica resync: a chunk that differs is rewritten whole.
const RESYNC_CHUNK_BYTES: usize = 64 * 1024;

/// After an unclean shutdown, makes every copy of every allocated extent of the replicated
/// volumes equal to the first copy that reads (replica 0 unless it fails), chunk by chunk:
/// a differing chunk is written, or punched when the source reads zero, and the devices are
/// synced before the store serves. This closes the window a crash opens between the writes
/// of one request to its copies: without it, a later failover from one copy to another
/// could show a reader data changing under it. Returns (extents compared, chunks repaired).
///
/// Cost: every allocated extent of a replicated volume is read once per copy (2 MiB each),
/// at startup, only after an unclean shutdown. See docs/ARCHITECTURE.md for the alternative
/// (a write-intent record) that would bound it to the extents written since the last FLUSH.
fn resync_replicas(devices: &[Device], volumes: &[LoadedVolume]) -> Result<(u64, u64), StoreError> {
    let mut src = vec![0u8; EXTENT_SIZE_BYTES as usize];
    let mut dst = vec![0u8; EXTENT_SIZE_BYTES as usize];
    let device = |p: PhysExtent| {
        devices
            .get(p.device as usize)
            .ok_or_else(|| corrupt(format!("extent on unknown device {}", p.device)))
    };
    let (mut extents, mut chunks) = (0u64, 0u64);
    for v in volumes.iter().filter(|v| !v.replicas.is_empty()) {
        for (extent, entry) in v.map.allocated_in(0, v.map.extent_count()) {
            let copies: Vec<PhysExtent> = std::iter::once(entry)
                .chain(v.replicas.iter().map(|m| m.get(extent)))
                .filter_map(PhysExtent::from_entry)
                .collect();
            // The source: the first copy that reads (on a device not failed by the operator).
            let copies: Vec<PhysExtent> = copies
                .into_iter()
                .filter(|p| {
                    devices
                        .get(p.device as usize)
                        .is_some_and(|d| !d.is_failed())
                })
                .collect();
            let mut source = None;
            for (i, &p) in copies.iter().enumerate() {
                match device(p)?.read(p.index, 0, &mut src) {
                    Ok(()) => {
                        source = Some(i);
                        break;
                    }
                    Err(e) => tracing::warn!(
                        volume = v.record.name.as_str(),
                        extent,
                        device = p.device,
                        error = %e,
                        "resync: a copy does not read; trying the next"
                    ),
                }
            }
            let Some(source) = source else {
                if copies.is_empty() {
                    continue; // every copy on a failed device: nothing to compare
                }
                return Err(StoreError::Io(std::io::Error::other(format!(
                    "resync of volume {} extent {extent}: no copy reads",
                    v.record.name
                ))));
            };
            extents += 1;
            for (_, &p) in copies.iter().enumerate().filter(|&(i, _)| i != source) {
                let d = device(p)?;
                match d.read(p.index, 0, &mut dst) {
                    Ok(()) => {}
                    // Blocks of this copy fail verification: every chunk is rewritten from
                    // the source (which verified), as if all of them differed.
                    Err(e) if crate::checksum::mismatch_of(&e).is_some() => {
                        tracing::warn!(
                            volume = v.record.name.as_str(),
                            extent,
                            device = p.device,
                            "resync: a copy fails checksum verification; rewriting it from the source"
                        );
                        for (t, s) in dst.iter_mut().zip(src.iter()) {
                            *t = !*s;
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
                for (k, (s, t)) in src
                    .chunks(RESYNC_CHUNK_BYTES)
                    .zip(dst.chunks(RESYNC_CHUNK_BYTES))
                    .enumerate()
                {
                    if s == t {
                        continue;
                    }
                    let off = (k * RESYNC_CHUNK_BYTES) as u64;
                    if s.iter().all(|&b| b == 0) {
                        d.punch(p.index, off, s.len() as u64)?;
                    } else {
                        d.write(p.index, off, s)?;
                    }
                    chunks += 1;
                }
            }
        }
    }
    if chunks > 0 {
        // Never a failed device: no copy there was compared or written, and its sync fails.
        for d in devices.iter().filter(|d| !d.is_failed()) {
            d.sync_if_dirty()?;
        }
    }
    Ok((extents, chunks))
}

/// A new pool's id: 8 bytes of `/dev/urandom` (never 0, which marks a RAM pool).
fn random_pool_id() -> Result<u64, StoreError> {
    use std::io::Read;
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| StoreError::Io(std::io::Error::new(e.kind(), format!("/dev/urandom: {e}"))))?;
    Ok(u64::from_le_bytes(bytes).max(1))
}

/// Writes device `device_id`'s signature at byte 0 of `file` and syncs it.
fn write_signature(
    file: &std::fs::File,
    pool_id: u64,
    device_id: u32,
    rec: &DeviceRecord,
    checksums: bool,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let sig = Signature {
        pool_id,
        device_id,
        reserved_extents: rec.reserved_extents,
        capacity_bytes: rec.capacity_bytes,
        checksums,
    };
    file.write_all_at(&sig.encode(), 0)?;
    file.sync_data()
}

/// What a recorded-as-signed device's first block says at open.
enum SignatureCheck {
    Ours(Signature),
    /// Another pool's device, or another device of this pool.
    Foreign(Signature),
    /// No valid signature (missing, damaged, unreadable): why.
    Unreadable(String),
}

fn check_signature(file: &std::fs::File, pool_id: u64, device_id: u32) -> SignatureCheck {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; SIGNATURE_LEN];
    if let Err(e) = file.read_exact_at(&mut buf, 0) {
        return SignatureCheck::Unreadable(format!("reading it: {e}"));
    }
    match Signature::decode(&buf) {
        Ok(sig) if sig.pool_id == pool_id && sig.device_id == device_id => {
            SignatureCheck::Ours(sig)
        }
        Ok(sig) => SignatureCheck::Foreign(sig),
        Err(e) => SignatureCheck::Unreadable(e.to_string()),
    }
}

/// Rebuilds the allocator and the in-memory extent maps from loaded metadata, checking that
/// every row is consistent (known volume, extent inside it, physical extent inside a device
/// and mapped once).
fn rebuild(
    devices: &[Device],
    reserved: &[u32],
    loaded: &crate::meta::Loaded,
) -> Result<(Allocator, Vec<LoadedVolume>), StoreError> {
    let counts: Vec<u32> = devices.iter().map(|d| d.extent_count).collect();
    rebuild_on(&counts, reserved, loaded)
}

/// `rebuild` on devices of these extent counts (`headroom check` runs it without opening
/// the devices; the reserved extents come from the device records).
pub(crate) fn check_rows(counts: &[u32], loaded: &crate::meta::Loaded) -> Result<(), StoreError> {
    let reserved: Vec<u32> = (0..counts.len())
        .map(|d| {
            loaded
                .devices
                .iter()
                .find(|(id, _)| *id as usize == d)
                .map_or(0, |(_, r)| r.reserved_extents)
        })
        .collect();
    rebuild_on(counts, &reserved, loaded).map(|_| ())
}

fn rebuild_on(
    counts: &[u32],
    reserved: &[u32],
    loaded: &crate::meta::Loaded,
) -> Result<(Allocator, Vec<LoadedVolume>), StoreError> {
    let mut allocator = Allocator::new(counts);
    for (d, &n) in reserved.iter().enumerate() {
        if !allocator.reserve_prefix(d, n) {
            return Err(corrupt(format!(
                "device {d} reserves {n} extents, more than it has"
            )));
        }
    }
    let mut volumes: BTreeMap<u64, LoadedVolume> = BTreeMap::new();
    for (id, rec) in &loaded.volumes {
        if validate_volume_name(&rec.name).is_err()
            || validate_size(rec.size_bytes, MAX_VOLUME_SIZE_BYTES).is_err()
        {
            return Err(corrupt(format!("volume {id} has an invalid name or size")));
        }
        if !(1..=MAX_REPLICAS).contains(&rec.replicas) {
            return Err(corrupt(format!(
                "volume {id} has {} replicas (1 to {MAX_REPLICAS})",
                rec.replicas
            )));
        }
        // A tenant id the rule refuses cannot match a client; the volume is still served to
        // nobody but its (impossible) tenant, so load it and say so rather than refuse the pool.
        if let Some(tenant) = &rec.tenant
            && let Err(err) = validate_tenant_id(tenant)
        {
            tracing::warn!(volume = rec.name.as_str(), "stored tenant: {err}");
        }
        volumes.insert(
            *id,
            LoadedVolume {
                id: *id,
                record: rec.clone(),
                map: ExtentMap::new(extent_count(rec.size_bytes)),
                replicas: (1..rec.replicas)
                    .map(|_| ExtentMap::new(extent_count(rec.size_bytes)))
                    .collect(),
                allocated_extents: 0,
            },
        );
    }
    // A physical extent a map row names must exist and belong to nobody else yet.
    let claim = |allocator: &mut Allocator, volume_id, phys: PhysExtent| {
        counts
            .get(phys.device as usize)
            .is_some_and(|&n| phys.index < n)
            && allocator.mark_used(volume_id, phys)
    };
    for &(volume_id, extent, phys) in &loaded.extents {
        let vol = volumes
            .get_mut(&volume_id)
            .ok_or_else(|| corrupt(format!("extent row for unknown volume {volume_id}")))?;
        let slot = vol.map.slot(extent).ok_or_else(|| {
            corrupt(format!(
                "volume {volume_id} maps extent {extent} past its end"
            ))
        })?;
        if !claim(&mut allocator, volume_id, phys) {
            return Err(corrupt(format!(
                "volume {volume_id} extent {extent}: physical extent {phys:?} is invalid or mapped twice"
            )));
        }
        slot.store(phys.to_entry(), Ordering::Release);
        vol.allocated_extents += 1;
    }
    for &(volume_id, replica, extent, phys) in &loaded.replica_extents {
        let vol = volumes
            .get_mut(&volume_id)
            .ok_or_else(|| corrupt(format!("replica row for unknown volume {volume_id}")))?;
        let slot = vol
            .replicas
            .get(usize::from(replica).wrapping_sub(1))
            .and_then(|m| m.slot(extent))
            .ok_or_else(|| {
                corrupt(format!(
                    "volume {volume_id} maps extent {extent} of replica {replica}, which it \
                     does not have"
                ))
            })?;
        if !claim(&mut allocator, volume_id, phys) {
            return Err(corrupt(format!(
                "volume {volume_id} extent {extent} replica {replica}: physical extent \
                 {phys:?} is invalid or mapped twice"
            )));
        }
        slot.store(phys.to_entry(), Ordering::Release);
        vol.allocated_extents += 1;
    }
    let mut names = std::collections::HashSet::new();
    for v in volumes.values() {
        if !names.insert(v.record.name.as_str()) {
            return Err(corrupt(format!("two volumes named {:?}", v.record.name)));
        }
    }
    Ok((allocator, volumes.into_values().collect()))
}
