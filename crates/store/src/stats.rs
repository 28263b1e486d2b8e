//! Counters that operators read: a latency histogram cheap enough for every I/O, and the
//! per-device operation counters every device I/O passes through (`Device`).
//!
//! Why here: the device layer is the one place every byte of every volume crosses, whatever
//! the node above does (scheduled or not, inline or on a worker), so counting there sees all
//! of it once. The node's `/metrics` reads these atomics at scrape time; nothing is copied.
//!
//! Cost: recording is one relaxed `fetch_add` per bucket, per sum and (on failure) per error
//! counter, plus the two clock reads that time the operation; no lock, no allocation.
//!
//! A full filesystem is not a broken device: an operation that failed with ENOSPC is counted
//! in `no_space`, not in `errors`, so nothing that judges a device by its errors (the node's
//! rebuild task fails a device after `fail_device_after_errors`) counts a full disk.

use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds of the latency buckets, as powers of two of nanoseconds: bucket `i` counts
/// durations in `(2^(13+i-1), 2^(13+i)]` ns (bucket 0: up to 8.192 µs), the last finite one
/// ends at 2^33 ns (8.59 s), and one more bucket takes everything above.
pub const LATENCY_FIRST_BOUND_LOG2_NS: u32 = 13;
/// Finite buckets; index `LATENCY_FINITE_BUCKETS` is the overflow (+Inf) bucket.
pub const LATENCY_FINITE_BUCKETS: usize = 21;
const LATENCY_BUCKETS: usize = LATENCY_FINITE_BUCKETS + 1;

/// A latency histogram of fixed log-spaced buckets (powers of two from 8.192 µs to 8.59 s),
/// as relaxed atomics: recording costs two `fetch_add`s and no branch but the clamp.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; LATENCY_BUCKETS],
    sum_ns: AtomicU64,
}

/// A consistent-enough copy of a [`LatencyHistogram`] (each atomic read once, relaxed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LatencySnapshot {
    /// Observations per bucket (not cumulative); the last is the overflow bucket.
    pub buckets: [u64; LATENCY_BUCKETS],
    pub sum_ns: u64,
}

impl LatencySnapshot {
    /// Observations in all.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Adds `other` into `self` (folding volumes or devices).
    pub fn add(&mut self, other: &LatencySnapshot) {
        for (a, b) in self.buckets.iter_mut().zip(other.buckets.iter()) {
            *a = a.saturating_add(*b);
        }
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
    }

    /// Upper bound of finite bucket `i`, in seconds.
    pub fn bound_seconds(i: usize) -> f64 {
        (1u64 << (LATENCY_FIRST_BOUND_LOG2_NS as usize + i)) as f64 / 1e9
    }
}

/// The bucket of a duration of `ns` nanoseconds.
#[inline]
pub fn latency_bucket(ns: u64) -> usize {
    // Bits needed for ns - 1: 2^(k-1) < ns <= 2^k gives k.
    let bits = 64 - ns.saturating_sub(1).leading_zeros();
    (bits.saturating_sub(LATENCY_FIRST_BOUND_LOG2_NS) as usize).min(LATENCY_FINITE_BUCKETS)
}

impl LatencyHistogram {
    /// Records one duration.
    #[inline]
    pub fn record(&self, ns: u64) {
        self.buckets[latency_bucket(ns)].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> LatencySnapshot {
        let mut out = LatencySnapshot::default();
        for (o, b) in out.buckets.iter_mut().zip(self.buckets.iter()) {
            *o = b.load(Ordering::Relaxed);
        }
        out.sum_ns = self.sum_ns.load(Ordering::Relaxed);
        out
    }
}

/// The operations a device does, as counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceOp {
    Read,
    Write,
    /// Zeroing that keeps the space (WRITE_ZEROES with NO_HOLE, a discard of part of an
    /// extent) and the reservation of a new extent's blocks.
    Zero,
    /// Deallocation (TRIM, WRITE_ZEROES, releases of whole extents).
    Punch,
    /// A data sync (FLUSH, FUA, metadata commits).
    Sync,
}

impl DeviceOp {
    pub const ALL: [DeviceOp; 5] = [
        DeviceOp::Read,
        DeviceOp::Write,
        DeviceOp::Zero,
        DeviceOp::Punch,
        DeviceOp::Sync,
    ];

    /// The `op` label value.
    pub fn name(self) -> &'static str {
        match self {
            DeviceOp::Read => "read",
            DeviceOp::Write => "write",
            DeviceOp::Zero => "zero",
            DeviceOp::Punch => "punch",
            DeviceOp::Sync => "sync",
        }
    }
}

/// How one device operation ended, as counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Done,
    /// ENOSPC: the filesystem under a device file is full (not a device error).
    NoSpace,
    /// Any other error.
    Failed,
}

impl Outcome {
    /// The outcome of an operation that returned `result`.
    pub(crate) fn of<T>(result: &std::io::Result<T>) -> Outcome {
        match result {
            Ok(_) => Outcome::Done,
            Err(e) if is_no_space(e) => Outcome::NoSpace,
            Err(_) => Outcome::Failed,
        }
    }
}

/// Whether `e` is ENOSPC (a full filesystem, real or injected), which is not a device error.
pub(crate) fn is_no_space(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull
}

