//! Deterministic scheduler-overhead workloads for instruction and cache-miss counts.
//!
//! The criterion bench (`benches/policies.rs`) measures time, which on a shared machine moves
//! by ±30 % with the neighbours' load. This runs the same workloads a fixed number of times
//! inside one function, `measured`, so that `valgrind --tool=callgrind
//! --toggle-collect='*measured*'` (add `--cache-sim=yes` for simulated cache misses) counts
//! exactly the scheduler's work, the same on every run, to compare two versions of the code.
//!
//! ```text
//! cargo run --release -p headroom-qos --example overhead_count -- alloc 1024 200
//! cargo run --release -p headroom-qos --example overhead_count -- io burst 10000 random 100000
//! ```
//!
//! `alloc ACTIVE WINDOWS`: Burst's per-window allocation over ACTIVE volumes (the
//! `burst_window_allocation` bench). `io POLICY VOLUMES ORDER IOS`: IOS I/Os of the per-I/O
//! bench (ORDER `seq` for `per_io`, `random` for `per_io_random`), all volumes active, after
//! 20,000 warm-up I/Os outside `measured`. `BENCH_TRACK=off` as in the bench.

use headroom_qos::bench_support::BurstAllocation;
use headroom_qos::{
    BurstMode, CostVector, Decision, IoRate, IoRequest, NodeCapacity, Observed, OpKind, Policy,
    PolicyKind, PolicyParams, VolumeQos, build_policy,
};
use std::hint::black_box;
use std::str::FromStr;

const STEP_NS: u64 = 1_000;
const BACKLOG: usize = 4;

struct Bench {
    policy: Box<dyn Policy>,
    now: u64,
    next_id: u64,
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
    fn new(kind: PolicyKind, volumes: u32, random: bool) -> Bench {
        let params = PolicyParams {
            track_invariants: std::env::var("BENCH_TRACK").map_or(true, |v| v != "off"),
            ..PolicyParams::default()
        };
        let mut policy = build_policy(kind, NodeCapacity::UNLIMITED, &params);
        let baseline_iops = if kind == PolicyKind::Base {
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
        for v in 0..volumes {
            policy.add_volume(0, v, &qos);
        }
        let mut b = Bench {
            policy,
            now: 0,
            next_id: 0,
            active: volumes,
            random: random.then_some(0x9e37_79b9_7f4a_7c15),
        };
        let mut order: Vec<u32> = (0..volumes).collect();
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
            arrival_ns: self.now,
        };
        self.policy.enqueue(self.now, req);
    }

    fn one_io(&mut self) {
        self.now += STEP_NS;
        loop {
            match self.policy.next(self.now) {
                Decision::Dispatch(req, _) => {
                    self.policy.complete(self.now, &req, Observed::default());
                    let v = match &mut self.random {
                        Some(state) => (xorshift(state) % u64::from(self.active)) as u32,
                        None => req.volume,
                    };
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

#[inline(never)]
fn measured(work: &mut dyn FnMut()) {
    work();
}

fn arg<T: FromStr>(args: &[String], i: usize, what: &str) -> Result<T, String> {
    args.get(i)
        .ok_or_else(|| format!("missing {what}"))?
        .parse()
        .map_err(|_| format!("bad {what}"))
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("alloc") => {
            let active: u32 = arg(&args, 1, "ACTIVE")?;
            let windows: u32 = arg(&args, 2, "WINDOWS")?;
            let mut alloc = BurstAllocation::new(active, active);
            for _ in 0..windows {
                alloc.prepare();
                measured(&mut || {
                    black_box(alloc.allocate());
                });
            }
        }
        Some("io") => {
            let kind = PolicyKind::from_str(&arg::<String>(&args, 1, "POLICY")?)
                .map_err(|e| e.to_string())?;
            let volumes: u32 = arg(&args, 2, "VOLUMES")?;
            let random = arg::<String>(&args, 3, "ORDER")? == "random";
            let ios: u64 = arg(&args, 4, "IOS")?;
            let mut b = Bench::new(kind, volumes, random);
            for _ in 0..20_000 {
                b.one_io();
            }
            measured(&mut || {
                for _ in 0..ios {
                    b.one_io();
                }
            });
        }
        _ => return Err("usage: alloc ACTIVE WINDOWS | io POLICY VOLUMES seq|random IOS".into()),
    }
    Ok(())
}
