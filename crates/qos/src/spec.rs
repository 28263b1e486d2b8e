//! What an operator types for a volume's QoS (CLI flags or the API's `qos` JSON object), and
//! how it becomes a [`VolumeQos`].
//!
//! Why a separate type: a [`VolumeQos`] is token buckets and byte rates, which no operator
//! writes by hand, and it depends on the volume's size (gp2 gives 3 IOPS per GiB). Operators
//! write a storage class and, perhaps, a few numbers on top of it ("gp2, but at most 2,000
//! IOPS"). A [`QosSpec`] keeps exactly what was typed, so that it can be stored, shown back and
//! changed later ([`QosSpec::merged_over`]), and [`QosSpec::resolve`] turns it into the
//! `VolumeQos` of a volume of a given size.
//!
//! # Resolution
//!
//! Start from the preset's `VolumeQos` at the volume's size, or, without a preset, from an
//! unlimited QoS ([`VolumeQos::default`]: baseline 0, no ceiling, burst on demand, weight 1,
//! one I/O per request). Then each given field refines it, in this order:
//!
//! 1. **Baselines.** `baseline_iops` / `baseline_mbps` set that dimension's baseline. Zero is
//!    allowed and means "nothing guaranteed". MB/s are decimal (10⁶ bytes per second).
//! 2. **Ceilings.** `ceiling_iops` / `ceiling_mbps` set that dimension's ceiling. A dimension
//!    whose ceiling was not given but now lies below its baseline has it raised to the
//!    baseline (gp2 with `baseline_iops: 5000` may run at 5,000). A given ceiling below a
//!    baseline that came from the preset lowers the baseline to it (gp2 with
//!    `ceiling_iops: 200` runs at most at 200, so it cannot be guaranteed 300).
//! 3. **One-dimensional baselines without a preset.** Without a preset, a baseline given in
//!    one dimension only leaves the other one unconstrained rather than at zero: its baseline
//!    is set to its ceiling (unlimited unless given). So `baseline_iops: 1000` alone
//!    guarantees 1,000 IOPS of any size and lets the volume burst on spare capacity without
//!    limit, and with `burst: none` it is a fixed 1,000 IOPS, exactly like QEMU's
//!    `iops-total=1000`. (A zero byte baseline would make every request with a payload a burst
//!    request, so the IOPS guarantee would guarantee nothing.)
//! 4. **Burst mode** (`burst`, else the preset's, else on demand):
//!    - `none`: the volume runs at one fixed rate per dimension, so its ceiling becomes its
//!      baseline (a given ceiling above the baseline has no effect; one below it has already
//!      lowered the baseline in step 2). Without a preset, a dimension with no baseline given
//!      takes its ceiling as that rate (`{burst: none, ceiling_iops: 500}` is a fixed 500 IOPS;
//!      nothing given at all is a fixed "unlimited"). Credit buckets are dropped. A baseline
//!      of 0 (given, or the preset's) is an error here: the fixed rate would be 0, so the
//!      volume would never run an I/O.
//!    - `on-demand`: above the baseline up to the ceiling whenever the node has spare
//!      capacity; credit buckets are dropped and the ceiling is not changed (a fixed-rate
//!      preset such as gp3 needs a `ceiling_*` to burst at all).
//!    - `credits`: when the starting QoS has credit buckets (gp2, azure-credit, QEMU `*-max`)
//!      they are kept (capacity, `start_full`). Otherwise a bucket is built in every *limited*
//!      dimension (finite ceiling above the baseline): refilled at the baseline, holding
//!      `(ceiling − baseline) × 1,800 s` credits, full at creation, so that a full bucket lasts
//!      exactly 30 minutes at the ceiling ([`CREDIT_BURST_SECONDS`], the duration of Azure's
//!      credit bursting and of gp2's 5.4 M-credit bucket at 3,000 IOPS). With no limited
//!      dimension this is an error: there is nothing to burst up to. So is a limited dimension
//!      whose baseline is 0: its bucket would never refill, and a volume in credit mode needs
//!      credits for every request, so it would stop for good once they ran out.
//!
//!    Whatever the mode's origin, a kept bucket whose refill is below its dimension's
//!    (refined) baseline has its refill raised to the baseline: an empty bucket delivers
//!    exactly its refill, so a lower one would break the baseline guarantee (the rule
//!    [`VolumeQos::validate`] enforces).
//! 5. **Weight.** `weight` replaces the preset's (which is one per 100 baseline IOPS); refining
//!    a baseline does not change the weight.
//! 6. **Validation** ([`VolumeQos::validate`]).
//!
//! Rejected, with [`QosError::InvalidQos`] naming the field and value: a volume size of 0; a
//! given ceiling of 0 (omit it for no ceiling); `burst: none` over a baseline of 0; a given ceiling below the baseline given in
//! the same dimension; a weight of 0 or above [`MAX_WEIGHT`]; any IOPS above [`MAX_IOPS`] or
//! MB/s above [`MAX_MBPS`]. An unknown or malformed preset, or a size the preset does not
//! sell, is the presets module's [`QosError::InvalidPreset`], passed through.

