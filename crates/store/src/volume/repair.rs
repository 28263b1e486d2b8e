//! Repair of replicated volumes: the store's half of a rebuild (copy a lost copy of an extent
//! onto a healthy device and swap it into the map, durably) and of a scrub (verify every
//! block's checksum on every copy and repair bad blocks from a good copy; compare the copies of
//! every extent, repair a minority from the majority). Pure store code without threads of
//! its own: the node's rebuild task decides when and how fast (it paces each call through the
//! scheduler), so the repair rate follows a QoS setting rather than a loop here.

use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use super::Volume;
use crate::checksum::{BLOCK_BYTES, BLOCKS_PER_EXTENT};
use crate::error::StoreError;
use crate::layout::{EXTENT_SIZE_BYTES, PENDING_BIT, PhysExtent};
use crate::store::Change;
use crate::sync::{lock, read};

/// Granularity of the copy of a rebuild and of a scrub's comparison (and repair).
pub const REPAIR_CHUNK_BYTES: usize = 64 * 1024;

/// What `Volume::rebuild_extent` did with one logical extent.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RebuildStep {
    /// Every copy is on a healthy device (or the extent is not allocated): nothing to do.
    Complete,
    /// A lost copy was rebuilt on a healthy device: `bytes` were read from a surviving copy.
    Rebuilt { bytes: u64 },
    /// No healthy device outside the extent's other copies has a free extent: the volume
    /// stays degraded.
    NoPlacement,
    /// No copy is on a healthy device: the data of this extent is lost.
    Lost,
}

/// The result of `Volume::scrub`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScrubReport {
    /// Allocated logical extents whose healthy copies were compared.
    pub extents_checked: u64,
    /// 64 KiB chunks whose copies disagreed.
    pub mismatches: u64,
    /// Of those, chunks rewritten from the majority (3 copies); with 2 copies that disagree
    /// there is no majority and nothing is rewritten.
    pub repaired: u64,
    /// 4 KiB blocks read and verified against their checksums (every copy on a device with
    /// checksums).
    #[serde(default)]
    pub blocks_verified: u64,
    /// Blocks (of any copy) that failed checksum verification.
    #[serde(default)]
    pub checksum_mismatches: u64,
    /// Of those, blocks rewritten from a copy whose block verifies.
    #[serde(default)]
    pub checksum_repaired: u64,
    /// Of those, blocks no copy of which verifies (1-replica volumes, or every copy bad): a
    /// read of them answers EIO.
    #[serde(default)]
    pub unrepairable: u64,
}

impl ScrubReport {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &ScrubReport) {
        self.extents_checked += other.extents_checked;
        self.mismatches += other.mismatches;
        self.repaired += other.repaired;
        self.blocks_verified += other.blocks_verified;
        self.checksum_mismatches += other.checksum_mismatches;
        self.checksum_repaired += other.checksum_repaired;
        self.unrepairable += other.unrepairable;
    }
}

