//! Per-block checksums of a device's data, kept on the device itself, and the write-intent
//! bitmap that keeps them correct across power cuts.
//!
//! Why: a disk may return other bytes than were written (bit rot, a misdirected or lost
//! write, firmware bugs) without reporting an error. Headroom then served them as data. Every
//! 4 KiB block of a checksummed device has a 4-byte CRC32C entry; every read verifies the
//! blocks it touches and never returns a block that fails (a replicated volume reads another
//! copy and rewrites the bad one; a 1-replica volume answers EIO).
//!
//! Layout of a checksummed device (signature format 2, `signature.rs`):
//!
//! ```text
//! [superblock 4 KiB][bitmap: 1 bit per extent, rounded up to 4 KiB][entries: 4 bytes per 4 KiB block]
//! ```
//!
//! rounded up to whole extents (`Layout::reserved_extents`, never allocated). Physical
//! extent N stays at N × 2 MiB; the entry of (extent, block) is at
//! `sums_offset + (extent × 512 + block) × 4`. Overhead: 4 / 4096 ≈ 0.1 %.
//!
//! Entry value: `crc32c(block) XOR crc32c(4096 zero bytes)`, so an all-zero block (never
//! written, punched, zeroed, fresh sparse space) has entry 0: a new device needs no
//! initialisation and punching a range only zeroes its entries, yet a bit flipped in a
//! never-written block is still caught (its CRC is no longer the zero block's).
//!
//! Consistency with concurrent I/O: writers of a block range take striped locks (keyed by
//! extent and group of 64 blocks, in ascending stripe order), write the data, then the
//! entries. Readers take no lock: a reader racing a writer may see new data with an old entry
//! (or the reverse), so a mismatch is retried once under the stripe locks before it counts as
//! corruption. A write smaller than a block reads the enclosing block under the lock,
//! verifies it (corruption is never laundered into a fresh checksum), merges and writes it
//! whole.
//!
//! Power loss (the write-intent bitmap): the page cache writes data and entries back in any
//! order, so after a power cut a block written since the last sync may not match its entry,
//! although no such write was acknowledged durable (any version of it is allowed). Before the
//! first write into an extent whose bit is clear, the bit is set and its 4 KiB bitmap page made
//! durable on its own (`RWF_DSYNC` on files and block devices, a durable write on a simulated
//! disk), then the write proceeds. After an unclean start the entries of every extent whose bit
//! is set are recomputed from its data before anything is served (`recompute_dirty`), the
//! device is synced and the bits cleared. Bits are cleared lazily after a device sync (below);
//! a cleared bit is written without sync, since a lost clear only costs a recompute.
//!
//! When a bit may be cleared: each extent has one atomic word: dirty bit, count of writes in
//! flight, and the device epoch read when its last write *completed*. A sync first bumps the
//! device epoch (`e` → `e + 1`), then syncs. A write that completed while the epoch was `v`
//! finished before the bump that ended `v`; so once the sync that bumped `e` succeeded, every
//! write that completed with epoch `≤ e` is durable. We clear only extents with no write in
//! flight and last completion epoch `< e` (quiet for a whole sync period, so a hot extent is
//! not cleared and re-dirtied at every FLUSH), and not before it has been quiet for
//! [`CLEAR_DELAY`] (5 s, md's bitmap delay): `e` is then the epoch of the last sync that
//! started at least that long ago. Without the delay, 4 KiB writes at random places each
//! followed by a FLUSH found their extent cleared almost every time, and paid a durable
//! bitmap write before the data and the FLUSH's sync after it, two syncs per write; with it
//! an extent written within the last 5 s stays set, and a crash recomputes at most the
//! extents written in the last 5 s before it (and since the last sync).
//!
//! A new extent: its bit is set when the pool allocates it, before the allocation is
//! published, and its bitmap page written *without* a sync (`set_for_new_extent`). Until the
//! allocation is committed the extent is free after a crash (free extents are punched at an
//! unclean start, entries zeroed), so its bit does not matter; and the commit that makes the
//! allocation durable takes the allocation into its batch before it syncs the devices
//! (`Shared::commit`), so the bit is durable before anything maps the extent. A 4 KiB write
//! into a new extent followed by a FLUSH used to make the bit durable on its own
//! (`RWF_DSYNC`, 290 µs of waiting on the VM) and then sync the device anyway.
//!
//! A write takes its in-flight count before it looks at the dirty bit, and the clear is a
//! compare-and-swap that requires the count to be zero, made under the bitmap lock that also
//! serialises setting bits: a write either sees the bit set (and the clear has not happened,
//! so the durable bit is still set), or sees it clear and sets it durably itself before
//! writing.
//!
//! Damage to these structures: a flipped entry makes its block fail verification (repaired
//! from a copy, or EIO; never wrong data). A flipped bitmap bit costs a recompute (set) or, if
//! a bit of an extent written just before a crash is lost, a false checksum error on a block
//! that was torn by the crash (the block was unacknowledged; it is repaired from a copy or
//! answers EIO). The superblock is checked at open (`signature.rs`).
//!
//! Which backends: files and block devices (signed, format 2) and simulated disks. RAM devices
//! do not (their data never leaves RAM), nor RADOS (Ceph checksums every object, BlueStore
//! crc32c). Unsigned devices of older builds have no room reserved: they stay unchecksummed,
//! and say so (`DeviceInfo::checksums`).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use crate::layout::EXTENT_SIZE_BYTES;
use crate::mutants::{self, Mutant};
use crate::sync::{lock, read, write};

