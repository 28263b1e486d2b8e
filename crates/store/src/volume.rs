//! A volume: the I/O path and the extent lifecycle of one virtual disk.
//!
//! Why: this is the hot path of the server. A read or write takes the volume's read lock (a
//! shared, uncontended counter), resolves each extent through the atomic in-memory map and
//! does positional I/O on the device; nothing is allocated per I/O. Only a write to a hole
//! takes the pool mutex (to allocate), and only a release (TRIM / WRITE_ZEROES of whole
//! extents, shrink, delete) takes the volume's write lock — which waits for in-flight I/O of
//! this volume, so no write can land in an extent after it was freed and handed to another
//! volume.
//!
//! A replicated volume (2 or 3 copies) has one extent map per replica; the copies of a
//! logical extent are allocated together, every write, zeroing and punch goes to every copy
//! on a healthy device before the request completes, and a read goes to the copy the routing
//! function (`route_read`) picks. A 1-replica volume has no replica maps, and its I/O takes
//! the same path as before replication existed plus one predictable branch per piece.

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::checksum::{BLOCK_BYTES, mismatch_of};
use crate::device::Device;
use crate::error::StoreError;
use crate::extent_map::{CHUNK_EXTENTS, ExtentMap};
use crate::fault::{self, FaultScope, IoClass};
use crate::layout::{
    EXTENT_SIZE_BYTES, MAX_REPLICAS, PENDING_BIT, PhysExtent, Piece, extent_count, pieces,
};
use crate::meta::{MetaOp, VolumeRecord};
use crate::stats::is_no_space;
use crate::store::{Change, DeviceSet, Shared};
use crate::sync::{lock, read};

// Asynchronous data I/O on RADOS: a child module, so it sees this module's private parts.
#[path = "volume_aio.rs"]
mod aio;
mod repair;
mod restore;
pub(crate) use restore::Resync;

pub use aio::{AioDone, AioRequest};
pub use repair::{RebuildStep, ScrubReport};

/// What the management API and CLI show about a volume.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct VolumeInfo {
    pub name: String,
    pub id: u64,
    pub size_bytes: u64,
    /// Space taken in the pool: allocated extents times `EXTENT_SIZE_BYTES`.
    pub allocated_bytes: u64,
    pub created_unix_s: u64,
    /// The volume's QoS settings: opaque JSON owned by the node layer (the store does not
    /// depend on the QoS crate). Absent from the JSON when unset, and optional when read, so
    /// clients and servers of different versions keep understanding each other.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qos: Option<String>,
    /// The tenant the volume belongs to; `None`: no tenant. Absent from the JSON when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Exported read-only. Absent from the JSON when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// Copies of every extent, on distinct devices (1 to `MAX_REPLICAS`); 1 when absent.
    #[serde(default = "one_replica")]
    pub replicas: u8,
    /// `degraded` while some of its extents are on a failed device.
    #[serde(default)]
    pub health: VolumeHealth,
}

/// Whether every copy of a volume's data is on a healthy device.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum VolumeHealth {
    /// No extent of the volume is on a failed device.
    #[default]
    Healthy,
    /// Some extents are on a failed device: a replicated volume serves them from the other
    /// copies (with less redundancy); a 1-replica volume may have lost them.
    Degraded,
    /// Degraded, and a rebuild is copying the lost copies onto healthy devices
    /// (`Volume::rebuild_extent`, driven by the node's rebuild task).
    Rebuilding,
}

fn one_replica() -> u8 {
    1
}

/// One run of a BLOCK_STATUS answer (`base:allocation`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    /// No storage behind this range (NBD_STATE_HOLE).
    pub hole: bool,
    /// This range reads as zeros (NBD_STATE_ZERO).
    pub zero: bool,
}

/// Where a logical extent is stored (diagnostics and tests).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhysicalLocation {
    pub device: u32,
    /// Byte offset of the extent on the device.
    pub offset_bytes: u64,
    /// The allocation is committed to the metadata database.
    pub committed: bool,
}

#[derive(Debug)]
pub(crate) struct VolumeState {
    size_bytes: u64,
    /// Replica 0: the only copy of a 1-replica volume.
    map: ExtentMap,
    /// Replicas 1 and up (empty for a 1-replica volume). An entry of these is set before
    /// replica 0's entry of the same extent (both under the pool mutex), so whoever sees
    /// replica 0 allocated sees every copy allocated.
    replicas: Vec<ExtentMap>,
}

impl VolumeState {
    /// Every replica's map, replica 0 first.
    fn maps(&self) -> impl Iterator<Item = &ExtentMap> {
        std::iter::once(&self.map).chain(&self.replicas)
    }

    /// The map of replica `replica`.
    fn map_of(&self, replica: usize) -> Option<&ExtentMap> {
        match replica {
            0 => Some(&self.map),
            r => self.replicas.get(r - 1),
        }
    }
}

/// A volume handle (`Arc<Volume>` from `Store::open_volume`), usable from many threads.
pub struct Volume {
    id: u64,
    name: String,
    created_unix_s: u64,
    /// Opaque QoS settings; changed only under the store's management mutex, after the commit
    /// that made the change durable.
    qos: Mutex<Option<String>>,
    /// Opaque attachments (the node's vhost-user sockets); changed like `qos`.
    attachments: Mutex<Option<String>>,
    /// Fixed at creation.
    tenant: Option<String>,
    /// Fixed at creation.
    read_only: bool,
    /// Copies of every extent; fixed at creation.
    replicas: u8,
    /// Replicated volumes: a write to the copies of an extent holds the lock of its stripe
    /// (extent index modulo the count), so two overlapping writes in flight at once reach
    /// every copy in the same order and the copies end up equal (NBD leaves the order of
    /// overlapping writes open, but not that the copies then disagree). Empty for 1 replica.
    copy_locks: Box<[Mutex<()>]>,
    shared: Arc<Shared>,
    me: Weak<Volume>,
    state: RwLock<VolumeState>,
    size_bytes: AtomicU64,
    allocated_extents: AtomicU64,
    deleted: AtomicBool,
    /// Warnings about failed requests, rate-limited.
    errors: ErrorLog,
    /// A rebuild of this volume's lost copies is running (set by its driver): a degraded
    /// volume then reports `Rebuilding`.
    rebuilding: AtomicBool,
    /// Asynchronous reads and writes in flight (volume_aio.rs); whoever takes `state`'s
    /// write lock waits for them, as it waits for synchronous I/O through the read lock.
    in_flight: Arc<aio::InFlight>,
    /// Per device, its `Device::lost_syncs` when this volume's FLUSH last looked: a FLUSH
    /// fails with ENOSPC if a device it has data on lost a sync since.
    lost_syncs_seen: Mutex<Vec<u64>>,
    /// Devices whose copies of this volume's extents are being made equal to the others
    /// (`Store::restore_device`): a bit set. Writes reach them; reads go elsewhere first.
    pub(crate) stale_devices: AtomicU64,
}

/// Warnings logged per volume and second about failed requests; the rest are counted and
/// reported with the next failure after the second is over.
const ERROR_LOG_PER_S: u64 = 10;

