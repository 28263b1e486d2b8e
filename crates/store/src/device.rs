//! Backing devices of the pool: sparse files, block devices, RAM, or (feature `rados`) a
//! RADOS pool whose objects are the extents (`rados.rs`).
//!
//! Why: the volume layer speaks in (physical extent, offset) and needs five operations from a
//! device — positional read/write, zeroing that keeps space, punching that frees space and
//! reads back as zeros, and a durable sync. This module hides how each backend does them and
//! falls back (writing zeros) where the kernel or filesystem lacks punch/zero-range support.
//!
//! Invariant the store relies on: after `punch*`, the range reads as zeros.
//!
//! Full filesystems (a device file larger than the space left under it): a new extent's
//! blocks are reserved when it is allocated (`reserve`, `fallocate` without punching: the
//! range stays unwritten and reads as zeros), and a discard of part of an allocated extent
//! keeps them (`clear`, zero-range), so writes into allocated extents do not need space the
//! filesystem may no longer have. ENOSPC is not a device fault: it is counted apart from the
//! errors (`stats`), and a sync that fails with ENOSPC does not fail the device (it counts a
//! lost sync instead, `lost_syncs`; see `sync_now_untimed`).

use std::fs::{File, OpenOptions};
use std::io;
use std::num::NonZeroU64;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{OnceLock, RwLock};
use std::time::Instant;

use rustix::fs::{Advice, FallocateFlags, SeekFrom};
use rustix::io::Errno;

use crate::checksum::{BLOCK_BYTES, BLOCKS_PER_EXTENT, ChecksumMismatch, Layout, RawIo, Sums};
use crate::fault::{self, ActiveRule, Fault, IoClass};
use crate::layout::EXTENT_SIZE_BYTES;
use crate::stats::{DeviceCounters, DeviceOp, Outcome, is_no_space};
use crate::sync::{read, write};

/// Source of zeros for the write-zeros fallback.
static ZEROES: [u8; 64 * 1024] = [0; 64 * 1024];

/// One device of the pool.
#[derive(Debug)]
pub(crate) struct Device {
    pub id: u32,
    /// Path for files and block devices, `memory:<id>` for RAM devices, `rados:<pool>/<namespace>`
    /// for RADOS.
    pub label: String,
    pub extent_count: u32,
    backend: Backend,
    /// Set after a write or punch lands, cleared by the sync that covers it.
    dirty: AtomicBool,
    /// A sync failed once: dirty pages may have been dropped, so no later sync may claim success.
    /// Also set when the device disappears (fault injection). New extents avoid failed devices.
    failed: AtomicBool,
    /// Fault rules scoped to this device (`Store::inject_faults`); unset: none.
    faults: OnceLock<Vec<ActiveRule>>,
    /// Operations, errors and latency per operation (`Store::device_stats`).
    stats: DeviceCounters,
    /// Read and write errors counted before the device last returned to service
    /// (`restore`): `errors_in_service` counts from there.
    errors_before_service: AtomicU64,
    /// Syncs that failed with ENOSPC: the data they were to make durable may be lost, but
    /// the device stays in service. Volumes compare it with what their last FLUSH saw.
    lost_syncs: AtomicU64,
    /// Per-block checksums and the write-intent bitmap (`checksum.rs`): signed file and block
    /// devices of format 2 and simulated disks; `None` elsewhere.
    sums: Option<Sums>,
}

#[derive(Debug)]
enum Backend {
    File(FileDevice),
    Memory(MemoryDevice),
    #[cfg(feature = "rados")]
    Rados(std::sync::Arc<crate::rados::Pool>),
    /// A disk of a simulated pool (`sim_disk.rs`, the power-cut test): writes are volatile
    /// until a sync.
    Sim(std::sync::Arc<crate::sim_disk::SimDisk>),
}

#[derive(Debug)]
struct FileDevice {
    file: File,
    is_block_device: bool,
    /// On tmpfs or ramfs: its pages live in RAM, so no read or write waits for a disk.
    in_memory: bool,
    punch_supported: AtomicBool,
    zero_range_supported: AtomicBool,
    seek_data_supported: AtomicBool,
    /// `fallocate` without flags (block reservation) works here.
    reserve_supported: AtomicBool,
}

/// RAM device: one lazily allocated buffer per extent, each behind its own lock, so reads of
/// different (or the same) extents run in parallel and a released extent returns its memory.
#[derive(Debug)]
struct MemoryDevice {
    slots: Box<[MemorySlot]>,
}

/// One RAM extent: `None` until first written (reads as zeros) and after a whole-extent punch.
type MemorySlot = RwLock<Option<Box<[u8]>>>;

/// Opens (or creates) a device file or block device; returns the file, its usable capacity in
/// bytes and whether it is a block device. A new or empty regular file is sized (sparse) to
/// `create_capacity_bytes`.
pub(crate) fn open_device_file(
    path: &Path,
    create_capacity_bytes: u64,
    may_create: bool,
) -> io::Result<(File, u64, bool)> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(may_create)
        .truncate(false)
        .open(path)?;
    let md = file.metadata()?;
    if md.file_type().is_block_device() {
        let capacity = rustix::fs::seek(&file, SeekFrom::End(0))?;
        return Ok((file, capacity, true));
    }
    if !md.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is neither a regular file nor a block device",
                path.display()
            ),
        ));
    }
    if md.len() == 0 && create_capacity_bytes > 0 {
        file.set_len(create_capacity_bytes)?;
        return Ok((file, create_capacity_bytes, false));
    }
    Ok((file, md.len(), false))
}

/// `statfs` magic numbers of the filesystems that keep file pages in RAM (linux/magic.h).
const TMPFS_MAGIC: u64 = 0x0102_1994;
const RAMFS_MAGIC: u64 = 0x8584_58f6;

/// Whether `file` is on tmpfs or ramfs. An error answers no (the safe side: I/O then leaves
/// the network threads).
fn on_memory_filesystem(file: &File) -> bool {
    match rustix::fs::fstatfs(file) {
        #[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
        Ok(stat) => {
            let magic = stat.f_type as u64;
            magic == TMPFS_MAGIC || magic == RAMFS_MAGIC
        }
        Err(_) => false,
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_string())
}

fn is_unsupported(e: Errno) -> bool {
    e == Errno::OPNOTSUPP || e == Errno::NOSYS || e == Errno::INVAL
}

impl Device {
    pub(crate) fn from_file(
        id: u32,
        label: String,
        file: File,
        is_block_device: bool,
        extent_count: u32,
    ) -> Device {
        Device {
            id,
            label,
            extent_count,
            backend: Backend::File(FileDevice {
                in_memory: !is_block_device && on_memory_filesystem(&file),
                file,
                is_block_device,
                punch_supported: AtomicBool::new(true),
                zero_range_supported: AtomicBool::new(true),
                seek_data_supported: AtomicBool::new(!is_block_device),
                // A block device's blocks exist already.
                reserve_supported: AtomicBool::new(!is_block_device),
            }),
            dirty: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            faults: OnceLock::new(),
            stats: DeviceCounters::default(),
            errors_before_service: AtomicU64::new(0),
            lost_syncs: AtomicU64::new(0),
            sums: None,
        }
    }

