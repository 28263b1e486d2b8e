//! Free-space bookkeeping and placement of new extents on the pool's devices.
//!
//! Why: placement decides how a volume's I/O spreads over devices. Following Flint's eVol
//! placement score (docs/background.md §2.3), a new extent of volume V goes to the healthy
//! device of the lowest cost
//!
//! ```text
//! cost(d) = 1.0 × share of V's extents already on d
//!         + 1.0 × fraction of d's extents in use
//!         + 1.5 × d's load (its telemetry: device time per second, at most 1)
//! ```
//!
//! ties broken by the most free extents, then the lowest device id. On equal idle devices this stripes a volume
//! round-robin (the share term) and fills emptier devices first (the fullness term); a
//! device busy with other volumes' I/O gets fewer new extents (the load term), so a new or
//! growing volume does not pile onto the device that is already the bottleneck. The weights
//! are Flint's (its busy term is a write cost; ours is measured time busy, which folds the
//! write cost in); Flint's fragmentation and preference terms have no counterpart here. The
//! load comes from `Store::observe_devices`, once per sampling interval; before any, and on
//! RAM devices (whose operations are not timed), it is 0. Within a device the lowest free
//! index is taken, which keeps used space dense and free space in long runs (cheap to punch
//! at startup). Free space is kept as runs of free extents (first index and length) with a
//! count per device, so the allocator's memory grows with how fragmented the free space is,
//! not with the device's size: an 8 PiB device costs one run, not a set of four billion
//! indexes built under the pool lock.
//!
//! Reserved extents (`reserve_prefix`: the first extent of a device signed by Headroom holds
//! its superblock, see `signature.rs`) are never free: never handed out, never punched by
//! the startup punch, and not counted in the device's total for the fullness term.
//!
//! Replicated volumes (`allocate_replicas`): the copies of one logical extent are placed
//! one after the other by the same cost, each avoiding the devices already chosen for that
//! extent, and first also every device in a failure domain already chosen (devices that
//! declare none are each their own domain). When the healthy devices with free space span
//! fewer domains than there are replicas, distinct devices are the fallback: two copies in
//! one domain still survive the loss of one device. The share term counts all of a volume's
//! copies, so replicas stripe like single copies do.
//!
//! This is plain state under the store's pool mutex: no I/O, no locking here.

use std::collections::{BTreeMap, HashMap};

use crate::layout::PhysExtent;

/// Weight of the share of the volume's extents already on a device.
pub(crate) const WEIGHT_VOLUME_SHARE: f64 = 1.0;
/// Weight of the fraction of a device's extents in use.
pub(crate) const WEIGHT_FULLNESS: f64 = 1.0;
/// Weight of a device's load (device time per second, capped at 1).
pub(crate) const WEIGHT_LOAD: f64 = 1.5;

/// One device's free extents as maximal runs (first index -> length) and their count: memory
/// grows with the number of runs (fragmentation), not with the device's size.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct FreeRuns {
    runs: BTreeMap<u32, u32>,
    count: u64,
}

impl FreeRuns {
    /// Extents `0..extent_count` free.
    fn all(extent_count: u32) -> FreeRuns {
        let mut runs = BTreeMap::new();
        if extent_count > 0 {
            runs.insert(0, extent_count);
        }
        FreeRuns {
            runs,
            count: u64::from(extent_count),
        }
    }

    fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn len(&self) -> u64 {
        self.count
    }

    /// Takes the lowest free index.
    fn pop_first(&mut self) -> Option<u32> {
        let (start, len) = self.runs.pop_first()?;
        if len > 1 {
            self.runs.insert(start + 1, len - 1);
        }
        self.count -= 1;
        Some(start)
    }

    /// Takes `index` if it is free; false if it is not.
    fn remove(&mut self, index: u32) -> bool {
        let Some((&start, &len)) = self.runs.range(..=index).next_back() else {
            return false;
        };
        let end = u64::from(start) + u64::from(len);
        if u64::from(index) >= end {
            return false;
        }
        self.runs.remove(&start);
        if index > start {
            self.runs.insert(start, index - start);
        }
        let after = (end - u64::from(index) - 1) as u32;
        if after > 0 {
            self.runs.insert(index + 1, after);
        }
        self.count -= 1;
        true
    }

