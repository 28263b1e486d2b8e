//! One virtio-blk descriptor chain read into a request, or refused, with every guest-given
//! length and address checked first.
//!
//! Why this is its own step, before anything reaches the pipeline: a chain is guest memory
//! the guest may have got wrong or made hostile (a descriptor past the end of its memory, a
//! header too short, data the device must write into marked device-readable, more segments
//! or bytes than the device offered). Each such chain is answered with a status the driver
//! understands (IOERR for a malformed request, UNSUPP for a type or flag this device does not
//! do), never a panic and never a read or write outside what the chain names. Only a chain
//! with no writable status byte at all cannot be answered; it is returned used with no
//! bytes written, which is all the spec leaves a device.
//!
//! The layout accepted is the one Linux and QEMU's drivers send: the 16-byte header alone
//! in the first descriptor, the data in the middle ones, the status in the first byte of
//! the last descriptor (device-writable). One DISCARD or WRITE_ZEROES segment per request
//! (`max_discard_seg` = 1 in the config space).

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};

use super::wire::{
    DISCARD_SEGMENT_BYTES, HEADER_BYTES, SECTOR_BYTES, SEG_MAX, Status, T_DISCARD, T_FLUSH,
    T_GET_ID, T_IN, T_OUT, T_WRITE_ZEROES, WRITE_ZEROES_FLAG_UNMAP,
};

/// A piece of guest memory a request reads from or writes into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub addr: GuestAddress,
    pub len: u32,
}

/// What a well-formed request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Read,
    Write,
    Flush,
    GetId,
    Discard,
    /// `unmap`: the range may be deallocated (VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP).
    WriteZeroes {
        unmap: bool,
    },
}

/// A chain read into a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlkRequest {
    pub head: u16,
    pub kind: Kind,
    pub offset_bytes: u64,
    /// READ/WRITE: the data's bytes; DISCARD/WRITE_ZEROES: the range's; GET_ID: the room for
    /// the id; FLUSH: 0.
    pub length_bytes: u32,
    /// READ, WRITE, GET_ID: where the data is.
    pub data: Vec<Segment>,
    pub status: GuestAddress,
}

/// What a chain turned out to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed {
    Request(BlkRequest),
    /// Answered with `status` at once, without reaching the pipeline.
    Refused {
        head: u16,
        status_addr: GuestAddress,
        status: Status,
        why: &'static str,
    },
    /// No device-writable status byte: returned used with nothing written.
    Unanswerable {
        head: u16,
        why: &'static str,
    },
}

