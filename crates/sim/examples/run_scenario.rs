//! Stand-in for `headroom sim run` until the CLI wires the library in:
//! `cargo run -p headroom-sim --release --example run_scenario -- FILE [--seed N]
//! [--policy P ...] [--json] [--out DIR]`.

use headroom_sim::{RunOptions, Scenario, run};
use std::io::Write;
use std::path::PathBuf;

fn main() {
    let mut args = std::env::args().skip(1);
    let mut file = None;
    let mut seed = 1u64;
    let mut policies = Vec::new();
    let mut json = false;
    let mut out = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seed" => seed = args.next().and_then(|s| s.parse().ok()).unwrap_or(1),
            "--policy" => policies.extend(args.next()),
            "--json" => json = true,
            "--out" => out = args.next().map(PathBuf::from),
            _ => file = Some(PathBuf::from(a)),
        }
    }
    let Some(file) = file else {
        eprintln!("usage: run_scenario FILE [--seed N] [--policy P ...] [--json] [--out DIR]");
        std::process::exit(2);
    };
    let scenario = match Scenario::load(&file) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let started = std::time::Instant::now();
    let mut last = 0.0;
    let progress = Box::new(move |f: f64| {
        if f - last >= 0.05 || f >= 1.0 {
            last = f;
            eprint!("\r{:5.1} %", f * 100.0);
            let _ = std::io::stderr().flush();
        }
    });
    let report = run(
        &scenario,
        RunOptions {
            seed,
            policies,
            out_dir: out,
            progress: Some(progress),
        },
    );
    eprintln!();
    match report {
        Ok(r) => {
            if json {
                match serde_json::to_string(&r) {
                    Ok(s) => println!("{s}"),
                    Err(e) => eprintln!("error: {e}"),
                }
            } else {
                print!("{}", r.to_table());
            }
            let ios: u64 = r.results.iter().map(|p| p.details.completed_ios).sum();
            let wall = started.elapsed().as_secs_f64();
            eprintln!(
                "{ios} simulated I/Os in {wall:.2} s wall ({:.2} M I/O per s)",
                ios as f64 / wall / 1e6
            );
        }
        Err(e) => {
            eprintln!("error: {e} (seed {seed})");
            std::process::exit(1);
        }
    }
}
