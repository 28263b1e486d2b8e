//! Runs the reproduction scenarios and prints the numbers `docs/results.md` quotes, next to
//! the papers' numbers: `cargo run -p headroom-sim --release --example reproduce --
//! [--seed N] [NAME ...]` (names: a-bps a-iops b c d e f g h-credits h-rotation; default all).

use headroom_sim::{PolicyResult, RunOptions, Scenario, SimReport, run};
use std::path::PathBuf;

fn load_run(file: &str, seed: u64) -> Result<SimReport, String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../scenarios")
        .join(file);
    let s = Scenario::load(&path).map_err(|e| e.to_string())?;
    run(
        &s,
        RunOptions {
            seed,
            ..RunOptions::default()
        },
    )
    .map_err(|e| e.to_string())
}

fn find<'a>(r: &'a SimReport, policy: &str, variant: &str) -> Option<&'a PolicyResult> {
    r.results
        .iter()
        .find(|p| p.policy == policy && p.variant == variant)
}

fn group<'a>(p: &'a PolicyResult, name: &str) -> Option<&'a headroom_sim::GroupResult> {
    p.groups.iter().find(|g| g.name == name)
}

fn pct_lower(ours: f64, base: f64) -> f64 {
    if base > 0.0 {
        // + 0.0 turns a negative zero into zero so that it prints as "0.0".
        (1.0 - ours / base) * 100.0 + 0.0
    } else {
        0.0
    }
}

fn victims(file: &str, seed: u64, title: &str) -> Result<(), String> {
    let r = load_run(file, seed)?;
    println!("### {title}\n");
    let variants: Vec<String> = {
        let mut v: Vec<String> = r.results.iter().map(|p| p.variant.clone()).collect();
        v.dedup();
        v
    };
    println!(
        "| variant | policy | victim mean µs | victim p99 µs | burster GB/s | burster kIOPS |"
    );
    println!("|---|---|---|---|---|---|");
    for v in &variants {
        for pol in ["wild", "base", "burst"] {
            if let Some(p) = find(&r, pol, v) {
                let (Some(vi), Some(b)) = (group(p, "victim"), group(p, "burster")) else {
                    continue;
                };
                println!(
                    "| {v} | {pol} | {:.0} | {:.0} | {:.2} | {:.0} |",
                    vi.lat_mean_us,
                    vi.lat_p99_us,
                    b.bytes_per_s / 1e9,
                    b.iops / 1e3
                );
            }
        }
        if let (Some(w), Some(b)) = (find(&r, "wild", v), find(&r, "burst", v))
            && let (Some(wv), Some(bv)) = (group(w, "victim"), group(b, "victim"))
        {
            println!(
                "| {v} | **burst vs wild** | **{:.0} % lower** | **{:.0} % lower** | | |",
                pct_lower(bv.lat_mean_us, wv.lat_mean_us),
                pct_lower(bv.lat_p99_us, wv.lat_p99_us)
            );
        }
    }
    println!();
    Ok(())
}

fn max_burst(seed: u64) -> Result<(), String> {
    let r = load_run("burstcbs-max-burst.toml", seed)?;
    println!("### (b) max burst\n");
    println!("| variant | wild GB/s | burst GB/s | wild kIOPS | burst kIOPS | burst vs wild |");
    println!("|---|---|---|---|---|---|");
    let mut variants: Vec<String> = r.results.iter().map(|p| p.variant.clone()).collect();
    variants.dedup();
    for v in &variants {
        if let (Some(w), Some(b)) = (find(&r, "wild", v), find(&r, "burst", v))
            && let (Some(wg), Some(bg)) = (group(w, "burster"), group(b, "burster"))
        {
            println!(
                "| {v} | {:.2} | {:.2} | {:.0} | {:.0} | {:.1} % lower |",
                wg.bytes_per_s / 1e9,
                bg.bytes_per_s / 1e9,
                wg.iops / 1e3,
                bg.iops / 1e3,
                pct_lower(bg.iops, wg.iops)
            );
        }
    }
    println!();
    Ok(())
}

