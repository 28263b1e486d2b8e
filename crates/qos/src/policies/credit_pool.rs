//! Shared credit pools of the Credit policy: burst credits granted per account, not per volume.
//!
//! Why: gp2-style credits belong to a volume, and a new volume starts with a full bucket. An
//! account that stripes over small volumes and replaces each one before its credits run out
//! therefore bursts forever ("More IOPS for Less", docs/background.md §5.5: ~100× the IOPS of one
//! volume). Volumes whose [`crate::vocab::CreditSpec::pool`] names the same id share one bucket
//! per dimension (I/O units, bytes) here instead:
//! - capacity and refill are the sums over the current members' buckets in that dimension
//!   (exact integers: the pool is a [`TokenBucket`] reconfigured live on every membership
//!   change, which keeps the balance, clamps it to a smaller capacity and never refills);
//! - the initial credits of a dimension are decided once, when it gets its first member ever
//!   (full by that member's capacity if it was added with `start_full`, else empty); the pool
//!   record outlives its members, so neither a replacement volume nor deleting and recreating
//!   every volume hands out a new burst;
//! - every request of a member spends from the pool; the Credit policy admits a member's
//!   request within its baseline meter whatever the balance (a shared bucket must not let one
//!   member starve another below its baseline) and a burst request only on a positive balance.
//!
//! Because baseline requests may run on a non-positive balance, a pool's balance can dip below
//! zero by more than one request: by at most one request per member plus what each member's
//! baseline meter had saved up (the refill, at least the sum of the members' baselines by
//! [`crate::vocab::VolumeQos::validate`], pays the rest back as it is spent). [`PoolDim`] keeps
//! that bound ("episode" bookkeeping below) so that `check_invariants` can verify it.

use crate::bucket::TokenBucket;
use crate::limiter::Charge;
use crate::vocab::{CreditBucketSpec, CreditSpec, NS_PER_S};
use std::collections::BTreeMap;

/// Dimensions of a pool: I/O units, then bytes.
const DIMS: usize = 2;
const NANO: i128 = NS_PER_S as i128;

/// What one member brings to one dimension of its pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Share {
    capacity: u64,
    refill_per_s: u64,
    /// Depth of the member's baseline meter in this dimension, in units: how far its baseline
    /// requests may run ahead of their rate, i.e. of the refill they bring.
    meter_depth_units: u64,
}

impl Share {
    /// A member's term of the overdraft bound: its meter's depth, plus one unit for the
    /// limiter's sub-nanosecond rounding allowance above depth.
    fn allowance_units(&self) -> u128 {
        u128::from(self.meter_depth_units) + 1
    }
}

/// A volume's membership in a pool: which pool, and what it contributes per dimension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Membership {
    /// Index of the pool in [`CreditPools::pools`] (stable: pools are never removed).
    slot: usize,
    shares: [Option<Share>; DIMS],
}

/// The shares a credit spec brings, given the member's baseline meter depths per dimension.
fn shares_of(spec: &CreditSpec, meter_depth_units: [u64; DIMS]) -> [Option<Share>; DIMS] {
    let share = |b: Option<CreditBucketSpec>, depth: u64| {
        b.map(|b| Share {
            capacity: b.capacity,
            refill_per_s: b.refill_per_s,
            meter_depth_units: depth,
        })
    };
    [
        share(spec.iops, meter_depth_units[0]),
        share(spec.bytes, meter_depth_units[1]),
    ]
}

fn start_full(spec: &CreditSpec, dim: usize) -> bool {
    let b = if dim == 0 { spec.iops } else { spec.bytes };
    b.is_some_and(|b| b.start_full)
}