use crate::error::QosError;
use crate::presets::{self, AZURE_BURST_SECONDS};
use crate::vocab::{BurstMode, CreditBucketSpec, CreditSpec, IoRate, VolumeQos};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Bytes per second in one MB/s (decimal, as Azure and Alibaba count).
pub const BYTES_PER_MB: u64 = 1_000_000;
/// Largest IOPS a spec may give (anything above is a typo, not a volume).
pub const MAX_IOPS: u64 = 100_000_000;
/// Largest MB/s a spec may give (1 TB/s).
pub const MAX_MBPS: u64 = 1_000_000;
/// Largest weight a spec may give (the presets' range is 1–10,000).
pub const MAX_WEIGHT: u32 = 10_000;
/// How long a full credit bucket built by [`QosSpec::resolve`] lasts at the ceiling, seconds:
/// 30 minutes, as Azure's credit bursting and gp2's bucket at 3,000 IOPS.
pub const CREDIT_BURST_SECONDS: u64 = AZURE_BURST_SECONDS;

/// How a volume may exceed its baseline, as an operator names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BurstKind {
    /// Never above the baseline: one fixed rate.
    None,
    /// Above the baseline, up to the ceiling, while credits last.
    Credits,
    /// Above the baseline, up to the ceiling, whenever the node has spare capacity.
    OnDemand,
}

impl BurstKind {
    /// The spelling serde and [`FromStr`] use: `none`, `credits`, `on-demand`.
    pub fn as_str(self) -> &'static str {
        match self {
            BurstKind::None => "none",
            BurstKind::Credits => "credits",
            BurstKind::OnDemand => "on-demand",
        }
    }
}

impl fmt::Display for BurstKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for BurstKind {
    type Err = QosError;

    /// Accepts `none`, `credits`, `on-demand` and `ondemand` (any case, `_` for `-`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "none" => Ok(BurstKind::None),
            "credits" => Ok(BurstKind::Credits),
            "on-demand" | "ondemand" => Ok(BurstKind::OnDemand),
            _ => Err(QosError::InvalidQos(format!(
                "burst {s:?}: expected none, credits or on-demand"
            ))),
        }
    }
}

/// A volume's QoS as an operator writes it; see the module documentation for how it resolves.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QosSpec {
    /// A preset as `qos preview --preset` spells it: gp2, gp3, io2, azure-credit,
    /// azure-ondemand, autopl, or `qemu:iops-total=...,...` (see [`presets::Preset::parse`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<String>,
    /// Guaranteed IOPS (0 = nothing guaranteed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_iops: Option<u64>,
    /// Guaranteed MB/s, decimal (10⁶ bytes per second).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_mbps: Option<u64>,
    /// Most IOPS ever allowed (> 0; absent = the preset's, or no ceiling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling_iops: Option<u64>,
    /// Most MB/s ever allowed, decimal (> 0; absent = the preset's, or no ceiling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling_mbps: Option<u64>,
    /// How the volume may exceed its baseline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<BurstKind>,
    /// Share of spare capacity relative to other volumes (1–10,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

fn invalid(msg: String) -> QosError {
    QosError::InvalidQos(msg)
}

/// A dimension of a spec: its given fields and how to read and write it in a `VolumeQos`.
#[derive(Clone, Copy)]
struct Dim {
    /// Suffix of the dimension's field names (`iops`, `mbps`), for messages.
    unit: &'static str,
    /// Given baseline and ceiling, already in the `VolumeQos` unit (I/O units or bytes/s).
    baseline: Option<u64>,
    ceiling: Option<u64>,
    get: fn(&IoRate) -> u64,
    set: fn(&mut IoRate, u64),
    bucket: fn(&mut CreditSpec) -> &mut Option<CreditBucketSpec>,
}

impl QosSpec {
    /// Whether nothing is given (such a spec resolves to [`VolumeQos::default`], and as a
    /// change it changes nothing).
    pub fn is_empty(&self) -> bool {
        *self == QosSpec::default()
    }