impl Volume {
    /// Logical extents of this volume with a copy on a failed device, in order: the work of
    /// a rebuild. Empty for a healthy volume.
    pub fn extents_to_rebuild(&self) -> Vec<u64> {
        let failed = self.shared.failed_devices();
        if failed.is_empty() {
            return Vec::new();
        }
        let st = read(&self.state);
        let mut out: Vec<u64> = Vec::new();
        for map in st.maps() {
            out.extend(
                map.allocated_in(0, map.extent_count())
                    .filter(|&(_, e)| {
                        PhysExtent::from_entry(e).is_some_and(|p| self.device_failed(p))
                    })
                    .map(|(i, _)| i),
            );
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The allocated logical extents (of replica 0, which every copy mirrors), in order,
    /// read under the state lock once: what a scrub (the node's background one too) or a
    /// restore's resync walks.
    pub fn allocated_extents(&self) -> Vec<u64> {
        let st = read(&self.state);
        st.map
            .allocated_in(0, st.map.extent_count())
            .map(|(i, _)| i)
            .collect()
    }

    /// Marks a rebuild of this volume as running or not (its driver's call): while it runs, a
    /// degraded volume reports `Rebuilding`.
    pub fn set_rebuilding(&self, running: bool) {
        self.rebuilding.store(running, Ordering::Release);
    }

    /// Rebuilds the copies of logical extent `extent` that are on failed devices: for each,
    /// a new physical extent on a healthy device that holds no other copy of it (another
    /// failure domain first), the data copied from a healthy copy, the device synced, the map
    /// entry swapped and the swap committed. The copy holds the extent's stripe lock
    /// (`copy_lock`) throughout, so a client write to this extent waits for it (one extent's
    /// copy) and then reaches the new copy too: the copies cannot diverge. The lost physical
    /// extent is dropped from the volume's accounting, never reused (its device is gone).
    pub fn rebuild_extent(&self, extent: u64) -> Result<RebuildStep, StoreError> {
        let mut bytes = 0u64;
        loop {
            match self.rebuild_one_copy(extent)? {
                RebuildStep::Rebuilt { bytes: b } => bytes += b,
                RebuildStep::Complete if bytes > 0 => return Ok(RebuildStep::Rebuilt { bytes }),
                other => return Ok(other),
            }
        }
    }

    fn rebuild_one_copy(&self, extent: u64) -> Result<RebuildStep, StoreError> {
        let swapped = {
            let st = read(&self.state);
            self.check_live()?;
            let _ordered = self.copy_lock(extent);
            let copies: Vec<(usize, PhysExtent)> = st
                .maps()
                .enumerate()
                .filter_map(|(r, m)| PhysExtent::from_entry(m.get(extent)).map(|p| (r, p)))
                .collect();
            let Some(&(lost_replica, lost)) = copies.iter().find(|(_, p)| self.device_failed(*p))
            else {
                return Ok(RebuildStep::Complete);
            };
            let Some(&(_, source)) = copies.iter().find(|(_, p)| !self.device_failed(*p)) else {
                return Ok(RebuildStep::Lost);
            };
            let holding = copies
                .iter()
                .fold(0u64, |acc, (_, p)| acc | 1u64 << (p.device % 64));
            let avoid = self.shared.failed_devices();
            let Some(target) = lock(&self.shared.pool)
                .allocator
                .allocate_replacement(self.id, holding, avoid.0)
            else {
                return Ok(RebuildStep::NoPlacement);
            };
            let copied = self.copy_extent(source, target);
            if let Err(e) = copied {
                // The target may hold part of the data: punch it before it is free again.
                let reusable = self
                    .shared
                    .device(target)
                    .and_then(|d| Ok(d.punch_extents(target.index, 1)?))
                    .is_ok();
                let mut pool = lock(&self.shared.pool);
                pool.allocator.disown(self.id, target);
                if reusable {
                    pool.allocator.release(target);
                } else {
                    pool.leaked += 1;
                }
                return Err(e);
            }
            let Some(slot) = st
                .map_of(lost_replica)
                .and_then(|m| m.existing_slot(extent))
            else {
                return Err(StoreError::NotFound(format!(
                    "replica {lost_replica} of volume {}",
                    self.name
                )));
            };
            // Under the read lock nothing released the extent; under the stripe lock nothing
            // else swapped it: the slot still holds the lost copy.
            let mut pool = lock(&self.shared.pool);
            slot.store(target.to_entry() | PENDING_BIT, Ordering::Release);
            pool.allocator.disown(self.id, lost);
            // The lost copy is mapped by nothing now but not free: leaked until a restart
            // punches it or `Store::restore_device` reclaims it.
            pool.leaked += 1;
            pool.pending.push(Change::Alloc {
                volume: self.me.clone(),
                volume_id: self.id,
                replica: lost_replica as u8,
                extent,
                phys: target,
            });
            tracing::info!(volume = %self.name, extent, replica = lost_replica, from = lost.device, to = target.device, "rebuilt a lost copy");
            EXTENT_SIZE_BYTES
        };
        // Durable swap (outside the volume's locks: the commit clears pending bits under them).
        self.shared.commit(&[], false)?;
        Ok(RebuildStep::Rebuilt { bytes: swapped })
    }

    /// Copies physical extent `source` to `target` (which reads zeros: a free extent) chunk
    /// by chunk, skipping chunks of zeros, and syncs `target`'s device.
    fn copy_extent(&self, source: PhysExtent, target: PhysExtent) -> Result<(), StoreError> {
        let src = self.shared.device(source)?;
        let dst = self.shared.device(target)?;
        // The new copy's blocks, as for any new extent (`Device::reserve`).
        dst.reserve(target.index)?;
        let mut buf = vec![0u8; REPAIR_CHUNK_BYTES];
        let mut off = 0u64;
        while off < EXTENT_SIZE_BYTES {
            src.read(source.index, off, &mut buf)?;
            if buf.iter().any(|&b| b != 0) {
                dst.write(target.index, off, &buf)?;
            }
            off += REPAIR_CHUNK_BYTES as u64;
        }
        dst.sync_now()?;
        Ok(())
    }

    /// Scrubs every allocated extent (`scrub_extent`, one after the other) and sums the
    /// reports. Synchronous: one extent's copies are read at a time.
    pub fn scrub(&self) -> Result<ScrubReport, StoreError> {
        let mut report = ScrubReport::default();
        for extent in self.allocated_extents() {
            report.add(&self.scrub_extent(extent)?);
        }
        Ok(report)
    }

    /// Scrubs logical extent `extent` (a step a paced caller can drive, like
    /// `rebuild_extent`), under its stripe lock so a client write is never half seen:
    ///
    /// 1. every copy on a healthy device is read below the page cache and each 4 KiB block
    ///    verified against its checksum (devices with checksums); a block that fails is
    ///    rewritten from a copy whose block verifies, or counted unrepairable (1 copy, or every
    ///    copy bad);
    /// 2. then the copies are compared 64 KiB at a time: a chunk that a strict majority of
    ///    copies agree on is rewritten on the others (3 copies); two copies that disagree (and
    ///    both verify) are reported, not repaired.
    pub fn scrub_extent(&self, extent: u64) -> Result<ScrubReport, StoreError> {
        let mut report = ScrubReport::default();
        let st = read(&self.state);
        self.check_live()?;
        let _ordered = self.copy_lock(extent);
        let copies: Vec<PhysExtent> = st
            .maps()
            .filter_map(|m| PhysExtent::from_entry(m.get(extent)))
            .filter(|p| !self.device_failed(*p))
            .collect();
        if copies.is_empty() {
            return Ok(report);
        }
        let mut bufs: Vec<Vec<u8>> = copies
            .iter()
            .map(|_| vec![0u8; EXTENT_SIZE_BYTES as usize])
            .collect();
        let mut bad: Vec<Vec<u64>> = Vec::with_capacity(copies.len());
        for (p, buf) in copies.iter().zip(bufs.iter_mut()) {
            let d = self.shared.device(*p)?;
            bad.push(d.verify_extent(p.index, buf)?);
            if d.has_checksums() {
                report.blocks_verified += BLOCKS_PER_EXTENT;
            }
        }
        let mut touched = false;
        let bs = BLOCK_BYTES as usize;
        for i in 0..copies.len() {
            for &b in &bad[i].clone() {
                report.checksum_mismatches += 1;
                let good = (0..copies.len()).find(|&j| j != i && !bad[j].contains(&b));
                let Some(j) = good else {
                    tracing::error!(volume = %self.name, extent, block = b, device = copies[i].device, "scrub: a block fails checksum verification and no copy of it verifies");
                    report.unrepairable += 1;
                    continue;
                };
                let range = b as usize * bs..(b as usize + 1) * bs;
                let block = bufs[j][range.clone()].to_vec();
                let d = self.shared.device(copies[i])?;
                d.write(copies[i].index, range.start as u64, &block)?;
                d.note_repaired(1);
                bufs[i][range].copy_from_slice(&block);
                bad[i].retain(|&x| x != b);
                report.checksum_repaired += 1;
                touched = true;
                tracing::warn!(volume = %self.name, extent, block = b, device = copies[i].device, "scrub: rewrote a block that failed checksum verification from a good copy");
            }
        }
        report.extents_checked += 1;
        let n = copies.len();
        for k in 0..(EXTENT_SIZE_BYTES as usize / REPAIR_CHUNK_BYTES) {
            if n < 2 {
                break;
            }
            let range = k * REPAIR_CHUNK_BYTES..(k + 1) * REPAIR_CHUNK_BYTES;
            let chunk = |i: usize| &bufs[i][range.clone()];
            if (1..n).all(|i| chunk(i) == chunk(0)) {
                continue;
            }
            report.mismatches += 1;
            let majority =
                (0..n).find(|&i| (0..n).filter(|&j| chunk(j) == chunk(i)).count() * 2 > n);
            let Some(m) = majority else {
                tracing::warn!(volume = %self.name, extent, chunk = k, "scrub: copies disagree and no majority");
                continue;
            };
            let good = chunk(m).to_vec();
            for i in (0..n).filter(|&i| chunk(i) != good.as_slice()) {
                let p = copies[i];
                let d = self.shared.device(p)?;
                if good.iter().all(|&b| b == 0) {
                    d.punch(p.index, range.start as u64, REPAIR_CHUNK_BYTES as u64)?;
                } else {
                    d.write(p.index, range.start as u64, &good)?;
                }
                touched = true;
            }
            tracing::warn!(volume = %self.name, extent, chunk = k, "scrub: repaired a chunk from the majority");
            report.repaired += 1;
        }
        drop(_ordered);
        drop(st);
        if touched {
            self.shared.commit(&[], false)?;
        }
        Ok(report)
    }
}
