//! Worker CPU model: the true CPU time one I/O takes on a worker thread.
//!
//! (Named `worker_cpu` rather than `cpu`: `headroom-qos` has a `cpu` module, which picks CPU
//! feature levels for its allocation code; this one is about simulated CPU *time*.)
//!
//! BurstCBS measured its DPU control threads (docs/background.md §1.5): a 4 KB write costs 1.16 µs and
//! a 128 KB write 6.18 µs, i.e. a fixed cost plus a per-KiB cost. The simulator charges that
//! affine cost per direction, and optionally a rare slow path (error handling after an FPGA
//! fault can double the cost, §1.5) to exercise online cost correction. This is the *truth*
//! the simulated node runs on; the policy only sees the `qos::CostModel` estimate.

use crate::rng::SimRng;
use headroom_qos::OpKind;
use serde::{Deserialize, Serialize};

/// Per-I/O CPU cost of a worker.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuSpec {
    /// Fixed CPU time of a read, ns.
    #[serde(default = "default_base")]
    pub read_base_ns: f64,
    /// CPU time per KiB of a read, ns.
    #[serde(default = "default_per_kib")]
    pub read_per_kib_ns: f64,
    /// Fixed CPU time of a write, ns.
    #[serde(default = "default_base")]
    pub write_base_ns: f64,
    /// CPU time per KiB of a write, ns.
    #[serde(default = "default_per_kib")]
    pub write_per_kib_ns: f64,
    /// CPU time of a request without payload (flush, trim), ns.
    #[serde(default = "default_base")]
    pub other_ns: f64,
    /// Probability that an I/O takes the slow path.
    #[serde(default)]
    pub slow_path_chance: f64,
    /// CPU multiplier of the slow path.
    #[serde(default = "default_slow_factor")]
    pub slow_path_factor: f64,
}

/// BurstCBS fit: 1.16 µs at 4 KiB, 6.18 µs at 128 KiB → 0.998 µs + 40.48 ns/KiB.
fn default_base() -> f64 {
    998.0
}
fn default_per_kib() -> f64 {
    40.48
}
fn default_slow_factor() -> f64 {
    2.0
}

impl Default for CpuSpec {
    fn default() -> Self {
        CpuSpec {
            read_base_ns: default_base(),
            read_per_kib_ns: default_per_kib(),
            write_base_ns: default_base(),
            write_per_kib_ns: default_per_kib(),
            other_ns: default_base(),
            slow_path_chance: 0.0,
            slow_path_factor: default_slow_factor(),
        }
    }
}

impl CpuSpec {
    /// CPU time of one I/O without the slow path, ns.
    #[inline]
    pub fn nominal_ns(&self, op: OpKind, len_bytes: u32) -> f64 {
        let kib = f64::from(len_bytes) / 1024.0;
        match op {
            OpKind::Read => self.read_base_ns + kib * self.read_per_kib_ns,
            OpKind::Write => self.write_base_ns + kib * self.write_per_kib_ns,
            OpKind::Flush | OpKind::Trim | OpKind::WriteZeroes => self.other_ns,
        }
    }

    /// CPU time of one I/O, drawing the slow path from `rng` when enabled, ns (at least 1).
    #[inline]
    pub fn sample_ns(&self, op: OpKind, len_bytes: u32, rng: &mut SimRng) -> u64 {
        let mut ns = self.nominal_ns(op, len_bytes);
        if self.slow_path_chance > 0.0 && rng.chance(self.slow_path_chance) {
            ns *= self.slow_path_factor;
        }
        crate::fastmath::round_u64(ns).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_matches_burstcbs_table() {
        let c = CpuSpec::default();
        assert!((c.nominal_ns(OpKind::Write, 4096) - 1_160.0).abs() < 1.0);
        assert!((c.nominal_ns(OpKind::Write, 128 << 10) - 6_180.0).abs() < 1.0);
        // "admittable per ms by CPU": 862 and 161.
        assert_eq!((1e6 / c.nominal_ns(OpKind::Write, 4096)) as u32, 862);
        assert_eq!((1e6 / c.nominal_ns(OpKind::Write, 128 << 10)) as u32, 161);
    }

    #[test]
    fn slow_path_doubles_at_the_configured_rate() {
        let c = CpuSpec {
            slow_path_chance: 0.1,
            ..CpuSpec::default()
        };
        let mut rng = SimRng::new(3, 3);
        let n = 100_000;
        let slow = (0..n)
            .filter(|_| c.sample_ns(OpKind::Read, 4096, &mut rng) > 2_000)
            .count();
        assert!((slow as f64 / n as f64 - 0.1).abs() < 0.01);
    }
}
