//! `[storage.emulated]`: a device emulated in front of the store (a linear IOCost model or
//! a VOP curve, its parallelism and interference), for experiments on hardware that does not
//! behave like the device under study. Taken whole from one layer.

use headroom_node::emulated::{EmulatedDeviceSpec, EmulatedError};
use headroom_qos::model::{IoCostModel, VopCurve};
use serde::Deserialize;

use super::cost::VopSection;
use super::{Invalid, Size};

/// `[storage.emulated]`: [`EmulatedDeviceSpec`].
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmulatedSection {
    /// The linear model; exactly one of `model` and `curve`.
    #[serde(default)]
    pub model: Option<IoCostSection>,
    /// A non-linear cost curve (Libra's VOP curve, the keys of `qos.cost.device.vop`).
    #[serde(default)]
    pub curve: Option<VopSection>,
    pub parallelism: u32,
    #[serde(default)]
    pub write_interference_permille: u32,
    #[serde(default)]
    pub per_device: bool,
    #[serde(default)]
    pub streams: u32,
}

/// An IOCost linear model ([`IoCostModel`]); `rbps`/`wbps` accept sizes (`"200MB"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoCostSection {
    pub rbps: Size,
    pub rseqiops: u64,
    pub rrandiops: u64,
    pub wbps: Size,
    pub wseqiops: u64,
    pub wrandiops: u64,
}

impl IoCostSection {
    pub fn model(&self) -> IoCostModel {
        IoCostModel {
            rbps: self.rbps.0,
            rseqiops: self.rseqiops,
            rrandiops: self.rrandiops,
            wbps: self.wbps.0,
            wseqiops: self.wseqiops,
            wrandiops: self.wrandiops,
        }
    }

    pub(super) fn check(&self, prefix: &str) -> Result<(), Invalid> {
        let m = self.model();
        for (key, value) in [
            ("rbps", m.rbps),
            ("rseqiops", m.rseqiops),
            ("rrandiops", m.rrandiops),
            ("wbps", m.wbps),
            ("wseqiops", m.wseqiops),
            ("wrandiops", m.wrandiops),
        ] {
            if value == 0 {
                return Err(Invalid::new(
                    format!("{prefix}.{key}"),
                    0,
                    "every rate must be greater than 0",
                ));
            }
        }
        Ok(())
    }
}

impl EmulatedSection {
    /// Exactly one of `model` and `curve`, each valid, and the spec the node checks.
    pub(super) fn check(&self) -> Result<(), Invalid> {
        let e = self;
        match (&e.model, &e.curve) {
            (Some(_), Some(_)) => {
                return Err(Invalid::new(
                    "storage.emulated.curve",
                    "(a table)",
                    "give either model (linear) or curve (non-linear), not both",
                ));
            }
            (None, None) => {
                return Err(Invalid::new(
                    "storage.emulated.model",
                    "(missing)",
                    "needs model (linear) or curve (non-linear)",
                ));
            }
            (None, Some(c)) => c.check("storage.emulated.curve")?,
            (Some(_), None) => {}
        }
        e.spec().validate().map_err(|err| match err {
            EmulatedError::Invalid {
                key,
                value,
                allowed,
            } => Invalid::new(format!("storage.emulated.{key}"), value, allowed),
            other => Invalid::new("storage.emulated", "", other.to_string()),
        })?;
        Ok(())
    }

    /// The VOP curve, when the device is described by one.
    pub(super) fn curve(&self) -> Option<VopCurve> {
        self.curve.as_ref().map(VopSection::curve)
    }

    /// What the node emulates.
    pub(super) fn spec(&self) -> EmulatedDeviceSpec {
        let e = self;
        // With a curve the device's costs come from it; `model` then only records a linear summary
        // of the curve (4 KiB IOPS, bandwidth at its largest point), which nothing charges.
        let model = match (&e.model, &e.curve) {
            (Some(m), _) => m.model(),
            (None, Some(c)) => {
                let c = c.curve();
                let summary = |points: &[(u64, u64)]| {
                    let iops = VopCurve::achieved_iops(points, 4096).max(1);
                    let bps = points
                        .last()
                        .map_or(1, |&(size, iops)| size.saturating_mul(iops))
                        .max(1);
                    (bps, iops)
                };
                let (rbps, riops) = summary(&c.read);
                let (wbps, wiops) = summary(&c.write);
                IoCostModel {
                    rbps,
                    rseqiops: riops,
                    rrandiops: riops,
                    wbps,
                    wseqiops: wiops,
                    wrandiops: wiops,
                }
            }
            (None, None) => IoCostModel::SSD_DFL,
        };
        EmulatedDeviceSpec {
            model,
            parallelism: e.parallelism,
            write_interference_permille: e.write_interference_permille,
            per_device: e.per_device,
            streams: e.streams,
        }
    }
}
