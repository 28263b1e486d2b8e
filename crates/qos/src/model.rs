//! Cost model: what one I/O costs in each resource dimension, corrected online.
//!
//! The scheduler is only as good as its cost estimates (docs/design.md principle 2). This module
//! turns `(op, size, sequential?)` into a [`CostVector`]:
//! - **CPU** time from a linear model per op kind (base + per KiB), BurstCBS style: measured on
//!   a few small sizes and extrapolated (docs/background.md §1.5);
//! - **ingress/egress** bytes are the payload, exactly;
//! - **device units** from either the IOCost linear model (device nanoseconds: base cost for
//!   sequential or random + per 4 KiB page, docs/background.md §6, with the kernel's built-in profiles)
//!   or a Libra VOP curve (milli-VOPs: `Max-IOP / Achieved-IOP(size)`, docs/background.md §4.2).
//!
//! Two online corrections keep estimates honest when the machine drifts:
//! - BurstCBS's **delay-based adjustment** scales the CPU estimate up step by step while the
//!   front-end delay (time between dispatch and execution, backend excluded) exceeds a target,
//!   and back down when it falls;
//! - the Gimbal/Flint **write-cost AIMD**: when the EWMA of write latency exceeds a threshold,
//!   the write cost multiplier jumps half way to its maximum; otherwise it decreases additively.
//!
//! Multipliers are integers in thousandths so estimates stay deterministic.

use crate::cost::{CostVector, mul_div_ceil};
use crate::vocab::{NS_PER_S, Observed, OpKind};
use serde::{Deserialize, Serialize};

const PAGE_BYTES: u64 = 4096;

/// A write-zeroes writes this much less metadata than its range: a 4-byte checksum entry
/// per 4 KiB block (the extent map changes are smaller still).
pub const ZERO_METADATA_RATIO: u64 = 1024;

/// IOCost treats an I/O as random if it starts farther than this from the previous end.
pub const IOCOST_SEQ_DISTANCE_BYTES: u64 = 16 * 1024 * 1024;

/// IOCost's sequential test: `|offset − previous end| <= 16 MiB`.
pub fn is_sequential(prev_end_bytes: u64, offset_bytes: u64) -> bool {
    prev_end_bytes.abs_diff(offset_bytes) <= IOCOST_SEQ_DISTANCE_BYTES
}

/// CPU cost of one op kind: `base_ns + len × per_kib_ps / 1024 / 1000`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinearCpu {
    /// Fixed cost per request, ns.
    pub base_ns: u64,
    /// Cost per KiB of payload, picoseconds.
    pub per_kib_ps: u64,
}

impl LinearCpu {
    /// Fits the line through two measured points `(size_bytes, cpu_ns)`.
    pub fn through(a: (u64, u64), b: (u64, u64)) -> LinearCpu {
        let (lo, hi) = if a.0 <= b.0 { (a, b) } else { (b, a) };
        let dsize = hi.0.saturating_sub(lo.0).max(1);
        let per_kib_ps = mul_div_ceil(hi.1.saturating_sub(lo.1), 1024 * 1000, dsize);
        let base_ns =
            lo.1.saturating_sub(mul_div_ceil(lo.0, per_kib_ps, 1024 * 1000));
        LinearCpu {
            base_ns,
            per_kib_ps,
        }
    }

    /// CPU ns for a payload of `len_bytes`.
    pub fn cpu_ns(&self, len_bytes: u64) -> u64 {
        self.base_ns
            .saturating_add(mul_div_ceil(len_bytes, self.per_kib_ps, 1024 * 1000))
    }
}

/// CPU model per op kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuModel {
    /// Reads.
    pub read: LinearCpu,
    /// Writes.
    pub write: LinearCpu,
    /// Flush, trim and write-zeroes (no payload); the per-KiB term applies to the range a
    /// write-zeroes provisions and zeroes (its checksum entries, its metadata), not to trims.
    pub other: LinearCpu,
    /// One device sync (`fdatasync`, the journal commit and the device's cache flush it
    /// causes: kernel time in the calling thread), per KiB of the write it makes durable.
    /// Charged on top of a FUA request and once per device a FLUSH syncs
    /// ([`CostModel::estimate_sync`]).
    #[serde(default = "default_sync_cpu")]
    pub sync: LinearCpu,
}