    /// Frees `index`, merging it with the runs on either side; false if it was free already.
    fn insert(&mut self, index: u32) -> bool {
        let mut start = index;
        let mut len = 1u32;
        if let Some((&s, &l)) = self.runs.range(..=index).next_back() {
            let end = u64::from(s) + u64::from(l);
            if u64::from(index) < end {
                return false;
            }
            if end == u64::from(index) {
                self.runs.remove(&s);
                start = s;
                len += l;
            }
        }
        if let Some(next) = index.checked_add(1)
            && let Some(l) = self.runs.remove(&next)
        {
            len += l;
        }
        self.runs.insert(start, len);
        self.count += 1;
        true
    }

    /// Whether `index` is free.
    fn contains(&self, index: u32) -> bool {
        self.runs
            .range(..=index)
            .next_back()
            .is_some_and(|(&start, &len)| u64::from(index) < u64::from(start) + u64::from(len))
    }

    fn runs(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.runs.iter().map(|(&s, &l)| (s, l))
    }
}

#[derive(Debug)]
pub(crate) struct Allocator {
    /// Free extents per device, as runs.
    free: Vec<FreeRuns>,
    /// Extents per device, free or not (reserved extents excluded).
    totals: Vec<u32>,
    /// Extents per device of each volume (for the placement score).
    per_volume: HashMap<u64, Vec<u32>>,
    /// Each device's load in [0, 1] (`set_load`); 0 until measured.
    load: Vec<f64>,
    /// Each device's failure domain (`set_failure_domain`); `None`: its own domain.
    domains: Vec<Option<String>>,
}

impl Allocator {
    /// All extents of every device free; `extent_counts[d]` extents on device `d`.
    pub(crate) fn new(extent_counts: &[u32]) -> Allocator {
        Allocator {
            free: extent_counts.iter().map(|&n| FreeRuns::all(n)).collect(),
            totals: extent_counts.to_vec(),
            per_volume: HashMap::new(),
            load: vec![0.0; extent_counts.len()],
            domains: vec![None; extent_counts.len()],
        }
    }

    /// Declares device `d`'s failure domain (`None`: none, the device is its own domain).
    pub(crate) fn set_failure_domain(&mut self, d: usize, domain: Option<String>) {
        if let Some(slot) = self.domains.get_mut(d) {
            *slot = domain;
        }
    }

    /// The devices that share a declared failure domain with a device of `chosen` (a bit set),
    /// `chosen` included.
    fn same_domains(&self, chosen: u64) -> u64 {
        let mut set = chosen;
        for (d, domain) in self.domains.iter().enumerate() {
            if chosen & (1u64 << (d % 64)) == 0 {
                continue;
            }
            let Some(domain) = domain else { continue };
            for (other, od) in self.domains.iter().enumerate() {
                if od.as_ref() == Some(domain) {
                    set |= 1u64 << (other % 64);
                }
            }
        }
        set
    }

    /// Places `replicas` copies of one new logical extent of `volume_id` on distinct devices
    /// outside `avoid`, preferring distinct failure domains (see the module comment). All or
    /// nothing: `None` (and nothing taken) if fewer than `replicas` such devices have a free
    /// extent.
    pub(crate) fn allocate_replicas(
        &mut self,
        volume_id: u64,
        replicas: usize,
        avoid: u64,
    ) -> Option<Vec<PhysExtent>> {
        let mut out: Vec<PhysExtent> = Vec::with_capacity(replicas);
        let mut chosen = 0u64;
        for _ in 0..replicas {
            let phys = self
                .allocate_avoiding(volume_id, avoid | self.same_domains(chosen))
                .or_else(|| self.allocate_avoiding(volume_id, avoid | chosen));
            let Some(phys) = phys else {
                for p in out {
                    self.disown(volume_id, p);
                    self.release(p);
                }
                return None;
            };
            chosen |= 1u64 << (phys.device % 64);
            out.push(phys);
        }
        Some(out)
    }

    /// One new copy of an extent of `volume_id` whose other copies are on the devices in
    /// `holding` (a rebuild's replacement of a lost copy): outside `avoid` and `holding`,
    /// preferring a failure domain none of `holding` is in.
    pub(crate) fn allocate_replacement(
        &mut self,
        volume_id: u64,
        holding: u64,
        avoid: u64,
    ) -> Option<PhysExtent> {
        self.allocate_avoiding(volume_id, avoid | self.same_domains(holding))
            .or_else(|| self.allocate_avoiding(volume_id, avoid | holding))
    }

    /// A device added to the running pool (the next id), all of its extents free.
    pub(crate) fn add_device(&mut self, extent_count: u32, domain: Option<String>) {
        self.free.push(FreeRuns::all(extent_count));
        self.totals.push(extent_count);
        self.load.push(0.0);
        self.domains.push(domain);
    }

