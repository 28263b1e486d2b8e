//! Wild (BurstCBS's WildCBS): weighted round robin with per-volume ceilings, work-conserving.
//!
//! The production scheduler BurstCBS started from: each ready volume gets `weight` requests per
//! turn, bounded only by its own ceiling and the node pacer. It fills the node, but a volume
//! with an always-full queue delays every request of its neighbours (no isolation): it is the
//! baseline the other policies are measured against.

use super::single_class_place;
use crate::cost::CostVector;
use crate::engine::{Ctx, Place, Rules, Verdict};
use crate::limiter::{Charge, RateLimiter};
use crate::sched::VolCore;
use crate::vocab::{IoRate, Phase, VolumeQos};

#[derive(Debug)]
pub(crate) struct WildRules {
    pub(crate) depth_ns: u64,
}

#[derive(Debug)]
pub(crate) struct WildVol {
    ceiling: RateLimiter,
    meter: RateLimiter,
    turn_left: u32,
}

impl Rules for WildRules {
    type Vol = WildVol;

    fn name(&self) -> &'static str {
        "wild"
    }

    fn classes(&self) -> usize {
        1
    }

    fn new_vol(&mut self, now_ns: u64, _idx: u32, qos: &VolumeQos) -> WildVol {
        WildVol {
            ceiling: RateLimiter::new(now_ns, qos.ceiling, self.depth_ns),
            meter: RateLimiter::new(now_ns, qos.baseline, self.depth_ns),
            turn_left: qos.weight.max(1),
        }
    }

    fn reconfigure(&mut self, now_ns: u64, _idx: u32, qos: &VolumeQos, vol: &mut WildVol) {
        vol.ceiling.reconfigure(now_ns, qos.ceiling);
        vol.meter.reconfigure(now_ns, qos.baseline);
        vol.turn_left = vol.turn_left.min(qos.weight.max(1));
    }

    fn enforced_ceiling(&self, qos: &VolumeQos) -> IoRate {
        qos.ceiling
    }

    fn classify(
        &mut self,
        now_ns: u64,
        _idx: u32,
        _core: &VolCore,
        vol: &mut WildVol,
        charge: Charge,
        _cost: &CostVector,
    ) -> Place {
        single_class_place(&vol.ceiling, now_ns, charge)
    }

    fn verdict(&mut self, ctx: &Ctx<'_>, vol: &mut WildVol) -> Verdict {
        let Ctx {
            now_ns,
            core,
            charge,
            ..
        } = *ctx;
        let phase = if vol.meter.ready_at(now_ns, charge) <= now_ns {
            Phase::Baseline
        } else {
            Phase::BurstSpare
        };
        vol.turn_left = vol.turn_left.saturating_sub(1);
        let front = vol.turn_left > 0;
        if !front {
            vol.turn_left = core.weight.max(1);
        }
        Verdict::Run { phase, front }
    }

    fn charge(&mut self, ctx: &Ctx<'_>, phase: Phase, vol: &mut WildVol) {
        let Ctx { now_ns, charge, .. } = *ctx;
        vol.ceiling.take(now_ns, charge);
        if phase == Phase::Baseline {
            vol.meter.take(now_ns, charge);
        }
    }

    fn baseline_guarantee(&self) -> Option<u64> {
        None
    }

    fn must_run(
        &self,
        now_ns: u64,
        _core: &VolCore,
        vol: &WildVol,
        charge: Charge,
        _cost: &CostVector,
    ) -> Option<bool> {
        Some(vol.ceiling.ready_at(now_ns, charge) <= now_ns)
    }
}