/// What one device sync costs the CPU by default: 500 µs, the order measured on a 2-core VM
/// with a virtio disk (`crates/store/tests/sync_interference.rs`: a 4 KiB FUA write took
/// 730 µs of its thread's CPU, a write and a FLUSH 1,130 µs). A sync is kernel work that
/// the process's own CPU accounting sees, far above a 4 KiB read's whole path; bare-metal
/// NVMe costs less, which only makes sync-heavy volumes pay more than they must.
pub const DEFAULT_SYNC_CPU_NS: u64 = 500_000;

/// CPU per KiB a write-zeroes zeroes by default: 5 ns (the same measurement: 1.26 ms for
/// 256 MiB with checksums, 0.37 ms without).
pub const DEFAULT_ZERO_CPU_PER_KIB_PS: u64 = 5_000;

fn default_sync_cpu() -> LinearCpu {
    LinearCpu {
        base_ns: DEFAULT_SYNC_CPU_NS,
        per_kib_ps: 0,
    }
}

impl Default for CpuModel {
    /// BurstCBS's DPU numbers (1.16 µs per 4 KB write, 6.18 µs per 128 KB write), used for
    /// reads too until calibrated.
    fn default() -> Self {
        let line = LinearCpu::through((4_096, 1_160), (131_072, 6_180));
        CpuModel {
            read: line,
            write: line,
            other: LinearCpu {
                base_ns: line.base_ns,
                per_kib_ps: DEFAULT_ZERO_CPU_PER_KIB_PS,
            },
            sync: default_sync_cpu(),
        }
    }
}

/// IOCost linear device model (`io.cost.model`): per direction, max sequential bytes/s, max
/// 4 KiB sequential IOPS, max 4 KiB random IOPS. Costs are device nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoCostModel {
    /// Read bytes/s.
    pub rbps: u64,
    /// Read 4 KiB sequential IOPS.
    pub rseqiops: u64,
    /// Read 4 KiB random IOPS.
    pub rrandiops: u64,
    /// Write bytes/s.
    pub wbps: u64,
    /// Write 4 KiB sequential IOPS.
    pub wseqiops: u64,
    /// Write 4 KiB random IOPS.
    pub wrandiops: u64,
}

impl IoCostModel {
    /// Kernel built-in profile for rotational disks.
    pub const HDD: IoCostModel = IoCostModel {
        rbps: 174_019_176,
        rseqiops: 41_708,
        rrandiops: 370,
        wbps: 178_075_866,
        wseqiops: 42_705,
        wrandiops: 378,
    };
    /// Kernel built-in profile for SSDs at queue depth 1.
    pub const SSD_QD1: IoCostModel = IoCostModel {
        rbps: 245_855_193,
        rseqiops: 61_575,
        rrandiops: 6_946,
        wbps: 141_365_009,
        wseqiops: 33_716,
        wrandiops: 26_796,
    };
    /// Kernel default SSD profile.
    pub const SSD_DFL: IoCostModel = IoCostModel {
        rbps: 488_636_629,
        rseqiops: 8_932,
        rrandiops: 8_518,
        wbps: 427_891_549,
        wseqiops: 28_755,
        wrandiops: 21_940,
    };
    /// Kernel fast-SSD profile.
    pub const SSD_FAST: IoCostModel = IoCostModel {
        rbps: 3_102_524_156,
        rseqiops: 724_816,
        rrandiops: 778_122,
        wbps: 1_742_780_862,
        wseqiops: 425_702,
        wrandiops: 443_193,
    };