/// Reads the chain of `head` (its descriptors, at most the queue's size of them: the
/// virtqueue crate bounds a chain so) against `mem`. `max_data_bytes`: the largest READ or
/// WRITE (the node's `max_request_bytes`); `max_range_bytes`: the largest DISCARD or
/// WRITE_ZEROES the config space offered.
pub fn parse<M: GuestMemory + ?Sized>(
    head: u16,
    descriptors: impl Iterator<Item = Descriptor>,
    mem: &M,
    max_data_bytes: u32,
    max_range_bytes: u32,
) -> Parsed {
    // A header, SEG_MAX data descriptors and a status; one more is enough to know there
    // are too many.
    let limit = SEG_MAX as usize + 3;
    let descs: Vec<Descriptor> = descriptors.take(limit).collect();
    let Some(last) = descs.last() else {
        return Parsed::Unanswerable {
            head,
            why: "an empty chain",
        };
    };
    if !last.is_write_only()
        || last.len() < 1
        || !mem.check_range(last.addr(), 1, Permissions::Write)
    {
        return Parsed::Unanswerable {
            head,
            why: "the last descriptor is not a writable status byte in guest memory",
        };
    }
    let status_addr = last.addr();
    let refuse = |status: Status, why: &'static str| Parsed::Refused {
        head,
        status_addr,
        status,
        why,
    };
    if descs.len() < 2 {
        return refuse(Status::IoErr, "no header before the status");
    }
    if descs.len() == limit {
        return refuse(Status::IoErr, "more data descriptors than SEG_MAX");
    }
    let header = descs[0];
    if header.is_write_only() || header.len() < HEADER_BYTES {
        return refuse(Status::IoErr, "the header is device-writable or too short");
    }
    let mut bytes = [0u8; HEADER_BYTES as usize];
    if mem.read_slice(&mut bytes, header.addr()).is_err() {
        return refuse(Status::IoErr, "the header is outside guest memory");
    }
    let request_type = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let sector = u64::from_le_bytes([
        bytes[8], bytes[9], bytes[10], bytes[11], bytes[12], bytes[13], bytes[14], bytes[15],
    ]);
    let middle = &descs[1..descs.len() - 1];
    let Some((data, total_bytes)) = segments(mem, middle) else {
        return refuse(Status::IoErr, "a data descriptor is outside guest memory");
    };
    let all_writable = middle.iter().all(|d| d.is_write_only());
    let all_readable = middle.iter().all(|d| !d.is_write_only());
    let offset = |sector: u64| sector.checked_mul(SECTOR_BYTES);
    let request = |kind, offset_bytes, length_bytes, data| {
        Parsed::Request(BlkRequest {
            head,
            kind,
            offset_bytes,
            length_bytes,
            data,
            status: status_addr,
        })
    };
    match request_type {
        T_IN | T_OUT => {
            let (kind, direction_ok) = match request_type {
                T_IN => (Kind::Read, all_writable),
                _ => (Kind::Write, all_readable),
            };
            if !direction_ok {
                return refuse(Status::IoErr, "a data descriptor has the wrong direction");
            }
            if total_bytes == 0 || total_bytes % SECTOR_BYTES != 0 {
                return refuse(Status::IoErr, "data not a whole number of sectors");
            }
            if total_bytes > u64::from(max_data_bytes) {
                return refuse(Status::IoErr, "data larger than the largest request");
            }
            let Some(offset_bytes) = offset(sector) else {
                return refuse(Status::IoErr, "sector past any volume's end");
            };
            request(kind, offset_bytes, total_bytes as u32, data)
        }
        T_FLUSH => request(Kind::Flush, 0, 0, Vec::new()),
        T_GET_ID => {
            if !all_writable || total_bytes == 0 {
                return refuse(
                    Status::IoErr,
                    "GET_ID needs device-writable room for the id",
                );
            }
            let room = total_bytes.min(super::wire::ID_BYTES as u64) as u32;
            request(Kind::GetId, 0, room, data)
        }
        T_DISCARD | T_WRITE_ZEROES => {
            if !all_readable || data.len() != 1 || total_bytes != u64::from(DISCARD_SEGMENT_BYTES) {
                return refuse(Status::IoErr, "not one device-readable 16-byte segment");
            }
            match range(mem, request_type, data[0], max_range_bytes) {
                Ok((kind, offset_bytes, length_bytes)) => {
                    request(kind, offset_bytes, length_bytes, Vec::new())
                }
                Err((status, why)) => refuse(status, why),
            }
        }
        _ => refuse(Status::Unsupp, "a request type this device does not do"),
    }
}

/// The data descriptors as segments, each checked to lie in guest memory with the access
/// its direction needs, and their total bytes; `None` if one does not.
fn segments<M: GuestMemory + ?Sized>(
    mem: &M,
    middle: &[Descriptor],
) -> Option<(Vec<Segment>, u64)> {
    let mut data = Vec::with_capacity(middle.len());
    let mut total_bytes: u64 = 0;
    for desc in middle {
        let access = if desc.is_write_only() {
            Permissions::Write
        } else {
            Permissions::Read
        };
        if !mem.check_range(desc.addr(), desc.len() as usize, access) {
            return None;
        }
        total_bytes += u64::from(desc.len());
        data.push(Segment {
            addr: desc.addr(),
            len: desc.len(),
        });
    }
    Some((data, total_bytes))
}