    pub(crate) fn memory(id: u32, extent_count: u32) -> Device {
        let slots = (0..extent_count).map(|_| RwLock::new(None)).collect();
        Device {
            id,
            label: format!("memory:{id}"),
            extent_count,
            backend: Backend::Memory(MemoryDevice { slots }),
            dirty: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            faults: OnceLock::new(),
            stats: DeviceCounters::default(),
            errors_before_service: AtomicU64::new(0),
            lost_syncs: AtomicU64::new(0),
            sums: None,
        }
    }

    /// A device whose extents are objects of a RADOS pool (see `rados.rs` for the naming).
    #[cfg(feature = "rados")]
    pub(crate) fn rados(
        id: u32,
        pool: std::sync::Arc<crate::rados::Pool>,
        extent_count: u32,
    ) -> Device {
        Device {
            id,
            label: pool.label.clone(),
            extent_count,
            backend: Backend::Rados(pool),
            dirty: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            faults: OnceLock::new(),
            stats: DeviceCounters::default(),
            errors_before_service: AtomicU64::new(0),
            lost_syncs: AtomicU64::new(0),
            sums: None,
        }
    }

    /// The object holding extent `ext` of this device.
    #[cfg(feature = "rados")]
    fn object(&self, ext: u32) -> crate::rados::ObjectName {
        crate::rados::ObjectName::new(self.id, ext)
    }

    /// Runs one device operation, counting it in the device's statistics. Operations of a
    /// RAM device are counted but not timed: they are memory copies, far below the first
    /// latency bucket, and two clock reads would cost more than many of them.
    #[inline]
    fn timed<T>(
        &self,
        op: DeviceOp,
        bytes: u64,
        run: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        if self.is_memory() {
            let result = run();
            self.stats.count(op, bytes, Outcome::of(&result));
            return result;
        }
        let start = Instant::now();
        let result = run();
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.stats.record(op, bytes, ns, Outcome::of(&result));
        result
    }

    /// A device on a disk of a simulated pool (`Store::open_simulated`).
    pub(crate) fn simulated(
        id: u32,
        disk: std::sync::Arc<crate::sim_disk::SimDisk>,
        extent_count: u32,
    ) -> Device {
        Device {
            id,
            label: disk.name().to_string(),
            extent_count,
            backend: Backend::Sim(disk),
            dirty: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            faults: OnceLock::new(),
            stats: DeviceCounters::default(),
            errors_before_service: AtomicU64::new(0),
            lost_syncs: AtomicU64::new(0),
            sums: None,
        }
    }

    /// A device whose extents are RADOS objects.
    #[cfg(feature = "rados")]
    pub(crate) fn is_rados(&self) -> bool {
        matches!(self.backend, Backend::Rados(_))
    }

    /// Before an asynchronous read or write of `len` bytes at `off` inside extent `ext`
    /// (volume_aio.rs): checks the range; the pool to send it to and the byte position on
    /// the device, or `None` if this is not a RADOS device or faults are injected into it.
    #[cfg(feature = "rados")]
    pub(crate) fn aio_prepare(
        &self,
        ext: u32,
        off: u64,
        len: u64,
    ) -> io::Result<Option<(std::sync::Arc<crate::rados::Pool>, u64)>> {
        let Backend::Rados(p) = &self.backend else {
            return Ok(None);
        };
        // Injected faults may sleep: they stay on the synchronous path (I/O threads).
        if self.faults.get().is_some() {
            return Ok(None);
        }
        let pos = self.check(ext, off, len)?;
        Ok(Some((std::sync::Arc::clone(p), pos)))
    }

    /// After an asynchronous read or write that `aio_prepare` allowed: counts it (latency
    /// from `started`) and names the device and position in an error.
    #[cfg(feature = "rados")]
    pub(crate) fn aio_finish(
        &self,
        write: bool,
        bytes: u64,
        pos: u64,
        started: Instant,
        result: io::Result<()>,
    ) -> io::Result<()> {
        let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let op = if write {
            DeviceOp::Write
        } else {
            DeviceOp::Read
        };
        self.stats.record(op, bytes, ns, Outcome::of(&result));
        result.map_err(|e| self.context(pos, e))
    }

    /// Reads `buf.len()` bytes at `off` inside physical extent `ext`.
    /// On a checksummed device every block read is verified; a block that fails (after a
    /// retry under the write locks) is an `InvalidData` error carrying `ChecksumMismatch`.
    pub(crate) fn read(&self, ext: u32, off: u64, buf: &mut [u8]) -> io::Result<()> {
        self.timed(DeviceOp::Read, buf.len() as u64, || {
            match self.sums_for(ext) {
                Some(sums) => self.read_checked(sums, ext, off, buf),
                None => self.read_untimed(ext, off, buf),
            }
        })
    }

    /// Writes `data` at `off` inside physical extent `ext` (and its checksum entries).
    pub(crate) fn write(&self, ext: u32, off: u64, data: &[u8]) -> io::Result<()> {
        self.timed(DeviceOp::Write, data.len() as u64, || {
            match self.sums_for(ext) {
                Some(sums) => self.write_checked(sums, ext, off, data),
                None => self.write_untimed(ext, off, data),
            }
        })
    }

    /// Zeroes `[off, off + len)` of extent `ext`, keeping the space allocated (NO_HOLE).
    pub(crate) fn zero(&self, ext: u32, off: u64, len: u64) -> io::Result<()> {
        self.timed(DeviceOp::Zero, len, || match self.sums_for(ext) {
            Some(sums) => {
                self.zero_checked(sums, ext, off, len, &|o, l| self.zero_untimed(ext, o, l))
            }
            None => self.zero_untimed(ext, off, len),
        })
    }

    /// Deallocates `[off, off + len)` of extent `ext`; the range reads as zeros afterwards.
    pub(crate) fn punch(&self, ext: u32, off: u64, len: u64) -> io::Result<()> {
        self.timed(DeviceOp::Punch, 0, || match self.sums_for(ext) {
            Some(sums) => {
                self.zero_checked(sums, ext, off, len, &|o, l| self.punch_untimed(ext, o, l))
            }
            None => self.punch_untimed(ext, off, len),
        })
    }

    /// Zeroes `[off, off + len)` of allocated extent `ext` for a discard (TRIM, a releasing
    /// WRITE_ZEROES, a shrink's tail): keeps the blocks reserved where it can (zero-range),
    /// so a later write there needs no new space; where keeping them takes space the
    /// filesystem does not have (a range that was a hole), it punches instead. Reads as zeros
    /// afterwards either way.
    pub(crate) fn clear(&self, ext: u32, off: u64, len: u64) -> io::Result<()> {
        let Backend::File(f) = &self.backend else {
            // RAM and RADOS have no blocks to keep: a partial punch is their zeroing.
            return self.punch(ext, off, len);
        };
        let clear = |off: u64, len: u64| {
            let pos = self.check(ext, off, len)?;
            // A discard, not a write: only a disappeared device fails it (as a punch).
            self.inject(IoClass::Other, pos, len)?;
            f.zero_range(pos, len).map_err(|e| self.context(pos, e))?;
            self.mark_dirty();
            Ok(())
        };
        let cleared = self.timed(DeviceOp::Zero, len, || match self.sums_for(ext) {
            Some(sums) => self.zero_checked(sums, ext, off, len, &clear),
            None => clear(off, len),
        });
        match cleared {
            Err(e) if is_no_space(&e) => self.punch(ext, off, len),
            other => other,
        }
    }