    /// A built-in profile by name (`hdd`, `ssd_qd1`, `ssd_dfl`, `ssd_fast`).
    pub fn builtin(name: &str) -> Option<IoCostModel> {
        match name.to_ascii_lowercase().replace('-', "_").as_str() {
            "hdd" => Some(Self::HDD),
            "ssd_qd1" => Some(Self::SSD_QD1),
            "ssd_dfl" | "ssd" => Some(Self::SSD_DFL),
            "ssd_fast" => Some(Self::SSD_FAST),
            _ => None,
        }
    }

    /// `(page, sequential base, random base)` costs in picoseconds for one direction
    /// (`calc_lcoefs`: page = 1 s / (bps / 4 KiB); base = max(1 s / iops − page, 0)).
    pub fn coefficients_ps(bps: u64, seqiops: u64, randiops: u64) -> (u64, u64, u64) {
        let s_ps: u64 = 1_000_000_000_000;
        let page = mul_div_ceil(s_ps, PAGE_BYTES, bps.max(1));
        let seq = (s_ps / seqiops.max(1)).saturating_sub(page);
        let rand = (s_ps / randiops.max(1)).saturating_sub(page);
        (page, seq, rand)
    }

    /// Device nanoseconds for one request (`calc_vtime_cost_builtin`): base (sequential or
    /// random) + pages × page cost, pages = max(len / 4 KiB, 1). Other ops cost 0.
    pub fn cost_ns(&self, op: OpKind, len_bytes: u64, sequential: bool) -> u64 {
        LinearCoefficients::of(self).cost_ns(op, len_bytes, sequential)
    }
}

/// An [`IoCostModel`]'s coefficients, computed once: [`IoCostModel::cost_ns`] would otherwise
/// redo three 64-bit divisions per direction for every request, about a tenth of the
/// simulator's time per I/O under a policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LinearCoefficients {
    /// The model these were computed from (a changed model is not served stale values).
    model: IoCostModel,
    /// `(page, sequential base, random base)` in picoseconds: reads, writes.
    read_ps: (u64, u64, u64),
    write_ps: (u64, u64, u64),
}

impl LinearCoefficients {
    fn of(m: &IoCostModel) -> Self {
        LinearCoefficients {
            model: *m,
            read_ps: IoCostModel::coefficients_ps(m.rbps, m.rseqiops, m.rrandiops),
            write_ps: IoCostModel::coefficients_ps(m.wbps, m.wseqiops, m.wrandiops),
        }
    }

    fn cost_ns(&self, op: OpKind, len_bytes: u64, sequential: bool) -> u64 {
        let (page, seq, rand) = match op {
            OpKind::Read => self.read_ps,
            OpKind::Write => self.write_ps,
            OpKind::Flush | OpKind::Trim | OpKind::WriteZeroes => return 0,
        };
        let pages = (len_bytes / PAGE_BYTES).max(1);
        let base = if sequential { seq } else { rand };
        base.saturating_add(pages.saturating_mul(page))
            .div_ceil(1000)
    }
}

/// Derived values a [`CostModel`] keeps beside its public configuration. Not part of its
/// identity: two models with the same configuration are equal whatever their caches hold,
/// and a deserialized model starts without one (and computes as before).
#[derive(Clone, Debug, Default)]
struct DerivedCache {
    linear: Option<LinearCoefficients>,
}

impl PartialEq for DerivedCache {
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

impl Eq for DerivedCache {}

/// A Libra VOP curve: achieved IOPS per request size, per direction. Cost of a request of size
/// `s` is `max_iops / achieved(s)` VOPs, reported in milli-VOPs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VopCurve {
    /// The device's maximum IOPS (smallest, fastest operation): one VOP.
    pub max_iops: u64,
    /// `(size_bytes, achieved_iops)` for reads, sorted by size.
    pub read: Vec<(u64, u64)>,
    /// `(size_bytes, achieved_iops)` for writes, sorted by size.
    pub write: Vec<(u64, u64)>,
}

