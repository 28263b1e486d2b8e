//! `[qos.cost]`: the cost model the scheduler charges requests with, a CPU line per kind of
//! operation and a device model (none, linear, or a VOP curve). A CPU line and the device
//! model are each taken whole from one layer: their numbers only make sense together.

use headroom_qos::model::{DeviceModel, LinearCpu, VopCurve};
use merge::Merge;
use serde::Deserialize;

use super::emulated::IoCostSection;
use super::{Invalid, Size};

/// `[qos.cost]`: the cost model the scheduler charges requests with.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct CostSection {
    #[merge(strategy = Merge::merge)]
    pub cpu: CpuSection,
    pub device: Option<DeviceSection>,
    /// Gimbal/Flint write-cost AIMD on device units of writes (absent: on).
    pub write_cost_aimd: Option<bool>,
}

/// `[qos.cost.cpu]`: one line per op kind (absent: BurstCBS's numbers, [`CpuModel::default`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Merge)]
#[serde(default, deny_unknown_fields)]
#[merge(strategy = merge::option::overwrite_none)]
pub struct CpuSection {
    pub read: Option<LinearCpuSection>,
    pub write: Option<LinearCpuSection>,
    pub other: Option<LinearCpuSection>,
    pub sync: Option<LinearCpuSection>,
}

/// CPU cost of one op kind: `base_ns + KiB × per_kib_ps / 1000` ([`LinearCpu`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinearCpuSection {
    pub base_ns: u64,
    pub per_kib_ps: u64,
}

impl LinearCpuSection {
    pub fn line(&self) -> LinearCpu {
        LinearCpu {
            base_ns: self.base_ns,
            per_kib_ps: self.per_kib_ps,
        }
    }
}

/// `qos.cost.device`: `"none"`, `{ linear = { rbps = ..., ... } }` or
/// `{ vop = { max_iops = ..., read = [[size, iops], ...], write = [...] } }`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceSection {
    None,
    Linear(IoCostSection),
    Vop(VopSection),
}

/// A Libra VOP curve ([`VopCurve`]); sizes accept units (`["4KiB", 20000]`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VopSection {
    /// One VOP; absent: the largest achieved IOPS of the two curves.
    #[serde(default)]
    pub max_iops: Option<u64>,
    pub read: Vec<(Size, u64)>,
    pub write: Vec<(Size, u64)>,
}

impl VopSection {
    pub fn curve(&self) -> VopCurve {
        let points = |v: &[(Size, u64)]| v.iter().map(|&(s, iops)| (s.0, iops)).collect();
        let read: Vec<(u64, u64)> = points(&self.read);
        let write: Vec<(u64, u64)> = points(&self.write);
        let max_iops = self
            .max_iops
            .unwrap_or_else(|| read.iter().chain(&write).map(|p| p.1).max().unwrap_or(1));
        VopCurve {
            max_iops,
            read,
            write,
        }
    }

    pub(super) fn check(&self, prefix: &str) -> Result<(), Invalid> {
        if self.max_iops == Some(0) {
            return Err(Invalid::new(
                format!("{prefix}.max_iops"),
                0,
                "must be greater than 0",
            ));
        }
        for (name, points) in [("read", &self.read), ("write", &self.write)] {
            let key = format!("{prefix}.{name}");
            if points.is_empty() {
                return Err(Invalid::new(
                    key,
                    "[]",
                    "needs at least one [size, iops] point",
                ));
            }
            let mut previous = 0;
            for &(size, iops) in points {
                let point = format!("[{}, {iops}]", size.0);
                if size.0 <= previous {
                    return Err(Invalid::new(
                        key,
                        point,
                        "sizes must be greater than 0 and increasing",
                    ));
                }
                if iops == 0 {
                    return Err(Invalid::new(key, point, "IOPS must be greater than 0"));
                }
                previous = size.0;
            }
        }
        Ok(())
    }
}

impl DeviceSection {
    pub fn model(&self) -> DeviceModel {
        match self {
            DeviceSection::None => DeviceModel::None,
            DeviceSection::Linear(m) => DeviceModel::Linear(m.model()),
            DeviceSection::Vop(v) => DeviceModel::Vop(v.curve()),
        }
    }

    pub(super) fn check(&self) -> Result<(), Invalid> {
        match self {
            DeviceSection::None => Ok(()),
            DeviceSection::Linear(m) => m.check("qos.cost.device.linear"),
            DeviceSection::Vop(v) => v.check("qos.cost.device.vop"),
        }
    }
}