    /// Reserves the filesystem blocks of the whole of extent `ext` (a new allocation), so
    /// writes into it cannot fail for want of space: `fallocate` without punching or
    /// zeroing, with KEEP_SIZE, leaves the range unwritten (it reads as zeros, and what was
    /// written there stays). ENOSPC when the filesystem has no room for it: the caller
    /// gives the extent back. A no-op on block devices, RAM and RADOS, and where the
    /// filesystem cannot preallocate (then later writes may still meet a full filesystem).
    /// Not a fault-injection point. Marks the device dirty, so the commit that makes the
    /// allocation durable syncs the reservation first.
    pub(crate) fn reserve(&self, ext: u32) -> io::Result<()> {
        let Backend::File(f) = &self.backend else {
            return Ok(());
        };
        if !f.reserve_supported.load(Ordering::Relaxed) {
            return Ok(());
        }
        let pos = self.check(ext, 0, EXTENT_SIZE_BYTES)?;
        self.timed(DeviceOp::Zero, 0, || {
            match rustix::fs::fallocate(&f.file, FallocateFlags::KEEP_SIZE, pos, EXTENT_SIZE_BYTES)
            {
                Ok(()) => {
                    self.mark_dirty();
                    Ok(())
                }
                Err(e) if is_unsupported(e) => {
                    tracing::warn!(device = %self.label, error = %e, "fallocate unsupported: extents are not reserved, so writes into them may meet a full filesystem");
                    f.reserve_supported.store(false, Ordering::Relaxed);
                    Ok(())
                }
                Err(e) => Err(self.context(pos, e.into())),
            }
        })
    }

    /// Extent `ext` is being allocated (reserved, not yet published): sets its write-intent
    /// bit without a sync of its own (`Sums::set_for_new_extent`; the commit of the
    /// allocation syncs it). A no-op without checksums.
    pub(crate) fn note_new_extent(&self, ext: u32) {
        if let Some(sums) = &self.sums {
            sums.set_for_new_extent(self, ext);
        }
    }

    /// Deallocates `count` whole extents starting at `first` (one call for a contiguous run).
    pub(crate) fn punch_extents(&self, first: u32, count: u32) -> io::Result<()> {
        self.timed(DeviceOp::Punch, 0, || {
            let Some(sums) = &self.sums else {
                return self.punch_extents_untimed(first, count);
            };
            // The reserved prefix is never punched through here with checksums on (it holds
            // the bitmap and the entries): only the covered part of the run.
            let start = first.max(sums.layout.reserved_extents);
            let end = (first + count).min(self.extent_count);
            if start >= end {
                return Ok(());
            }
            sums.begin_change(self, start, end - start)?;
            let result = self
                .punch_extents_untimed(start, end - start)
                .and_then(|()| sums.zero_extent_entries(self, start, end - start));
            sums.end_change(start, end - start);
            result
        })
    }

    /// Unconditional data sync (FUA). Once a sync fails the device stays failed.
    pub(crate) fn sync_now(&self) -> io::Result<()> {
        self.timed(DeviceOp::Sync, 0, || self.sync_now_untimed())
    }

    /// The device's operation counters.
    pub(crate) fn stats(&self) -> [crate::stats::DeviceOpStats; 5] {
        self.stats.snapshot()
    }

    /// Read and write errors (ENOSPC not included) since the device last entered service.
    pub(crate) fn errors_in_service(&self) -> u64 {
        self.stats
            .read_write_errors()
            .saturating_sub(self.errors_before_service.load(Ordering::Relaxed))
    }

    /// Syncs that failed with ENOSPC since the device started (a generation count).
    pub(crate) fn lost_syncs(&self) -> u64 {
        self.lost_syncs.load(Ordering::SeqCst)
    }

    /// Checks that a failed device answers again before it is returned to service: reads
    /// its first 4 KiB and, for a file or block device, runs an `fdatasync` (which the
    /// failed flag otherwise skips). Injected faults apply (a device gone stays gone).
    pub(crate) fn probe(&self) -> io::Result<()> {
        let mut buf = [0u8; 4096];
        self.read(0, 0, &mut buf)?;
        self.inject(IoClass::Sync, 0, 0)?;
        match &self.backend {
            Backend::File(f) => rustix::fs::fdatasync(&f.file).map_err(io::Error::from),
            _ => Ok(()),
        }
    }

    /// Returns a failed device to service (`Store::restore_device`, after its scrub): it is
    /// synced, written and allocated on again, and its error count starts from zero. The
    /// dirty flag is kept, so the next commit syncs what was written while it was failed.
    pub(crate) fn restore(&self) {
        self.errors_before_service
            .store(self.stats.read_write_errors(), Ordering::Relaxed);
        if self.failed.swap(false, Ordering::SeqCst) {
            tracing::warn!(device = %self.label, "device returned to service");
        }
    }

    /// Installs the fault rules scoped to this device; false if some were installed already.
    pub(crate) fn install_faults(&self, rules: Vec<ActiveRule>) -> bool {
        self.faults.set(rules).is_ok()
    }