impl VopCurve {
    /// A curve sampled from an IOCost model at the given sizes (random I/O), so the two device
    /// models agree on one device.
    pub fn from_iocost(m: &IoCostModel, sizes: &[u64]) -> VopCurve {
        let sample = |op| {
            let mut pts: Vec<(u64, u64)> = sizes
                .iter()
                .map(|&s| (s, NS_PER_S / m.cost_ns(op, s, false).max(1)))
                .collect();
            pts.sort_unstable();
            pts
        };
        let read = sample(OpKind::Read);
        let write = sample(OpKind::Write);
        let max_iops = read
            .iter()
            .chain(write.iter())
            .map(|p| p.1)
            .max()
            .unwrap_or(1);
        VopCurve {
            max_iops,
            read,
            write,
        }
    }

    /// Achieved IOPS at `len_bytes`: linear interpolation between points; beyond the last point
    /// bandwidth is taken as constant; below the first point, the first point's IOPS.
    pub fn achieved_iops(points: &[(u64, u64)], len_bytes: u64) -> u64 {
        let Some(&first) = points.first() else {
            return 1;
        };
        if len_bytes <= first.0 {
            return first.1.max(1);
        }
        for w in points.windows(2) {
            let (a, b) = (w[0], w[1]);
            if len_bytes <= b.0 {
                let span = (b.0 - a.0).max(1);
                let t = len_bytes - a.0;
                let v = if b.1 >= a.1 {
                    a.1 + mul_div_ceil(b.1 - a.1, t, span)
                } else {
                    a.1 - crate::cost::mul_div_floor(a.1 - b.1, t, span)
                };
                return v.max(1);
            }
        }
        let last = points[points.len() - 1];
        crate::cost::mul_div_floor(last.1, last.0, len_bytes).max(1)
    }

    /// Milli-VOPs for one request.
    pub fn cost_milli_vops(&self, op: OpKind, len_bytes: u64) -> u64 {
        let points = match op {
            OpKind::Read => &self.read,
            OpKind::Write => &self.write,
            OpKind::Flush | OpKind::Trim | OpKind::WriteZeroes => return 0,
        };
        mul_div_ceil(self.max_iops, 1000, Self::achieved_iops(points, len_bytes))
    }
}

/// How device units are computed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceModel {
    /// The device is not modelled (device units are 0).
    None,
    /// IOCost linear model: units are device nanoseconds (capacity 10⁹ per second per device).
    Linear(IoCostModel),
    /// Libra VOP curve: units are milli-VOPs (capacity `max_iops × 1000` per second).
    Vop(VopCurve),
}

impl DeviceModel {
    /// Device units per second one device can do under this model.
    pub fn capacity_per_s(&self) -> u64 {
        match self {
            DeviceModel::None => u64::MAX,
            DeviceModel::Linear(_) => NS_PER_S,
            DeviceModel::Vop(c) => c.max_iops.saturating_mul(1000),
        }
    }
}

/// BurstCBS delay-based adjustment of the CPU estimate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelayAdjust {
    /// Front-end delay (executor queueing, backend excluded) the estimate aims to keep, ns.
    pub target_delay_ns: u64,
    /// Increase of the CPU multiplier per observation above target, thousandths.
    pub step_up_permille: u64,
    /// Decrease per observation at or below target, thousandths.
    pub step_down_permille: u64,
    /// Upper bound of the multiplier, thousandths (lower bound is 1000).
    pub max_permille: u64,
}

impl Default for DelayAdjust {
    fn default() -> Self {
        DelayAdjust {
            target_delay_ns: 250_000,
            step_up_permille: 20,
            step_down_permille: 5,
            max_permille: 4_000,
        }
    }
}

/// Gimbal/Flint dynamic write cost (Flint `SsdView::RecordIO`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteCostAimd {
    /// Write latency above which the device counts as congested, ns (Flint: 2 ms).
    pub threshold_ns: u64,
    /// EWMA gain for write latency, thousandths (Flint: 0.3).
    pub ewma_gain_permille: u64,
    /// Maximum write cost multiplier, thousandths (Flint: 3.4).
    pub max_permille: u64,
    /// Additive decrease per uncongested write, thousandths (Flint: 0.5).
    pub decrease_permille: u64,
}

