//! Deterministic behaviour tests, one or more per policy, with explicit times.
//!
//! Unless stated otherwise the node has one CPU second per second and every request costs
//! 1 ms of CPU, so the node does exactly 1,000 requests per second and the k-th request of a
//! saturated node starts at k ms.

mod common;

use common::{Driver, MS, S, cost, cpu_capacity};
use headroom_qos::{
    BurstMode, CostVector, CreditBucketSpec, CreditSpec, IoRate, NodeCapacity, OpKind, Phase,
    PolicyKind, PolicyParams, VolumeQos,
};

const REQ_CPU_NS: u64 = 1_000_000;

fn node() -> NodeCapacity {
    cpu_capacity(1_000_000_000)
}

fn c() -> CostVector {
    cost(REQ_CPU_NS, OpKind::Read, 4096)
}

/// A volume that may burst on spare capacity up to `ceiling_iops`.
fn on_demand(baseline_iops: u64, ceiling_iops: u64, weight: u32) -> VolumeQos {
    VolumeQos {
        baseline: IoRate::new(baseline_iops, u64::MAX),
        ceiling: IoRate::new(ceiling_iops, u64::MAX),
        burst: BurstMode::OnDemand,
        weight,
        io_unit_bytes: 0,
    }
}

fn fixed(iops: u64, weight: u32) -> VolumeQos {
    VolumeQos {
        weight,
        ..VolumeQos::fixed(IoRate::new(iops, u64::MAX))
    }
}

fn credits(baseline: u64, ceiling: u64, bucket: u64) -> VolumeQos {
    VolumeQos {
        baseline: IoRate::new(baseline, u64::MAX),
        ceiling: IoRate::new(ceiling, u64::MAX),
        burst: BurstMode::Credits(CreditSpec {
            iops: Some(CreditBucketSpec {
                capacity: bucket,
                refill_per_s: baseline,
                start_full: true,
            }),
            bytes: None,
            pool: None,
        }),
        weight: 1,
        io_unit_bytes: 0,
    }
}

/// [`credits`] in credit pool `pool`.
fn pooled(baseline: u64, ceiling: u64, bucket: u64, pool: u32) -> VolumeQos {
    let mut q = credits(baseline, ceiling, bucket);
    if let BurstMode::Credits(c) = &mut q.burst {
        c.pool = Some(pool);
    }
    q
}

fn flood(d: &mut Driver, vol: u32, n: usize) {
    d.enqueue(vol, n, OpKind::Read, 4096, c());
}

// ---------------------------------------------------------------------------------------- Wild

#[test]
fn wild_fills_the_node_exactly_at_capacity() {
    let mut d = Driver::new(PolicyKind::Wild, node());
    d.add(1, &on_demand(0, u64::MAX, 1));
    flood(&mut d, 1, 3_000);
    d.run_until(2 * S);
    assert_eq!(d.count(1, 0, S), 1_000);
    assert_eq!(d.count(1, S, 2 * S), 1_000);
    // The k-th request starts at exactly k ms.
    assert!(
        d.log
            .iter()
            .take(100)
            .enumerate()
            .all(|(k, x)| x.at_ns == k as u64 * MS)
    );
}

#[test]
fn wild_respects_each_ceiling() {
    let mut d = Driver::new(PolicyKind::Wild, node());
    d.add(1, &on_demand(0, 100, 1));
    flood(&mut d, 1, 500);
    d.run_until(S);
    assert_eq!(d.count(1, 0, S), 100);
}

#[test]
fn wild_shares_spare_capacity_by_weight() {
    let mut d = Driver::new(PolicyKind::Wild, node());
    d.add(1, &on_demand(0, u64::MAX, 3));
    d.add(2, &on_demand(0, u64::MAX, 1));
    flood(&mut d, 1, 2_000);
    flood(&mut d, 2, 2_000);
    d.run_until(S - 1);
    assert_eq!((d.count(1, 0, S), d.count(2, 0, S)), (750, 250));
    // Weighted round robin: A A A B A A A B ...
    let order: Vec<u32> = d.log.iter().take(8).map(|x| x.req.volume).collect();
    assert_eq!(order, vec![1, 1, 1, 2, 1, 1, 1, 2]);
}

#[test]
fn wild_does_not_protect_a_baseline_and_burst_does() {
    // Victim: 600 IOPS sold, demanding 600/s, weight 1. Burster: weight 9, unlimited.
    let run = |kind| {
        let mut d = Driver::new(kind, node());
        d.add(1, &fixed(600, 1));
        d.add(2, &on_demand(0, u64::MAX, 9));
        flood(&mut d, 2, 3_000);
        d.run_with_demand(2 * S, &[(1, 600, OpKind::Read, 4096, c())]);
        (d.count(1, S, 2 * S), d.max_wait(1, S, 2 * S))
    };
    let (wild_victim, wild_wait) = run(PolicyKind::Wild);
    assert!(
        wild_victim <= 110,
        "wild gives the victim its round-robin share only: {wild_victim}"
    );
    assert!(wild_wait > 100 * MS, "and its queue grows: {wild_wait}");
    let (burst_victim, burst_wait) = run(PolicyKind::Burst);
    assert!(
        (599..=601).contains(&burst_victim),
        "burst keeps the baseline: {burst_victim}"
    );
    assert!(
        burst_wait < 2 * MS,
        "within a couple of request times: {burst_wait}"
    );
}

// ---------------------------------------------------------------------------------------- Base

#[test]
fn base_caps_every_volume_at_its_baseline_even_on_an_idle_node() {
    let mut d = Driver::new(PolicyKind::Base, node());
    d.add(1, &on_demand(200, 1_000, 1));
    flood(&mut d, 1, 1_000);
    d.run_until(2 * S);
    assert_eq!(d.count(1, 0, S), 200);
    assert_eq!(d.count(1, S, 2 * S), 200);
    assert_eq!(d.count_phase(1, Phase::Baseline, 0, 2 * S), 400);
}