    /// Fails the device for good (the operator's `headroom device fail`, or a device recorded
    /// failed): from now on it is treated like a device whose sync failed.
    pub(crate) fn mark_failed(&self) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            tracing::warn!(device = %self.label, "device marked failed");
        }
    }

    /// Whether writes or punches completed since the last sync ([`Device::sync_if_dirty`]).
    pub(crate) fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::SeqCst)
    }

    /// Whether a sync failed (or the device disappeared): its data can no longer be made
    /// durable.
    pub(crate) fn is_failed(&self) -> bool {
        if self.failed.load(Ordering::SeqCst) {
            return true;
        }
        let vanished = self
            .faults
            .get()
            .is_some_and(|rules| rules.iter().any(ActiveRule::vanished));
        if vanished && !self.failed.swap(true, Ordering::SeqCst) {
            tracing::error!(device = %self.label, "device gone; marked failed");
        }
        vanished
    }

    /// Runs the device's fault rules over one operation at byte `pos`. A device that
    /// disappears is failed from then on (every later sync fails too).
    fn inject(&self, class: IoClass, pos: u64, len: u64) -> io::Result<()> {
        let Some(rules) = self.faults.get() else {
            return Ok(());
        };
        match fault::apply(rules.iter(), class, pos, len) {
            None => Ok(()),
            Some((fault, rule)) => {
                if fault == Fault::Gone && !self.failed.swap(true, Ordering::SeqCst) {
                    tracing::error!(device = %self.label, "device gone; marked failed");
                }
                Err(self.context(pos, fault::io_error(fault, rule, class)))
            }
        }
    }

    /// `e` with the device and the byte position in its text (the kind is kept, so a full
    /// filesystem's ENOSPC is still `StorageFull`).
    fn context(&self, pos: u64, e: io::Error) -> io::Error {
        io::Error::new(
            e.kind(),
            format!("device {} at byte {pos}: {e}", self.label),
        )
    }

    pub(crate) fn is_memory(&self) -> bool {
        matches!(self.backend, Backend::Memory(_))
    }

    /// A file or block device (the pools that can grow by another one).
    pub(crate) fn is_file_backed(&self) -> bool {
        matches!(self.backend, Backend::File(_))
    }

    /// A disk of a simulated pool (it grows and fails like a file pool).
    pub(crate) fn is_simulated(&self) -> bool {
        matches!(self.backend, Backend::Sim(_))
    }

    /// Whether its data lives in RAM: a RAM device, or a file on tmpfs or ramfs. No
    /// operation on it waits for a disk (memory pressure aside), so it may run on a network
    /// thread.
    pub(crate) fn is_memory_resident(&self) -> bool {
        match &self.backend {
            Backend::Memory(_) => true,
            Backend::File(f) => f.in_memory,
            Backend::Sim(_) => true,
            // Every operation is a network round trip to the cluster.
            #[cfg(feature = "rados")]
            Backend::Rados(_) => false,
        }
    }

    /// Whether zeroing and punching are metadata operations here (RAM, or a kernel and
    /// filesystem that support punch-hole and zero-range), not writes of zeros.
    pub(crate) fn zeroes_fast(&self) -> bool {
        match &self.backend {
            Backend::Memory(_) | Backend::Sim(_) => true,
            Backend::File(f) => {
                f.punch_supported.load(Ordering::Relaxed)
                    && f.zero_range_supported.load(Ordering::Relaxed)
            }
            // Removing an object and RADOS `zero` are metadata operations on the OSD.
            #[cfg(feature = "rados")]
            Backend::Rados(_) => true,
        }
    }

    pub(crate) fn capacity_bytes(&self) -> u64 {
        u64::from(self.extent_count) * EXTENT_SIZE_BYTES
    }

    fn check(&self, ext: u32, off: u64, len: u64) -> io::Result<u64> {
        if ext >= self.extent_count || off.saturating_add(len) > EXTENT_SIZE_BYTES {
            return Err(invalid("physical range outside the device"));
        }
        Ok(u64::from(ext) * EXTENT_SIZE_BYTES + off)
    }

    fn mark_dirty(&self) {
        // Load first: under many writers the flag stays set and the cache line stays shared.
        if !self.dirty.load(Ordering::SeqCst) {
            self.dirty.store(true, Ordering::SeqCst);
        }
    }

    /// Reads `buf.len()` bytes at `off` inside physical extent `ext`.
    fn read_untimed(&self, ext: u32, off: u64, buf: &mut [u8]) -> io::Result<()> {
        let pos = self.check(ext, off, buf.len() as u64)?;
        self.inject(IoClass::Read, pos, buf.len() as u64)?;
        match &self.backend {
            Backend::File(f) => f
                .file
                .read_exact_at(buf, pos)
                .map_err(|e| self.context(pos, e)),
            Backend::Memory(m) => {
                let slot = read(m.slot(ext)?);
                match slot.as_deref() {
                    None => buf.fill(0),
                    Some(data) => {
                        let start = off as usize;
                        let src = data
                            .get(start..start + buf.len())
                            .ok_or_else(|| invalid("memory extent range"))?;
                        buf.copy_from_slice(src);
                    }
                }
                Ok(())
            }
            #[cfg(feature = "rados")]
            Backend::Rados(p) => p
                .read(self.object(ext).as_c_str(), off, buf)
                .map_err(|e| self.context(pos, e)),
            Backend::Sim(d) => d.read(pos, buf).map_err(|e| self.context(pos, e)),
        }
    }

    /// Writes `data` at `off` inside physical extent `ext`.
    fn write_untimed(&self, ext: u32, off: u64, data: &[u8]) -> io::Result<()> {
        let pos = self.check(ext, off, data.len() as u64)?;
        self.inject(IoClass::Write, pos, data.len() as u64)?;
        match &self.backend {
            Backend::File(f) => {
                f.file
                    .write_all_at(data, pos)
                    .map_err(|e| self.context(pos, e))?;
                self.mark_dirty();
                Ok(())
            }
            Backend::Memory(m) => {
                let mut slot = write(m.slot(ext)?);
                let buf = slot.get_or_insert_with(|| {
                    vec![0u8; EXTENT_SIZE_BYTES as usize].into_boxed_slice()
                });
                let start = off as usize;
                let dst = buf
                    .get_mut(start..start + data.len())
                    .ok_or_else(|| invalid("memory extent range"))?;
                dst.copy_from_slice(data);
                self.mark_dirty();
                Ok(())
            }
            Backend::Sim(d) => {
                d.write(pos, data).map_err(|e| self.context(pos, e))?;
                self.mark_dirty();
                Ok(())
            }
            // Not marked dirty: an acknowledged RADOS write is already durable (rados.rs).
            #[cfg(feature = "rados")]
            Backend::Rados(p) => p
                .write(self.object(ext).as_c_str(), off, data)
                .map_err(|e| self.context(pos, e)),
        }
    }

    /// Zeroes `[off, off + len)` of extent `ext`, keeping the space allocated (NO_HOLE).
    fn zero_untimed(&self, ext: u32, off: u64, len: u64) -> io::Result<()> {
        let pos = self.check(ext, off, len)?;
        self.inject(IoClass::Write, pos, len)?;
        match &self.backend {
            Backend::File(f) => f.zero_range(pos, len).map_err(|e| self.context(pos, e))?,
            Backend::Memory(m) => m.zero(ext, off, len, false)?,
            Backend::Sim(d) => d.zero(pos, len).map_err(|e| self.context(pos, e))?,
            #[cfg(feature = "rados")]
            Backend::Rados(p) => p
                .zero(self.object(ext).as_c_str(), off, len)
                .map_err(|e| self.context(pos, e))?,
        }
        self.mark_dirty();
        Ok(())
    }

    /// Deallocates `[off, off + len)` of extent `ext`; the range reads as zeros afterwards.
    fn punch_untimed(&self, ext: u32, off: u64, len: u64) -> io::Result<()> {
        let pos = self.check(ext, off, len)?;
        self.inject(IoClass::Other, pos, len)?;
        match &self.backend {
            Backend::File(f) => f.punch(pos, len).map_err(|e| self.context(pos, e))?,
            Backend::Memory(m) => m.zero(ext, off, len, true)?,
            Backend::Sim(d) => d.zero(pos, len).map_err(|e| self.context(pos, e))?,
            #[cfg(feature = "rados")]
            Backend::Rados(p) => {
                let oid = self.object(ext);
                if off == 0 && len == EXTENT_SIZE_BYTES {
                    p.remove(oid.as_c_str())
                } else {
                    p.zero(oid.as_c_str(), off, len)
                }
                .map_err(|e| self.context(pos, e))?
            }
        }
        self.mark_dirty();
        Ok(())
    }

    /// Deallocates `count` whole extents starting at `first` (one call for a contiguous run).
    fn punch_extents_untimed(&self, first: u32, count: u32) -> io::Result<()> {
        if count == 0 {
            return Ok(());
        }
        if u64::from(first) + u64::from(count) > u64::from(self.extent_count) {
            return Err(invalid("physical extents outside the device"));
        }
        let pos = u64::from(first) * EXTENT_SIZE_BYTES;
        let len = u64::from(count) * EXTENT_SIZE_BYTES;
        self.inject(IoClass::Other, pos, len)?;
        match &self.backend {
            Backend::File(f) => f.punch(pos, len).map_err(|e| self.context(pos, e))?,
            Backend::Memory(m) => {
                for ext in first..first + count {
                    *write(m.slot(ext)?) = None;
                }
            }
            Backend::Sim(d) => d.zero(pos, len).map_err(|e| self.context(pos, e))?,
            #[cfg(feature = "rados")]
            Backend::Rados(p) => p
                .remove_many((first..first + count).map(|ext| self.object(ext)))
                .map_err(|e| self.context(pos, e))?,
        }
        self.mark_dirty();
        Ok(())
    }

    /// Deallocates the extents of `runs` ((first, count) pairs, ascending): the startup punch
    /// of free space. A RADOS device removes only the objects that exist (it lists its
    /// namespace), instead of one removal per free extent of its whole capacity.
    pub(crate) fn punch_free_runs(&self, runs: &[(u32, u32)]) -> io::Result<()> {
        #[cfg(feature = "rados")]
        if let Backend::Rados(p) = &self.backend {
            let stray: Vec<u32> = p
                .list()?
                .iter()
                .filter_map(|name| crate::rados::ObjectName::parse(name))
                .filter(|&(device, ext)| {
                    let i = runs.partition_point(|&(first, _)| first <= ext);
                    device == self.id && i > 0 && ext - runs[i - 1].0 < runs[i - 1].1
                })
                .map(|(_, ext)| ext)
                .collect();
            return self.timed(DeviceOp::Punch, 0, || {
                p.remove_many(stray.iter().map(|&ext| self.object(ext)))
                    .map_err(|e| self.context(0, e))
            });
        }
        for &(first, count) in runs {
            self.punch_extents(first, count)?;
        }
        Ok(())
    }

    /// Makes every write and punch that completed before this call durable, if any happened
    /// since the last sync. Used by FLUSH and metadata commits.
    pub(crate) fn sync_if_dirty(&self) -> io::Result<()> {
        if self.is_failed() {
            return Err(self.failed_error());
        }
        if self.dirty.swap(false, Ordering::SeqCst)
            && let Err(e) = self.sync_now()
        {
            self.dirty.store(true, Ordering::SeqCst);
            return Err(e);
        }
        Ok(())
    }

    /// Unconditional data sync (FUA). Once a sync fails the device stays failed.
    fn sync_now_untimed(&self) -> io::Result<()> {
        if self.is_failed() {
            return Err(self.failed_error());
        }
        let epoch = self.sums.as_ref().map(Sums::before_sync);
        let result = self
            .inject(IoClass::Sync, 0, 0)
            .and_then(|()| match &self.backend {
                Backend::File(f) => rustix::fs::fdatasync(&f.file).map_err(io::Error::from),
                Backend::Memory(_) => Ok(()),
                Backend::Sim(d) => d.sync(),
                // A barrier with nothing to wait for: librados acknowledged each write only
                // once every replica had it on stable storage, and each device operation
                // returns only after its acknowledgement, so everything that completed
                // before this call is already durable. The commit that follows (redb) is
                // what FLUSH still has to make durable.
                #[cfg(feature = "rados")]
                Backend::Rados(_) => Ok(()),
            });
        if let (Ok(()), Some(sums), Some(epoch)) = (&result, &self.sums, epoch) {
            sums.after_sync(self, epoch);
        }
        result.map_err(|e| {
            // ENOSPC (XFS, btrfs, NFS, thin LVM can report it at writeback): the data of the
            // writes this sync was to cover may be lost, as after any failed fsync, but the
            // device is not broken. It stays in service; the volumes with data on it fail
            // their next FLUSH (`lost_syncs`), and a later sync succeeds once there is space.
            if is_no_space(&e) {
                self.lost_syncs.fetch_add(1, Ordering::SeqCst);
                tracing::warn!(device = %self.label, error = %e, "fdatasync failed with ENOSPC; unsynced writes may be lost, the device stays in service");
            } else if !self.failed.swap(true, Ordering::SeqCst) {
                tracing::error!(device = %self.label, error = %e, "fdatasync failed; device marked failed");
            }
            e
        })
    }

    /// The error of every sync on a failed device.
    pub(crate) fn failed_error(&self) -> io::Error {
        io::Error::other(format!(
            "device {} failed (a sync failed or it disappeared); acknowledged data on it may be lost",
            self.label
        ))
    }

    /// Advisory read-ahead (NBD CACHE).
    pub(crate) fn advise_willneed(&self, ext: u32, off: u64, len: u64) {
        if let (Backend::File(f), Ok(pos)) = (&self.backend, self.check(ext, off, len))
            && let Err(e) =
                rustix::fs::fadvise(&f.file, pos, NonZeroU64::new(len), Advice::WillNeed)
        {
            tracing::debug!(device = %self.label, error = %e, "fadvise WILLNEED failed");
        }
    }

    /// Reports `[off, off + len)` of extent `ext` as runs of (length, holds data). Ranges the
    /// device knows to be unallocated (punched file ranges, unwritten RAM extents) are
    /// reported as `false`; when the device cannot tell, everything is data.
    pub(crate) fn data_runs(&self, ext: u32, off: u64, len: u64, out: &mut dyn FnMut(u64, bool)) {
        let Ok(start) = self.check(ext, off, len) else {
            out(len, true);
            return;
        };
        match &self.backend {
            Backend::Memory(m) => {
                let has_data = m.slot(ext).map(|s| read(s).is_some()).unwrap_or(true);
                out(len, has_data);
            }
            Backend::File(f) => f.data_runs(start, len, out),
            Backend::Sim(_) => out(len, true),
            // A missing object is a hole; an existing one is reported as data throughout.
            #[cfg(feature = "rados")]
            Backend::Rados(p) => {
                let has_data = p.exists(self.object(ext).as_c_str()).unwrap_or(true);
                out(len, has_data);
            }
        }
    }

    /// Bytes of real storage the device uses (file blocks or RAM), when knowable.
    pub(crate) fn physical_used_bytes(&self) -> Option<u64> {
        match &self.backend {
            Backend::File(f) if f.is_block_device => None,
            Backend::File(f) => f.file.metadata().ok().map(|m| m.blocks() * 512),
            Backend::Memory(m) => {
                let used = m.slots.iter().filter(|s| read(s).is_some()).count() as u64;
                Some(used * EXTENT_SIZE_BYTES)
            }
            // The cluster's own accounting (`ceph df`) knows; we do not ask it.
            #[cfg(feature = "rados")]
            Backend::Rados(_) => None,
            Backend::Sim(_) => None,
        }
    }
}

