//! Fixed cases that once broke an invariant in the property tests (`invariants.rs`), spelled
//! out so that they replay exactly whatever the property tests' strategies become.
//!
//! They were proptest seeds in `proptest-regressions/invariants.txt`. A saved seed replays its
//! case only while the strategies draw the same way, and these were saved before
//! `PolicyParams` gained `pacer_depth_ns` (all of them) and `track_invariants` (all but one):
//! replayed, they drew unrelated cases. What is kept here is the shrunk case recorded next to
//! each seed, for those that still pin a rule: each test says which rule of the invariant
//! checks or of a policy, broken on purpose, makes it fail (some of these the property tests
//! at their fixed seed do not catch). The seeds did not record which policy failed, so every
//! case runs on every policy, with a node pacer that saves up nothing (as when they were
//! recorded) and one that saves up 1 ms (as the server's), through the property tests' own
//! replay: every invariant after every step, the same decisions with per-volume tracking on
//! and off, and the dispatch log within the capacity in effect.

mod common;
mod replay;

use common::MS;
use headroom_qos::{
    BurstMode, CostVector, CreditBucketSpec, CreditSpec, IoRate, NodeCapacity, PolicyKind,
    PolicyParams, VolumeQos,
};
use replay::Op::{self, Add, Advance, Enqueue, Update};
use replay::{FLUSH, READ_1M, READ_4K, WRITE_64K, run};

const UNLIMITED: u64 = u64::MAX;

/// The property tests' largest node: CPU, 4 GB/s each way, unlimited device.
fn big_node() -> NodeCapacity {
    NodeCapacity::new(CostVector::new(
        1_000_000_000,
        4_000_000_000,
        4_000_000_000,
        UNLIMITED,
    ))
}

/// The property tests' middle node: 400 MB/s each way, so a 1 MiB request is 2.6 ms of it.
fn mid_node() -> NodeCapacity {
    NodeCapacity::new(CostVector::new(
        200_000_000,
        400_000_000,
        400_000_000,
        2_000_000_000,
    ))
}

/// Runs `ops` on every policy, with the node pacer saving up nothing and 1 ms, and the
/// parameters the cases shrank to: 1 ms windows, N = 1, α = 1, no throttle weight, no reserve
/// (parameters added since they were recorded keep their defaults).
fn on_every_policy(capacity: NodeCapacity, limiter_depth_ns: u64, ops: &[Op]) {
    for kind in PolicyKind::ALL {
        for pacer_depth_ns in [0, MS] {
            // Every field today; the update keeps fields added later at their defaults.
            #[allow(clippy::needless_update)]
            let params = PolicyParams {
                window_ns: MS,
                limiter_depth_ns,
                pacer_depth_ns,
                history_windows: 1,
                alpha_permille: 1000,
                throttle_weight_permille: 0,
                reserve_permille: 0,
                drr_quantum_device_units: 50_000,
                seed: 0,
                track_invariants: true,
                ..PolicyParams::default()
            };
            run(kind, capacity, params, ops.to_vec());
        }
    }
}

/// A baseline of `iops` and `bytes_per_s`, and no burst: the baseline is also the ceiling.
fn fixed(iops: u64, bytes_per_s: u64) -> VolumeQos {
    VolumeQos {
        baseline: IoRate::new(iops, bytes_per_s),
        burst: BurstMode::None,
        ..VolumeQos::default()
    }
}

/// An IOPS credit bucket of `capacity`, refilled at `refill_per_s`, starting empty.
fn iops_credits(capacity: u64, refill_per_s: u64, pool: Option<u32>) -> BurstMode {
    BurstMode::Credits(CreditSpec {
        iops: Some(CreditBucketSpec {
            capacity,
            refill_per_s,
            start_full: false,
        }),
        bytes: None,
        pool,
    })
}

/// A 1 MiB read on a volume whose byte baseline (15.9 MB/s, and its ceiling: no burst) allows
/// 16 KB per 1 ms window, then small reads behind it. Fails if the ceiling check's bound per
/// window loses its one-request allowance in bytes (`max_bytes_per_req` in
/// `Tracker::on_dispatch`): the `ceiling` invariant, on every policy but Wild. Seed 7bfe81ee.
#[test]
fn ceiling_check_allows_one_request_larger_than_a_window_in_bytes() {
    on_every_policy(
        big_node(),
        0,
        &[
            Add(4, fixed(51, 15_910_975)),
            Enqueue(4, 1, READ_1M),
            Enqueue(4, 3, READ_4K),
        ],
    );
}