#[test]
fn base_isolates_a_victim_from_a_flooding_neighbour() {
    let mut d = Driver::new(PolicyKind::Base, node());
    d.add(1, &fixed(600, 1));
    d.add(2, &fixed(300, 1));
    flood(&mut d, 2, 3_000);
    d.run_with_demand(2 * S, &[(1, 600, OpKind::Read, 4096, c())]);
    assert_eq!(d.count(1, S, 2 * S), 600);
    assert_eq!(d.count(2, S, 2 * S), 300);
    assert!(d.max_wait(1, 0, 2 * S) <= 2 * MS);
}

#[test]
fn base_applies_a_qos_change_immediately() {
    let mut d = Driver::new(PolicyKind::Base, node());
    d.add(1, &fixed(100, 1));
    flood(&mut d, 1, 1_000);
    d.run_until(S - 1);
    d.update(1, &fixed(400, 1));
    d.run_until(2 * S - 1);
    assert_eq!(d.count(1, 0, S), 100);
    // One 100-IOPS interval is still owed at the change (10 ms at 100/s = 2.5 ms at 400/s).
    assert!(
        (398..=400).contains(&d.count(1, S, 2 * S)),
        "{}",
        d.count(1, S, 2 * S)
    );
}

// -------------------------------------------------------------------------------------- Credit

#[test]
fn credit_bursts_while_credits_last_then_holds_the_baseline() {
    // Bucket 1,000, refill 100/s, ceiling 500: a full burst lasts 1,000 / (500 − 100) = 2.5 s.
    let mut d = Driver::new(PolicyKind::Credit, node());
    d.add(1, &credits(100, 500, 1_000));
    d.run_with_demand(
        5 * S,
        &[(
            1,
            1_000,
            OpKind::Read,
            4096,
            cost(1_000, OpKind::Read, 4096),
        )],
    );
    let per_s: Vec<usize> = (0..5).map(|s| d.count(1, s * S, (s + 1) * S)).collect();
    assert_eq!(per_s, vec![500, 500, 250 + 50, 100, 100]);
    // Above-baseline requests are labelled as paid by credits.
    assert_eq!(d.count_phase(1, Phase::Baseline, 0, S), 100);
    assert_eq!(d.count_phase(1, Phase::BurstCredit, 0, S), 400);
    assert_eq!(d.count_phase(1, Phase::BurstCredit, 3 * S, 5 * S), 0);
    assert_eq!(d.policy.snapshot(1).unwrap().iops_credits, Some(0));
}

#[test]
fn credit_qos_change_keeps_the_balance_instead_of_refilling() {
    let mut d = Driver::new(PolicyKind::Credit, node());
    d.add(1, &credits(100, 500, 1_000));
    d.run_with_demand(
        S,
        &[(1, 500, OpKind::Read, 4096, cost(1_000, OpKind::Read, 4096))],
    );
    let before = d.policy.snapshot(1).unwrap().iops_credits.unwrap();
    assert!((599..=601).contains(&before), "{before}");
    // QEMU would refill the whole burst here; we keep the balance.
    d.update(1, &credits(100, 800, 5_000));
    assert_eq!(d.policy.snapshot(1).unwrap().iops_credits, Some(before));
    // A smaller bucket clamps it.
    d.update(1, &credits(100, 800, 300));
    assert_eq!(d.policy.snapshot(1).unwrap().iops_credits, Some(300));
}

#[test]
fn credit_serves_baselines_before_bursts_on_a_saturated_node() {
    let mut d = Driver::new(PolicyKind::Credit, node());
    d.add(1, &fixed(600, 1));
    d.add(2, &credits(200, 1_000, 1_000_000));
    flood(&mut d, 2, 3_000);
    d.run_with_demand(2 * S, &[(1, 600, OpKind::Read, 4096, c())]);
    assert_eq!(d.count(1, S, 2 * S), 600);
    // The flooding volume gets its 200 baseline plus the 200 left over, paid by credits.
    let b = d.count(2, S, 2 * S);
    assert!((399..=401).contains(&b), "{b}");
    assert!(d.count_phase(2, Phase::Baseline, S, 2 * S) >= 199);
    assert!(d.max_wait(1, 0, 2 * S) <= 2 * MS);
}

// ------------------------------------------------------------------------- Credit: shared pools
//
// Pooled volumes below: baseline 100, ceiling 500, bucket 1,000 each (refill 100/s), demand
// 500/s of 1-us requests (the node never binds). Alone, such a volume bursts for
// 1,000 / (500 − 100) = 2.5 s.

fn demand(vol: u32) -> (u32, u64, OpKind, u32, CostVector) {
    (
        vol,
        500,
        OpKind::Read,
        4096,
        cost(1_000, OpKind::Read, 4096),
    )
}

fn balance(d: &Driver, vol: u32) -> u64 {
    match d.policy.snapshot(vol).and_then(|s| s.iops_credits) {
        Some(b) => b,
        None => panic!("volume {vol} has no IOPS credits"),
    }
}

