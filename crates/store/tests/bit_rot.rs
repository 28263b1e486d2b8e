//! Bit rot: random bits flipped behind the store's back in the device files (in data blocks
//! and in checksum entries), then every read is checked against what was written.
//!
//! The store runs on real device files. After the data is written and flushed, the test opens
//! each device file through its own descriptor, flips one random bit at a random place of each
//! chosen block (or of its 4-byte checksum entry), syncs it and drops the page cache of the
//! range (`posix_fadvise(DONTNEED)`), so the store's next read sees the disk. Then:
//!
//! - on a 2-replica volume every read returns the bytes written (0 wrong bytes) and every
//!   damaged copy is rewritten (a read of that copy alone then matches);
//! - on a 1-replica volume exactly the damaged blocks answer `StoreError::Checksum` (EIO), a
//!   sub-block write into one fails too (never laundered into a fresh checksum), and every
//!   other block reads right;
//! - a scrub finds every damaged block (100 %), repairs those with a good copy and counts the
//!   others unrepairable.
//!
//! Seeded (`HEADROOM_BIT_ROT_SEED`; otherwise a fresh seed, printed, so a failure replays).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code panics on failure by design

mod common;

use std::collections::BTreeSet;
use std::num::NonZeroU64;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use common::pattern;
use headroom_store::sim_disk::SimRng;
use headroom_store::{EXTENT_SIZE_BYTES, NewVolume, Store, StoreConfig, StoreError, Volume};
use tempfile::TempDir;

const E: u64 = EXTENT_SIZE_BYTES;
const BLOCK: u64 = 4096;
const MIB: u64 = 1 << 20;
/// Where the checksum entries start on a device of up to 32768 extents: after the 4 KiB
/// superblock and the 4 KiB write-intent bitmap (`checksum::Layout`).
const SUMS_OFFSET: u64 = 8192;
const VOLUME_BYTES: u64 = 3 * E;
/// Blocks damaged per volume and round.
const DAMAGED: usize = 24;

fn seed() -> u64 {
    let seed = std::env::var("HEADROOM_BIT_ROT_SEED")
        .ok()
        .map(|v| {
            let v = v.trim().to_string();
            match v.strip_prefix("0x") {
                Some(h) => u64::from_str_radix(h, 16).unwrap(),
                None => v.parse().unwrap(),
            }
        })
        .unwrap_or_else(|| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            SimRng::new(nanos).next_u64()
        });
    eprintln!("bit rot seed {seed:#x} (replay: HEADROOM_BIT_ROT_SEED={seed:#x})");
    seed
}

fn open(dir: &TempDir) -> Store {
    Store::open(&StoreConfig {
        device_count: 3,
        device_capacity_bytes: 32 * MIB,
        ..StoreConfig::new(dir.path())
    })
    .unwrap()
}

fn volume(store: &Store, name: &str, replicas: u8) -> Arc<Volume> {
    store
        .create_volume_with(
            name,
            VOLUME_BYTES,
            NewVolume {
                replicas,
                ..NewVolume::default()
            },
        )
        .unwrap();
    store.open_volume(name).unwrap()
}

/// One damaged place: a block of a copy, in its data or in its checksum entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Damage {
    /// Block index in the volume.
    block: u64,
    replica: u8,
    in_entry: bool,
}

/// Flips one random bit of `len` bytes at `pos` of `path`, behind the store's back.
fn flip(path: &Path, pos: u64, len: u64, rng: &mut SimRng) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let at = pos + rng.below(len);
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 1 << rng.below(8);
    f.write_all_at(&b, at).unwrap();
    f.sync_data().unwrap();
    let page = at / BLOCK * BLOCK;
    rustix::fs::fadvise(
        &f,
        page,
        NonZeroU64::new(BLOCK),
        rustix::fs::Advice::DontNeed,
    )
    .unwrap();
}

/// Damages `n` distinct blocks of `v` (one copy each, data or entry), chosen by `rng`.
fn damage(
    dir: &TempDir,
    v: &Volume,
    n: usize,
    rng: &mut SimRng,
    avoid: &BTreeSet<u64>,
) -> Vec<Damage> {
    let blocks = VOLUME_BYTES / BLOCK;
    let mut chosen = BTreeSet::new();
    while chosen.len() < n {
        let block = rng.below(blocks);
        if avoid.contains(&block) || chosen.iter().any(|d: &Damage| d.block == block) {
            continue;
        }
        chosen.insert(Damage {
            block,
            replica: rng.below(u64::from(v.replicas())) as u8,
            in_entry: rng.below(3) == 0,
        });
    }
    for d in &chosen {
        let extent = d.block * BLOCK / E;
        let in_extent = (d.block * BLOCK) % E / BLOCK;
        let loc = v.replica_location(d.replica, extent).unwrap();
        let path = dir.path().join(format!("devices/dev-{}.img", loc.device));
        if d.in_entry {
            let index = loc.offset_bytes / E;
            flip(&path, SUMS_OFFSET + (index * 512 + in_extent) * 4, 4, rng);
        } else {
            flip(&path, loc.offset_bytes + in_extent * BLOCK, BLOCK, rng);
        }
    }
    chosen.into_iter().collect()
}

fn checksum_errors(store: &Store) -> u64 {
    store.device_stats().iter().map(|d| d.checksum_errors).sum()
}