/// Bytes covered by one checksum entry.
pub(crate) const BLOCK_BYTES: u64 = 4096;
/// Blocks of one extent.
pub(crate) const BLOCKS_PER_EXTENT: u64 = EXTENT_SIZE_BYTES / BLOCK_BYTES;
/// Bytes of one entry.
const ENTRY_BYTES: u64 = 4;
/// Bytes of the superblock at the start of the device.
const SUPERBLOCK_BYTES: u64 = 4096;
/// Bytes of one bitmap page (the unit made durable).
const BITMAP_PAGE_BYTES: u64 = 4096;
/// Blocks per stripe lock group.
const BLOCKS_PER_STRIPE: u64 = 64;
/// Stripe locks per device.
const STRIPES: usize = 256;
/// Entries of one 4 KiB page of the entry region: those of 2 extents.
const ENTRIES_PER_PAGE: u64 = BLOCK_BYTES / ENTRY_BYTES;
/// Entry pages a device keeps in RAM (`EntryCache`): 16 MiB, the entries of 16 GiB of data.
const CACHED_PAGES: usize = 4096;

const DIRTY: u64 = 1 << 63;
const IN_FLIGHT_ONE: u64 = 1 << 48;
const IN_FLIGHT_MASK: u64 = ((1 << 15) - 1) << 48;
const EPOCH_MASK: u64 = (1 << 48) - 1;

static ZERO_BLOCK_CRC: LazyLock<u32> =
    LazyLock::new(|| crc32c::crc32c(&[0u8; BLOCK_BYTES as usize]));

/// The entry of one 4 KiB block: 0 for a block of zeros.
pub(crate) fn entry_of(block: &[u8]) -> u32 {
    crc32c::crc32c(block) ^ *ZERO_BLOCK_CRC
}

/// Where a checksummed device keeps its bitmap and entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub bitmap_offset: u64,
    pub bitmap_bytes: u64,
    pub sums_offset: u64,
    pub sums_bytes: u64,
    /// Whole extents holding superblock, bitmap and entries (never allocated).
    pub reserved_extents: u32,
}

impl Layout {
    /// The layout of a device of `extent_count` extents (the reserved ones included: they
    /// have entries too, unused, which keeps the arithmetic plain).
    pub(crate) fn for_extents(extent_count: u32) -> Layout {
        let n = u64::from(extent_count);
        let bitmap_bytes = n.div_ceil(8).div_ceil(BITMAP_PAGE_BYTES).max(1) * BITMAP_PAGE_BYTES;
        let sums_bytes = (n * BLOCKS_PER_EXTENT * ENTRY_BYTES).div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        let bitmap_offset = SUPERBLOCK_BYTES;
        let sums_offset = bitmap_offset + bitmap_bytes;
        let end = sums_offset + sums_bytes;
        Layout {
            bitmap_offset,
            bitmap_bytes,
            sums_offset,
            sums_bytes,
            reserved_extents: end.div_ceil(EXTENT_SIZE_BYTES) as u32,
        }
    }

    /// Byte position of the entry of `block` of extent `ext`.
    pub(crate) fn entry_pos(&self, ext: u32, block: u64) -> u64 {
        self.sums_offset + (u64::from(ext) * BLOCKS_PER_EXTENT + block) * ENTRY_BYTES
    }
}

/// The raw positional I/O the checksum code needs from a backend (no range checks, no fault
/// injection: these are Headroom's own structures).
pub(crate) trait RawIo {
    fn raw_read(&self, pos: u64, buf: &mut [u8]) -> io::Result<()>;
    fn raw_write(&self, pos: u64, data: &[u8]) -> io::Result<()>;
    /// Writes `data` without asking for a sync: the next FLUSH does not sync the device for
    /// it (the page cache writes it back in time). Only for writes whose loss costs a
    /// recompute, never data: the clearing of write-intent bits.
    fn raw_write_unsynced(&self, pos: u64, data: &[u8]) -> io::Result<()>;
    /// Writes `data` and makes that range (only) durable before returning.
    fn raw_write_durable(&self, pos: u64, data: &[u8]) -> io::Result<()>;
    /// Zeroes `[pos, pos + len)` (reads zeros afterwards).
    fn raw_zero(&self, pos: u64, len: u64) -> io::Result<()>;
}

/// A block that fails verification: the error inside the `io::Error` (kind `InvalidData`)
/// a checksummed device's read returns.
#[derive(Debug, thiserror::Error)]
#[error(
    "checksum mismatch on device {device} at byte {pos}: the data read is not what was written"
)]
pub(crate) struct ChecksumMismatch {
    pub device: u32,
    /// Byte position on the device of the first bad block.
    pub pos: u64,
}

