//! Which `qos::CostModel` the simulated workers estimate with.
//!
//! The policies only ever see *estimates*; the node runs on its true CPU and device models.
//! By default the estimator is what a perfect `calibrate` would produce on the simulated node
//! (same CPU line, same device profile), so a policy is judged on its scheduling, not on a
//! mis-calibration. A scenario can instead pick the qos crate's defaults, a different device
//! profile, Libra's VOP curve or the two naive models Libra compared against (every I/O costs
//! the same; cost proportional to size), or scale the CPU estimate to study mis-estimation and
//! the online corrections.

use crate::device::{CostCurve, DeviceSpec, IoCostProfile};
use crate::error::SimError;
use crate::worker_cpu::CpuSpec;
use headroom_qos::model::{CpuModel, DeviceModel, IoCostModel, LinearCpu, VopCurve};
use headroom_qos::{CostModel, OpKind};
use serde::{Deserialize, Serialize};

/// Device part of the estimator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceEstimate {
    /// The simulated device's own model: IOCost linear for a profile, a VOP curve for a table.
    #[default]
    Node,
    /// Libra VOP curve sampled from the simulated device (1 KiB … 1 MiB, random I/O).
    Vop,
    /// Every read or write costs the same (Libra's "constant" model).
    Constant,
    /// Cost proportional to size (Libra's "linear" model without intercept).
    Size,
    /// Affine in size (IOCost-style base + per page) fitted through the device's true 4 KiB and
    /// 256 KiB random costs — a linear model *with* intercept.
    Affine,
    /// The qos crate's default (IOCost `ssd_dfl`).
    QosDefault,
    /// Device not modelled (device units are 0).
    None,
}

/// CPU part of the estimator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuEstimate {
    /// The simulated node's CPU line.
    #[default]
    Node,
    /// The qos crate's default (BurstCBS's DPU fit).
    QosDefault,
}

/// The `[cost]` table of a scenario.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostSpec {
    /// CPU estimate.
    #[serde(default)]
    pub cpu: CpuEstimate,
    /// Multiplies the CPU estimate (0.5 = the estimator thinks I/Os are twice as cheap).
    #[serde(default = "one")]
    pub cpu_scale: f64,
    /// Device estimate.
    #[serde(default)]
    pub device: DeviceEstimate,
    /// BurstCBS delay-based CPU adjustment on (qos defaults) or off.
    #[serde(default = "yes")]
    pub delay_adjust: bool,
    /// Gimbal/Flint write-cost AIMD on (qos defaults) or off.
    #[serde(default = "yes")]
    pub write_cost_aimd: bool,
}

fn one() -> f64 {
    1.0
}
fn yes() -> bool {
    true
}

impl Default for CostSpec {
    fn default() -> Self {
        CostSpec {
            cpu: CpuEstimate::Node,
            cpu_scale: 1.0,
            device: DeviceEstimate::Node,
            delay_adjust: true,
            write_cost_aimd: true,
        }
    }
}

fn line(base_ns: f64, per_kib_ns: f64, scale: f64) -> LinearCpu {
    LinearCpu {
        base_ns: (base_ns * scale).round().max(0.0) as u64,
        per_kib_ps: (per_kib_ns * scale * 1000.0).round().max(0.0) as u64,
    }
}

fn iocost(p: &IoCostProfile, speedup: f64) -> IoCostModel {
    let u = |v: f64| (v * speedup).round().max(1.0) as u64;
    IoCostModel {
        rbps: u(p.rbps),
        rseqiops: u(p.rseqiops),
        rrandiops: u(p.rrandiops),
        wbps: u(p.wbps),
        wseqiops: u(p.wseqiops),
        wrandiops: u(p.wrandiops),
    }
}

const SAMPLE_SIZES: [u64; 11] = [
    1 << 10,
    2 << 10,
    4 << 10,
    8 << 10,
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
];

