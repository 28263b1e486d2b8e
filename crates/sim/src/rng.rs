//! Deterministic random numbers: one seed drives the whole run.
//!
//! Every random component (each tenant's generator, the population draw, the CPU slow path)
//! gets its own *stream* derived from the run's seed and a fixed stream id, so adding a tenant
//! does not reshuffle the numbers every other tenant sees.
//!
//! The generator is xoshiro256++ (Blackman and Vigna): 32 bytes of state, a few integer
//! operations per draw, period 2^256 - 1, passes BigCrush and PractRand. Each stream's state is
//! four SplitMix64 outputs of a seed mixed from `(seed, stream)`, the seeding its authors
//! recommend, so streams start at unrelated points of that period. Pure integer arithmetic:
//! the same numbers on every platform and Rust version. It replaced ChaCha8, whose 300-byte
//! state (a 256-byte output buffer and its index on different cache lines) cost two cache
//! misses per draw with 1,000 tenants and a block refill every 32 draws; the 32-byte state now
//! sits in the tenant's hot cache line (measured in docs/results.md, "Speed").

/// Stream id of the population generator (tenant utilisations).
pub const STREAM_POPULATION: u64 = 1;
/// Stream id of the node model (CPU slow paths, dispatch tie-breaks).
pub const STREAM_NODE: u64 = 2;
/// First stream id of the tenants; tenant `i` uses `STREAM_TENANT_BASE + i`.
pub const STREAM_TENANT_BASE: u64 = 1 << 20;

/// A seeded random stream with the few distributions the simulator needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRng {
    s: [u64; 4],
}

/// SplitMix64 step (Steele, Lea and Flood): advances `x` and returns a well-mixed value.
#[inline]
fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SimRng {
    /// The stream `stream` of the run seeded with `seed`.
    pub fn new(seed: u64, stream: u64) -> Self {
        // Mix the two ids through SplitMix64 separately, so that nearby (seed, stream) pairs
        // give unrelated states.
        let mut a = seed;
        let mut b = stream ^ 0x6A09_E667_F3BC_C908;
        let mut x = splitmix64(&mut a) ^ splitmix64(&mut b).rotate_left(32);
        let mut s = [
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
            splitmix64(&mut x),
        ];
        if s == [0; 4] {
            // The one state xoshiro cannot leave (never produced in practice).
            s[0] = 1;
        }
        SimRng { s }
    }

    /// A uniform 64-bit value (xoshiro256++).
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    #[inline]
    pub fn unit(&mut self) -> f64 {
        // Through `i64`: one instruction, same value (it is below 2^53).
        (self.next_u64() >> 11) as i64 as f64 * (1.0 / (1u64 << 53) as f64)
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
    fn matches_the_reference_xoshiro256pp() {
        // First outputs of xoshiro256++ from the state {1, 2, 3, 4} (reference C code).
        let mut r = SimRng { s: [1, 2, 3, 4] };
        let want = [41_943_041u64, 58_720_359, 3_588_806_011_781_223];
        for w in want {
            assert_eq!(r.next_u64(), w);
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