#[test]
fn credit_pool_members_draining_together_last_half_as_long() {
    let mut d = Driver::new(PolicyKind::Credit, node());
    d.add(1, &pooled(100, 500, 1_000, 7));
    d.add(2, &pooled(100, 500, 1_000, 7));
    d.add(3, &credits(100, 500, 1_000));
    // One grant for the account (the first member's 1,000), refilled at 200/s: drained at
    // 1,000 − 200 = 800/s it lasts 1.25 s; volume 3's own bucket lasts 2.5 s.
    assert_eq!(
        (balance(&d, 1), balance(&d, 2), balance(&d, 3)),
        (1_000, 1_000, 1_000)
    );
    let all = [demand(1), demand(2), demand(3)];
    d.run_with_demand(1_200 * MS, &all);
    let b = balance(&d, 1);
    assert!((38..=42).contains(&b), "pool after 1.2 s: {b}");
    assert_eq!(balance(&d, 2), b, "members see one balance");
    d.run_with_demand(1_300 * MS, &all);
    assert_eq!(balance(&d, 1), 0);
    let own = balance(&d, 3);
    assert!((478..=482).contains(&own), "own bucket after 1.3 s: {own}");
    d.run_with_demand(2_400 * MS, &all);
    assert!(balance(&d, 3) > 0);
    d.run_with_demand(2_600 * MS, &all);
    assert_eq!(balance(&d, 3), 0);
    d.run_with_demand(5 * S, &all);
    // Both members burst at 500 until 1.25 s, then get their baselines (the pool's refill).
    let pool_rate = |from: u64, to: u64| d.count(1, from, to) + d.count(2, from, to);
    assert_eq!(pool_rate(0, S), 1_000);
    assert!(
        (198..=202).contains(&pool_rate(3 * S, 4 * S)),
        "{}",
        pool_rate(3 * S, 4 * S)
    );
    assert_eq!(d.count(1, 4 * S, 5 * S), 100);
    assert_eq!(d.count(2, 4 * S, 5 * S), 100);
    assert_eq!(d.count(3, 2 * S, 3 * S), 300);
    assert_eq!(d.count_phase(1, Phase::BurstCredit, 2 * S, 5 * S), 0);
}

#[test]
fn credit_pool_lends_an_idle_members_credits_to_a_busy_one() {
    let mut d = Driver::new(PolicyKind::Credit, node());
    d.add(1, &pooled(100, 500, 1_000, 7));
    d.add(2, &pooled(100, 500, 1_000, 7));
    d.add(3, &credits(100, 500, 1_000));
    // Volume 2 idles: its refill is volume 1's too. 1,000 / (500 − 200) = 3.33 s of burst,
    // then 200/s (its own baseline plus the idle member's), where volume 3 gets 100.
    d.run_with_demand(5 * S, &[demand(1), demand(3)]);
    assert_eq!(d.count(1, 0, 3 * S), 1_500);
    assert_eq!(d.count(3, 2 * S, 3 * S), 300);
    let busy = d.count(1, 4 * S, 5 * S);
    assert!((198..=202).contains(&busy), "{busy}");
    assert_eq!(d.count(3, 4 * S, 5 * S), 100);
    assert!(d.count_phase(1, Phase::BurstCredit, 4 * S, 5 * S) >= 98);
}

#[test]
fn credit_pool_member_keeps_its_baseline_when_a_sibling_floods() {
    let mut d = Driver::new(PolicyKind::Credit, node());
    // An empty pool of two members counting 4 KiB I/O units (refill 200 units/s in all).
    let mut empty = pooled(100, 3_000, 1_000, 7);
    empty.io_unit_bytes = 4096;
    if let BurstMode::Credits(c) = &mut empty.burst {
        c.iops = c.iops.map(|b| CreditBucketSpec {
            start_full: false,
            ..b
        });
    }
    d.add(1, &empty);
    d.add(2, &empty);
    // Volume 1 floods 1 MiB reads (256 units each): one of them admitted on a positive pool
    // balance leaves it 255 units (1.3 s of refill) in debt. Volume 2 asks for exactly its
    // baseline in 4 KiB reads and gets it without waiting for the pool: its baseline rests on
    // its own meter, not on what its sibling left in the pool.
    let big = cost(1_000, OpKind::Read, 1 << 20);
    d.enqueue(1, 200, OpKind::Read, 1 << 20, big);
    d.run_with_demand(
        5 * S,
        &[(2, 100, OpKind::Read, 4096, cost(1_000, OpKind::Read, 4096))],
    );
    for s in 1..5 {
        assert_eq!(d.count(2, s * S, (s + 1) * S), 100, "second {s}");
    }
    assert!(
        d.max_wait(2, 0, 5 * S) <= 10 * MS,
        "{}",
        d.max_wait(2, 0, 5 * S)
    );
    // Volume 1 gets the rest: its own baseline, 100 units/s = one 1 MiB read per 2.56 s.
    let flooder = d.count(1, S, 5 * S);
    assert!((1..=3).contains(&flooder), "{flooder}");
}

#[test]
fn credit_pool_replacement_volume_brings_no_credits() {
    for add_first in [false, true] {
        let mut d = Driver::new(PolicyKind::Credit, node());
        d.add(1, &pooled(100, 500, 1_000, 7));
        d.add(2, &pooled(100, 500, 1_000, 7));
        // 1 s at 500/s from volume 1: 1,000 − 500 + 200 = 700.
        d.run_with_demand(S, &[demand(1)]);
        let before = balance(&d, 2);
        assert!((699..=701).contains(&before), "{before}");
        // Replace volume 1 by volume 4 (a fresh volume whose bucket would start full).
        if add_first {
            d.add(4, &pooled(100, 500, 1_000, 7));
            d.remove(1);
        } else {
            d.remove(1);
            d.add(4, &pooled(100, 500, 1_000, 7));
        }
        assert_eq!(balance(&d, 4), before, "add_first {add_first}");
        assert_eq!(balance(&d, 2), before);
        // Unpooled, the same fresh volume gets a whole bucket: the hole the pool closes.
        d.add(5, &credits(100, 500, 1_000));
        assert_eq!(balance(&d, 5), 1_000);
    }
}

#[test]
fn credit_pool_outlives_its_members() {
    let mut d = Driver::new(PolicyKind::Credit, node());
    d.add(1, &pooled(100, 500, 1_000, 7));
    d.add(2, &pooled(100, 500, 1_000, 7));
    assert_eq!(balance(&d, 1), 1_000);
    d.remove(1);
    d.remove(2);
    // No member: capacity 0, balance 0, and no refill however long.
    d.run_until(100 * S);
    d.add(1, &pooled(100, 500, 1_000, 7));
    d.add(2, &pooled(100, 500, 1_000, 7));
    assert_eq!(balance(&d, 1), 0);
    d.run_until(101 * S);
    assert_eq!(balance(&d, 2), 200);
    // Another pool id is another account: granted once, on its own.
    d.add(3, &pooled(100, 500, 1_000, 8));
    assert_eq!(balance(&d, 3), 1_000);
}

