//! The experiment behind Burst's default parameters (docs/qos.md, "Parameters").
//!
//! A saturated node (50,000 requests/s of CPU) shared by:
//! - 4 *victims* sold a fixed 5,000 IOPS, switching between idle and their full baseline every
//!   500 ms (two active at a time), so prediction and fast recovery matter;
//! - 2 *moderate* bursters (baseline 2,500, ceiling 50,000) demanding 8,000 requests/s;
//! - 2 *heavy* bursters (same QoS) with 64 requests always outstanding.
//!
//! Scenario B replaces victims and moderates by 2 *spiky* bursters (baseline 2,500) that demand
//! 20,000 requests/s for 100 ms every 500 ms while the 2 heavies flood: here lending decides
//! who gets the spare capacity, so the spikes' p99 wait and served share show what window,
//! N, alpha and the throttle weight do.
//!
//! Each parameter is swept around the defaults. Everything is simulated time, so the numbers
//! are deterministic.
//!
//! Run: `cargo run --release -p headroom-qos --example burst_params`

use headroom_qos::{
    BurstMode, CostVector, Decision, IoRate, IoRequest, NodeCapacity, Observed, OpKind, Policy,
    PolicyKind, PolicyParams, VolumeQos, build_policy,
};

const S: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
const REQ_CPU_NS: u64 = 20_000;
const SERVICE_NS: u64 = 100_000;
const RUN_NS: u64 = 3 * S;
const HEAVY_QD: usize = 64;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Victim,
    Moderate,
    Heavy,
    Spiky,
}

struct Source {
    kind: Kind,
    volume: u32,
    /// Open loop: requests per second and the next arrival index.
    rate: u64,
    issued: u64,
    phase: u64,
}

impl Source {
    fn active(&self, t: u64) -> bool {
        match self.kind {
            Kind::Victim => (t / (500 * MS) + self.phase).is_multiple_of(2),
            Kind::Spiky => (t + self.phase * 250 * MS) % (500 * MS) < 100 * MS,
            _ => true,
        }
    }

    fn next_arrival(&self) -> u64 {
        (self.issued * S).div_ceil(self.rate.max(1))
    }
}

struct Outcome {
    /// Victims in scenario A, spikes in scenario B.
    victim_p99_us: f64,
    victim_max_us: f64,
    moderate_served_pct: f64,
    heavy_per_s: f64,
    utilisation_pct: f64,
}

