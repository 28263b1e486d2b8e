//! A simulated disk that can lose power: the model the power-cut test runs the real store on.
//!
//! Why: the crash test kills the process, which keeps the page cache, so a store that never
//! synced would pass it. Here every disk of a simulated pool (the data devices and the redb
//! file) keeps what was written but not yet synced as *volatile*: reads see it, but only a
//! sync makes it durable. One `Power` object counts the operations of all disks of a pool; at
//! the configured cut point it goes off, and that operation and every later one (syncs
//! included) fail with EIO, so nothing more becomes durable. `SimPool::resolve_cut` then
//! decides, with a seed, what the disks' caches had written back when the power failed: for
//! every unsynced operation of every disk keep it, drop it, or tear it (keep a random subset
//! of its 512-byte or 4 KiB sectors), and apply what is kept onto the durable image in a
//! random order, so overlapping unsynced writes may land in either order. That is the
//! contract of a disk whose flush works (POSIX `fdatasync`, NVMe FLUSH): nothing about
//! unsynced data, everything about synced data. No clock, no threads: the same seed gives
//! the same outcome.
//!
//! Images are sparse (4 KiB pages in a map, absent pages read as zeros), so a 64 MiB disk
//! costs only what was written to it.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::sync::{Arc, Mutex};

use crate::sync::lock;

/// Page of the sparse images.
const PAGE_BYTES: u64 = 4096;
/// The smaller tear granularity (a disk sector); the larger one is a page.
const SECTOR_BYTES: u64 = 512;

/// splitmix64: the seeded generator of the cut's decisions.
#[derive(Debug, Clone)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0; 0 gives 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }
}

/// The power of one simulated pool: counts the mutating operations (write, zero, set_len,
/// sync) of all its disks and goes off at the cut point.
#[derive(Debug, Default)]
pub struct Power {
    state: Mutex<PowerState>,
}

#[derive(Debug, Default)]
struct PowerState {
    ops: u64,
    /// The operation count at which the power goes off (that operation fails).
    cut_at: Option<u64>,
    off: bool,
}

fn power_off_error() -> io::Error {
    io::Error::from_raw_os_error(5) // EIO
}

impl Power {
    /// Mutating operations counted so far (all disks of the pool).
    pub fn ops(&self) -> u64 {
        lock(&self.state).ops
    }

    /// Arms the cut: the `n`-th mutating operation from now (1: the next one) fails with EIO
    /// and the power stays off from then on.
    pub fn cut_after(&self, n: u64) {
        let mut s = lock(&self.state);
        s.cut_at = Some(s.ops + n.max(1));
    }

    /// Clears an armed cut that has not happened yet.
    pub fn disarm(&self) {
        lock(&self.state).cut_at = None;
    }

    pub fn is_off(&self) -> bool {
        lock(&self.state).off
    }

    /// One mutating operation: an error if the power is (or just went) off.
    fn tick(&self) -> io::Result<()> {
        let mut s = lock(&self.state);
        if s.off {
            return Err(power_off_error());
        }
        s.ops += 1;
        if s.cut_at.is_some_and(|at| s.ops >= at) {
            s.off = true;
            return Err(power_off_error());
        }
        Ok(())
    }

    /// A read: not counted, but a disk without power answers nothing.
    fn check(&self) -> io::Result<()> {
        if lock(&self.state).off {
            return Err(power_off_error());
        }
        Ok(())
    }

    fn restore(&self) {
        let mut s = lock(&self.state);
        s.off = false;
        s.cut_at = None;
    }
}

/// One page of an image; shared between the durable and the current image until one of
/// them writes it (copy on write), so a sync or a cut costs no copy of the disk.
type Page = Arc<[u8; PAGE_BYTES as usize]>;

/// A sparse byte image: 4 KiB pages, absent ones read as zeros.
#[derive(Clone, Debug, Default)]
struct Image {
    len: u64,
    pages: BTreeMap<u64, Page>,
}

impl Image {
    fn read(&self, off: u64, out: &mut [u8]) {
        let mut done = 0usize;
        while done < out.len() {
            let pos = off + done as u64;
            let page = pos / PAGE_BYTES;
            let in_page = (pos % PAGE_BYTES) as usize;
            let n = (PAGE_BYTES as usize - in_page).min(out.len() - done);
            match self.pages.get(&page) {
                Some(p) => out[done..done + n].copy_from_slice(&p[in_page..in_page + n]),
                None => out[done..done + n].fill(0),
            }
            done += n;
        }
    }