#[test]
fn credit_pool_qos_change_keeps_the_balance() {
    let mut d = Driver::new(PolicyKind::Credit, node());
    d.add(1, &pooled(100, 500, 1_000, 7));
    d.add(2, &pooled(100, 500, 1_000, 7));
    d.run_with_demand(S, &[demand(1)]);
    let before = balance(&d, 1);
    assert!((699..=701).contains(&before), "{before}");
    // A larger bucket (capacity 6,000): kept, not refilled.
    d.update(1, &pooled(100, 800, 5_000, 7));
    assert_eq!(balance(&d, 1), before);
    // Smaller, but still above the balance (capacity 1,100): kept.
    d.update(1, &pooled(100, 800, 100, 7));
    assert_eq!(balance(&d, 2), before);
    // Capacity 200: clamped.
    d.update(2, &pooled(100, 500, 100, 7));
    assert_eq!(balance(&d, 1), 200);
    // A faster refill counts from the change: 100 + 300 per second.
    d.update(1, &pooled(100, 800, 5_000, 7));
    d.update(1, &pooled(300, 800, 5_000, 7));
    d.run_until(d.now + S);
    assert_eq!(balance(&d, 2), 600);
    // Leaving the pool by a QoS change: own bucket, empty; the pool loses its share.
    d.update(1, &credits(300, 800, 5_000));
    assert_eq!(balance(&d, 1), 0);
    assert_eq!(balance(&d, 2), 100);
    // Joining one brings no credits either.
    d.update(1, &pooled(100, 500, 1_000, 7));
    assert_eq!(balance(&d, 1), 100);
}

// --------------------------------------------------------------------------------------- Burst

#[test]
fn burst_lends_spare_capacity_but_keeps_the_reserve() {
    let mut d = Driver::new(PolicyKind::Burst, node());
    d.add(1, &on_demand(0, u64::MAX, 1));
    flood(&mut d, 1, 3_000);
    d.run_until(2 * S);
    // 5 % of the node is held back for fast recovery: 950 of 1,000 requests per second.
    let n = d.count(1, S, 2 * S);
    assert!((949..=951).contains(&n), "{n}");
    assert_eq!(d.count_phase(1, Phase::BurstSpare, S, 2 * S), n);
}

#[test]
fn burst_gives_a_waking_volume_its_baseline_at_once() {
    let params = PolicyParams::default();
    let mut d = Driver::with_params(PolicyKind::Burst, node(), &params);
    d.add(1, &fixed(300, 1));
    d.add(2, &on_demand(0, u64::MAX, 1));
    flood(&mut d, 2, 5_000);
    // The victim is idle for 100 windows, then demands its baseline.
    d.run_until(S);
    let start = d.now;
    d.run_with_demand(start + S, &[(1, 300, OpKind::Read, 4096, c())]);
    assert_eq!(d.count(1, start, start + S), 300);
    // No throttling on wake-up: every request runs within about one request time.
    assert!(
        d.max_wait(1, start, start + S) <= 2 * MS,
        "{}",
        d.max_wait(1, start, start + S)
    );
    // Burster keeps the rest: 1,000 − 300 = 700 per second.
    let b = d.count(2, start, start + S);
    assert!((698..=702).contains(&b), "{b}");
    assert!(params.window_ns < S);
}

#[test]
fn burst_without_burst_mode_stays_at_baseline() {
    let mut d = Driver::new(PolicyKind::Burst, node());
    d.add(1, &fixed(250, 1));
    flood(&mut d, 1, 1_000);
    d.run_until(S - 1);
    assert_eq!(d.count(1, 0, S), 250);
    assert_eq!(d.count_phase(1, Phase::Baseline, 0, S), 250);
}

#[test]
fn burst_with_credits_bursts_only_while_credits_last() {
    let mut d = Driver::new(PolicyKind::Burst, node());
    d.add(1, &credits(100, 500, 1_000));
    d.run_with_demand(
        4 * S,
        &[(
            1,
            1_000,
            OpKind::Read,
            4096,
            cost(1_000, OpKind::Read, 4096),
        )],
    );
    let per_s: Vec<usize> = (0..4).map(|s| d.count(1, s * S, (s + 1) * S)).collect();
    assert_eq!(per_s, vec![500, 500, 300, 100]);
    assert_eq!(d.count_phase(1, Phase::BurstCredit, 0, S), 400);
}

// ------------------------------------------------------------------ Credit and Burst: restore
//
// The server persists credit balances and restores them after a restart
// (`Policy::restore_credits`). Every step below also checks every invariant (the driver runs
// `check_invariants` after each call, with per-volume tracking on).

const GIB: u64 = 1 << 30;

/// A 100 GiB gp2 volume: baseline 300 IOPS, bucket of 5.4 M credits, full at creation.
fn gp2() -> VolumeQos {
    headroom_qos::presets::volume_qos("gp2", 100 * GIB).expect("gp2 preset")
}

/// [`gp2`] with a bucket that starts empty.
fn gp2_starting_empty() -> VolumeQos {
    let mut q = gp2();
    if let BurstMode::Credits(CreditSpec { iops: Some(b), .. }) = &mut q.burst {
        b.start_full = false;
    }
    q
}