impl ChecksumMismatch {
    pub(crate) fn into_io(self) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, self)
    }
}

/// The mismatch inside `e`, if it is one.
pub(crate) fn mismatch_of(e: &io::Error) -> Option<&ChecksumMismatch> {
    e.get_ref()
        .and_then(|r| r.downcast_ref::<ChecksumMismatch>())
}

/// How long an extent goes without a write before a sync may clear its write-intent bit.
pub(crate) const CLEAR_DELAY: Duration = Duration::from_secs(5);

/// Checksum state of one device.
#[derive(Debug)]
pub(crate) struct Sums {
    pub layout: Layout,
    extent_count: u32,
    /// Per extent: `DIRTY`, writes in flight, epoch of its last completed write.
    words: Box<[AtomicU64]>,
    epoch: AtomicU64,
    /// When each recent sync started, `(epoch it ended, when)`, oldest first: the newest
    /// entry at least `clear_delay` old, and every newer one.
    syncs: Mutex<VecDeque<(u64, Instant)>>,
    clear_delay: Duration,
    bitmap: Mutex<Bitmap>,
    stripes: Box<[Mutex<()>]>,
    cache: EntryCache,
    /// Blocks that failed verification (after the locked retry).
    pub checksum_errors: AtomicU64,
    /// Blocks rewritten from a good copy.
    pub repaired: AtomicU64,
}

#[derive(Debug)]
struct Bitmap {
    image: Vec<u8>,
    /// Extents whose bit is set (what a clear looks at).
    dirty: Vec<u32>,
}

