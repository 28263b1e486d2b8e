//! Workload generators: what each simulated tenant asks of the node.
//!
//! The reproductions need the load shapes the papers used: closed loop at a queue depth (fio
//! `iodepth`), open loop at a rate (fio `rate_iops`, optionally capped by a queue depth),
//! on/off bursts, active windows (a tenant that goes idle and resumes), the BurstCBS size mixes
//! (BPS-intensive 4–128 KiB, IOPS-intensive 4–16 KiB, §1.7) and a population whose utilisation
//! matches BurstCBS Insight 2 (most tenants far below their base level, a bursting tail).
//! Generators only draw numbers; the node model decides when they are asked.

use crate::error::SimError;
use crate::rng::SimRng;
use serde::{Deserialize, Serialize};

/// How requests are issued.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Keep `qd` requests outstanding at all times (while on).
    #[default]
    Closed,
    /// Issue at `rate_iops` regardless of completions (capped at `qd` outstanding if `qd > 0`).
    Open,
    /// Replay a trace file.
    Trace,
    /// Issue nothing (a provisioned but unused volume).
    Idle,
}

/// Inter-arrival distribution of open-loop tenants.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrival {
    /// Exponential gaps (Poisson process).
    #[default]
    Poisson,
    /// Constant gaps (fio `rate_iops` with `rate_process=linear`).
    Uniform,
}

/// Offset pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pattern {
    /// Uniform random, aligned to the request size's 4 KiB pages.
    #[default]
    Random,
    /// Each request starts where the previous one ended (wrapping at the volume's end).
    Sequential,
}

/// Request sizes: a named mix or an explicit list of `[size_kib, weight]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SizesSpec {
    /// `"iops"` (4, 8, 16 KiB), `"bps"` (4 … 128 KiB by powers of two), or one size like `"4k"`.
    Named(String),
    /// Explicit `[[size_kib, weight], ...]`.
    Table(Vec<[f64; 2]>),
}

impl Default for SizesSpec {
    fn default() -> Self {
        SizesSpec::Named("4k".into())
    }
}

/// A sampler over request sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct SizeMix {
    sizes_bytes: Vec<u32>,
    cumulative: Vec<f64>,
}

impl SizeMix {
    /// Builds the sampler of a spec.
    pub fn from_spec(spec: &SizesSpec) -> Result<SizeMix, SimError> {
        let table: Vec<[f64; 2]> = match spec {
            SizesSpec::Named(name) => match name.to_ascii_lowercase().as_str() {
                "iops" => vec![[4.0, 1.0], [8.0, 1.0], [16.0, 1.0]],
                "bps" => [4.0, 8.0, 16.0, 32.0, 64.0, 128.0]
                    .iter()
                    .map(|s| [*s, 1.0])
                    .collect(),
                other => {
                    let digits = other.trim_end_matches(['k', 'K']).trim_end_matches("ib");
                    let kib: f64 = digits.parse().map_err(|_| {
                        SimError::Invalid(format!(
                            "unknown size mix {name:?} (expected \"iops\", \"bps\", \"<n>k\" or a table)"
                        ))
                    })?;
                    vec![[kib, 1.0]]
                }
            },
            SizesSpec::Table(t) => t.clone(),
        };
        if table.is_empty() {
            return Err(SimError::Invalid("size mix is empty".into()));
        }
        let mut sizes_bytes = Vec::with_capacity(table.len());
        let mut cumulative = Vec::with_capacity(table.len());
        let mut total = 0.0;
        for [kib, w] in table {
            let bytes = kib * 1024.0;
            if !(bytes.is_finite() && bytes >= 512.0 && bytes <= f64::from(u32::MAX)) {
                return Err(SimError::Invalid(format!(
                    "request size {kib} KiB out of range [0.5 KiB, 4 GiB)"
                )));
            }
            if !(w.is_finite() && w >= 0.0) {
                return Err(SimError::Invalid(format!("size weight {w} must be >= 0")));
            }
            total += w;
            sizes_bytes.push(bytes.round() as u32);
            cumulative.push(total);
        }
        if total <= 0.0 {
            return Err(SimError::Invalid("size weights sum to zero".into()));
        }
        for c in &mut cumulative {
            *c /= total;
        }
        Ok(SizeMix {
            sizes_bytes,
            cumulative,
        })
    }

