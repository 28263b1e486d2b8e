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

use headroom_qos::PolicyKind;
use headroom_qos::bench_support::{BurstAllocation, PerIoBench, PerIoSetup};
use std::hint::black_box;
use std::str::FromStr;

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
            let mut b = PerIoBench::new(PerIoSetup {
                kind,
                volumes,
                active: volumes,
                random,
                track_invariants: std::env::var("BENCH_TRACK").map_or(true, |v| v != "off"),
                high_baseline: false,
            });
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