#[test]
fn restore_credits_sets_each_own_bucket_within_its_capacity() {
    let tracked = PolicyParams {
        track_invariants: true,
        ..PolicyParams::default()
    };
    for kind in [PolicyKind::Credit, PolicyKind::Burst] {
        let mut d = Driver::with_params(kind, node(), &tracked);
        d.add(1, &gp2());
        d.add(2, &gp2_starting_empty());
        assert_eq!(balance(&d, 1), 5_400_000, "{kind}");
        assert_eq!(balance(&d, 2), 0, "{kind}");
        d.restore(1, Some(1_000), None);
        assert_eq!(balance(&d, 1), 1_000, "{kind}");
        // Never beyond the capacity.
        d.restore(1, Some(5_400_001), None);
        assert_eq!(balance(&d, 1), 5_400_000, "{kind}");
        d.restore(1, Some(u64::MAX), Some(u64::MAX));
        assert_eq!(balance(&d, 1), 5_400_000, "{kind}");
        // A bucket that started empty is set too.
        d.restore(2, Some(500), None);
        assert_eq!(balance(&d, 2), 500, "{kind}");
        // `None` leaves a bucket alone; gp2 has no bytes bucket, so a bytes value is ignored.
        d.restore(2, None, Some(7));
        let s = d.policy.snapshot(2).expect("volume 2");
        assert_eq!(
            (s.iops_credits, s.bytes_credits),
            (Some(500), None),
            "{kind}"
        );
        // The restored level refills at the bucket's rate (300/s) from there.
        d.run_until(2 * S);
        assert_eq!(balance(&d, 2), 500 + 2 * 300, "{kind}");
        // An unknown volume: nothing happens, and it is not registered.
        d.restore(9, Some(1), Some(1));
        assert!(d.policy.snapshot(9).is_none(), "{kind}");
    }
}

#[test]
fn a_credit_volume_bursts_exactly_on_its_restored_credits() {
    // Baseline 100, no ceiling, bucket 1,000 refilled at 100/s; the node never binds. At one
    // instant the baseline meter admits one request and every other one runs on credits, on
    // any positive balance: the credits restored are exactly the requests that run.
    let q = VolumeQos {
        ceiling: IoRate::UNLIMITED,
        ..credits(100, 500, 1_000)
    };
    let mut d = Driver::new(PolicyKind::Credit, NodeCapacity::UNLIMITED);
    d.add(1, &q);
    d.add(2, &q);
    d.restore(1, Some(10), None);
    flood(&mut d, 1, 2_000);
    flood(&mut d, 2, 2_000);
    let wake = d.drain();
    assert_eq!(d.count_phase(1, Phase::Baseline, 0, 1), 1);
    assert_eq!(d.count_phase(1, Phase::BurstCredit, 0, 1), 9);
    assert_eq!(balance(&d, 1), 0);
    // Not restored: the full bucket of 1,000.
    assert_eq!(d.count(2, 0, 1), 1_000);
    // Both wait for the first nanosecond of refill.
    assert_eq!(wake, Some(1));
    // Restored while it waits for credits, the volume runs on them at once.
    d.restore(1, Some(5), None);
    assert_eq!(d.drain(), Some(1));
    assert_eq!(d.count_phase(1, Phase::BurstCredit, 0, 1), 14);
    // From then on it runs at the refill, its baseline: at 1 ns + k × 10 ms.
    d.run_until(S);
    let times: Vec<u64> = d
        .log
        .iter()
        .filter(|x| x.req.volume == 1 && x.at_ns > 0)
        .map(|x| x.at_ns)
        .collect();
    let expected: Vec<u64> = (0..100).map(|k| 1 + k * 10 * MS).collect();
    assert_eq!(times, expected);
}

#[test]
fn restore_credits_leaves_pools_and_policies_without_buckets_alone() {
    // Pools are not persisted: a member's restore changes nothing.
    let mut d = Driver::new(PolicyKind::Credit, node());
    d.add(1, &pooled(100, 500, 1_000, 7));
    d.add(2, &pooled(100, 500, 1_000, 7));
    assert_eq!(balance(&d, 1), 1_000);
    d.restore(1, Some(5), None);
    d.restore(2, Some(2_000), None);
    assert_eq!((balance(&d, 1), balance(&d, 2)), (1_000, 1_000));
    // Policies without credit buckets: a no-op.
    for kind in [
        PolicyKind::Wild,
        PolicyKind::Base,
        PolicyKind::MClock,
        PolicyKind::DrrVop,
    ] {
        let mut d = Driver::new(kind, node());
        d.add(1, &gp2());
        d.restore(1, Some(5), Some(5));
        let s = d.policy.snapshot(1).expect("volume 1");
        assert_eq!((s.iops_credits, s.bytes_credits), (None, None), "{kind}");
    }
}

// -------------------------------------------------------------------------------------- mClock

#[test]
fn mclock_meets_reservations_and_shares_the_rest_by_weight() {
    let mut d = Driver::new(PolicyKind::MClock, node());
    d.add(1, &on_demand(600, u64::MAX, 1));
    d.add(2, &on_demand(100, u64::MAX, 1));
    flood(&mut d, 1, 3_000);
    flood(&mut d, 2, 3_000);
    d.run_until(2 * S);
    let (a, b) = (d.count(1, S, 2 * S), d.count(2, S, 2 * S));
    // Reservations first (600 + 100); the proportional tags of both advance with all service,
    // so the 300 left go to the volume behind in proportional share: B.
    assert!((599..=601).contains(&a), "{a}");
    assert!((399..=401).contains(&b), "{b}");
    assert_eq!(d.count_phase(1, Phase::Baseline, S, 2 * S), a);
}

#[test]
fn mclock_splits_by_weight_and_honours_limits() {
    let mut d = Driver::new(PolicyKind::MClock, node());
    d.add(1, &on_demand(0, u64::MAX, 2));
    d.add(2, &on_demand(0, u64::MAX, 1));
    d.add(3, &on_demand(0, 100, 4));
    flood(&mut d, 1, 3_000);
    flood(&mut d, 2, 3_000);
    flood(&mut d, 3, 3_000);
    d.run_until(2 * S);
    // Volume 3 is held at its 100 limit; 900 left split 2:1.
    assert_eq!(d.count(3, S, 2 * S), 100);
    let (a, b) = (d.count(1, S, 2 * S), d.count(2, S, 2 * S));
    assert!(
        (598..=602).contains(&a) && (298..=302).contains(&b),
        "{a} {b}"
    );
}