impl Default for WriteCostAimd {
    fn default() -> Self {
        WriteCostAimd {
            threshold_ns: 2_000_000,
            ewma_gain_permille: 300,
            max_permille: 3_400,
            decrease_permille: 500,
        }
    }
}

/// Estimates the cost vector of an I/O and corrects itself from observations.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CostModel {
    /// CPU model.
    pub cpu: CpuModel,
    /// Device model.
    pub device: DeviceModel,
    /// CPU correction.
    pub delay: DelayAdjust,
    /// Write device-cost correction.
    pub write_cost: WriteCostAimd,
    cpu_multiplier_permille: u64,
    write_multiplier_permille: u64,
    write_latency_ewma_ns: u64,
    #[serde(skip)]
    derived: DerivedCache,
}

impl Default for CostModel {
    /// BurstCBS CPU numbers and the kernel's default SSD profile.
    fn default() -> Self {
        CostModel::new(
            CpuModel::default(),
            DeviceModel::Linear(IoCostModel::SSD_DFL),
        )
    }
}

/// `x × permille / 1000` rounded up; the neutral 1000 (the usual case) without a division.
fn permille_ceil(x: u64, permille: u64) -> u64 {
    if permille == 1000 {
        x
    } else {
        mul_div_ceil(x, permille, 1000)
    }
}

impl CostModel {
    /// A model with default corrections and neutral multipliers.
    pub fn new(cpu: CpuModel, device: DeviceModel) -> Self {
        let linear = match &device {
            DeviceModel::Linear(m) => Some(LinearCoefficients::of(m)),
            DeviceModel::None | DeviceModel::Vop(_) => None,
        };
        CostModel {
            derived: DerivedCache { linear },
            cpu,
            device,
            delay: DelayAdjust::default(),
            write_cost: WriteCostAimd::default(),
            cpu_multiplier_permille: 1000,
            write_multiplier_permille: 1000,
            write_latency_ewma_ns: 0,
        }
    }

    /// Current CPU correction, thousandths (1000 = as modelled).
    pub fn cpu_multiplier_permille(&self) -> u64 {
        self.cpu_multiplier_permille
    }

    /// Current write device-cost correction, thousandths.
    pub fn write_multiplier_permille(&self) -> u64 {
        self.write_multiplier_permille
    }

    /// Estimated cost of one I/O. A write-zeroes is charged for the range it zeroes: CPU by
    /// the `other` line's per-KiB term, device work as the metadata it writes (a sequential
    /// write of [`ZERO_METADATA_RATIO`]-th of its range, at least one page: the checksum
    /// entries, 4 bytes per 4 KiB block); trims and flushes by their base. What a flush
    /// makes durable is [`CostModel::estimate_sync`], which the caller adds per device.
    pub fn estimate(&self, op: OpKind, len_bytes: u32, sequential: bool) -> CostVector {
        let len = u64::from(len_bytes);
        let (line, cpu_len) = match op {
            OpKind::Read => (&self.cpu.read, len),
            OpKind::Write => (&self.cpu.write, len),
            OpKind::WriteZeroes => (&self.cpu.other, len),
            OpKind::Flush | OpKind::Trim => (&self.cpu.other, 0),
        };
        let cpu_ns = permille_ceil(line.cpu_ns(cpu_len), self.cpu_multiplier_permille);
        let device = match op {
            OpKind::WriteZeroes => self.device_units(
                OpKind::Write,
                (len / ZERO_METADATA_RATIO).max(PAGE_BYTES),
                sequential,
            ),
            _ => self.device_units(op, len, sequential),
        };
        CostVector {
            cpu_ns,
            ingress_bytes: if op.has_ingress_payload() { len } else { 0 },
            egress_bytes: if op.has_egress_payload() { len } else { 0 },
            device_units: device,
        }
    }

