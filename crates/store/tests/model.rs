//! Model check: random sequences of write / read / trim / write-zeroes / resize / flush on
//! one volume, compared after every step with a plain `Vec<u8>` model, plus invariants on
//! block status and pool accounting. Runs on the RAM backend (many cases) and on files, and on
//! a 2-replica volume, whose every copy must match the model too.

// Helpers outside `#[test]` functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use headroom_store::{EXTENT_SIZE_BYTES, NewVolume, Store, StoreConfig, StoreError, Volume};
use proptest::prelude::*;

const E: u64 = EXTENT_SIZE_BYTES;
const MAX_EXTENTS: u64 = 5;

#[derive(Clone, Debug)]
enum Op {
    Write { shape: Shape, seed: u64, fua: bool },
    Read { shape: Shape },
    Trim { shape: Shape, fua: bool },
    Zero { shape: Shape, may_release: bool },
    Resize { sectors: u64 },
    Flush,
}

/// Raw numbers turned into a range against the current size when the op runs.
#[derive(Clone, Copy, Debug)]
struct Shape {
    kind: u8,
    a: u64,
    b: u64,
}

impl Shape {
    /// (offset, len, expected in range). Kinds: random, near an extent boundary, past the end.
    fn resolve(self, size: u64) -> (u64, u64, bool) {
        let (offset, max_len) = match self.kind % 4 {
            0 | 1 => (self.a % (size + 1), size),
            2 => {
                let boundary = (self.a % (size / E + 1)) * E;
                (boundary.saturating_sub(self.b % 8192).min(size), size)
            }
            _ => {
                let offset = size.saturating_sub(self.a % 4096);
                let len = (size - offset) + 1 + self.b % 4096;
                return (offset, len, false);
            }
        };
        let cap = (max_len - offset).min(5 * E / 2);
        (offset, self.b % (cap + 1), true)
    }
}

fn shape() -> impl Strategy<Value = Shape> {
    (any::<u8>(), any::<u64>(), any::<u64>()).prop_map(|(kind, a, b)| Shape { kind, a, b })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (shape(), any::<u64>(), any::<bool>()).prop_map(|(shape, seed, fua)| Op::Write { shape, seed, fua: fua && seed % 4 == 0 }),
        2 => shape().prop_map(|shape| Op::Read { shape }),
        2 => (shape(), any::<bool>()).prop_map(|(shape, fua)| Op::Trim { shape, fua }),
        2 => (shape(), any::<bool>()).prop_map(|(shape, may_release)| Op::Zero { shape, may_release }),
        1 => (1..=MAX_EXTENTS * E / 512).prop_map(|sectors| Op::Resize { sectors }),
        1 => Just(Op::Flush),
    ]
}

fn data(seed: u64, len: usize) -> Vec<u8> {
    // Varies per 512-byte sector and never zero, so misplaced or missing sectors show.
    (0..len)
        .map(|i| ((seed ^ (i as u64 >> 9)).wrapping_mul(0x9E37_79B9) >> 13) as u8 | 1)
        .collect()
}

fn expect_range<T>(r: Result<T, StoreError>, in_range: bool) -> Result<Option<T>, TestCaseError> {
    match (r, in_range) {
        (Ok(v), true) => Ok(Some(v)),
        (Err(StoreError::OutOfRange { .. }), false) => Ok(None),
        (r, _) => Err(TestCaseError::fail(format!(
            "in_range={in_range} but got {:?}",
            r.err()
        ))),
    }
}

fn run(store: &Store, initial_sectors: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    run_with(store, initial_sectors, 1, ops)
}

fn run_with(
    store: &Store,
    initial_sectors: u64,
    replicas: u8,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let size = initial_sectors * 512;
    let options = NewVolume {
        replicas,
        ..NewVolume::default()
    };
    store.create_volume_with("m", size, options).unwrap();
    let v = store.open_volume("m").unwrap();
    let mut model = vec![0u8; size as usize];
    for op in ops {
        let size = model.len() as u64;
        match *op {
            Op::Write { shape, seed, fua } => {
                let (off, len, ok) = shape.resolve(size);
                let d = data(seed, len as usize);
                if expect_range(v.write_at(off, &d, fua), ok)?.is_some() {
                    model[off as usize..(off + len) as usize].copy_from_slice(&d);
                }
            }
            Op::Read { shape } => {
                let (off, len, ok) = shape.resolve(size);
                let mut buf = vec![0xAAu8; len as usize];
                if expect_range(v.read_at(off, &mut buf), ok)?.is_some() {
                    prop_assert!(
                        buf[..] == model[off as usize..(off + len) as usize],
                        "read {off}+{len}"
                    );
                }
            }
            Op::Trim { shape, fua } => {
                let (off, len, ok) = shape.resolve(size);
                if expect_range(v.trim(off, len, fua), ok)?.is_some() {
                    model[off as usize..(off + len) as usize].fill(0);
                }
            }
            Op::Zero { shape, may_release } => {
                let (off, len, ok) = shape.resolve(size);
                if expect_range(v.write_zeroes(off, len, may_release, false), ok)?.is_some() {
                    model[off as usize..(off + len) as usize].fill(0);
                }
            }
            Op::Resize { sectors } => {
                store.resize_volume("m", sectors * 512).unwrap();
                model.resize((sectors * 512) as usize, 0);
            }
            Op::Flush => v.flush().unwrap(),
        }
        prop_assert_eq!(v.size_bytes(), model.len() as u64);
    }
    check_final(store, &v, &model)
}