/// How a checksummed range splits into a partial head block, whole blocks, a partial tail.
fn block_span(off: u64, len: u64) -> (u64, u64) {
    (off / BLOCK_BYTES, (off + len).div_ceil(BLOCK_BYTES))
}

impl Device {
    /// Turns checksums on for this device (`checksum.rs`): reads its write-intent bitmap.
    /// For a file or block device signed with format 2, or a simulated disk, whose reserved
    /// prefix is at least the layout's.
    pub(crate) fn with_checksums(mut self) -> io::Result<Device> {
        let layout = Layout::for_extents(self.extent_count);
        let mut bitmap = vec![0u8; layout.bitmap_bytes as usize];
        self.raw_read(layout.bitmap_offset, &mut bitmap)?;
        self.sums = Some(Sums::new(layout, self.extent_count, bitmap));
        Ok(self)
    }

    /// Whether the data of this device is checksummed.
    pub(crate) fn has_checksums(&self) -> bool {
        self.sums.is_some()
    }

    /// Blocks that failed verification since the device was opened.
    pub(crate) fn checksum_errors(&self) -> u64 {
        self.sums
            .as_ref()
            .map_or(0, |s| s.checksum_errors.load(Ordering::Relaxed))
    }

    /// Blocks rewritten from a good copy since the device was opened.
    pub(crate) fn repaired_blocks(&self) -> u64 {
        self.sums
            .as_ref()
            .map_or(0, |s| s.repaired.load(Ordering::Relaxed))
    }

