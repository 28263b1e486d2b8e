//! Power loss: the real store on simulated disks that lose, tear and reorder every write not
//! yet synced when the power fails (`headroom_store::sim_disk`), checked against a model of
//! what was acknowledged.
//!
//! A single-threaded, seeded driver runs random operations on a `Store::open_simulated` pool:
//! WRITE (4 KiB-aligned and 512-byte-aligned, 512 B to 256 KiB, often into unallocated
//! extents), FUA WRITE, FLUSH, TRIM and WRITE_ZEROES (partial and whole extents, with and
//! without NO_HOLE, with and without FUA), volume create / resize (grow and shrink, sizes
//! ending inside an extent) / delete, device add and device fail, on 1- and 2-replica
//! volumes. The power is cut at a random operation of the simulated disks (data devices and
//! the redb disk alike, so cuts land inside writes, inside commits between the device syncs
//! and the redb commit, and inside redb's own writes). Then the store is dropped, the cut is
//! resolved with the seed (every unsynced operation kept, dropped or torn at 512 B or 4 KiB,
//! applied in a random order), the store is reopened (it must open without error, through
//! the same recovery as `Store::open`) and checked:
//!
//! - the volume set and sizes: acknowledged changes hold, the one in flight at the cut is
//!   all-or-nothing;
//! - every 512-byte sector of every volume holds one allowed version: its durable version
//!   (written with FUA, or acknowledged before a FLUSH of its volume that was acknowledged)
//!   or a later acknowledged or in-flight one; zeros only where zeros are allowed
//!   (never-written space, the grown part of a volume, TRIM / WRITE_ZEROES); never a sector
//!   of another place or volume (each sector names its volume, index and version).
//!
//! - every block of every device verifies against its checksum (the simulated disks carry
//!   checksums, `checksum.rs`): no read fails with a checksum error and no device counts one
//!   after the reopen, so a block torn by the cut was recomputed from the write-intent bitmap.
//!
//! What the reopened store serves then becomes each sector's only allowed content, and the
//! next cycle goes on with the same pool. The rules are those of the SIGKILL test
//! (`crates/headroom/tests/crash_consistency.rs`) at sector granularity.
//!
//! `HEADROOM_POWER_CUT_CUTS` (default 2000) is the number of cuts of the main test;
//! `HEADROOM_POWER_CUT_SEED` runs that one seed only. Everything is decided by the seed (no
//! clock, no threads), so a failure reproduces exactly; its message names the seed, the
//! cycle, the volume, the sector, the allowed versions and what was found. The mutant tests
//! switch on a deliberate bug of the commit protocol (`headroom_store::mutants`) and assert
//! the simulation catches it within the CI run's cuts. `HEADROOM_POWER_CUT_TRACE=1` prints
//! the operations of the failing cycle and the one before it.
//!
//! Two choices of the model: a reply that comes back after the power went off does not count
//! (the whole machine lost power, so no client heard it), and no device holding extents of a
//! 1-replica volume is failed (the store gives that data up with the device: its FLUSH fails
//! from then on and a shrink's tail punch there is never made durable).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code panics on failure by design

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use headroom_store::mutants::{self, Mutant};
use headroom_store::sim_disk::{SimPool, SimRng};
use headroom_store::{EXTENT_SIZE_BYTES, NewVolume, Store, StoreError};

const SECTOR: u64 = 512;
const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;
const DEVICE_BYTES: u64 = 16 * MIB;
const INITIAL_DEVICES: usize = 2;
const MAX_DEVICES: usize = 5;
const MAX_VOLUMES: usize = 4;
const MAX_VOLUME_BYTES: u64 = 6 * MIB;
/// The cut lands at one of the next this many operations of the simulated disks.
const MAX_CUT_OPS: u64 = 150;
/// Seeds of every CI run (regression seeds go here too).
/// 0xb84c2fdc3f8d107d: a fresh seed that failed a device holding the last healthy copy of a
/// replicated extent (a driver fault: such a write has no copy to go to).
const FIXED_SEEDS: &[u64] = &[1, 2, 3, 4, 5, 6, 0x5eed, 0xdecade, 0xb84c2fdc3f8d107d];
/// Seeds drawn afresh each run (printed, so a failure can be replayed).
const FRESH_SEEDS: usize = 2;
const DEFAULT_CUTS: u64 = 2000;
const MAGIC: u64 = 0x504f_5745_5243_5554; // "POWERCUT"

