//! Property tests: random sequences of enqueue / next / complete / QoS change / time advance
//! (and, in the `*_under_capacity_changes` variants, capacity changes at random times), with
//! every invariant checked after every step, for every policy.

mod common;
mod replay;

use common::MS;
use headroom_qos::{
    BurstMode, CostVector, CreditBucketSpec, CreditSpec, IoRate, NodeCapacity, PolicyKind,
    PolicyParams, VolumeQos,
};
use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, RngSeed};
use replay::{Op, SHAPES, run};

fn qos_strategy() -> impl Strategy<Value = VolumeQos> {
    (
        0u64..=400,
        prop_oneof![Just(None), (0u64..2_000).prop_map(Some)],
        0u64..=(32 << 20),
        prop_oneof![Just(None), (0u64..(256 << 20)).prop_map(Some)],
        0u8..3,
        (1u64..5_000, 0u64..200, any::<bool>(), any::<bool>()),
        1u32..8,
        prop_oneof![Just(0u32), Just(4_096u32), Just(256 * 1024u32)],
    )
        .prop_map(
            |(
                b_iops,
                extra_iops,
                b_bytes,
                extra_bytes,
                mode,
                (cap, extra_refill, full, bytes_bucket),
                weight,
                unit,
            )| {
                let baseline = IoRate::new(b_iops, b_bytes);
                let ceiling = IoRate::new(
                    extra_iops.map_or(u64::MAX, |e| b_iops + e),
                    extra_bytes.map_or(u64::MAX, |e| b_bytes + e),
                );
                let burst = match mode {
                    0 => BurstMode::None,
                    1 => BurstMode::OnDemand,
                    _ => BurstMode::Credits(CreditSpec {
                        iops: Some(CreditBucketSpec {
                            capacity: cap,
                            refill_per_s: b_iops + extra_refill,
                            start_full: full,
                        }),
                        bytes: bytes_bucket.then_some(CreditBucketSpec {
                            capacity: cap << 16,
                            refill_per_s: b_bytes + (extra_refill << 12),
                            start_full: full,
                        }),
                        pool: None,
                    }),
                };
                let q = VolumeQos {
                    baseline,
                    ceiling,
                    burst,
                    weight,
                    io_unit_bytes: unit,
                };
                assert!(q.validate().is_ok(), "{q:?}");
                q
            },
        )
}

/// [`qos_strategy`], with credit volumes put in one of two shared credit pools (or none), so
/// that pools see members join, leave, change QoS and differ in buckets and baselines.
fn pooled_qos_strategy() -> impl Strategy<Value = VolumeQos> {
    (
        qos_strategy(),
        prop_oneof![Just(None), (0u32..2).prop_map(Some)],
    )
        .prop_map(|(mut q, pool)| {
            if let BurstMode::Credits(c) = &mut q.burst {
                c.pool = pool;
            }
            q
        })
}

fn op_strategy() -> impl Strategy<Value = Op> {
    ops_with(qos_strategy().boxed())
}

fn pooled_op_strategy() -> impl Strategy<Value = Op> {
    ops_with(pooled_qos_strategy().boxed())
}

fn ops_with(qos: BoxedStrategy<VolumeQos>) -> impl Strategy<Value = Op> {
    let vol = 0u32..6;
    prop_oneof![
        2 => (vol.clone(), qos.clone()).prop_map(|(v, q)| Op::Add(v, q)),
        1 => (vol.clone(), qos).prop_map(|(v, q)| Op::Update(v, q)),
        1 => vol.clone().prop_map(Op::Remove),
        6 => (vol, 1usize..12, 0usize..SHAPES.len()).prop_map(|(v, n, s)| Op::Enqueue(v, n, s)),
        4 => (0u64..(30 * MS)).prop_map(Op::Advance),
    ]
}

/// [`op_strategy`] plus capacity changes at random times.
fn capacity_op_strategy() -> impl Strategy<Value = Op> {
    capacity_ops_with(qos_strategy().boxed())
}

/// [`pooled_op_strategy`] plus capacity changes at random times.
fn pooled_capacity_op_strategy() -> impl Strategy<Value = Op> {
    capacity_ops_with(pooled_qos_strategy().boxed())
}

fn capacity_ops_with(qos: BoxedStrategy<VolumeQos>) -> impl Strategy<Value = Op> {
    // Mostly a uniform scale (the node moves a share), sometimes per dimension, sometimes
    // the same capacity again (a no-op) or an unlimited dimension.
    let factor = prop_oneof![
        2 => Just(1_000u32),
        6 => 50u32..4_000,
        1 => Just(u32::MAX),
    ];
    let scale = prop_oneof![
        3 => (50u32..4_000).prop_map(|f| [f; 4]),
        1 => Just([1_000u32; 4]),
        2 => [factor.clone(), factor.clone(), factor.clone(), factor],
    ];
    prop_oneof![
        14 => ops_with(qos),
        3 => scale.prop_map(Op::SetCapacity),
    ]
}

