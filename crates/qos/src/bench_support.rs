//! Workload drivers shared by the criterion benchmark (`benches/policies.rs`, which times
//! them) and the `overhead_count` example (which runs them under callgrind for deterministic
//! instruction and cache-miss counts), so that both measure exactly the same work.
//!
//! Nothing here reads a clock: the caller times the calls. Compiled only with the
//! `bench-support` feature, which the bench and the example get from the crate's
//! dev-dependency on itself (see `Cargo.toml`).

use crate::cost::CostVector;
use crate::policy::{Policy, PolicyKind, PolicyParams, build_policy};
use crate::vocab::{
    BurstMode, Decision, IoRate, IoRequest, NodeCapacity, Observed, OpKind, VolumeQos,
};
use std::hint::black_box;

/// Burst's per-window allocation (Algorithm 1) over synthetic active volumes.
#[derive(Debug)]
pub struct BurstAllocation(crate::policies::burst::AllocationBench);

impl BurstAllocation {
    /// `defined` volumes, of which the first `active` have usage, on a node sized for their
    /// baselines.
    pub fn new(defined: u32, active: u32) -> Self {
        BurstAllocation(crate::policies::burst::AllocationBench::new(
            defined, active, false,
        ))
    }

    /// The same on a node that sold ten times its device capacity in baselines: round 1 is
    /// scaled down every window (one more pass, one division per volume).
    pub fn oversold(defined: u32, active: u32) -> Self {
        BurstAllocation(crate::policies::burst::AllocationBench::new(
            defined, active, true,
        ))
    }

    /// Runs the allocation compiled for `level` (lowered to what this CPU has).
    pub fn set_cpu_level(&mut self, level: crate::cpu::CpuLevel) {
        self.0.set_cpu_level(level);
    }

    /// Gives every active volume one window of usage (call outside the measurement).
    pub fn prepare(&mut self) {
        self.0.prepare();
    }

    /// Runs one window's allocation; returns how many volumes it allocated to.
    pub fn allocate(&mut self) -> usize {
        self.0.allocate()
    }
}

/// Time between two I/Os of the per-I/O workload (a node doing a million IOPS).
const STEP_NS: u64 = 1_000;
/// Requests every active volume keeps queued.
const BACKLOG: usize = 4;

/// The per-I/O workload: what it runs on.
#[derive(Clone, Copy, Debug)]
pub struct PerIoSetup {
    /// The policy.
    pub kind: PolicyKind,
    /// Volumes defined.
    pub volumes: u32,
    /// Volumes with requests (the first `active`).
    pub active: u32,
    /// Visit volumes in a pseudo-random order (as the simulator does) instead of in turn.
    pub random: bool,
    /// `PolicyParams::track_invariants`.
    pub track_invariants: bool,
    /// Give every volume a baseline that never binds (Base always gets one).
    pub high_baseline: bool,
}

/// The per-I/O workload: an unlimited node, every active volume keeping [`BACKLOG`] requests
/// queued, 100 IOPS baselines bursting far above; each I/O is next → dispatch → complete →
/// enqueue a replacement (to the same volume, or to a pseudo-random one).
#[derive(Debug)]
pub struct PerIoBench {
    policy: Box<dyn Policy>,
    now_ns: u64,
    next_id: u64,
    active: u32,
    /// xorshift state when volumes are visited in random order.
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

impl PerIoBench {
    /// Builds the policy and queues the initial backlog.
    pub fn new(setup: PerIoSetup) -> PerIoBench {
        let params = PolicyParams {
            track_invariants: setup.track_invariants,
            ..PolicyParams::default()
        };
        let mut policy = build_policy(setup.kind, NodeCapacity::UNLIMITED, &params);
        let baseline_iops = if setup.kind == PolicyKind::Base || setup.high_baseline {
            10_000_000
        } else {
            100
        };
        let qos = VolumeQos {
            baseline: IoRate::new(baseline_iops, u64::MAX),
            ceiling: IoRate::UNLIMITED,
            burst: BurstMode::OnDemand,
            weight: 1,
            io_unit_bytes: 0,
        };
        for v in 0..setup.volumes {
            policy.add_volume(0, v, &qos);
        }
        let active = setup.active.clamp(1, setup.volumes.max(1));
        let mut b = PerIoBench {
            policy,
            now_ns: 0,
            next_id: 0,
            active,
            random: setup.random.then_some(0x9e37_79b9_7f4a_7c15),
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

    fn enqueue(&mut self, volume: u32) {
        self.next_id += 1;
        let req = IoRequest {
            id: self.next_id,
            volume,
            op: OpKind::Read,
            offset_bytes: self.next_id * 4096,
            len_bytes: 4096,
            cost: CostVector::new(1_000, 0, 4096, 100),
            arrival_ns: self.now_ns,
        };
        self.policy.enqueue(self.now_ns, req);
    }

    /// One I/O: next → dispatch → complete → enqueue a replacement (keeps the backlog).
    pub fn one_io(&mut self) {
        self.now_ns += STEP_NS;
        loop {
            match self.policy.next(self.now_ns) {
                Decision::Dispatch(req, _) => {
                    self.policy.complete(self.now_ns, &req, Observed::default());
                    let v = match &mut self.random {
                        Some(state) => (xorshift(state) % u64::from(self.active)) as u32,
                        None => req.volume,
                    };
                    self.enqueue(v);
                    black_box(req.id);
                    return;
                }
                Decision::WaitUntil(t) => self.now_ns = t.max(self.now_ns + 1),
                Decision::Idle => return,
            }
        }
    }
}