/// The content of sector `index` of the volume with uid `uid` at version `version` (never 0:
/// version 0 is zeros).
fn stamp(uid: u64, index: u64, version: u32, out: &mut [u8]) {
    let h = mix(uid, index, version);
    for (i, w) in out.chunks_exact_mut(8).enumerate() {
        let v = match i {
            0 => MAGIC,
            1 => uid,
            2 => index,
            3 => u64::from(version),
            _ => h.wrapping_mul(i as u64 | 1).rotate_left(i as u32),
        };
        w.copy_from_slice(&v.to_le_bytes());
    }
}

fn mix(uid: u64, index: u64, version: u32) -> u64 {
    let mut r = SimRng::new(uid ^ index.rotate_left(20) ^ u64::from(version).rotate_left(44));
    r.next_u64()
}

/// What a sector read back holds.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    Zeros,
    Version { uid: u64, index: u64, version: u32 },
    Garbage,
}

fn decode(s: &[u8]) -> Found {
    let word = |i: usize| u64::from_le_bytes(s[i * 8..i * 8 + 8].try_into().unwrap());
    if word(0) != MAGIC {
        // Word by word: most sectors read are zeros, and this runs for all of them.
        let zero = s
            .chunks_exact(8)
            .all(|w| u64::from_le_bytes(w.try_into().unwrap()) == 0);
        return if zero { Found::Zeros } else { Found::Garbage };
    }
    let (uid, index, version) = (word(1), word(2), word(3));
    let Ok(version) = u32::try_from(version) else {
        return Found::Garbage;
    };
    let mut expect = [0u8; SECTOR as usize];
    stamp(uid, index, version, &mut expect);
    if expect != s {
        return Found::Garbage;
    }
    Found::Version {
        uid,
        index,
        version,
    }
}

/// One sector of the model: its durable version and the later ones that may be there.
#[derive(Clone, Debug, Default)]
struct Sector {
    durable: u32,
    later: Vec<u32>,
}

impl Sector {
    fn allowed(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::once(self.durable).chain(self.later.iter().copied())
    }
}

#[derive(Debug)]
struct VolModel {
    uid: u64,
    size: u64,
    replicas: u8,
    sectors: Vec<Sector>,
}

impl VolModel {
    fn name(&self) -> String {
        format!("v{}", self.uid)
    }
}

/// The management change in flight at the cut (all-or-nothing after it).
#[derive(Debug)]
enum InFlight {
    None,
    Create(u64),
    Delete(u64),
    Resize { uid: u64, old: u64, new: u64 },
    AddDevice,
    FailDevice,
}

/// The outcome of one seed's run.
#[derive(Debug, Default)]
struct Totals {
    cuts: u64,
    /// Cuts that landed inside the recovery of a reopen.
    recovery_cuts: u64,
    checked: u64,
}

struct Driver {
    seed: u64,
    rng: SimRng,
    pool: Arc<SimPool>,
    volumes: BTreeMap<u64, VolModel>,
    next_uid: u64,
    next_version: u32,
    in_flight: InFlight,
    cycle: u64,
    devices: usize,
    failed_devices: Vec<u32>,
    /// With `HEADROOM_POWER_CUT_TRACE`: the operations of this cycle and the one before.
    trace: Option<(Vec<String>, Vec<String>)>,
}

fn is_power_error(pool: &SimPool) -> bool {
    pool.power().is_off()
}

impl Driver {
    fn new(seed: u64) -> Driver {
        Driver {
            seed,
            rng: SimRng::new(seed),
            pool: SimPool::new(INITIAL_DEVICES, DEVICE_BYTES),
            volumes: BTreeMap::new(),
            next_uid: 1,
            next_version: 1,
            in_flight: InFlight::None,
            cycle: 0,
            devices: INITIAL_DEVICES,
            failed_devices: Vec::new(),
            trace: std::env::var_os("HEADROOM_POWER_CUT_TRACE").map(|_| Default::default()),
        }
    }

    fn note(&mut self, what: impl FnOnce() -> String) {
        if let Some((_, now)) = &mut self.trace {
            now.push(what());
        }
    }

    fn fail(&self, what: String) -> String {
        if let Some((before, now)) = &self.trace {
            eprintln!(
                "previous cycle:\n  {}\nthis cycle:\n  {}",
                before.join("\n  "),
                now.join("\n  ")
            );
        }
        format!(
            "seed {:#x} cycle {}: {what} (replay: HEADROOM_POWER_CUT_SEED={:#x} HEADROOM_POWER_CUT_CUTS={})",
            self.seed,
            self.cycle,
            self.seed,
            self.cycle + 1
        )
    }

    fn version(&mut self) -> u32 {
        let v = self.next_version;
        self.next_version += 1;
        v
    }

