//! A log-bucketed latency histogram with fixed storage.
//!
//! Recording must not allocate (the simulator records one latency per I/O, millions per
//! second), and percentiles up to p99.9 must be trustworthy. Buckets are HDR-style: exact below
//! 128 ns, then 128 sub-buckets per power of two, so any recorded value is reported within
//! 0.8 % of its true value. The mean is exact (a running sum).

/// Sub-bucket bits: 2^7 = 128 sub-buckets per octave (relative error < 1/128).
const SUB_BITS: u32 = 7;
const SUB: u64 = 1 << SUB_BITS;
/// Highest octave tracked: values up to 2^48 ns (~78 hours) are exact-bucketed, larger are
/// clamped into the last bucket.
const MAX_EXP: u32 = 47;
const BUCKETS: usize = ((MAX_EXP - SUB_BITS + 2) as usize) * SUB as usize;

/// Latency histogram in nanoseconds.
#[derive(Clone)]
pub struct Histogram {
    counts: Box<[u64]>,
    count: u64,
    sum_ns: u128,
    min_ns: u64,
    max_ns: u64,
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("count", &self.count)
            .field("mean_ns", &self.mean_ns())
            .finish()
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

#[inline]
fn index_of(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let e = 63 - v.leading_zeros(); // floor(log2 v) >= SUB_BITS
    let e = e.min(MAX_EXP);
    let v = v.min((1u64 << (MAX_EXP + 1)) - 1);
    let mantissa = (v >> (e - SUB_BITS)) - SUB; // in [0, SUB)
    ((e - SUB_BITS + 1) as usize) * SUB as usize + mantissa as usize
}

/// Lowest value that falls into bucket `i`, and the bucket's width.
#[inline]
fn bucket_range(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < SUB {
        return (i, 1);
    }
    let octave = i / SUB; // >= 1
    let mantissa = i % SUB;
    let e = octave + u64::from(SUB_BITS) - 1;
    let width = 1u64 << (e - u64::from(SUB_BITS));
    ((SUB + mantissa) * width, width)
}

impl Histogram {
    /// An empty histogram.
    pub fn new() -> Self {
        Histogram {
            counts: vec![0; BUCKETS].into_boxed_slice(),
            count: 0,
            sum_ns: 0,
            min_ns: u64::MAX,
            max_ns: 0,
        }
    }

    /// Records one value.
    #[inline]
    pub fn record(&mut self, v_ns: u64) {
        self.counts[index_of(v_ns)] += 1;
        self.count += 1;
        self.sum_ns += u128::from(v_ns);
        self.min_ns = self.min_ns.min(v_ns);
        self.max_ns = self.max_ns.max(v_ns);
    }

    /// Adds every value of `other`.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += *b;
        }
        self.count += other.count;
        self.sum_ns += other.sum_ns;
        self.min_ns = self.min_ns.min(other.min_ns);
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    /// Number of values recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Exact mean, 0 when empty.
    pub fn mean_ns(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_ns as f64 / self.count as f64
        }
    }

    /// Largest value recorded (0 when empty).
    pub fn max_ns(&self) -> u64 {
        self.max_ns
    }

    /// The value at quantile `q` in `[0, 1]` (nearest rank), reported as the middle of its
    /// bucket and clamped to the observed min/max; 0 when empty.
    pub fn quantile_ns(&self, q: f64) -> f64 {
        if self.count == 0 {
            return 0.0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let (lo, width) = bucket_range(i);
                let mid = lo as f64 + (width as f64 - 1.0) / 2.0;
                return mid.clamp(self.min_ns as f64, self.max_ns as f64);
            }
        }
        self.max_ns as f64
    }

    /// Points of the cumulative distribution: `(value_ns, fraction <= value)` per non-empty
    /// bucket (upper edge of the bucket), for plotting.
    pub fn cdf_points(&self) -> Vec<(f64, f64)> {
        let mut out = Vec::new();
        if self.count == 0 {
            return out;
        }
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            seen += c;
            let (lo, width) = bucket_range(i);
            let hi = (lo + width - 1).min(self.max_ns).max(lo);
            out.push((hi as f64, seen as f64 / self.count as f64));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_contain_their_values() {
        let mut prev_end = 0u64;
        for i in 0..BUCKETS - 1 {
            let (lo, w) = bucket_range(i);
            assert_eq!(lo, prev_end, "bucket {i}");
            prev_end = lo + w;
            assert_eq!(index_of(lo), i);
            assert_eq!(index_of(lo + w - 1), i);
        }
    }

    #[test]
    fn quantiles_within_one_percent() {
        let mut h = Histogram::new();
        for v in 1..=100_000u64 {
            h.record(v * 10);
        }
        for (q, want) in [(0.5, 500_000.0), (0.99, 990_000.0), (0.999, 999_000.0)] {
            let got = h.quantile_ns(q);
            assert!((got - want).abs() / want < 0.01, "q{q}: {got} vs {want}");
        }
        assert!((h.mean_ns() - 500_005.0).abs() < 1e-6);
        assert_eq!(h.count(), 100_000);
    }

    #[test]
    fn small_values_are_exact_and_merge_adds() {
        let mut a = Histogram::new();
        let mut b = Histogram::new();
        a.record(5);
        b.record(7);
        b.record(7);
        a.merge(&b);
        assert_eq!(a.count(), 3);
        assert_eq!(a.quantile_ns(0.0), 5.0);
        assert_eq!(a.quantile_ns(1.0), 7.0);
        let cdf = a.cdf_points();
        assert_eq!(cdf.last().map(|p| p.1), Some(1.0));
    }

    #[test]
    fn huge_values_are_clamped_not_lost() {
        let mut h = Histogram::new();
        h.record(u64::MAX / 2);
        assert_eq!(h.count(), 1);
        assert!(h.quantile_ns(0.5) > 0.0);
    }
}