/// Two 1 MiB reads arrive for an unknown volume, which is then given a 1 IOPS ceiling counted
/// in 4 KiB units (256 units per read), then a fixed 1 IOPS baseline. Fails if the ceiling
/// check's bound loses its one-request allowance in units (`max_units_per_req`): the
/// `ceiling` invariant ("256 units > ceiling bound 2"). Seed fc74d3ce.
#[test]
fn ceiling_check_allows_one_request_larger_than_a_window_in_units() {
    on_every_policy(
        big_node(),
        0,
        &[
            Enqueue(5, 2, READ_1M),
            Add(
                5,
                VolumeQos {
                    ceiling: IoRate::new(1, UNLIMITED),
                    io_unit_bytes: 4096,
                    ..VolumeQos::default()
                },
            ),
            Advance(1),
            Add(
                5,
                VolumeQos {
                    baseline: IoRate::new(1, 1),
                    ceiling: IoRate::new(1, UNLIMITED),
                    burst: BurstMode::None,
                    ..VolumeQos::default()
                },
            ),
        ],
    );
}

/// On a node where no 1 ms window holds a 1 MiB read, a volume whose 1 MiB reads were held
/// back by a zero byte ceiling is released (best effort, weight 6) while a best-effort
/// neighbour streams 1 MiB reads. Fails if the capacity check allows only one request beyond
/// a window (`Tracker::on_dispatch`), fewer than the node pacer lets through (a burst and a
/// baseline request at least): the `capacity` invariant, on Credit. Seed 0e0c1773.
#[test]
fn capacity_check_allows_the_pacers_requests_larger_than_a_window() {
    on_every_policy(
        mid_node(),
        0,
        &[
            Update(
                1,
                VolumeQos {
                    ceiling: IoRate::new(UNLIMITED, 0),
                    burst: BurstMode::None,
                    ..VolumeQos::default()
                },
            ),
            Enqueue(1, 6, READ_1M),
            Enqueue(0, 7, READ_1M),
            Advance(13_107_200),
            Add(
                1,
                VolumeQos {
                    weight: 6,
                    io_unit_bytes: 262_144,
                    ..VolumeQos::default()
                },
            ),
            Enqueue(2, 1, READ_4K),
            Update(0, fixed(0, 0)),
        ],
    );
}

/// A 4 KiB read of an on-demand volume with no byte baseline (which Base, capping at the
/// baseline, holds forever) is still queued when a QoS change gives the volume one. Fails if
/// `Tracker::on_qos_change` does not restart the head request's wait at the change: the
/// `baseline` invariant on Base (the read would be owed since it arrived). Seed d5afdd10.
#[test]
fn a_qos_change_restarts_the_wait_of_the_queued_head_request() {
    on_every_policy(
        big_node(),
        10 * MS,
        &[
            Add(
                4,
                VolumeQos {
                    baseline: IoRate::new(107, 0),
                    ..VolumeQos::default()
                },
            ),
            Enqueue(4, 1, READ_4K),
            Advance(16_505_550),
            Add(4, fixed(102, 1_786_588)),
            Enqueue(4, 2, READ_4K),
            Advance(3_297_199),
        ],
    );
}

/// A volume registered by its first read and then given a fixed baseline (4 KiB reads at
/// 191 kB/s: one per 21 ms) idles, and reads again. Fails if a volume becoming backlogged
/// does not reset its shadow meter to one request (`ShadowMeter::activate` in
/// `Tracker::on_enqueue`: idleness would save up the limiter's 10 ms depth): the `baseline`
/// invariant on mClock. Also fails if the shadow meter's debt is not capped at one request,
/// or it ignores the byte baseline (Base, mClock), or Burst puts a volume without burst mode
/// in a burst class. Seed d519acda.
#[test]
fn an_idle_volume_saves_up_no_baseline() {
    on_every_policy(
        big_node(),
        10 * MS,
        &[
            Enqueue(5, 1, READ_4K),
            Add(5, fixed(115, 190_987)),
            Advance(4_083_030),
            Advance(10_926_525),
            Enqueue(1, 5, FLUSH),
            Add(1, fixed(101, 0)),
            Advance(8_256_486),
            Enqueue(5, 2, READ_4K),
            Add(2, fixed(0, 0)),
        ],
    );
}

