//! What is written at the start of a device: Headroom's own signature, and the signatures of
//! everything else (filesystems, partition tables, volume managers) that `device add` must
//! not overwrite.
//!
//! Why: a device path is only a name. After a reboot that renamed disks, or a typo, the path
//! recorded for device 3 may lead to another pool's disk or to a filesystem; writing there
//! destroys data nobody asked to destroy. Every device Headroom adds or creates (file or
//! block device; not RAM or RADOS) therefore carries a small superblock at byte 0, written
//! and synced before the device's record is committed, naming the pool (its random id) and
//! the device. Its first extent is reserved for Headroom's own structures and never
//! allocated (`DeviceRecord::reserved_extents`, `Allocator::reserve_prefix`): the
//! superblock uses 4 KiB of its 2 MiB, the rest is kept for what the format will need next
//! (the per-block checksum region of new devices will live in reserved extents at the start
//! of the device). Extent offsets do not move: physical extent N stays at N × 2 MiB.
//!
//! Layout of the superblock (little-endian, `SIGNATURE_LEN` bytes, the rest zero):
//!
//! ```text
//! 0   16  magic "HEADROOM-DEVICE\0"
//! 16   4  format version (2; 1 is read as 2 without checksums)
//! 20   4  bytes covered by the checksum (64)
//! 24   8  pool id
//! 32   4  device id
//! 36   4  reserved extents at the start of the device
//! 40   8  capacity in bytes (whole extents)
//! 48   4  features: bit 0 = per-block checksums and write-intent bitmap (checksum.rs)
//! 52   8  zero (room for later fields of version 2)
//! 60   4  CRC32C (Castagnoli) of bytes 0..60
//! ```

use thiserror::Error;

/// Bytes read and written for the superblock (one 4 KiB block: an atomic write on every
/// device we support).
pub(crate) const SIGNATURE_LEN: usize = 4096;
/// Fewest extents reserved at the start of a device Headroom signs (the checksum layout of a
/// large device reserves more: `checksum::Layout::reserved_extents`).
pub(crate) const RESERVED_EXTENTS: u32 = 1;
/// Magic at byte 0 of a Headroom device.
pub(crate) const SIGNATURE_MAGIC: [u8; 16] = *b"HEADROOM-DEVICE\0";
/// Version of the superblock layout above.
pub(crate) const SIGNATURE_FORMAT_VERSION: u32 = 2;
/// Feature bit: the device carries per-block checksums (`checksum.rs`).
const FEATURE_CHECKSUMS: u32 = 1;
/// Bytes covered by the CRC32C, which follows them.
const COVERED_LEN: usize = 60;
/// Bytes of a device's start that `foreign_signature` looks at (btrfs's superblock magic is
/// at 64 KiB + 64).
pub(crate) const PROBE_LEN: usize = 68 << 10;

/// Headroom's superblock on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Signature {
    pub pool_id: u64,
    pub device_id: u32,
    pub reserved_extents: u32,
    pub capacity_bytes: u64,
    /// Per-block checksums and the write-intent bitmap live in the reserved prefix.
    pub checksums: bool,
}

/// Why a device's first block is not a valid Headroom signature.
#[derive(Debug, Error, PartialEq, Eq)]
pub(crate) enum SignatureError {
    #[error("no Headroom signature (the first 4 KiB hold no Headroom magic)")]
    Missing,
    #[error("the Headroom signature is damaged: {0}")]
    Damaged(String),
    #[error("the Headroom signature has format version {0}, this build reads 1 and 2")]
    UnknownVersion(u32),
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(b)
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(b)
}

impl Signature {
    /// The superblock's bytes (`SIGNATURE_LEN`).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut buf = vec![0u8; SIGNATURE_LEN];
        buf[0..16].copy_from_slice(&SIGNATURE_MAGIC);
        buf[16..20].copy_from_slice(&SIGNATURE_FORMAT_VERSION.to_le_bytes());
        buf[20..24].copy_from_slice(&(COVERED_LEN as u32).to_le_bytes());
        buf[24..32].copy_from_slice(&self.pool_id.to_le_bytes());
        buf[32..36].copy_from_slice(&self.device_id.to_le_bytes());
        buf[36..40].copy_from_slice(&self.reserved_extents.to_le_bytes());
        buf[40..48].copy_from_slice(&self.capacity_bytes.to_le_bytes());
        let features = if self.checksums { FEATURE_CHECKSUMS } else { 0 };
        buf[48..52].copy_from_slice(&features.to_le_bytes());
        let crc = crc32c::crc32c(&buf[..COVERED_LEN]);
        buf[60..64].copy_from_slice(&crc.to_le_bytes());
        buf
    }

    /// Reads a superblock from a device's first bytes (at least 64).
    pub(crate) fn decode(buf: &[u8]) -> Result<Signature, SignatureError> {
        if buf.len() < 64 || buf[0..16] != SIGNATURE_MAGIC {
            return Err(SignatureError::Missing);
        }
        let version = u32_at(buf, 16);
        if version != SIGNATURE_FORMAT_VERSION && version != 1 {
            return Err(SignatureError::UnknownVersion(version));
        }
        let covered = u32_at(buf, 20);
        if covered as usize != COVERED_LEN {
            return Err(SignatureError::Damaged(format!(
                "header length {covered}, expected {COVERED_LEN}"
            )));
        }
        let stored = u32_at(buf, 60);
        let computed = crc32c::crc32c(&buf[..COVERED_LEN]);
        if stored != computed {
            return Err(SignatureError::Damaged(format!(
                "CRC32C {stored:08x}, computed {computed:08x}"
            )));
        }
        Ok(Signature {
            pool_id: u64_at(buf, 24),
            device_id: u32_at(buf, 32),
            reserved_extents: u32_at(buf, 36),
            capacity_bytes: u64_at(buf, 40),
            checksums: version >= 2 && u32_at(buf, 48) & FEATURE_CHECKSUMS != 0,
        })
    }
}