#[test]
fn mclock_idle_volume_earns_no_credit() {
    let mut d = Driver::new(PolicyKind::MClock, node());
    d.add(1, &on_demand(0, 100, 1));
    d.run_until(5 * S);
    flood(&mut d, 1, 1_000);
    let t = d.now;
    d.run_until(t + 100 * MS - 1);
    // 100 ms at 100/s: 10 requests, not the 500 five idle seconds would have "saved".
    assert_eq!(d.count(1, t, t + 100 * MS), 10);
}

#[test]
fn mclock_limit_change_is_retimed_not_refilled() {
    let mut d = Driver::new(PolicyKind::MClock, node());
    d.add(1, &on_demand(0, 10, 1));
    flood(&mut d, 1, 1_000);
    d.run_until(S - 1);
    assert_eq!(d.count(1, 0, S), 10);
    d.update(1, &on_demand(0, 500, 1));
    d.run_until(2 * S - 1);
    let n = d.count(1, S, 2 * S);
    assert!((499..=500).contains(&n), "{n}");
}

// ------------------------------------------------------------------------------------- DRR-VOP

fn vop_node() -> NodeCapacity {
    NodeCapacity::new(CostVector::new(u64::MAX, u64::MAX, u64::MAX, 1_000_000))
}

#[test]
fn drr_vop_is_fair_in_device_units_not_in_iops() {
    let small = CostVector::new(0, 0, 4096, 100);
    let large = CostVector::new(0, 0, 131_072, 1_000);
    let params = PolicyParams {
        drr_quantum_device_units: 1_000,
        ..PolicyParams::default()
    };
    let mut d = Driver::with_params(PolicyKind::DrrVop, vop_node(), &params);
    d.add(1, &on_demand(0, u64::MAX, 1));
    d.add(2, &on_demand(0, u64::MAX, 1));
    d.enqueue(1, 20_000, OpKind::Read, 4096, small);
    d.enqueue(2, 2_000, OpKind::Read, 131_072, large);
    d.run_until(S - 1);
    let units = |v| {
        d.log
            .iter()
            .filter(|x| x.req.volume == v)
            .map(|x| x.req.cost.device_units)
            .sum::<u64>()
    };
    let (a, b) = (units(1), units(2));
    assert!(a.abs_diff(b) <= 2_000, "{a} vs {b}");
    // So the small-request volume runs ten times the IOPS.
    let (na, nb) = (d.count(1, 0, S), d.count(2, 0, S));
    assert!(na >= 9 * nb, "{na} vs {nb}");
}

#[test]
fn drr_vop_stays_fair_in_device_units_when_requests_exceed_the_quantum() {
    // Both request sizes cost more than the 1,000-unit quantum (the simulator's case: IOCost
    // units of a 256 KiB write against the default quantum). Raising each volume's quantum to
    // its own largest request gave equal IOPS (3,200 vs 12,800 units per turn); the node-wide
    // raise keeps equal device units.
    let small = CostVector::new(0, 0, 4096, 3_200);
    let large = CostVector::new(0, 0, 131_072, 12_800);
    let params = PolicyParams {
        drr_quantum_device_units: 1_000,
        ..PolicyParams::default()
    };
    let mut d = Driver::with_params(PolicyKind::DrrVop, vop_node(), &params);
    d.add(1, &on_demand(0, u64::MAX, 1));
    d.add(2, &on_demand(0, u64::MAX, 1));
    d.enqueue(1, 20_000, OpKind::Read, 4096, small);
    d.enqueue(2, 5_000, OpKind::Read, 131_072, large);
    d.run_until(S - 1);
    let units = |v| {
        d.log
            .iter()
            .filter(|x| x.req.volume == v)
            .map(|x| x.req.cost.device_units)
            .sum::<u64>()
    };
    let (a, b) = (units(1), units(2));
    assert!(a > 0 && b > 0);
    // Within one turn (one quantum of 12,800 units, plus one large request) of each other.
    assert!(a.abs_diff(b) <= 2 * 12_800, "{a} vs {b}");
    let (na, nb) = (d.count(1, 0, S), d.count(2, 0, S));
    assert!(na >= 3 * nb, "{na} vs {nb}");
}

#[test]
fn drr_vop_weights_and_ceilings() {
    let r = CostVector::new(0, 0, 4096, 100);
    let params = PolicyParams {
        drr_quantum_device_units: 100,
        ..PolicyParams::default()
    };
    let mut d = Driver::with_params(PolicyKind::DrrVop, vop_node(), &params);
    d.add(1, &on_demand(0, u64::MAX, 3));
    d.add(2, &on_demand(0, u64::MAX, 1));
    d.add(3, &on_demand(0, 1_000, 8));
    for v in 1..=3 {
        d.enqueue(v, 12_000, OpKind::Read, 4096, r);
    }
    d.run_until(S - 1);
    // 10,000 requests fit; volume 3 is capped at 1,000, the other 9,000 split 3:1.
    assert_eq!(d.count(3, 0, S), 1_000);
    let (a, b) = (d.count(1, 0, S), d.count(2, 0, S));
    assert!(
        a.abs_diff(6_750) <= 10 && b.abs_diff(2_250) <= 10,
        "{a} {b}"
    );
}

// ------------------------------------------------------------------------------- all policies