/// A VOP curve sampled from the simulated device's true costs (random I/O).
fn vop_from_curve(curve: &CostCurve) -> VopCurve {
    let sample = |op| {
        SAMPLE_SIZES
            .iter()
            .map(|&s| {
                let c = curve.cost_ns(op, s as u32, false).max(1e-3);
                (s, (1e9 / c).round().max(1.0) as u64)
            })
            .collect::<Vec<_>>()
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

impl CostSpec {
    /// Builds the estimator for a node with this CPU and first device.
    pub fn build(&self, cpu: &CpuSpec, device: &DeviceSpec) -> Result<CostModel, SimError> {
        if !(self.cpu_scale.is_finite() && self.cpu_scale > 0.0) {
            return Err(SimError::Invalid(format!(
                "cost.cpu_scale must be > 0, got {}",
                self.cpu_scale
            )));
        }
        let cpu_model = match self.cpu {
            CpuEstimate::Node => CpuModel {
                read: line(cpu.read_base_ns, cpu.read_per_kib_ns, self.cpu_scale),
                write: line(cpu.write_base_ns, cpu.write_per_kib_ns, self.cpu_scale),
                other: line(cpu.other_ns, 0.0, self.cpu_scale),
                // The simulated workloads send no FUA or FLUSH: never charged here.
                sync: CpuModel::default().sync,
            },
            CpuEstimate::QosDefault => {
                let d = CpuModel::default();
                let s = |l: LinearCpu| LinearCpu {
                    base_ns: (l.base_ns as f64 * self.cpu_scale).round() as u64,
                    per_kib_ps: (l.per_kib_ps as f64 * self.cpu_scale).round() as u64,
                };
                CpuModel {
                    read: s(d.read),
                    write: s(d.write),
                    other: s(d.other),
                    sync: s(d.sync),
                }
            }
        };
        let curve = device.curve()?;
        let device_model = match self.device {
            DeviceEstimate::None => DeviceModel::None,
            DeviceEstimate::QosDefault => DeviceModel::Linear(IoCostModel::SSD_DFL),
            DeviceEstimate::Node => {
                let profile = match (&device.profile, &device.iocost) {
                    (Some(name), _) => IoCostProfile::builtin(name),
                    (None, Some(p)) => Some(*p),
                    _ => None,
                };
                match profile {
                    Some(p) => DeviceModel::Linear(iocost(&p, device.speedup)),
                    None => DeviceModel::Vop(vop_from_curve(&curve)),
                }
            }
            DeviceEstimate::Vop => DeviceModel::Vop(vop_from_curve(&curve)),
            DeviceEstimate::Constant => {
                let v = vop_from_curve(&curve);
                let m = v.max_iops;
                DeviceModel::Vop(VopCurve {
                    max_iops: m,
                    read: vec![(1 << 10, m), (1 << 30, m)],
                    write: vec![(1 << 10, m), (1 << 30, m)],
                })
            }
            DeviceEstimate::Affine => {
                let fit = |op| {
                    let c4 = curve.cost_ns(op, 4096, false).max(1.0);
                    let c256 = curve.cost_ns(op, 256 << 10, false).max(c4 + 1.0);
                    let page = (c256 - c4) / 63.0;
                    // IOCost: cost(4 KiB) = base + 1 page = 1 s / iops; page = 4 KiB / bps.
                    let iops = (1e9 / c4).round().max(1.0) as u64;
                    let bps = (4096.0 * 1e9 / page).round().max(1.0) as u64;
                    (bps, iops)
                };
                let (rbps, riops) = fit(OpKind::Read);
                let (wbps, wiops) = fit(OpKind::Write);
                DeviceModel::Linear(IoCostModel {
                    rbps,
                    rseqiops: riops,
                    rrandiops: riops,
                    wbps,
                    wseqiops: wiops,
                    wrandiops: wiops,
                })
            }
            DeviceEstimate::Size => {
                // One point at 1 KiB: beyond it bandwidth is constant, so cost ∝ size.
                let v = vop_from_curve(&curve);
                let m = v.max_iops;
                DeviceModel::Vop(VopCurve {
                    max_iops: m,
                    read: vec![(1 << 10, m)],
                    write: vec![(1 << 10, m)],
                })
            }
        };
        let mut model = CostModel::new(cpu_model, device_model);
        if !self.delay_adjust {
            model.delay.step_up_permille = 0;
            model.delay.step_down_permille = 0;
        }
        if !self.write_cost_aimd {
            model.write_cost.max_permille = 1000;
            model.write_cost.threshold_ns = u64::MAX;
        }
        Ok(model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(profile: &str) -> DeviceSpec {
        DeviceSpec {
            profile: Some(profile.into()),
            iocost: None,
            curve: None,
            speedup: 1.0,
            parallelism: 0,
            rw_interference: 0.0,
            latency_ns: 0,
            layout: Default::default(),
            streams: 1,
            count: 1,
        }
    }

    #[test]
    fn node_estimate_matches_the_simulated_truth() {
        let cpu = CpuSpec::default();
        let d = dev("ssd_fast");
        let m = CostSpec::default().build(&cpu, &d).unwrap();
        let est = m.estimate(OpKind::Write, 128 << 10, false);
        assert!((est.cpu_ns as f64 - cpu.nominal_ns(OpKind::Write, 128 << 10)).abs() <= 2.0);
        let truth = d.curve().unwrap().cost_ns(OpKind::Write, 128 << 10, false);
        assert!((est.device_units as f64 - truth).abs() / truth < 0.01);
        assert_eq!(est.ingress_bytes, 128 << 10);
    }

    #[test]
    fn libra_naive_models_are_constant_and_proportional() {
        let cpu = CpuSpec::default();
        let d = dev("ssd_dfl");
        let constant = CostSpec {
            device: DeviceEstimate::Constant,
            ..CostSpec::default()
        }
        .build(&cpu, &d)
        .unwrap();
        let a = constant.estimate(OpKind::Read, 4096, false).device_units;
        let b = constant
            .estimate(OpKind::Write, 256 << 10, false)
            .device_units;
        assert_eq!(a, b);
        let size = CostSpec {
            device: DeviceEstimate::Size,
            ..CostSpec::default()
        }
        .build(&cpu, &d)
        .unwrap();
        let s4 = size.estimate(OpKind::Read, 4096, false).device_units;
        let s64 = size.estimate(OpKind::Read, 64 << 10, false).device_units;
        assert!((s64 as f64 / s4 as f64 - 16.0).abs() < 0.1, "{s4} {s64}");
        let vop = CostSpec {
            device: DeviceEstimate::Vop,
            ..CostSpec::default()
        }
        .build(&cpu, &d)
        .unwrap();
        // VOP cost tracks the device: a 64 KiB read costs far less than 16 × a 4 KiB one.
        let v4 = vop.estimate(OpKind::Read, 4096, false).device_units;
        let v64 = vop.estimate(OpKind::Read, 64 << 10, false).device_units;
        assert!(v64 < 4 * v4, "{v4} {v64}");
    }
}