    /// Draws one size.
    #[inline]
    pub fn sample(&self, rng: &mut SimRng) -> u32 {
        if self.sizes_bytes.len() == 1 {
            return self.sizes_bytes[0];
        }
        let u = rng.unit();
        // The first index whose cumulative weight exceeds `u`, counted without branches
        // (`cumulative` is non-decreasing, so it is the number of entries `<= u`): a random
        // draw mispredicts a search loop's exit.
        let i = self
            .cumulative
            .iter()
            .map(|c| usize::from(*c <= u))
            .sum::<usize>()
            .min(self.sizes_bytes.len() - 1);
        self.sizes_bytes[i]
    }

    /// Every size with its probability, `(bytes, probability)` (the lab draws from the same
    /// mix with its own generator).
    pub fn entries(&self) -> Vec<(u32, f64)> {
        let mut prev = 0.0;
        self.sizes_bytes
            .iter()
            .zip(&self.cumulative)
            .map(|(s, c)| {
                let p = c - prev;
                prev = *c;
                (*s, p)
            })
            .collect()
    }

    /// Mean request size in bytes.
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

/// Periodic on/off bursts.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnOffSpec {
    /// Length of an on period, seconds.
    pub on_s: f64,
    /// Length of an off period, seconds.
    pub off_s: f64,
    /// Start each tenant at a random point of its cycle (else all start "on" at t = 0).
    #[serde(default = "yes")]
    pub random_phase: bool,
}

fn yes() -> bool {
    true
}

/// Trace replay settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceSpec {
    /// CSV file, relative to the scenario file.
    pub path: String,
    /// `alibaba` (`device_id,opcode,offset,length,timestamp`) or `msr` (MSR Cambridge).
    pub format: crate::trace::TraceFormat,
    /// Replay speed (2.0 = twice as fast as recorded).
    #[serde(default = "one")]
    pub speed: f64,
    /// Devices to replay, in order of first appearance; 0 = all.
    #[serde(default)]
    pub max_devices: usize,
}

fn one() -> f64 {
    1.0
}

/// Utilisation draw matching BurstCBS Insight 2 (docs/background.md §1.1): over 80 % of tenants below
/// half of their provisioned rate, a long tail that bursts to several times it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PopulationSpec {
    /// Share of tenants with utilisation uniform in `[low_min, 0.5)`.
    #[serde(default = "default_below_half")]
    pub below_half_share: f64,
    /// Lowest utilisation drawn for the quiet majority.
    #[serde(default = "default_low_min")]
    pub low_min: f64,
    /// Share of tenants that burst (on/off) to `[1, tail_peak_max]` × baseline while on.
    #[serde(default = "default_tail_share")]
    pub tail_share: f64,
    /// Highest burst level of the tail, as a multiple of the baseline.
    #[serde(default = "default_tail_peak")]
    pub tail_peak_max: f64,
    /// On/off cycle of the bursting tail.
    #[serde(default = "default_tail_onoff")]
    pub tail_onoff: OnOffSpec,
}

fn default_below_half() -> f64 {
    0.82
}
fn default_low_min() -> f64 {
    0.02
}
fn default_tail_share() -> f64 {
    0.05
}
fn default_tail_peak() -> f64 {
    3.5
}
fn default_tail_onoff() -> OnOffSpec {
    OnOffSpec {
        on_s: 1.0,
        off_s: 3.0,
        random_phase: true,
    }
}

/// One tenant's draw from a population.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TenantLoad {
    /// Rate while on, as a multiple of the baseline.
    pub level: f64,
    /// Whether the tenant bursts on/off (the tail).
    pub bursting: bool,
}

impl PopulationSpec {
    /// Checks shares and levels.
    pub fn validate(&self) -> Result<(), SimError> {
        let ok = (0.0..=1.0).contains(&self.below_half_share)
            && (0.0..=1.0).contains(&self.tail_share)
            && self.below_half_share + self.tail_share <= 1.0
            && self.low_min >= 0.0
            && self.low_min < 0.5
            && self.tail_peak_max >= 1.0
            && self.tail_onoff.on_s > 0.0
            && self.tail_onoff.off_s >= 0.0;
        if ok {
            Ok(())
        } else {
            Err(SimError::Invalid(format!("invalid population {self:?}")))
        }
    }

    /// Draws one tenant.
    pub fn draw(&self, rng: &mut SimRng) -> TenantLoad {
        let u = rng.unit();
        if u < self.below_half_share {
            TenantLoad {
                level: rng.uniform(self.low_min, 0.5),
                bursting: false,
            }
        } else if u < self.below_half_share + self.tail_share {
            TenantLoad {
                level: rng.uniform(1.0, self.tail_peak_max),
                bursting: true,
            }
        } else {
            TenantLoad {
                level: rng.uniform(0.5, 1.0),
                bursting: false,
            }
        }
    }