fn capacity_strategy() -> impl Strategy<Value = NodeCapacity> {
    prop_oneof![
        Just(NodeCapacity::new(CostVector::new(
            1_000_000_000,
            4_000_000_000,
            4_000_000_000,
            u64::MAX
        ))),
        Just(NodeCapacity::new(CostVector::new(
            200_000_000,
            400_000_000,
            400_000_000,
            2_000_000_000
        ))),
        Just(NodeCapacity::new(CostVector::new(
            20_000_000,
            50_000_000,
            50_000_000,
            300_000_000
        ))),
    ]
}

fn params_strategy() -> impl Strategy<Value = PolicyParams> {
    (
        prop_oneof![Just(1_000_000u64), Just(10_000_000u64)],
        prop_oneof![Just(0u64), Just(1_000_000u64), Just(10_000_000u64)],
        1u32..10,
        1_000u32..2_000,
        0u32..4_000,
        0u32..100,
        any::<u64>(),
        // The server's node pacer saves up 1 ms; the simulator's none.
        prop_oneof![Just(0u64), Just(1_000_000u64)],
        // Requests may run ahead of their volume's head (the default) or not.
        prop_oneof![Just(0u32), Just(1u32), Just(16u32)],
    )
        .prop_map(
            |(
                window_ns,
                limiter_depth_ns,
                history_windows,
                alpha_permille,
                throttle_weight_permille,
                reserve_permille,
                seed,
                pacer_depth_ns,
                reorder_lookahead,
            )| {
                PolicyParams {
                    window_ns,
                    limiter_depth_ns,
                    pacer_depth_ns,
                    history_windows,
                    alpha_permille,
                    throttle_weight_permille,
                    reserve_permille,
                    drr_quantum_device_units: 50_000,
                    seed,
                    track_invariants: true,
                    reorder_lookahead,
                }
            },
        )
}

/// A fixed seed keeps CI deterministic; `PROPTEST_RNG_SEED=<u64>` explores other sequences.
fn rng_seed() -> RngSeed {
    let seed = std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x4ead_5eed_0000_0003);
    RngSeed::Fixed(seed)
}

/// A failing case's seed is saved to `proptest-regressions/invariants.txt` and replayed first
/// on the next runs. A seed replays its case only while the strategies above draw the same way,
/// so once the failure is understood, spell the shrunk case out as a named test in
/// `regressions.rs` (with `replay::Op`) and delete the seed.
macro_rules! invariant_test {
    ($name:ident, $kind:expr) => {
        invariant_test!($name, $kind, op_strategy());
    };
    ($name:ident, $kind:expr, $ops:expr) => {
        proptest! {
            #![proptest_config(ProptestConfig {
                cases: 256,
                max_shrink_iters: 4_000,
                failure_persistence: Some(Box::new(FileFailurePersistence::Direct("proptest-regressions/invariants.txt"))),
                rng_seed: rng_seed(),
                ..ProptestConfig::default()
            })]
            #[test]
            fn $name(capacity in capacity_strategy(), params in params_strategy(), ops in prop::collection::vec($ops, 1..120)) {
                run($kind, capacity, params, ops);
            }
        }
    };
}

invariant_test!(wild_invariants_hold, PolicyKind::Wild);
invariant_test!(base_invariants_hold, PolicyKind::Base);
invariant_test!(credit_invariants_hold, PolicyKind::Credit);
invariant_test!(
    credit_pool_invariants_hold,
    PolicyKind::Credit,
    pooled_op_strategy()
);
invariant_test!(burst_invariants_hold, PolicyKind::Burst);
invariant_test!(mclock_invariants_hold, PolicyKind::MClock);
invariant_test!(drr_vop_invariants_hold, PolicyKind::DrrVop);

invariant_test!(
    wild_invariants_hold_under_capacity_changes,
    PolicyKind::Wild,
    capacity_op_strategy()
);
invariant_test!(
    base_invariants_hold_under_capacity_changes,
    PolicyKind::Base,
    capacity_op_strategy()
);
invariant_test!(
    credit_invariants_hold_under_capacity_changes,
    PolicyKind::Credit,
    capacity_op_strategy()
);
invariant_test!(
    credit_pool_invariants_hold_under_capacity_changes,
    PolicyKind::Credit,
    pooled_capacity_op_strategy()
);
invariant_test!(
    burst_invariants_hold_under_capacity_changes,
    PolicyKind::Burst,
    capacity_op_strategy()
);
invariant_test!(
    mclock_invariants_hold_under_capacity_changes,
    PolicyKind::MClock,
    capacity_op_strategy()
);
invariant_test!(
    drr_vop_invariants_hold_under_capacity_changes,
    PolicyKind::DrrVop,
    capacity_op_strategy()
);