    /// Resolves against a volume size: the preset's `VolumeQos` (or an unlimited one),
    /// refined by each given field, then validated. The rules are in the module documentation.
    pub fn resolve(&self, size_bytes: u64) -> Result<VolumeQos, QosError> {
        if size_bytes == 0 {
            return Err(invalid("volume size must be > 0 bytes".into()));
        }
        self.check_fields()?;
        let mut q = match &self.preset {
            Some(p) => presets::volume_qos(p, size_bytes)?,
            None => VolumeQos::default(),
        };
        let dims = self.dims();

        // 1 and 2: baselines, then ceilings.
        for d in &dims {
            if let Some(b) = d.baseline {
                (d.set)(&mut q.baseline, b);
            }
            let baseline = (d.get)(&q.baseline);
            match d.ceiling {
                Some(c) => {
                    (d.set)(&mut q.ceiling, c);
                    // Only lowers a preset's baseline: a given one above `c` was rejected.
                    (d.set)(&mut q.baseline, baseline.min(c));
                }
                None if (d.get)(&q.ceiling) < baseline => (d.set)(&mut q.ceiling, baseline),
                None => {}
            }
        }
        // 3: without a preset, a baseline given in one dimension only leaves the other free.
        let given = dims.map(|d| d.baseline.is_some());
        if self.preset.is_none() && given[0] != given[1] {
            for d in dims.iter().filter(|d| d.baseline.is_none()) {
                let ceiling = (d.get)(&q.ceiling);
                (d.set)(&mut q.baseline, ceiling);
            }
        }

        // 4: burst mode.
        let kind = self.burst.unwrap_or(match q.burst {
            BurstMode::None => BurstKind::None,
            BurstMode::Credits(_) => BurstKind::Credits,
            BurstMode::OnDemand => BurstKind::OnDemand,
        });
        match kind {
            BurstKind::None => {
                for d in &dims {
                    if self.preset.is_none() && d.baseline.is_none() {
                        let ceiling = (d.get)(&q.ceiling);
                        (d.set)(&mut q.baseline, ceiling);
                    }
                    let baseline = (d.get)(&q.baseline);
                    // The fixed rate is the baseline: at 0 the volume could never run an I/O
                    // (every request would wait forever), the effect of a ceiling of 0.
                    if baseline == 0 {
                        return Err(invalid(format!(
                            "burst none with baseline_{} 0: the volume would be fixed at 0 {} \
                             and never run an I/O (give baseline_{} > 0, or burst on-demand to \
                             run on spare capacity)",
                            d.unit,
                            d.unit.to_uppercase(),
                            d.unit
                        )));
                    }
                    (d.set)(&mut q.ceiling, baseline);
                }
                q.burst = BurstMode::None;
            }
            BurstKind::OnDemand => q.burst = BurstMode::OnDemand,
            BurstKind::Credits => {
                let mut spec = match q.burst {
                    BurstMode::Credits(spec) => spec,
                    BurstMode::None | BurstMode::OnDemand => built_buckets(&q, &dims)?,
                };
                for d in &dims {
                    let baseline = (d.get)(&q.baseline);
                    if let Some(b) = (d.bucket)(&mut spec) {
                        b.refill_per_s = b.refill_per_s.max(baseline);
                    }
                }
                q.burst = BurstMode::Credits(spec);
            }
        }

        // 5: weight.
        if let Some(w) = self.weight {
            q.weight = w;
        }
        q.validate()?;
        Ok(q)
    }

    /// Applies this spec as a change on top of an existing one (a live `volume qos` change):
    /// each field given here replaces `base`'s, the others are kept. A preset given here
    /// (even the same one) restates the class: it replaces `base`'s preset and clears all of
    /// `base`'s refinements (baselines, ceilings, burst and weight), which were made against
    /// the old class, so the result is exactly this spec.
    pub fn merged_over(&self, base: &QosSpec) -> QosSpec {
        if self.preset.is_some() {
            return self.clone();
        }
        QosSpec {
            preset: base.preset.clone(),
            baseline_iops: self.baseline_iops.or(base.baseline_iops),
            baseline_mbps: self.baseline_mbps.or(base.baseline_mbps),
            ceiling_iops: self.ceiling_iops.or(base.ceiling_iops),
            ceiling_mbps: self.ceiling_mbps.or(base.ceiling_mbps),
            burst: self.burst.or(base.burst),
            weight: self.weight.or(base.weight),
        }
    }