    /// Counts `blocks` rewritten from a good copy (the volume's repair).
    pub(crate) fn note_repaired(&self, blocks: u64) {
        if let Some(s) = &self.sums {
            s.repaired.fetch_add(blocks, Ordering::Relaxed);
        }
    }

    fn sums_for(&self, ext: u32) -> Option<&Sums> {
        self.sums.as_ref().filter(|s| s.covers(ext))
    }

    /// Reads and verifies blocks `[b0, b1)` of `ext` into `data`; the first bad block.
    fn read_blocks(
        &self,
        sums: &Sums,
        ext: u32,
        b0: u64,
        data: &mut [u8],
        from_disk: bool,
    ) -> io::Result<Option<u64>> {
        let b1 = b0 + data.len() as u64 / BLOCK_BYTES;
        self.read_untimed(ext, b0 * BLOCK_BYTES, data)?;
        let mut entries = [0u32; BLOCKS_PER_EXTENT as usize];
        let entries = &mut entries[..(b1 - b0) as usize];
        if from_disk {
            sums.read_entries_disk(self, ext, b0, b1, entries)
        } else {
            sums.read_entries(self, ext, b0, b1, entries)
        }
        .map_err(|e| self.context(sums.layout.entry_pos(ext, b0), e))?;
        Ok(Sums::first_bad(data, entries).map(|i| b0 + i as u64))
    }

    fn mismatch(&self, sums: &Sums, ext: u32, block: u64, blocks: u64) -> io::Error {
        sums.checksum_errors
            .fetch_add(blocks.max(1), Ordering::Relaxed);
        let pos = u64::from(ext) * EXTENT_SIZE_BYTES + block * BLOCK_BYTES;
        tracing::error!(device = %self.label, pos, "checksum mismatch: a block read is not what was written");
        ChecksumMismatch {
            device: self.id,
            pos,
        }
        .into_io()
    }

    fn read_checked(&self, sums: &Sums, ext: u32, off: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(ext, off, buf.len() as u64)?;
        let (b0, b1) = block_span(off, buf.len() as u64);
        let aligned =
            off.is_multiple_of(BLOCK_BYTES) && (buf.len() as u64).is_multiple_of(BLOCK_BYTES);
        let mut tmp = Vec::new();
        let data: &mut [u8] = if aligned {
            buf
        } else {
            tmp.resize(((b1 - b0) * BLOCK_BYTES) as usize, 0);
            &mut tmp
        };
        if self.read_blocks(sums, ext, b0, data, false)?.is_some() {
            // A write may have been between its data and its entries: once more, under its
            // locks, before this counts as corruption.
            let _locked = sums.lock_range(ext, b0, b1);
            if let Some(bad) = self.read_blocks(sums, ext, b0, data, true)? {
                let n = self.count_bad(sums, ext, b0, data);
                return Err(self.mismatch(sums, ext, bad, n));
            }
        }
        if !aligned {
            let start = (off - b0 * BLOCK_BYTES) as usize;
            buf.copy_from_slice(&tmp[start..start + buf.len()]);
        }
        Ok(())
    }

    /// Bad blocks among whole blocks `data` starting at `b0` (entries read again).
    fn count_bad(&self, sums: &Sums, ext: u32, b0: u64, data: &[u8]) -> u64 {
        let b1 = b0 + data.len() as u64 / BLOCK_BYTES;
        let mut entries = [0u32; BLOCKS_PER_EXTENT as usize];
        let entries = &mut entries[..(b1 - b0) as usize];
        if sums.read_entries_disk(self, ext, b0, b1, entries).is_err() {
            return b1 - b0;
        }
        data.chunks_exact(BLOCK_BYTES as usize)
            .zip(entries.iter())
            .filter(|(b, e)| crate::checksum::entry_of(b) != **e)
            .count() as u64
    }

    fn write_checked(&self, sums: &Sums, ext: u32, off: u64, data: &[u8]) -> io::Result<()> {
        self.check(ext, off, data.len() as u64)?;
        let (b0, b1) = block_span(off, data.len() as u64);
        let _locked = sums.lock_range(ext, b0, b1);
        sums.begin_change(self, ext, 1)?;
        let result = self.write_locked(sums, ext, off, data, b0, b1);
        sums.end_change(ext, 1);
        result
    }

    fn write_locked(
        &self,
        sums: &Sums,
        ext: u32,
        off: u64,
        data: &[u8],
        b0: u64,
        b1: u64,
    ) -> io::Result<()> {
        let end = off + data.len() as u64;
        if off.is_multiple_of(BLOCK_BYTES) && end.is_multiple_of(BLOCK_BYTES) {
            self.write_untimed(ext, off, data)?;
            return sums
                .write_entries_of(self, ext, b0, data)
                .map_err(|e| self.context(sums.layout.entry_pos(ext, b0), e));
        }
        // Read-modify-write of the partial end blocks; each must verify first (corruption is
        // never laundered into a fresh checksum).
        let mut whole = vec![0u8; ((b1 - b0) * BLOCK_BYTES) as usize];
        let bs = BLOCK_BYTES as usize;
        let last = (b1 - b0 - 1) as usize;
        let mut partial = Vec::with_capacity(2);
        if !off.is_multiple_of(BLOCK_BYTES) {
            partial.push(0);
        }
        if !end.is_multiple_of(BLOCK_BYTES) && !partial.contains(&last) {
            partial.push(last);
        }
        for i in partial {
            let b = b0 + i as u64;
            if let Some(bad) =
                self.read_blocks(sums, ext, b, &mut whole[i * bs..(i + 1) * bs], true)?
            {
                return Err(self.mismatch(sums, ext, bad, 1));
            }
        }
        let start = (off - b0 * BLOCK_BYTES) as usize;
        whole[start..start + data.len()].copy_from_slice(data);
        self.write_untimed(ext, b0 * BLOCK_BYTES, &whole)?;
        sums.write_entries_of(self, ext, b0, &whole)
            .map_err(|e| self.context(sums.layout.entry_pos(ext, b0), e))
    }

