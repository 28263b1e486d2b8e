//! Scheduler overhead: nanoseconds per I/O (enqueue + next + complete) for every policy at
//! 10, 1,000 and 10,000 volumes with 1 % and 100 % of them active, and Burst's per-window
//! allocation (Algorithm 1 alone, over volumes given one window of synthetic usage) at 64,
//! 1,024 and 10,000 active volumes, and 64 active out of 10,000 defined, on a node sized for
//! its volumes' baselines, and again (`_oversold`) on one that sold ten times its device
//! capacity in baselines, where round 1 is scaled down every window.
//!
//! The node capacity and the volumes' ceilings are unlimited so that nothing waits on a
//! limit: the numbers are the policies' own bookkeeping. Every volume has a 100 IOPS baseline
//! and bursts far above it (Base: a baseline that never binds). Time advances 1 µs per I/O (a node doing a million IOPS),
//! so Burst's 10 ms window rolls over every 10,000 I/Os and its allocation is included,
//! amortised, in its per-I/O figure.
//!
//! `per_io_random` is the same loop with the volumes visited in a pseudo-random order, as in
//! the simulator (arrivals land on random volumes): the ready ring starts in a shuffled order
//! and every replacement request goes to a pseudo-random active volume, so consecutive I/Os
//! touch unrelated, cache-cold volumes instead of walking the volume table in order.
//!
//! `BENCH_TRACK=off` runs every policy with `PolicyParams::track_invariants` off (no
//! per-volume invariant tracking; the default, on, is what the tests use).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use headroom_qos::bench_support::BurstAllocation;
use headroom_qos::{
    BurstMode, CostVector, Decision, IoRate, IoRequest, NodeCapacity, Observed, OpKind, Policy,
    PolicyKind, PolicyParams, VolumeQos, build_policy,
};
use std::hint::black_box;
use std::time::{Duration, Instant};

const STEP_NS: u64 = 1_000;
const BACKLOG: usize = 4;

/// Volumes burst far above a small baseline (so burst paths are exercised), except under
/// Base, which caps at the baseline and so gets one that never binds.
fn qos(kind: PolicyKind) -> VolumeQos {
    let baseline_iops = if kind == PolicyKind::Base || std::env::var("BENCH_HIGH_BASE").is_ok() {
        10_000_000
    } else {
        100
    };
    VolumeQos {
        baseline: IoRate::new(baseline_iops, u64::MAX),
        ceiling: IoRate::UNLIMITED,
        burst: BurstMode::OnDemand,
        weight: 1,
        io_unit_bytes: 0,
    }
}

struct Bench {
    policy: Box<dyn Policy>,
    now: u64,
    next_id: u64,
    /// Active volumes; `Some(state)`: replacements go to pseudo-random ones (xorshift state).
    active: u32,
    random: Option<u64>,
}

fn xorshift(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    x
}

impl Bench {
    fn new(kind: PolicyKind, volumes: u32, active: u32, random: bool) -> Bench {
        let params = PolicyParams {
            track_invariants: std::env::var("BENCH_TRACK").map_or(true, |v| v != "off"),
            ..PolicyParams::default()
        };
        let mut policy = build_policy(kind, NodeCapacity::UNLIMITED, &params);
        for v in 0..volumes {
            policy.add_volume(0, v, &qos(kind));
        }
        let mut b = Bench {
            policy,
            now: 0,
            next_id: 0,
            active,
            random: random.then_some(0x9e37_79b9_7f4a_7c15),
        };
        // The order in which volumes first become backlogged is their ring order.
        let mut order: Vec<u32> = (0..active).collect();
        if let Some(state) = &mut b.random {
            for i in (1..order.len()).rev() {
                let j = (xorshift(state) % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
        }
        for v in order {
            for _ in 0..BACKLOG {
                b.enqueue(v);
            }
        }
        b
    }

    /// The volume that gets the replacement for a request of `done` (itself, or random).
    fn replacement_for(&mut self, done: u32) -> u32 {
        match &mut self.random {
            Some(state) => (xorshift(state) % u64::from(self.active)) as u32,
            None => done,
        }
    }

    fn enqueue(&mut self, volume: u32) {
        self.next_id += 1;
        let req = IoRequest {
            id: self.next_id,
            volume,
            op: OpKind::Read,
            offset_bytes: self.next_id * 4096,
            len_bytes: 4096,
            cost: CostVector::new(1_000, 0, 4096, 100),
            arrival_ns: self.now,
        };
        self.policy.enqueue(self.now, req);
    }

    /// One I/O: next → dispatch → complete → enqueue a replacement (keeps the backlog).
    fn one_io(&mut self) {
        self.now += STEP_NS;
        loop {
            match self.policy.next(self.now) {
                Decision::Dispatch(req, _) => {
                    self.policy.complete(self.now, &req, Observed::default());
                    let v = self.replacement_for(req.volume);
                    self.enqueue(v);
                    black_box(req.id);
                    return;
                }
                Decision::WaitUntil(t) => self.now = t.max(self.now + 1),
                Decision::Idle => return,
            }
        }
    }
}

fn per_io(c: &mut Criterion) {
    per_io_group(c, "per_io", &[10, 1_000, 10_000], &[1, 100], false);
}

fn per_io_random(c: &mut Criterion) {
    per_io_group(c, "per_io_random", &[1_000, 10_000], &[100], true);
}

fn per_io_group(
    c: &mut Criterion,
    name: &str,
    volume_counts: &[u32],
    active_pcts: &[u32],
    random: bool,
) {
    let mut group = c.benchmark_group(name);
    for kind in PolicyKind::ALL {
        for &volumes in volume_counts {
            for &active_pct in active_pcts {
                let active = (volumes * active_pct / 100).max(1);
                let id = BenchmarkId::new(kind.as_str(), format!("{volumes}vols_{active_pct}pct"));
                group.bench_function(id, |bencher| {
                    let mut b = Bench::new(kind, volumes, active, random);
                    // Warm the structures (first window, heaps at size).
                    for _ in 0..20_000 {
                        b.one_io();
                    }
                    bencher.iter_custom(|iters| {
                        let start = Instant::now();
                        for _ in 0..iters {
                            b.one_io();
                        }
                        start.elapsed()
                    });
                });
            }
        }
    }
    group.finish();
}

fn burst_allocation(c: &mut Criterion) {
    let mut group = c.benchmark_group("burst_window_allocation");
    for (defined, active, oversold) in [
        (64u32, 64u32, false),
        (1_024, 1_024, false),
        (10_000, 10_000, false),
        (10_000, 64, false),
        (64, 64, true),
        (1_024, 1_024, true),
        (10_000, 10_000, true),
    ] {
        let node = if oversold { "_oversold" } else { "" };
        let id = BenchmarkId::from_parameter(format!("{active}active_of_{defined}{node}"));
        group.bench_function(id, |bencher| {
            let mut alloc = if oversold {
                BurstAllocation::oversold(defined, active)
            } else {
                BurstAllocation::new(defined, active)
            };
            bencher.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    alloc.prepare();
                    let start = Instant::now();
                    let n = alloc.allocate();
                    total += start.elapsed();
                    assert_eq!(n, active as usize);
                }
                total
            });
        });
    }
    group.finish();
}

criterion_group!(benches, per_io, per_io_random, burst_allocation);
criterion_main!(benches);
