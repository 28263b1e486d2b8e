//! BLOCK_STATUS: a bounded walk of the allocation runs.

use headroom_nbd::consts;
use headroom_store::{StoreError, Volume};

/// Longest range one BLOCK_STATUS walks: 64 extents of 2 MiB. The NBD spec lets the answer
/// describe less than was asked (the client asks again from where it ends), and without a
/// bound a crafted 4 GiB request over a fragmented volume cost about a million `lseek` calls
/// on a thread that serves other connections. At most 64 allocated extents are asked where
/// their data is; unallocated ranges cost nothing.
pub const BLOCK_STATUS_MAX_WALK_BYTES: u64 = 64 * headroom_store::EXTENT_SIZE_BYTES;
/// Most descriptors one BLOCK_STATUS answer carries (8 bytes each), also a shorter answer.
pub const BLOCK_STATUS_MAX_DESCRIPTORS: usize = 2048;
/// What a BLOCK_STATUS is charged against the byte budgets: its largest answer.
pub(super) const BLOCK_STATUS_CHARGE_BYTES: u32 = (BLOCK_STATUS_MAX_DESCRIPTORS * 8) as u32;

/// The allocation runs of `[offset, offset + length)`, at most [`BLOCK_STATUS_MAX_WALK_BYTES`]
/// of it, walked one extent at a time: the walk stops once it has
/// [`BLOCK_STATUS_MAX_DESCRIPTORS`] runs (a fragmented extent is hundreds of runs, each two
/// `lseek` calls: 64 such extents took 0.4 s on this machine), or with `req_one`
/// (NBD_CMD_FLAG_REQ_ONE: one extent is enough) as soon as a second run shows where the first
/// one ends.
pub(super) fn block_status(
    volume: &Volume,
    offset: u64,
    length: u64,
    req_one: bool,
) -> Result<Vec<headroom_store::Extent>, StoreError> {
    let end = offset.saturating_add(length.min(BLOCK_STATUS_MAX_WALK_BYTES));
    let extent_bytes = headroom_store::EXTENT_SIZE_BYTES;
    let mut out: Vec<headroom_store::Extent> = Vec::new();
    let mut pos = offset;
    while pos < end {
        let next = ((pos / extent_bytes + 1) * extent_bytes).min(end);
        let mut walked = 0;
        for run in volume.block_status(pos, next - pos)? {
            walked += run.length;
            match out.last_mut() {
                Some(last) if last.hole == run.hole && last.zero == run.zero => {
                    last.length += run.length;
                }
                _ => out.push(run),
            }
        }
        if walked == 0 {
            break;
        }
        pos += walked;
        if (req_one && out.len() > 1) || out.len() >= BLOCK_STATUS_MAX_DESCRIPTORS {
            break;
        }
    }
    if req_one {
        out.truncate(1);
    }
    Ok(out)
}

/// Maps store extents to `base:allocation` descriptors (length, flags), at most
/// [`BLOCK_STATUS_MAX_DESCRIPTORS`] of them (one with `req_one`).
pub(super) fn status_descriptors(
    extents: &[headroom_store::Extent],
    req_one: bool,
) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(extents.len().min(1024));
    for extent in extents {
        let mut flags = 0;
        if extent.hole {
            flags |= consts::NBD_STATE_HOLE;
        }
        if extent.zero || extent.hole {
            flags |= consts::NBD_STATE_ZERO;
        }
        // Request lengths are 32-bit, so every clipped extent fits; saturate defensively.
        let length = u32::try_from(extent.length).unwrap_or(u32::MAX);
        if length == 0 {
            continue;
        }
        let full = out.len() == BLOCK_STATUS_MAX_DESCRIPTORS;
        match out.last_mut() {
            Some(last) if last.1 == flags => last.0 = last.0.saturating_add(length),
            // A shorter answer: the client asks again from where it ends.
            _ if full => break,
            _ => out.push((length, flags)),
        }
        if req_one {
            break;
        }
    }
    if req_one {
        out.truncate(1);
    }
    out
}