    /// Long-run utilisation of a drawn tenant (its mean rate over its baseline).
    pub fn mean_utilisation(&self, load: &TenantLoad) -> f64 {
        if load.bursting {
            let on = self.tail_onoff.on_s;
            load.level * on / (on + self.tail_onoff.off_s)
        } else {
            load.level
        }
    }
}

/// A tenant group's workload as written in the scenario.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSpec {
    /// Issue mode.
    #[serde(default)]
    pub mode: Mode,
    /// Closed loop: requests kept outstanding. Open loop / trace: cap on outstanding (0 = none).
    #[serde(default)]
    pub qd: u32,
    /// Open loop: requests per second per tenant (while on).
    #[serde(default)]
    pub rate_iops: f64,
    /// Open loop: rate as a multiple of the tenant's baseline IOPS (instead of `rate_iops`).
    #[serde(default)]
    pub rate_of_baseline: Option<f64>,
    /// Open loop: inter-arrival distribution.
    #[serde(default)]
    pub arrival: Arrival,
    /// Request sizes.
    #[serde(default)]
    pub sizes: SizesSpec,
    /// Fraction of reads (the rest are writes).
    #[serde(default = "default_read_fraction")]
    pub read_fraction: f64,
    /// Offset pattern.
    #[serde(default)]
    pub pattern: Pattern,
    /// Periodic on/off bursts.
    #[serde(default)]
    pub onoff: Option<OnOffSpec>,
    /// Active windows `[[from_s, to_s], ...]`; outside them the tenant is off. Default: always.
    #[serde(default)]
    pub active: Option<Vec<[f64; 2]>>,
    /// Draw each tenant's open-loop rate from a population (rates relative to the baseline).
    #[serde(default)]
    pub population: Option<PopulationSpec>,
    /// Trace replay (mode = "trace").
    #[serde(default)]
    pub trace: Option<TraceSpec>,
}

fn default_read_fraction() -> f64 {
    0.5
}

impl WorkloadSpec {
    /// Checks the fields that do not depend on the rest of the scenario.
    pub fn validate(&self) -> Result<(), SimError> {
        if !(0.0..=1.0).contains(&self.read_fraction) {
            return Err(SimError::Invalid(format!(
                "read_fraction {} outside [0, 1]",
                self.read_fraction
            )));
        }
        match self.mode {
            Mode::Closed if self.qd == 0 => {
                return Err(SimError::Invalid(
                    "closed-loop workload needs qd >= 1".into(),
                ));
            }
            Mode::Open => {
                let explicit = self.rate_iops.is_finite() && self.rate_iops > 0.0;
                if !explicit && self.rate_of_baseline.is_none() && self.population.is_none() {
                    return Err(SimError::Invalid(
                        "open-loop workload needs rate_iops > 0, rate_of_baseline or a population"
                            .into(),
                    ));
                }
            }
            Mode::Trace if self.trace.is_none() => {
                return Err(SimError::Invalid(
                    "trace workload needs a [trace] table".into(),
                ));
            }
            _ => {}
        }
        if let Some(p) = &self.population {
            p.validate()?;
        }
        if let Some(o) = &self.onoff
            && !(o.on_s > 0.0 && o.off_s >= 0.0 && o.on_s.is_finite() && o.off_s.is_finite())
        {
            return Err(SimError::Invalid(format!(
                "on/off periods must be positive, got {o:?}"
            )));
        }
        if let Some(windows) = &self.active {
            for w in windows {
                if !(w[0] >= 0.0 && w[1] > w[0]) {
                    return Err(SimError::Invalid(format!(
                        "active window {w:?} must satisfy 0 <= from < to"
                    )));
                }
            }
        }
        SizeMix::from_spec(&self.sizes)?;
        Ok(())
    }
}

/// When a tenant is on: active windows intersected with an on/off cycle.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Schedule {
    /// Sorted, non-overlapping `[from, to)` windows in ns; empty = always active.
    pub windows_ns: Vec<(u64, u64)>,
    /// On/off cycle `(on_ns, off_ns, phase_ns)`: at time t the tenant is on when
    /// `(t + phase) mod (on + off) < on`.
    pub cycle_ns: Option<(u64, u64, u64)>,
}

impl Schedule {
    /// Whether the tenant issues at `t_ns`.
    pub fn is_on(&self, t_ns: u64) -> bool {
        let in_window = self.windows_ns.is_empty()
            || self.windows_ns.iter().any(|(a, b)| t_ns >= *a && t_ns < *b);
        let in_cycle = match self.cycle_ns {
            None => true,
            Some((on, off, phase)) => (t_ns + phase) % (on + off) < on,
        };
        in_window && in_cycle
    }

