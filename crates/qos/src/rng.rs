//! A tiny deterministic random source (xorshift64*), owned by the policy that needs it.
//!
//! Burst's fast recovery samples two donors (power of two choices). The choice must be
//! reproducible from a seed so that the simulator and tests are deterministic, and must not
//! touch a global RNG; quality needs are modest, so 64 bits of state are plenty.

/// xorshift64* generator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XorShift64 {
    state: u64,
}

impl XorShift64 {
    /// A generator from a seed (zero is replaced by a fixed non-zero constant).
    pub fn new(seed: u64) -> Self {
        XorShift64 {
            state: if seed == 0 {
                0x9e37_79b9_7f4a_7c15
            } else {
                seed
            },
        }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `0..n` (`n > 0`), by multiply-shift (no modulo bias worth caring about here).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_in_range() {
        let mut a = XorShift64::new(7);
        let mut b = XorShift64::new(7);
        for _ in 0..1000 {
            let x = a.below(10);
            assert_eq!(x, b.below(10));
            assert!(x < 10);
        }
        let mut z = XorShift64::new(0);
        assert_ne!(z.next_u64(), 0);
    }
}