    /// Range checks of the given fields alone, with the field names in the messages.
    fn check_fields(&self) -> Result<(), QosError> {
        let limits = [
            ("baseline_iops", self.baseline_iops, MAX_IOPS, "IOPS"),
            ("ceiling_iops", self.ceiling_iops, MAX_IOPS, "IOPS"),
            ("baseline_mbps", self.baseline_mbps, MAX_MBPS, "MB/s"),
            ("ceiling_mbps", self.ceiling_mbps, MAX_MBPS, "MB/s"),
        ];
        for (field, value, max, unit) in limits {
            if let Some(v) = value
                && v > max
            {
                return Err(invalid(format!(
                    "{field} {v} is above the limit of {max} {unit}"
                )));
            }
        }
        for (field, value) in [
            ("ceiling_iops", self.ceiling_iops),
            ("ceiling_mbps", self.ceiling_mbps),
        ] {
            if value == Some(0) {
                return Err(invalid(format!(
                    "{field} must be > 0 (omit it for no ceiling)"
                )));
            }
        }
        let pairs = [
            ("iops", self.baseline_iops, self.ceiling_iops),
            ("mbps", self.baseline_mbps, self.ceiling_mbps),
        ];
        for (unit, baseline, ceiling) in pairs {
            if let (Some(b), Some(c)) = (baseline, ceiling)
                && c < b
            {
                return Err(invalid(format!(
                    "ceiling_{unit} {c} is below baseline_{unit} {b}"
                )));
            }
        }
        if let Some(w) = self.weight
            && !(1..=MAX_WEIGHT).contains(&w)
        {
            return Err(invalid(format!("weight {w} is outside 1..={MAX_WEIGHT}")));
        }
        Ok(())
    }

    /// The two dimensions, with the given rates converted to `VolumeQos` units (the limits
    /// checked first keep MB/s × 10⁶ far from overflowing).
    fn dims(&self) -> [Dim; 2] {
        let bytes = |mbps: Option<u64>| mbps.map(|v| v.saturating_mul(BYTES_PER_MB));
        [
            Dim {
                unit: "iops",
                baseline: self.baseline_iops,
                ceiling: self.ceiling_iops,
                get: |r| r.iops,
                set: |r, v| r.iops = v,
                bucket: |s| &mut s.iops,
            },
            Dim {
                unit: "mbps",
                baseline: bytes(self.baseline_mbps),
                ceiling: bytes(self.ceiling_mbps),
                get: |r| r.bytes_per_s,
                set: |r, v| r.bytes_per_s = v,
                bucket: |s| &mut s.bytes,
            },
        ]
    }
}

