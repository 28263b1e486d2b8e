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
//! per-volume invariant tracking; the default, on, is what the tests use). `BENCH_CPU=baseline`
//! (or `x86-64-v3`) runs the allocation group at a lower vector level than the CPU's
//! (`headroom_qos::cpu`).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use headroom_qos::PolicyKind;
use headroom_qos::bench_support::{BurstAllocation, PerIoBench, PerIoSetup};
use headroom_qos::cpu::CpuLevel;
use std::time::{Duration, Instant};

/// The per-I/O workload for `kind`, with the environment's switches (`BENCH_TRACK=off`,
/// `BENCH_HIGH_BASE`).
fn setup(kind: PolicyKind, volumes: u32, active: u32, random: bool) -> PerIoSetup {
    PerIoSetup {
        kind,
        volumes,
        active,
        random,
        track_invariants: std::env::var("BENCH_TRACK").map_or(true, |v| v != "off"),
        high_baseline: std::env::var("BENCH_HIGH_BASE").is_ok(),
    }
}

/// `BENCH_CPU=baseline|x86-64-v3|x86-64-v4`: the vector level of Burst's allocation (default:
/// the highest this CPU has; a level above it runs as the highest it has).
fn cpu_level() -> Option<CpuLevel> {
    let v = std::env::var("BENCH_CPU").ok()?;
    match v.parse() {
        Ok(level) => Some(level),
        Err(e) => panic!("BENCH_CPU: {e}"),
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
                    let mut b = PerIoBench::new(setup(kind, volumes, active, random));
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
            if let Some(level) = cpu_level() {
                alloc.set_cpu_level(level);
            }
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