/// A DISCARD's or WRITE_ZEROES's one segment (`virtio_blk_discard_write_zeroes`): its kind,
/// offset and length, or the status and reason to refuse it with.
fn range<M: GuestMemory + ?Sized>(
    mem: &M,
    request_type: u32,
    segment: Segment,
    max_range_bytes: u32,
) -> Result<(Kind, u64, u32), (Status, &'static str)> {
    let mut seg = [0u8; DISCARD_SEGMENT_BYTES as usize];
    if mem.read_slice(&mut seg, segment.addr).is_err() {
        return Err((Status::IoErr, "the segment is outside guest memory"));
    }
    let seg_sector = u64::from_le_bytes([
        seg[0], seg[1], seg[2], seg[3], seg[4], seg[5], seg[6], seg[7],
    ]);
    let sectors = u32::from_le_bytes([seg[8], seg[9], seg[10], seg[11]]);
    let flags = u32::from_le_bytes([seg[12], seg[13], seg[14], seg[15]]);
    let unmap = flags & WRITE_ZEROES_FLAG_UNMAP != 0;
    if flags & !WRITE_ZEROES_FLAG_UNMAP != 0 || (request_type == T_DISCARD && unmap) {
        return Err((Status::Unsupp, "a flag this device does not know"));
    }
    let length_bytes = u64::from(sectors) * SECTOR_BYTES;
    if length_bytes == 0 || length_bytes > u64::from(max_range_bytes) {
        return Err((Status::IoErr, "a range of no sectors or past the maximum"));
    }
    let Some(offset_bytes) = seg_sector.checked_mul(SECTOR_BYTES) else {
        return Err((Status::IoErr, "sector past any volume's end"));
    };
    let kind = match request_type {
        T_DISCARD => Kind::Discard,
        _ => Kind::WriteZeroes { unmap },
    };
    Ok((kind, offset_bytes, length_bytes as u32))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use vm_memory::GuestMemoryMmap;

    use super::*;

    const WRITE: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn desc(addr: u64, len: u32, flags: u16) -> Descriptor {
        Descriptor::new(addr, len, flags, 0)
    }

    /// A header of its own in guest memory (each at a new address, so a test may build
    /// several chains before it parses them).
    fn header(mem: &GuestMemoryMmap<()>, request_type: u32, sector: u64) -> Descriptor {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let at = 0x4_0000 + 16 * NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&request_type.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, GuestAddress(at)).unwrap();
        desc(at, 16, 0)
    }

    fn parse_chain(mem: &GuestMemoryMmap<()>, chain: Vec<Descriptor>) -> Parsed {
        parse(0, chain.into_iter(), mem, 1 << 20, 1 << 30)
    }

    #[test]
    fn a_read_is_its_sector_and_its_writable_data() {
        let m = mem();
        let chain = vec![
            header(&m, T_IN, 8),
            desc(0x2000, 4096, WRITE),
            desc(0x9000, 1, WRITE),
        ];
        let Parsed::Request(r) = parse_chain(&m, chain) else {
            panic!("refused")
        };
        assert_eq!(
            (r.kind, r.offset_bytes, r.length_bytes),
            (Kind::Read, 4096, 4096)
        );
        assert_eq!(r.status, GuestAddress(0x9000));
    }

    #[test]
    fn bad_chains_are_answered_not_followed() {
        let m = mem();
        let status = desc(0x9000, 1, WRITE);
        let cases: Vec<(Vec<Descriptor>, Status)> = vec![
            // Data of a READ the device could not write (wrong direction).
            (
                vec![header(&m, T_IN, 0), desc(0x2000, 512, 0), status],
                Status::IoErr,
            ),
            // Past the end of guest memory.
            (
                vec![header(&m, T_OUT, 0), desc(0xFFFF_0000, 512, 0), status],
                Status::IoErr,
            ),
            // Not whole sectors.
            (
                vec![header(&m, T_OUT, 0), desc(0x2000, 100, 0), status],
                Status::IoErr,
            ),
            // Larger than the largest request.
            (
                vec![
                    header(&m, T_OUT, 0),
                    desc(0x2000, 0x8_0000, 0),
                    desc(0x2000, 0x8_0000, 0),
                    desc(0x2000, 512, 0),
                    status,
                ],
                Status::IoErr,
            ),
            // A header too short.
            (vec![desc(0x1000, 8, 0), status], Status::IoErr),
            // An unknown type.
            (vec![header(&m, 99, 0), status], Status::Unsupp),
            // A sector whose byte offset overflows.
            (
                vec![
                    header(&m, T_IN, u64::MAX / 2),
                    desc(0x2000, 512, WRITE),
                    status,
                ],
                Status::IoErr,
            ),
        ];
        for (i, (chain, expected)) in cases.into_iter().enumerate() {
            match parse_chain(&m, chain) {
                Parsed::Refused { status, .. } => assert_eq!(status, expected, "case {i}"),
                other => panic!("case {i}: {other:?}"),
            }
        }
        // No writable status byte: nothing to answer with.
        let chain = vec![header(&m, T_IN, 0), desc(0x9000, 1, 0)];
        assert!(matches!(
            parse_chain(&m, chain),
            Parsed::Unanswerable { .. }
        ));
    }

    #[test]
    fn a_discard_with_unmap_is_unsupported_and_write_zeroes_keeps_it() {
        let m = mem();
        let segment = |flags: u32| {
            let mut s = [0u8; 16];
            s[0..8].copy_from_slice(&16u64.to_le_bytes());
            s[8..12].copy_from_slice(&8u32.to_le_bytes());
            s[12..16].copy_from_slice(&flags.to_le_bytes());
            m.write_slice(&s, GuestAddress(0x3000)).unwrap();
            desc(0x3000, 16, 0)
        };
        let status = desc(0x9000, 1, WRITE);
        let chain = vec![header(&m, T_DISCARD, 0), segment(1), status];
        assert!(matches!(
            parse_chain(&m, chain),
            Parsed::Refused {
                status: Status::Unsupp,
                ..
            }
        ));
        let chain = vec![header(&m, T_WRITE_ZEROES, 0), segment(1), status];
        let Parsed::Request(r) = parse_chain(&m, chain) else {
            panic!("refused")
        };
        assert_eq!(
            (r.kind, r.offset_bytes, r.length_bytes),
            (Kind::WriteZeroes { unmap: true }, 16 * 512, 8 * 512)
        );
    }
}
