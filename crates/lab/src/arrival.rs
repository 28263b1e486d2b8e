//! Arrival processes of open-loop tenants: when the next request is due.
//!
//! Why both: an open-loop tenant models clients that do not wait for the storage (a queue
//! of independent users), so requests arrive at a rate whatever the latency. Poisson arrivals
//! (exponential gaps) are what many independent clients add up to and what the simulator
//! draws by default; fixed gaps are fio's `rate_iops` with `rate_process=linear`, the
//! gentlest load at a given rate, which keeps a victim's own queueing out of its latency.
//! Gaps are drawn from the lab's seeded PRNG so that a run with the same seed has the same
//! arrival times (relative to its start).

use crate::rng::SplitMix64;

/// The inter-arrival distribution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArrivalKind {
    /// Exponentially distributed gaps: a Poisson process.
    Poisson,
    /// Constant gaps of `1 / rate`.
    Fixed,
}

/// A stream of arrival gaps at a mean rate.
#[derive(Debug, Clone)]
pub struct Arrivals {
    kind: ArrivalKind,
    mean_gap_ns: f64,
    rng: SplitMix64,
}

impl Arrivals {
    /// Arrivals at `rate_per_s` (> 0, finite) with the given distribution and seed.
    #[must_use]
    pub fn new(kind: ArrivalKind, rate_per_s: f64, seed: u64) -> Self {
        Self {
            kind,
            mean_gap_ns: 1e9 / rate_per_s,
            rng: SplitMix64::new(seed),
        }
    }

    /// The gap to the next arrival, in nanoseconds (at least 1).
    pub fn next_gap_ns(&mut self) -> u64 {
        let gap = match self.kind {
            ArrivalKind::Fixed => self.mean_gap_ns,
            // Inverse transform: -ln(1 - U) is Exp(1) for U uniform in [0, 1); 1 - U is in
            // (0, 1], so the logarithm is finite.
            ArrivalKind::Poisson => -(1.0 - self.rng.unit()).ln() * self.mean_gap_ns,
        };
        (gap.round() as u64).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Arrivals within `window_ns` of the start.
    fn count_in(arrivals: &mut Arrivals, window_ns: u64) -> u64 {
        let mut t = 0u64;
        let mut n = 0;
        loop {
            t += arrivals.next_gap_ns();
            if t > window_ns {
                return n;
            }
            n += 1;
        }
    }

    #[test]
    fn poisson_arrivals_keep_their_mean_rate() {
        // 20,000/s for 10 s: 200,000 expected; the standard deviation of a Poisson count is
        // sqrt(200,000) ~ 447, so 1 % (2,000) is more than 4 sigma.
        let mut arrivals = Arrivals::new(ArrivalKind::Poisson, 20_000.0, 42);
        let n = count_in(&mut arrivals, 10_000_000_000);
        assert!((198_000..=202_000).contains(&n), "{n} arrivals");
    }

    #[test]
    fn poisson_gaps_are_exponential() {
        // For Exp(1/mean), P(gap > mean) = 1/e ~ 0.3679 and the coefficient of variation is 1.
        let mut arrivals = Arrivals::new(ArrivalKind::Poisson, 1_000.0, 9);
        let gaps: Vec<f64> = (0..100_000)
            .map(|_| arrivals.next_gap_ns() as f64)
            .collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let above = gaps.iter().filter(|g| **g > 1e6).count() as f64 / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!((mean / 1e6 - 1.0).abs() < 0.02, "mean gap {mean} ns");
        assert!(
            (above - (-1.0f64).exp()).abs() < 0.01,
            "P(gap > mean) = {above}"
        );
        assert!(
            (var.sqrt() / mean - 1.0).abs() < 0.03,
            "cv {}",
            var.sqrt() / mean
        );
    }

    #[test]
    fn fixed_arrivals_are_evenly_spaced() {
        let mut arrivals = Arrivals::new(ArrivalKind::Fixed, 4_000.0, 1);
        for _ in 0..10 {
            assert_eq!(arrivals.next_gap_ns(), 250_000);
        }
        let mut arrivals = Arrivals::new(ArrivalKind::Fixed, 3_000.0, 1);
        assert_eq!(count_in(&mut arrivals, 1_000_000_000), 3_000);
    }

    #[test]
    fn the_same_seed_gives_the_same_arrivals() {
        let mut a = Arrivals::new(ArrivalKind::Poisson, 500.0, 3);
        let mut b = Arrivals::new(ArrivalKind::Poisson, 500.0, 3);
        let mut c = Arrivals::new(ArrivalKind::Poisson, 500.0, 4);
        let ga: Vec<u64> = (0..50).map(|_| a.next_gap_ns()).collect();
        let gb: Vec<u64> = (0..50).map(|_| b.next_gap_ns()).collect();
        let gc: Vec<u64> = (0..50).map(|_| c.next_gap_ns()).collect();
        assert_eq!(ga, gb);
        assert_ne!(ga, gc);
    }
}
