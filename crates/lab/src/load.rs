//! What one tenant does: the load of the lab's scenarios, as plain data the engine runs.
//!
//! Why its own types rather than the simulator's `WorkloadSpec`: the generator must not depend
//! on the simulator (it is a measuring instrument, and the simulator is what it checks), and
//! it needs concrete things the scenario file leaves to the model: which export, which byte
//! range, which seed per tenant. `headroom lab run` translates a scenario into these, key by
//! key, and reports the keys it cannot translate.

use std::time::Duration;

use headroom_nbd::MAX_PAYLOAD_BYTES;

use crate::arrival::ArrivalKind;
use crate::client::LabError;
use crate::closed_loop::{MAX_QUEUE_DEPTH, Target};
use crate::rng::SplitMix64;

/// Request sizes and offsets are multiples of this (the smallest sector size in use).
pub const SECTOR_BYTES: u32 = 512;

/// Open-loop arrivals waiting for a free slot are capped (as in the simulator), so an
/// overloaded tenant cannot grow memory without bound; arrivals beyond are counted dropped.
pub const MAX_BACKLOG: u64 = 1 << 20;

/// How a tenant issues requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoadMode {
    /// Keep `queue_depth` requests outstanding while on (fio `iodepth`).
    Closed {
        /// Requests in flight, `1..=MAX_QUEUE_DEPTH`.
        queue_depth: u32,
    },
    /// Requests arrive at `rate_iops` whatever the latency; at most `max_outstanding` are in
    /// flight, later arrivals wait in a backlog (fio `rate_iops` with an `iodepth`).
    Open {
        /// Mean arrivals per second (> 0).
        rate_iops: f64,
        /// Gap distribution.
        arrival: ArrivalKind,
        /// Most requests in flight, `1..=MAX_QUEUE_DEPTH`.
        max_outstanding: u32,
    },
}

/// A weighted mix of request sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct SizeMix {
    sizes_bytes: Vec<u32>,
    cumulative: Vec<f64>,
}

impl SizeMix {
    /// A mix of `(bytes, weight)`: every size a positive multiple of 512 up to the NBD
    /// request bound, weights >= 0 with a positive sum.
    pub fn new(entries: &[(u32, f64)]) -> Result<Self, LabError> {
        let invalid = |m: String| Err(LabError::InvalidSpec(m));
        if entries.is_empty() {
            return invalid("the size mix is empty".into());
        }
        let mut total = 0.0;
        let mut sizes_bytes = Vec::with_capacity(entries.len());
        let mut cumulative = Vec::with_capacity(entries.len());
        for &(bytes, weight) in entries {
            if bytes == 0 || !bytes.is_multiple_of(SECTOR_BYTES) {
                return invalid(format!(
                    "request size {bytes} bytes is not a positive multiple of {SECTOR_BYTES}"
                ));
            }
            if bytes > MAX_PAYLOAD_BYTES {
                return invalid(format!(
                    "request size {bytes} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte NBD request bound"
                ));
            }
            if !(weight.is_finite() && weight >= 0.0) {
                return invalid(format!("size weight {weight} must be >= 0"));
            }
            total += weight;
            sizes_bytes.push(bytes);
            cumulative.push(total);
        }
        if total <= 0.0 {
            return invalid("size weights sum to zero".into());
        }
        for c in &mut cumulative {
            *c /= total;
        }
        Ok(Self {
            sizes_bytes,
            cumulative,
        })
    }

    /// One size only.
    pub fn single(bytes: u32) -> Result<Self, LabError> {
        Self::new(&[(bytes, 1.0)])
    }

    /// Draws a size.
    pub fn sample(&self, rng: &mut SplitMix64) -> u32 {
        if self.sizes_bytes.len() == 1 {
            return self.sizes_bytes[0];
        }
        let u = rng.unit();
        let i = self
            .cumulative
            .iter()
            .position(|c| u < *c)
            .unwrap_or(self.sizes_bytes.len() - 1);
        self.sizes_bytes[i]
    }

    /// The largest size of the mix.
    #[must_use]
    pub fn max_bytes(&self) -> u32 {
        self.sizes_bytes
            .iter()
            .copied()
            .max()
            .unwrap_or(SECTOR_BYTES)
    }

    /// Mean request size, bytes.
    #[must_use]
    pub fn mean_bytes(&self) -> f64 {
        let mut prev = 0.0;
        let mut mean = 0.0;
        for (s, c) in self.sizes_bytes.iter().zip(&self.cumulative) {
            mean += f64::from(*s) * (c - prev);
            prev = *c;
        }
        mean
    }
}

/// When a tenant is on: the simulator's own [`Schedule`] (active windows intersected with an
/// on/off cycle, in ns from the start of the run), so the lab switches tenants on and off by
/// exactly the rule `sim run` does.
pub use headroom_sim::workload::Schedule;

/// One tenant: one connection to its own export.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantLoad {
    /// Server and export.
    pub target: Target,
    /// Closed or open loop.
    pub mode: LoadMode,
    /// Request sizes.
    pub sizes: SizeMix,
    /// Share of READs in thousandths (`0..=1000`).
    pub read_permille: u32,
    /// Offsets fall in `[0, region_bytes)` (at most the export's size).
    pub region_bytes: u64,
    /// Each request starts where the previous ended (wrapping), else uniform random.
    pub sequential: bool,
    /// When the tenant issues.
    pub phases: Schedule,
    /// Seed of the tenant's operations, sizes, offsets and arrivals.
    pub seed: u64,
}

impl TenantLoad {
    /// Requests this tenant may have in flight.
    #[must_use]
    pub const fn max_in_flight(&self) -> u32 {
        match self.mode {
            LoadMode::Closed { queue_depth } => queue_depth,
            LoadMode::Open {
                max_outstanding, ..
            } => max_outstanding,
        }
    }