    /// Healthy capacity minus what the volumes may take, in bytes.
    fn headroom_bytes(&self, healthy_devices: usize) -> i64 {
        let provisioned: u64 = self
            .volumes
            .values()
            .map(|v| v.size.div_ceil(EXTENT_SIZE_BYTES) * EXTENT_SIZE_BYTES * u64::from(v.replicas))
            .sum();
        // Each device keeps its first extent for its checksums (checksum.rs).
        (healthy_devices as u64 * (DEVICE_BYTES - EXTENT_SIZE_BYTES)) as i64
            - provisioned as i64
            - (8 * MIB) as i64
    }

    fn healthy(&self) -> usize {
        self.devices - self.failed_devices.len()
    }

    fn pick_volume(&mut self) -> Option<u64> {
        if self.volumes.is_empty() {
            return None;
        }
        let i = self.rng.below(self.volumes.len() as u64) as usize;
        self.volumes.keys().nth(i).copied()
    }

    /// A range of `uid`'s volume: sector-aligned, 512 B..256 KiB, or 1-2 whole extents.
    fn range(&mut self, size: u64, whole_extents: bool) -> (u64, u64) {
        if whole_extents && size >= EXTENT_SIZE_BYTES {
            let extents = size / EXTENT_SIZE_BYTES;
            let first = self.rng.below(extents);
            let n = 1 + self.rng.below(2.min(extents - first));
            return (first * EXTENT_SIZE_BYTES, n * EXTENT_SIZE_BYTES);
        }
        let aligned = self.rng.below(2) == 0;
        let grain = if aligned { 4 * KIB } else { SECTOR };
        let max_len = (256 * KIB).min(size);
        let len = (1 + self.rng.below(max_len / grain)) * grain;
        let len = len.min(size - size % grain).max(SECTOR);
        let slots = (size - len) / grain;
        let off = self.rng.below(slots + 1) * grain;
        (off, len.min(size - off))
    }

    /// Runs operations until the power goes off. `Err`: a failure of the store.
    fn run_until_cut(&mut self, store: &Store) -> Result<(), String> {
        self.in_flight = InFlight::None;
        if let Some((before, now)) = &mut self.trace {
            *before = std::mem::take(now);
        }
        let cut = 1 + self.rng.below(MAX_CUT_OPS);
        self.pool.power().cut_after(cut);
        loop {
            let result = self.step(store);
            let (off, in_flight) = (self.pool.power().is_off(), format!("{:?}", self.in_flight));
            self.note(|| format!("  -> {result:?} power off {off} in flight {in_flight}"));
            if let Err(e) = result {
                if is_power_error(&self.pool) {
                    return Ok(());
                }
                return Err(self.fail(e));
            }
            if self.pool.power().is_off() {
                return Ok(());
            }
        }
    }

    /// One random operation; `Err` text only matters when the power is on.
    fn step(&mut self, store: &Store) -> Result<(), String> {
        self.in_flight = InFlight::None;
        let Some(uid) = self.pick_volume() else {
            return self.create(store);
        };
        let roll = self.rng.below(100);
        let ops = self.pool.power().ops();
        self.note(|| format!("[ops {ops}] roll {roll} on v{uid}"));
        match roll {
            0..=34 => self.write(store, uid, false),
            35..=44 => self.write(store, uid, true),
            45..=54 => self.flush(store, uid),
            55..=62 => self.discard(store, uid, Discard::Trim),
            63..=70 => self.discard(store, uid, Discard::Zeroes),
            71..=76 => self.create(store),
            77..=86 => self.resize(store, uid),
            87..=90 => self.delete(store, uid),
            91..=94 => self.add_device(store),
            95..=96 => self.fail_device(store),
            _ => self.write(store, uid, false),
        }
    }

    fn write(&mut self, store: &Store, uid: u64, fua: bool) -> Result<(), String> {
        let size = self.volumes[&uid].size;
        let (off, len) = self.range(size, false);
        let v = self.version();
        let mut data = vec![0u8; len as usize];
        let first = off / SECTOR;
        for (i, s) in data.chunks_exact_mut(SECTOR as usize).enumerate() {
            stamp(uid, first + i as u64, v, s);
        }
        let model = self.volumes.get_mut(&uid).unwrap();
        for s in &mut model.sectors[first as usize..(first + len / SECTOR) as usize] {
            s.later.push(v);
        }
        let vol = store
            .open_volume(&model.name())
            .map_err(|e| e.to_string())?;
        self.note(|| {
            format!(
                "write v{uid} sectors {first}..{} version {v} fua {fua}",
                first + len / SECTOR
            )
        });
        match vol.write_at(off, &data, fua) {
            Ok(()) => {
                if fua && self.acked() {
                    self.make_durable(uid, first, len / SECTOR);
                }
                Ok(())
            }
            Err(e) => self.durability_error(e, "write"),
        }
    }

