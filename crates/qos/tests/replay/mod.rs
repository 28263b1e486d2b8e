//! Replaying a sequence of operations against a policy with every invariant checked, shared by
//! the property tests (`invariants.rs`, which generate the sequences) and the fixed cases
//! (`regressions.rs`, which spell out sequences that once broke an invariant).

// Each test crate that includes this module uses a different part of it.
#![allow(dead_code)]

use super::common::{self, Driver, MS};
use headroom_qos::{
    CostVector, NS_PER_S, NodeCapacity, OpKind, Phase, PolicyKind, PolicyParams, VolumeQos,
};

/// One step of a test sequence.
#[derive(Clone, Debug)]
pub enum Op {
    /// `add_volume` (on a known volume: a QoS change).
    Add(u32, VolumeQos),
    /// `update_qos` (on an unknown volume: an add).
    Update(u32, VolumeQos),
    Remove(u32),
    /// `(volume, n, shape)`: `n` requests of [`SHAPES`]`[shape]` (a volume not added yet is
    /// registered by its first request, best effort), then everything that may run now runs.
    Enqueue(u32, usize, usize),
    /// Runs the ideal executor this many nanoseconds further.
    Advance(u64),
    /// The node moves capacity: each dimension of the capacity the policy was built with,
    /// scaled by this many thousandths (`u32::MAX`: unlimited).
    SetCapacity([u32; 4]),
}

/// Request shapes: `(op, length, CPU ns, device units)`.
pub const SHAPES: [(OpKind, u32, u64, u64); 6] = [
    (OpKind::Read, 4_096, 2_000, 100_000),
    (OpKind::Write, 4_096, 2_500, 30_000),
    (OpKind::Write, 65_536, 4_000, 200_000),
    (OpKind::Read, 1 << 20, 30_000, 2_000_000),
    (OpKind::Flush, 0, 500, 0),
    (OpKind::Trim, 1 << 20, 1_000, 0),
];

/// Indices into [`SHAPES`].
pub const READ_4K: usize = 0;
pub const WRITE_4K: usize = 1;
pub const WRITE_64K: usize = 2;
pub const READ_1M: usize = 3;
pub const FLUSH: usize = 4;
pub const TRIM_1M: usize = 5;

pub fn shape_cost(i: usize) -> (OpKind, u32, CostVector) {
    let (op, len, cpu, dev) = SHAPES[i % SHAPES.len()];
    let l = u64::from(len);
    let c = CostVector::new(
        cpu,
        if op == OpKind::Write { l } else { 0 },
        if op == OpKind::Read { l } else { 0 },
        dev,
    );
    (op, len, c)
}

/// `base` with each dimension scaled by `scale` thousandths (see [`Op::SetCapacity`]).
pub fn scaled(base: NodeCapacity, scale: [u32; 4]) -> NodeCapacity {
    let d = base.per_second.dims();
    NodeCapacity::new(CostVector::from_dims(std::array::from_fn(|i| {
        if scale[i] == u32::MAX || d[i] == u64::MAX {
            u64::MAX
        } else {
            (u128::from(d[i]) * u128::from(scale[i]) / 1000).min(u128::from(u64::MAX - 1)) as u64
        }
    })))
}