fn targets(seed: u64) -> Result<(), String> {
    let r = load_run("burstcbs-base-targets.toml", seed)?;
    println!("### (c) base-level targets (20k IOPS)\n");
    println!("| I/O type | policy | QD1 | QD2 | QD4 | QD8 |");
    println!("|---|---|---|---|---|---|");
    let mut variants: Vec<String> = r.results.iter().map(|p| p.variant.clone()).collect();
    variants.dedup();
    let mut missed = [0usize; 3];
    let mut lowest = [f64::INFINITY; 3];
    for v in &variants {
        for (k, pol) in ["wild", "base", "burst"].iter().enumerate() {
            if let Some(p) = find(&r, pol, v) {
                let cells: Vec<f64> = ["qd1", "qd2", "qd4", "qd8"]
                    .iter()
                    .map(|g| group(p, g).map_or(0.0, |g| g.iops))
                    .collect();
                // The target "within QD 8": met if QD 8 reaches it (1 % tolerance).
                if cells[3] < 19_800.0 {
                    missed[k] += 1;
                }
                lowest[k] = lowest[k].min(cells[3]);
                println!(
                    "| {v} | {pol} | {:.0} | {:.0} | {:.0} | {:.0} |",
                    cells[0], cells[1], cells[2], cells[3]
                );
            }
        }
    }
    println!(
        "\nQD 8 misses the 20k target: wild {} of {n}, base {} of {n}, burst {} of {n}; lowest at QD 8: wild {:.0}, burst {:.0}\n",
        missed[0],
        missed[1],
        missed[2],
        lowest[0],
        lowest[2],
        n = variants.len()
    );
    Ok(())
}

fn scaling(seed: u64) -> Result<(), String> {
    let r = load_run("burstcbs-thread-scaling.toml", seed)?;
    println!("### (d) thread scaling\n");
    println!(
        "| workers | 1-to-1 MIOPS (max/min) | stealing MIOPS (max/min) | 1-to-N MIOPS (max/min) | stealing vs 1-to-N |"
    );
    println!("|---|---|---|---|---|");
    for w in [1, 2, 4, 8] {
        let get = |mode: &str| {
            find(&r, "wild", &format!("{mode}-w{w}"))
                .map(|p| (p.details.node_iops / 1e6, p.details.worker_max_min_ratio))
        };
        if let (Some(a), Some(b), Some(c)) = (get("1to1"), get("steal"), get("1toN")) {
            println!(
                "| {w} | {:.2} ({:.2}) | {:.2} ({:.2}) | {:.2} ({:.2}) | {:.0} % lower |",
                a.0,
                a.1,
                b.0,
                b.1,
                c.0,
                c.1,
                pct_lower(b.0, c.0)
            );
        }
    }
    println!();
    Ok(())
}

fn resume(seed: u64) -> Result<(), String> {
    let r = load_run("burstcbs-resume.toml", seed)?;
    println!("### (e) idle tenant resumes (45k IOPS baseline)\n");
    println!(
        "| policy | IOPS 3.0–3.5 s | first 10 ms | mean µs | p99 µs | queued in policy µs | share in baseline phase |"
    );
    println!("|---|---|---|---|---|---|---|");
    for pol in ["wild", "base", "burst"] {
        if let Some(p) = find(&r, pol, "")
            && let Some(g) = group(p, "resumer")
        {
            let gi = p
                .groups
                .iter()
                .position(|x| x.name == "resumer")
                .unwrap_or(0);
            let s = &p.series;
            let b = (3.0 / s.bucket_s).round() as usize;
            let first = s.groups[gi].buckets.get(b).map_or(0, |x| x.ops) as f64 / s.bucket_s;
            let d = &p.details.groups[gi];
            println!(
                "| {pol} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.3} |",
                g.iops,
                first,
                g.lat_mean_us,
                g.lat_p99_us,
                d.sched_wait_mean_us,
                d.phase_share.baseline
            );
        }
    }
    println!();
    Ok(())
}

fn libra(seed: u64) -> Result<(), String> {
    let r = load_run("libra-vop.toml", seed)?;
    println!("### (f) Libra allocation accuracy\n");
    println!("| cost model | min/max device time across the 10 tenants | device busy |");
    println!("|---|---|---|");
    for p in &r.results {
        println!(
            "| {} | {:.3} | {:.2} |",
            p.variant, p.details.tenant_device_time_min_max_ratio, p.details.device_utilisation
        );
    }
    println!();
    Ok(())
}

