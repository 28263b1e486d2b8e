//! Cross-node arbitration of a shared backend: how the arbiter splits the backend's capacity
//! between the nodes that share it (Flint's "bandwidth auction").
//!
//! Why: each node paces its own tenants at its own capacity, and the burst policy serves
//! baselines first and bursts only on the node's spare capacity. But nodes that share one
//! backend (a RADOS pool) do not see each other's load: one node's bursting tenants can fill
//! the backend and slow down another node's tenants that stay within their baselines. So
//! every epoch each node reports its demand, and one arbiter gives each node a share of the
//! backend's capacity, which the node then uses as its own capacity.
//!
//! The rule ([`shares`]), for one dimension (the backend's capacity in some unit per second):
//!
//! 1. every node first gets its *reserved* demand (what its tenants' baselines need now, at
//!    most its total demand); if the reserved demands alone exceed the capacity, they are
//!    scaled down in proportion and nothing else is given;
//! 2. the rest goes to the nodes that want more (total demand above reserved), by weight,
//!    water-filling: a node never gets more than its demand in this step, and what a satisfied
//!    node does not take goes to the others by weight;
//! 3. what is still left when every demand is met is given to every node by weight, so that
//!    a burst that starts within an epoch finds spare capacity at once rather than one epoch
//!    later. It is safe: the shares still add up to the capacity.
//!
//! So the shares add up to exactly the capacity (when at least one node reports), no node
//! gets less than its reserved demand unless the reserved demands exceed the capacity, and no
//! node gets less than its weighted part of what the reserved demands leave unless it asked
//! for less. Pure arithmetic: no clock, time plays no part.

/// What one node reported for an epoch, in the backend's capacity unit per second.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeDemand {
    /// Relative weight in the split of what reserved demands leave (0 counts as 1).
    pub weight: u64,
    /// What its tenants' baselines need now (taken as at most `demand`).
    pub reserved: u64,
    /// All it could use now, bursts included.
    pub demand: u64,
}

/// Each node's share of `capacity` (per second), in the order of `nodes`; see the module
/// documentation for the rule. The shares add up to `capacity` (nothing when `nodes` is
/// empty).
pub fn shares(capacity: u64, nodes: &[NodeDemand]) -> Vec<u64> {
    if nodes.is_empty() {
        return Vec::new();
    }
    let reserved: Vec<u64> = nodes.iter().map(|n| n.reserved.min(n.demand)).collect();
    let reserved_sum: u128 = reserved.iter().map(|&r| u128::from(r)).sum();
    if reserved_sum >= u128::from(capacity) {
        return proportional(capacity, &reserved);
    }
    let mut share = reserved.clone();
    let mut left = capacity - reserved_sum as u64;
    let weight = |i: usize| nodes[i].weight.max(1);
    // Step 2: water-filling by weight among the nodes that want more.
    let mut want: Vec<u64> = nodes
        .iter()
        .zip(&reserved)
        .map(|(n, &r)| n.demand - r)
        .collect();
    let mut active: Vec<usize> = (0..nodes.len()).filter(|&i| want[i] > 0).collect();
    while left > 0 && !active.is_empty() {
        let weights: Vec<u64> = active.iter().map(|&i| weight(i)).collect();
        let parts = proportional(left, &weights);
        let capped: Vec<usize> = active
            .iter()
            .zip(&parts)
            .filter(|&(&i, &p)| p >= want[i])
            .map(|(&i, _)| i)
            .collect();
        if capped.is_empty() {
            for (&i, p) in active.iter().zip(parts) {
                share[i] += p;
            }
            left = 0;
            break;
        }
        // Satisfy the nodes whose part covers their want; the rest is split again.
        for &i in &capped {
            share[i] += want[i];
            left -= want[i];
            want[i] = 0;
        }
        active.retain(|&i| want[i] > 0);
    }
    // Step 3: every demand is met; the spare goes to everyone by weight.
    if left > 0 {
        let weights: Vec<u64> = (0..nodes.len()).map(weight).collect();
        for (s, p) in share.iter_mut().zip(proportional(left, &weights)) {
            *s += p;
        }
    }
    share
}

