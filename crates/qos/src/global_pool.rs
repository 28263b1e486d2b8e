//! The node's capacity shared between scheduler workers (BurstCBS's global pool).
//!
//! Each scheduler worker runs its own policy over a share of the node's capacity. Fixed `1/N`
//! shares waste capacity as soon as load is uneven: with 1-to-1 dispatch a volume that bursts
//! is confined to its home worker's share while the others sit idle, and even sprayed load is
//! uneven when few volumes are active. So the node moves capacity between workers every
//! rebalancing period (the policy window, 10 ms by default, and never less than
//! [`MIN_PERIOD_NS`]), per cost dimension, from what each worker did in the last period:
//!
//! 1. every worker keeps a *floor*: its baseline-phase use times 5/4 (room for its baseline
//!    tenants to grow), and at least an idle floor of `5 % / N` of the node, so that a worker
//!    whose tenants wake up can serve them until the next period (BurstCBS's 5 % reserve,
//!    spread over the workers). A worker whose baseline work alone used 3/4 of its share while
//!    its policy held requests back gets at least its static `1/N` back at once (BurstCBS's
//!    fast recovery): lending never costs baseline tenants more than one period;
//! 2. every worker gets its whole use times 5/4 on top of that, when the node has it;
//! 3. what is left goes in equal parts to the workers that were *capacity-bound* (the policy
//!    held requests back while the worker used at least 3/4 of its share), or, if none was,
//!    to every worker, so that spare capacity is where the next burst will look for it.
//!
//! When the node cannot cover step 2, baseline floors come first and the rest is shared in
//! proportion to what each worker asked beyond its floor. The shares of a dimension always add
//! up to the node's capacity in that dimension, so the workers together never schedule more
//! than the node has. An unlimited dimension stays unlimited on every worker.
//!
//! This module is the arithmetic only, pure like the rest of this crate (so the simulator can
//! run it too); the node's scheduler measures the use and applies the shares with
//! `Policy::set_capacity`.

use crate::CostVector;
use crate::arbitration::proportional;
use crate::cost::{DIMENSIONS, mul_div_floor};

/// Part of the node kept as idle floors, over all workers together (permille).
pub const IDLE_FLOOR_PERMILLE: u64 = 50;

/// The shortest rebalancing period, whatever the policy window: the split follows each
/// worker's use over one period, and a worker must see a few requests in it for that use to
/// mean anything. With `window_ns = 1 ms` and a node share of 436 IOPS over two workers (a
/// fifth of a request per worker per period, so a use of 0 or 1 request), the shares followed
/// the noise and the node did 110 IOPS, below its tenants' baselines (docs/results.md, "A pool
/// with a capacity of its own"); the policy alone, at the same window, gives the full share.
pub const MIN_PERIOD_NS: u64 = 10_000_000;

/// What one worker did over the last rebalancing period, in cost units per second.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerUse {
    /// Cost it dispatched, all phases.
    pub used: CostVector,
    /// Cost it dispatched in the baseline phase.
    pub baseline: CostVector,
    /// Its share during the period.
    pub share: CostVector,
    /// Its policy held requests back (a `WaitUntil`) during the period.
    pub held_back: bool,
}

/// New shares of `node` (per second) for workers that used what `uses` says.
pub fn split(node: CostVector, uses: &[WorkerUse]) -> Vec<CostVector> {
    let mut shares = vec![[0u64; DIMENSIONS]; uses.len()];
    for (d, &capacity) in node.dims().iter().enumerate() {
        let column: Vec<DimensionUse> = uses
            .iter()
            .map(|u| DimensionUse {
                used: u.used.dims()[d],
                baseline: u.baseline.dims()[d],
                bound: u.held_back && u.used.dims()[d] >= u.share.dims()[d] / 4 * 3,
                baseline_bound: u.held_back && u.baseline.dims()[d] >= u.share.dims()[d] / 4 * 3,
            })
            .collect();
        for (w, value) in split_dimension(capacity, &column).into_iter().enumerate() {
            shares[w][d] = value;
        }
    }
    shares.into_iter().map(CostVector::from_dims).collect()
}

/// The workers' shares for a new node capacity `node` (cross-node arbitration changes it at
/// run time), in the proportions of their current `shares`, adding up to `node` in every
/// dimension. A change is no time to re-split by use: the period since the last rebalancing
/// may be a millisecond long, and a worker that happened to dispatch nothing in it would be
/// cut to its idle floor until the next period, with its tenants' requests (sprayed over every
/// worker) waiting behind a pacer at a few percent of the node. A dimension that was unlimited
/// has no proportions to keep: its new capacity is split evenly; one that becomes unlimited is
/// unlimited on every worker.
pub fn rescale(node: CostVector, shares: &[CostVector]) -> Vec<CostVector> {
    let mut out = vec![[0u64; DIMENSIONS]; shares.len()];
    for (d, &capacity) in node.dims().iter().enumerate() {
        let column: Vec<u64> = shares.iter().map(|s| s.dims()[d]).collect();
        let split = if capacity == u64::MAX {
            vec![u64::MAX; shares.len()]
        } else if column.contains(&u64::MAX) {
            proportional(capacity, &vec![1; shares.len()])
        } else {
            proportional(capacity, &column)
        };
        for (w, value) in split.into_iter().enumerate() {
            out[w][d] = value;
        }
    }
    out.into_iter().map(CostVector::from_dims).collect()
}

