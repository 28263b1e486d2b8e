//! The six policies. Five share the ring engine (`crate::engine`); mClock orders by tags.

mod base;
pub(crate) mod burst;
pub(crate) mod credit;
mod credit_pool;
mod drr;
mod mclock;
mod wild;

use crate::engine::{Ctx, Engine, Place};
use crate::limiter::{Charge, RateLimiter, VolumeCredits};
use crate::policy::{Policy, PolicyKind, PolicyParams};
use crate::vocab::{NodeCapacity, Phase, VolumeQos};

/// A volume's credit buckets, boxed only once the volume is (or was) in credit mode: most
/// volumes have none, and an empty [`VolumeCredits`] would still take 144 bytes (three cache
/// lines) of the volume's hot state. Behaves exactly like the [`VolumeCredits`] it wraps.
#[derive(Debug, Default)]
pub(crate) struct SparseCredits(Option<Box<VolumeCredits>>);

impl SparseCredits {
    pub(crate) fn new(now_ns: u64, qos: &VolumeQos) -> Self {
        let c = VolumeCredits::new(now_ns, qos);
        SparseCredits(c.is_active().then(|| Box::new(c)))
    }

    pub(crate) fn reconfigure(&mut self, now_ns: u64, qos: &VolumeQos) {
        match &mut self.0 {
            Some(c) => c.reconfigure(now_ns, qos),
            None => {
                // `VolumeCredits::reconfigure` on an empty set: new buckets start empty.
                let mut c = VolumeCredits::default();
                c.reconfigure(now_ns, qos);
                if c.is_active() {
                    self.0 = Some(Box::new(c));
                }
            }
        }
    }

    pub(crate) fn is_active(&self) -> bool {
        self.0.as_ref().is_some_and(|c| c.is_active())
    }

    pub(crate) fn ready_at(&self, now_ns: u64, charge: Charge) -> u64 {
        self.0
            .as_ref()
            .map_or(now_ns, |c| c.ready_at(now_ns, charge))
    }

    pub(crate) fn take(&mut self, now_ns: u64, charge: Charge) {
        if let Some(c) = &mut self.0 {
            c.take(now_ns, charge);
        }
    }

    pub(crate) fn restore(&mut self, now_ns: u64, iops: Option<u64>, bytes: Option<u64>) -> bool {
        self.0
            .as_mut()
            .is_some_and(|c| c.restore(now_ns, iops, bytes))
    }

    pub(crate) fn balances_at(&self, now_ns: u64) -> (Option<u64>, Option<u64>) {
        self.0
            .as_ref()
            .map_or((None, None), |c| c.balances_at(now_ns))
    }

    pub(crate) fn within_range(&self) -> bool {
        self.0.as_ref().is_none_or(|c| c.within_range())
    }
}

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
pub(crate) fn credit_phase(ctx: &Ctx<'_>, meter: &RateLimiter, credits: &SparseCredits) -> Phase {
    let Ctx {
        now_ns,
        core,
        charge,
        ..
    } = *ctx;
    if core.burst_none || meter.ready_at(now_ns, charge) <= now_ns {
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
    let track = params.track_invariants;
    let pacer_depth_ns = params.pacer_depth_ns;
    let lookahead = params.reorder_lookahead;
    match kind {
        PolicyKind::Wild => Box::new(
            Engine::new(wild::WildRules { depth_ns }, capacity, w, depth_ns, track)
                .with_pacer_depth(capacity, pacer_depth_ns)
                .with_reorder_lookahead(lookahead),
        ),
        PolicyKind::Base => Box::new(
            Engine::new(base::BaseRules { depth_ns }, capacity, w, depth_ns, track)
                .with_pacer_depth(capacity, pacer_depth_ns)
                .with_reorder_lookahead(lookahead),
        ),
        PolicyKind::Credit => Box::new(
            Engine::new(
                credit::CreditRules::new(depth_ns),
                capacity,
                w,
                depth_ns,
                track,
            )
            .with_pacer_depth(capacity, pacer_depth_ns)
            .with_reorder_lookahead(lookahead),
        ),
        PolicyKind::Burst => Box::new(
            Engine::new(
                burst::BurstRules::new(capacity, params),
                capacity,
                w,
                depth_ns,
                track,
            )
            .with_pacer_depth(capacity, pacer_depth_ns)
            .with_reorder_lookahead(lookahead),
        ),
        PolicyKind::MClock => Box::new(
            mclock::MClock::new(capacity, w, depth_ns, track)
                .with_pacer_depth(capacity, pacer_depth_ns),
        ),
        PolicyKind::DrrVop => Box::new(
            Engine::new(drr::DrrRules::new(params), capacity, w, depth_ns, track)
                .with_pacer_depth(capacity, pacer_depth_ns)
                .with_reorder_lookahead(lookahead),
        ),
    }
}
