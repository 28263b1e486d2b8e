//! Credit: token-bucket bursting with the semantics operators already know (gp2, Azure credit
//! bursting, QEMU `*-max`).
//!
//! Every request spends credits from the volume's bucket(s); the bucket refills at
//! `refill_per_s` (the baseline, in every preset) up to its capacity; a request may run when the
//! bucket holds its cost and the ceiling allows it. A full bucket drained at demand `d` therefore
//! lasts `capacity / (d − refill)`, and an empty one still delivers the refill rate, i.e. the
//! baseline. A baseline meter labels each request `baseline` or `burst_credit` and gives
//! baseline requests priority over burst requests when the node is saturated, which is what
//! keeps every volume's baseline guaranteed.

use super::{SparseCredits, credit_phase, promote_within_baseline};
use crate::cost::CostVector;
use crate::engine::{Ctx, Entry, Place, Rules, Verdict};
use crate::limiter::{Charge, RateLimiter};
use crate::sched::{Slab, VolCore};
use crate::vocab::{IoRate, Phase, VolumeQos};

#[derive(Debug)]
pub(crate) struct CreditRules {
    pub(crate) depth_ns: u64,
}

#[derive(Debug)]
pub(crate) struct CreditVol {
    ceiling: RateLimiter,
    meter: RateLimiter,
    credits: SparseCredits,
}

const BASELINE: usize = 0;
const BURST: usize = 1;

impl Rules for CreditRules {
    type Vol = CreditVol;

    fn name(&self) -> &'static str {
        "credit"
    }

    fn classes(&self) -> usize {
        2
    }

    fn new_vol(&mut self, now_ns: u64, _idx: u32, qos: &VolumeQos) -> CreditVol {
        CreditVol {
            ceiling: RateLimiter::new(now_ns, qos.burst_ceiling(), self.depth_ns),
            meter: RateLimiter::new(now_ns, qos.baseline, self.depth_ns),
            credits: SparseCredits::new(now_ns, qos),
        }
    }

    fn reconfigure(&mut self, now_ns: u64, _idx: u32, qos: &VolumeQos, vol: &mut CreditVol) {
        vol.ceiling.reconfigure(now_ns, qos.burst_ceiling());
        vol.meter.reconfigure(now_ns, qos.baseline);
        vol.credits.reconfigure(now_ns, qos);
    }

    fn enforced_ceiling(&self, qos: &VolumeQos) -> IoRate {
        qos.burst_ceiling()
    }

    fn classify(
        &mut self,
        now_ns: u64,
        _idx: u32,
        core: &VolCore,
        vol: &mut CreditVol,
        charge: Charge,
        _cost: &CostVector,
    ) -> Place {
        let t_ok = vol
            .ceiling
            .ready_at(now_ns, charge)
            .max(vol.credits.ready_at(now_ns, charge));
        if t_ok > now_ns {
            return Place::At(t_ok);
        }
        let t_meter = vol.meter.ready_at(now_ns, charge);
        if t_meter <= now_ns || core.burst_none {
            Place::Ring {
                class: BASELINE,
                front: false,
                reclassify_at: None,
            }
        } else {
            Place::Ring {
                class: BURST,
                front: false,
                reclassify_at: Some(t_meter),
            }
        }
    }

    fn is_baseline_class(&self, class: usize) -> bool {
        class == BASELINE
    }

    fn effective_class(&self, now_ns: u64, class: usize, vol: &CreditVol, charge: Charge) -> usize {
        promote_within_baseline(class, BASELINE, &vol.meter, now_ns, charge)
    }

    fn verdict(&mut self, ctx: &Ctx<'_>, vol: &mut CreditVol) -> Verdict {
        Verdict::Run {
            phase: credit_phase(ctx, &vol.meter, &vol.credits),
            front: false,
        }
    }

    fn charge(&mut self, ctx: &Ctx<'_>, phase: Phase, vol: &mut CreditVol) {
        let Ctx { now_ns, charge, .. } = *ctx;
        vol.ceiling.take(now_ns, charge);
        vol.credits.take(now_ns, charge);
        if phase == Phase::Baseline {
            vol.meter.take(now_ns, charge);
        }
    }

    fn credits(&self, now_ns: u64, vol: &CreditVol) -> (Option<u64>, Option<u64>) {
        vol.credits.balances_at(now_ns)
    }

    fn check(&self, vols: &Slab<Entry<CreditVol>>) -> Result<(), String> {
        for (_, e) in vols.iter() {
            if !e.x.credits.within_range() {
                return Err(format!(
                    "volume {}: credit balance outside [0, bucket]",
                    e.core.id
                ));
            }
        }
        Ok(())
    }

    fn baseline_guarantee(&self) -> Option<u64> {
        Some(0)
    }
}