    /// Takes device `d`'s first `count` extents out of the free space for good (Headroom's own
    /// structures: the signature); they are never allocated nor punched. Call before
    /// `mark_used`. Returns false if one of them was not free.
    pub(crate) fn reserve_prefix(&mut self, d: usize, count: u32) -> bool {
        let Some(free) = self.free.get_mut(d) else {
            return count == 0;
        };
        let mut all = true;
        for index in 0..count {
            all &= free.remove(index);
        }
        if let Some(total) = self.totals.get_mut(d) {
            *total = total.saturating_sub(count);
        }
        all
    }

    /// Device `d`'s failure domain, if one was declared.
    pub(crate) fn failure_domain(&self, d: usize) -> Option<&str> {
        self.domains.get(d).and_then(|x| x.as_deref())
    }

    /// How many devices outside `avoid` have a free extent.
    pub(crate) fn devices_with_space(&self, avoid: u64) -> usize {
        (0..self.device_count())
            .filter(|&d| !self.free[d].is_empty() && avoid & (1u64 << (d % 64)) == 0)
            .count()
    }

    /// `volume_id`'s extents per device, as long as the device list.
    fn counts_mut(&mut self, volume_id: u64) -> &mut Vec<u32> {
        let n = self.device_count();
        let counts = self.per_volume.entry(volume_id).or_default();
        if counts.len() < n {
            counts.resize(n, 0);
        }
        counts
    }

    /// Sets the devices' loads (device time per second each, from their telemetry); values
    /// are clamped to [0, 1], missing devices count as idle.
    pub(crate) fn set_load(&mut self, load: &[f64]) {
        for (d, slot) in self.load.iter_mut().enumerate() {
            let value = load.get(d).copied().unwrap_or(0.0);
            *slot = if value.is_finite() {
                value.clamp(0.0, 1.0)
            } else {
                0.0
            };
        }
    }

    /// The placement cost of device `d` for a volume with `counts` extents per device
    /// (`mine_total` in all): lower is better.
    fn cost(&self, d: usize, counts: Option<&Vec<u32>>, mine_total: u32) -> f64 {
        let mine = counts.map_or(0, |c| c.get(d).copied().unwrap_or(0));
        let share = if mine_total == 0 {
            0.0
        } else {
            f64::from(mine) / f64::from(mine_total)
        };
        let total = self.totals.get(d).copied().unwrap_or(0).max(1);
        let used = u64::from(total).saturating_sub(self.free[d].len());
        let fullness = used as f64 / f64::from(total);
        WEIGHT_VOLUME_SHARE * share + WEIGHT_FULLNESS * fullness + WEIGHT_LOAD * self.load[d]
    }

    fn device_count(&self) -> usize {
        self.free.len()
    }

    /// Records an extent already owned by `volume_id` (loading metadata). Returns false if it
    /// is out of range or not free (mapped twice).
    pub(crate) fn mark_used(&mut self, volume_id: u64, phys: PhysExtent) -> bool {
        let Some(free) = self.free.get_mut(phys.device as usize) else {
            return false;
        };
        if !free.remove(phys.index) {
            return false;
        }
        self.counts_mut(volume_id)[phys.device as usize] += 1;
        true
    }

    /// Picks and takes a free extent for `volume_id`, or `None` when the pool is full.
    #[cfg(test)]
    pub(crate) fn allocate(&mut self, volume_id: u64) -> Option<PhysExtent> {
        self.allocate_avoiding(volume_id, 0)
    }

    /// Like `allocate`, on the devices whose bit is clear in `avoid` (failed devices).
    pub(crate) fn allocate_avoiding(&mut self, volume_id: u64, avoid: u64) -> Option<PhysExtent> {
        let counts = self.per_volume.get(&volume_id);
        let mine_total = counts.map_or(0, |c| c.iter().sum::<u32>());
        let device = (0..self.device_count())
            .filter(|&d| !self.free[d].is_empty() && avoid & (1u64 << (d % 64)) == 0)
            .map(|d| (self.cost(d, counts, mine_total), d))
            .min_by(|a, b| {
                a.0.total_cmp(&b.0)
                    .then_with(|| self.free[b.1].len().cmp(&self.free[a.1].len()))
                    .then(a.1.cmp(&b.1))
            })
            .map(|(_, d)| d)?;
        let index = self.free[device].pop_first()?;
        self.counts_mut(volume_id)[device] += 1;
        Some(PhysExtent {
            device: device as u32,
            index,
        })
    }

