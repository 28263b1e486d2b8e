//! Deterministic random numbers: one seed drives the whole run.
//!
//! Every random component (each tenant's generator, the population draw, the CPU slow path)
//! gets its own ChaCha8 *stream* derived from the run's seed and a fixed stream id. ChaCha is
//! portable (same numbers on every platform and Rust version), and separate streams mean that
//! adding a tenant does not reshuffle the numbers every other tenant sees.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Stream id of the population generator (tenant utilisations).
pub const STREAM_POPULATION: u64 = 1;
/// Stream id of the node model (CPU slow paths, dispatch tie-breaks).
pub const STREAM_NODE: u64 = 2;
/// First stream id of the tenants; tenant `i` uses `STREAM_TENANT_BASE + i`.
pub const STREAM_TENANT_BASE: u64 = 1 << 20;

/// A seeded random stream with the few distributions the simulator needs.
#[derive(Clone, Debug)]
pub struct SimRng {
    inner: ChaCha8Rng,
}

impl SimRng {
    /// The stream `stream` of the run seeded with `seed`.
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut inner = ChaCha8Rng::seed_from_u64(seed);
        inner.set_stream(stream);
        SimRng { inner }
    }

    /// A uniform 64-bit value.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    #[inline]
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[lo, hi)`.
    #[inline]
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform integer in `[0, n)`; `n == 0` yields 0. Lemire's multiply-shift (the tiny bias
    /// for huge `n` is irrelevant here and keeps the draw branch-free).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// True with probability `p`.
    #[inline]
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (p >= 1.0 || self.unit() < p)
    }

    /// Exponentially distributed with the given mean (inverse transform).
    #[inline]
    pub fn exp(&mut self, mean: f64) -> f64 {
        // 1 - unit() is in (0, 1], so the log is finite.
        -mean * (1.0 - self.unit()).ln()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_and_stream_repeat() {
        let mut a = SimRng::new(7, 3);
        let mut b = SimRng::new(7, 3);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
    }

    #[test]
    fn streams_differ() {
        let mut a = SimRng::new(7, 3);
        let mut b = SimRng::new(7, 4);
        let same = (0..64).filter(|_| a.next_u64() == b.next_u64()).count();
        assert!(same < 2);
    }

    #[test]
    fn exp_mean_and_unit_range() {
        let mut r = SimRng::new(1, 1);
        let n = 200_000;
        let mut sum = 0.0;
        for _ in 0..n {
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
            sum += r.exp(5.0);
        }
        let mean = sum / f64::from(n);
        assert!((mean - 5.0).abs() < 0.05, "mean {mean}");
    }

    #[test]
    fn below_is_in_range_and_covers() {
        let mut r = SimRng::new(2, 9);
        let mut seen = [0u32; 5];
        for _ in 0..10_000 {
            let v = r.below(5);
            seen[v as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 1_800 && c < 2_200), "{seen:?}");
    }
}
