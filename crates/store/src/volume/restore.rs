//! A volume's half of returning a failed device to service (`Store::restore_device`): which
//! physical extents of the device the volume still maps, and making the volume's copies on
//! the device equal to a healthy copy again. Why apart from `repair.rs`: a rebuild moves a
//! lost copy elsewhere, a restore brings the old copy back up to date in place; they share
//! the stripe locks and the chunk size, not the steps.
//!
//! While a device's copies are being brought up to date, the volume has the device in
//! `stale_devices`: writes reach the copies there (the device is in service), reads try the
//! other copies first (`Volume::route_read`), so nothing stale is returned. Each extent is
//! copied under its stripe lock (`copy_lock`), the lock every write to the copies holds, so a
//! write lands either before the copy (and is copied) or after it (and reaches every copy).

use std::sync::atomic::Ordering;

use super::Volume;
use super::repair::REPAIR_CHUNK_BYTES;
use crate::error::StoreError;
use crate::layout::{EXTENT_SIZE_BYTES, PhysExtent};
use crate::sync::read;

/// What `Volume::resync_copies_on` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Resync {
    /// Copies on the device compared with a healthy copy.
    pub extents_checked: u64,
    /// 64 KiB chunks that differed and were rewritten from the healthy copy.
    pub chunks_rewritten: u64,
    /// Copies with no other copy on a healthy device to compare with: left as they are.
    pub without_source: u64,
}

impl Volume {
    /// The physical extents of device `device` that any copy of this volume maps.
    pub(crate) fn extents_on(&self, device: u32) -> Vec<u32> {
        let st = read(&self.state);
        st.maps()
            .flat_map(|m| m.allocated_in(0, m.extent_count()))
            .filter_map(|(_, e)| PhysExtent::from_entry(e))
            .filter(|p| p.device == device)
            .map(|p| p.index)
            .collect()
    }

    /// Marks the copies on `device` stale for reads (`stale_devices`) or clears the mark.
    pub(crate) fn set_stale(&self, device: u32, stale: bool) {
        let bit = 1u64 << (device % 64);
        if stale {
            self.stale_devices.fetch_or(bit, Ordering::AcqRel);
        } else {
            self.stale_devices.fetch_and(!bit, Ordering::AcqRel);
        }
    }

    /// Whether reads should avoid the copies on `device` (a restore is bringing them up to
    /// date).
    pub(crate) fn is_stale(&self, device: u32) -> bool {
        self.stale_devices.load(Ordering::Acquire) & (1u64 << (device % 64)) != 0
    }

    /// Makes every copy of this (replicated) volume on `device` equal to a copy on a healthy
    /// device, 64 KiB chunk by chunk: a chunk that differs is rewritten (zeroed when the
    /// healthy copy's chunk is zeros). Each extent under its stripe lock. The device must be
    /// in service already (writes reach it) and marked stale for this volume. Does not sync.
    pub(crate) fn resync_copies_on(&self, device: u32) -> Result<Resync, StoreError> {
        let mut out = Resync::default();
        if self.replicas < 2 {
            return Ok(out);
        }
        let extents = self.allocated_extents();
        let mut good = vec![0u8; REPAIR_CHUNK_BYTES];
        let mut mine = vec![0u8; REPAIR_CHUNK_BYTES];
        for extent in extents {
            let st = read(&self.state);
            if self.check_live().is_err() {
                return Ok(out);
            }
            let _ordered = self.copy_lock(extent);
            let copies: Vec<PhysExtent> = st
                .maps()
                .filter_map(|m| PhysExtent::from_entry(m.get(extent)))
                .collect();
            let Some(&target) = copies.iter().find(|p| p.device == device) else {
                continue;
            };
            let Some(&source) = copies
                .iter()
                .find(|p| p.device != device && !self.device_failed(**p))
            else {
                out.without_source += 1;
                continue;
            };
            let src = self.shared.device(source)?;
            let dst = self.shared.device(target)?;
            out.extents_checked += 1;
            let mut off = 0u64;
            while off < EXTENT_SIZE_BYTES {
                src.read(source.index, off, &mut good)?;
                // A chunk of the restored copy that fails checksum verification (its device
                // lost unsynced pages when it failed) differs: rewritten from the source.
                let differs = match dst.read(target.index, off, &mut mine) {
                    Ok(()) => good != mine,
                    Err(e) if crate::checksum::mismatch_of(&e).is_some() => true,
                    Err(e) => return Err(e.into()),
                };
                if differs {
                    if good.iter().all(|&b| b == 0) {
                        dst.clear(target.index, off, REPAIR_CHUNK_BYTES as u64)?;
                    } else {
                        dst.write(target.index, off, &good)?;
                    }
                    out.chunks_rewritten += 1;
                }
                off += REPAIR_CHUNK_BYTES as u64;
            }
        }
        Ok(out)
    }
}