/// Held stripe locks of one range (one stripe, the usual case, takes no allocation).
#[allow(dead_code)] // held for their drop
pub(crate) enum RangeGuard<'a> {
    One(MutexGuard<'a, ()>),
    Many(Vec<MutexGuard<'a, ()>>),
}

/// A bounded read cache of entry pages (write-through: the device's entry region stays
/// authoritative). Why: reading a 4-byte entry from the device costs a system call per read,
/// as much CPU as the data read on a RAM-backed file. A page read from the device may be stale
/// by the time it is inserted (a writer updated the device meanwhile); a stale entry can only
/// cause a mismatch, and a mismatch is always retried from the device under the stripe locks,
/// which refreshes the cached entries. A damaged entry on the device is therefore found when
/// its page is next loaded (eviction, restart) or by a scrub, which reads the device.
#[derive(Debug)]
struct EntryCache {
    pages: RwLock<HashMap<u64, Arc<[AtomicU32]>>>,
}

impl EntryCache {
    fn get(&self, page: u64) -> Option<Arc<[AtomicU32]>> {
        read(&self.pages).get(&page).cloned()
    }

    fn insert(&self, page: u64, entries: Arc<[AtomicU32]>) {
        let mut pages = write(&self.pages);
        if pages.len() >= CACHED_PAGES && !pages.contains_key(&page) {
            // Any page: the cache only saves system calls, it never decides anything.
            if let Some(&victim) = pages.keys().next() {
                pages.remove(&victim);
            }
        }
        pages.entry(page).or_insert(entries);
    }
}

impl Sums {
    /// State for a device of `extent_count` extents with `layout`; `bitmap` is the bitmap
    /// region as read from the device (or zeros).
    pub(crate) fn new(layout: Layout, extent_count: u32, bitmap: Vec<u8>) -> Sums {
        let mut dirty = Vec::new();
        let words: Box<[AtomicU64]> = (0..extent_count)
            .map(|e| {
                let set = bitmap
                    .get(e as usize / 8)
                    .is_some_and(|b| b & (1 << (e % 8)) != 0);
                if set {
                    dirty.push(e);
                }
                AtomicU64::new(if set { DIRTY } else { 0 })
            })
            .collect();
        let mut image = bitmap;
        image.resize(layout.bitmap_bytes as usize, 0);
        Sums {
            layout,
            extent_count,
            words,
            epoch: AtomicU64::new(1),
            syncs: Mutex::new(VecDeque::new()),
            clear_delay: CLEAR_DELAY,
            bitmap: Mutex::new(Bitmap { image, dirty }),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            cache: EntryCache {
                pages: RwLock::new(HashMap::new()),
            },
            checksum_errors: AtomicU64::new(0),
            repaired: AtomicU64::new(0),
        }
    }

    /// Whether `ext` holds volume data (not the reserved prefix): only those are checked.
    pub(crate) fn covers(&self, ext: u32) -> bool {
        ext >= self.layout.reserved_extents && ext < self.extent_count
    }

    /// Extents whose bit is set now.
    pub(crate) fn dirty_extents(&self) -> Vec<u32> {
        let mut d = lock(&self.bitmap).dirty.clone();
        d.sort_unstable();
        d
    }

    /// Locks the stripes of blocks `[b0, b1)` of extent `ext`, in ascending stripe order.
    pub(crate) fn lock_range(&self, ext: u32, b0: u64, b1: u64) -> RangeGuard<'_> {
        let stripe = |g: u64| {
            ((u64::from(ext) * (BLOCKS_PER_EXTENT / BLOCKS_PER_STRIPE) + g) as usize) % STRIPES
        };
        let (g0, g1) = (b0 / BLOCKS_PER_STRIPE, b1.div_ceil(BLOCKS_PER_STRIPE));
        if g1 <= g0 + 1 {
            return RangeGuard::One(lock(&self.stripes[stripe(g0)]));
        }
        let mut idx: Vec<usize> = (g0..g1).map(stripe).collect();
        idx.sort_unstable();
        idx.dedup();
        RangeGuard::Many(idx.into_iter().map(|i| lock(&self.stripes[i])).collect())
    }

    /// Before data of extents `[first, first + count)` changes: counts the change in flight
    /// and, for an extent whose bit is clear, sets it durably first. Pair with `end_change`.
    pub(crate) fn begin_change(&self, raw: &dyn RawIo, first: u32, count: u32) -> io::Result<()> {
        let mut clear = Vec::new();
        for e in first..first + count {
            let prev = self.words[e as usize].fetch_add(IN_FLIGHT_ONE, Ordering::SeqCst);
            if prev & DIRTY == 0 {
                clear.push(e);
            }
        }
        if clear.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.set_bits(raw, &clear) {
            self.end_change(first, count);
            return Err(e);
        }
        Ok(())
    }

    /// After the change `begin_change` announced completed (or failed).
    pub(crate) fn end_change(&self, first: u32, count: u32) {
        for e in first..first + count {
            let word = &self.words[e as usize];
            let mut w = word.load(Ordering::SeqCst);
            loop {
                let epoch = self.epoch.load(Ordering::SeqCst) & EPOCH_MASK;
                let next = ((w - IN_FLIGHT_ONE) & !EPOCH_MASK) | epoch;
                match word.compare_exchange(w, next, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(_) => break,
                    Err(now) => w = now,
                }
            }
        }
    }

    fn set_bits(&self, raw: &dyn RawIo, exts: &[u32]) -> io::Result<()> {
        let mut bm = lock(&self.bitmap);
        let mut pages: Option<(u64, u64)> = None;
        let mut newly = Vec::new();
        for &e in exts {
            let prev = self.words[e as usize].fetch_or(DIRTY, Ordering::SeqCst);
            if prev & DIRTY != 0 {
                continue;
            }
            newly.push(e);
            bm.image[e as usize / 8] |= 1 << (e % 8);
            bm.dirty.push(e);
            let page = (u64::from(e) / 8) / BITMAP_PAGE_BYTES;
            pages = Some(pages.map_or((page, page), |(a, b)| (a.min(page), b.max(page))));
        }
        let Some((p0, p1)) = pages else {
            return Ok(());
        };
        if mutants::active(Mutant::SkipBitmapWrite) {
            return Ok(());
        }
        let start = (p0 * BITMAP_PAGE_BYTES) as usize;
        let end = ((p1 + 1) * BITMAP_PAGE_BYTES) as usize;
        let result = raw.raw_write_durable(
            self.layout.bitmap_offset + start as u64,
            &bm.image[start..end],
        );
        if result.is_err() {
            // Not durable: the next write must try again.
            for &e in &newly {
                self.words[e as usize].fetch_and(!DIRTY, Ordering::SeqCst);
                bm.image[e as usize / 8] &= !(1 << (e % 8));
            }
            bm.dirty.retain(|d| !newly.contains(d));
        }
        result
    }

    /// Sets the bit of extent `ext`, which the pool is allocating and has not published yet,
    /// writing its bitmap page *without* a sync of its own (module comment, "A new
    /// extent"): the commit that makes the allocation durable syncs the device after the
    /// allocation is in its batch, so the bit is durable before anything maps the extent,
    /// and until then the extent is free after a crash (punched, entries zeroed). The word's
    /// epoch is set to the current one, as if a write completed now, so no sync clears the
    /// bit before the extent's first write has had the clear delay to come. Returns whether
    /// the bit is set (`false` after a failed write: the first write then sets it durably).
    pub(crate) fn set_for_new_extent(&self, raw: &dyn RawIo, ext: u32) -> bool {
        let mut bm = lock(&self.bitmap);
        let word = &self.words[ext as usize];
        let mut w = word.load(Ordering::SeqCst);
        loop {
            if w & DIRTY != 0 {
                return true; // set already (never cleared since an earlier life): durable
            }
            let epoch = self.epoch.load(Ordering::SeqCst) & EPOCH_MASK;
            let next = (w & !EPOCH_MASK) | epoch | DIRTY;
            match word.compare_exchange(w, next, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => break,
                Err(now) => w = now,
            }
        }
        bm.image[ext as usize / 8] |= 1 << (ext % 8);
        bm.dirty.push(ext);
        if mutants::active(Mutant::SkipBitmapWrite) {
            return true;
        }
        let page = (u64::from(ext) / 8) / BITMAP_PAGE_BYTES;
        let start = (page * BITMAP_PAGE_BYTES) as usize;
        let end = start + BITMAP_PAGE_BYTES as usize;
        // `raw_write`: the device is dirty, so the commit's sync covers this page.
        match raw.raw_write(
            self.layout.bitmap_offset + start as u64,
            &bm.image[start..end],
        ) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(extent = ext, error = %e, "writing the write-intent bit of a new extent failed; its first write sets it durably");
                word.fetch_and(!DIRTY, Ordering::SeqCst);
                bm.image[ext as usize / 8] &= !(1 << (ext % 8));
                bm.dirty.retain(|&d| d != ext);
                false
            }
        }
    }

    /// The same state with another clear delay (tests: 0 clears after one quiet period).
    #[cfg(test)]
    pub(crate) fn with_clear_delay(mut self, delay: Duration) -> Sums {
        self.clear_delay = delay;
        self
    }

    /// Before a device sync starts: the epoch to pass to `after_sync` once it succeeded.
    pub(crate) fn before_sync(&self) -> u64 {
        let mut syncs = lock(&self.syncs);
        let epoch = self.epoch.fetch_add(1, Ordering::SeqCst);
        let now = Instant::now();
        syncs.push_back((epoch, now));
        while syncs.len() >= 2 && now.duration_since(syncs[1].1) >= self.clear_delay {
            syncs.pop_front();
        }
        epoch
    }

    /// After the sync that `before_sync` returned `epoch` for succeeded: clears the bits of
    /// the extents quiet since before the previous sync that started at least the clear
    /// delay ago, and before this one (module comment), writing the bitmap pages without
    /// sync. Returns the extents cleared.
    pub(crate) fn after_sync(&self, raw: &dyn RawIo, epoch: u64) -> usize {
        // `before_sync` keeps the newest sync at least the delay old at the front (one that
        // has come of age since is left for a later sync: that only clears later).
        let threshold = lock(&self.syncs)
            .front()
            .filter(|(_, started)| started.elapsed() >= self.clear_delay)
            .map(|&(e, _)| e.min(epoch));
        let Some(epoch) = threshold else {
            return 0;
        };
        let mut bm = lock(&self.bitmap);
        if bm.dirty.is_empty() {
            return 0;
        }
        let mut pages: Option<(u64, u64)> = None;
        let mut cleared = 0;
        let dirty = std::mem::take(&mut bm.dirty);
        let mut kept = Vec::with_capacity(dirty.len());
        for e in dirty {
            let word = &self.words[e as usize];
            let w = word.load(Ordering::SeqCst);
            let quiet = w & DIRTY != 0 && w & IN_FLIGHT_MASK == 0 && (w & EPOCH_MASK) < epoch;
            if quiet
                && word
                    .compare_exchange(w, w & !DIRTY, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                bm.image[e as usize / 8] &= !(1 << (e % 8));
                let page = (u64::from(e) / 8) / BITMAP_PAGE_BYTES;
                pages = Some(pages.map_or((page, page), |(a, b)| (a.min(page), b.max(page))));
                cleared += 1;
            } else {
                kept.push(e);
            }
        }
        bm.dirty = kept;
        if let Some((p0, p1)) = pages {
            let start = (p0 * BITMAP_PAGE_BYTES) as usize;
            let end = ((p1 + 1) * BITMAP_PAGE_BYTES) as usize;
            // A lost clear only costs a recompute after a crash: no sync for it (a FLUSH
            // syncing the device again only for this write doubled the syncs of a loop of
            // 4 KiB writes and FLUSHes).
            if let Err(e) = raw.raw_write_unsynced(
                self.layout.bitmap_offset + start as u64,
                &bm.image[start..end],
            ) {
                tracing::debug!(error = %e, "writing cleared write-intent bits failed");
            }
        }
        cleared
    }

    /// Clears every bit (after `recompute_dirty` and a sync at startup), without sync.
    pub(crate) fn clear_all(&self, raw: &dyn RawIo) -> io::Result<()> {
        let mut bm = lock(&self.bitmap);
        for e in std::mem::take(&mut bm.dirty) {
            self.words[e as usize].fetch_and(!DIRTY, Ordering::SeqCst);
        }
        bm.image.fill(0);
        raw.raw_write_unsynced(self.layout.bitmap_offset, &bm.image)
    }

    /// The entries of blocks `[b0, b1)` of `ext` into `out`, from the cache (loading the page
    /// from the device on a miss). May be stale: verify a mismatch with `read_entries_disk`.
    pub(crate) fn read_entries(
        &self,
        raw: &dyn RawIo,
        ext: u32,
        b0: u64,
        b1: u64,
        out: &mut [u32],
    ) -> io::Result<()> {
        let (page, base) = self.page_of(ext);
        let entries = match self.cache.get(page) {
            Some(p) => p,
            None => {
                let mut bytes = vec![0u8; BLOCK_BYTES as usize];
                raw.raw_read(self.layout.sums_offset + page * BLOCK_BYTES, &mut bytes)?;
                let p: Arc<[AtomicU32]> = bytes
                    .chunks_exact(4)
                    .map(|c| AtomicU32::new(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                    .collect();
                self.cache.insert(page, Arc::clone(&p));
                p
            }
        };
        for (i, o) in out.iter_mut().enumerate().take((b1 - b0) as usize) {
            *o = entries[(base + b0) as usize + i].load(Ordering::Acquire);
        }
        Ok(())
    }

    /// The cache page holding extent `ext`'s entries and the index of its first entry there.
    fn page_of(&self, ext: u32) -> (u64, u64) {
        let first = u64::from(ext) * BLOCKS_PER_EXTENT;
        (first / ENTRIES_PER_PAGE, first % ENTRIES_PER_PAGE)
    }

    /// Stores `entries` (of blocks from `b0` of `ext`) into the cached page, if cached.
    fn cache_store(&self, ext: u32, b0: u64, entries: impl Iterator<Item = u32>) {
        let (page, base) = self.page_of(ext);
        if let Some(p) = self.cache.get(page) {
            for (i, e) in entries.enumerate() {
                p[(base + b0) as usize + i].store(e, Ordering::Release);
            }
        }
    }

    /// Reads the entries of blocks `[b0, b1)` of `ext` from the device into `out` and
    /// refreshes the cached ones. Call under the range's stripe locks.
    pub(crate) fn read_entries_disk(
        &self,
        raw: &dyn RawIo,
        ext: u32,
        b0: u64,
        b1: u64,
        out: &mut [u32],
    ) -> io::Result<()> {
        let n = (b1 - b0) as usize;
        let mut bytes = [0u8; (BLOCKS_PER_EXTENT * ENTRY_BYTES) as usize];
        let bytes = &mut bytes[..n * ENTRY_BYTES as usize];
        raw.raw_read(self.layout.entry_pos(ext, b0), bytes)?;
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        self.cache_store(ext, b0, out.iter().copied().take(n));
        Ok(())
    }

    /// Writes the entries of the whole blocks `data` (starting at block `b0` of `ext`): to
    /// the device, then to the cache.
    pub(crate) fn write_entries_of(
        &self,
        raw: &dyn RawIo,
        ext: u32,
        b0: u64,
        data: &[u8],
    ) -> io::Result<()> {
        let mut entries = [0u32; BLOCKS_PER_EXTENT as usize];
        let mut bytes = [0u8; (BLOCKS_PER_EXTENT * ENTRY_BYTES) as usize];
        let n = data.len() / BLOCK_BYTES as usize;
        for ((o, e), block) in bytes
            .chunks_exact_mut(4)
            .zip(entries.iter_mut())
            .zip(data.chunks_exact(BLOCK_BYTES as usize))
        {
            *e = entry_of(block);
            o.copy_from_slice(&e.to_le_bytes());
        }
        raw.raw_write(
            self.layout.entry_pos(ext, b0),
            &bytes[..n * ENTRY_BYTES as usize],
        )?;
        self.cache_store(ext, b0, entries[..n].iter().copied());
        Ok(())
    }

    /// Zeroes the entries of blocks `[b0, b1)` of `ext` (a range now reading zeros).
    pub(crate) fn zero_entries(
        &self,
        raw: &dyn RawIo,
        ext: u32,
        b0: u64,
        b1: u64,
    ) -> io::Result<()> {
        let pos = self.layout.entry_pos(ext, b0);
        raw.raw_zero(pos, (b1 - b0) * ENTRY_BYTES)?;
        self.cache_store(ext, b0, std::iter::repeat_n(0, (b1 - b0) as usize));
        Ok(())
    }

    /// Zeroes the entries of whole extents `[first, first + count)`.
    pub(crate) fn zero_extent_entries(
        &self,
        raw: &dyn RawIo,
        first: u32,
        count: u32,
    ) -> io::Result<()> {
        let pos = self.layout.entry_pos(first, 0);
        raw.raw_zero(pos, u64::from(count) * BLOCKS_PER_EXTENT * ENTRY_BYTES)?;
        // A startup punch covers the whole free space: only cached pages are touched.
        if read(&self.cache.pages).is_empty() {
            return Ok(());
        }
        for ext in first..first + count {
            self.cache_store(ext, 0, std::iter::repeat_n(0, BLOCKS_PER_EXTENT as usize));
        }
        Ok(())
    }

    /// Index of the first block of `data` (whole blocks, starting at block `b0`) whose entry
    /// in `entries` does not match.
    pub(crate) fn first_bad(data: &[u8], entries: &[u32]) -> Option<usize> {
        data.chunks_exact(BLOCK_BYTES as usize)
            .zip(entries)
            .position(|(block, &entry)| entry_of(block) != entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn layout_fits_and_grows_with_the_device() {
        let small = Layout::for_extents(8);
        assert_eq!(small.bitmap_offset, 4096);
        assert_eq!(small.bitmap_bytes, 4096);
        assert_eq!(small.sums_offset, 8192);
        assert_eq!(small.sums_bytes, 16384);
        assert_eq!(small.reserved_extents, 1);
        // 1 TiB: 512 Ki extents, 64 KiB of bitmap, 1 GiB of entries -> 513 extents reserved.
        let big = Layout::for_extents(512 * 1024);
        assert_eq!(big.bitmap_bytes, 64 * 1024);
        assert_eq!(big.sums_bytes, 1 << 30);
        assert_eq!(big.reserved_extents, 513);
        // Entries of the last block of the last extent are inside the reserved prefix.
        let last = big.entry_pos(512 * 1024 - 1, BLOCKS_PER_EXTENT - 1);
        assert!(last + 4 <= u64::from(big.reserved_extents) * EXTENT_SIZE_BYTES);
        assert_eq!(big.entry_pos(1, 0), big.sums_offset + 512 * 4);
        // The largest device that fits in one reserved extent.
        let edge = Layout::for_extents(1019);
        assert_eq!(edge.reserved_extents, 1);
        assert_eq!(Layout::for_extents(1021).reserved_extents, 2);
    }

    #[test]
    fn zero_blocks_have_entry_zero_and_one_bit_changes_it() {
        let zero = [0u8; BLOCK_BYTES as usize];
        assert_eq!(entry_of(&zero), 0);
        let mut one = zero;
        one[1234] = 0x10;
        assert_ne!(entry_of(&one), 0);
        assert_eq!(Sums::first_bad(&one, &[0]), Some(0));
        assert_eq!(Sums::first_bad(&one, &[entry_of(&one)]), None);
    }

    /// A recording backend for the bitmap protocol.
    #[derive(Default)]
    struct Rec {
        durable: AtomicUsize,
        lazy: AtomicUsize,
        unsynced: AtomicUsize,
        last_page: Mutex<Vec<u8>>,
    }
    impl RawIo for Rec {
        fn raw_read(&self, _: u64, buf: &mut [u8]) -> io::Result<()> {
            buf.fill(0);
            Ok(())
        }
        fn raw_write(&self, _: u64, data: &[u8]) -> io::Result<()> {
            self.lazy.fetch_add(1, Ordering::SeqCst);
            *lock(&self.last_page) = data.to_vec();
            Ok(())
        }
        fn raw_write_unsynced(&self, _: u64, data: &[u8]) -> io::Result<()> {
            self.unsynced.fetch_add(1, Ordering::SeqCst);
            *lock(&self.last_page) = data.to_vec();
            Ok(())
        }
        fn raw_write_durable(&self, _: u64, data: &[u8]) -> io::Result<()> {
            self.durable.fetch_add(1, Ordering::SeqCst);
            *lock(&self.last_page) = data.to_vec();
            Ok(())
        }
        fn raw_zero(&self, _: u64, _: u64) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn bitmap_bits_are_set_durably_once_and_cleared_only_after_a_quiet_sync_period() {
        let raw = Rec::default();
        let s =
            Sums::new(Layout::for_extents(16), 16, vec![0; 4096]).with_clear_delay(Duration::ZERO);
        s.begin_change(&raw, 3, 1).unwrap();
        assert_eq!(raw.durable.load(Ordering::SeqCst), 1);
        assert_eq!(lock(&raw.last_page)[0], 1 << 3);
        // A second writer of the same extent, concurrent or later: no second durable write.
        s.begin_change(&raw, 3, 1).unwrap();
        assert_eq!(raw.durable.load(Ordering::SeqCst), 1);
        s.end_change(3, 1);
        // One write still in flight: a sync clears nothing.
        let e = s.before_sync();
        assert_eq!(s.after_sync(&raw, e), 0);
        s.end_change(3, 1);
        // Completed during the period of the sync just done: not quiet for a whole period.
        let e = s.before_sync();
        assert_eq!(s.after_sync(&raw, e), 0);
        assert_eq!(s.dirty_extents(), vec![3]);
        // Quiet since before the previous sync started: cleared, written without a sync (and
        // without asking the next FLUSH for one).
        let lazy = raw.lazy.load(Ordering::SeqCst);
        let e = s.before_sync();
        assert_eq!(s.after_sync(&raw, e), 1);
        assert_eq!(lock(&raw.last_page)[0], 0);
        assert_eq!(raw.unsynced.load(Ordering::SeqCst), 1);
        assert_eq!(raw.lazy.load(Ordering::SeqCst), lazy);
        assert!(s.dirty_extents().is_empty());
        // The next write sets it durably again.
        s.begin_change(&raw, 3, 1).unwrap();
        assert_eq!(raw.durable.load(Ordering::SeqCst), 2);
        s.end_change(3, 1);
    }

    #[test]
    fn a_new_extents_bit_is_written_for_the_commits_sync_and_its_writes_add_no_durable_write() {
        let raw = Rec::default();
        let s =
            Sums::new(Layout::for_extents(16), 16, vec![0; 4096]).with_clear_delay(Duration::ZERO);
        // Some syncs before the allocation: an old epoch must not make the new bit look quiet.
        for _ in 0..3 {
            let e = s.before_sync();
            s.after_sync(&raw, e);
        }
        assert!(s.set_for_new_extent(&raw, 6));
        // Written with a write that leaves the device to sync (`raw_write`), not on its own.
        assert_eq!(raw.durable.load(Ordering::SeqCst), 0);
        assert_eq!(raw.lazy.load(Ordering::SeqCst), 1);
        assert_eq!(lock(&raw.last_page)[0], 1 << 6);
        assert_eq!(s.dirty_extents(), vec![6]);
        // The first write into it (and the next) finds the bit set: no durable bitmap write.
        s.begin_change(&raw, 6, 1).unwrap();
        s.end_change(6, 1);
        s.begin_change(&raw, 6, 1).unwrap();
        s.end_change(6, 1);
        assert_eq!(raw.durable.load(Ordering::SeqCst), 0);
        assert_eq!(raw.lazy.load(Ordering::SeqCst), 1);
        // The bit follows the quiet rule from its last write, as any other.
        let e = s.before_sync();
        assert_eq!(s.after_sync(&raw, e), 0);
        let e = s.before_sync();
        assert_eq!(s.after_sync(&raw, e), 1);
    }

    #[test]
    fn a_new_extents_bit_is_not_cleared_before_its_first_write() {
        let raw = Rec::default();
        let s =
            Sums::new(Layout::for_extents(16), 16, vec![0; 4096]).with_clear_delay(Duration::ZERO);
        for _ in 0..3 {
            let e = s.before_sync();
            s.after_sync(&raw, e);
        }
        assert!(s.set_for_new_extent(&raw, 2));
        // The commit's sync, which makes the bit durable, must not clear it: the extent's
        // first write may come right after the commit, and then needs no bitmap write.
        let e = s.before_sync();
        assert_eq!(s.after_sync(&raw, e), 0);
        assert_eq!(s.dirty_extents(), vec![2]);
        s.begin_change(&raw, 2, 1).unwrap();
        s.end_change(2, 1);
        assert_eq!(raw.durable.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_write_completing_after_the_sync_started_keeps_its_bit() {
        let raw = Rec::default();
        let s =
            Sums::new(Layout::for_extents(16), 16, vec![0; 4096]).with_clear_delay(Duration::ZERO);
        s.begin_change(&raw, 5, 1).unwrap();
        let e1 = s.before_sync();
        s.end_change(5, 1); // completes while sync 1 runs: maybe not covered by it
        assert_eq!(s.after_sync(&raw, e1), 0);
        let e2 = s.before_sync();
        // Completed with epoch e1 + 1 = e2: covered by sync 2 but not quiet for a period.
        assert_eq!(s.after_sync(&raw, e2), 0);
        let e3 = s.before_sync();
        assert_eq!(s.after_sync(&raw, e3), 1);
    }

    #[test]
    fn a_bit_stays_set_until_its_extent_is_quiet_for_the_clear_delay() {
        let raw = Rec::default();
        let s = Sums::new(Layout::for_extents(16), 16, vec![0; 4096])
            .with_clear_delay(Duration::from_secs(3600));
        s.begin_change(&raw, 3, 1).unwrap();
        s.end_change(3, 1);
        // Quiet for many sync periods, but not for an hour: kept, and nothing written.
        for _ in 0..100 {
            let e = s.before_sync();
            assert_eq!(s.after_sync(&raw, e), 0);
        }
        assert_eq!(s.dirty_extents(), vec![3]);
        assert_eq!(raw.unsynced.load(Ordering::SeqCst), 0);
        // The next write finds it set: no durable bitmap write (the one that set it only).
        s.begin_change(&raw, 3, 1).unwrap();
        s.end_change(3, 1);
        assert_eq!(raw.durable.load(Ordering::SeqCst), 1);
        // The history of syncs stays bounded (the newest one older than the delay, and the
        // newer ones: here all 100, none is an hour old).
        assert_eq!(lock(&s.syncs).len(), 100);
        let zero =
            Sums::new(Layout::for_extents(16), 16, vec![0; 4096]).with_clear_delay(Duration::ZERO);
        for _ in 0..100 {
            zero.before_sync();
        }
        assert_eq!(lock(&zero.syncs).len(), 1);
    }

    #[test]
    fn bits_found_set_at_open_are_dirty_until_cleared() {
        let raw = Rec::default();
        let mut bm = vec![0u8; 4096];
        bm[1] = 0b10; // extent 9
        let s = Sums::new(Layout::for_extents(16), 16, bm);
        assert_eq!(s.dirty_extents(), vec![9]);
        // Set already: a write needs no durable bitmap write.
        s.begin_change(&raw, 9, 1).unwrap();
        assert_eq!(raw.durable.load(Ordering::SeqCst), 0);
        s.end_change(9, 1);
        s.clear_all(&raw).unwrap();
        assert!(s.dirty_extents().is_empty());
        assert!(lock(&raw.last_page).iter().all(|&b| b == 0));
    }

    #[test]
    fn stripe_locks_of_overlapping_ranges_do_not_deadlock() {
        let s = std::sync::Arc::new(Sums::new(Layout::for_extents(64), 64, vec![0; 4096]));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let s = std::sync::Arc::clone(&s);
                std::thread::spawn(move || {
                    for i in 0..2000u64 {
                        let ext = ((i * 7 + t) % 64) as u32;
                        let b0 = (i * 13 + t * 100) % 512;
                        let _g = s.lock_range(ext, b0, (b0 + 300).min(512));
                        let _ = ext;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}