fn check_final(store: &Store, v: &Volume, model: &[u8]) -> Result<(), TestCaseError> {
    let size = model.len() as u64;
    let mut all = vec![0xAAu8; model.len()];
    v.read_at(0, &mut all).unwrap();
    prop_assert!(all == model, "final content differs");
    let runs = v.block_status(0, size).unwrap();
    prop_assert_eq!(runs.iter().map(|r| r.length).sum::<u64>(), size);
    let mut pos = 0usize;
    for r in &runs {
        if r.zero {
            prop_assert!(
                model[pos..pos + r.length as usize].iter().all(|&b| b == 0),
                "zero run at {pos} holds data"
            );
        }
        pos += r.length as usize;
    }
    let mapped = (0..size.div_ceil(E))
        .filter(|&i| v.extent_location(i).is_some())
        .count() as u64;
    // Every copy holds the model, and is mapped where replica 0 is, on another device.
    let copies = u64::from(v.replicas());
    for r in 1..v.replicas() {
        let mut copy = vec![0xAAu8; model.len()];
        v.read_replica_at(r, 0, &mut copy).unwrap();
        prop_assert!(copy == model, "replica {} differs from the model", r);
        for i in 0..size.div_ceil(E) {
            let (first, this) = (v.extent_location(i), v.replica_location(r, i));
            prop_assert_eq!(first.is_some(), this.is_some(), "extent {}", i);
            if let (Some(a), Some(b)) = (first, this) {
                prop_assert_ne!(a.device, b.device, "extent {}", i);
            }
        }
    }
    let mapped = mapped * copies;
    prop_assert_eq!(v.info().allocated_bytes, mapped * E);
    // Every extent holding non-zero data is mapped.
    for (i, chunk) in model.chunks(E as usize).enumerate() {
        if chunk.iter().any(|&b| b != 0) {
            prop_assert!(v.extent_location(i as u64).is_some());
        }
    }
    store.flush_all().unwrap();
    let pool = store.pool_info();
    prop_assert_eq!(pool.quarantined_extents, 0);
    prop_assert_eq!(pool.allocated_extents, mapped);
    prop_assert_eq!(pool.free_extents + mapped, pool.total_extents);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn memory_volume_matches_model(
        initial_sectors in 1..=MAX_EXTENTS * E / 512,
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        let store = Store::open_memory(MAX_EXTENTS * 2 * E).unwrap();
        run(&store, initial_sectors, &ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn replicated_memory_volume_matches_model_on_every_copy(
        initial_sectors in 1..=MAX_EXTENTS * E / 512,
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        // Two RAM devices of MAX_EXTENTS extents: room for every copy of a full volume.
        let store = Store::open_memory(MAX_EXTENTS * 2 * E).unwrap();
        run_with(&store, initial_sectors, 2, &ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn file_volume_matches_model_and_survives_reopen(
        initial_sectors in 1..=MAX_EXTENTS * E / 512,
        ops in proptest::collection::vec(op(), 1..30),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = StoreConfig { device_count: 2, device_capacity_bytes: MAX_EXTENTS * E, ..StoreConfig::new(dir.path()) };
        let model = {
            let store = Store::open(&cfg).unwrap();
            run(&store, initial_sectors, &ops)?;
            let v = store.open_volume("m").unwrap();
            let mut all = vec![0u8; v.size_bytes() as usize];
            v.read_at(0, &mut all).unwrap();
            all
        };
        let store = Store::open(&cfg).unwrap();
        let v = store.open_volume("m").unwrap();
        let mut all = vec![0xAAu8; model.len()];
        v.read_at(0, &mut all).unwrap();
        prop_assert!(all == model, "content changed across reopen");
    }
}