fn run(params: &PolicyParams, spiky: bool) -> Outcome {
    let capacity = NodeCapacity::new(CostVector::new(S, u64::MAX, u64::MAX, u64::MAX));
    let mut p: Box<dyn Policy> = build_policy(PolicyKind::Burst, capacity, params);
    let fixed = VolumeQos {
        weight: 50,
        ..VolumeQos::fixed(IoRate::new(5_000, u64::MAX))
    };
    let burster = VolumeQos {
        baseline: IoRate::new(2_500, u64::MAX),
        ceiling: IoRate::new(50_000, u64::MAX),
        burst: BurstMode::OnDemand,
        weight: 25,
        io_unit_bytes: 0,
    };
    let mut sources = Vec::new();
    if spiky {
        for i in 0..2u32 {
            p.add_volume(0, i, &burster);
            sources.push(Source {
                kind: Kind::Spiky,
                volume: i,
                rate: 20_000,
                issued: 0,
                phase: u64::from(i),
            });
        }
    } else {
        for i in 0..4u32 {
            p.add_volume(0, i, &fixed);
            sources.push(Source {
                kind: Kind::Victim,
                volume: i,
                rate: 5_000,
                issued: 0,
                phase: u64::from(i % 2),
            });
        }
        for i in 4..6u32 {
            p.add_volume(0, i, &burster);
            sources.push(Source {
                kind: Kind::Moderate,
                volume: i,
                rate: 8_000,
                issued: 0,
                phase: 0,
            });
        }
    }
    for i in 6..8u32 {
        p.add_volume(0, i, &burster);
        sources.push(Source {
            kind: Kind::Heavy,
            volume: i,
            rate: 0,
            issued: 0,
            phase: 0,
        });
    }
    let cost = CostVector::new(REQ_CPU_NS, 0, 4096, 0);
    let mut id = 0u64;
    let mut mk = |vol: u32, now: u64| {
        id += 1;
        IoRequest {
            id,
            volume: vol,
            op: OpKind::Read,
            offset_bytes: id * 4096,
            len_bytes: 4096,
            cost,
            arrival_ns: now,
        }
    };
    let mut now = 0u64;
    for s in &sources {
        if s.kind == Kind::Heavy {
            for _ in 0..HEAVY_QD {
                p.enqueue(0, mk(s.volume, 0));
            }
        }
    }
    let mut inflight: std::collections::BinaryHeap<std::cmp::Reverse<(u64, u64, u32)>> =
        Default::default();
    let mut victim_waits = Vec::new();
    let (mut moderate_done, mut moderate_demand, mut heavy_done, mut total_done) =
        (0u64, 0u64, 0u64, 0u64);
    while now < RUN_NS {
        // Open-loop arrivals due now (victims only while active: their schedule restarts).
        for s in sources.iter_mut().filter(|s| s.kind != Kind::Heavy) {
            while s.next_arrival() <= now {
                let at = s.next_arrival();
                s.issued += 1;
                if s.active(at) {
                    p.enqueue(now, mk(s.volume, at));
                    if matches!(s.kind, Kind::Moderate | Kind::Spiky) {
                        moderate_demand += 1;
                    }
                }
            }
        }
        // Completions (heavies re-issue at once).
        while let Some(&std::cmp::Reverse((t, rid, vol))) = inflight.peek() {
            if t > now {
                break;
            }
            inflight.pop();
            let r = IoRequest {
                id: rid,
                volume: vol,
                ..mk(vol, t)
            };
            p.complete(
                now,
                &r,
                Observed {
                    service_ns: SERVICE_NS,
                    queue_ns: 0,
                },
            );
            if vol >= 6 {
                p.enqueue(now, mk(vol, now));
            }
        }
        let wake = loop {
            match p.next(now) {
                Decision::Dispatch(r, _) => {
                    total_done += 1;
                    match (spiky, r.volume) {
                        (true, 0 | 1) => {
                            victim_waits.push(now - r.arrival_ns);
                            moderate_done += 1;
                        }
                        (false, 0..=3) => victim_waits.push(now - r.arrival_ns),
                        (false, 4 | 5) => moderate_done += 1,
                        _ => heavy_done += 1,
                    }
                    inflight.push(std::cmp::Reverse((now + SERVICE_NS, r.id, r.volume)));
                }
                Decision::WaitUntil(t) => break t,
                Decision::Idle => break u64::MAX,
            }
        };
        let next_arrival = sources
            .iter()
            .filter(|s| s.kind != Kind::Heavy)
            .map(Source::next_arrival)
            .min();
        let next_done = inflight.peek().map(|std::cmp::Reverse((t, _, _))| *t);
        now = [Some(wake), next_arrival, next_done]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(RUN_NS)
            .max(now + 1);
    }
    victim_waits.sort_unstable();
    let pct = |q: f64| {
        victim_waits
            .get(((victim_waits.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(0)
    };
    let secs = RUN_NS as f64 / S as f64;
    Outcome {
        victim_p99_us: pct(0.99) as f64 / 1e3,
        victim_max_us: victim_waits.last().copied().unwrap_or(0) as f64 / 1e3,
        moderate_served_pct: 100.0 * moderate_done as f64 / moderate_demand.max(1) as f64,
        heavy_per_s: heavy_done as f64 / secs,
        utilisation_pct: 100.0 * total_done as f64 * REQ_CPU_NS as f64 / (secs * S as f64),
    }
}

fn main() {
    let base = PolicyParams::default();
    let mut rows: Vec<(String, PolicyParams)> = vec![("defaults".into(), base)];
    for w in [MS, 5 * MS, 20 * MS, 100 * MS] {
        rows.push((
            format!("window_ns={w}"),
            PolicyParams {
                window_ns: w,
                ..base
            },
        ));
    }
    for n in [1, 4, 32] {
        rows.push((
            format!("history_windows={n}"),
            PolicyParams {
                history_windows: n,
                ..base
            },
        ));
    }
    for a in [1_000, 1_500, 2_000] {
        rows.push((
            format!("alpha_permille={a}"),
            PolicyParams {
                alpha_permille: a,
                ..base
            },
        ));
    }
    for t in [0, 1_000, 4_000, 8_000] {
        rows.push((
            format!("throttle_weight_permille={t}"),
            PolicyParams {
                throttle_weight_permille: t,
                ..base
            },
        ));
    }
    for r in [0, 25, 100] {
        rows.push((
            format!("reserve_permille={r}"),
            PolicyParams {
                reserve_permille: r,
                ..base
            },
        ));
    }
    for (scenario, spiky) in [
        ("A: victims + moderate + heavy bursters", false),
        ("B: spiky + heavy bursters", true),
    ] {
        println!("\nScenario {scenario}\n");
        println!(
            "| parameters | p99 wait (µs) | max wait (µs) | demand served (%) | heavy (req/s) | utilisation (%) |"
        );
        println!("|---|---|---|---|---|---|");
        for (name, params) in &rows {
            let o = run(params, spiky);
            println!(
                "| {name} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} |",
                o.victim_p99_us,
                o.victim_max_us,
                o.moderate_served_pct,
                o.heavy_per_s,
                o.utilisation_pct
            );
        }
    }
}
