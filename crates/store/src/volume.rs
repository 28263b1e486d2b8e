//! A volume: the I/O path and the extent lifecycle of one virtual disk.
//!
//! Why: this is the hot path of the server. A read or write takes the volume's read lock (a
//! shared, uncontended counter), resolves each extent through the atomic in-memory map and
//! does positional I/O on the device; nothing is allocated per I/O. Only a write to a hole
//! takes the pool mutex (to allocate), and only a release (TRIM / WRITE_ZEROES of whole
//! extents, shrink, delete) takes the volume's write lock — which waits for in-flight I/O of
//! this volume, so no write can land in an extent after it was freed and handed to another
//! volume.

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::StoreError;
use crate::extent_map::{CHUNK_EXTENTS, ExtentMap};
use crate::fault::{self, FaultScope, IoClass};
use crate::layout::{EXTENT_SIZE_BYTES, PENDING_BIT, PhysExtent, Piece, extent_count, pieces};
use crate::meta::{MetaOp, VolumeRecord};
use crate::store::{Change, DeviceSet, Shared};
use crate::sync::{lock, read};

// Asynchronous data I/O on RADOS: a child module, so it sees this module's private parts.
#[path = "volume_aio.rs"]
mod aio;
pub use aio::{AioDone, AioRequest};

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
    map: ExtentMap,
}