    /// The first time after `t_ns` at which `is_on` may change, if any.
    pub fn next_change_ns(&self, t_ns: u64) -> Option<u64> {
        let mut best: Option<u64> = None;
        let mut consider = |c: u64| {
            if c > t_ns {
                best = Some(best.map_or(c, |b| b.min(c)));
            }
        };
        for (a, b) in &self.windows_ns {
            consider(*a);
            consider(*b);
        }
        if let Some((on, off, phase)) = self.cycle_ns
            && off > 0
        {
            let period = on + off;
            let pos = (t_ns + phase) % period;
            let to_boundary = if pos < on { on - pos } else { period - pos };
            consider(t_ns + to_boundary);
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_mixes_have_the_paper_sizes() {
        let iops = SizeMix::from_spec(&SizesSpec::Named("iops".into())).unwrap();
        assert_eq!(iops.sizes_bytes, vec![4096, 8192, 16384]);
        let bps = SizeMix::from_spec(&SizesSpec::Named("bps".into())).unwrap();
        assert_eq!(bps.sizes_bytes.first(), Some(&4096));
        assert_eq!(bps.sizes_bytes.last(), Some(&(128 << 10)));
        let one = SizeMix::from_spec(&SizesSpec::Named("64k".into())).unwrap();
        assert_eq!(one.mean_bytes(), 65536.0);
        assert!(SizeMix::from_spec(&SizesSpec::Named("huge".into())).is_err());
        assert!(SizeMix::from_spec(&SizesSpec::Table(vec![])).is_err());
    }

    #[test]
    fn size_sampling_follows_weights() {
        let mix = SizeMix::from_spec(&SizesSpec::Table(vec![[4.0, 3.0], [64.0, 1.0]])).unwrap();
        let mut rng = SimRng::new(1, 1);
        let n = 100_000;
        let small = (0..n).filter(|_| mix.sample(&mut rng) == 4096).count();
        assert!((small as f64 / n as f64 - 0.75).abs() < 0.01);
        assert!((mix.mean_bytes() - (0.75 * 4096.0 + 0.25 * 65536.0)).abs() < 1e-6);
    }

    #[test]
    fn population_matches_insight_two() {
        let p = PopulationSpec {
            below_half_share: default_below_half(),
            low_min: default_low_min(),
            tail_share: default_tail_share(),
            tail_peak_max: default_tail_peak(),
            tail_onoff: default_tail_onoff(),
        };
        let mut rng = SimRng::new(9, 5);
        let draws: Vec<_> = (0..10_000).map(|_| p.draw(&mut rng)).collect();
        let below = draws.iter().filter(|d| p.mean_utilisation(d) < 0.5).count() as f64
            / draws.len() as f64;
        assert!(below > 0.80, "share below half {below}");
        let peak = draws.iter().map(|d| d.level).fold(0.0, f64::max);
        assert!(peak > 3.0, "tail peak {peak}");
    }

    #[test]
    fn schedule_windows_and_cycles() {
        let s = Schedule {
            windows_ns: vec![(0, 100), (300, 400)],
            cycle_ns: None,
        };
        assert!(s.is_on(0) && s.is_on(99) && !s.is_on(100) && s.is_on(350));
        assert_eq!(s.next_change_ns(50), Some(100));
        assert_eq!(s.next_change_ns(100), Some(300));
        assert_eq!(s.next_change_ns(400), None);
        let c = Schedule {
            windows_ns: vec![],
            cycle_ns: Some((10, 30, 5)),
        };
        assert!(c.is_on(0) && c.is_on(4) && !c.is_on(5) && c.is_on(35));
        assert_eq!(c.next_change_ns(0), Some(5));
        assert_eq!(c.next_change_ns(5), Some(35));
    }

    #[test]
    fn validation_catches_bad_specs() {
        let mut w = WorkloadSpec {
            mode: Mode::Closed,
            qd: 0,
            rate_iops: 0.0,
            rate_of_baseline: None,
            arrival: Arrival::Poisson,
            sizes: SizesSpec::default(),
            read_fraction: 0.5,
            pattern: Pattern::Random,
            onoff: None,
            active: None,
            population: None,
            trace: None,
        };
        assert!(w.validate().is_err());
        w.qd = 4;
        assert!(w.validate().is_ok());
        w.mode = Mode::Open;
        assert!(w.validate().is_err());
        w.rate_iops = 100.0;
        assert!(w.validate().is_ok());
        w.read_fraction = 1.5;
        assert!(w.validate().is_err());
    }
}