/// Counters of one operation on one device. Operations = histogram count + untimed.
#[derive(Debug, Default)]
pub(crate) struct DeviceOpCounters {
    errors: AtomicU64,
    /// Operations that failed with ENOSPC (not in `errors`).
    no_space: AtomicU64,
    /// Bytes the operations moved (read, written or zeroed).
    bytes: AtomicU64,
    /// Operations counted without a duration (RAM devices).
    untimed: AtomicU64,
    latency: LatencyHistogram,
}

/// Counters of one device, per operation.
#[derive(Debug, Default)]
pub(crate) struct DeviceCounters {
    ops: [DeviceOpCounters; 5],
}

impl DeviceCounters {
    /// Records one operation of `bytes` that took `ns` and ended as `outcome`.
    #[inline]
    pub(crate) fn record(&self, op: DeviceOp, bytes: u64, ns: u64, outcome: Outcome) {
        let c = &self.ops[op as usize];
        c.latency.record(ns);
        c.bytes.fetch_add(bytes, Ordering::Relaxed);
        c.count_outcome(outcome);
    }

    /// Counts one operation of `bytes` without timing it.
    #[inline]
    pub(crate) fn count(&self, op: DeviceOp, bytes: u64, outcome: Outcome) {
        let c = &self.ops[op as usize];
        c.untimed.fetch_add(1, Ordering::Relaxed);
        c.bytes.fetch_add(bytes, Ordering::Relaxed);
        c.count_outcome(outcome);
    }

    /// Read and write errors (ENOSPC not included) since the device started: what the
    /// rebuild task's `fail_device_after_errors` counts.
    pub(crate) fn read_write_errors(&self) -> u64 {
        self.ops[DeviceOp::Read as usize]
            .errors
            .load(Ordering::Relaxed)
            .saturating_add(
                self.ops[DeviceOp::Write as usize]
                    .errors
                    .load(Ordering::Relaxed),
            )
    }

    pub(crate) fn snapshot(&self) -> [DeviceOpStats; 5] {
        let mut out = [DeviceOpStats::default(); 5];
        for (o, c) in out.iter_mut().zip(self.ops.iter()) {
            o.latency = c.latency.snapshot();
            o.ops = o.latency.count() + c.untimed.load(Ordering::Relaxed);
            o.errors = c.errors.load(Ordering::Relaxed);
            o.no_space = c.no_space.load(Ordering::Relaxed);
            o.bytes = c.bytes.load(Ordering::Relaxed);
        }
        out
    }
}

impl DeviceOpCounters {
    #[inline]
    fn count_outcome(&self, outcome: Outcome) {
        match outcome {
            Outcome::Done => {}
            Outcome::NoSpace => {
                self.no_space.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::Failed => {
                self.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// One device operation's counters, read at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceOpStats {
    pub ops: u64,
    /// Operations that failed, ENOSPC not included (a full filesystem is not a device error).
    pub errors: u64,
    /// Operations that failed with ENOSPC.
    pub no_space: u64,
    /// Bytes moved: read, written or zeroed (0 for punches and syncs).
    pub bytes: u64,
    /// Time spent in the operation (device call entry to return).
    pub latency: LatencySnapshot,
}

/// A device's counters as `Store::device_stats` returns them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceStats {
    /// The device's label: its path, or `memory:<id>`.
    pub device: String,
    /// Per operation, in [`DeviceOp::ALL`] order.
    pub ops: [DeviceOpStats; 5],
    /// Operations are timed (not on RAM devices: their latency histograms stay empty).
    pub timed: bool,
    /// Read and write errors (ENOSPC not included) since the device last entered service
    /// (its start, or `Store::restore_device`): what `fail_device_after_errors` counts.
    pub errors_in_service: u64,
    /// 4 KiB blocks that failed checksum verification since the store opened (bit rot, a
    /// torn or lost write). Always 0 on a device without checksums.
    pub checksum_errors: u64,
    /// 4 KiB blocks of this device rewritten from a good copy after they failed verification.
    pub repaired_blocks: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_from_8_us() {
        assert_eq!(latency_bucket(0), 0);
        assert_eq!(latency_bucket(8192), 0);
        assert_eq!(latency_bucket(8193), 1);
        assert_eq!(latency_bucket(16_384), 1);
        assert_eq!(latency_bucket(16_385), 2);
        assert_eq!(latency_bucket(1 << 33), LATENCY_FINITE_BUCKETS - 1);
        assert_eq!(latency_bucket((1 << 33) + 1), LATENCY_FINITE_BUCKETS);
        assert_eq!(latency_bucket(u64::MAX), LATENCY_FINITE_BUCKETS);
        for i in 0..LATENCY_FINITE_BUCKETS {
            let bound_ns = (LatencySnapshot::bound_seconds(i) * 1e9).round() as u64;
            assert_eq!(latency_bucket(bound_ns), i);
            assert_eq!(latency_bucket(bound_ns + 1), i + 1);
        }
        let h = LatencyHistogram::default();
        h.record(10_000);
        h.record(1_000_000);
        let s = h.snapshot();
        assert_eq!(s.count(), 2);
        assert_eq!(s.sum_ns, 1_010_000);
    }
}