    fn write(&mut self, off: u64, data: &[u8]) {
        let mut done = 0usize;
        while done < data.len() {
            let pos = off + done as u64;
            let page = pos / PAGE_BYTES;
            let in_page = (pos % PAGE_BYTES) as usize;
            let n = (PAGE_BYTES as usize - in_page).min(data.len() - done);
            let p = self
                .pages
                .entry(page)
                .or_insert_with(|| Arc::new([0u8; PAGE_BYTES as usize]));
            Arc::make_mut(p)[in_page..in_page + n].copy_from_slice(&data[done..done + n]);
            done += n;
        }
        self.len = self.len.max(off + data.len() as u64);
    }

    /// Zeros `[off, off + len)`; whole pages are dropped (the range reads zeros).
    fn zero(&mut self, off: u64, len: u64) {
        let end = off + len;
        let mut pos = off;
        while pos < end {
            let page = pos / PAGE_BYTES;
            let in_page = pos % PAGE_BYTES;
            let n = (PAGE_BYTES - in_page).min(end - pos);
            if n == PAGE_BYTES {
                self.pages.remove(&page);
            } else if let Some(p) = self.pages.get_mut(&page) {
                Arc::make_mut(p)[in_page as usize..(in_page + n) as usize].fill(0);
            }
            pos += n;
        }
    }

    fn set_len(&mut self, len: u64) {
        if len < self.len {
            let tail = len.div_ceil(PAGE_BYTES) * PAGE_BYTES;
            self.zero(len, tail.min(self.len).saturating_sub(len));
            let _ = self.pages.split_off(&len.div_ceil(PAGE_BYTES));
        }
        self.len = len;
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Write { off, data } => self.write(*off, data),
            Op::Zero { off, len } => self.zero(*off, *len),
            Op::SetLen(len) => self.set_len(*len),
        }
    }
}

/// One unsynced operation.
#[derive(Clone, Debug)]
enum Op {
    Write {
        off: u64,
        data: Vec<u8>,
    },
    /// Zero-range and punch: both read zeros afterwards.
    Zero {
        off: u64,
        len: u64,
    },
    SetLen(u64),
}

/// What a power cut did to the unsynced operations (all disks of a pool).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CutReport {
    pub kept: u64,
    pub dropped: u64,
    pub torn: u64,
}

#[derive(Debug, Default)]
struct DiskState {
    /// What survives a power loss.
    durable: Image,
    /// What reads see: `durable` with `log` applied.
    current: Image,
    /// Operations since the last sync, in order.
    log: Vec<Op>,
}

/// One simulated disk (a data device or the metadata file) of a pool.
pub struct SimDisk {
    name: String,
    power: Arc<Power>,
    state: Mutex<DiskState>,
}