/// A backlogged volume with a byte baseline only (64 KiB writes) moves to credits in both
/// dimensions (one-credit IOPS bucket, 64 KiB byte bucket, 256 KiB units) while a neighbour
/// changes QoS. Fails if `Tracker::on_qos_change` keeps what the shadow meter saved up instead
/// of restarting the new baseline with nothing: the `baseline` invariant on Credit and Burst
/// (the property tests at their fixed seed do not catch this). Also fails if the shadow
/// meter's debt is not capped at one request, or it ignores the byte baseline. Seed
/// 71a8cac9.
#[test]
fn a_qos_change_into_credits_restarts_the_baseline_with_nothing_saved_up() {
    on_every_policy(
        big_node(),
        10 * MS,
        &[
            Update(2, fixed(0, 2_601_499)),
            Add(0, VolumeQos::default()),
            Advance(0),
            Enqueue(2, 4, WRITE_64K),
            Update(0, fixed(304, 1_240_279)),
            Advance(4_417_040),
            Enqueue(0, 2, WRITE_64K),
            Add(
                2,
                VolumeQos {
                    baseline: IoRate::new(96, 4_429_570),
                    burst: BurstMode::Credits(CreditSpec {
                        iops: Some(CreditBucketSpec {
                            capacity: 1,
                            refill_per_s: 96,
                            start_full: false,
                        }),
                        bytes: Some(CreditBucketSpec {
                            capacity: 65_536,
                            refill_per_s: 4_429_570,
                            start_full: false,
                        }),
                        pool: None,
                    }),
                    io_unit_bytes: 262_144,
                    ..VolumeQos::default()
                },
            ),
        ],
    );
}

/// A backlogged volume with 1 MiB reads and flushes goes from on demand (256 KiB units,
/// 1,409 IOPS ceiling) to fixed and back to on demand with another ceiling. Fails, on mClock,
/// for the same broken rule as `a_qos_change_into_credits_restarts_the_baseline_with_nothing_saved_up`
/// (the `baseline` invariant), and if the shadow meter's debt is not capped at one request.
/// Seed acf8e641.
#[test]
fn repeated_qos_changes_restart_the_baseline_with_nothing_saved_up() {
    let on_demand = |iops, ceiling_iops| VolumeQos {
        baseline: IoRate::new(iops, 0),
        ceiling: IoRate::new(ceiling_iops, UNLIMITED),
        io_unit_bytes: 262_144,
        ..VolumeQos::default()
    };
    on_every_policy(
        big_node(),
        10 * MS,
        &[
            Add(3, on_demand(157, 1_409)),
            Enqueue(3, 4, READ_1M),
            Advance(2_838_893),
            Enqueue(3, 3, FLUSH),
            Update(3, fixed(206, 0)),
            Advance(15_330_062),
            Advance(20_208_512),
            Update(3, on_demand(265, 289)),
            Advance(11_633_926),
        ],
    );
}

/// A volume registered by a backlog of reads joins credit pool 0, leaves it for a fixed
/// baseline and joins it again, while another volume flushes. Fails if Credit keeps the
/// volume's baseline meter debt when it joins a pool (`forgive_debt` in
/// `CreditRules::reconfigure`), since in a pool its baseline rests on that meter alone: the
/// `baseline` invariant (the property tests at their fixed seed do not catch this). Seed
/// 1eeea967 (from the pooled property test, the only seed saved after `track_invariants`
/// existed).
#[test]
fn a_backlogged_volume_joining_a_credit_pool_has_its_meter_debt_forgiven() {
    on_every_policy(
        big_node(),
        0,
        &[
            Enqueue(1, 1, READ_4K),
            Enqueue(0, 10, READ_4K),
            Enqueue(0, 3, READ_1M),
            Add(
                0,
                VolumeQos {
                    baseline: IoRate::new(108, 440_818),
                    burst: iops_credits(1, 139, Some(0)),
                    ..VolumeQos::default()
                },
            ),
            Advance(24_075_815),
            Advance(19_065_451),
            Advance(7_458_867),
            Advance(14_410_026),
            Add(
                0,
                VolumeQos {
                    io_unit_bytes: 262_144,
                    ..fixed(171, 6_539_983)
                },
            ),
            Advance(22_851_707),
            Advance(3_779_520),
            Add(2, fixed(13, 0)),
            Enqueue(2, 2, FLUSH),
            Add(
                0,
                VolumeQos {
                    baseline: IoRate::new(7, 11_693_331),
                    burst: iops_credits(1, 7, Some(0)),
                    ..VolumeQos::default()
                },
            ),
        ],
    );
}

/// A best-effort volume's read is still queued when it is changed to nothing guaranteed and
/// no burst; a 1 IOPS volume flushes. Fails if Burst's `classify` puts a volume without burst
/// mode that its meter does not admit in a burst class instead of the baseline class: the
/// `work_conserving` invariant ("the node is idle but volume 2 (below its ceiling) has 1
/// queued requests"). Seed 5a19a677.
#[test]
fn burst_classifies_volumes_without_burst_mode_as_baseline() {
    on_every_policy(
        big_node(),
        0,
        &[
            Update(1, fixed(0, 0)),
            Enqueue(2, 1, READ_4K),
            Add(1, fixed(1, 0)),
            Update(2, fixed(0, 0)),
            Enqueue(1, 1, FLUSH),
        ],
    );
}