#[test]
fn every_policy_handles_unknown_volumes_removal_and_bad_qos_without_panicking() {
    for kind in PolicyKind::ALL {
        let mut d = Driver::new(kind, node());
        // Unknown volume: registered best effort (Base gives best effort nothing).
        flood(&mut d, 7, 5);
        d.run_until(10 * MS);
        let expected = if kind == PolicyKind::Base { 0 } else { 5 };
        assert_eq!(d.count(7, 0, S), expected, "{kind}");
        // Removal drops queued requests and keeps the accounting straight.
        d.add(8, &fixed(1, 1));
        flood(&mut d, 8, 10);
        d.remove(8);
        assert!(d.policy.snapshot(8).is_none());
        // An inconsistent QoS (baseline above ceiling, zero weight) must not panic.
        d.check = false;
        let bad = VolumeQos {
            baseline: IoRate::new(1_000, 1),
            ceiling: IoRate::new(10, 0),
            weight: 0,
            ..VolumeQos::default()
        };
        d.add(9, &bad);
        flood(&mut d, 9, 10);
        d.run_until(d.now + S);
        // Time going backwards is treated as the last time seen.
        d.now = 0;
        let _ = d.drain();
        assert_eq!(d.policy.name(), kind.as_str());
    }
}

// --------------------------------------------------------------------------- capacity changes

/// A volume that can use the whole node under `kind` (Base caps at the baseline, so its
/// baseline is above the node's capacity).
fn node_filler(kind: PolicyKind) -> VolumeQos {
    if kind == PolicyKind::Base {
        fixed(10_000, 1)
    } else {
        on_demand(0, u64::MAX, 1)
    }
}

/// Requests per second a flooding volume gets at `per_s` requests per second of capacity
/// (Burst keeps its 5 % reserve out of bursts), and the tolerance.
fn filled(kind: PolicyKind, per_s: usize) -> std::ops::RangeInclusive<usize> {
    let n = if kind == PolicyKind::Burst {
        per_s * 95 / 100
    } else {
        per_s
    };
    n - 2..=n + 2
}

#[test]
fn every_policy_follows_a_capacity_change_at_once() {
    for kind in PolicyKind::ALL {
        let mut d = Driver::new(kind, node());
        d.add(1, &node_filler(kind));
        flood(&mut d, 1, 6_000);
        d.run_until(S);
        assert!(filled(kind, 1_000).contains(&d.count(1, 0, S)), "{kind}");
        // Halved: 500 requests per second from now on, no burst of saved-up capacity.
        d.set_capacity(cpu_capacity(500_000_000));
        d.run_until(2 * S);
        let n = d.count(1, S, 2 * S);
        assert!(filled(kind, 500).contains(&n), "{kind}: halved {n}");
        // The first 10 ms after the change already run at the new rate.
        let first = d.count(1, S, S + 10 * MS);
        assert!(first <= 6, "{kind}: {first} in the first 10 ms");
        // Doubled: 2,000 per second.
        d.set_capacity(cpu_capacity(2_000_000_000));
        d.run_until(3 * S);
        let n = d.count(1, 2 * S, 3 * S);
        assert!(filled(kind, 2_000).contains(&n), "{kind}: doubled {n}");
    }
}

#[test]
fn every_policy_treats_the_same_capacity_again_as_a_no_op() {
    let params = PolicyParams {
        pacer_depth_ns: MS,
        ..PolicyParams::default()
    };
    for kind in PolicyKind::ALL {
        let run = |again: bool| {
            let mut d = Driver::with_params(kind, node(), &params);
            d.add(1, &node_filler(kind));
            d.add(2, &credits(100, 400, 500));
            d.add(3, &fixed(200, 2));
            for vol in 1..=3 {
                flood(&mut d, vol, 1_000);
            }
            for step in 1..=300u64 {
                d.run_until(step * 3 * MS + 7);
                if again {
                    d.set_capacity(node());
                }
            }
            d.log
                .iter()
                .map(|x| (x.at_ns, x.req.id, x.phase))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(true), run(false), "{kind}");
    }
}

#[test]
fn node_pacer_keeps_its_debt_across_a_capacity_change() {
    // Each 100 ms request (10 % of the node for one second) leaves the pacer 100 ms deeper in
    // debt. A request that has to wait for all of it finds 100 ms of debt at 0 and, at half
    // the capacity from 50 ms on, runs at 150 ms: the change neither forgives nor refills
    // anything. (A baseline far above the node: only the node pacer holds them back. Where the
    // policy lets a baseline request run inside one request's debt, the second runs at once,
    // or as soon as it counts as such, at the change, and the third is the one that waits
    // until 150 ms; where not, the second waits.)
    for kind in PolicyKind::ALL {
        let mut d = Driver::new(kind, node());
        d.add(1, &fixed(10_000, 1));
        for id in 2..5 {
            d.enqueue(
                1,
                id,
                OpKind::Read,
                4096,
                cost(100 * REQ_CPU_NS, OpKind::Read, 4096),
            );
        }
        d.run_until(1);
        let at_once = d.count(1, 0, 1);
        assert!((1..=2).contains(&at_once), "{kind}: {at_once}");
        d.now = 50 * MS;
        d.set_capacity(cpu_capacity(500_000_000));
        d.run_until(S);
        // 50 ms repaid at the old rate, the remaining 50 ms of debt at half the rate: nothing
        // runs after the change before 150 ms, and one request runs then.
        let times: Vec<u64> = d.log.iter().map(|x| x.at_ns).collect();
        assert!(
            times.iter().all(|&t| t <= 50 * MS || t >= 150 * MS),
            "{kind}: {times:?}"
        );
        assert!(times.contains(&(150 * MS)), "{kind}: {times:?}");
    }
}

#[test]
fn burst_throughput_follows_a_halved_capacity_within_the_reserve() {
    let mut d = Driver::new(PolicyKind::Burst, node());
    d.add(1, &on_demand(0, u64::MAX, 1));
    d.add(2, &on_demand(0, u64::MAX, 3));
    flood(&mut d, 1, 5_000);
    flood(&mut d, 2, 5_000);
    d.run_until(S);
    d.set_capacity(cpu_capacity(500_000_000));
    d.run_until(3 * S);
    // Every window from the next one on: at most 95 % of the new capacity for bursts.
    for w in 0..200u64 {
        let from = S + (w + 1) * 10 * MS;
        let n = d.count(1, from, from + 10 * MS) + d.count(2, from, from + 10 * MS);
        assert!(n <= 5, "window {w} after the change: {n} requests");
    }
    let n = d.count(1, 2 * S, 3 * S) + d.count(2, 2 * S, 3 * S);
    assert!((473..=477).contains(&n), "{n}");
    // Lending follows usage and weight: neither burster is starved.
    assert!(d.count(1, 2 * S, 3 * S) > 50 && d.count(2, 2 * S, 3 * S) > 50);
}

