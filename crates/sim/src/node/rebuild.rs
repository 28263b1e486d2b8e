//! Mirror rebuilds: the copy that moves a replaced volume's data onto its replacement.
//!
//! "More IOPS for Less" (docs/background.md §5.5) swaps a volume by adding the fresh one to the old
//! one's RAID-1 pair, letting the mirror copy the whole volume onto it, and removing the old
//! one. That copy is the rotation's overhead: it spends both volumes' IOPS, throughput and
//! credits while the tenant is running, and the old volume stays provisioned (billed) until
//! it is done. This module holds the bookkeeping of one such copy (which chunk is next, what
//! is in flight, how far the new volume is in sync) and of all of a node's rebuilds;
//! [`handlers`] sends the copy's reads and writes through the policies like any tenant
//! request, so they are paced and charged like one.

mod handlers;

use super::NONE;
use crate::scenario::{RebuildSpec, RebuildTenantIo};
use headroom_qos::VolumeId;

/// The node's mirror rebuilds.
pub(super) struct Rebuilds {
    /// Role of each slot (indexed like `slots`; empty unless rebuilds are enabled).
    roles: Vec<Role>,
    /// Every rebuild of the run, in start order.
    list: Vec<Rebuild>,
    /// Per tenant, the index in `list` of the rebuild whose old volume is not released yet,
    /// or `NONE`.
    of_tenant: Vec<u32>,
}

impl Rebuilds {
    /// No rebuild yet; `enabled` when some action rebuilds (then every one of `tenants`
    /// tenants gets an entry in `of_tenant`).
    pub(super) fn new(enabled: bool, tenants: usize) -> Rebuilds {
        Rebuilds {
            roles: Vec::new(),
            list: Vec::new(),
            of_tenant: if enabled {
                vec![NONE; tenants]
            } else {
                Vec::new()
            },
        }
    }
}

/// What a request in flight is, when the run has mirror rebuilds (kept beside the slots, so
/// that a run without them neither stores nor reads it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// The tenant's own request.
    Tenant,
    /// A copy read from the old volume of rebuild `rebuild`.
    CopyRead { rebuild: u32 },
    /// A copy write to the new volume of rebuild `rebuild`.
    CopyWrite { rebuild: u32 },
    /// One half of a tenant write sent to both volumes of a RAID-1 pair; the tenant hears of
    /// it when the second half completes (the first one turns its partner into `Tenant`).
    Mirror { partner: u32 },
}

/// One volume's copy onto its replacement, from the replacement until the old volume is
/// released.
#[derive(Clone, Debug)]
pub(crate) struct Rebuild {
    /// Tenant whose volume is rebuilt.
    pub tenant: u32,
    /// Volume copied from (released when the copy is done and no request uses it).
    pub old: VolumeId,
    /// Volume copied to (the tenant's volume from the replacement on).
    pub new: VolumeId,
    /// Where the tenant's own I/O goes until the copy is done.
    pub tenant_io: RebuildTenantIo,
    size_bytes: u64,
    io_bytes: u64,
    qd: usize,
    /// Start of the next chunk to read.
    next_offset_bytes: u64,
    /// Start offsets of the chunks being copied (read or write in flight).
    in_flight: Vec<u64>,
    /// Bytes written to the new volume.
    pub written_bytes: u64,
    /// When the replacement happened, ns.
    pub started_ns: u64,
    /// When the last chunk was written, ns.
    pub copied_ns: Option<u64>,
    /// The old volume is not released before this time (the action's `overlap_s`), ns.
    pub release_not_before_ns: u64,
    /// Requests addressed to the old volume that have not completed.
    pub old_requests: u64,
    /// A `Release` event is pending for this rebuild.
    pub release_scheduled: bool,
    /// The old volume was removed from the policies.
    pub released: bool,
    /// Round-robin counter for spraying copies over workers (1-to-N dispatch).
    pub spray: u32,
}

impl Rebuild {
    /// A copy of `size_bytes` in chunks of `spec.io_kib`, at most `spec.qd` chunks in flight,
    /// starting at `started_ns`; the old volume may be released as soon as it is done.
    pub fn new(
        tenant: u32,
        old: VolumeId,
        new: VolumeId,
        size_bytes: u64,
        spec: &RebuildSpec,
        started_ns: u64,
    ) -> Rebuild {
        let io_bytes = u64::from(spec.io_kib) * 1024;
        let qd = spec.qd;
        Rebuild {
            tenant,
            old,
            new,
            tenant_io: spec.tenant_io,
            size_bytes,
            io_bytes: io_bytes.max(1),
            qd: (qd as usize).max(1),
            next_offset_bytes: 0,
            in_flight: Vec::with_capacity(qd as usize),
            written_bytes: 0,
            started_ns,
            copied_ns: None,
            release_not_before_ns: started_ns,
            old_requests: 0,
            release_scheduled: false,
            released: false,
            spray: tenant,
        }
    }