/// What a device's first bytes (`PROBE_LEN` of them, or fewer for a small file) say was
/// written there by something else: a filesystem, a partition table, a volume manager,
/// encryption, swap, or a Headroom device (of any pool: the caller tells ours apart).
/// `None`: no signature known here (the caller still checks that the device is all zeros).
pub(crate) fn foreign_signature(head: &[u8]) -> Option<String> {
    let at = |offset: usize, magic: &[u8]| {
        head.get(offset..offset + magic.len())
            .is_some_and(|b| b == magic)
    };
    if at(0, &SIGNATURE_MAGIC) {
        return Some(match Signature::decode(head) {
            Ok(sig) => format!(
                "a Headroom signature (pool {:016x}, device {})",
                sig.pool_id, sig.device_id
            ),
            Err(e) => format!("a Headroom signature ({e})"),
        });
    }
    let known: [(usize, &[u8], &str); 12] = [
        (0, b"LUKS\xba\xbe", "a LUKS encryption header"),
        (0, b"XFSB", "an XFS filesystem"),
        (1080, &[0x53, 0xef], "an ext2/ext3/ext4 filesystem"),
        (65600, b"_BHRfS_M", "a btrfs filesystem"),
        (4086, b"SWAPSPACE2", "a swap area"),
        (4086, b"SWAP-SPACE", "a swap area"),
        (512, b"EFI PART", "a GPT partition table"),
        (0, b"LABELONE", "an LVM physical volume"),
        (512, b"LABELONE", "an LVM physical volume"),
        (1024, b"LABELONE", "an LVM physical volume"),
        (1536, b"LABELONE", "an LVM physical volume"),
        (32769, b"CD001", "an ISO 9660 filesystem"),
    ];
    for (offset, magic, what) in known {
        if at(offset, magic) {
            return Some(what.to_string());
        }
    }
    // Last: an MBR's boot signature (also on FAT and NTFS boot sectors).
    if at(510, &[0x55, 0xaa]) {
        return Some("an MBR partition table or boot sector".to_string());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sig() -> Signature {
        Signature {
            pool_id: 0x0123_4567_89ab_cdef,
            device_id: 3,
            reserved_extents: 1,
            capacity_bytes: 64 << 20,
            checksums: true,
        }
    }

    #[test]
    fn a_version_1_signature_reads_as_one_without_checksums() {
        let mut buf = sig().encode();
        buf[16..20].copy_from_slice(&1u32.to_le_bytes());
        buf[48..52].copy_from_slice(&0u32.to_le_bytes());
        let crc = crc32c::crc32c(&buf[..COVERED_LEN]);
        buf[60..64].copy_from_slice(&crc.to_le_bytes());
        let read = Signature::decode(&buf).unwrap();
        assert!(!read.checksums);
        assert_eq!(read.pool_id, sig().pool_id);
        let mut v3 = buf.clone();
        v3[16..20].copy_from_slice(&3u32.to_le_bytes());
        assert_eq!(
            Signature::decode(&v3),
            Err(SignatureError::UnknownVersion(3))
        );
    }

    #[test]
    fn a_signature_round_trips_and_any_flipped_bit_is_caught() {
        let buf = sig().encode();
        assert_eq!(buf.len(), SIGNATURE_LEN);
        assert_eq!(Signature::decode(&buf), Ok(sig()));
        for byte in 16..64 {
            let mut bad = buf.clone();
            bad[byte] ^= 0x10;
            assert!(
                matches!(
                    Signature::decode(&bad),
                    Err(SignatureError::Damaged(_) | SignatureError::UnknownVersion(_))
                ),
                "byte {byte}"
            );
        }
        assert_eq!(
            Signature::decode(&vec![0u8; SIGNATURE_LEN]),
            Err(SignatureError::Missing)
        );
        let mut other = buf.clone();
        other[0] = b'X';
        assert_eq!(Signature::decode(&other), Err(SignatureError::Missing));
    }

    #[test]
    fn known_signatures_are_recognised_and_zeros_are_not() {
        let zeros = vec![0u8; PROBE_LEN];
        assert_eq!(foreign_signature(&zeros), None);
        assert_eq!(foreign_signature(&[]), None);
        let cases: [(usize, &[u8], &str); 11] = [
            (1080, &[0x53, 0xef], "ext2/ext3/ext4"),
            (0, b"XFSB", "XFS"),
            (65600, b"_BHRfS_M", "btrfs"),
            (510, &[0x55, 0xaa], "MBR"),
            (512, b"EFI PART", "GPT"),
            (512, b"LABELONE", "LVM"),
            (0, b"LABELONE", "LVM"),
            (4086, b"SWAPSPACE2", "swap"),
            (4086, b"SWAP-SPACE", "swap"),
            (0, b"LUKS\xba\xbe", "LUKS"),
            (32769, b"CD001", "ISO 9660"),
        ];
        for (offset, magic, what) in cases {
            let mut head = zeros.clone();
            head[offset..offset + magic.len()].copy_from_slice(magic);
            let found = foreign_signature(&head).unwrap_or_default();
            assert!(found.contains(what), "{what} at {offset}: {found:?}");
        }
        let mut head = zeros.clone();
        head[..SIGNATURE_LEN].copy_from_slice(&sig().encode());
        let found = foreign_signature(&head).unwrap_or_default();
        assert!(found.contains("Headroom") && found.contains("0123456789abcdef"));
        // A file shorter than the probe is looked at as far as it goes.
        assert_eq!(foreign_signature(&zeros[..100]), None);
    }
}