    /// A request failed: with the power on, that is a failure of the store (no 1-replica
    /// volume has data on a failed device, and every other one has a healthy copy).
    fn durability_error(&self, e: StoreError, what: &str) -> Result<(), String> {
        Err(format!("{what}: {e}"))
    }

    /// Whether a reply that came back was received: after the power failed no client
    /// hears anything (the whole machine lost power), so a success then is no promise.
    fn acked(&self) -> bool {
        !self.pool.power().is_off()
    }

    fn make_durable(&mut self, uid: u64, first: u64, count: u64) {
        let model = self.volumes.get_mut(&uid).unwrap();
        for s in &mut model.sectors[first as usize..(first + count) as usize] {
            if let Some(&last) = s.later.last() {
                s.durable = last;
                s.later.clear();
            }
        }
    }

    fn flush(&mut self, store: &Store, uid: u64) -> Result<(), String> {
        let name = self.volumes[&uid].name();
        let vol = store.open_volume(&name).map_err(|e| e.to_string())?;
        match vol.flush() {
            Ok(()) if self.acked() => {
                let n = self.volumes[&uid].sectors.len() as u64;
                self.make_durable(uid, 0, n);
                Ok(())
            }
            Ok(()) => Ok(()),
            Err(e) => self.durability_error(e, "flush"),
        }
    }

    fn discard(&mut self, store: &Store, uid: u64, kind: Discard) -> Result<(), String> {
        let size = self.volumes[&uid].size;
        let whole = self.rng.below(2) == 0;
        let (off, len) = self.range(size, whole);
        let fua = self.rng.below(3) == 0;
        let may_release = self.rng.below(2) == 0;
        let model = self.volumes.get_mut(&uid).unwrap();
        let first = off / SECTOR;
        for s in &mut model.sectors[first as usize..((off + len) / SECTOR) as usize] {
            s.later.push(0);
        }
        let vol = store
            .open_volume(&model.name())
            .map_err(|e| e.to_string())?;
        self.note(|| {
            format!(
                "discard v{uid} sectors {first}..{} fua {fua} release {may_release}",
                (off + len) / SECTOR
            )
        });
        let result = match kind {
            Discard::Trim => vol.trim(off, len, fua),
            Discard::Zeroes => vol.write_zeroes(off, len, may_release, fua),
        };
        match result {
            Ok(()) => {
                if fua && self.acked() {
                    self.make_durable(uid, first, len / SECTOR);
                }
                Ok(())
            }
            Err(e) => self.durability_error(e, "trim/write_zeroes"),
        }
    }

    fn volume_size(&mut self) -> u64 {
        // Whole extents, or ending inside one.
        let sectors = MAX_VOLUME_BYTES / SECTOR;
        let s = 1 + self.rng.below(sectors);
        if self.rng.below(3) == 0 {
            (s * SECTOR).div_ceil(EXTENT_SIZE_BYTES) * EXTENT_SIZE_BYTES
        } else {
            s * SECTOR
        }
    }

    fn create(&mut self, store: &Store) -> Result<(), String> {
        if self.volumes.len() >= MAX_VOLUMES {
            return Ok(());
        }
        let size = self.volume_size();
        let replicas = if self.healthy() >= 2 && self.rng.below(2) == 0 {
            2
        } else {
            1
        };
        let taken = size.div_ceil(EXTENT_SIZE_BYTES) * EXTENT_SIZE_BYTES * u64::from(replicas);
        if self.headroom_bytes(self.healthy()) < taken as i64 {
            return Ok(());
        }
        let uid = self.next_uid;
        self.next_uid += 1;
        let model = VolModel {
            uid,
            size,
            replicas,
            sectors: vec![Sector::default(); (size / SECTOR) as usize],
        };
        let name = model.name();
        self.volumes.insert(uid, model);
        self.in_flight = InFlight::Create(uid);
        let options = NewVolume {
            replicas,
            ..NewVolume::default()
        };
        store
            .create_volume_with(&name, size, options)
            .map_err(|e| format!("create {name}: {e}"))?;
        if self.acked() {
            self.in_flight = InFlight::None;
        }
        Ok(())
    }