    /// What one device sync costs: CPU by the `sync` line (per KiB of the write it makes
    /// durable: `len_bytes`, 0 for a FLUSH), device work as one random page write (the
    /// journal commit and the cache flush). Nothing crosses the network.
    pub fn estimate_sync(&self, len_bytes: u32) -> CostVector {
        CostVector {
            cpu_ns: permille_ceil(
                self.cpu.sync.cpu_ns(u64::from(len_bytes)),
                self.cpu_multiplier_permille,
            ),
            ingress_bytes: 0,
            egress_bytes: 0,
            device_units: self.device_units(OpKind::Write, PAGE_BYTES, false),
        }
    }

    /// Device units of `op` over `len` bytes, with the write-cost correction on writes.
    fn device_units(&self, op: OpKind, len: u64, sequential: bool) -> u64 {
        let device = match (&self.device, &self.derived.linear) {
            (DeviceModel::None, _) => 0,
            (DeviceModel::Linear(m), Some(c)) if c.model == *m => c.cost_ns(op, len, sequential),
            (DeviceModel::Linear(m), _) => m.cost_ns(op, len, sequential),
            (DeviceModel::Vop(c), _) => c.cost_milli_vops(op, len),
        };
        if op == OpKind::Write {
            permille_ceil(device, self.write_multiplier_permille)
        } else {
            device
        }
    }