impl fmt::Debug for SimDisk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimDisk")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl SimDisk {
    /// A disk of `len_bytes` zeros (durably that long: a file that already exists).
    fn new(name: String, power: Arc<Power>, len_bytes: u64) -> SimDisk {
        let image = Image {
            len: len_bytes,
            pages: BTreeMap::new(),
        };
        SimDisk {
            name,
            power,
            state: Mutex::new(DiskState {
                durable: image.clone(),
                current: image,
                log: Vec::new(),
            }),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The length reads see.
    pub fn len(&self) -> io::Result<u64> {
        self.power.check()?;
        Ok(lock(&self.state).current.len)
    }

    /// Whether the disk is empty (length 0).
    pub fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Reads `out.len()` bytes at `off`; past the end is an error.
    pub fn read(&self, off: u64, out: &mut [u8]) -> io::Result<()> {
        self.power.check()?;
        let s = lock(&self.state);
        if off.saturating_add(out.len() as u64) > s.current.len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{}: read past the end", self.name),
            ));
        }
        s.current.read(off, out);
        Ok(())
    }

    /// Writes `data` at `off` (volatile until a sync); a write past the end extends the disk.
    pub fn write(&self, off: u64, data: &[u8]) -> io::Result<()> {
        self.record(Op::Write {
            off,
            data: data.to_vec(),
        })
    }

    /// Zeros `[off, off + len)` (zero-range or punch; volatile until a sync).
    pub fn zero(&self, off: u64, len: u64) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.record(Op::Zero { off, len })
    }

    /// Sets the length (volatile until a sync); new bytes read zeros.
    pub fn set_len(&self, len: u64) -> io::Result<()> {
        self.record(Op::SetLen(len))
    }

    /// Makes every operation before it durable.
    pub fn sync(&self) -> io::Result<()> {
        self.power.tick()?;
        let mut s = lock(&self.state);
        let log = std::mem::take(&mut s.log);
        for op in &log {
            s.durable.apply(op);
        }
        Ok(())
    }

    /// Writes `data` at `off` and makes that range durable before returning (a 4 KiB
    /// `pwritev2(RWF_DSYNC)`): the other unsynced operations stay volatile, except earlier
    /// writes lying wholly inside the range, which this one supersedes (the page cache holds
    /// one version of a page, and the flush that makes it durable flushes the disk's cache).
    pub fn write_durable(&self, off: u64, data: &[u8]) -> io::Result<()> {
        self.power.tick()?;
        let end = off + data.len() as u64;
        let mut s = lock(&self.state);
        s.log.retain(|op| {
            !matches!(op, Op::Write { off: o, data: d } if *o >= off && *o + d.len() as u64 <= end)
        });
        s.current.write(off, data);
        s.durable.write(off, data);
        Ok(())
    }

    fn record(&self, op: Op) -> io::Result<()> {
        self.power.tick()?;
        let mut s = lock(&self.state);
        s.current.apply(&op);
        s.log.push(op);
        Ok(())
    }

    /// The power failed: keep, drop or tear each unsynced operation and apply the kept
    /// pieces onto the durable image in a random order; reads then see the durable image.
    fn resolve(&self, rng: &mut SimRng, report: &mut CutReport) {
        let mut s = lock(&self.state);
        let log = std::mem::take(&mut s.log);
        let mut pieces: Vec<Op> = Vec::new();
        for op in log {
            match rng.below(3) {
                0 => {
                    report.kept += 1;
                    pieces.push(op);
                }
                1 => report.dropped += 1,
                _ => {
                    report.torn += 1;
                    let grain = if rng.below(2) == 0 {
                        SECTOR_BYTES
                    } else {
                        PAGE_BYTES
                    };
                    tear(op, grain, rng, &mut pieces);
                }
            }
        }
        // Fisher-Yates: the disk wrote its cache back in any order.
        for i in (1..pieces.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            pieces.swap(i, j);
        }
        for p in &pieces {
            s.durable.apply(p);
        }
        s.current = s.durable.clone();
    }
}

/// The sectors (of `grain` bytes, aligned on the disk) of `op` that a tear keeps, each with
/// probability one half, into `out`. A length change is not torn: kept or dropped whole.
fn tear(op: Op, grain: u64, rng: &mut SimRng, out: &mut Vec<Op>) {
    let (off, len) = match &op {
        Op::Write { off, data } => (*off, data.len() as u64),
        Op::Zero { off, len } => (*off, *len),
        Op::SetLen(_) => {
            if rng.below(2) == 0 {
                out.push(op);
            }
            return;
        }
    };
    let end = off + len;
    let mut pos = off;
    while pos < end {
        let next = ((pos / grain + 1) * grain).min(end);
        if rng.below(2) == 0 {
            out.push(match &op {
                Op::Write { data, .. } => Op::Write {
                    off: pos,
                    data: data[(pos - off) as usize..(next - off) as usize].to_vec(),
                },
                _ => Op::Zero {
                    off: pos,
                    len: next - pos,
                },
            });
        }
        pos = next;
    }
}

/// The disks of one simulated pool: the metadata disk, data disks by device id, one power.
pub struct SimPool {
    power: Arc<Power>,
    meta: Arc<SimDisk>,
    disks: Mutex<Vec<Arc<SimDisk>>>,
    device_bytes: u64,
    initial_devices: usize,
}

impl fmt::Debug for SimPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimPool")
            .field("disks", &lock(&self.disks).len())
            .finish_non_exhaustive()
    }
}

impl SimPool {
    /// A new pool: an empty metadata disk and `devices` data disks of `device_bytes` each
    /// (what `Store::open_simulated` makes its devices of on first open).
    pub fn new(devices: usize, device_bytes: u64) -> Arc<SimPool> {
        let power = Arc::new(Power::default());
        Arc::new(SimPool {
            meta: Arc::new(SimDisk::new("sim:meta".into(), Arc::clone(&power), 0)),
            disks: Mutex::new(Vec::new()),
            power,
            device_bytes,
            initial_devices: devices,
        })
    }

    pub fn power(&self) -> &Power {
        &self.power
    }

    pub(crate) fn meta_disk(&self) -> Arc<SimDisk> {
        Arc::clone(&self.meta)
    }

    pub(crate) fn initial_devices(&self) -> usize {
        self.initial_devices
    }

