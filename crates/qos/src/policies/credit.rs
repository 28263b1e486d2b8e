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
//!
//! Volumes whose credit specs name a pool share their buckets per account instead
//! (`super::credit_pool`): every request still pays the pool, but a request within the volume's
//! baseline meter runs whatever the pool holds, so that no member can starve another below its
//! baseline; only burst requests wait for a positive pool balance.

use super::credit_pool::{CreditPools, Membership};
use super::{SparseCredits, credit_phase, promote_within_baseline};
use crate::cost::CostVector;
use crate::engine::{Ctx, Entry, Place, Rules, Verdict};
use crate::limiter::{Charge, RateLimiter, depth_units};
use crate::sched::{Slab, VolCore};
use crate::vocab::{BurstMode, CreditSpec, IoRate, Phase, VolumeQos};

#[derive(Debug)]
pub(crate) struct CreditRules {
    depth_ns: u64,
    pools: CreditPools,
}

impl CreditRules {
    pub(crate) fn new(depth_ns: u64) -> Self {
        CreditRules {
            depth_ns,
            pools: CreditPools::default(),
        }
    }

    /// Depth of a volume's baseline meter per dimension (as `RateLimiter::new` builds it).
    fn meter_depths(&self, qos: &VolumeQos) -> [u64; 2] {
        [
            depth_units(qos.baseline.iops, self.depth_ns),
            depth_units(qos.baseline.bytes_per_s, self.depth_ns),
        ]
    }
}

/// The pool a QoS puts its volume in, with its credit spec.
fn pooled(qos: &VolumeQos) -> Option<(u32, &CreditSpec)> {
    match &qos.burst {
        BurstMode::Credits(spec) => spec.pool.map(|id| (id, spec)),
        BurstMode::None | BurstMode::OnDemand => None,
    }
}

#[derive(Debug)]
pub(crate) struct CreditVol {
    ceiling: RateLimiter,
    meter: RateLimiter,
    /// The volume's own buckets (none while it is in a pool).
    credits: SparseCredits,
    /// Its pool membership, if any (boxed: most volumes have none).
    pool: Option<Box<Membership>>,
    /// When it last ran a request above its baseline (bursting while that is recent).
    last_burst_ns: Option<u64>,
}

const BASELINE: usize = 0;
const BURST: usize = 1;

/// How often a pooled volume waiting on a pool without refill looks again, ns.
const ZERO_REFILL_POLL_NS: u64 = crate::vocab::NS_PER_S;

impl Rules for CreditRules {
    type Vol = CreditVol;