/// Splits `total` in proportion to `weights` (equal parts if every weight is 0); the parts add
/// up to `total` exactly (the rounding remainder goes one unit each to the first parts).
pub fn proportional(total: u64, weights: &[u64]) -> Vec<u64> {
    let sum: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    let n = weights.len() as u128;
    if n == 0 {
        return Vec::new();
    }
    let mut parts: Vec<u64> = weights
        .iter()
        .map(|&w| {
            (u128::from(total) * u128::from(w))
                .checked_div(sum)
                .unwrap_or(u128::from(total) / n) as u64
        })
        .collect();
    let given: u128 = parts.iter().map(|&p| u128::from(p)).sum();
    let mut rest = (u128::from(total) - given) as u64;
    for part in parts.iter_mut() {
        if rest == 0 {
            break;
        }
        *part += 1;
        rest -= 1;
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn node(weight: u64, reserved: u64, demand: u64) -> NodeDemand {
        NodeDemand {
            weight,
            reserved,
            demand,
        }
    }

    #[test]
    fn a_burster_cannot_take_what_another_nodes_baselines_need() {
        // Node 0: bursting tenants with small baselines; node 1: base-level tenants only.
        let s = shares(10_000, &[node(1, 500, 10_000), node(1, 3_000, 3_500)]);
        assert_eq!(s.iter().sum::<u64>(), 10_000);
        assert!(s[1] >= 3_500, "node 1 gets all it asked: {s:?}");
        // Both demands are met only in part; node 0 takes all the rest.
        assert_eq!(s, vec![6_500, 3_500]);
    }

    #[test]
    fn reserved_demands_beyond_capacity_are_scaled_down() {
        let s = shares(1_000, &[node(5, 1_500, 3_000), node(1, 500, 500)]);
        assert_eq!(s, vec![750, 250]);
    }

    #[test]
    fn the_rest_goes_by_weight_and_what_one_leaves_goes_to_the_other() {
        // Equal reserved, both want much more: 3:1.
        let s = shares(4_000, &[node(3, 0, 10_000), node(1, 0, 10_000)]);
        assert_eq!(s, vec![3_000, 1_000]);
        // The heavy node asks for less than its weighted part: the light one takes the rest.
        let s = shares(4_000, &[node(3, 0, 1_000), node(1, 0, 10_000)]);
        assert_eq!(s, vec![1_000, 3_000]);
    }

    #[test]
    fn spare_capacity_is_handed_out_by_weight() {
        let s = shares(1_000, &[node(1, 100, 100), node(3, 100, 100)]);
        assert_eq!(s, vec![300, 700]);
        assert!(shares(1_000, &[]).is_empty());
        assert_eq!(shares(0, &[node(1, 5, 5)]), vec![0]);
    }

    fn arb_node() -> impl Strategy<Value = NodeDemand> {
        (0u64..10, 0u64..5_000, 0u64..20_000).prop_map(|(w, r, d)| node(w, r, d))
    }

    proptest! {
        #[test]
        fn shares_add_up_and_respect_reserved_and_weights(
            capacity in 0u64..50_000,
            nodes in proptest::collection::vec(arb_node(), 1..8),
        ) {
            let s = shares(capacity, &nodes);
            prop_assert_eq!(s.len(), nodes.len());
            prop_assert_eq!(s.iter().map(|&x| u128::from(x)).sum::<u128>(), u128::from(capacity));
            let reserved: Vec<u64> = nodes.iter().map(|n| n.reserved.min(n.demand)).collect();
            let reserved_sum: u64 = reserved.iter().sum();
            if reserved_sum <= capacity {
                let rest = capacity - reserved_sum;
                let weight_sum: u64 = nodes.iter().map(|n| n.weight.max(1)).sum();
                for (i, n) in nodes.iter().enumerate() {
                    // Its reserved part, always.
                    prop_assert!(s[i] >= reserved[i], "{:?} -> {:?}", nodes, s);
                    // Its demand, or at least its weighted part of the rest (less rounding).
                    let fair = rest * n.weight.max(1) / weight_sum;
                    prop_assert!(
                        s[i] >= n.demand.min(reserved[i] + fair.saturating_sub(nodes.len() as u64)),
                        "{:?} -> {:?}", nodes, s
                    );
                }
                // Nobody gets more than its demand while another node's demand is unmet.
                let unmet = nodes.iter().zip(&s).any(|(n, &x)| x < n.demand);
                if unmet {
                    for (n, &x) in nodes.iter().zip(&s) {
                        prop_assert!(x <= n.demand.max(n.reserved.min(n.demand)), "{:?} -> {:?}", nodes, s);
                    }
                }
            } else {
                // Scaled down: nobody gets more than its reserved demand.
                for (i, &x) in s.iter().enumerate() {
                    prop_assert!(x <= reserved[i] + 1, "{:?} -> {:?}", nodes, s);
                }
            }
        }
    }
}