/// Credit buckets for a QoS that had none: one per dimension with a finite ceiling above its
/// baseline, refilled at the baseline, lasting [`CREDIT_BURST_SECONDS`] at the ceiling, full.
fn built_buckets(q: &VolumeQos, dims: &[Dim; 2]) -> Result<CreditSpec, QosError> {
    let mut spec = CreditSpec {
        iops: None,
        bytes: None,
        pool: None,
    };
    for d in dims {
        let (baseline, ceiling) = ((d.get)(&q.baseline), (d.get)(&q.ceiling));
        if ceiling != u64::MAX && ceiling > baseline {
            if baseline == 0 {
                return Err(invalid(format!(
                    "burst credits with baseline_{} 0: the bucket would never refill, so the \
                     volume would stop for good once its credits ran out (give baseline_{} > 0)",
                    d.unit, d.unit
                )));
            }
            *(d.bucket)(&mut spec) = Some(CreditBucketSpec {
                capacity: (ceiling - baseline).saturating_mul(CREDIT_BURST_SECONDS),
                refill_per_s: baseline,
                start_full: true,
            });
        }
    }
    if spec.iops.is_none() && spec.bytes.is_none() {
        let show = |v: u64| {
            if v == u64::MAX {
                "unlimited".to_string()
            } else {
                v.to_string()
            }
        };
        return Err(invalid(format!(
            "burst credits needs a finite ceiling above the baseline in at least one dimension \
             (resolved: IOPS baseline {}, ceiling {}; bytes/s baseline {}, ceiling {}); give \
             ceiling_iops or ceiling_mbps above the baseline",
            show(q.baseline.iops),
            show(q.ceiling.iops),
            show(q.baseline.bytes_per_s),
            show(q.ceiling.bytes_per_s),
        )));
    }
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    const MB: u64 = BYTES_PER_MB;

    fn credits(q: &VolumeQos) -> CreditSpec {
        match q.burst {
            BurstMode::Credits(c) => c,
            other => panic!("expected credits, got {other:?}"),
        }
    }

    fn err_text(spec: &QosSpec, size_bytes: u64) -> String {
        match spec.resolve(size_bytes) {
            Ok(q) => panic!("{spec:?} should be rejected, resolved to {q:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn gp2() -> QosSpec {
        QosSpec {
            preset: Some("gp2".into()),
            ..QosSpec::default()
        }
    }

    #[test]
    fn empty_spec_is_the_unlimited_default() {
        assert!(QosSpec::default().is_empty());
        assert_eq!(
            QosSpec::default().resolve(GIB).unwrap(),
            VolumeQos::default()
        );
        assert!(!gp2().is_empty());
    }

    #[test]
    fn a_preset_alone_resolves_as_the_presets_module_does() {
        let text = "qemu:iops-total=1000,iops-total-max=5000,iops-total-max-length=10";
        let spec: QosSpec = serde_json::from_str(&format!(r#"{{"preset":"{text}"}}"#)).unwrap();
        assert_eq!(
            spec.resolve(10 * GIB).unwrap(),
            presets::volume_qos(text, 10 * GIB).unwrap()
        );
        for p in ["gp2", "gp3", "io2:iops=3000", "azure-credit", "autopl"] {
            let spec = QosSpec {
                preset: Some(p.into()),
                ..QosSpec::default()
            };
            assert_eq!(
                spec.resolve(100 * GIB).unwrap(),
                presets::volume_qos(p, 100 * GIB).unwrap(),
                "{p}"
            );
        }
    }

    #[test]
    fn gp2_with_a_lower_ceiling_keeps_its_baseline_and_bucket() {
        let spec = QosSpec {
            ceiling_iops: Some(2_000),
            ..gp2()
        };
        let q = spec.resolve(100 * GIB).unwrap();
        assert_eq!(q.baseline, IoRate::new(300, 128 * MIB));
        assert_eq!(q.ceiling, IoRate::new(2_000, 128 * MIB));
        let b = credits(&q).iops.unwrap();
        assert_eq!(
            (b.capacity, b.refill_per_s, b.start_full),
            (5_400_000, 300, true)
        );
        assert_eq!((q.weight, q.io_unit_bytes), (3, 256 * 1024));
    }

    #[test]
    fn a_ceiling_below_a_presets_baseline_lowers_the_baseline() {
        let q = QosSpec {
            ceiling_iops: Some(200),
            ..gp2()
        }
        .resolve(100 * GIB)
        .unwrap();
        assert_eq!((q.baseline.iops, q.ceiling.iops), (200, 200));
        // The bucket still refills at 300 >= 200: valid.
        assert_eq!(credits(&q).iops.unwrap().refill_per_s, 300);
    }

    #[test]
    fn a_raised_baseline_raises_an_ungiven_ceiling_and_the_refill() {
        // Within the ceiling: the ceiling stays, the bucket refills at the new baseline.
        let q = QosSpec {
            baseline_iops: Some(1_000),
            ..gp2()
        }
        .resolve(100 * GIB)
        .unwrap();
        assert_eq!((q.baseline.iops, q.ceiling.iops), (1_000, 3_000));
        assert_eq!(credits(&q).iops.unwrap().refill_per_s, 1_000);
        // Above it: the ceiling follows the baseline.
        let q = QosSpec {
            baseline_iops: Some(5_000),
            baseline_mbps: Some(200),
            ..gp2()
        }
        .resolve(100 * GIB)
        .unwrap();
        assert_eq!(q.baseline, IoRate::new(5_000, 200 * MB));
        assert_eq!(q.ceiling, IoRate::new(5_000, 200 * MB));
        assert_eq!(credits(&q).iops.unwrap().refill_per_s, 5_000);
        // Refining a baseline keeps the preset's weight.
        assert_eq!(q.weight, 3);
    }

    #[test]
    fn a_baseline_alone_guarantees_it_and_bursts_on_spare_capacity() {
        let q = QosSpec {
            baseline_iops: Some(1_000),
            ..QosSpec::default()
        }
        .resolve(GIB)
        .unwrap();
        // The bytes dimension is left free (baseline = ceiling = unlimited), not at zero.
        assert_eq!(q.baseline, IoRate::new(1_000, u64::MAX));
        assert_eq!(q.ceiling, IoRate::UNLIMITED);
        assert_eq!(
            (q.burst, q.weight, q.io_unit_bytes),
            (BurstMode::OnDemand, 1, 0)
        );
        // With a ceiling in the other dimension, that ceiling bounds both.
        let q = QosSpec {
            baseline_iops: Some(1_000),
            ceiling_mbps: Some(100),
            ..QosSpec::default()
        }
        .resolve(GIB)
        .unwrap();
        assert_eq!(q.baseline, IoRate::new(1_000, 100 * MB));
        assert_eq!(q.ceiling, IoRate::new(u64::MAX, 100 * MB));
        // Both given: both used, MB/s decimal.
        let q = QosSpec {
            baseline_iops: Some(1_000),
            baseline_mbps: Some(0),
            ..QosSpec::default()
        }
        .resolve(GIB)
        .unwrap();
        assert_eq!(q.baseline, IoRate::new(1_000, 0));
    }

    #[test]
    fn burst_none_with_a_baseline_is_a_fixed_rate_like_qemu() {
        let q = QosSpec {
            baseline_iops: Some(1_000),
            burst: Some(BurstKind::None),
            ..QosSpec::default()
        }
        .resolve(GIB)
        .unwrap();
        let qemu = presets::volume_qos("qemu:iops-total=1000", GIB).unwrap();
        assert_eq!(
            (q.baseline, q.ceiling, q.burst),
            (qemu.baseline, qemu.ceiling, qemu.burst)
        );
        // A given ceiling above the baseline has no effect without burst.
        let q = QosSpec {
            baseline_iops: Some(1_000),
            ceiling_iops: Some(5_000),
            burst: Some(BurstKind::None),
            ..QosSpec::default()
        }
        .resolve(GIB)
        .unwrap();
        assert_eq!(q.ceiling, IoRate::new(1_000, u64::MAX));
        // A ceiling alone is the fixed rate.
        let q = QosSpec {
            ceiling_iops: Some(500),
            burst: Some(BurstKind::None),
            ..QosSpec::default()
        }
        .resolve(GIB)
        .unwrap();
        assert_eq!(q, VolumeQos::fixed(IoRate::new(500, u64::MAX)));
        // gp2 without burst: its baseline, fixed, no bucket.
        let q = QosSpec {
            burst: Some(BurstKind::None),
            ..gp2()
        }
        .resolve(100 * GIB)
        .unwrap();
        assert_eq!(q.burst, BurstMode::None);
        assert_eq!(q.ceiling, IoRate::new(300, 128 * MIB));
        assert_eq!(q.baseline, q.ceiling);
    }

    #[test]
    fn a_fixed_rate_preset_stays_fixed_unless_it_may_burst() {
        let gp3 = |ceiling_iops, burst| QosSpec {
            preset: Some("gp3".into()),
            ceiling_iops,
            burst,
            ..QosSpec::default()
        };
        let q = gp3(Some(6_000), None).resolve(100 * GIB).unwrap();
        assert_eq!((q.burst, q.ceiling.iops), (BurstMode::None, 3_000));
        let q = gp3(Some(6_000), Some(BurstKind::OnDemand))
            .resolve(100 * GIB)
            .unwrap();
        assert_eq!((q.burst, q.ceiling.iops), (BurstMode::OnDemand, 6_000));
        // Credits on a preset without buckets: built by the 30-minute rule.
        let q = gp3(Some(6_000), Some(BurstKind::Credits))
            .resolve(100 * GIB)
            .unwrap();
        let c = credits(&q);
        assert_eq!(
            c.iops,
            Some(CreditBucketSpec {
                capacity: 3_000 * 1_800,
                refill_per_s: 3_000,
                start_full: true
            })
        );
        assert_eq!(c.bytes, None);
    }

    #[test]
    fn gp2_on_demand_drops_the_bucket_and_keeps_the_ceiling() {
        let q = QosSpec {
            burst: Some(BurstKind::OnDemand),
            ..gp2()
        }
        .resolve(100 * GIB)
        .unwrap();
        assert_eq!(q.burst, BurstMode::OnDemand);
        assert_eq!(q.ceiling.iops, 3_000);
    }

    #[test]
    fn credits_without_a_preset_last_thirty_minutes_at_the_ceiling() {
        let q = QosSpec {
            baseline_iops: Some(1_000),
            ceiling_iops: Some(5_000),
            baseline_mbps: Some(50),
            ceiling_mbps: Some(150),
            burst: Some(BurstKind::Credits),
            ..QosSpec::default()
        }
        .resolve(GIB)
        .unwrap();
        let c = credits(&q);
        let i = c.iops.unwrap();
        assert_eq!(
            (i.capacity, i.refill_per_s, i.start_full),
            (7_200_000, 1_000, true)
        );
        assert_eq!(i.capacity / (q.ceiling.iops - i.refill_per_s), 1_800);
        let b = c.bytes.unwrap();
        assert_eq!((b.capacity, b.refill_per_s), (100 * MB * 1_800, 50 * MB));
        assert_eq!(c.pool, None);
        // One limited dimension is enough: the free one gets no bucket.
        let q = QosSpec {
            baseline_iops: Some(1_000),
            ceiling_iops: Some(5_000),
            burst: Some(BurstKind::Credits),
            ..QosSpec::default()
        }
        .resolve(GIB)
        .unwrap();
        assert_eq!(credits(&q).bytes, None);
        assert_eq!(q.baseline.bytes_per_s, u64::MAX);
    }

    #[test]
    fn credits_need_a_finite_ceiling_above_the_baseline() {
        for spec in [
            QosSpec {
                baseline_iops: Some(1_000),
                burst: Some(BurstKind::Credits),
                ..QosSpec::default()
            },
            QosSpec {
                baseline_iops: Some(1_000),
                ceiling_iops: Some(1_000),
                burst: Some(BurstKind::Credits),
                ..QosSpec::default()
            },
            QosSpec {
                preset: Some("gp3".into()),
                burst: Some(BurstKind::Credits),
                ..QosSpec::default()
            },
        ] {
            let e = err_text(&spec, 100 * GIB);
            assert!(e.contains("burst credits needs a finite ceiling"), "{e}");
            assert!(e.contains("ceiling_iops"), "{e}");
        }
        let e = err_text(
            &QosSpec {
                baseline_iops: Some(1_000),
                burst: Some(BurstKind::Credits),
                ..QosSpec::default()
            },
            GIB,
        );
        assert!(e.contains("IOPS baseline 1000, ceiling unlimited"), "{e}");
        // A bucket refilled at a zero baseline would strand the volume once it ran dry.
        let e = err_text(
            &QosSpec {
                ceiling_iops: Some(1_000),
                burst: Some(BurstKind::Credits),
                ..QosSpec::default()
            },
            GIB,
        );
        assert!(e.contains("baseline_iops 0"), "{e}");
    }

    /// Found by the `api_bodies` fuzz target (`fuzz/corpus/api_bodies/regression-burst-none-zero-baseline`):
    /// `{"baseline_iops":0,"burst":"none"}` resolved to a fixed 0 IOPS (baseline = ceiling = 0),
    /// a volume whose every request waits forever, which a given `ceiling_iops: 0` is refused for.
    #[test]
    fn burst_none_over_a_zero_baseline_is_refused() {
        let e = err_text(
            &QosSpec {
                baseline_iops: Some(0),
                burst: Some(BurstKind::None),
                weight: Some(10_000),
                ..QosSpec::default()
            },
            1,
        );
        assert!(e.contains("burst none with baseline_iops 0"), "{e}");
        let e = err_text(
            &QosSpec {
                baseline_iops: Some(100),
                baseline_mbps: Some(0),
                burst: Some(BurstKind::None),
                ..QosSpec::default()
            },
            GIB,
        );
        assert!(e.contains("burst none with baseline_mbps 0"), "{e}");
        // A zero baseline is still fine where the volume may run above it.
        let q = QosSpec {
            baseline_iops: Some(0),
            burst: Some(BurstKind::OnDemand),
            ..QosSpec::default()
        }
        .resolve(GIB)
        .unwrap();
        assert_eq!(q.baseline.iops, 0);
        assert!(q.ceiling.iops > 0);
    }

    #[test]
    fn weight_replaces_the_presets() {
        let q = QosSpec {
            weight: Some(77),
            ..gp2()
        }
        .resolve(100 * GIB)
        .unwrap();
        assert_eq!(q.weight, 77);
        for (w, ok) in [(0, false), (1, true), (10_000, true), (10_001, false)] {
            let spec = QosSpec {
                weight: Some(w),
                ..QosSpec::default()
            };
            assert_eq!(spec.resolve(GIB).is_ok(), ok, "weight {w}");
        }
        let e = err_text(
            &QosSpec {
                weight: Some(0),
                ..QosSpec::default()
            },
            GIB,
        );
        assert!(e.contains("weight 0"), "{e}");
    }

    #[test]
    fn bad_fields_are_rejected_by_name() {
        let cases = [
            (
                QosSpec {
                    ceiling_iops: Some(0),
                    ..QosSpec::default()
                },
                "ceiling_iops must be > 0 (omit it for no ceiling)",
            ),
            (
                QosSpec {
                    ceiling_mbps: Some(0),
                    ..gp2()
                },
                "ceiling_mbps must be > 0",
            ),
            (
                QosSpec {
                    baseline_iops: Some(500),
                    ceiling_iops: Some(400),
                    ..QosSpec::default()
                },
                "ceiling_iops 400 is below baseline_iops 500",
            ),
            (
                QosSpec {
                    baseline_mbps: Some(500),
                    ceiling_mbps: Some(400),
                    ..gp2()
                },
                "ceiling_mbps 400 is below baseline_mbps 500",
            ),
            (
                QosSpec {
                    ceiling_iops: Some(MAX_IOPS + 1),
                    ..QosSpec::default()
                },
                "ceiling_iops 100000001 is above the limit of 100000000 IOPS",
            ),
            (
                QosSpec {
                    baseline_mbps: Some(MAX_MBPS + 1),
                    ..QosSpec::default()
                },
                "baseline_mbps 1000001 is above the limit of 1000000 MB/s",
            ),
        ];
        for (spec, msg) in cases {
            let e = spec.resolve(100 * GIB);
            assert!(
                matches!(&e, Err(QosError::InvalidQos(m)) if m.contains(msg)),
                "{spec:?}: {e:?}"
            );
        }
        // At the limits, and a zero baseline: accepted.
        let ok = QosSpec {
            baseline_iops: Some(0),
            ceiling_iops: Some(MAX_IOPS),
            ceiling_mbps: Some(MAX_MBPS),
            ..QosSpec::default()
        }
        .resolve(GIB)
        .unwrap();
        assert_eq!(ok.ceiling, IoRate::new(MAX_IOPS, MAX_MBPS * MB));
        assert_eq!(ok.baseline.iops, 0);
    }

    #[test]
    fn size_zero_and_bad_presets_are_rejected() {
        let e = err_text(&QosSpec::default(), 0);
        assert!(e.contains("size"), "{e}");
        assert!(gp2().resolve(0).is_err());
        let unknown = QosSpec {
            preset: Some("gp9".into()),
            ..QosSpec::default()
        };
        assert_eq!(
            unknown.resolve(GIB),
            Err(presets::Preset::parse("gp9").unwrap_err())
        );
        assert!(matches!(
            unknown.resolve(GIB),
            Err(QosError::InvalidPreset { .. })
        ));
        // A size the preset does not sell: the preset's error too.
        assert!(matches!(
            QosSpec {
                preset: Some("azure-credit".into()),
                ..QosSpec::default()
            }
            .resolve(1_024 * GIB),
            Err(QosError::InvalidPreset { .. })
        ));
    }

    #[test]
    fn serde_round_trips_and_rejects_unknown_fields() {
        let spec = QosSpec {
            preset: Some("gp2".into()),
            baseline_iops: Some(1),
            baseline_mbps: Some(2),
            ceiling_iops: Some(3),
            ceiling_mbps: Some(4),
            burst: Some(BurstKind::OnDemand),
            weight: Some(5),
        };
        let json = serde_json::to_string(&spec).unwrap();
        assert!(json.contains(r#""burst":"on-demand""#), "{json}");
        assert_eq!(serde_json::from_str::<QosSpec>(&json).unwrap(), spec);
        // Absent fields are not written, and an empty object is the empty spec.
        assert_eq!(serde_json::to_string(&QosSpec::default()).unwrap(), "{}");
        assert_eq!(
            serde_json::from_str::<QosSpec>("{}").unwrap(),
            QosSpec::default()
        );
        let partial: QosSpec =
            serde_json::from_str(r#"{"ceiling_iops":2000,"burst":"credits"}"#).unwrap();
        assert_eq!(
            (partial.ceiling_iops, partial.burst, partial.preset),
            (Some(2_000), Some(BurstKind::Credits), None)
        );
        assert!(serde_json::from_str::<QosSpec>(r#"{"ceiling_iopz":2000}"#).is_err());
        assert!(serde_json::from_str::<QosSpec>(r#"{"burst":"sometimes"}"#).is_err());
        assert!(serde_json::from_str::<QosSpec>(r#"{"burst":"on_demand"}"#).is_err());
    }

    #[test]
    fn burst_kind_parses_the_cli_spellings() {
        for (text, kind) in [
            ("none", BurstKind::None),
            ("credits", BurstKind::Credits),
            ("on-demand", BurstKind::OnDemand),
            ("ondemand", BurstKind::OnDemand),
            ("On_Demand", BurstKind::OnDemand),
        ] {
            assert_eq!(text.parse::<BurstKind>(), Ok(kind), "{text}");
        }
        for kind in [BurstKind::None, BurstKind::Credits, BurstKind::OnDemand] {
            assert_eq!(kind.to_string().parse::<BurstKind>(), Ok(kind));
        }
        let e = "sometimes".parse::<BurstKind>().unwrap_err().to_string();
        assert!(e.contains("none, credits or on-demand"), "{e}");
    }

    #[test]
    fn a_change_replaces_given_fields_and_a_new_preset_starts_over() {
        let base = QosSpec {
            ceiling_iops: Some(2_000),
            weight: Some(9),
            burst: Some(BurstKind::Credits),
            ..gp2()
        };
        let change = QosSpec {
            ceiling_iops: Some(2_500),
            baseline_mbps: Some(100),
            ..QosSpec::default()
        };
        assert_eq!(
            change.merged_over(&base),
            QosSpec {
                ceiling_iops: Some(2_500),
                baseline_mbps: Some(100),
                ..base.clone()
            }
        );
        // An empty change changes nothing.
        assert_eq!(QosSpec::default().merged_over(&base), base);
        // A new preset drops every refinement of the old class.
        let gp3 = QosSpec {
            preset: Some("gp3".into()),
            weight: Some(2),
            ..QosSpec::default()
        };
        assert_eq!(gp3.merged_over(&base), gp3);
        // Onto nothing, a change is itself.
        assert_eq!(change.merged_over(&QosSpec::default()), change);
    }
}
