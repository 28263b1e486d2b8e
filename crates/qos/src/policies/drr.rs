//! DRR-VOP (Libra): deficit round robin charged in virtual IOPs.
//!
//! Libra makes fairness meaningful across request sizes by charging each request its device
//! cost (VOPs from the cost model's VOP curve: a 256 KiB read is not "one I/O") and serving
//! volumes with deficit round robin. Each volume earns `drr_quantum_device_units × weight` per
//! round; unused capacity flows to whoever is ready (work-conserving), bounded by each volume's
//! burst ceiling.
//!
//! A round always lets a volume run at least one request: the quantum per unit of weight is
//! raised to the largest request cost seen on the node, like Gimbal's virtual slots hold at
//! least one request; this keeps `next` O(1) amortised instead of spinning through empty
//! rounds. The raise is node-wide, never per volume: raising each volume's quantum to its own
//! largest request would hand a volume of large requests a larger quantum and turn the
//! fairness in device units into fairness in IOPS (found by the simulator, Libra's scenario).

use super::single_class_place;
use crate::cost::CostVector;
use crate::engine::{Ctx, Place, Rules, Verdict};
use crate::limiter::{Charge, RateLimiter};
use crate::policy::PolicyParams;
use crate::sched::VolCore;
use crate::vocab::{IoRate, Phase, VolumeQos};

#[derive(Debug)]
pub(crate) struct DrrRules {
    quantum_device_units: u64,
    depth_ns: u64,
    /// Largest DRR charge of any request classified so far (monotone).
    max_cost: u64,
}

impl DrrRules {
    pub(crate) fn new(params: &PolicyParams) -> Self {
        DrrRules {
            quantum_device_units: params.drr_quantum_device_units.max(1),
            depth_ns: params.limiter_depth_ns,
            max_cost: 1,
        }
    }

    /// A volume's quantum per turn: the configured quantum, raised node-wide to the largest
    /// request cost seen, times its weight (so every turn runs at least one request).
    fn quantum(&self, weight: u32) -> u64 {
        self.quantum_device_units
            .max(self.max_cost)
            .saturating_mul(u64::from(weight.max(1)))
    }
}

#[derive(Debug)]
pub(crate) struct DrrVol {
    ceiling: RateLimiter,
    meter: RateLimiter,
    /// Device units this volume may still spend in its current turn.
    deficit: u64,
    /// The next visit starts a new turn (adds a quantum).
    fresh_turn: bool,
}

/// The DRR charge of a request: its device units (at least one, so zero-cost requests still rotate).
fn vop(cost: &CostVector) -> u64 {
    cost.device_units.max(1)
}

impl Rules for DrrRules {
    type Vol = DrrVol;

    fn name(&self) -> &'static str {
        "drr-vop"
    }

    fn classes(&self) -> usize {
        1
    }

    fn new_vol(&mut self, now_ns: u64, _idx: u32, qos: &VolumeQos) -> DrrVol {
        DrrVol {
            ceiling: RateLimiter::new(now_ns, qos.burst_ceiling(), self.depth_ns),
            meter: RateLimiter::new(now_ns, qos.baseline, self.depth_ns),
            deficit: 0,
            fresh_turn: true,
        }
    }

    fn reconfigure(&mut self, now_ns: u64, _idx: u32, qos: &VolumeQos, vol: &mut DrrVol) {
        vol.ceiling.reconfigure(now_ns, qos.burst_ceiling());
        vol.meter.reconfigure(now_ns, qos.baseline);
    }

    fn enforced_ceiling(&self, qos: &VolumeQos) -> IoRate {
        qos.burst_ceiling()
    }

    fn became_backlogged(&mut self, _now_ns: u64, _idx: u32, vol: &mut DrrVol) {
        // DRR: a queue that went empty starts its next turn with no saved deficit.
        vol.deficit = 0;
        vol.fresh_turn = true;
    }

    fn classify(
        &mut self,
        now_ns: u64,
        _idx: u32,
        _core: &VolCore,
        vol: &mut DrrVol,
        charge: Charge,
        cost: &CostVector,
    ) -> Place {
        self.max_cost = self.max_cost.max(vop(cost));
        single_class_place(&vol.ceiling, now_ns, charge)
    }

    fn verdict(&mut self, ctx: &Ctx<'_>, vol: &mut DrrVol) -> Verdict {
        let Ctx {
            now_ns,
            core,
            charge,
            req,
            ..
        } = *ctx;
        let c = vop(&req.cost);
        self.max_cost = self.max_cost.max(c);
        if vol.fresh_turn {
            vol.deficit = vol.deficit.saturating_add(self.quantum(core.weight));
            vol.fresh_turn = false;
        }
        if vol.deficit < c {
            vol.fresh_turn = true;
            return Verdict::Rotate;
        }
        let phase = if core.burst_none || vol.meter.ready_at(now_ns, charge) <= now_ns {
            Phase::Baseline
        } else {
            Phase::BurstSpare
        };
        Verdict::Run { phase, front: true }
    }

    fn charge(&mut self, ctx: &Ctx<'_>, phase: Phase, vol: &mut DrrVol) {
        let Ctx {
            now_ns,
            core,
            charge,
            req,
            ..
        } = *ctx;
        vol.ceiling.take(now_ns, charge);
        if phase == Phase::Baseline {
            vol.meter.take(now_ns, charge);
        }
        vol.deficit = vol.deficit.saturating_sub(vop(&req.cost));
        if core.queue.is_empty() {
            vol.deficit = 0;
            vol.fresh_turn = true;
        }
    }

    fn baseline_guarantee(&self) -> Option<u64> {
        None
    }

    fn must_run(
        &self,
        now_ns: u64,
        _core: &VolCore,
        vol: &DrrVol,
        charge: Charge,
        _cost: &CostVector,
    ) -> Option<bool> {
        Some(vol.ceiling.ready_at(now_ns, charge) <= now_ns)
    }
}