#[test]
fn burst_gives_bursters_more_when_the_capacity_doubles() {
    let mut d = Driver::new(PolicyKind::Burst, node());
    d.add(1, &fixed(300, 1));
    d.add(2, &on_demand(0, u64::MAX, 1));
    flood(&mut d, 2, 10_000);
    let start = d.now;
    d.run_with_demand(start + S, &[(1, 300, OpKind::Read, 4096, c())]);
    let before = d.count(2, S / 2, S);
    d.set_capacity(cpu_capacity(2_000_000_000));
    d.run_with_demand(start + 2 * S, &[(1, 300, OpKind::Read, 4096, c())]);
    let after = d.count(2, S + S / 2, 2 * S);
    // 700 per second before, 1,700 (2,000 less the baseline) after; half a second each.
    assert!((348..=352).contains(&before), "{before}");
    assert!((848..=852).contains(&after), "{after}");
    assert_eq!(d.count(1, S, 2 * S), 300);
}

#[test]
fn burst_meets_the_baseline_when_the_new_capacity_covers_it() {
    let mut d = Driver::new(PolicyKind::Burst, node());
    d.add(1, &fixed(300, 1));
    d.add(2, &on_demand(0, u64::MAX, 1));
    flood(&mut d, 2, 10_000);
    let demand = [(1, 300, OpKind::Read, 4096, c())];
    d.run_with_demand(S, &demand);
    // Halved: 500 per second still covers the 300 sold.
    d.set_capacity(cpu_capacity(500_000_000));
    d.run_with_demand(2 * S, &demand);
    assert_eq!(d.count(1, S, 2 * S), 300);
    // Within about one request time at the new capacity (2 ms) behind the burst in progress.
    assert!(
        d.max_wait(1, S, 2 * S) <= 4 * MS,
        "{}",
        d.max_wait(1, S, 2 * S)
    );
    let b = d.count(2, S + 100 * MS, 2 * S);
    assert!((178..=182).contains(&b), "{b}");
    // Over-provisioned for half a second (200 per second, below the 300 sold): not
    // guaranteed, and no invariant claims it is ...
    d.set_capacity(cpu_capacity(200_000_000));
    d.run_with_demand(2 * S + S / 2, &demand);
    let starved = d.count(1, 2 * S, 2 * S + S / 2);
    assert!(starved <= 101, "{starved}");
    // ... then covered again: the baseline is met again, with the backlog forgiven by the
    // invariant but served by the scheduler as capacity allows.
    d.set_capacity(cpu_capacity(500_000_000));
    d.run_with_demand(4 * S, &demand);
    assert_eq!(d.count(1, 3 * S + S / 2, 4 * S), 150);
}

#[test]
fn mclock_meets_reservations_after_a_capacity_cut_that_covers_them() {
    let mut d = Driver::new(PolicyKind::MClock, node());
    d.add(1, &on_demand(300, u64::MAX, 1));
    d.add(2, &on_demand(100, u64::MAX, 1));
    flood(&mut d, 1, 5_000);
    flood(&mut d, 2, 5_000);
    d.run_until(S);
    d.set_capacity(cpu_capacity(500_000_000));
    d.run_until(3 * S);
    let (a, b) = (d.count(1, 2 * S, 3 * S), d.count(2, 2 * S, 3 * S));
    // Reservations (300 + 100) first, the 100 left by proportional share.
    assert!(
        a >= 299 && b >= 99 && (499..=501).contains(&(a + b)),
        "{a} {b}"
    );
}

#[test]
fn a_bursters_own_baseline_does_not_spend_its_neighbours_pacer_allowance() {
    // A burster with large requests (10 ms of the node each) and a 30 % baseline, next to a
    // victim well within its baseline (97 small requests a second, so that its arrivals do not
    // line up with the burster's requests). The burster's baseline
    // requests are baseline too; were they to run inside the node pacer's allowance (the
    // debt of one, the largest, request), each would leave the pacer a whole large request in
    // debt beyond it, and the victim's next request would wait for that debt to be repaid.
    // The server's parameters: a node pacer that may run 1 ms ahead.
    let params = PolicyParams {
        pacer_depth_ns: MS,
        ..PolicyParams::default()
    };
    for kind in [PolicyKind::Burst, PolicyKind::Credit] {
        let mut d = Driver::with_params(kind, node(), &params);
        // Credit bursts on credits: a bucket that lasts the whole run.
        let qos = if kind == PolicyKind::Credit {
            credits(30, 10_000, 1_000_000)
        } else {
            on_demand(30, u64::MAX, 1)
        };
        d.add(1, &qos);
        d.add(2, &fixed(200, 1));
        d.enqueue(
            1,
            5_000,
            OpKind::Read,
            128 << 10,
            cost(10 * REQ_CPU_NS, OpKind::Read, 128 << 10),
        );
        d.run_with_demand(2 * S, &[(2, 97, OpKind::Read, 4096, c())]);
        let burster = d.count(1, S, 2 * S);
        let waited = d.max_wait(2, S, 2 * S);
        eprintln!("{kind}: burster {burster} requests/s, victim waited at most {waited} ns");
        assert!(d.count(2, S, 2 * S) >= 96, "{kind}");
        assert!(
            burster >= 85,
            "{kind}: the burster keeps the node's spare capacity: {burster}"
        );
        assert!(
            waited <= 2 * REQ_CPU_NS,
            "{kind}: victim waited {waited} ns"
        );
    }
}