fn fast(seed: u64) -> Result<(), String> {
    let r = load_run("fast-replicas.toml", seed)?;
    println!("### (g) FAST replica assignment\n");
    println!("| assignment | RR IOPS (ms) | SR IOPS (ms) | RW IOPS (ms) | SW IOPS (ms) |");
    println!("|---|---|---|---|---|");
    for p in &r.results {
        let cell = |n: &str| {
            group(p, n).map_or("-".to_string(), |g| {
                format!("{:.0} ({:.0})", g.iops, g.lat_mean_us / 1e3)
            })
        };
        println!(
            "| {} | {} | {} | {} | {} |",
            p.variant,
            cell("RR"),
            cell("SR"),
            cell("RW"),
            cell("SW")
        );
    }
    println!();
    Ok(())
}

fn credits(seed: u64) -> Result<(), String> {
    let r = load_run("gp2-credits.toml", seed)?;
    println!("### (h) gp2 credit timeline\n");
    let Some(p) = find(&r, "credit", "") else {
        return Err("no credit result".into());
    };
    let s = &p.series;
    let b = &s.groups[0].buckets;
    let rate = |i: usize| b[i].ops as f64 / s.bucket_s;
    let first_below = |from: usize| (from..b.len()).find(|&i| rate(i) < 1_000.0);
    let start2 = (20_400.0 / s.bucket_s) as usize;
    let d1 = first_below(1).map_or(0.0, |i| i as f64 * s.bucket_s);
    let d2 = first_below(start2 + 1).map_or(0.0, |i| i as f64 * s.bucket_s - 20_400.0);
    println!(
        "first burst at {:.0} IOPS lasted {d1:.0} s, then {:.0} IOPS; after 18,000 s idle the second burst lasted {d2:.0} s\n",
        rate(10),
        rate((2_200.0 / s.bucket_s) as usize)
    );
    let r = load_run("gp2-rotation.toml", seed)?;
    println!(
        "| tenant (100 GiB) | IOPS 2,000–3,800 s | GiB-hours | volumes created | rebuilds copied | copy s (mean, max) | old volume held s (mean) |"
    );
    println!("|---|---|---|---|---|---|---|");
    if let Some(p) = find(&r, "credit", "") {
        for (g, d) in p.groups.iter().zip(&p.details.groups) {
            let rebuild = d.rebuild.as_ref().map_or("| - | - | -".to_string(), |b| {
                format!(
                    "| {} of {} | {:.1}, {:.1} | {:.1}",
                    b.copied, b.started, b.copy_s_mean, b.copy_s_max, b.overlap_s_mean
                )
            });
            println!(
                "| {} | {:.0} | {:.1} | {} {rebuild} |",
                g.name, g.iops, d.provisioned_gib_hours, d.volumes_created
            );
        }
        if let (Some(a), Some(b)) = (group(p, "single"), group(p, "rotated")) {
            let ca = p.details.groups[0].provisioned_gib_hours;
            let cb = p.details.groups[1].provisioned_gib_hours;
            println!(
                "\nrotation: {:.1}x the IOPS for {:+.1} % cost\n",
                b.iops / a.iops,
                (cb / ca - 1.0) * 100.0
            );
        }
    }
    Ok(())
}

fn main() {
    let mut seed = 1u64;
    let mut names = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--seed" {
            seed = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
        } else {
            names.push(a);
        }
    }
    let all = ["a-bps", "a-iops", "b", "c", "d", "e", "f", "g", "h-credits"];
    let chosen: Vec<String> = if names.is_empty() {
        all.iter().map(|s| s.to_string()).collect()
    } else {
        names
    };
    for n in chosen {
        let res = match n.as_str() {
            "a-bps" => victims(
                "burstcbs-victims.toml",
                seed,
                "(a) victims next to BPS-intensive bursters",
            ),
            "a-iops" => victims(
                "burstcbs-victims-iops.toml",
                seed,
                "(a) victims next to IOPS-intensive bursters",
            ),
            "b" => max_burst(seed),
            "c" => targets(seed),
            "d" => scaling(seed),
            "e" => resume(seed),
            "f" => libra(seed),
            "g" => fast(seed),
            "h-credits" | "h" => credits(seed),
            other => Err(format!("unknown reproduction {other}")),
        };
        if let Err(e) = res {
            eprintln!("{n}: error: {e} (seed {seed})");
        }
    }
}