    /// Checks the bounds that do not depend on the export.
    pub fn validate(&self) -> Result<(), LabError> {
        let invalid = |m: String| Err(LabError::InvalidSpec(m));
        let depth = self.max_in_flight();
        if !(1..=MAX_QUEUE_DEPTH).contains(&depth) {
            return invalid(format!(
                "{} {depth} is outside 1..={MAX_QUEUE_DEPTH}",
                match self.mode {
                    LoadMode::Closed { .. } => "queue_depth",
                    LoadMode::Open { .. } => "max_outstanding",
                }
            ));
        }
        if let LoadMode::Open { rate_iops, .. } = self.mode
            && !(rate_iops.is_finite() && rate_iops > 0.0 && rate_iops <= 10_000_000.0)
        {
            return invalid(format!("rate_iops {rate_iops} is outside (0, 1e7]"));
        }
        if self.read_permille > 1000 {
            return invalid(format!(
                "read_permille {} is outside 0..=1000",
                self.read_permille
            ));
        }
        if self.region_bytes < u64::from(self.sizes.max_bytes()) {
            return invalid(format!(
                "region_bytes {} is smaller than the largest request ({} bytes)",
                self.region_bytes,
                self.sizes.max_bytes()
            ));
        }
        for (a, b) in &self.phases.windows_ns {
            if b <= a {
                return invalid(format!("active window [{a} ns, {b} ns) is empty"));
            }
        }
        if let Some((on, _, _)) = self.phases.cycle_ns
            && on == 0
        {
            return invalid("an on/off cycle needs a positive on period".into());
        }
        Ok(())
    }
}

/// Tenants whose results are reported together.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupLoad {
    /// Group name.
    pub name: String,
    /// Its tenants.
    pub tenants: Vec<TenantLoad>,
    /// Statistics count completions in `[stats_from, stats_to)` from the start of the run.
    pub stats_from: Duration,
    /// End of the statistics window (at most the run's duration).
    pub stats_to: Duration,
}

/// How long and how finely a run is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunPlan {
    /// Tenants issue for this long; then in-flight requests drain.
    pub duration: Duration,
    /// Width of a timeline bucket.
    pub timeline_bucket: Duration,
    /// Requests still in flight this long after the end fail the run.
    pub drain_timeout: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant() -> TenantLoad {
        TenantLoad {
            target: Target {
                addr: "127.0.0.1:1".into(),
                export: "t".into(),
            },
            mode: LoadMode::Open {
                rate_iops: 1000.0,
                arrival: ArrivalKind::Poisson,
                max_outstanding: 32,
            },
            sizes: SizeMix::new(&[(4096, 1.0), (131_072, 1.0)]).expect("mix"),
            read_permille: 500,
            region_bytes: 1 << 30,
            sequential: false,
            phases: Schedule::default(),
            seed: 1,
        }
    }

    #[test]
    fn a_sane_tenant_is_accepted() {
        assert!(tenant().validate().is_ok());
    }

    #[test]
    fn out_of_range_tenants_are_refused_with_the_field() {
        let cases: Vec<(TenantLoad, &str)> = vec![
            (
                TenantLoad {
                    mode: LoadMode::Closed { queue_depth: 0 },
                    ..tenant()
                },
                "queue_depth 0",
            ),
            (
                TenantLoad {
                    mode: LoadMode::Closed { queue_depth: 257 },
                    ..tenant()
                },
                "queue_depth 257",
            ),
            (
                TenantLoad {
                    mode: LoadMode::Open {
                        rate_iops: 0.0,
                        arrival: ArrivalKind::Fixed,
                        max_outstanding: 4,
                    },
                    ..tenant()
                },
                "rate_iops 0",
            ),
            (
                TenantLoad {
                    mode: LoadMode::Open {
                        rate_iops: 10.0,
                        arrival: ArrivalKind::Fixed,
                        max_outstanding: 1000,
                    },
                    ..tenant()
                },
                "max_outstanding 1000",
            ),
            (
                TenantLoad {
                    read_permille: 1001,
                    ..tenant()
                },
                "read_permille 1001",
            ),
            (
                TenantLoad {
                    region_bytes: 8192,
                    ..tenant()
                },
                "smaller than the largest request",
            ),
            (
                TenantLoad {
                    phases: Schedule {
                        windows_ns: vec![(2_000_000_000, 1_000_000_000)],
                        cycle_ns: None,
                    },
                    ..tenant()
                },
                "is empty",
            ),
        ];
        for (bad, needle) in cases {
            let err = bad.validate().expect_err("accepted").to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
    }

    #[test]
    fn size_mixes_refuse_bad_sizes_and_follow_weights() {
        assert!(SizeMix::new(&[]).is_err());
        assert!(SizeMix::new(&[(1000, 1.0)]).is_err());
        assert!(SizeMix::new(&[(64 << 20, 1.0)]).is_err());
        assert!(SizeMix::new(&[(4096, 0.0)]).is_err());
        assert!(SizeMix::new(&[(4096, -1.0)]).is_err());
        let mix = SizeMix::new(&[(4096, 3.0), (65_536, 1.0)]).expect("mix");
        let mut rng = SplitMix64::new(5);
        let n = 100_000;
        let small = (0..n).filter(|_| mix.sample(&mut rng) == 4096).count();
        assert!((small as f64 / n as f64 - 0.75).abs() < 0.01, "{small}");
        assert!((mix.mean_bytes() - (0.75 * 4096.0 + 0.25 * 65_536.0)).abs() < 1e-6);
        assert_eq!(mix.max_bytes(), 65_536);
    }
}