fn saturate(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// One dimension of a pool.
#[derive(Clone, Debug)]
struct PoolDim {
    /// The pooled credits: capacity and rate are the (saturated) sums below. A summed rate of
    /// `u64::MAX` means unlimited, as for any bucket.
    bucket: TokenBucket,
    capacity_sum: u128,
    refill_sum: u128,
    members: u64,
    /// Whether the one-time initial grant has been decided (first member ever).
    initial_decided: bool,
    /// Largest single charge ever spent from this dimension.
    max_charge: u64,
    /// Σ over current members of [`Share::allowance_units`].
    allowance_units: u128,
    /// The overdraft bound counts every member incarnation (a membership, or a QoS change of
    /// one) active since the balance was last seen non-negative: a departed member's baseline
    /// requests may still be unpaid. `episode_*` are those sums; they restart from the current
    /// members whenever an operation finds the balance >= 0.
    episode_allowance_units: u128,
    episode_incarnations: u64,
}

impl PoolDim {
    fn new(now_ns: u64) -> Self {
        PoolDim {
            bucket: TokenBucket::new(now_ns, 0, 0, false),
            capacity_sum: 0,
            refill_sum: 0,
            members: 0,
            initial_decided: false,
            max_charge: 0,
            allowance_units: 0,
            episode_allowance_units: 0,
            episode_incarnations: 0,
        }
    }

    /// Brings the balance up to `now_ns`; a non-negative balance starts a new episode.
    fn observe(&mut self, now_ns: u64) {
        self.bucket.advance(now_ns);
        if self.bucket.level_nano() >= 0 {
            self.episode_allowance_units = self.allowance_units;
            self.episode_incarnations = self.members;
        }
    }

    fn add(&mut self, s: &Share) {
        self.capacity_sum += u128::from(s.capacity);
        self.refill_sum += u128::from(s.refill_per_s);
        self.members += 1;
        self.allowance_units += s.allowance_units();
        self.episode_allowance_units += s.allowance_units();
        self.episode_incarnations += 1;
    }

    fn sub(&mut self, s: &Share) {
        self.capacity_sum = self.capacity_sum.saturating_sub(u128::from(s.capacity));
        self.refill_sum = self.refill_sum.saturating_sub(u128::from(s.refill_per_s));
        self.members = self.members.saturating_sub(1);
        self.allowance_units = self.allowance_units.saturating_sub(s.allowance_units());
    }

    /// Applies the sums to the bucket at `now_ns`: balance kept, clamped, never refilled.
    fn apply(&mut self, now_ns: u64) {
        self.bucket.reconfigure(
            now_ns,
            saturate(self.refill_sum),
            saturate(self.capacity_sum),
        );
    }

    /// The lowest balance the pool can reach, in nano-units (negative): one request per member
    /// incarnation of the episode plus one (the burst request admitted on a positive balance),
    /// plus what their baseline meters could have saved up.
    fn floor_nano(&self) -> i128 {
        let requests = (u128::from(self.episode_incarnations) + 1) * u128::from(self.max_charge);
        let units = requests.saturating_add(self.episode_allowance_units);
        -(i128::try_from(units)
            .unwrap_or(i128::MAX)
            .saturating_mul(NANO))
    }
}

/// One pool.
#[derive(Clone, Debug)]
struct Pool {
    id: u32,
    dims: [PoolDim; DIMS],
}

/// Every pool of one Credit policy instance.
#[derive(Clone, Debug, Default)]
pub(crate) struct CreditPools {
    /// Pool id → index in `pools`.
    slots: BTreeMap<u32, usize>,
    /// Pools in creation order; never removed (a pool remembers its grant).
    pools: Vec<Pool>,
}

impl CreditPools {
    fn slot_for(&mut self, now_ns: u64, id: u32) -> usize {
        if let Some(&slot) = self.slots.get(&id) {
            return slot;
        }
        let slot = self.pools.len();
        self.pools.push(Pool {
            id,
            dims: [PoolDim::new(now_ns), PoolDim::new(now_ns)],
        });
        self.slots.insert(id, slot);
        slot
    }

    /// Whether `m` is a member of pool `id`.
    pub(crate) fn is_in(&self, m: &Membership, id: u32) -> bool {
        self.pools.get(m.slot).is_some_and(|p| p.id == id)
    }

    /// Adds a member to pool `id` (created if new). `added` is true for a volume being added
    /// (it may bring the pool's one initial grant), false for a QoS change (never brings
    /// credits). `meter_depth_units` are the member's baseline meter depths per dimension.
    pub(crate) fn join(
        &mut self,
        now_ns: u64,
        id: u32,
        spec: &CreditSpec,
        meter_depth_units: [u64; DIMS],
        added: bool,
    ) -> Membership {
        let slot = self.slot_for(now_ns, id);
        let shares = shares_of(spec, meter_depth_units);
        if let Some(pool) = self.pools.get_mut(slot) {
            for (d, (dim, share)) in pool.dims.iter_mut().zip(&shares).enumerate() {
                let Some(share) = share else { continue };
                dim.observe(now_ns);
                dim.add(share);
                dim.apply(now_ns);
                if !dim.initial_decided {
                    dim.initial_decided = true;
                    if added && start_full(spec, d) {
                        dim.bucket.give(now_ns, share.capacity);
                    }
                }
            }
        }
        Membership { slot, shares }
    }

    /// Removes a member: capacity and refill shrink, the balance is clamped to the new capacity.
    pub(crate) fn leave(&mut self, now_ns: u64, m: &Membership) {
        let Some(pool) = self.pools.get_mut(m.slot) else {
            return;
        };
        for (dim, share) in pool.dims.iter_mut().zip(&m.shares) {
            let Some(share) = share else { continue };
            dim.observe(now_ns);
            dim.sub(share);
            dim.apply(now_ns);
        }
    }

    /// A member's QoS changed (same pool): its contribution is replaced, the balance kept
    /// (clamped to a smaller capacity), nothing granted.
    pub(crate) fn change(
        &mut self,
        now_ns: u64,
        m: &mut Membership,
        spec: &CreditSpec,
        meter_depth_units: [u64; DIMS],
    ) {
        let shares = shares_of(spec, meter_depth_units);
        let Some(pool) = self.pools.get_mut(m.slot) else {
            return;
        };
        for (dim, (old, new)) in pool.dims.iter_mut().zip(m.shares.iter().zip(&shares)) {
            if old == new {
                continue;
            }
            dim.observe(now_ns);
            if let Some(old) = old {
                dim.sub(old);
            }
            if let Some(new) = new {
                dim.add(new);
                dim.initial_decided = true;
            }
            dim.apply(now_ns);
        }
        m.shares = shares;
    }

    /// Earliest time `>= now_ns` at which every pooled bucket `charge` draws on has a positive
    /// balance (the rule of a volume's own credit bucket).
    pub(crate) fn ready_at(&self, now_ns: u64, m: &Membership, charge: Charge) -> u64 {
        let Some(pool) = self.pools.get(m.slot) else {
            return now_ns;
        };
        let [iops, bytes] = &pool.dims;
        let mut t = now_ns;
        if m.shares[0].is_some() {
            t = t.max(iops.bucket.credit_ready_at(now_ns));
        }
        if m.shares[1].is_some() && charge.bytes > 0 {
            t = t.max(bytes.bucket.credit_ready_at(now_ns));
        }
        t
    }

    /// Spends a member's request from the pool, in full.
    pub(crate) fn take(&mut self, now_ns: u64, m: &Membership, charge: Charge) {
        let Some(pool) = self.pools.get_mut(m.slot) else {
            return;
        };
        for (dim, (share, units)) in pool
            .dims
            .iter_mut()
            .zip(m.shares.iter().zip([charge.units, charge.bytes]))
        {
            if share.is_none() || units == 0 {
                continue;
            }
            dim.observe(now_ns);
            dim.bucket.take_credit(now_ns, units);
            dim.max_charge = dim.max_charge.max(units);
        }
    }

    /// Whole credits in the pool's buckets the member uses, at `now_ns`.
    pub(crate) fn balances_at(&self, now_ns: u64, m: &Membership) -> (Option<u64>, Option<u64>) {
        let Some(pool) = self.pools.get(m.slot) else {
            return (None, None);
        };
        let balance = |d: usize| {
            m.shares[d]
                .and(pool.dims.get(d))
                .map(|dim| dim.bucket.whole_units_at(now_ns))
        };
        (balance(0), balance(1))
    }

    /// Checks every pool: its sums are those of its current `members`, and its balance lies
    /// within `[overdraft floor, capacity]` (see [`PoolDim::floor_nano`]).
    pub(crate) fn check<'a>(
        &self,
        members: impl Iterator<Item = &'a Membership>,
    ) -> Result<(), String> {
        // (capacity, refill, members, allowance) per pool and dimension, recomputed.
        let mut sums = vec![[(0u128, 0u128, 0u64, 0u128); DIMS]; self.pools.len()];
        for m in members {
            let Some(per_dim) = sums.get_mut(m.slot) else {
                return Err(format!("a member refers to unknown pool slot {}", m.slot));
            };
            for (acc, share) in per_dim.iter_mut().zip(&m.shares) {
                if let Some(s) = share {
                    acc.0 += u128::from(s.capacity);
                    acc.1 += u128::from(s.refill_per_s);
                    acc.2 += 1;
                    acc.3 += s.allowance_units();
                }
            }
        }
        for (pool, expected) in self.pools.iter().zip(&sums) {
            for (d, (dim, &(capacity, refill, members, allowance))) in
                pool.dims.iter().zip(expected).enumerate()
            {
                let what = if d == 0 { "I/O-unit" } else { "bytes" };
                if (
                    dim.capacity_sum,
                    dim.refill_sum,
                    dim.members,
                    dim.allowance_units,
                ) != (capacity, refill, members, allowance)
                {
                    return Err(format!(
                        "credit pool {} ({what}): sums (capacity {}, refill {}, members {}) differ from its members' ({capacity}, {refill}, {members})",
                        pool.id, dim.capacity_sum, dim.refill_sum, dim.members
                    ));
                }
                if dim.bucket.capacity_units() != saturate(capacity)
                    || dim.bucket.rate_per_s() != saturate(refill)
                {
                    return Err(format!(
                        "credit pool {} ({what}): bucket (capacity {}, refill {}) is not the sum of its members'",
                        pool.id,
                        dim.bucket.capacity_units(),
                        dim.bucket.rate_per_s()
                    ));
                }
                if !dim.bucket.level_within(dim.floor_nano()) {
                    return Err(format!(
                        "credit pool {} ({what}): balance {} nano-units outside [{}, {}] (capacity {})",
                        pool.id,
                        dim.bucket.level_nano(),
                        dim.floor_nano(),
                        dim.bucket.capacity_nano(),
                        dim.bucket.capacity_units()
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(capacity: u64, refill_per_s: u64, start_full: bool) -> CreditSpec {
        CreditSpec {
            iops: Some(CreditBucketSpec {
                capacity,
                refill_per_s,
                start_full,
            }),
            bytes: None,
            pool: Some(1),
        }
    }

    const S: u64 = NS_PER_S;

    #[test]
    fn first_member_grants_once_and_sums_follow_membership() {
        let mut p = CreditPools::default();
        let a = p.join(0, 1, &spec(1_000, 100, true), [1, 1], true);
        let b = p.join(0, 1, &spec(500, 50, true), [1, 1], true);
        // One grant (the first member's capacity), the capacity of both.
        assert_eq!(p.balances_at(0, &a), (Some(1_000), None));
        assert_eq!(p.balances_at(0, &b), (Some(1_000), None));
        p.take(
            0,
            &a,
            Charge {
                units: 900,
                bytes: 0,
            },
        );
        // 100 left, refilled at 150/s up to 1,500.
        assert_eq!(p.balances_at(2 * S, &b).0, Some(400));
        assert_eq!(p.balances_at(100 * S, &b).0, Some(1_500));
        p.leave(100 * S, &a);
        assert_eq!(p.balances_at(100 * S, &b).0, Some(500));
        p.leave(100 * S, &b);
        assert_eq!(p.balances_at(200 * S, &b).0, Some(0));
        // A new member after everyone left: capacity and refill, no credits.
        let c = p.join(200 * S, 1, &spec(1_000, 100, true), [1, 1], true);
        assert_eq!(p.balances_at(200 * S, &c).0, Some(0));
        assert_eq!(p.balances_at(201 * S, &c).0, Some(100));
        assert!(p.check([&c].into_iter()).is_ok());
        // The check notices sums that are not those of the members.
        assert!(p.check(std::iter::empty()).is_err());
    }

    #[test]
    fn a_first_member_without_start_full_leaves_the_pool_empty_for_good() {
        let mut p = CreditPools::default();
        let a = p.join(0, 1, &spec(1_000, 100, false), [1, 1], true);
        let b = p.join(0, 1, &spec(1_000, 100, true), [1, 1], true);
        assert_eq!(p.balances_at(0, &b).0, Some(0));
        assert!(p.check([&a, &b].into_iter()).is_ok());
    }

    #[test]
    fn baseline_overdraft_stays_within_the_floor() {
        let mut p = CreditPools::default();
        let a = p.join(0, 1, &spec(10, 100, false), [5, 5], true);
        // Baseline requests on an empty pool: the meter's depth (5) plus one request.
        for _ in 0..6 {
            p.take(0, &a, Charge { units: 1, bytes: 0 });
        }
        assert!(p.check([&a].into_iter()).is_ok());
        // The same debt remains the bound after the member leaves (the episode remembers it).
        p.leave(0, &a);
        assert!(p.check(std::iter::empty()).is_ok());
        // Far beyond the bound is reported.
        let b = p.join(0, 1, &spec(10, 100, false), [1, 1], true);
        for _ in 0..100 {
            p.take(0, &b, Charge { units: 1, bytes: 0 });
        }
        assert!(p.check([&b].into_iter()).is_err());
    }
}