#[test]
fn flipped_bits_are_never_served_and_are_repaired_from_a_good_copy() {
    let mut rng = SimRng::new(seed());
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir);
    assert!(store.pool_info().devices.iter().all(|d| d.checksums));
    let two = volume(&store, "two", 2);
    let one = volume(&store, "one", 1);
    let data = pattern(rng.next_u64(), VOLUME_BYTES as usize);
    two.write_at(0, &data, false).unwrap();
    one.write_at(0, &data, false).unwrap();
    two.flush().unwrap();
    one.flush().unwrap();

    // Round 1: reads.
    let damaged_two = damage(&dir, &two, DAMAGED, &mut rng, &BTreeSet::new());
    let damaged_one = damage(&dir, &one, DAMAGED, &mut rng, &BTreeSet::new());
    let mut buf = vec![0u8; VOLUME_BYTES as usize];
    for copy in 0..2u8 {
        buf.fill(0);
        two.read_at_from(0, &mut buf, copy).unwrap();
        let wrong = buf.iter().zip(&data).filter(|(a, b)| a != b).count();
        assert_eq!(
            wrong, 0,
            "2-replica volume read from copy {copy}: {wrong} wrong bytes"
        );
    }
    // Every damaged copy was rewritten: read alone, it matches.
    for d in &damaged_two {
        let mut b = vec![0u8; BLOCK as usize];
        two.read_replica_at(d.replica, d.block * BLOCK, &mut b)
            .unwrap_or_else(|e| panic!("{d:?} not repaired: {e}"));
        assert!(
            b == data[(d.block * BLOCK) as usize..((d.block + 1) * BLOCK) as usize],
            "{d:?}"
        );
    }
    let repaired: u64 = store.device_stats().iter().map(|d| d.repaired_blocks).sum();
    assert!(
        repaired >= DAMAGED as u64,
        "{repaired} blocks repaired, {DAMAGED} damaged"
    );
    // 1 replica: exactly the damaged blocks fail, with the checksum error.
    let bad: BTreeSet<u64> = damaged_one.iter().map(|d| d.block).collect();
    let mut b = vec![0u8; BLOCK as usize];
    for block in 0..VOLUME_BYTES / BLOCK {
        let result = one.read_at(block * BLOCK, &mut b);
        if bad.contains(&block) {
            assert!(
                matches!(result, Err(StoreError::Checksum { .. })),
                "damaged block {block} read {result:?}"
            );
        } else {
            result.unwrap_or_else(|e| panic!("block {block}: {e}"));
            assert!(
                b == data[(block * BLOCK) as usize..((block + 1) * BLOCK) as usize],
                "block {block} of the 1-replica volume reads wrong"
            );
        }
    }
    // Sub-block I/O into a damaged block: the read fails, and so does a write (its old
    // block does not verify: writing it would launder the corruption into a fresh checksum).
    let first_bad = *bad.iter().next().unwrap();
    let mut small = [0u8; 512];
    assert!(matches!(
        one.read_at(first_bad * BLOCK + 1024, &mut small),
        Err(StoreError::Checksum { .. })
    ));
    assert!(matches!(
        one.write_at(first_bad * BLOCK + 1024, &[7u8; 512], false),
        Err(StoreError::Checksum { .. })
    ));
    // On 2 replicas a sub-block write into a (fresh) damaged block repairs it first.
    let fresh: BTreeSet<u64> = damaged_two.iter().map(|d| d.block).collect();
    let d2 = damage(&dir, &two, 1, &mut rng, &fresh)[0];
    let mut expect = data.clone();
    let at = (d2.block * BLOCK + 512) as usize;
    expect[at..at + 512].fill(9);
    two.write_at(at as u64, &[9u8; 512], false).unwrap();
    for copy in 0..2u8 {
        let mut b = vec![0u8; BLOCK as usize];
        two.read_replica_at(copy, d2.block * BLOCK, &mut b).unwrap();
        assert!(
            b == expect[(d2.block * BLOCK) as usize..((d2.block + 1) * BLOCK) as usize],
            "copy {copy} after a sub-block write into a damaged block"
        );
    }

    // Round 2: a scrub finds every damaged block.
    let before = checksum_errors(&store);
    let avoid: BTreeSet<u64> = bad.clone();
    let scrub_two = damage(&dir, &two, DAMAGED, &mut rng, &BTreeSet::new());
    let scrub_one = damage(&dir, &one, DAMAGED, &mut rng, &avoid);
    let r2 = two.scrub().unwrap();
    assert_eq!(r2.checksum_mismatches, DAMAGED as u64, "{r2:?}");
    assert_eq!(r2.checksum_repaired, DAMAGED as u64, "{r2:?}");
    assert_eq!(r2.unrepairable, 0, "{r2:?}");
    assert_eq!(r2.blocks_verified, 3 * 2 * 512);
    // The first round's 24 blocks are still bad on the 1-replica volume, plus these.
    let r1 = one.scrub().unwrap();
    assert_eq!(r1.checksum_mismatches, 2 * DAMAGED as u64, "{r1:?}");
    assert_eq!(r1.unrepairable, 2 * DAMAGED as u64, "{r1:?}");
    assert_eq!(
        checksum_errors(&store) - before,
        3 * DAMAGED as u64,
        "every damaged block counted once"
    );
    for d in &scrub_two {
        let mut b = vec![0u8; BLOCK as usize];
        two.read_replica_at(d.replica, d.block * BLOCK, &mut b)
            .unwrap_or_else(|e| panic!("{d:?} not repaired by the scrub: {e}"));
        assert!(b == expect[(d.block * BLOCK) as usize..((d.block + 1) * BLOCK) as usize]);
    }
    for d in &scrub_one {
        assert!(matches!(
            one.read_at(d.block * BLOCK, &mut b),
            Err(StoreError::Checksum { .. })
        ));
    }
    // A block rewritten whole gets a fresh checksum and reads again.
    one.write_at(first_bad * BLOCK, &vec![3u8; BLOCK as usize], false)
        .unwrap();
    one.read_at(first_bad * BLOCK, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 3));
}