/// Milliseconds since the first call (a process-wide monotonic clock for the rate limit).
fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    u64::try_from(START.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A rate-limited log of a volume's failed requests, so that a device that disappears
/// under a busy client does not flood the log (approximate under races, never blocking).
#[derive(Debug, Default)]
struct ErrorLog {
    window_start_ms: AtomicU64,
    logged_in_window: AtomicU64,
    suppressed: AtomicU64,
}

impl ErrorLog {
    fn log(&self, volume: &str, op: &'static str, offset: u64, length: u64, err: &StoreError) {
        let now = now_ms();
        let start = self.window_start_ms.load(Ordering::Relaxed);
        if now.saturating_sub(start) >= 1000
            && self
                .window_start_ms
                .compare_exchange(start, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.logged_in_window.store(0, Ordering::Relaxed);
            let skipped = self.suppressed.swap(0, Ordering::Relaxed);
            if skipped > 0 {
                tracing::warn!(
                    volume,
                    skipped,
                    "{skipped} more failed requests of this volume were not logged (at most {ERROR_LOG_PER_S} a second)"
                );
            }
        }
        if self.logged_in_window.fetch_add(1, Ordering::Relaxed) < ERROR_LOG_PER_S {
            tracing::warn!(volume, op, offset, length, error = %err, "request failed");
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl fmt::Debug for Volume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Volume")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("size_bytes", &self.size_bytes())
            .finish_non_exhaustive()
    }
}

/// Lock stripes of a replicated volume's copy writes (`Volume::copy_locks`): enough that
/// writes to different extents rarely share one.
const COPY_LOCK_STRIPES: usize = 64;

/// Commits a full pool may run to recycle quarantined extents before a write gives up with
/// `NoSpace` (others may take the recycled extents first).
const MAX_RECLAIMS: u32 = 8;

/// What `Volume::place` found for a new logical extent.
enum Placed {
    /// Another writer allocated it first: its map entry.
    Already(u64),
    /// The pool is full but some extents wait in quarantine: commit, then retry.
    Reclaim,
    /// Extents taken for it (one per copy), not yet reserved nor published.
    New(Vec<PhysExtent>),
}

enum WriteOutcome {
    Done {
        touched: DeviceSet,
        needs_commit: bool,
    },
    /// The pool is full but some extents wait in quarantine: commit, then retry.
    Reclaim,
}

fn check_range(size_bytes: u64, offset: u64, len: u64) -> Result<(), StoreError> {
    match offset.checked_add(len) {
        Some(end) if end <= size_bytes => Ok(()),
        _ => Err(StoreError::OutOfRange {
            offset,
            length: len,
            size_bytes,
        }),
    }
}

/// Splits `[offset, offset + len)` into a partial head piece, a range of whole extents
/// `[first, end)`, and a partial tail piece.
fn split(offset: u64, len: u64) -> (Option<Piece>, (u64, u64), Option<Piece>) {
    if len == 0 {
        return (None, (0, 0), None);
    }
    let end = offset + len;
    let head_off = offset % EXTENT_SIZE_BYTES;
    let first_ext = offset / EXTENT_SIZE_BYTES;
    if first_ext == (end - 1) / EXTENT_SIZE_BYTES {
        let p = Piece {
            extent: first_ext,
            offset_in_extent: head_off,
            len,
            pos: 0,
        };
        if p.is_whole_extent() {
            return (None, (first_ext, first_ext + 1), None);
        }
        return (Some(p), (0, 0), None);
    }
    let (head, whole_first) = if head_off == 0 {
        (None, first_ext)
    } else {
        let p = Piece {
            extent: first_ext,
            offset_in_extent: head_off,
            len: EXTENT_SIZE_BYTES - head_off,
            pos: 0,
        };
        (Some(p), first_ext + 1)
    };
    let tail_len = end % EXTENT_SIZE_BYTES;
    let (tail, whole_end) = if tail_len == 0 {
        (None, end / EXTENT_SIZE_BYTES)
    } else {
        let ext = end / EXTENT_SIZE_BYTES;
        let p = Piece {
            extent: ext,
            offset_in_extent: 0,
            len: tail_len,
            pos: len - tail_len,
        };
        (Some(p), ext)
    };
    (head, (whole_first, whole_end), tail)
}

impl Volume {
    pub(crate) fn new(
        shared: Arc<Shared>,
        id: u64,
        record: VolumeRecord,
        map: ExtentMap,
        replicas: Vec<ExtentMap>,
        allocated_extents: u64,
    ) -> Arc<Volume> {
        let lost_syncs_seen = shared.devices.iter().map(Device::lost_syncs).collect();
        Arc::new_cyclic(|me| Volume {
            id,
            name: record.name,
            created_unix_s: record.created_unix_s,
            qos: Mutex::new(record.qos),
            attachments: Mutex::new(record.attachments),
            tenant: record.tenant,
            read_only: record.read_only,
            replicas: record.replicas,
            copy_locks: if record.replicas > 1 {
                (0..COPY_LOCK_STRIPES).map(|_| Mutex::new(())).collect()
            } else {
                Box::new([])
            },
            shared,
            me: me.clone(),
            size_bytes: AtomicU64::new(record.size_bytes),
            state: RwLock::new(VolumeState {
                size_bytes: record.size_bytes,
                map,
                replicas,
            }),
            allocated_extents: AtomicU64::new(allocated_extents),
            deleted: AtomicBool::new(false),
            rebuilding: AtomicBool::new(false),
            errors: ErrorLog::default(),
            in_flight: Arc::default(),
            lost_syncs_seen: Mutex::new(lost_syncs_seen),
            stale_devices: AtomicU64::new(0),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// Copies of every extent (1 to `MAX_REPLICAS`).
    pub fn replicas(&self) -> u8 {
        self.replicas
    }

    /// Space taken in the pool: every replica's extents.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_extents.load(Ordering::Relaxed) * EXTENT_SIZE_BYTES
    }

    /// The volume's opaque QoS settings (see `VolumeInfo::qos`).
    pub fn qos(&self) -> Option<String> {
        lock(&self.qos).clone()
    }

    /// The tenant the volume belongs to (`None`: no tenant).
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// Whether the volume is exported read-only.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    pub fn is_deleted(&self) -> bool {
        self.deleted.load(Ordering::Acquire)
    }

    pub fn info(&self) -> VolumeInfo {
        VolumeInfo {
            name: self.name.clone(),
            id: self.id,
            size_bytes: self.size_bytes(),
            allocated_bytes: self.allocated_bytes(),
            created_unix_s: self.created_unix_s,
            qos: self.qos(),
            tenant: self.tenant.clone(),
            read_only: self.read_only,
            replicas: self.replicas,
            health: self.health(),
        }
    }

    /// `Degraded` while a failed device holds one of the volume's extents (`Rebuilding` if a
    /// rebuild runs meanwhile).
    pub fn health(&self) -> VolumeHealth {
        let failed = self.shared.failed_devices();
        if failed.is_empty() {
            return VolumeHealth::Healthy;
        }
        let holder = lock(&self.shared.pool)
            .allocator
            .first_device_holding(self.id, failed.0);
        match holder {
            Some(_) if self.rebuilding.load(Ordering::Acquire) => VolumeHealth::Rebuilding,
            Some(_) => VolumeHealth::Degraded,
            None => VolumeHealth::Healthy,
        }
    }

    /// The durable record of this volume with `size_bytes` and `qos`.
    fn record(&self, size_bytes: u64, qos: Option<String>) -> VolumeRecord {
        VolumeRecord {
            name: self.name.clone(),
            size_bytes,
            created_unix_s: self.created_unix_s,
            qos,
            tenant: self.tenant.clone(),
            read_only: self.read_only,
            replicas: self.replicas,
            attachments: self.attachments(),
        }
    }

    /// The volume's opaque attachments (see `Store::set_volume_attachments`).
    pub fn attachments(&self) -> Option<String> {
        lock(&self.attachments).clone()
    }

    /// Replaces the attachments (caller serialises management operations): durable first,
    /// then visible.
    pub(crate) fn set_attachments(&self, attachments: Option<String>) -> Result<(), StoreError> {
        self.check_live()?;
        let mut record = self.record(self.size_bytes(), self.qos());
        record.attachments = attachments.clone();
        self.shared
            .commit(&[MetaOp::PutVolume(self.id, record)], false)?;
        *lock(&self.attachments) = attachments;
        Ok(())
    }

    /// Replaces the QoS settings (caller serialises management operations): durable first,
    /// then visible, like every management change.
    pub(crate) fn set_qos(&self, qos: Option<String>) -> Result<(), StoreError> {
        self.check_live()?;
        let record = self.record(self.size_bytes(), qos.clone());
        self.shared
            .commit(&[MetaOp::PutVolume(self.id, record)], false)?;
        *lock(&self.qos) = qos;
        Ok(())
    }

    fn check_live(&self) -> Result<(), StoreError> {
        if self.deleted.load(Ordering::Acquire) {
            return Err(StoreError::VolumeDeleted(self.name.clone()));
        }
        Ok(())
    }

    /// Runs this volume's fault rules (`crate::fault`) over one request, if any are
    /// installed. Requests that would fail anyway (deleted volume, out of range) are left to
    /// fail with their own error.
    fn inject(&self, class: IoClass, offset: u64, len: u64) -> Result<(), StoreError> {
        let Some(rules) = self.shared.volume_faults.get() else {
            return Ok(());
        };
        if self.check_live().is_err() || check_range(self.size_bytes(), offset, len).is_err() {
            return Ok(());
        }
        let mine = rules
            .iter()
            .filter(|r| matches!(&r.rule.scope, FaultScope::Volume(name) if *name == self.name));
        match fault::apply(mine, class, offset, len) {
            None => Ok(()),
            Some((fault, rule)) => Err(StoreError::Io(fault::io_error(fault, rule, class))),
        }
    }

    /// A request failed: log device failures and a full pool (rate-limited), and report a
    /// full device (ENOSPC from the filesystem under a device file) on a write as `NoSpace`.
    fn failed(&self, op: &'static str, offset: u64, length: u64, err: StoreError) -> StoreError {
        if matches!(err, StoreError::Io(_) | StoreError::NoSpace) {
            self.errors.log(&self.name, op, offset, length, &err);
        }
        match err {
            StoreError::Io(e) if mismatch_of(&e).is_some() => {
                let device = mismatch_of(&e).map_or(0, |m| m.device);
                StoreError::Checksum {
                    volume: self.name.clone(),
                    offset,
                    device,
                }
            }
            StoreError::Io(e)
                if e.kind() == io::ErrorKind::StorageFull
                    && matches!(op, "write" | "write_zeroes" | "flush") =>
            {
                StoreError::NoSpace
            }
            other => other,
        }
    }

    /// The error for a promise of durability if this volume has extents on a device in
    /// `failed` (its data there may be lost).
    fn check_failed(&self, failed: DeviceSet) -> Result<(), StoreError> {
        if failed.is_empty() {
            return Ok(());
        }
        let holder = lock(&self.shared.pool)
            .allocator
            .first_device_holding(self.id, failed.0);
        if holder.is_some() && self.replicas > 1 {
            return self.check_copies_left(failed);
        }
        match holder {
            Some(device) => Err(self.shared.failed_error(device)),
            None => Ok(()),
        }
    }

    /// A replicated volume with copies on failed devices: the error for the first logical
    /// extent none of whose copies is on a healthy device (its data may be lost), or `Ok`
    /// when every extent keeps a copy the sync covered. Scans the maps (only while a device
    /// is failed).
    fn check_copies_left(&self, failed: DeviceSet) -> Result<(), StoreError> {
        let st = read(&self.state);
        for (extent, entry) in st.map.allocated_in(0, st.map.extent_count()) {
            let mut lost_on = None;
            let mut healthy = false;
            for e in std::iter::once(entry).chain(st.replicas.iter().map(|m| m.get(extent))) {
                match PhysExtent::from_entry(e) {
                    Some(p) if failed.contains(p.device) || self.device_failed(p) => {
                        lost_on.get_or_insert(p.device);
                    }
                    Some(_) => healthy = true,
                    None => {}
                }
            }
            if let (false, Some(device)) = (healthy, lost_on) {
                return Err(self.shared.failed_error(device as usize));
            }
        }
        Ok(())
    }

    /// Whether the device of `phys` is failed (or unknown).
    fn device_failed(&self, phys: PhysExtent) -> bool {
        self.shared
            .devices
            .get(phys.device as usize)
            .is_none_or(Device::is_failed)
    }

    /// The order in which a replicated volume's read tries the copies of logical extent
    /// `extent`: copy `first` (the node's routing decision, `headroom_qos::routing`; 0 when
    /// the caller has none), then the ones after it in turn, copies on healthy devices before
    /// copies on failed ones and stale ones (a restore is bringing them up to date; tried
    /// only when nothing else is left).
    fn route_read(&self, st: &VolumeState, extent: u64, first: usize) -> [Option<PhysExtent>; 3] {
        let mut order = [None; MAX_REPLICAS as usize];
        let mut n = 0;
        let copies = st.replicas.len() + 1;
        for failed_pass in [false, true] {
            for k in 0..copies {
                if let Some(phys) = st
                    .map_of((first + k) % copies)
                    .and_then(|map| PhysExtent::from_entry(map.get(extent)))
                    && (self.device_failed(phys) || self.is_stale(phys.device)) == failed_pass
                    && n < order.len()
                {
                    order[n] = Some(phys);
                    n += 1;
                }
            }
        }
        order
    }

    /// Reads piece `p` of a replicated volume into `dst` from the first copy that answers
    /// (`route_read`'s order); a copy that fails is logged and the next one tried.
    fn read_replicated(
        &self,
        st: &VolumeState,
        p: &Piece,
        dst: &mut [u8],
        first: usize,
    ) -> Result<(), StoreError> {
        let mut last_error = None;
        let order = self.route_read(st, p.extent, first);
        for phys in order.into_iter().flatten() {
            let result = self
                .shared
                .device(phys)
                .and_then(|d| Ok(d.read(phys.index, p.offset_in_extent, dst)?));
            match result {
                Ok(()) => return Ok(()),
                // Some block of this copy fails verification: block by block from here, so
                // damage in different blocks of different copies is still read around.
                Err(StoreError::Io(e)) if mismatch_of(&e).is_some() => {
                    tracing::warn!(volume = %self.name, device = phys.device, error = %e, "a replica failed checksum verification; reading its blocks from the other copies");
                    return self.read_blockwise(p, dst, &order);
                }
                Err(e) => {
                    tracing::warn!(volume = %self.name, device = phys.device, error = %e, "read of a replica failed; trying the next");
                    last_error = Some(e);
                }
            }
        }
        match last_error {
            Some(e) => Err(e),
            None => {
                dst.fill(0);
                Ok(())
            }
        }
    }

    /// Reads piece `p` 4 KiB block by block, each from the first copy in `order` whose block
    /// verifies; the copies whose block failed are rewritten from it (`repair_copy`). A block
    /// that no copy verifies fails the read (the mismatch of the last copy tried).
    fn read_blockwise(
        &self,
        p: &Piece,
        dst: &mut [u8],
        order: &[Option<PhysExtent>; MAX_REPLICAS as usize],
    ) -> Result<(), StoreError> {
        let end = p.offset_in_extent + p.len;
        let mut off = p.offset_in_extent;
        while off < end {
            let next = ((off / BLOCK_BYTES + 1) * BLOCK_BYTES).min(end);
            let sub = Piece {
                extent: p.extent,
                offset_in_extent: off,
                len: next - off,
                pos: 0,
            };
            let out =
                &mut dst[(off - p.offset_in_extent) as usize..(next - p.offset_in_extent) as usize];
            let mut bad: [Option<PhysExtent>; MAX_REPLICAS as usize] =
                [None; MAX_REPLICAS as usize];
            let mut last_error = None;
            let mut done = false;
            for (k, phys) in order.iter().enumerate() {
                let Some(phys) = *phys else { continue };
                match self
                    .shared
                    .device(phys)
                    .and_then(|d| Ok(d.read(phys.index, off, out)?))
                {
                    Ok(()) => {
                        for b in bad.iter().flatten() {
                            if let Err(e) = self.repair_copy(&sub, *b, phys, true) {
                                tracing::warn!(volume = %self.name, device = b.device, error = %e, "repairing a copy that failed verification failed");
                            }
                        }
                        done = true;
                        break;
                    }
                    Err(StoreError::Io(e)) if mismatch_of(&e).is_some() => {
                        bad[k] = Some(phys);
                        last_error = Some(StoreError::Io(e));
                    }
                    Err(e) => last_error = Some(e),
                }
            }
            if !done {
                return Err(last_error.unwrap_or_else(|| {
                    StoreError::Io(io::Error::other("no copy of the block to read"))
                }));
            }
            off = next;
        }
        Ok(())
    }

    /// Rewrites the blocks enclosing piece `p` on copy `bad` (which failed verification) from
    /// copy `good`: read again (verified) and written whole, under the extent's copy lock
    /// (`lock`: false when the caller holds it), so no client write comes between.
    fn repair_copy(
        &self,
        p: &Piece,
        bad: PhysExtent,
        good: PhysExtent,
        lock: bool,
    ) -> Result<(), StoreError> {
        let _ordered = if lock { self.copy_lock(p.extent) } else { None };
        let b0 = p.offset_in_extent / BLOCK_BYTES * BLOCK_BYTES;
        let b1 = (p.offset_in_extent + p.len).div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        let mut buf = vec![0u8; (b1 - b0) as usize];
        self.shared.device(good)?.read(good.index, b0, &mut buf)?;
        let target = self.shared.device(bad)?;
        if target.is_failed() {
            return Ok(());
        }
        target.write(bad.index, b0, &buf)?;
        target.note_repaired((b1 - b0) / BLOCK_BYTES);
        tracing::warn!(volume = %self.name, device = bad.device, extent = p.extent, offset = b0, bytes = b1 - b0, "rewrote blocks that failed checksum verification from a good copy");
        Ok(())
    }

    /// Runs `op` on every copy of piece `p` of a replicated volume whose device is healthy,
    /// noting the devices touched and whether an allocation is still pending. Copies on
    /// failed devices are skipped (the volume is degraded); if every copy is on a failed
    /// device the piece fails.
    fn on_every_copy(
        &self,
        st: &VolumeState,
        p: &Piece,
        touched: &mut DeviceSet,
        needs_commit: &mut bool,
        mut op: impl FnMut(&Device, PhysExtent) -> io::Result<()>,
    ) -> Result<(), StoreError> {
        let mut written = false;
        let mut skipped = None;
        let _ordered = self.copy_lock(p.extent);
        for map in st.maps() {
            let entry = map.get(p.extent);
            *needs_commit |= entry & PENDING_BIT != 0;
            let Some(phys) = PhysExtent::from_entry(entry) else {
                continue;
            };
            let device = self.shared.device(phys)?;
            if device.is_failed() {
                skipped = Some(phys.device);
                continue;
            }
            match op(device, phys) {
                Ok(()) => {}
                // A partial-block write found the enclosing block of this copy bad: repair
                // it from another copy (the copy lock is held), then write again.
                Err(e) if mismatch_of(&e).is_some() => {
                    let good = st
                        .maps()
                        .filter_map(|m| PhysExtent::from_entry(m.get(p.extent)))
                        .find(|g| *g != phys && !self.device_failed(*g))
                        .ok_or(StoreError::Io(e))?;
                    self.repair_copy(p, phys, good, false)?;
                    op(device, phys)?;
                }
                Err(e) => return Err(e.into()),
            }
            touched.insert(phys.device);
            written = true;
        }
        match skipped {
            Some(device) if !written => Err(self.shared.failed_error(device as usize)),
            _ => Ok(()),
        }
    }

    /// The stripe lock of logical extent `extent`'s copies (`copy_locks`); `None` for a
    /// 1-replica volume.
    fn copy_lock(&self, extent: u64) -> Option<std::sync::MutexGuard<'_, ()>> {
        let n = self.copy_locks.len() as u64;
        if n == 0 {
            return None;
        }
        self.copy_locks.get((extent % n) as usize).map(lock)
    }

    /// Reads `buf.len()` bytes at `offset` from replica `replica` only (tests and scrub:
    /// comparing copies). Unallocated ranges read as zeros; `NotFound` for a replica the
    /// volume does not have.
    pub fn read_replica_at(
        &self,
        replica: u8,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), StoreError> {
        let st = read(&self.state);
        self.check_live()?;
        check_range(st.size_bytes, offset, buf.len() as u64)?;
        let map = st.map_of(usize::from(replica)).ok_or_else(|| {
            StoreError::NotFound(format!("replica {replica} of volume {}", self.name))
        })?;
        for p in pieces(offset, buf.len() as u64) {
            let dst = &mut buf[p.buf_range()];
            match PhysExtent::from_entry(map.get(p.extent)) {
                None => dst.fill(0),
                Some(phys) => {
                    self.shared
                        .device(phys)?
                        .read(phys.index, p.offset_in_extent, dst)?
                }
            }
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset`. Unwritten ranges read as zeros.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        self.read_at_from(offset, buf, 0)
    }

    /// As [`Volume::read_at`], trying copy `first_copy` of a replicated volume first (the
    /// node's read routing; the other copies follow in turn, and a copy on a failed device
    /// comes last whatever its number). A 1-replica volume ignores it.
    pub fn read_at_from(
        &self,
        offset: u64,
        buf: &mut [u8],
        first_copy: u8,
    ) -> Result<(), StoreError> {
        let len = buf.len() as u64;
        self.inject(IoClass::Read, offset, len)
            .and_then(|()| self.read_inner(offset, buf, usize::from(first_copy)))
            .map_err(|e| self.failed("read", offset, len, e))
    }

    /// Reads `buf.len()` bytes at `offset` unless the whole range is a hole (never written,
    /// or trimmed away): then it returns `true` and leaves `buf` as it was, so a reply can say
    /// "zeros" without carrying them. Fails exactly as `read_at` would.
    pub fn read_at_unless_hole(&self, offset: u64, buf: &mut [u8]) -> Result<bool, StoreError> {
        self.read_at_unless_hole_from(offset, buf, 0)
    }

    /// As [`Volume::read_at_unless_hole`], trying copy `first_copy` first
    /// ([`Volume::read_at_from`]).
    pub fn read_at_unless_hole_from(
        &self,
        offset: u64,
        buf: &mut [u8],
        first_copy: u8,
    ) -> Result<bool, StoreError> {
        let first_copy = usize::from(first_copy);
        let len = buf.len() as u64;
        self.inject(IoClass::Read, offset, len)
            .and_then(|()| {
                let st = read(&self.state);
                self.check_live()?;
                check_range(st.size_bytes, offset, len)?;
                if pieces(offset, len)
                    .all(|p| PhysExtent::from_entry(st.map.get(p.extent)).is_none())
                {
                    return Ok(true);
                }
                self.read_pieces(&st, offset, buf, first_copy)
                    .map(|()| false)
            })
            .map_err(|e| self.failed("read", offset, len, e))
    }

    fn read_inner(&self, offset: u64, buf: &mut [u8], first_copy: usize) -> Result<(), StoreError> {
        let st = read(&self.state);
        self.check_live()?;
        check_range(st.size_bytes, offset, buf.len() as u64)?;
        self.read_pieces(&st, offset, buf, first_copy)
    }

    /// Copies `[offset, offset + buf.len())` out of the devices; holes read as zeros. The
    /// caller holds the state's read lock and has checked the range.
    fn read_pieces(
        &self,
        st: &VolumeState,
        offset: u64,
        buf: &mut [u8],
        first_copy: usize,
    ) -> Result<(), StoreError> {
        for p in pieces(offset, buf.len() as u64) {
            let dst = &mut buf[p.buf_range()];
            if !st.replicas.is_empty() {
                self.read_replicated(st, &p, dst, first_copy)?;
                continue;
            }
            match PhysExtent::from_entry(st.map.get(p.extent)) {
                None => dst.fill(0),
                Some(phys) => {
                    self.shared
                        .device(phys)?
                        .read(phys.index, p.offset_in_extent, dst)?;
                }
            }
        }
        Ok(())
    }

    /// Writes `data` at `offset`, allocating extents on first write. With `fua`, the data (and
    /// the allocation of any extent it created) is durable when this returns.
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), StoreError> {
        let len = data.len() as u64;
        self.inject(IoClass::Write, offset, len)
            .and_then(|()| self.write_inner(offset, data, fua))
            .map_err(|e| self.failed("write", offset, len, e))
    }

    fn write_inner(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), StoreError> {
        let mut reclaims = 0;
        let lost_before = if fua { self.lost_syncs_total() } else { 0 };
        loop {
            match self.write_once(offset, data)? {
                WriteOutcome::Done {
                    touched,
                    needs_commit,
                } => {
                    if fua {
                        self.inject(IoClass::Sync, offset, data.len() as u64)?;
                        self.make_durable(touched, needs_commit)?;
                        self.check_no_sync_lost_since(lost_before)?;
                    }
                    return Ok(());
                }
                WriteOutcome::Reclaim if reclaims < MAX_RECLAIMS => {
                    // Frees wait for a durable commit: commit them (outside our lock) and retry.
                    reclaims += 1;
                    self.shared.commit(&[], false)?;
                }
                WriteOutcome::Reclaim => return Err(StoreError::NoSpace),
            }
        }
    }

    fn write_once(&self, offset: u64, data: &[u8]) -> Result<WriteOutcome, StoreError> {
        let st = read(&self.state);
        self.check_live()?;
        check_range(st.size_bytes, offset, data.len() as u64)?;
        let mut touched = DeviceSet::default();
        let mut needs_commit = false;
        for p in pieces(offset, data.len() as u64) {
            let mut entry = st.map.get(p.extent);
            if entry == 0 {
                match self.allocate(&st, p.extent)? {
                    Some(e) => entry = e,
                    None => return Ok(WriteOutcome::Reclaim),
                }
            }
            if !st.replicas.is_empty() {
                let src = &data[p.buf_range()];
                self.on_every_copy(&st, &p, &mut touched, &mut needs_commit, |d, phys| {
                    d.write(phys.index, p.offset_in_extent, src)
                })?;
                continue;
            }
            needs_commit |= entry & PENDING_BIT != 0;
            let Some(phys) = PhysExtent::from_entry(entry) else {
                continue;
            };
            self.shared.device(phys)?.write(
                phys.index,
                p.offset_in_extent,
                &data[p.buf_range()],
            )?;
            touched.insert(phys.device);
        }
        Ok(WriteOutcome::Done {
            touched,
            needs_commit,
        })
    }

    /// Allocates logical extent `extent` (caller holds the read lock). `Ok(None)`: the pool is
    /// full but a commit would free quarantined extents.
    ///
    /// The extents are taken under the pool mutex, their filesystem blocks reserved outside
    /// it (`Device::reserve`, one `fallocate` of 2 MiB per copy), and only then published in
    /// the map, so no write lands in an extent whose blocks are not reserved. A device whose
    /// filesystem has no room for the reservation is avoided for this extent and the
    /// placement tried again; when no device has room the write gets ENOSPC now, instead of
    /// later writes into the extent. An extent given back (no room, or another writer
    /// allocated the same logical extent meanwhile) is punched first, so it is free and
    /// reads zeros with no blocks held.
    fn allocate(&self, st: &VolumeState, extent: u64) -> Result<Option<u64>, StoreError> {
        let Some(slot) = st.map.slot(extent) else {
            return Err(StoreError::OutOfRange {
                offset: extent * EXTENT_SIZE_BYTES,
                length: EXTENT_SIZE_BYTES,
                size_bytes: st.size_bytes,
            });
        };
        // The disk of the metadata filled and its reserve was given to the metadata's
        // commits: new data extents would take that room (FLUSH must go on committing).
        if self.shared.metadata_reserve_in_use() {
            return Err(StoreError::NoSpace);
        }
        // New extents go to devices that can still make data durable.
        let mut avoid = self.shared.failed_devices();
        let mut full = None;
        loop {
            let placed = match (self.place(slot, avoid), &full) {
                (Ok(Placed::Already(current)), _) => return Ok(Some(current)),
                (Ok(Placed::New(placed)), _) => placed,
                // Every device with a free extent has a full filesystem under it: recycling
                // the quarantine would not help (its extents were punched already).
                (_, Some(_)) => return Err(StoreError::NoSpace),
                (Ok(Placed::Reclaim), None) => return Ok(None),
                (Err(e), None) => return Err(e),
            };
            match self.reserve_all(&placed) {
                Ok(()) => {}
                Err((device, e)) if is_no_space(&e) => {
                    tracing::debug!(volume = %self.name, device, error = %e, "no room to reserve a new extent; trying another device");
                    self.give_back(&placed);
                    avoid.insert(device);
                    full = Some(e);
                    continue;
                }
                Err((_, e)) => {
                    self.give_back(&placed);
                    return Err(StoreError::Io(e));
                }
            }
            let mut pool = lock(&self.shared.pool);
            let current = slot.load(Ordering::Acquire);
            if current != 0 {
                drop(pool);
                self.give_back(&placed);
                return Ok(Some(current)); // another writer allocated it meanwhile
            }
            // Replicas 1.. first: a reader that sees replica 0's entry sees them all.
            for (replica, &phys) in placed.iter().enumerate().rev() {
                pool.pending.push(Change::Alloc {
                    volume: self.me.clone(),
                    volume_id: self.id,
                    replica: replica as u8,
                    extent,
                    phys,
                });
                let entry = phys.to_entry() | PENDING_BIT;
                if replica == 0 {
                    slot.store(entry, Ordering::Release);
                } else if let Some(s) = st.replicas.get(replica - 1).and_then(|m| m.slot(extent)) {
                    s.store(entry, Ordering::Release);
                }
            }
            drop(pool);
            self.allocated_extents
                .fetch_add(placed.len() as u64, Ordering::Relaxed);
            return Ok(Some(slot.load(Ordering::Acquire)));
        }
    }

    /// Takes the extents for one new logical extent under the pool mutex, outside `avoid`,
    /// or says why not.
    fn place(&self, slot: &AtomicU64, avoid: DeviceSet) -> Result<Placed, StoreError> {
        let mut pool = lock(&self.shared.pool);
        let current = slot.load(Ordering::Acquire);
        if current != 0 {
            return Ok(Placed::Already(current)); // another writer allocated it first
        }
        let copies = usize::from(self.replicas);
        let placed = if copies <= 1 {
            pool.allocator
                .allocate_avoiding(self.id, avoid.0)
                .map(|p| vec![p])
        } else {
            pool.allocator.allocate_replicas(self.id, copies, avoid.0)
        };
        if let Some(placed) = placed {
            return Ok(Placed::New(placed));
        }
        if pool.quarantined > 0 {
            return Ok(Placed::Reclaim);
        }
        let failed = self.shared.failed_devices();
        if copies > 1 && pool.allocator.devices_with_space(0) >= copies {
            if failed.is_empty() {
                return Err(StoreError::NoSpace); // the filesystems under them are full
            }
            return Err(StoreError::Io(io::Error::other(format!(
                "no free extent on {copies} distinct healthy devices (some devices with \
                 free space failed)"
            ))));
        }
        if copies > 1 && pool.allocator.devices_with_space(0) > 0 {
            return Err(StoreError::NoSpace);
        }
        if failed.iter().any(|d| pool.allocator.free_extents(d) > 0) {
            return Err(StoreError::Io(io::Error::other(
                "no free extent on a healthy device (the devices with free space failed)",
            )));
        }
        Err(StoreError::NoSpace)
    }

    /// Reserves the blocks of every extent of `placed` and sets their write-intent bits
    /// (made durable by the commit of the allocation, not by a sync of their own); the
    /// device and the error of the first that could not be reserved.
    fn reserve_all(&self, placed: &[PhysExtent]) -> Result<(), (u32, io::Error)> {
        for &phys in placed {
            let result = match self.shared.device(phys) {
                Ok(d) => d
                    .reserve(phys.index)
                    .map(|()| d.note_new_extent(phys.index)),
                Err(e) => Err(io::Error::other(e.to_string())),
            };
            result.map_err(|e| (phys.device, e))?;
        }
        Ok(())
    }

    /// Returns extents taken by `place` and never published: punched (a reservation may
    /// hold blocks) and freed at once. Nothing was written to them and nothing durable maps
    /// them, so no quarantine is needed; one whose punch fails counts as leaked.
    fn give_back(&self, placed: &[PhysExtent]) {
        let punched: Vec<bool> = placed
            .iter()
            .map(|&p| {
                self.shared
                    .device(p)
                    .is_ok_and(|d| d.punch_extents(p.index, 1).is_ok())
            })
            .collect();
        let mut pool = lock(&self.shared.pool);
        for (&p, ok) in placed.iter().zip(punched) {
            pool.allocator.disown(self.id, p);
            if ok {
                pool.allocator.release(p);
            } else {
                pool.leaked += 1;
            }
        }
    }

    /// After a commit: the allocation of `extent` of replica `replica` at `phys` is durable.
    pub(crate) fn mark_committed(&self, replica: u8, extent: u64, phys: PhysExtent) {
        let st = read(&self.state);
        if let Some(slot) = st
            .map_of(usize::from(replica))
            .and_then(|m| m.existing_slot(extent))
        {
            let pending = phys.to_entry() | PENDING_BIT;
            let _ = slot.compare_exchange(
                pending,
                phys.to_entry(),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    /// Syncs that failed with ENOSPC on any device of the pool so far (`Device::lost_syncs`).
    fn lost_syncs_total(&self) -> u64 {
        self.shared.devices.iter().map(Device::lost_syncs).sum()
    }

    /// After a FUA request's durability step: ENOSPC if any device lost a sync since
    /// `before` (`lost_syncs_total` when the request started). Such a sync may have dropped
    /// this request's data before the sync that then succeeded, so the FUA cannot be
    /// promised. Conservative: a loss on a device the request did not touch fails it too
    /// (rare, and only while a filesystem reports ENOSPC at writeback).
    fn check_no_sync_lost_since(&self, before: u64) -> Result<(), StoreError> {
        if self.lost_syncs_total() == before {
            return Ok(());
        }
        Err(StoreError::Io(io::Error::new(
            io::ErrorKind::StorageFull,
            "a device sync failed with ENOSPC while this FUA request was made durable",
        )))
    }

    /// FUA completion: sync the devices written, or run a full commit if an allocation the
    /// request relies on is not yet durable.
    fn make_durable(&self, touched: DeviceSet, needs_commit: bool) -> Result<(), StoreError> {
        // Devices the write touched that failed before its data there was durable (a sync
        // that failed, or the operator's `device fail` racing the write).
        let mut lost = DeviceSet(0);
        if needs_commit {
            let failed = self.shared.commit(&[], false)?;
            lost = DeviceSet(touched.0 & failed.0);
        } else {
            for d in touched.iter() {
                if let Some(dev) = self.shared.devices.get(d) {
                    match dev.sync_now() {
                        Ok(()) => {}
                        Err(_) if self.replicas > 1 && dev.is_failed() => lost.insert(d as u32),
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        match lost.iter().next() {
            None => Ok(()),
            // A replicated volume keeps its promise while every extent has a copy the sync
            // covered, as its FLUSH does (`check_failed`).
            Some(_) if self.replicas > 1 => self.check_copies_left(lost),
            Some(device) => Err(self.shared.failed_error(device)),
        }
    }

    /// NBD WRITE_ZEROES: the range reads as zeros afterwards. With `may_release` (no NO_HOLE
    /// flag) it behaves like `trim`: whole extents are released, partial ones punched, holes
    /// stay holes. Without it (NO_HOLE) the range ends up fully provisioned, as the NBD spec
    /// intends, so later writes there cannot fail with `NoSpace`: holes get extents (which
    /// read as zeros already) and allocated space is zeroed in place.
    pub fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_release: bool,
        fua: bool,
    ) -> Result<(), StoreError> {
        self.inject(IoClass::Write, offset, len)
            .and_then(|()| self.write_zeroes_inner(offset, len, may_release, fua))
            .map_err(|e| self.failed("write_zeroes", offset, len, e))
    }

    fn write_zeroes_inner(
        &self,
        offset: u64,
        len: u64,
        may_release: bool,
        fua: bool,
    ) -> Result<(), StoreError> {
        if may_release {
            return self.discard(offset, len, fua);
        }
        let mut reclaims = 0;
        let lost_before = if fua { self.lost_syncs_total() } else { 0 };
        loop {
            match self.zero_provisioned_once(offset, len)? {
                WriteOutcome::Done {
                    touched,
                    needs_commit,
                } => {
                    if fua {
                        self.inject(IoClass::Sync, offset, len)?;
                        self.make_durable(touched, needs_commit)?;
                        self.check_no_sync_lost_since(lost_before)?;
                    }
                    return Ok(());
                }
                WriteOutcome::Reclaim if reclaims < MAX_RECLAIMS => {
                    reclaims += 1;
                    self.shared.commit(&[], false)?;
                }
                WriteOutcome::Reclaim => return Err(StoreError::NoSpace),
            }
        }
    }

    fn zero_provisioned_once(&self, offset: u64, len: u64) -> Result<WriteOutcome, StoreError> {
        let st = read(&self.state);
        self.check_live()?;
        check_range(st.size_bytes, offset, len)?;
        let mut touched = DeviceSet::default();
        let mut needs_commit = false;
        for p in pieces(offset, len) {
            let mut entry = st.map.get(p.extent);
            if entry == 0 {
                match self.allocate(&st, p.extent)? {
                    Some(e) => entry = e,
                    None => return Ok(WriteOutcome::Reclaim),
                }
            }
            if !st.replicas.is_empty() {
                self.on_every_copy(&st, &p, &mut touched, &mut needs_commit, |d, phys| {
                    d.zero(phys.index, p.offset_in_extent, p.len)
                })?;
                continue;
            }
            needs_commit |= entry & PENDING_BIT != 0;
            let Some(phys) = PhysExtent::from_entry(entry) else {
                continue;
            };
            // Also for an extent just allocated: another writer may have raced us to it.
            self.shared
                .device(phys)?
                .zero(phys.index, p.offset_in_extent, p.len)?;
            touched.insert(phys.device);
        }
        Ok(WriteOutcome::Done {
            touched,
            needs_commit,
        })
    }

    /// NBD TRIM: releases the whole extents covered and punches partial ones. Trimmed ranges
    /// read as zeros afterwards (stronger than NBD requires, and deterministic).
    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), StoreError> {
        self.inject(IoClass::Other, offset, len)
            .and_then(|()| self.discard(offset, len, fua))
            .map_err(|e| self.failed("trim", offset, len, e))
    }

    /// TRIM and releasing WRITE_ZEROES: punch the allocated partial pieces, release the
    /// allocated whole extents (under the write lock, so no I/O of this volume is in flight).
    fn discard(&self, offset: u64, len: u64, fua: bool) -> Result<(), StoreError> {
        let lost_before = if fua { self.lost_syncs_total() } else { 0 };
        let (head, (first, end), tail) = split(offset, len);
        let needs_release = {
            let st = read(&self.state);
            self.check_live()?;
            check_range(st.size_bytes, offset, len)?;
            let needs_release = st.map.allocated_in(first, end).next().is_some();
            if !needs_release {
                self.punch_partials(&st, head, tail)?;
            }
            needs_release
        };
        if needs_release {
            let mut st = self.write_state();
            self.check_live()?;
            check_range(st.size_bytes, offset, len)?;
            self.punch_partials(&st, head, tail)?;
            self.release_locked(&mut st, first, end)?;
        }
        if fua || (needs_release && self.shared.quarantine_full()) {
            let failed = self.shared.commit(&[], false)?;
            if fua {
                self.check_failed(failed)?;
                self.check_no_sync_lost_since(lost_before)?;
            }
        }
        Ok(())
    }

    /// Zeroes the allocated parts of the partial head and tail pieces of a discard, keeping
    /// their blocks (`Device::clear`).
    fn punch_partials(
        &self,
        st: &VolumeState,
        head: Option<Piece>,
        tail: Option<Piece>,
    ) -> Result<(), StoreError> {
        for p in head.iter().chain(tail.iter()) {
            let _ordered = self.copy_lock(p.extent);
            for map in st.maps() {
                if let Some(phys) = PhysExtent::from_entry(map.get(p.extent)) {
                    let device = self.shared.device(phys)?;
                    if st.replicas.is_empty() || !device.is_failed() {
                        // Keeps the extent's reserved blocks (`Device::clear`).
                        device.clear(phys.index, p.offset_in_extent, p.len)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Releases every allocated extent in `[first, end)` (caller holds the write lock, so no
    /// I/O of this volume is in flight): unmap, punch, and queue the free, of every replica.
    /// The physical extents stay quarantined until the next commit makes the free durable.
    fn release_locked(&self, st: &mut VolumeState, first: u64, end: u64) -> Result<(), StoreError> {
        let mut freed: Vec<(u8, u64, PhysExtent)> = Vec::new();
        for (replica, map) in st.maps().enumerate() {
            freed.extend(map.allocated_in(first, end).filter_map(|(i, _)| {
                let old = map.existing_slot(i)?.swap(0, Ordering::AcqRel);
                PhysExtent::from_entry(old).map(|p| (replica as u8, i, p))
            }));
        }
        if freed.is_empty() {
            return Ok(());
        }
        freed.sort_by_key(|&(_, _, p)| p);
        // Punch contiguous physical runs with one call each; remember which runs failed.
        let mut ok = vec![true; freed.len()];
        let mut first_error = None;
        let mut i = 0;
        while i < freed.len() {
            let start = freed[i].2;
            let mut j = i + 1;
            while j < freed.len()
                && freed[j].2.device == start.device
                && freed[j].2.index == freed[j - 1].2.index + 1
            {
                j += 1;
            }
            let result = self
                .shared
                .device(start)
                .and_then(|d| Ok(d.punch_extents(start.index, (j - i) as u32)?));
            if let Err(e) = result {
                tracing::error!(volume = %self.name, error = %e, "punching freed extents failed; they stay out of the pool");
                ok[i..j].fill(false);
                first_error.get_or_insert(e);
            }
            i = j;
        }
        {
            let mut pool = lock(&self.shared.pool);
            for (&(replica, extent, phys), &reusable) in freed.iter().zip(&ok) {
                pool.allocator.disown(self.id, phys);
                pool.pending.push(Change::Free {
                    volume_id: self.id,
                    replica,
                    extent,
                    phys,
                    reusable,
                });
                if reusable {
                    pool.quarantined += 1;
                } else {
                    pool.leaked += 1;
                }
            }
        }
        self.allocated_extents
            .fetch_sub(freed.len() as u64, Ordering::Relaxed);
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Makes every write acknowledged before the call durable, on all devices, together with
    /// the extent allocations and frees of every volume (one pool-wide commit).
    /// Fails if the volume has an extent on a failed device (its data there may be lost);
    /// other devices' failures do not concern it.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.check_live()
            .and_then(|()| self.inject(IoClass::Sync, 0, 0))
            .and_then(|()| self.shared.commit(&[], false))
            .and_then(|failed| self.check_failed(failed))
            .and_then(|()| self.check_lost_syncs())
            .map_err(|e| self.failed("flush", 0, 0, e))
    }

    /// After a FLUSH's commit: ENOSPC if a device this volume has data on lost a sync
    /// (`Device::lost_syncs`, a sync that failed with ENOSPC) since this volume's last FLUSH
    /// looked, in this commit or in another volume's. Writes before a failed sync may be
    /// lost, and a later sync that succeeds says nothing about them, so each loss fails the
    /// next FLUSH of every volume with data on that device once; the FLUSH after it covers
    /// what is on the device then.
    fn check_lost_syncs(&self) -> Result<(), StoreError> {
        let mut lost = DeviceSet::default();
        {
            let mut seen = lock(&self.lost_syncs_seen);
            for d in &self.shared.devices {
                let now = d.lost_syncs();
                let i = d.id as usize;
                if seen.len() <= i {
                    seen.resize(i + 1, 0);
                }
                if now != seen[i] {
                    seen[i] = now;
                    lost.insert(d.id);
                }
            }
        }
        if lost.is_empty() {
            return Ok(());
        }
        let holder = lock(&self.shared.pool)
            .allocator
            .first_device_holding(self.id, lost.0);
        match holder.and_then(|d| self.shared.devices.get(d)) {
            Some(d) => Err(StoreError::Io(io::Error::new(
                io::ErrorKind::StorageFull,
                format!(
                    "device {}: a sync failed with ENOSPC; writes since the last FLUSH may be lost",
                    d.label
                ),
            ))),
            None => Ok(()),
        }
    }

    /// Whether any extent of `[offset, offset + len)` is allocated (on any copy): whether a
    /// CACHE of the range has anything to read ahead. No I/O: the extent map only. A range
    /// past the end holds nothing.
    pub fn holds_data_in(&self, offset: u64, len: u64) -> bool {
        let st = read(&self.state);
        let end = offset.saturating_add(len).min(st.size_bytes);
        offset < end
            && pieces(offset, end - offset).any(|p| self.route_first(&st, p.extent).is_some())
    }

    /// Advisory prefetch of `[offset, offset + len)` (NBD CACHE): read-ahead hints for the
    /// allocated parts on file devices; a no-op for holes and RAM.
    pub fn cache(&self, offset: u64, len: u64) -> Result<(), StoreError> {
        self.inject(IoClass::Other, offset, len)
            .map_err(|e| self.failed("cache", offset, len, e))?;
        let st = read(&self.state);
        self.check_live()?;
        check_range(st.size_bytes, offset, len)?;
        for p in pieces(offset, len) {
            if let Some(phys) = self.route_first(&st, p.extent) {
                self.shared
                    .device(phys)?
                    .advise_willneed(phys.index, p.offset_in_extent, p.len);
            }
        }
        Ok(())
    }

    /// Allocation status of `[offset, offset + len)` clipped to the volume end, as runs with
    /// adjacent equal runs merged. Unallocated extents are holes that read as zeros; inside
    /// allocated extents, ranges the device knows are unallocated (punched) are reported as
    /// holes too. `offset` past the end is `OutOfRange` (unless `len` is 0).
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, StoreError> {
        let clipped = len.min(self.size_bytes().saturating_sub(offset));
        self.inject(IoClass::Other, offset, clipped)
            .map_err(|e| self.failed("block_status", offset, len, e))?;
        let st = read(&self.state);
        self.check_live()?;
        if offset > st.size_bytes || (offset == st.size_bytes && len > 0) {
            return Err(StoreError::OutOfRange {
                offset,
                length: len,
                size_bytes: st.size_bytes,
            });
        }
        let end = offset.saturating_add(len).min(st.size_bytes);
        let mut out: Vec<Extent> = Vec::new();
        let mut push = |length: u64, hole: bool| {
            if length == 0 {
                return;
            }
            match out.last_mut() {
                Some(last) if last.hole == hole => last.length += length,
                _ => out.push(Extent {
                    length,
                    hole,
                    zero: hole,
                }),
            }
        };
        let mut pos = offset;
        while pos < end {
            let extent = pos / EXTENT_SIZE_BYTES;
            let next = match self.route_first(&st, extent) {
                None => {
                    let next = if st.map.chunk_exists(extent) {
                        (extent + 1) * EXTENT_SIZE_BYTES
                    } else {
                        (extent / CHUNK_EXTENTS + 1) * CHUNK_EXTENTS * EXTENT_SIZE_BYTES
                    };
                    let next = next.min(end);
                    push(next - pos, true);
                    next
                }
                Some(phys) => {
                    let next = ((extent + 1) * EXTENT_SIZE_BYTES).min(end);
                    let off = pos % EXTENT_SIZE_BYTES;
                    self.shared.device(phys)?.data_runs(
                        phys.index,
                        off,
                        next - pos,
                        &mut |l, data| push(l, !data),
                    );
                    next
                }
            };
            pos = next;
        }
        Ok(out)
    }

    /// Whether WRITE_ZEROES is cheap on this volume (NBD FAST_ZERO): true unless a device of
    /// the pool had to fall back to writing zeros because punch-hole or zero-range failed
    /// with `EOPNOTSUPP`.
    pub fn is_zero_fast(&self) -> bool {
        self.shared.devices.iter().all(|d| d.zeroes_fast())
    }

    /// How many devices of the pool hold writes or punches not yet made durable: what a
    /// FLUSH now would sync (its commit syncs every such device, whoever wrote there). The
    /// scheduler charges a FLUSH one sync per device this counts.
    pub fn unsynced_devices(&self) -> u32 {
        let n = self.shared.devices.iter().filter(|d| d.is_dirty()).count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The copy a read of `extent` goes to first (replica 0 for a 1-replica volume), `None`
    /// for a hole.
    fn route_first(&self, st: &VolumeState, extent: u64) -> Option<PhysExtent> {
        if st.replicas.is_empty() {
            PhysExtent::from_entry(st.map.get(extent))
        } else {
            self.route_read(st, extent, 0)[0]
        }
    }

    /// Every copy of logical extent `extent` (index = replica number; `None`: a hole, or no
    /// such replica), with whether its device is healthy: what the node's read router needs,
    /// under one read lock.
    pub fn copies(&self, extent: u64) -> [Option<(PhysicalLocation, bool)>; MAX_REPLICAS as usize] {
        let st = read(&self.state);
        let mut out = [None; MAX_REPLICAS as usize];
        for (slot, map) in out.iter_mut().zip(st.maps()) {
            let entry = map.get(extent);
            *slot = PhysExtent::from_entry(entry).map(|p| {
                (
                    PhysicalLocation {
                        device: p.device,
                        offset_bytes: p.byte_offset(),
                        committed: entry & PENDING_BIT == 0,
                    },
                    !self.device_failed(p),
                )
            });
        }
        out
    }

    /// Where logical extent `extent` is stored (replica 0), or `None` for a hole.
    pub fn extent_location(&self, extent: u64) -> Option<PhysicalLocation> {
        self.replica_location(0, extent)
    }

    /// Where replica `replica` of logical extent `extent` is stored, or `None` for a hole
    /// (or a replica the volume does not have).
    pub fn replica_location(&self, replica: u8, extent: u64) -> Option<PhysicalLocation> {
        let entry = read(&self.state)
            .map_of(usize::from(replica))
            .map_or(0, |m| m.get(extent));
        PhysExtent::from_entry(entry).map(|p| PhysicalLocation {
            device: p.device,
            offset_bytes: p.byte_offset(),
            committed: entry & PENDING_BIT == 0,
        })
    }

    /// Resize (caller serialises management operations). Grow commits first, then exposes the
    /// new space; shrink releases the extents past the end, zeroes the tail of the last
    /// extent, then commits.
    pub(crate) fn resize(&self, new_size: u64) -> Result<(), StoreError> {
        self.check_live()?;
        let old_size = self.size_bytes();
        if new_size == old_size {
            return Ok(());
        }
        let record = self.record(new_size, self.qos());
        if new_size > old_size {
            self.shared
                .commit(&[MetaOp::PutVolume(self.id, record)], false)?;
            let mut st = self.write_state();
            st.map.resize(extent_count(new_size));
            for m in &mut st.replicas {
                m.resize(extent_count(new_size));
            }
            st.size_bytes = new_size;
            self.size_bytes.store(new_size, Ordering::Release);
            return Ok(());
        }
        let result = {
            let mut st = self.write_state();
            let new_count = extent_count(new_size);
            let old_count = st.map.extent_count();
            let released = self.release_locked(&mut st, new_count, old_count);
            let tail_off = new_size % EXTENT_SIZE_BYTES;
            let tail_piece = Piece {
                extent: new_size / EXTENT_SIZE_BYTES,
                offset_in_extent: tail_off,
                len: EXTENT_SIZE_BYTES - tail_off,
                pos: 0,
            };
            let tail = if tail_off != 0 {
                self.punch_partials(&st, Some(tail_piece), None)
            } else {
                Ok(())
            };
            st.map.resize(new_count);
            for m in &mut st.replicas {
                m.resize(new_count);
            }
            st.size_bytes = new_size;
            self.size_bytes.store(new_size, Ordering::Release);
            released.and(tail)
        };
        // The shrink is applied in memory: keep the size change pending if the commit fails.
        self.shared
            .commit(&[MetaOp::PutVolume(self.id, record)], true)?;
        result
    }

    /// Delete (caller removed the volume from the registry): fail new I/O, wait for in-flight
    /// I/O, release and punch everything, commit the deletion.
    pub(crate) fn destroy(&self) -> Result<(), StoreError> {
        self.deleted.store(true, Ordering::Release);
        let released = {
            let mut st = self.write_state();
            let count = st.map.extent_count();
            let r = self.release_locked(&mut st, 0, count);
            st.map.resize(0);
            for m in &mut st.replicas {
                m.resize(0);
            }
            r
        };
        lock(&self.shared.pool).allocator.forget_volume(self.id);
        self.shared.commit(&[MetaOp::DeleteVolume(self.id)], true)?;
        released
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_cases() {
        let e = EXTENT_SIZE_BYTES;
        assert_eq!(split(0, 0), (None, (0, 0), None));
        let (h, w, t) = split(0, e);
        assert!(h.is_none() && t.is_none());
        assert_eq!(w, (0, 1));
        let (h, w, t) = split(10, 20);
        assert_eq!(
            h.map(|p| (p.extent, p.offset_in_extent, p.len)),
            Some((0, 10, 20))
        );
        assert_eq!(w.0, w.1);
        assert!(t.is_none());
        let (h, w, t) = split(e - 1, 2 * e + 2);
        assert_eq!(
            h.map(|p| (p.extent, p.offset_in_extent, p.len)),
            Some((0, e - 1, 1))
        );
        assert_eq!(w, (1, 3));
        assert_eq!(
            t.map(|p| (p.extent, p.offset_in_extent, p.len)),
            Some((3, 0, 1))
        );
        let (h, w, t) = split(e, 3 * e);
        assert!(h.is_none() && t.is_none());
        assert_eq!(w, (1, 4));
    }

    #[test]
    fn volume_info_json_omits_unset_qos_and_reads_json_without_it() {
        let mut info = VolumeInfo {
            name: "v".into(),
            id: 1,
            size_bytes: 4096,
            allocated_bytes: 0,
            created_unix_s: 7,
            qos: None,
            tenant: None,
            read_only: false,
            replicas: 1,
            health: VolumeHealth::Healthy,
        };
        let json = serde_json::to_string(&info).unwrap();
        assert!(!json.contains("qos"), "{json}");
        assert!(
            !json.contains("tenant") && !json.contains("read_only"),
            "{json}"
        );
        assert!(json.contains(r#""replicas":1"#), "{json}");
        let without: serde_json::Value =
            serde_json::from_str(&json.replace(r#","replicas":1"#, "")).unwrap();
        assert_eq!(
            serde_json::from_value::<VolumeInfo>(without)
                .unwrap()
                .replicas,
            1
        );
        assert_eq!(serde_json::from_str::<VolumeInfo>(&json).unwrap(), info);
        info.qos = Some(r#"{"iops":100}"#.into());
        info.tenant = Some("alice".into());
        info.read_only = true;
        let json = serde_json::to_string(&info).unwrap();
        assert_eq!(serde_json::from_str::<VolumeInfo>(&json).unwrap(), info);
    }
}