    /// A zeroing (zero-range, punch, clear) of `[off, off + len)` of `ext` with checksums:
    /// whole blocks through `op`, their entries set to 0; partial blocks as a write of zeros
    /// (read-modify-write, verified).
    fn zero_checked(
        &self,
        sums: &Sums,
        ext: u32,
        off: u64,
        len: u64,
        op: &dyn Fn(u64, u64) -> io::Result<()>,
    ) -> io::Result<()> {
        self.check(ext, off, len)?;
        if len == 0 {
            return Ok(());
        }
        let end = off + len;
        let a = off.div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        let b = end / BLOCK_BYTES * BLOCK_BYTES;
        if a >= b {
            return self.write_checked(sums, ext, off, &ZEROES[..len as usize]);
        }
        if off < a {
            self.write_checked(sums, ext, off, &ZEROES[..(a - off) as usize])?;
        }
        {
            let (b0, b1) = (a / BLOCK_BYTES, b / BLOCK_BYTES);
            let _locked = sums.lock_range(ext, b0, b1);
            sums.begin_change(self, ext, 1)?;
            let result = op(a, b - a).and_then(|()| {
                sums.zero_entries(self, ext, b0, b1)
                    .map_err(|e| self.context(sums.layout.entry_pos(ext, b0), e))
            });
            sums.end_change(ext, 1);
            result?;
        }
        if b < end {
            self.write_checked(sums, ext, b, &ZEROES[..(end - b) as usize])?;
        }
        Ok(())
    }