    /// The next chunk to copy, `(offset, length)`, if one may start now (fewer than `qd` in
    /// flight and data left); it counts as in flight from here on.
    pub fn start_chunk(&mut self) -> Option<(u64, u32)> {
        if self.in_flight.len() >= self.qd || self.next_offset_bytes >= self.size_bytes {
            return None;
        }
        let offset = self.next_offset_bytes;
        let len = self.io_bytes.min(self.size_bytes - offset);
        self.next_offset_bytes += len;
        self.in_flight.push(offset);
        // `io_bytes` is at most 64 MiB (validated), so the length fits.
        Some((offset, u32::try_from(len).unwrap_or(u32::MAX)))
    }

    /// The chunk at `offset` of `len` bytes is on the new volume.
    pub fn chunk_written(&mut self, offset: u64, len: u32, now_ns: u64) {
        if let Some(i) = self.in_flight.iter().position(|&o| o == offset) {
            self.in_flight.swap_remove(i);
        }
        self.written_bytes += u64::from(len);
        if self.written_bytes >= self.size_bytes && self.in_flight.is_empty() {
            self.copied_ns = Some(now_ns);
        }
    }

    /// Every byte below this offset is on the new volume (md's `recovery_offset`).
    pub fn in_sync_below_bytes(&self) -> u64 {
        if self.copied_ns.is_some() {
            return self.size_bytes;
        }
        self.in_flight
            .iter()
            .copied()
            .min()
            .unwrap_or(self.next_offset_bytes)
    }

    /// The copy is finished.
    pub fn copied(&self) -> bool {
        self.copied_ns.is_some()
    }
}

/// What the rebuilds of one group did over the whole run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RebuildStats {
    /// Rebuilds started (one per replaced volume).
    pub started: u64,
    /// Rebuilds whose copy finished.
    pub copied: u64,
    /// Replacements skipped because the tenant's previous rebuild had not released its old
    /// volume yet.
    pub skipped: u64,
    /// Bytes written to new volumes by the copy.
    pub bytes_copied: u64,
    /// Copy reads from old volumes (completed).
    pub copy_reads: u64,
    /// Copy writes to new volumes (completed).
    pub copy_writes: u64,
    /// Tenant reads served by an old volume (data not yet copied).
    pub tenant_reads_from_old: u64,
    /// Tenant writes also written to an old volume (the RAID-1 mirror).
    pub tenant_writes_mirrored: u64,
    /// Sum of copy durations (replacement to last chunk written), ns.
    pub copy_ns_sum: u64,
    /// Longest copy, ns.
    pub copy_ns_max: u64,
    /// Sum of the time old volumes stayed provisioned after their replacement, ns.
    pub overlap_ns_sum: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_volume_once_with_at_most_qd_in_flight() {
        let size = 5 * 1024 + 123;
        // 1 KiB chunks.
        let spec = RebuildSpec {
            io_kib: 1,
            qd: 2,
            tenant_io: Default::default(),
        };
        let mut r = Rebuild::new(0, 1, 2, size, &spec, 0);
        let a = r.start_chunk();
        let b = r.start_chunk();
        assert_eq!((a, b), (Some((0, 1024)), Some((1024, 1024))));
        assert_eq!(r.start_chunk(), None, "qd 2 reached");
        assert_eq!(r.in_sync_below_bytes(), 0);
        // Out-of-order completion: the in-sync mark waits for the lowest chunk.
        r.chunk_written(1024, 1024, 5);
        assert_eq!(r.in_sync_below_bytes(), 0);
        let mut total = 2048u64;
        let mut last = 0;
        while let Some((o, l)) = r.start_chunk() {
            total += u64::from(l);
            last = l;
            r.chunk_written(o, l, 7);
        }
        assert!(!r.copied(), "chunk 0 is still in flight");
        r.chunk_written(0, 1024, 9);
        assert_eq!(total, size);
        assert_eq!(last, 123, "the last chunk is partial");
        assert_eq!(r.written_bytes, size);
        assert_eq!(r.copied_ns, Some(9));
        assert_eq!(r.in_sync_below_bytes(), size);
    }
}
