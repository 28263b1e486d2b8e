//! Geometry: extent size, volume size limits, and the split of a byte range into extents.
//!
//! Why a separate module: every path (I/O, trim, block status, resize) cuts byte ranges at
//! extent boundaries the same way, and the encoding of a physical location into one `u64`
//! (so the in-memory map can be an array of atomics) must match everywhere.

/// Size of one extent, the unit of allocation, placement and release: 2 MiB.
///
/// Why 2 MiB (Flint's `kExtentSize`; RBD objects are 4 MiB):
/// - **metadata size**: one map entry (8 bytes in memory, one redb row) per 2 MiB keeps a
///   fully written 1 TiB volume at 512 Ki entries = 4 MiB of map, so maps of every volume fit
///   in RAM and load at startup in well under a second;
/// - **allocation granularity**: a thin volume pays at most 2 MiB - 4 KiB of waste per
///   touched region, and a first write into a fresh region allocates once per 2 MiB, so the
///   pool mutex is taken rarely even under random writes;
/// - **TRIM granularity**: guests and filesystems discard in units of 1-2 MiB or more
///   (ext4/xfs allocation groups, `fstrim` minimum lengths, qemu cluster sizes of 64 KiB-2 MiB
///   align into it), so whole-extent release happens often; partial ranges are still punched.
///   2 MiB is also the huge-page size and a multiple of every SSD erase/discard granularity
///   we expect, so a released extent maps onto whole device discard units.
pub const EXTENT_SIZE_BYTES: u64 = 2 * 1024 * 1024;

/// Volume sizes must be a multiple of this (a sector, what every NBD client assumes).
pub const VOLUME_SIZE_ALIGN_BYTES: u64 = 512;

/// Largest volume size accepted: 64 TiB (32 Mi extents; the map is allocated lazily in chunks).
pub const MAX_VOLUME_SIZE_BYTES: u64 = 64 << 40;

/// Most copies of a volume's extents (`NewVolume::replicas`).
pub const MAX_REPLICAS: u8 = 3;

/// Bit 63 of an in-memory map entry: the allocation is not yet committed to redb.
pub(crate) const PENDING_BIT: u64 = 1 << 63;

/// Where a logical extent lives: a device of the pool and an extent index on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PhysExtent {
    pub device: u32,
    pub index: u32,
}

impl PhysExtent {
    /// In-memory map encoding; never 0 (0 means hole). Device ids are < `MAX_DEVICES`.
    pub(crate) fn to_entry(self) -> u64 {
        ((u64::from(self.device) + 1) << 32) | u64::from(self.index)
    }

    /// Decodes a map entry (ignoring the pending bit); `None` for a hole.
    pub(crate) fn from_entry(entry: u64) -> Option<PhysExtent> {
        let e = entry & !PENDING_BIT;
        if e == 0 {
            return None;
        }
        Some(PhysExtent {
            device: ((e >> 32) - 1) as u32,
            index: e as u32,
        })
    }

    /// redb encoding (device in the high half, index in the low half).
    pub(crate) fn to_db(self) -> u64 {
        (u64::from(self.device) << 32) | u64::from(self.index)
    }

    pub(crate) fn from_db(v: u64) -> PhysExtent {
        PhysExtent {
            device: (v >> 32) as u32,
            index: v as u32,
        }
    }

    /// Byte offset of this extent on its device.
    pub(crate) fn byte_offset(self) -> u64 {
        u64::from(self.index) * EXTENT_SIZE_BYTES
    }
}

/// Number of extents needed to hold `size_bytes`.
pub(crate) fn extent_count(size_bytes: u64) -> u64 {
    size_bytes.div_ceil(EXTENT_SIZE_BYTES)
}

/// One extent-aligned piece of a byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Logical extent index in the volume.
    pub extent: u64,
    /// Offset of the piece inside the extent.
    pub offset_in_extent: u64,
    /// Length of the piece (never crosses an extent boundary).
    pub len: u64,
    /// Offset of the piece from the start of the request (index into the caller's buffer).
    pub pos: u64,
}

impl Piece {
    pub(crate) fn is_whole_extent(&self) -> bool {
        self.offset_in_extent == 0 && self.len == EXTENT_SIZE_BYTES
    }

    pub(crate) fn buf_range(&self) -> std::ops::Range<usize> {
        self.pos as usize..(self.pos + self.len) as usize
    }
}

/// Iterator over the extent pieces of `[offset, offset + len)`; the caller has checked that
/// the range does not overflow.
#[derive(Clone, Debug)]
pub(crate) struct Pieces {
    cur: u64,
    remaining: u64,
    pos: u64,
}

pub(crate) fn pieces(offset: u64, len: u64) -> Pieces {
    Pieces {
        cur: offset,
        remaining: len,
        pos: 0,
    }
}

impl Iterator for Pieces {
    type Item = Piece;

    fn next(&mut self) -> Option<Piece> {
        if self.remaining == 0 {
            return None;
        }
        let offset_in_extent = self.cur % EXTENT_SIZE_BYTES;
        let len = (EXTENT_SIZE_BYTES - offset_in_extent).min(self.remaining);
        let piece = Piece {
            extent: self.cur / EXTENT_SIZE_BYTES,
            offset_in_extent,
            len,
            pos: self.pos,
        };
        self.cur += len;
        self.remaining -= len;
        self.pos += len;
        Some(piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_encoding_round_trips_and_is_never_zero() {
        for (device, index) in [(0, 0), (0, 7), (3, u32::MAX), (63, 12345)] {
            let p = PhysExtent { device, index };
            let e = p.to_entry();
            assert_ne!(e, 0);
            assert_eq!(PhysExtent::from_entry(e), Some(p));
            assert_eq!(PhysExtent::from_entry(e | PENDING_BIT), Some(p));
            assert_eq!(PhysExtent::from_db(p.to_db()), p);
        }
        assert_eq!(PhysExtent::from_entry(0), None);
    }

    #[test]
    fn pieces_split_at_boundaries() {
        let e = EXTENT_SIZE_BYTES;
        let got: Vec<_> = pieces(e - 10, e + 20).collect();
        assert_eq!(got.len(), 3);
        assert_eq!(
            (
                got[0].extent,
                got[0].offset_in_extent,
                got[0].len,
                got[0].pos
            ),
            (0, e - 10, 10, 0)
        );
        assert_eq!(
            (
                got[1].extent,
                got[1].offset_in_extent,
                got[1].len,
                got[1].pos
            ),
            (1, 0, e, 10)
        );
        assert!(got[1].is_whole_extent());
        assert_eq!(
            (
                got[2].extent,
                got[2].offset_in_extent,
                got[2].len,
                got[2].pos
            ),
            (2, 0, 10, e + 10)
        );
        assert_eq!(pieces(5, 0).count(), 0);
        assert_eq!(got.iter().map(|p| p.len).sum::<u64>(), e + 20);
    }

    #[test]
    fn extent_count_rounds_up() {
        assert_eq!(extent_count(0), 0);
        assert_eq!(extent_count(1), 1);
        assert_eq!(extent_count(EXTENT_SIZE_BYTES), 1);
        assert_eq!(extent_count(EXTENT_SIZE_BYTES + 1), 2);
    }
}