    /// After an unclean start: recomputes, from their data, the entries of the extents whose
    /// write-intent bit is set and `wanted` accepts (the allocated ones). The caller syncs and
    /// then clears the bits (`clear_intent_bits`). Returns the extents recomputed.
    pub(crate) fn recompute_dirty(&self, wanted: &dyn Fn(u32) -> bool) -> io::Result<usize> {
        let Some(sums) = &self.sums else {
            return Ok(0);
        };
        let mut data = vec![0u8; EXTENT_SIZE_BYTES as usize];
        let mut n = 0;
        for ext in sums.dirty_extents() {
            if sums.covers(ext) && wanted(ext) {
                self.read_untimed(ext, 0, &mut data)?;
                sums.write_entries_of(self, ext, 0, &data)?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// Clears every write-intent bit: the caller made data and entries durable and
    /// consistent (startup, after `recompute_dirty` and a sync).
    pub(crate) fn clear_intent_bits(&self) -> io::Result<()> {
        match &self.sums {
            Some(sums) => sums.clear_all(self),
            None => Ok(()),
        }
    }

    /// Zeroes the bitmap and the entries of a device joining the pool (before
    /// `with_checksums`): nothing the space held before may look like a write intent or an
    /// entry.
    pub(crate) fn zero_checksum_region(&self) -> io::Result<()> {
        let layout = Layout::for_extents(self.extent_count);
        self.raw_zero(
            layout.bitmap_offset,
            layout.sums_offset + layout.sums_bytes - layout.bitmap_offset,
        )
    }

    /// A scrub of extent `ext`: reads it below the page cache where it can (file devices:
    /// `posix_fadvise(DONTNEED)` first), verifies every block; the bad blocks, in order.
    /// On a device without checksums it only reads (nothing is bad).
    pub(crate) fn verify_extent(&self, ext: u32, data: &mut [u8]) -> io::Result<Vec<u64>> {
        let Some(sums) = self.sums_for(ext) else {
            self.read(ext, 0, data)?;
            return Ok(Vec::new());
        };
        if let Backend::File(f) = &self.backend {
            let pos = u64::from(ext) * EXTENT_SIZE_BYTES;
            let _ = rustix::fs::fadvise(
                &f.file,
                pos,
                NonZeroU64::new(EXTENT_SIZE_BYTES),
                Advice::DontNeed,
            );
            let epos = sums.layout.entry_pos(ext, 0);
            let _ = rustix::fs::fadvise(
                &f.file,
                epos,
                NonZeroU64::new(BLOCKS_PER_EXTENT * 4),
                Advice::DontNeed,
            );
        }
        let mut bad = Vec::new();
        if self.read_blocks(sums, ext, 0, data, true)?.is_some() {
            let _locked = sums.lock_range(ext, 0, BLOCKS_PER_EXTENT);
            self.read_blocks(sums, ext, 0, data, true)?;
            let mut entries = [0u32; BLOCKS_PER_EXTENT as usize];
            sums.read_entries_disk(self, ext, 0, BLOCKS_PER_EXTENT, &mut entries)?;
            for (i, (b, e)) in data
                .chunks_exact(BLOCK_BYTES as usize)
                .zip(entries.iter())
                .enumerate()
            {
                if crate::checksum::entry_of(b) != *e {
                    bad.push(i as u64);
                }
            }
            sums.checksum_errors
                .fetch_add(bad.len() as u64, Ordering::Relaxed);
        }
        Ok(bad)
    }
}

impl RawIo for Device {
    fn raw_read(&self, pos: u64, buf: &mut [u8]) -> io::Result<()> {
        match &self.backend {
            Backend::File(f) => f.file.read_exact_at(buf, pos),
            Backend::Sim(d) => d.read(pos, buf),
            _ => Err(invalid("no checksums on this backend")),
        }
    }

    fn raw_write(&self, pos: u64, data: &[u8]) -> io::Result<()> {
        self.raw_write_unsynced(pos, data)?;
        self.mark_dirty();
        Ok(())
    }

    fn raw_write_unsynced(&self, pos: u64, data: &[u8]) -> io::Result<()> {
        match &self.backend {
            Backend::File(f) => f.file.write_all_at(data, pos),
            Backend::Sim(d) => d.write(pos, data),
            _ => Err(invalid("no checksums on this backend")),
        }
    }

    fn raw_write_durable(&self, pos: u64, data: &[u8]) -> io::Result<()> {
        match &self.backend {
            Backend::File(f) => f.write_dsync(pos, data),
            Backend::Sim(d) => d.write_durable(pos, data),
            _ => Err(invalid("no checksums on this backend")),
        }
    }

    fn raw_zero(&self, pos: u64, len: u64) -> io::Result<()> {
        match &self.backend {
            Backend::File(f) => f.punch(pos, len)?,
            Backend::Sim(d) => d.zero(pos, len)?,
            _ => return Err(invalid("no checksums on this backend")),
        }
        self.mark_dirty();
        Ok(())
    }
}

impl FileDevice {
    /// Writes `data` at `pos` and makes only that range durable: `pwritev2(RWF_DSYNC)`
    /// (Linux 4.7+), falling back to a write and an `fdatasync` of the whole file.
    fn write_dsync(&self, mut pos: u64, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            match rustix::io::pwritev2(
                &self.file,
                &[io::IoSlice::new(data)],
                pos,
                rustix::io::ReadWriteFlags::DSYNC,
            ) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(n) => {
                    data = &data[n..];
                    pos += n as u64;
                }
                Err(Errno::INTR) => {}
                Err(e) if is_unsupported(e) || e == Errno::NOSYS => {
                    self.file.write_all_at(data, pos)?;
                    return rustix::fs::fdatasync(&self.file).map_err(io::Error::from);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
    fn write_zeroes(&self, mut pos: u64, len: u64) -> io::Result<()> {
        let end = pos + len;
        while pos < end {
            let n = (end - pos).min(ZEROES.len() as u64) as usize;
            self.file.write_all_at(&ZEROES[..n], pos)?;
            pos += n as u64;
        }
        Ok(())
    }

    fn punch(&self, pos: u64, len: u64) -> io::Result<()> {
        if self.punch_supported.load(Ordering::Relaxed) {
            match rustix::fs::fallocate(
                &self.file,
                FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
                pos,
                len,
            ) {
                Ok(()) => return Ok(()),
                Err(e) if is_unsupported(e) => {
                    tracing::warn!(error = %e, "punch-hole unsupported; falling back to writing zeros");
                    self.punch_supported.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.write_zeroes(pos, len)
    }

    fn zero_range(&self, pos: u64, len: u64) -> io::Result<()> {
        if self.zero_range_supported.load(Ordering::Relaxed) {
            match rustix::fs::fallocate(
                &self.file,
                FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE,
                pos,
                len,
            ) {
                Ok(()) => return Ok(()),
                Err(e) if is_unsupported(e) => {
                    tracing::warn!(error = %e, "zero-range unsupported; falling back to writing zeros");
                    self.zero_range_supported.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.write_zeroes(pos, len)
    }

    fn data_runs(&self, start: u64, len: u64, out: &mut dyn FnMut(u64, bool)) {
        let end = start + len;
        if !self.seek_data_supported.load(Ordering::Relaxed) {
            out(len, true);
            return;
        }
        let mut pos = start;
        while pos < end {
            let data = match rustix::fs::seek(&self.file, SeekFrom::Data(pos)) {
                Ok(d) => d,
                Err(Errno::NXIO) => end,
                Err(e) => {
                    tracing::debug!(error = %e, "SEEK_DATA unsupported; reporting data");
                    self.seek_data_supported.store(false, Ordering::Relaxed);
                    out(end - pos, true);
                    return;
                }
            };
            if data > pos {
                out(data.min(end) - pos, false);
            }
            if data >= end {
                return;
            }
            let hole = match rustix::fs::seek(&self.file, SeekFrom::Hole(data)) {
                Ok(h) => h.max(data + 1),
                Err(_) => end,
            };
            out(hole.min(end) - data, true);
            pos = hole;
        }
    }
}

impl MemoryDevice {
    fn slot(&self, ext: u32) -> io::Result<&MemorySlot> {
        self.slots
            .get(ext as usize)
            .ok_or_else(|| invalid("memory extent index"))
    }

    fn zero(&self, ext: u32, off: u64, len: u64, may_free: bool) -> io::Result<()> {
        let mut slot = write(self.slot(ext)?);
        if may_free && off == 0 && len == EXTENT_SIZE_BYTES {
            *slot = None;
            return Ok(());
        }
        if let Some(buf) = slot.as_mut() {
            let start = off as usize;
            buf.get_mut(start..start + len as usize)
                .ok_or_else(|| invalid("memory extent range"))?
                .fill(0);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_on_tmpfs_count_as_memory_and_files_on_disk_do_not() {
        assert!(Device::memory(0, 1).is_memory_resident());
        let shm = tempfile::tempdir_in("/dev/shm").expect("/dev/shm is tmpfs on Linux");
        let (file, _, block) = open_device_file(&shm.path().join("d"), 4 << 20, true).unwrap();
        assert!(Device::from_file(0, "shm".into(), file, block, 2).is_memory_resident());
        // The temporary directory is on a disk filesystem here and on CI; say so if not.
        let disk = tempfile::tempdir().unwrap();
        if on_memory_filesystem(&std::fs::File::open(disk.path()).unwrap()) {
            eprintln!("skipped the disk half: the temporary directory is on tmpfs here");
            return;
        }
        let (file, _, block) = open_device_file(&disk.path().join("d"), 4 << 20, true).unwrap();
        assert!(!Device::from_file(0, "disk".into(), file, block, 2).is_memory_resident());
    }

    #[test]
    fn memory_device_reads_zero_until_written_and_after_punch() {
        let d = Device::memory(0, 2);
        let mut buf = [1u8; 16];
        d.read(1, 100, &mut buf).unwrap();
        assert_eq!(buf, [0u8; 16]);
        d.write(1, 100, &[7u8; 16]).unwrap();
        d.read(1, 100, &mut buf).unwrap();
        assert_eq!(buf, [7u8; 16]);
        d.punch(1, 104, 4).unwrap();
        d.read(1, 100, &mut buf).unwrap();
        assert_eq!(&buf[..4], &[7u8; 4]);
        assert_eq!(&buf[4..8], &[0u8; 4]);
        d.punch_extents(1, 1).unwrap();
        d.read(1, 100, &mut buf).unwrap();
        assert_eq!(buf, [0u8; 16]);
        assert_eq!(d.physical_used_bytes(), Some(0));
        assert!(d.read(2, 0, &mut buf).is_err());
        assert!(d.write(0, EXTENT_SIZE_BYTES - 8, &buf).is_err());
    }

    #[test]
    fn file_device_punch_frees_blocks_and_reads_zero() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.img");
        let (file, cap, is_blk) = open_device_file(&path, 4 * EXTENT_SIZE_BYTES, true).unwrap();
        assert_eq!(cap, 4 * EXTENT_SIZE_BYTES);
        assert!(!is_blk);
        let d = Device::from_file(0, path.display().to_string(), file, false, 4);
        let data = vec![0xabu8; EXTENT_SIZE_BYTES as usize];
        d.write(2, 0, &data).unwrap();
        let used = d.physical_used_bytes().unwrap();
        assert!(used >= EXTENT_SIZE_BYTES, "{used}");
        let mut runs = Vec::new();
        d.data_runs(2, 0, EXTENT_SIZE_BYTES, &mut |l, data| runs.push((l, data)));
        assert_eq!(runs, vec![(EXTENT_SIZE_BYTES, true)]);
        d.punch_extents(2, 1).unwrap();
        assert!(d.physical_used_bytes().unwrap() + EXTENT_SIZE_BYTES <= used);
        let mut buf = vec![1u8; 4096];
        d.read(2, 8192, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        runs.clear();
        d.data_runs(2, 0, EXTENT_SIZE_BYTES, &mut |l, data| runs.push((l, data)));
        assert_eq!(runs, vec![(EXTENT_SIZE_BYTES, false)]);
        d.sync_if_dirty().unwrap();
    }
}
