//! Simulator speed on one core for a 1,000-tenant node.
//!
//! `cargo run -p headroom-sim --release --example speed -- [POLICY ...] [--hour] [--one-to-one] [--seconds=S] [--untracked]`
//!
//! Default: 1,000 tenants in closed loop (QD 2, 4–16 KiB, 70 % reads) on 8 workers with
//! 1-to-N dispatch for 20 simulated seconds; prints simulated I/Os per second per policy.
//! `--hour`: one simulated hour of 1,000 tenants at 100 IOPS each (100k IOPS, open loop), the
//! issue's "one hour in under two minutes" check (`--seconds=S` shortens it). `--one-to-one`:
//! each tenant's queue pinned to one worker (each worker's policy holds 125 volumes) instead
//! of 1-to-N (every worker's policy holds all 1,000, so the per-volume state is eight times
//! larger). `--untracked`: the policies run with `track_invariants = false` (they skip the
//! per-volume bookkeeping that only `check_invariants` reads; no decision changes).
//!
//! Columns: `cpu_s` is the CPU time the run took on its one thread (Linux
//! `/proc/thread-self/schedstat`, nanosecond resolution; `nan` elsewhere), `wall_s` the
//! wall-clock time; `M_ios_per_cpu_s` is the issue's "simulated I/Os per second on one core"
//! (on a shared machine it is the steadier of the two), `M_ios_per_wall_s` the same per
//! wall-clock second. `events_per_io` and `next_calls_per_io` count the simulator's events and
//! the policies' answers (dispatch, wait, idle) per completed I/O; an idle answer may come from
//! `queued_requests() == 0` without a `next` call.

use headroom_sim::{RunOptions, Scenario, run};

/// CPU time this thread has used so far, seconds (Linux only).
fn thread_cpu_s() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(f64::NAN, |ns| ns as f64 / 1e9)
}

fn scenario(hour: bool, dispatch: &str, seconds: Option<f64>, tracked: bool) -> String {
    let (duration, workload) = if hour {
        (
            seconds.unwrap_or(3600.0),
            r#"{ mode = "open", rate_iops = 100.0, sizes = "iops", read_fraction = 0.7 }"#,
        )
    } else {
        (
            seconds.unwrap_or(20.0),
            r#"{ mode = "closed", qd = 2, sizes = "iops", read_fraction = 0.7 }"#,
        )
    };
    format!(
        r#"
        name = "speed"
        duration_s = {duration}
        timeline_ms = 1000.0
        check_invariants_ms = 0.0
        [policy_params]
        track_invariants = {tracked}
        [node]
        workers = 8
        dispatch = "{dispatch}"
        [[node.devices]]
        profile = "ssd_fast"
        latency_ns = 80000
        count = 8
        [[groups]]
        name = "tenants"
        tenants = 1000
        qos = {{ baseline_iops = 1000.0, ceiling_iops = 20000.0, burst = "on_demand" }}
        workload = {workload}
    "#
    )
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let hour = args.iter().any(|a| a == "--hour");
    let dispatch = if args.iter().any(|a| a == "--one-to-one") {
        "one_to_one"
    } else {
        "one_to_n"
    };
    let seconds = args
        .iter()
        .find_map(|a| a.strip_prefix("--seconds="))
        .and_then(|v| v.parse::<f64>().ok());
    let tracked = !args.iter().any(|a| a == "--untracked");
    let mut policies: Vec<String> = args.into_iter().filter(|a| !a.starts_with("--")).collect();
    if policies.is_empty() {
        policies = vec!["fifo".into(), "wild".into(), "base".into(), "burst".into()];
    }
    let s = match Scenario::from_toml_str(&scenario(hour, dispatch, seconds, tracked)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "policy  dispatch    simulated_ios   cpu_s  wall_s  M_ios_per_cpu_s  M_ios_per_wall_s  events_per_io  sim_iops  next_calls_per_io"
    );
    for p in policies {
        let started = std::time::Instant::now();
        let cpu_started = thread_cpu_s();
        let r = run(
            &s,
            RunOptions {
                seed: 1,
                policies: vec![p.clone()],
                ..RunOptions::default()
            },
        );
        let wall = started.elapsed().as_secs_f64();
        let cpu = thread_cpu_s() - cpu_started;
        match r {
            Ok(r) => {
                let d = &r.results[0].details;
                let ios = d.completed_ios.max(1) as f64;
                // Every answer is a dispatch, a wait or an idle (dispatches = completions).
                let (waits, idles) = d.workers.iter().fold((0, 0), |(w, i), wk| {
                    let [waits, idles, _] = wk.policy_waits_idles_past;
                    (w + waits, i + idles)
                });
                let next_calls = d.completed_ios + waits + idles;
                println!(
                    "{p:7} {dispatch:10} {:14} {cpu:7.2} {wall:7.2} {:16.2} {:17.2} {:14.2} {:9.0} {:18.2} (waits {:.2}, idles {:.2})",
                    d.completed_ios,
                    d.completed_ios as f64 / cpu / 1e6,
                    d.completed_ios as f64 / wall / 1e6,
                    d.events as f64 / ios,
                    d.node_iops,
                    next_calls as f64 / ios,
                    waits as f64 / ios,
                    idles as f64 / ios
                );
            }
            Err(e) => eprintln!("{p}: error: {e}"),
        }
    }
}