    pub(crate) fn device_bytes(&self) -> u64 {
        self.device_bytes
    }

    /// The data disk of device `id`, made (`len_bytes` long) if the pool has none yet. A disk
    /// left by a device addition whose commit a cut lost is handed out again as it is.
    pub(crate) fn disk(&self, id: usize, len_bytes: u64) -> Arc<SimDisk> {
        let mut disks = lock(&self.disks);
        while disks.len() <= id {
            let n = disks.len();
            disks.push(Arc::new(SimDisk::new(
                format!("sim:{n}"),
                Arc::clone(&self.power),
                len_bytes,
            )));
        }
        Arc::clone(&disks[id])
    }

    /// The power failed at the cut: resolves every disk's unsynced operations with `seed`
    /// (metadata disk first, then the data disks by id), then restores the power.
    pub fn resolve_cut(&self, seed: u64) -> CutReport {
        let mut rng = SimRng::new(seed);
        let mut report = CutReport::default();
        self.meta.resolve(&mut rng, &mut report);
        for d in lock(&self.disks).iter() {
            d.resolve(&mut rng, &mut report);
        }
        self.power.restore();
        report
    }
}

/// redb's storage on a simulated disk (`Meta::open_simulated`).
#[derive(Debug)]
pub(crate) struct SimBackend(pub Arc<SimDisk>);

impl redb::StorageBackend for SimBackend {
    fn len(&self) -> io::Result<u64> {
        self.0.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.0.read(offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.write(offset, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(d: &SimDisk, off: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        d.read(off, &mut b).unwrap();
        b
    }

    #[test]
    fn synced_data_survives_a_cut_and_unsynced_data_is_kept_dropped_or_torn() {
        let mut outcomes = [0u32; 3]; // all old, all new, mixed
        for seed in 0..64 {
            let pool = SimPool::new(1, 1 << 20);
            let d = pool.disk(0, 1 << 20);
            d.write(0, &[1u8; 8192]).unwrap();
            d.sync().unwrap();
            d.write(0, &[2u8; 8192]).unwrap();
            assert_eq!(
                read(&d, 0, 8192),
                vec![2u8; 8192],
                "reads see volatile data"
            );
            pool.power().cut_after(1);
            assert!(d.sync().is_err() && pool.power().is_off());
            assert!(d.write(0, &[3u8; 1]).is_err(), "no power, no write");
            pool.resolve_cut(seed);
            let got = read(&d, 0, 8192);
            assert!(
                got.iter().all(|&b| b == 1 || b == 2),
                "only old or new bytes"
            );
            for s in got.chunks(512) {
                assert!(
                    s.iter().all(|&b| b == s[0]),
                    "torn at sector granularity only"
                );
            }
            let i = if got.iter().all(|&b| b == 1) {
                0
            } else if got.iter().all(|&b| b == 2) {
                1
            } else {
                2
            };
            outcomes[i] += 1;
        }
        assert!(outcomes.iter().all(|&n| n > 0), "{outcomes:?}");
    }

    #[test]
    fn overlapping_unsynced_writes_may_land_in_either_order() {
        let mut last = [0u32; 3];
        for seed in 0..64 {
            let pool = SimPool::new(1, 4096);
            let d = pool.disk(0, 4096);
            d.write(0, &[1u8; 512]).unwrap();
            d.write(0, &[2u8; 512]).unwrap();
            pool.resolve_cut(seed);
            last[read(&d, 0, 512)[0] as usize] += 1;
        }
        assert!(last.iter().all(|&n| n > 0), "{last:?}");
    }

    #[test]
    fn punch_and_set_len_are_volatile_until_synced() {
        let pool = SimPool::new(1, 8192);
        let d = pool.disk(0, 8192);
        d.write(0, &[9u8; 8192]).unwrap();
        d.sync().unwrap();
        d.zero(100, 5000).unwrap();
        d.set_len(4096).unwrap();
        assert!(
            d.read(4000, &mut [0u8; 200]).is_err(),
            "read past the new end"
        );
        assert_eq!(read(&d, 99, 2), vec![9, 0]);
        d.sync().unwrap();
        pool.power().cut_after(1);
        let _ = d.write(0, &[1u8; 16]);
        pool.resolve_cut(1);
        assert_eq!(d.len().unwrap(), 4096);
        assert_eq!(read(&d, 99, 2), vec![9, 0]);
        d.set_len(8192).unwrap();
        assert_eq!(
            read(&d, 4096, 4096),
            vec![0u8; 4096],
            "grown part reads zeros"
        );
    }
}
