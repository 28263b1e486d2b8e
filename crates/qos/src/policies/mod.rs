//! The six policies. Five share the ring engine (`crate::engine`); mClock orders by tags.

mod base;
pub(crate) mod burst;
pub(crate) mod credit;
mod drr;
mod mclock;
mod wild;

use crate::engine::{Ctx, Engine, Place};
use crate::limiter::{Charge, RateLimiter, VolumeCredits};
use crate::policy::{Policy, PolicyKind, PolicyParams};
use crate::vocab::{BurstMode, NodeCapacity, Phase};

/// Where a request of a single-class policy (Wild, Base, DRR-VOP) goes: wait until `limit`
/// admits it, else into the one ring.
pub(crate) fn single_class_place(limit: &RateLimiter, now_ns: u64, charge: Charge) -> Place {
    let t = limit.ready_at(now_ns, charge);
    if t > now_ns {
        Place::At(t)
    } else {
        Place::Ring {
            class: 0,
            front: false,
            reclassify_at: None,
        }
    }
}

/// A queued burst-class request moves to the baseline class as soon as the volume's baseline
/// meter admits it (Credit and Burst).
pub(crate) fn promote_within_baseline(
    class: usize,
    baseline_class: usize,
    meter: &RateLimiter,
    now_ns: u64,
    charge: Charge,
) -> usize {
    if class != baseline_class && meter.ready_at(now_ns, charge) <= now_ns {
        baseline_class
    } else {
        class
    }
}

/// The phase a credit-bursting volume's next request runs in (shared by Credit and Burst):
/// within its baseline meter it is `Baseline`; above it, `BurstCredit` while its credit
/// bucket is active, else `BurstSpare` (spare node capacity only).
pub(crate) fn credit_phase(ctx: &Ctx<'_>, meter: &RateLimiter, credits: &VolumeCredits) -> Phase {
    let Ctx {
        now_ns,
        core,
        charge,
        ..
    } = *ctx;
    if core.qos.burst == BurstMode::None || meter.ready_at(now_ns, charge) <= now_ns {
        Phase::Baseline
    } else if credits.is_active() {
        Phase::BurstCredit
    } else {
        Phase::BurstSpare
    }
}

pub(crate) fn build(
    kind: PolicyKind,
    capacity: NodeCapacity,
    params: &PolicyParams,
) -> Box<dyn Policy> {
    let (w, depth_ns) = (params.window_ns, params.limiter_depth_ns);
    match kind {
        PolicyKind::Wild => Box::new(Engine::new(
            wild::WildRules { depth_ns },
            capacity,
            w,
            depth_ns,
        )),
        PolicyKind::Base => Box::new(Engine::new(
            base::BaseRules { depth_ns },
            capacity,
            w,
            depth_ns,
        )),
        PolicyKind::Credit => Box::new(Engine::new(
            credit::CreditRules { depth_ns },
            capacity,
            w,
            depth_ns,
        )),
        PolicyKind::Burst => Box::new(Engine::new(
            burst::BurstRules::new(capacity, params),
            capacity,
            w,
            depth_ns,
        )),
        PolicyKind::MClock => Box::new(mclock::MClock::new(capacity, w, depth_ns)),
        PolicyKind::DrrVop => Box::new(Engine::new(
            drr::DrrRules::new(params),
            capacity,
            w,
            depth_ns,
        )),
    }
}