    fn name(&self) -> &'static str {
        "credit"
    }

    fn classes(&self) -> usize {
        2
    }

    fn new_vol(&mut self, now_ns: u64, _idx: u32, qos: &VolumeQos) -> CreditVol {
        let (credits, pool) = match pooled(qos) {
            Some((id, spec)) => {
                let depths = self.meter_depths(qos);
                let m = self.pools.join(now_ns, id, spec, depths, true);
                (SparseCredits::default(), Some(Box::new(m)))
            }
            None => (SparseCredits::new(now_ns, qos), None),
        };
        CreditVol {
            ceiling: RateLimiter::new(now_ns, qos.burst_ceiling(), self.depth_ns),
            meter: RateLimiter::new(now_ns, qos.baseline, self.depth_ns),
            credits,
            pool,
            last_burst_ns: None,
        }
    }

    fn reconfigure(&mut self, now_ns: u64, _idx: u32, qos: &VolumeQos, vol: &mut CreditVol) {
        vol.ceiling.reconfigure(now_ns, qos.burst_ceiling());
        vol.meter.reconfigure(now_ns, qos.baseline);
        let depths = self.meter_depths(qos);
        match (vol.pool.take(), pooled(qos)) {
            (Some(mut m), Some((id, spec))) => {
                if self.pools.is_in(&m, id) {
                    self.pools.change(now_ns, &mut m, spec, depths);
                    vol.pool = Some(m);
                } else {
                    self.pools.leave(now_ns, &m);
                    vol.pool = Some(Box::new(self.pools.join(now_ns, id, spec, depths, false)));
                }
            }
            (Some(m), None) => {
                // Out of the pool: own buckets, which (as any new bucket on a QoS change)
                // start empty.
                self.pools.leave(now_ns, &m);
                vol.credits = SparseCredits::default();
                vol.credits.reconfigure(now_ns, qos);
            }
            (None, Some((id, spec))) => {
                // Into a pool: the volume's own balance is dropped, not brought along (a
                // volume created unpooled with a full bucket must not fill the pool). Its
                // baseline meter's debt is forgiven: outside a pool (without burst, its meter
                // is charged but not consulted) it may owe more than one request, and in a
                // pool its baseline rests on the meter alone.
                vol.meter.forgive_debt(now_ns);
                vol.credits = SparseCredits::default();
                vol.pool = Some(Box::new(self.pools.join(now_ns, id, spec, depths, false)));
            }
            (None, None) => vol.credits.reconfigure(now_ns, qos),
        }
    }

    fn removed(&mut self, now_ns: u64, _idx: u32, vol: &CreditVol) {
        if let Some(m) = &vol.pool {
            self.pools.leave(now_ns, m);
        }
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
        if let Some(m) = vol.pool.as_deref() {
            return classify_pooled(now_ns, vol, &self.pools, m, charge);
        }
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

    fn baseline_allowance(&self, now_ns: u64, _idx: u32, vol: &CreditVol) -> bool {
        // Bursting: a request above its baseline within the last two meter depths (Burst's
        // "this window or the last" at the default 10 ms).
        vol.last_burst_ns
            .is_none_or(|t| now_ns.saturating_sub(t) > self.depth_ns.saturating_mul(2))
    }

    fn effective_class(&self, now_ns: u64, class: usize, vol: &CreditVol, charge: Charge) -> usize {
        promote_within_baseline(class, BASELINE, &vol.meter, now_ns, charge)
    }

    fn verdict(&mut self, ctx: &Ctx<'_>, vol: &mut CreditVol) -> Verdict {
        let Some(m) = vol.pool.as_deref() else {
            return Verdict::Run {
                phase: credit_phase(ctx, &vol.meter, &vol.credits),
                front: false,
            };
        };
        // A sibling may have spent the pool since this volume was found ready: within its
        // baseline it runs anyway, above it only on a positive balance.
        let Ctx { now_ns, charge, .. } = *ctx;
        if vol.meter.ready_at(now_ns, charge) <= now_ns {
            Verdict::Run {
                phase: Phase::Baseline,
                front: false,
            }
        } else if self.pools.ready_at(now_ns, m, charge) <= now_ns {
            Verdict::Run {
                phase: Phase::BurstCredit,
                front: false,
            }
        } else {
            Verdict::Rotate
        }
    }

    fn charge(&mut self, ctx: &Ctx<'_>, phase: Phase, vol: &mut CreditVol) {
        let Ctx { now_ns, charge, .. } = *ctx;
        vol.ceiling.take(now_ns, charge);
        match vol.pool.as_deref() {
            Some(m) => self.pools.take(now_ns, m, charge),
            None => vol.credits.take(now_ns, charge),
        }
        if phase == Phase::Baseline {
            vol.meter.take(now_ns, charge);
        } else {
            vol.last_burst_ns = Some(now_ns);
        }
    }

    fn restore_credits(
        &mut self,
        now_ns: u64,
        vol: &mut CreditVol,
        iops_credits: Option<u64>,
        bytes_credits: Option<u64>,
    ) -> bool {
        // A pooled volume has no buckets of its own (`vol.credits` is empty), so this leaves
        // its pool alone: pools are not persisted by the server yet.
        vol.credits.restore(now_ns, iops_credits, bytes_credits)
    }

    fn credits(&self, now_ns: u64, vol: &CreditVol) -> (Option<u64>, Option<u64>) {
        match vol.pool.as_deref() {
            Some(m) => self.pools.balances_at(now_ns, m),
            None => vol.credits.balances_at(now_ns),
        }
    }

    fn check(&self, vols: &Slab<Entry<CreditVol>>) -> Result<(), String> {
        for (_, e) in vols.iter() {
            if !e.x.credits.within_range() {
                return Err(format!(
                    "volume {}: credit balance outside [0, bucket]",
                    e.core.id
                ));
            }
            if e.x.pool.is_some() && e.x.credits.is_active() {
                return Err(format!(
                    "volume {}: has its own credit buckets while in a pool",
                    e.core.id
                ));
            }
        }
        self.pools
            .check(vols.iter().filter_map(|(_, e)| e.x.pool.as_deref()))
    }

    fn baseline_guarantee(&self) -> Option<u64> {
        Some(0)
    }
}

/// Where a pooled volume's head request goes: the baseline ring as soon as its ceiling and
/// baseline meter admit it (whatever the pool holds), the burst ring as soon as its ceiling
/// admits it and the pool balance is positive.
fn classify_pooled(
    now_ns: u64,
    vol: &CreditVol,
    pools: &CreditPools,
    m: &Membership,
    charge: Charge,
) -> Place {
    let t_ceiling = vol.ceiling.ready_at(now_ns, charge);
    let t_meter = vol.meter.ready_at(now_ns, charge);
    let t_baseline = t_ceiling.max(t_meter);
    if t_baseline <= now_ns {
        return Place::Ring {
            class: BASELINE,
            front: false,
            reclassify_at: None,
        };
    }
    let t_pool = pools.ready_at(now_ns, m, charge);
    let t_burst = t_ceiling.max(t_pool);
    if t_burst <= now_ns {
        return Place::Ring {
            class: BURST,
            front: false,
            reclassify_at: Some(t_meter),
        };
    }
    let t = t_baseline.min(t_burst);
    if t == u64::MAX && t_pool == u64::MAX && t_ceiling != u64::MAX {
        // An empty pool that nobody refills: a sibling joining later would refill it, but
        // nothing re-places this volume then, so look again later instead of never.
        return Place::At(now_ns.saturating_add(ZERO_REFILL_POLL_NS));
    }
    Place::At(t)
}