    /// `volume_id` no longer owns `phys` (the extent is not free yet: see `release`).
    pub(crate) fn disown(&mut self, volume_id: u64, phys: PhysExtent) {
        if let Some(c) = self
            .per_volume
            .get_mut(&volume_id)
            .and_then(|c| c.get_mut(phys.device as usize))
        {
            *c = c.saturating_sub(1);
        }
    }

    /// Forgets a deleted volume.
    pub(crate) fn forget_volume(&mut self, volume_id: u64) {
        self.per_volume.remove(&volume_id);
    }

    /// Returns `phys` to the free pool.
    pub(crate) fn release(&mut self, phys: PhysExtent) {
        if let Some(free) = self.free.get_mut(phys.device as usize) {
            let was_taken = free.insert(phys.index);
            // Freed twice is handed out twice later: two volumes on one extent. A release
            // build keeps the one free entry; a debug build stops at the second release.
            debug_assert!(was_taken, "extent {phys:?} released while already free");
        }
    }

    /// The first device in the bit set `devices` that holds an extent of `volume_id`.
    pub(crate) fn first_device_holding(&self, volume_id: u64, devices: u64) -> Option<usize> {
        let counts = self.per_volume.get(&volume_id)?;
        counts
            .iter()
            .enumerate()
            .find(|&(d, &n)| n > 0 && devices & (1u64 << (d % 64)) != 0)
            .map(|(d, _)| d)
    }

    /// Device `device`'s extents less its reserved ones.
    pub(crate) fn usable_extents(&self, device: usize) -> u64 {
        self.totals.get(device).map_or(0, |&n| u64::from(n))
    }

    /// Whether `phys` is in the free pool.
    pub(crate) fn is_free(&self, phys: PhysExtent) -> bool {
        self.free
            .get(phys.device as usize)
            .is_some_and(|f| f.contains(phys.index))
    }

    pub(crate) fn free_extents(&self, device: usize) -> u64 {
        self.free.get(device).map_or(0, FreeRuns::len)
    }

    pub(crate) fn total_free_extents(&self) -> u64 {
        self.free.iter().map(FreeRuns::len).sum()
    }

