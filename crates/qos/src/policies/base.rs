//! Base (BurstCBS's BaseCBS, Gimbal-like): every volume is capped at its baseline.
//!
//! Strong isolation and no burst at all: capacity a volume does not use is lost. Ready volumes
//! are served round robin.

use super::single_class_place;
use crate::cost::CostVector;
use crate::engine::{Ctx, Place, Rules, Verdict};
use crate::limiter::{Charge, RateLimiter};
use crate::sched::VolCore;
use crate::vocab::{IoRate, Phase, VolumeQos};

#[derive(Debug)]
pub(crate) struct BaseRules {
    pub(crate) depth_ns: u64,
}

#[derive(Debug)]
pub(crate) struct BaseVol {
    limit: RateLimiter,
}

fn cap(qos: &VolumeQos) -> IoRate {
    qos.baseline.min(qos.ceiling)
}

impl Rules for BaseRules {
    type Vol = BaseVol;

    fn name(&self) -> &'static str {
        "base"
    }

    fn classes(&self) -> usize {
        1
    }

    fn new_vol(&mut self, now_ns: u64, _idx: u32, qos: &VolumeQos) -> BaseVol {
        BaseVol {
            limit: RateLimiter::new(now_ns, cap(qos), self.depth_ns),
        }
    }

    fn reconfigure(&mut self, now_ns: u64, _idx: u32, qos: &VolumeQos, vol: &mut BaseVol) {
        vol.limit.reconfigure(now_ns, cap(qos));
    }

    fn enforced_ceiling(&self, qos: &VolumeQos) -> IoRate {
        cap(qos)
    }

    fn classify(
        &mut self,
        now_ns: u64,
        _idx: u32,
        _core: &VolCore,
        vol: &mut BaseVol,
        charge: Charge,
        _cost: &CostVector,
    ) -> Place {
        single_class_place(&vol.limit, now_ns, charge)
    }

    fn verdict(&mut self, ctx: &Ctx<'_>, _vol: &mut BaseVol) -> Verdict {
        let Ctx { .. } = *ctx;
        Verdict::Run {
            phase: Phase::Baseline,
            front: false,
        }
    }

    fn charge(&mut self, ctx: &Ctx<'_>, _phase: Phase, vol: &mut BaseVol) {
        let Ctx { now_ns, charge, .. } = *ctx;
        vol.limit.take(now_ns, charge);
    }

    fn baseline_guarantee(&self) -> Option<u64> {
        Some(0)
    }
}