    fn resize(&mut self, store: &Store, uid: u64) -> Result<(), String> {
        let old = self.volumes[&uid].size;
        let new = self.volume_size();
        let replicas = self.volumes[&uid].replicas;
        let grow = new
            .div_ceil(EXTENT_SIZE_BYTES)
            .saturating_sub(old.div_ceil(EXTENT_SIZE_BYTES))
            * EXTENT_SIZE_BYTES
            * u64::from(replicas);
        if new == old || self.headroom_bytes(self.healthy()) < grow as i64 {
            return Ok(());
        }
        let model = self.volumes.get_mut(&uid).unwrap();
        if new < old {
            // An unacknowledged shrink may have zeroed what it cut.
            for s in &mut model.sectors[(new / SECTOR) as usize..] {
                s.later.push(0);
            }
        }
        let name = model.name();
        if self.trace.is_some() {
            let vol = store.open_volume(&name).map_err(|e| e.to_string())?;
            let at = vol.copies(new / EXTENT_SIZE_BYTES);
            let failed: Vec<u32> = store
                .pool_info()
                .devices
                .iter()
                .filter(|d| d.failed)
                .map(|d| d.id)
                .collect();
            self.note(|| format!("resize v{uid} (replicas {replicas}) {old} -> {new}; last extent at {at:?}; failed devices {failed:?}"));
        }
        self.in_flight = InFlight::Resize { uid, old, new };
        store
            .resize_volume(&name, new)
            .map_err(|e| format!("resize {name} {old} -> {new}: {e}"))?;
        if !self.acked() {
            return Ok(());
        }
        self.in_flight = InFlight::None;
        self.set_size(uid, new);
        if new > old {
            // The grown part reads zeros at once.
            let vol = store.open_volume(&name).map_err(|e| e.to_string())?;
            let mut buf = vec![0u8; (new - old) as usize];
            vol.read_at(old, &mut buf)
                .map_err(|e| format!("read after grow: {e}"))?;
            let nonzero = buf
                .chunks_exact(SECTOR as usize)
                .position(|s| decode(s) != Found::Zeros);
            if let Some(i) = nonzero {
                let s = &buf[i * SECTOR as usize..(i + 1) * SECTOR as usize];
                return Err(format!(
                    "volume {name} grown {old} -> {new}: sector at byte {} is not zero ({:?})",
                    old + i as u64 * SECTOR,
                    decode(s)
                ));
            }
        }
        Ok(())
    }

    fn set_size(&mut self, uid: u64, new: u64) {
        let model = self.volumes.get_mut(&uid).unwrap();
        model
            .sectors
            .resize((new / SECTOR) as usize, Sector::default());
        model.size = new;
    }

    fn delete(&mut self, store: &Store, uid: u64) -> Result<(), String> {
        if self.volumes.len() < 2 {
            return Ok(());
        }
        let model = self.volumes.get_mut(&uid).unwrap();
        for s in &mut model.sectors {
            s.later.push(0);
        }
        let name = model.name();
        self.in_flight = InFlight::Delete(uid);
        store
            .delete_volume(&name)
            .map_err(|e| format!("delete {name}: {e}"))?;
        if self.acked() {
            self.in_flight = InFlight::None;
            self.volumes.remove(&uid);
        }
        Ok(())
    }

    fn add_device(&mut self, store: &Store) -> Result<(), String> {
        if self.devices >= MAX_DEVICES {
            return Ok(());
        }
        self.in_flight = InFlight::AddDevice;
        store
            .add_device(None, DEVICE_BYTES)
            .map_err(|e| format!("add device: {e}"))?;
        if self.acked() {
            self.in_flight = InFlight::None;
            self.devices += 1;
        }
        Ok(())
    }

    fn fail_device(&mut self, store: &Store) -> Result<(), String> {
        // Keep two healthy devices (2-replica volumes) and room for every volume.
        if self.healthy() <= 3 || self.headroom_bytes(self.healthy() - 1) < 0 {
            return Ok(());
        }
        let healthy: Vec<u32> = (0..self.devices as u32)
            .filter(|d| !self.failed_devices.contains(d))
            .collect();
        let id = healthy[self.rng.below(healthy.len() as u64) as usize];
        // Not a device holding extents of a 1-replica volume: their data there is given up
        // with it (its FLUSH fails from then on, and nothing written there is durable any
        // more), which this model does not follow.
        for v in self.volumes.values().filter(|v| v.replicas == 1) {
            let vol = store.open_volume(&v.name()).map_err(|e| e.to_string())?;
            for extent in 0..v.size.div_ceil(EXTENT_SIZE_BYTES) {
                if vol.extent_location(extent).is_some_and(|p| p.device == id) {
                    return Ok(());
                }
            }
        }
        // Nor one holding the last healthy copy of an extent of a replicated volume (the
        // other copies' devices failed earlier): that extent would have no copy to write to.
        for v in self.volumes.values().filter(|v| v.replicas > 1) {
            let vol = store.open_volume(&v.name()).map_err(|e| e.to_string())?;
            for extent in 0..v.size.div_ceil(EXTENT_SIZE_BYTES) {
                let copies = vol.copies(extent);
                let on_id = copies
                    .iter()
                    .flatten()
                    .any(|(p, healthy)| *healthy && p.device == id);
                let others_healthy = copies
                    .iter()
                    .flatten()
                    .any(|(p, healthy)| *healthy && p.device != id);
                if on_id && !others_healthy {
                    return Ok(());
                }
            }
        }
        self.in_flight = InFlight::FailDevice;
        store
            .fail_device(id)
            .map_err(|e| format!("fail device {id}: {e}"))?;
        if self.acked() {
            self.in_flight = InFlight::None;
            self.failed_devices.push(id);
        }
        Ok(())
    }

