//! Simulator speed on one core for a 1,000-tenant node.
//!
//! `cargo run -p headroom-sim --release --example speed -- [POLICY ...] [--hour]`
//!
//! Default: 1,000 tenants in closed loop (QD 2, 4–16 KiB, 70 % reads) on 8 workers with
//! 1-to-N dispatch for 20 simulated seconds; prints simulated I/Os per wall-clock second per
//! policy. `--hour`: one simulated hour of 1,000 tenants at 100 IOPS each (100k IOPS, open
//! loop), the issue's "one hour in under two minutes" check.

use headroom_sim::{RunOptions, Scenario, run};

fn scenario(hour: bool) -> String {
    let (duration, workload) = if hour {
        (
            3600.0,
            r#"{ mode = "open", rate_iops = 100.0, sizes = "iops", read_fraction = 0.7 }"#,
        )
    } else {
        (
            20.0,
            r#"{ mode = "closed", qd = 2, sizes = "iops", read_fraction = 0.7 }"#,
        )
    };
    format!(
        r#"
        name = "speed"
        duration_s = {duration}
        timeline_ms = 1000.0
        check_invariants_ms = 0.0
        [node]
        workers = 8
        dispatch = "one_to_n"
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
    let mut policies: Vec<String> = args.into_iter().filter(|a| a != "--hour").collect();
    if policies.is_empty() {
        policies = vec!["fifo".into(), "wild".into(), "base".into(), "burst".into()];
    }
    let s = match Scenario::from_toml_str(&scenario(hour)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    println!("policy  simulated_ios  wall_s  M_ios_per_s  events_per_io  sim_iops");
    for p in policies {
        let started = std::time::Instant::now();
        let r = run(
            &s,
            RunOptions {
                seed: 1,
                policies: vec![p.clone()],
                ..RunOptions::default()
            },
        );
        let wall = started.elapsed().as_secs_f64();
        match r {
            Ok(r) => {
                let d = &r.results[0].details;
                println!(
                    "{p:7} {:13} {wall:7.2} {:12.2} {:14.2} {:9.0}",
                    d.completed_ios,
                    d.completed_ios as f64 / wall / 1e6,
                    d.events as f64 / d.completed_ios.max(1) as f64,
                    d.node_iops
                );
            }
            Err(e) => eprintln!("{p}: error: {e}"),
        }
    }
}