    /// Free extents of `device` as maximal contiguous runs (first index, count).
    pub(crate) fn free_runs(&self, device: usize) -> Vec<(u32, u32)> {
        self.free
            .get(device)
            .map(|f| f.runs().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_a_volume_over_devices() {
        let mut a = Allocator::new(&[4, 4]);
        let got: Vec<u32> = (0..4).map(|_| a.allocate(1).unwrap().device).collect();
        assert_eq!(got, vec![0, 1, 0, 1]);
        // Volume 2 starts where free space is largest: equal, so device 0; then alternates.
        let p = a.allocate(2).unwrap();
        assert_eq!(
            p,
            PhysExtent {
                device: 0,
                index: 2
            }
        );
        assert_eq!(a.allocate(2).unwrap().device, 1);
    }

    #[test]
    fn prefers_more_free_space_on_ties() {
        let mut a = Allocator::new(&[2, 6]);
        assert_eq!(a.allocate(7).unwrap().device, 1);
        assert_eq!(a.allocate(7).unwrap().device, 0);
        assert_eq!(a.allocate(9).unwrap().device, 1);
    }

    #[test]
    fn avoids_devices_and_finds_holders() {
        let mut a = Allocator::new(&[4, 4, 4]);
        let got: Vec<u32> = (0..4)
            .map(|_| a.allocate_avoiding(1, 0b010).unwrap().device)
            .collect();
        assert_eq!(got, vec![0, 2, 0, 2]);
        assert!(a.allocate_avoiding(1, 0b111).is_none());
        assert_eq!(a.first_device_holding(1, 0b110), Some(2));
        assert_eq!(a.first_device_holding(1, 0b010), None);
        assert_eq!(a.first_device_holding(9, 0b111), None);
    }

    #[test]
    fn a_busy_device_gets_fewer_new_extents() {
        // Device 0 saturated (load 1), device 1 idle: a new volume avoids device 0 until
        // its share of device 1 outweighs the load (1.5): all of the first extents go to 1.
        let mut a = Allocator::new(&[64, 64]);
        a.set_load(&[1.0, 0.0]);
        let got: Vec<u32> = (0..8).map(|_| a.allocate(1).unwrap().device).collect();
        assert_eq!(got, vec![1; 8]);
        // Half busy (0.75 of cost): the volume goes there only once device 1 holds well over
        // its share, so device 1 gets more of them.
        let mut a = Allocator::new(&[64, 64]);
        a.set_load(&[0.5, 0.0]);
        let got: Vec<u32> = (0..12).map(|_| a.allocate(1).unwrap().device).collect();
        let on_busy = got.iter().filter(|&&d| d == 0).count();
        assert!((1..6).contains(&on_busy), "{got:?}");
        // Idle again: back to striping.
        a.set_load(&[0.0, 0.0]);
        let got: Vec<u32> = (0..4).map(|_| a.allocate(2).unwrap().device).collect();
        assert_eq!(got, vec![0, 1, 0, 1]);
    }

    #[test]
    fn an_added_device_takes_new_extents_of_existing_volumes() {
        let mut a = Allocator::new(&[4]);
        for _ in 0..3 {
            assert_eq!(a.allocate(1).unwrap().device, 0);
        }
        a.add_device(4, None);
        assert_eq!(a.free_extents(1), 4);
        // Emptier, and volume 1 holds nothing there: the next extents go to device 1 until
        // the volume's share evens out.
        assert_eq!(a.allocate(1).unwrap().device, 1);
        assert_eq!(a.allocate(1).unwrap().device, 1);
        assert_eq!(a.first_device_holding(1, 0b10), Some(1));
        a.disown(
            1,
            PhysExtent {
                device: 1,
                index: 0,
            },
        );
    }

    #[test]
    fn loads_are_clamped_and_missing_ones_are_idle() {
        let mut a = Allocator::new(&[4, 4, 4]);
        a.set_load(&[f64::NAN, 7.0]);
        assert_eq!(a.load, vec![0.0, 1.0, 0.0]);
        a.set_load(&[-1.0, 0.25, f64::INFINITY]);
        assert_eq!(a.load, vec![0.0, 0.25, 0.0]);
    }

    #[test]
    fn exhausts_then_reuses_released() {
        let mut a = Allocator::new(&[1, 1]);
        let x = a.allocate(1).unwrap();
        let y = a.allocate(1).unwrap();
        assert_ne!(x, y);
        assert!(a.allocate(1).is_none());
        assert_eq!(a.total_free_extents(), 0);
        a.disown(1, x);
        a.release(x);
        assert_eq!(a.allocate(2), Some(x));
    }

    #[test]
    fn mark_used_detects_double_mapping_and_runs_coalesce() {
        let mut a = Allocator::new(&[8]);
        assert!(a.mark_used(
            1,
            PhysExtent {
                device: 0,
                index: 3
            }
        ));
        assert!(!a.mark_used(
            2,
            PhysExtent {
                device: 0,
                index: 3
            }
        ));
        assert!(!a.mark_used(
            2,
            PhysExtent {
                device: 1,
                index: 0
            }
        ));
        assert!(!a.mark_used(
            2,
            PhysExtent {
                device: 0,
                index: 8
            }
        ));
        assert_eq!(a.free_runs(0), vec![(0, 3), (4, 4)]);
        assert_eq!(a.free_extents(0), 7);
    }

    #[test]
    fn replicas_go_to_distinct_devices_and_stripe() {
        let mut a = Allocator::new(&[8, 8, 8]);
        let mut per_device = [0; 3];
        for _ in 0..6 {
            let got = a.allocate_replicas(1, 2, 0).unwrap();
            assert_eq!(got.len(), 2);
            assert_ne!(got[0].device, got[1].device, "{got:?}");
            for p in got {
                per_device[p.device as usize] += 1;
            }
        }
        assert_eq!(per_device, [4, 4, 4]);
        let got = a.allocate_replicas(1, 3, 0).unwrap();
        let mut devices: Vec<u32> = got.iter().map(|p| p.device).collect();
        devices.sort_unstable();
        assert_eq!(devices, vec![0, 1, 2]);
    }

    #[test]
    fn replicas_prefer_distinct_failure_domains_then_distinct_devices() {
        // Devices 0 and 1 in rack a, 2 in rack b: every extent gets one copy in each rack.
        let mut a = Allocator::new(&[8, 8, 8]);
        a.set_failure_domain(0, Some("a".into()));
        a.set_failure_domain(1, Some("a".into()));
        a.set_failure_domain(2, Some("b".into()));
        for _ in 0..6 {
            let got = a.allocate_replicas(1, 2, 0).unwrap();
            let on_b = got.iter().filter(|p| p.device == 2).count();
            assert_eq!(on_b, 1, "{got:?}");
        }
        // Three replicas over two domains: distinct devices, both domains used.
        let got = a.allocate_replicas(2, 3, 0).unwrap();
        let mut devices: Vec<u32> = got.iter().map(|p| p.device).collect();
        devices.sort_unstable();
        assert_eq!(devices, vec![0, 1, 2]);
    }

    #[test]
    fn an_8_pib_class_device_costs_one_run() {
        // u32::MAX extents of 2 MiB: 8 PiB. Building it, allocating from it, reserving its
        // first extent and releasing in the middle touch a handful of runs, not 4 billion
        // entries (this test would take minutes and tens of GiB with a set of indexes).
        let mut a = Allocator::new(&[u32::MAX, 4]);
        assert_eq!(a.free_runs(0), vec![(0, u32::MAX)]);
        assert!(a.reserve_prefix(0, 1));
        assert_eq!(a.free_runs(0), vec![(1, u32::MAX - 1)]);
        assert_eq!(a.free_extents(0), u64::from(u32::MAX) - 1);
        let p = a.allocate_avoiding(1, 0b10).unwrap();
        assert_eq!((p.device, p.index), (0, 1));
        assert!(a.mark_used(
            1,
            PhysExtent {
                device: 0,
                index: 1 << 31
            }
        ));
        assert_eq!(
            a.free_runs(0),
            vec![
                (2, (1 << 31) - 2),
                ((1 << 31) + 1, u32::MAX - (1 << 31) - 1)
            ]
        );
        a.release(PhysExtent {
            device: 0,
            index: 1 << 31,
        });
        a.release(p);
        assert_eq!(a.free_runs(0), vec![(1, u32::MAX - 1)]);
        assert!(a.free[0].runs.len() <= 1);
    }

    #[test]
    fn reserved_extents_are_never_handed_out_nor_free() {
        let mut a = Allocator::new(&[3, 3]);
        assert!(a.reserve_prefix(0, 1));
        assert!(a.reserve_prefix(1, 1));
        assert_eq!(a.free_runs(0), vec![(1, 2)]);
        let mut got: Vec<(u32, u32)> = (0..4)
            .map(|_| a.allocate(1).map(|p| (p.device, p.index)).unwrap())
            .collect();
        got.sort_unstable();
        assert_eq!(got, vec![(0, 1), (0, 2), (1, 1), (1, 2)]);
        assert!(a.allocate(1).is_none());
        // Marking a reserved extent used (a map that points into the signature) is refused.
        assert!(!a.mark_used(
            2,
            PhysExtent {
                device: 0,
                index: 0
            }
        ));
    }

    #[test]
    fn runs_match_a_set_of_indexes() {
        // The run bookkeeping against the obvious model, over a fixed pseudo-random sequence.
        let mut runs = FreeRuns::all(64);
        let mut set: std::collections::BTreeSet<u32> = (0..64).collect();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..4000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = (x % 70) as u32;
            match x % 3 {
                0 => assert_eq!(runs.remove(i), set.remove(&i)),
                1 => assert_eq!(runs.insert(i), set.insert(i)),
                _ => assert_eq!(runs.pop_first(), set.pop_first()),
            }
            assert_eq!(runs.len(), set.len() as u64);
            let mut expect: Vec<(u32, u32)> = Vec::new();
            for &i in &set {
                match expect.last_mut() {
                    Some((s, c)) if *s + *c == i => *c += 1,
                    _ => expect.push((i, 1)),
                }
            }
            assert_eq!(runs.runs().collect::<Vec<_>>(), expect);
        }
    }

    #[test]
    fn replicas_are_all_or_nothing() {
        let mut a = Allocator::new(&[1, 4]);
        assert!(a.allocate_replicas(1, 2, 0).is_some());
        // Device 0 is full: one device with space cannot hold two copies; nothing is taken.
        assert_eq!(a.devices_with_space(0), 1);
        assert!(a.allocate_replicas(1, 2, 0).is_none());
        assert_eq!(a.free_extents(1), 3);
        // A failed device is avoided too.
        let mut a = Allocator::new(&[4, 4, 4]);
        for _ in 0..4 {
            let got = a.allocate_replicas(1, 2, 0b001).unwrap();
            assert!(got.iter().all(|p| p.device != 0));
        }
        assert!(a.allocate_replicas(1, 2, 0b001).is_none());
        assert_eq!(a.free_extents(0), 4);
    }
}