    /// After the reopen: the volume set, sizes and every sector against the model; then what
    /// was found becomes the model. Returns the sectors checked that had a durable version.
    fn check(&mut self, store: &Store) -> Result<u64, String> {
        let listed: BTreeMap<String, (u64, u8)> = store
            .list_volumes()
            .into_iter()
            .map(|v| (v.name, (v.size_bytes, v.replicas)))
            .collect();
        // Devices: an addition or failure in flight went either way.
        let info = store.pool_info();
        let failed: Vec<u32> = info
            .devices
            .iter()
            .filter(|d| d.failed)
            .map(|d| d.id)
            .collect();
        let devices_ok = match self.in_flight {
            InFlight::AddDevice => {
                info.devices.len() == self.devices || info.devices.len() == self.devices + 1
            }
            _ => info.devices.len() == self.devices,
        };
        if !devices_ok {
            return Err(self.fail(format!(
                "{} devices after the reopen, the model has {} (in flight: {:?})",
                info.devices.len(),
                self.devices,
                self.in_flight
            )));
        }
        let failed_ok = match self.in_flight {
            InFlight::FailDevice => {
                failed.len() == self.failed_devices.len()
                    || failed.len() == self.failed_devices.len() + 1
            }
            _ => failed.len() == self.failed_devices.len(),
        };
        if !failed_ok {
            return Err(self.fail(format!(
                "failed devices {failed:?} after the reopen, the model has {:?} (in flight: {:?})",
                self.failed_devices, self.in_flight
            )));
        }
        self.devices = info.devices.len();
        self.failed_devices = failed;

        for name in listed.keys() {
            let known = name
                .strip_prefix('v')
                .and_then(|u| u.parse::<u64>().ok())
                .is_some_and(|uid| self.volumes.contains_key(&uid));
            if !known {
                return Err(self.fail(format!("unknown volume {name} after the reopen")));
            }
        }
        let uids: Vec<u64> = self.volumes.keys().copied().collect();
        let mut checked = 0;
        for uid in uids {
            let name = self.volumes[&uid].name();
            let optional =
                matches!(self.in_flight, InFlight::Create(u) | InFlight::Delete(u) if u == uid);
            let Some(&(size, _)) = listed.get(&name) else {
                if optional {
                    self.volumes.remove(&uid);
                    continue;
                }
                return Err(self.fail(format!("volume {name} is gone after the reopen")));
            };
            let model_size = self.volumes[&uid].size;
            let size_ok = match self.in_flight {
                InFlight::Resize { uid: u, old, new } if u == uid => size == old || size == new,
                _ => size == model_size,
            };
            if !size_ok {
                return Err(self.fail(format!(
                    "volume {name} is {size} bytes after the reopen, the model has {model_size} (in flight: {:?})",
                    self.in_flight
                )));
            }
            self.set_size(uid, size);
            checked += self.check_volume(store, uid)?;
        }
        self.in_flight = InFlight::None;
        Ok(checked)
    }