/// One worker's use of one dimension.
#[derive(Clone, Copy, Debug)]
struct DimensionUse {
    used: u64,
    baseline: u64,
    /// Held back while using 3/4 of its share.
    bound: bool,
    /// Held back while its baseline work alone used 3/4 of its share.
    baseline_bound: bool,
}

fn grown(x: u64) -> u64 {
    x.saturating_add(x / 4)
}

fn split_dimension(capacity: u64, uses: &[DimensionUse]) -> Vec<u64> {
    let n = uses.len() as u64;
    if capacity == u64::MAX || n == 0 {
        return vec![capacity; uses.len()];
    }
    let idle_floor = mul_div_floor(capacity, IDLE_FLOOR_PERMILLE, 1000) / n;
    let static_share = capacity / n;
    let floors: Vec<u64> = uses
        .iter()
        .map(|u| {
            let recovery = if u.baseline_bound { static_share } else { 0 };
            grown(u.baseline)
                .max(idle_floor)
                .max(recovery)
                .min(capacity)
        })
        .collect();
    let wants: Vec<u64> = uses
        .iter()
        .zip(&floors)
        .map(|(u, &f)| grown(u.used).min(capacity).max(f))
        .collect();
    let floor_sum: u128 = floors.iter().map(|&f| u128::from(f)).sum();
    if floor_sum >= u128::from(capacity) {
        return proportional(capacity, &floors);
    }
    let want_sum: u128 = wants.iter().map(|&w| u128::from(w)).sum();
    if want_sum >= u128::from(capacity) {
        // Floors first; the rest in proportion to what each asked beyond its floor.
        let rest = capacity - floor_sum as u64;
        let extra: Vec<u64> = wants.iter().zip(&floors).map(|(w, f)| w - f).collect();
        let extra = proportional(rest, &extra);
        return floors.iter().zip(extra).map(|(f, e)| f + e).collect();
    }
    let mut shares = wants;
    let left = capacity - want_sum as u64;
    let bound: Vec<usize> = (0..uses.len()).filter(|&w| uses[w].bound).collect();
    let takers: Vec<usize> = if bound.is_empty() {
        (0..uses.len()).collect()
    } else {
        bound
    };
    let k = takers.len() as u64;
    for (i, &w) in takers.iter().enumerate() {
        shares[w] += left / k + u64::from((i as u64) < left % k);
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NODE: u64 = 1_000_000_000;

    fn node() -> CostVector {
        CostVector::new(u64::MAX, u64::MAX, u64::MAX, NODE)
    }

    fn device(v: u64) -> CostVector {
        CostVector::new(0, 0, 0, v)
    }

    fn worker(used: u64, baseline: u64, share: u64, held_back: bool) -> WorkerUse {
        WorkerUse {
            used: device(used),
            baseline: device(baseline),
            share: device(share),
            held_back,
        }
    }

    fn device_shares(shares: &[CostVector]) -> Vec<u64> {
        shares.iter().map(|s| s.dims()[3]).collect()
    }

    #[test]
    fn a_lone_burster_gets_the_node_but_the_idle_floors() {
        let half = NODE / 2;
        let uses = [worker(half, 0, half, true), worker(0, 0, half, false)];
        let shares = split(node(), &uses);
        let device = device_shares(&shares);
        assert_eq!(
            device[1],
            NODE / 20 / 2,
            "the idle worker keeps its idle floor"
        );
        assert_eq!(device[0], NODE - NODE / 40);
        // Unlimited dimensions stay unlimited.
        assert!(shares.iter().all(|s| s.dims()[0] == u64::MAX));
    }

    #[test]
    fn a_worker_with_baseline_work_keeps_it_and_room_to_grow() {
        let uses = [
            worker(900_000_000, 0, 950_000_000, true),
            worker(100_000_000, 100_000_000, 50_000_000, false),
        ];
        let device = device_shares(&split(node(), &uses));
        assert_eq!(device[1], 125_000_000);
        assert_eq!(device[0], NODE - 125_000_000);
    }

    #[test]
    fn a_worker_starved_of_baseline_capacity_gets_its_static_share_back_at_once() {
        let idle_floor = NODE / 40;
        let uses = [
            worker(NODE - idle_floor, 0, NODE - idle_floor, true),
            worker(idle_floor, idle_floor, idle_floor, true),
        ];
        let device = device_shares(&split(node(), &uses));
        assert_eq!(device, vec![NODE / 2, NODE / 2]);
    }

    #[test]
    fn spare_capacity_is_spread_when_nobody_is_bound() {
        let uses = [
            worker(100, 0, NODE / 2, false),
            worker(100, 0, NODE / 2, false),
        ];
        let device = device_shares(&split(node(), &uses));
        assert_eq!(device, vec![NODE / 2, NODE / 2]);
    }

    #[test]
    fn held_back_below_three_quarters_of_its_share_is_not_bound() {
        // Worker 1's requests wait for their own volume's ceiling, not for capacity.
        let uses = [
            worker(NODE / 2, 0, NODE / 2, true),
            worker(NODE / 10, 0, NODE / 2, true),
        ];
        let device = device_shares(&split(node(), &uses));
        assert_eq!(device[1], grown(NODE / 10));
        assert_eq!(device[0], NODE - grown(NODE / 10));
    }

    #[test]
    fn an_oversubscribed_node_serves_baseline_floors_first() {
        let uses = [
            worker(NODE, NODE / 2, NODE / 2, true),
            worker(NODE, 0, NODE / 2, true),
        ];
        let device = device_shares(&split(node(), &uses));
        assert!(device[0] >= grown(NODE / 2), "{device:?}");
        assert_eq!(device.iter().sum::<u64>(), NODE);
    }

    #[test]
    fn a_new_capacity_keeps_the_workers_proportions() {
        // A worker serving three quarters of the node keeps three quarters of the new
        // capacity, not what a millisecond of use since the last rebalancing would say.
        let shares = [device(750), device(250)];
        let half = rescale(CostVector::new(u64::MAX, u64::MAX, u64::MAX, 500), &shares);
        assert_eq!(device_shares(&half), vec![375, 125]);
        assert!(half.iter().all(|s| s.dims()[..3] == [u64::MAX; 3]));
        // Unlimited before: no proportions, an even split; unlimited after: unlimited.
        let was_unlimited = [CostVector::MAX, CostVector::MAX, CostVector::MAX];
        assert_eq!(
            device_shares(&rescale(device(1_000), &was_unlimited)),
            vec![334, 333, 333]
        );
        assert_eq!(
            device_shares(&rescale(CostVector::MAX, &shares)),
            vec![u64::MAX; 2]
        );
    }

    proptest! {
        /// A rescaled split adds up to the new capacity and keeps the order of the shares.
        #[test]
        fn rescaled_shares_add_up(
            capacity in 1u64..=10_000_000_000,
            old in prop::collection::vec(0u64..=10_000_000_000, 1..8),
        ) {
            let shares: Vec<CostVector> = old.iter().map(|&v| device(v)).collect();
            let device_new = device_shares(&rescale(device(capacity), &shares));
            prop_assert_eq!(device_new.iter().map(|&d| u128::from(d)).sum::<u128>(), u128::from(capacity));
            for i in 0..old.len() {
                for j in 0..old.len() {
                    if old[i] > old[j] {
                        // The rounding remainder (at most one unit each) may go to either.
                        prop_assert!(device_new[i] + 1 >= device_new[j]);
                    }
                }
            }
        }

        /// The shares of each dimension add up to the node's capacity (unlimited stays
        /// unlimited), and a worker gets its baseline use (grown by a quarter) whenever the
        /// node can cover every worker's.
        #[test]
        fn shares_add_up_and_cover_baselines(
            capacity in 1u64..=10_000_000_000,
            raw in prop::collection::vec((0u64..=20_000_000_000, 0u64..=1000, any::<bool>()), 1..8),
        ) {
            let n = raw.len() as u64;
            let uses: Vec<WorkerUse> = raw
                .iter()
                .map(|&(used, baseline_permille, held)| {
                    let baseline = mul_div_floor(used, baseline_permille, 1000);
                    worker(used, baseline, capacity / n, held)
                })
                .collect();
            let shares = split(CostVector::new(u64::MAX, u64::MAX, u64::MAX, capacity), &uses);
            let device = device_shares(&shares);
            prop_assert_eq!(device.iter().map(|&d| u128::from(d)).sum::<u128>(), u128::from(capacity));
            prop_assert!(shares.iter().all(|s| s.dims()[..3] == [u64::MAX; 3]));
            let floors: u128 = uses.iter().map(|u| u128::from(grown(u.baseline.dims()[3]).min(capacity))).sum();
            let idle = u128::from(mul_div_floor(capacity, IDLE_FLOOR_PERMILLE, 1000) / n) * u128::from(n);
            if floors + idle <= u128::from(capacity) {
                for (u, &d) in uses.iter().zip(&device) {
                    prop_assert!(d >= grown(u.baseline.dims()[3]).min(capacity));
                }
            }
        }
    }
}