/// Runs `ops` with per-volume invariant tracking as `params` says (the callers turn it on) and
/// again with it off: every invariant holds after every step in both (off checks the
/// node-wide ones), and turning tracking off changes no decision.
pub fn run(kind: PolicyKind, capacity: NodeCapacity, params: PolicyParams, ops: Vec<Op>) {
    let untracked = PolicyParams {
        track_invariants: false,
        ..params
    };
    let logs = [params, untracked].map(|params| {
        let mut d = Driver::with_params(kind, capacity, &params);
        d.service_ns = 50_000;
        // The capacity in effect from each time on.
        let mut capacities = vec![(0u64, capacity)];
        for op in ops.iter().cloned() {
            match op {
                Op::Add(v, q) => d.add(v, &q),
                Op::Update(v, q) => d.update(v, &q),
                Op::Remove(v) => d.remove(v),
                Op::Enqueue(v, n, s) => {
                    let (op, len, c) = shape_cost(s);
                    d.enqueue(v, n, op, len, c);
                    let _ = d.drain();
                }
                Op::Advance(dt) => {
                    let t = d.now + dt;
                    d.run_until(t);
                }
                Op::SetCapacity(scale) => {
                    let c = scaled(capacity, scale);
                    d.set_capacity(c);
                    capacities.push((d.now, c));
                    let _ = d.drain();
                }
            }
        }
        // Let everything that can run, run: queued requests of volumes that may run eventually
        // drain.
        let t = d.now + 200 * MS;
        d.run_until(t);
        check_windows(kind, &params, &capacities, &d.log);
        d.log
            .iter()
            .map(|x| (x.at_ns, x.req.id, x.phase))
            .collect::<Vec<_>>()
    });
    assert_eq!(logs[0], logs[1], "tracking invariants changed a decision");
}

/// Checks the log against the capacity in effect, independently of the policy's own tracker:
/// in every aligned window, the cost dispatched is at most the largest capacity in effect
/// during the window (per dimension) times the window (plus the pacer's depth and one ns),
/// plus one request the pacer saved up (it is at least one request deep), one burst and one
/// baseline request; Burst's burst-phase cost also leaves the reserve alone (the burst
/// pacer's rate, capacity × (1 − reserve), over the window plus its depth, plus the request
/// it saved up and one more).
fn check_windows(
    kind: PolicyKind,
    params: &PolicyParams,
    capacities: &[(u64, NodeCapacity)],
    log: &[common::Dispatched],
) {
    let Some(last) = log.last() else {
        return;
    };
    let w_ns = params.window_ns;
    let max_cost = log
        .iter()
        .fold(CostVector::ZERO, |m, x| m.max(x.req.cost))
        .dims();
    let burst_depth_ns = params.limiter_depth_ns.max(1);
    let reserve = u128::from(params.reserve_permille);
    let bound = |cap: u64, span_ns: u64| -> u128 {
        (u128::from(cap) * u128::from(span_ns)).div_ceil(u128::from(NS_PER_S))
    };
    let mut i = 0;
    for w in 0..=last.at_ns / w_ns {
        let (start, end) = (w * w_ns, (w + 1) * w_ns);
        // Largest capacity in effect during [start, end): the one at `start` and every later
        // change before `end`.
        let mut widest = [0u64; 4];
        for &(t, c) in capacities {
            let in_effect_at_start = capacities
                .iter()
                .rev()
                .find(|&&(t0, _)| t0 <= start)
                .is_some_and(|&(t0, _)| t0 == t);
            if in_effect_at_start || (t > start && t < end) {
                for (m, x) in widest.iter_mut().zip(c.per_second.dims()) {
                    *m = (*m).max(x);
                }
            }
        }
        let mut total = [0u128; 4];
        let mut burst = [0u128; 4];
        while i < log.len() && log[i].at_ns < end {
            let x = &log[i];
            for (d, c) in x.req.cost.dims().into_iter().enumerate() {
                total[d] += u128::from(c);
                if x.phase != Phase::Baseline {
                    burst[d] += u128::from(c);
                }
            }
            i += 1;
        }
        for d in 0..4 {
            if widest[d] == u64::MAX {
                continue;
            }
            let cap =
                bound(widest[d], w_ns + params.pacer_depth_ns + 1) + 3 * u128::from(max_cost[d]);
            assert!(
                total[d] <= cap,
                "{kind}: window {w} dimension {d}: dispatched {} > {cap} (largest capacity in effect {})",
                total[d],
                widest[d]
            );
            if kind == PolicyKind::Burst {
                let rate = (u128::from(widest[d]) * (1000 - reserve) / 1000) as u64;
                let cap = bound(rate, w_ns + burst_depth_ns + 1) + 1 + 2 * u128::from(max_cost[d]);
                assert!(
                    burst[d] <= cap,
                    "{kind}: window {w} dimension {d}: burst phases dispatched {} > {cap}, into the reserve",
                    burst[d]
                );
            }
        }
    }
}