    /// Feeds an observation back (online correction). `_sequential` and `_estimate` are kept
    /// for models that correct per class of request.
    pub fn observe(
        &mut self,
        op: OpKind,
        _len_bytes: u32,
        _sequential: bool,
        _estimate: &CostVector,
        observed: Observed,
    ) {
        // Delay-based CPU adjustment: front-end delay only.
        let d = &self.delay;
        if observed.queue_ns > d.target_delay_ns {
            self.cpu_multiplier_permille =
                (self.cpu_multiplier_permille + d.step_up_permille).min(d.max_permille.max(1000));
        } else {
            self.cpu_multiplier_permille = self
                .cpu_multiplier_permille
                .saturating_sub(d.step_down_permille)
                .max(1000);
        }
        if op == OpKind::Write {
            let w = &self.write_cost;
            let gain = w.ewma_gain_permille.min(1000);
            self.write_latency_ewma_ns = if self.write_latency_ewma_ns == 0 {
                observed.service_ns
            } else {
                (self.write_latency_ewma_ns * (1000 - gain) + observed.service_ns * gain) / 1000
            };
            let max = w.max_permille.max(1000);
            self.write_multiplier_permille = if self.write_latency_ewma_ns > w.threshold_ns {
                (self.write_multiplier_permille + max) / 2
            } else {
                self.write_multiplier_permille
                    .saturating_sub(w.decrease_permille)
                    .max(1000)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_line_reproduces_burstcbs_points() {
        let m = CostModel::new(CpuModel::default(), DeviceModel::None);
        let c4 = m.estimate(OpKind::Write, 4_096, false).cpu_ns;
        let c128 = m.estimate(OpKind::Write, 131_072, false).cpu_ns;
        assert!((1_159..=1_161).contains(&c4), "{c4}");
        assert!((6_179..=6_181).contains(&c128), "{c128}");
        // Payload lands in the right dimension.
        let w = m.estimate(OpKind::Write, 4_096, false);
        let r = m.estimate(OpKind::Read, 4_096, false);
        assert_eq!(
            (
                w.ingress_bytes,
                w.egress_bytes,
                r.ingress_bytes,
                r.egress_bytes
            ),
            (4_096, 0, 0, 4_096)
        );
        assert_eq!(m.estimate(OpKind::Trim, 1 << 30, false).ingress_bytes, 0);
    }

    #[test]
    fn a_sync_costs_what_the_sync_line_and_one_random_page_write_say() {
        let m = CostModel::new(
            CpuModel::default(),
            DeviceModel::Linear(IoCostModel::SSD_DFL),
        );
        let sync = m.estimate_sync(0);
        assert_eq!(sync.cpu_ns, DEFAULT_SYNC_CPU_NS);
        assert_eq!(
            sync.device_units,
            IoCostModel::SSD_DFL.cost_ns(OpKind::Write, 4_096, false)
        );
        assert_eq!((sync.ingress_bytes, sync.egress_bytes), (0, 0));
        // A sync costs far more CPU than the 4 KiB write it follows (the measurement behind
        // the default), and a flush alone only its base: the caller adds the syncs.
        assert!(sync.cpu_ns > 100 * m.estimate(OpKind::Write, 4_096, false).cpu_ns);
        assert!(m.estimate(OpKind::Flush, 0, false).cpu_ns < sync.cpu_ns / 100);
        // The per-KiB term is of the write made durable.
        let line = LinearCpu {
            base_ns: 1_000,
            per_kib_ps: 1_000_000,
        };
        let m = CostModel::new(
            CpuModel {
                sync: line,
                ..CpuModel::default()
            },
            DeviceModel::None,
        );
        assert_eq!(m.estimate_sync(4_096).cpu_ns, 1_000 + 4_000);
    }

    #[test]
    fn a_write_zeroes_is_charged_for_its_range_not_as_a_payload() {
        let m = CostModel::new(
            CpuModel::default(),
            DeviceModel::Linear(IoCostModel::SSD_DFL),
        );
        let len = 32 << 20;
        let zero = m.estimate(OpKind::WriteZeroes, len, true);
        let write = m.estimate(OpKind::Write, len, true);
        // No bytes cross the network.
        assert_eq!((zero.ingress_bytes, zero.egress_bytes), (0, 0));
        // CPU per KiB zeroed: 5 ns, an eighth of a write's copy.
        let base = CpuModel::default().other.base_ns;
        assert_eq!(
            zero.cpu_ns,
            base + u64::from(len) / 1024 * DEFAULT_ZERO_CPU_PER_KIB_PS / 1000
        );
        assert!(zero.cpu_ns * 4 < write.cpu_ns, "{zero:?} {write:?}");
        // Device work: the checksum entries, a 1024th of the range, written sequentially.
        assert_eq!(
            zero.device_units,
            IoCostModel::SSD_DFL.cost_ns(OpKind::Write, u64::from(len) / 1024, true)
        );
        assert!(zero.device_units > 0 && zero.device_units * 100 < write.device_units);
        // A trim is its base whatever its range.
        let trim = m.estimate(OpKind::Trim, len, true);
        assert_eq!((trim.cpu_ns, trim.device_units), (base, 0));
    }

    #[test]
    fn iocost_matches_the_derived_table() {
        // docs/background.md §6: SSD_DFL 4 KiB random read ≈ 117 µs, 128 KiB sequential read ≈ 372 µs.
        let m = IoCostModel::SSD_DFL;
        let r4 = m.cost_ns(OpKind::Read, 4_096, false);
        let s128 = m.cost_ns(OpKind::Read, 131_072, true);
        assert!((117_000..=117_500).contains(&r4), "{r4}");
        assert!((371_500..=372_500).contains(&s128), "{s128}");
        // Page cost 8.4 µs, random base 109 µs (table: 8.4 / 103.6 / 109.0).
        let (page, seq, rand) = IoCostModel::coefficients_ps(m.rbps, m.rseqiops, m.rrandiops);
        assert_eq!(
            (page / 100_000, seq / 100_000, rand / 100_000),
            (83, 1_035, 1_090)
        );
        assert_eq!(m.cost_ns(OpKind::Flush, 0, false), 0);
        assert_eq!(
            IoCostModel::builtin("ssd-fast"),
            Some(IoCostModel::SSD_FAST)
        );
        assert!(is_sequential(
            1 << 20,
            (1 << 20) + IOCOST_SEQ_DISTANCE_BYTES
        ));
        assert!(!is_sequential(0, IOCOST_SEQ_DISTANCE_BYTES + 1));
    }

    #[test]
    fn vop_cost_is_max_over_achieved() {
        let c = VopCurve {
            max_iops: 100_000,
            read: vec![(4_096, 100_000), (131_072, 10_000)],
            write: vec![(4_096, 50_000)],
        };
        assert_eq!(c.cost_milli_vops(OpKind::Read, 4_096), 1_000);
        assert_eq!(c.cost_milli_vops(OpKind::Read, 131_072), 10_000);
        assert_eq!(c.cost_milli_vops(OpKind::Write, 4_096), 2_000);
        // Beyond the last point bandwidth is constant: 8 KiB write = half the IOPS.
        assert_eq!(c.cost_milli_vops(OpKind::Write, 8_192), 4_000);
        // Interpolated in between, monotone.
        let mid = c.cost_milli_vops(OpKind::Read, 65_536);
        assert!(mid > 1_000 && mid < 10_000, "{mid}");
        let from = VopCurve::from_iocost(&IoCostModel::SSD_DFL, &[4_096, 16_384, 131_072]);
        assert!(from.cost_milli_vops(OpKind::Write, 4_096) >= 1_000);
    }

    #[test]
    fn delay_adjustment_rises_above_target_and_falls_back() {
        let mut m = CostModel::default();
        let base = m.estimate(OpKind::Read, 4_096, false).cpu_ns;
        let slow = Observed {
            service_ns: 0,
            queue_ns: 1_000_000,
        };
        for _ in 0..10 {
            m.observe(OpKind::Read, 4_096, false, &CostVector::ZERO, slow);
        }
        assert_eq!(m.cpu_multiplier_permille(), 1_200);
        assert!(m.estimate(OpKind::Read, 4_096, false).cpu_ns > base);
        for _ in 0..1_000 {
            m.observe(
                OpKind::Read,
                4_096,
                false,
                &CostVector::ZERO,
                Observed::default(),
            );
        }
        assert_eq!(m.cpu_multiplier_permille(), 1_000);
        for _ in 0..10_000 {
            m.observe(OpKind::Read, 4_096, false, &CostVector::ZERO, slow);
        }
        assert_eq!(m.cpu_multiplier_permille(), 4_000);
    }

    #[test]
    fn write_cost_aimd_follows_flint() {
        let mut m = CostModel::default();
        let slow = Observed {
            service_ns: 5_000_000,
            queue_ns: 0,
        };
        m.observe(OpKind::Write, 4_096, false, &CostVector::ZERO, slow);
        // Half way from 1.0 to 3.4.
        assert_eq!(m.write_multiplier_permille(), 2_200);
        m.observe(OpKind::Write, 4_096, false, &CostVector::ZERO, slow);
        assert_eq!(m.write_multiplier_permille(), 2_800);
        let w = m.estimate(OpKind::Write, 4_096, false).device_units;
        let plain = CostModel::default()
            .estimate(OpKind::Write, 4_096, false)
            .device_units;
        assert!(w > 2 * plain);
        // Reads do not move it; fast writes bring it down 0.5 at a time once the EWMA recovers.
        m.observe(OpKind::Read, 4_096, false, &CostVector::ZERO, slow);
        assert_eq!(m.write_multiplier_permille(), 2_800);
        let fast = Observed {
            service_ns: 100_000,
            queue_ns: 0,
        };
        let mut seen = Vec::new();
        for _ in 0..8 {
            m.observe(OpKind::Write, 4_096, false, &CostVector::ZERO, fast);
            seen.push(m.write_multiplier_permille());
        }
        // The latency EWMA (gain 0.3) stays above 2 ms for two more writes, then the cost
        // falls by 0.5 per write to its floor.
        assert_eq!(
            seen,
            vec![3_100, 3_250, 2_750, 2_250, 1_750, 1_250, 1_000, 1_000]
        );
    }
}
