//! What virtio-blk fixes on the wire and in the config space: the feature bits this backend
//! offers, the request types and statuses, and the `virtio_blk_config` a driver reads.
//!
//! Why a file of its own: these are the device's promises to a guest driver (what it may
//! send, how large, in how many segments), and every bound the request parser enforces
//! (`vhost_user::request`) is one of them, so they are written once, here.

use virtio_bindings::virtio_blk;

/// A sector, the unit of virtio-blk offsets and lengths.
pub const SECTOR_BYTES: u64 = 512;
/// The logical block size reported to the guest (VIRTIO_BLK_F_BLK_SIZE).
pub const BLOCK_BYTES: u32 = 4096;
/// Data descriptors one request may carry (VIRTIO_BLK_F_SEG_MAX); more are IOERR.
///
/// Why 126: with its header and status a request of SEG_MAX segments is 128 descriptors,
/// the ring QEMU's `vhost-user-blk-pci` sets up by default (`queue-size=128`), and without
/// indirect descriptors a driver puts every descriptor of a request in the ring itself. A
/// request larger than the ring never fits: Linux's `virtqueue_add` refuses it with the ring
/// empty, blk-mq stops the queue until a completion restarts it, and none comes (the guest's
/// disk hangs with an idle ring). At 128 that happened to a write of 128 pages the guest's
/// page cache held in 128 pieces (docs/ARCHITECTURE.md, decision 71). QEMU's own virtio-blk
/// says `queue-size - 2` for the same reason.
pub const SEG_MAX: u32 = 126;
/// Bytes of one `virtio_blk_discard_write_zeroes` segment.
pub const DISCARD_SEGMENT_BYTES: u32 = 16;
/// Bytes of a request header (`virtio_blk_outhdr`: type, reserved, sector).
pub const HEADER_BYTES: u32 = 16;
/// Bytes of the config space this backend fills (up to `write_zeroes_may_unmap` and its
/// padding).
pub const CONFIG_BYTES: usize = 60;

pub const T_IN: u32 = virtio_blk::VIRTIO_BLK_T_IN;
pub const T_OUT: u32 = virtio_blk::VIRTIO_BLK_T_OUT;
pub const T_FLUSH: u32 = virtio_blk::VIRTIO_BLK_T_FLUSH;
pub const T_GET_ID: u32 = virtio_blk::VIRTIO_BLK_T_GET_ID;
pub const T_DISCARD: u32 = virtio_blk::VIRTIO_BLK_T_DISCARD;
pub const T_WRITE_ZEROES: u32 = virtio_blk::VIRTIO_BLK_T_WRITE_ZEROES;
pub const WRITE_ZEROES_FLAG_UNMAP: u32 = virtio_blk::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP;
pub const ID_BYTES: usize = virtio_blk::VIRTIO_BLK_ID_BYTES as usize;

/// A request's status byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    IoErr,
    Unsupp,
}

impl Status {
    pub fn byte(self) -> u8 {
        match self {
            Status::Ok => virtio_blk::VIRTIO_BLK_S_OK as u8,
            Status::IoErr => virtio_blk::VIRTIO_BLK_S_IOERR as u8,
            Status::Unsupp => virtio_blk::VIRTIO_BLK_S_UNSUPP as u8,
        }
    }
}

/// The virtio feature bits offered: VERSION_1, EVENT_IDX, INDIRECT_DESC, SEG_MAX, BLK_SIZE, FLUSH, MQ,
/// DISCARD, WRITE_ZEROES, RO for a read-only volume, and vhost-user's PROTOCOL_FEATURES.
/// Not offered: INDIRECT_DESC (a chain is bounded by the queue size without it), CONFIG_WCE
/// (the cache mode is always writeback: a FLUSH makes writes durable).
pub fn features(read_only: bool) -> u64 {
    let bits = [
        virtio_bindings::virtio_config::VIRTIO_F_VERSION_1,
        virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX,
        virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC,
        virtio_blk::VIRTIO_BLK_F_SEG_MAX,
        virtio_blk::VIRTIO_BLK_F_BLK_SIZE,
        virtio_blk::VIRTIO_BLK_F_FLUSH,
        virtio_blk::VIRTIO_BLK_F_MQ,
        virtio_blk::VIRTIO_BLK_F_DISCARD,
        virtio_blk::VIRTIO_BLK_F_WRITE_ZEROES,
    ];
    let mut features = bits.iter().fold(0u64, |acc, bit| acc | (1u64 << bit));
    if read_only {
        features |= 1 << virtio_blk::VIRTIO_BLK_F_RO;
    }
    features | vhost::vhost_user::message::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
}

/// What the config space tells the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlkConfig {
    pub capacity_bytes: u64,
    pub num_queues: u16,
    /// Largest DISCARD and WRITE_ZEROES, in bytes (the pipeline splits larger ones itself,
    /// so this is only what one request may name).
    pub max_discard_bytes: u32,
}

impl BlkConfig {
    /// `virtio_blk_config`, little-endian, as the virtio spec lays it out.
    pub fn encode(&self) -> [u8; CONFIG_BYTES] {
        let mut c = [0u8; CONFIG_BYTES];
        let max_discard_sectors = (u64::from(self.max_discard_bytes) / SECTOR_BYTES) as u32;
        c[0..8].copy_from_slice(&(self.capacity_bytes / SECTOR_BYTES).to_le_bytes());
        // size_max (8..12) unset: VIRTIO_BLK_F_SIZE_MAX is not offered.
        c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        // geometry (16..20) unset.
        c[20..24].copy_from_slice(&BLOCK_BYTES.to_le_bytes());
        // topology (24..32) unset; writeback (32) unset: no CONFIG_WCE.
        c[34..36].copy_from_slice(&self.num_queues.to_le_bytes());
        c[36..40].copy_from_slice(&max_discard_sectors.to_le_bytes());
        c[40..44].copy_from_slice(&1u32.to_le_bytes()); // max_discard_seg
        c[44..48].copy_from_slice(&(BLOCK_BYTES / SECTOR_BYTES as u32).to_le_bytes());
        c[48..52].copy_from_slice(&max_discard_sectors.to_le_bytes());
        c[52..56].copy_from_slice(&1u32.to_le_bytes()); // max_write_zeroes_seg
        c[56] = 1; // write_zeroes_may_unmap
        c
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn the_config_space_puts_each_field_at_its_offset() {
        let c = BlkConfig {
            capacity_bytes: 1 << 30,
            num_queues: 3,
            max_discard_bytes: 1 << 20,
        }
        .encode();
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2 << 20);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 4096);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 3);
        assert_eq!(u32::from_le_bytes(c[36..40].try_into().unwrap()), 2048);
        assert_eq!(c[56], 1);
    }

    #[test]
    fn a_read_only_volume_says_so() {
        let ro = 1u64 << virtio_blk::VIRTIO_BLK_F_RO;
        assert_eq!(features(true) & ro, ro);
        assert_eq!(features(false) & ro, 0);
    }
}