    fn check_volume(&mut self, store: &Store, uid: u64) -> Result<u64, String> {
        let name = self.volumes[&uid].name();
        let vol = store
            .open_volume(&name)
            .map_err(|e| self.fail(format!("open {name}: {e}")))?;
        let size = self.volumes[&uid].size;
        let chunk = 256 * KIB;
        let mut buf = vec![0u8; chunk as usize];
        let mut checked = 0;
        let mut off = 0;
        while off < size {
            let n = chunk.min(size - off);
            let buf = &mut buf[..n as usize];
            if let Err(e) = vol.read_at(off, buf) {
                return Err(self.fail(format!("read {name} at {off}: {e}")));
            }
            for (i, s) in buf.chunks_exact(SECTOR as usize).enumerate() {
                let index = off / SECTOR + i as u64;
                let found = decode(s);
                let sector = &self.volumes[&uid].sectors[index as usize];
                let version = match found {
                    Found::Zeros => Some(0),
                    Found::Version {
                        uid: u,
                        index: x,
                        version,
                    } if u == uid && x == index => Some(version),
                    _ => None,
                };
                if !version.is_some_and(|v| sector.allowed().any(|a| a == v)) {
                    let mut allowed = String::new();
                    for a in sector.allowed() {
                        let _ = write!(allowed, "{a} ");
                    }
                    return Err(self.fail(format!(
                        "volume {name} (replicas {}) sector {index} (byte {}): allowed versions [{}] \
                         (durable {}, 0 = zeros), found {found:?}",
                        self.volumes[&uid].replicas,
                        index * SECTOR,
                        allowed.trim_end(),
                        sector.durable
                    )));
                }
                if sector.durable != 0 {
                    checked += 1;
                }
                let model = self.volumes.get_mut(&uid).unwrap();
                let s = &mut model.sectors[index as usize];
                s.durable = version.unwrap_or(0);
                s.later.clear();
            }
            off += n;
        }
        Ok(checked)
    }