/// A volume handle (`Arc<Volume>` from `Store::open_volume`), usable from many threads.
pub struct Volume {
    id: u64,
    name: String,
    created_unix_s: u64,
    /// Opaque QoS settings; changed only under the store's management mutex, after the commit
    /// that made the change durable.
    qos: Mutex<Option<String>>,
    /// Fixed at creation.
    tenant: Option<String>,
    /// Fixed at creation.
    read_only: bool,
    shared: Arc<Shared>,
    me: Weak<Volume>,
    state: RwLock<VolumeState>,
    size_bytes: AtomicU64,
    allocated_extents: AtomicU64,
    deleted: AtomicBool,
    /// Warnings about failed requests, rate-limited.
    errors: ErrorLog,
    /// Asynchronous reads and writes in flight (volume_aio.rs); whoever takes `state`'s
    /// write lock waits for them, as it waits for synchronous I/O through the read lock.
    in_flight: Arc<aio::InFlight>,
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

/// Commits a full pool may run to recycle quarantined extents before a write gives up with
/// `NoSpace` (others may take the recycled extents first).
const MAX_RECLAIMS: u32 = 8;

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
        allocated_extents: u64,
    ) -> Arc<Volume> {
        Arc::new_cyclic(|me| Volume {
            id,
            name: record.name,
            created_unix_s: record.created_unix_s,
            qos: Mutex::new(record.qos),
            tenant: record.tenant,
            read_only: record.read_only,
            shared,
            me: me.clone(),
            size_bytes: AtomicU64::new(record.size_bytes),
            state: RwLock::new(VolumeState {
                size_bytes: record.size_bytes,
                map,
            }),
            allocated_extents: AtomicU64::new(allocated_extents),
            deleted: AtomicBool::new(false),
            errors: ErrorLog::default(),
            in_flight: Arc::default(),
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
        }
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
            StoreError::Io(e)
                if e.kind() == io::ErrorKind::StorageFull
                    && matches!(op, "write" | "write_zeroes") =>
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
        match holder {
            Some(device) => Err(self.shared.failed_error(device)),
            None => Ok(()),
        }
    }

    /// Reads `buf.len()` bytes at `offset`. Unwritten ranges read as zeros.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let len = buf.len() as u64;
        self.inject(IoClass::Read, offset, len)
            .and_then(|()| self.read_inner(offset, buf))
            .map_err(|e| self.failed("read", offset, len, e))
    }

    /// Reads `buf.len()` bytes at `offset` unless the whole range is a hole (never written,
    /// or trimmed away): then it returns `true` and leaves `buf` as it was, so a reply can say
    /// "zeros" without carrying them. Fails exactly as `read_at` would.
    pub fn read_at_unless_hole(&self, offset: u64, buf: &mut [u8]) -> Result<bool, StoreError> {
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
                self.read_pieces(&st, offset, buf).map(|()| false)
            })
            .map_err(|e| self.failed("read", offset, len, e))
    }

    fn read_inner(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let st = read(&self.state);
        self.check_live()?;
        check_range(st.size_bytes, offset, buf.len() as u64)?;
        self.read_pieces(&st, offset, buf)
    }

    /// Copies `[offset, offset + buf.len())` out of the devices; holes read as zeros. The
    /// caller holds the state's read lock and has checked the range.
    fn read_pieces(&self, st: &VolumeState, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        for p in pieces(offset, buf.len() as u64) {
            let dst = &mut buf[p.buf_range()];
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
        loop {
            match self.write_once(offset, data)? {
                WriteOutcome::Done {
                    touched,
                    needs_commit,
                } => {
                    if fua {
                        self.inject(IoClass::Sync, offset, data.len() as u64)?;
                        self.make_durable(touched, needs_commit)?;
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
    fn allocate(&self, st: &VolumeState, extent: u64) -> Result<Option<u64>, StoreError> {
        let Some(slot) = st.map.slot(extent) else {
            return Err(StoreError::OutOfRange {
                offset: extent * EXTENT_SIZE_BYTES,
                length: EXTENT_SIZE_BYTES,
                size_bytes: st.size_bytes,
            });
        };
        // New extents go to devices that can still make data durable.
        let avoid = self.shared.failed_devices();
        let mut pool = lock(&self.shared.pool);
        let current = slot.load(Ordering::Acquire);
        if current != 0 {
            return Ok(Some(current)); // another writer allocated it first
        }
        let Some(phys) = pool.allocator.allocate_avoiding(self.id, avoid.0) else {
            if pool.quarantined > 0 {
                return Ok(None);
            }
            if avoid.iter().any(|d| pool.allocator.free_extents(d) > 0) {
                return Err(StoreError::Io(io::Error::other(
                    "no free extent on a healthy device (the devices with free space failed)",
                )));
            }
            return Err(StoreError::NoSpace);
        };
        pool.pending.push(Change::Alloc {
            volume: self.me.clone(),
            volume_id: self.id,
            extent,
            phys,
        });
        let entry = phys.to_entry() | PENDING_BIT;
        slot.store(entry, Ordering::Release);
        self.allocated_extents.fetch_add(1, Ordering::Relaxed);
        Ok(Some(entry))
    }

    /// After a commit: the allocation of `extent` at `phys` is durable.
    pub(crate) fn mark_committed(&self, extent: u64, phys: PhysExtent) {
        let st = read(&self.state);
        if let Some(slot) = st.map.existing_slot(extent) {
            let pending = phys.to_entry() | PENDING_BIT;
            let _ = slot.compare_exchange(
                pending,
                phys.to_entry(),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    /// FUA completion: sync the devices written, or run a full commit if an allocation the
    /// request relies on is not yet durable.
    fn make_durable(&self, touched: DeviceSet, needs_commit: bool) -> Result<(), StoreError> {
        if needs_commit {
            let failed = self.shared.commit(&[], false)?;
            return match touched.iter().find(|&d| failed.contains(d as u32)) {
                Some(device) => Err(self.shared.failed_error(device)),
                None => Ok(()),
            };
        }
        for d in touched.iter() {
            if let Some(dev) = self.shared.devices.get(d) {
                dev.sync_now()?;
            }
        }
        Ok(())
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
        loop {
            match self.zero_provisioned_once(offset, len)? {
                WriteOutcome::Done {
                    touched,
                    needs_commit,
                } => {
                    if fua {
                        self.inject(IoClass::Sync, offset, len)?;
                        self.make_durable(touched, needs_commit)?;
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
            }
        }
        Ok(())
    }

    /// Punches the allocated parts of the partial head and tail pieces of a discard.
    fn punch_partials(
        &self,
        st: &VolumeState,
        head: Option<Piece>,
        tail: Option<Piece>,
    ) -> Result<(), StoreError> {
        for p in head.iter().chain(tail.iter()) {
            if let Some(phys) = PhysExtent::from_entry(st.map.get(p.extent)) {
                self.shared
                    .device(phys)?
                    .punch(phys.index, p.offset_in_extent, p.len)?;
            }
        }
        Ok(())
    }

    /// Releases every allocated extent in `[first, end)` (caller holds the write lock, so no
    /// I/O of this volume is in flight): unmap, punch, and queue the free. The physical extents
    /// stay quarantined until the next commit makes the free durable.
    fn release_locked(&self, st: &mut VolumeState, first: u64, end: u64) -> Result<(), StoreError> {
        let mut freed: Vec<(u64, PhysExtent)> = st
            .map
            .allocated_in(first, end)
            .filter_map(|(i, _)| {
                let old = st.map.existing_slot(i)?.swap(0, Ordering::AcqRel);
                PhysExtent::from_entry(old).map(|p| (i, p))
            })
            .collect();
        if freed.is_empty() {
            return Ok(());
        }
        freed.sort_by_key(|&(_, p)| p);
        // Punch contiguous physical runs with one call each; remember which runs failed.
        let mut ok = vec![true; freed.len()];
        let mut first_error = None;
        let mut i = 0;
        while i < freed.len() {
            let start = freed[i].1;
            let mut j = i + 1;
            while j < freed.len()
                && freed[j].1.device == start.device
                && freed[j].1.index == freed[j - 1].1.index + 1
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
            for (&(extent, phys), &reusable) in freed.iter().zip(&ok) {
                pool.allocator.disown(self.id, phys);
                pool.pending.push(Change::Free {
                    volume_id: self.id,
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
            .map_err(|e| self.failed("flush", 0, 0, e))
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
            if let Some(phys) = PhysExtent::from_entry(st.map.get(p.extent)) {
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
            let entry = st.map.get(extent);
            let next = match PhysExtent::from_entry(entry) {
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

    /// Where logical extent `extent` is stored, or `None` for a hole.
    pub fn extent_location(&self, extent: u64) -> Option<PhysicalLocation> {
        let entry = read(&self.state).map.get(extent);
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
            let tail = match PhysExtent::from_entry(st.map.get(new_size / EXTENT_SIZE_BYTES)) {
                Some(phys) if tail_off != 0 => self.shared.device(phys).and_then(|d| {
                    Ok(d.punch(phys.index, tail_off, EXTENT_SIZE_BYTES - tail_off)?)
                }),
                _ => Ok(()),
            };
            st.map.resize(new_count);
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
        };
        let json = serde_json::to_string(&info).unwrap();
        assert!(!json.contains("qos"), "{json}");
        assert!(
            !json.contains("tenant") && !json.contains("read_only"),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<VolumeInfo>(&json).unwrap(), info);
        info.qos = Some(r#"{"iops":100}"#.into());
        info.tenant = Some("alice".into());
        info.read_only = true;
        let json = serde_json::to_string(&info).unwrap();
        assert_eq!(serde_json::from_str::<VolumeInfo>(&json).unwrap(), info);
    }
}
