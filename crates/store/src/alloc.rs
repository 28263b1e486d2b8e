//! Free-space bookkeeping and placement of new extents on the pool's devices.
//!
//! Why: placement decides how a volume's I/O spreads over devices. Following Flint's eVol
//! placement score (docs/background.md §2.3) without its telemetry terms, a new extent of volume V goes
//! to the device holding the fewest extents of V, ties broken by the most free extents, then
//! by the lowest device id. This stripes a volume round-robin across equal devices and fills
//! emptier devices first. Within a device the lowest free index is taken, which keeps used
//! space dense and free space in long runs (cheap to punch at startup).
//!
//! This is plain state under the store's pool mutex: no I/O, no locking here.

use std::collections::{BTreeSet, HashMap};

use crate::layout::PhysExtent;

#[derive(Debug)]
pub(crate) struct Allocator {
    /// Free extent indexes per device.
    free: Vec<BTreeSet<u32>>,
    /// Extents per device of each volume (for the placement score).
    per_volume: HashMap<u64, Vec<u32>>,
}

impl Allocator {
    /// All extents of every device free; `extent_counts[d]` extents on device `d`.
    pub(crate) fn new(extent_counts: &[u32]) -> Allocator {
        Allocator {
            free: extent_counts.iter().map(|&n| (0..n).collect()).collect(),
            per_volume: HashMap::new(),
        }
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
        if !free.remove(&phys.index) {
            return false;
        }
        let n = self.device_count();
        self.per_volume
            .entry(volume_id)
            .or_insert_with(|| vec![0; n])[phys.device as usize] += 1;
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
        let device = (0..self.device_count())
            .filter(|&d| !self.free[d].is_empty() && avoid & (1u64 << (d % 64)) == 0)
            .min_by_key(|&d| {
                let mine = counts.map_or(0, |c| c[d]);
                (mine, std::cmp::Reverse(self.free[d].len()), d)
            })?;
        let index = self.free[device].pop_first()?;
        let n = self.device_count();
        self.per_volume
            .entry(volume_id)
            .or_insert_with(|| vec![0; n])[device] += 1;
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
            free.insert(phys.index);
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

    pub(crate) fn free_extents(&self, device: usize) -> u64 {
        self.free.get(device).map_or(0, |f| f.len() as u64)
    }

    pub(crate) fn total_free_extents(&self) -> u64 {
        self.free.iter().map(|f| f.len() as u64).sum()
    }

    /// Free extents of `device` as maximal contiguous runs (first index, count).
    pub(crate) fn free_runs(&self, device: usize) -> Vec<(u32, u32)> {
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for &i in self.free.get(device).into_iter().flatten() {
            match runs.last_mut() {
                Some((start, count)) if *start + *count == i => *count += 1,
                _ => runs.push((i, 1)),
            }
        }
        runs
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
}