    /// Runs `cuts` power cuts; `Err`: the first failure.
    fn run(&mut self, cuts: u64, totals: &mut Totals) -> Result<(), String> {
        let mut store =
            Store::open_simulated(&self.pool).map_err(|e| self.fail(format!("first open: {e}")))?;
        if let Some(d) = store.pool_info().devices.iter().find(|d| !d.checksums) {
            return Err(self.fail(format!("device {} has no checksums", d.id)));
        }
        for cycle in 0..cuts {
            self.cycle = cycle;
            self.run_until_cut(&store)?;
            drop(store);
            let seed = self.rng.next_u64();
            let report = self.pool.resolve_cut(seed);
            self.note(|| format!("cut resolved: {report:?}"));
            // One reopen in eight loses power again inside recovery (the startup punch, the
            // replica resync, the commit of `clean = 0`): the next reopen must still work.
            if self.rng.below(8) == 0 {
                self.pool.power().cut_after(1 + self.rng.below(40));
                let interrupted = Store::open_simulated(&self.pool);
                let what = match &interrupted {
                    Ok(_) => "opened".to_string(),
                    Err(e) => e.to_string(),
                };
                self.note(|| format!("reopen with a cut: {what}"));
                if self.pool.power().is_off() {
                    totals.recovery_cuts += 1;
                } else {
                    // Recovery needed fewer operations than the cut: no cut this time.
                    self.pool.power().disarm();
                }
                drop(interrupted);
                let seed = self.rng.next_u64();
                self.pool.resolve_cut(seed);
            }
            store = Store::open_simulated(&self.pool)
                .map_err(|e| self.fail(format!("reopen after the cut: {e}")))?;
            totals.checked += self.check(&store)?;
            // Every block read back verified against its checksum on every device: a torn
            // write since the last sync was recomputed at the reopen (the write-intent
            // bitmap), never served as a checksum error nor silently repaired from a copy.
            let errors: u64 = store.device_stats().iter().map(|d| d.checksum_errors).sum();
            if errors > 0 {
                return Err(self.fail(format!(
                    "{errors} block(s) failed checksum verification after the reopen"
                )));
            }
            totals.cuts += 1;
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Discard {
    Trim,
    Zeroes,
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={v} is not a number")))
}

fn fresh_seed(i: usize) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    SimRng::new(nanos ^ (i as u64).rotate_left(32)).next_u64()
}

/// The seeds of a run and the cuts of each.
fn plan(total: u64) -> Vec<(u64, u64)> {
    if let Some(seed) = env_u64("HEADROOM_POWER_CUT_SEED") {
        return vec![(seed, total)];
    }
    let mut seeds: Vec<u64> = FIXED_SEEDS.to_vec();
    seeds.extend((0..FRESH_SEEDS).map(fresh_seed));
    let per = total.div_ceil(seeds.len() as u64);
    seeds.into_iter().map(|s| (s, per)).collect()
}

#[test]
fn acknowledged_data_survives_power_cuts() {
    let total = env_u64("HEADROOM_POWER_CUT_CUTS").unwrap_or(DEFAULT_CUTS);
    let started = std::time::Instant::now();
    let mut totals = Totals::default();
    for (seed, cuts) in plan(total) {
        eprintln!("power cut seed {seed:#x}: {cuts} cuts");
        let mut driver = Driver::new(seed);
        if let Err(e) = driver.run(cuts, &mut totals) {
            panic!("{e}");
        }
    }
    eprintln!(
        "power cuts: {} (and {} inside recovery), acknowledged blocks checked: {}, lost: 0 ({:.1} s)",
        totals.cuts,
        totals.recovery_cuts,
        totals.checked,
        started.elapsed().as_secs_f64()
    );
    assert!(totals.cuts >= total, "{} cuts of {total}", totals.cuts);
    assert!(totals.checked > 0, "no durable sector was ever checked");
}

/// Runs the fixed seeds with `mutant` on until the simulation fails; the cuts it took.
fn cuts_to_catch(mutant: Mutant) -> Option<(u64, String)> {
    mutants::set(Some(mutant));
    let mut spent = 0;
    let mut caught = None;
    let budget = DEFAULT_CUTS;
    for &seed in FIXED_SEEDS {
        let mut totals = Totals::default();
        let per = budget.div_ceil(FIXED_SEEDS.len() as u64);
        let result = Driver::new(seed).run(per, &mut totals);
        spent += totals.cuts;
        if let Err(e) = result {
            caught = Some((spent + 1, e));
            break;
        }
    }
    mutants::set(None);
    caught
}

#[test]
fn skipping_the_device_sync_before_the_commit_is_caught() {
    let (cuts, failure) = cuts_to_catch(Mutant::SkipDeviceSync)
        .expect("the simulation did not catch a commit that never syncs the devices");
    eprintln!("mutant SkipDeviceSync caught after {cuts} cuts: {failure}");
}

#[test]
fn skipping_the_durable_write_intent_bit_is_caught() {
    let (cuts, failure) = cuts_to_catch(Mutant::SkipBitmapWrite)
        .expect("the simulation did not catch writes whose write-intent bit never became durable");
    eprintln!("mutant SkipBitmapWrite caught after {cuts} cuts: {failure}");
}

#[test]
fn committing_the_metadata_before_the_device_sync_is_caught() {
    let (cuts, failure) = cuts_to_catch(Mutant::SyncAfterCommit)
        .expect("the simulation did not catch a commit that syncs the devices after redb");
    eprintln!("mutant SyncAfterCommit caught after {cuts} cuts: {failure}");
}

/// Writes 4 KiB into a new extent, FLUSHes, overwrites the block without a FLUSH and cuts
/// the power; after the reopen the block must read (no checksum error) and hold one of the
/// two versions in each sector. The new extent's write-intent bit is written without a sync
/// of its own at allocation and made durable by the FLUSH's commit; if it were not durable,
/// the unclean start would not recompute the extent's entries, and a cut that kept the
/// overwrite's data but not its entries (or the reverse) would read as a checksum error.
fn overwrite_after_a_new_extents_flush_survives_a_cut(seed: u64) -> Result<(), String> {
    let pool = SimPool::new(1, DEVICE_BYTES);
    let (a, b) = (vec![0xa5u8; 4096], vec![0x5au8; 4096]);
    let at = EXTENT_SIZE_BYTES + 8 * 4096;
    {
        let store = Store::open_simulated(&pool).map_err(|e| e.to_string())?;
        store
            .create_volume("v", 4 * EXTENT_SIZE_BYTES)
            .map_err(|e| e.to_string())?;
        let v = store.open_volume("v").map_err(|e| e.to_string())?;
        v.write_at(at, &a, false).map_err(|e| e.to_string())?;
        v.flush().map_err(|e| e.to_string())?;
        v.write_at(at, &b, false).map_err(|e| e.to_string())?;
        pool.power().cut_after(1);
    }
    pool.resolve_cut(seed);
    let store = Store::open_simulated(&pool).map_err(|e| format!("reopen: {e}"))?;
    let v = store.open_volume("v").map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 4096];
    v.read_at(at, &mut buf)
        .map_err(|e| format!("seed {seed}: read after the cut: {e}"))?;
    for (i, s) in buf.chunks(SECTOR as usize).enumerate() {
        if s != &a[..SECTOR as usize] && s != &b[..SECTOR as usize] {
            return Err(format!("seed {seed}: sector {i} holds neither version"));
        }
    }
    Ok(())
}

#[test]
fn a_new_extents_write_intent_bit_is_durable_once_its_flush_returned() {
    for seed in 0..48 {
        overwrite_after_a_new_extents_flush_survives_a_cut(seed).unwrap();
    }
}

#[test]
fn a_new_extents_write_intent_bit_kept_in_memory_only_is_caught() {
    mutants::set(Some(Mutant::SkipBitmapWrite));
    let caught =
        (0..48).find_map(|seed| overwrite_after_a_new_extents_flush_survives_a_cut(seed).err());
    mutants::set(None);
    let failure = caught.expect("a new extent's bit that never reached the disk was not caught");
    eprintln!("caught: {failure}");
}
