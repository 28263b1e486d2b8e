//! `headroom lab run`: a scenario file run on real I/O. For each policy (and variant) the lab
//! starts its own Headroom server with an emulated device carrying the scenario's cost model
//! (lab_plan.rs), creates the scenario's volumes with their QoS through the API, drives every
//! tenant from this process with `headroom-lab`, checks the server's counters against the
//! generator's, stops the server by PID, and reports in the JSON shape of `sim run`, so the
//! two can be read side by side. With `--target URL` it runs against a server already running
//! (its own policy) instead. Peers (qemu-storage-daemon, nbdkit) are further rows
//! (lab_peers.rs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use headroom_lab::{GroupLoad, GroupOutcome, RunOutcome, RunPlan, Target, TenantLoad};
use headroom_sim::GroupResult;
use headroom_sim::Scenario;
use headroom_sim::plot::{Series, line_chart};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use crate::lab_peers;
use crate::lab_plan::{self, NotHonoured, Plan};
use crate::lab_server::{self, HeadroomServer};
use crate::output::{emit, print_json};

#[derive(Subcommand, Debug)]
pub enum LabCommand {
    /// Run a scenario file (the format of `sim run`) on real I/O against real servers.
    Run {
        /// Scenario TOML (see scenarios/).
        file: PathBuf,
        /// Seed of every tenant's operations, sizes, offsets, arrivals and phases.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Policies to run (repeatable): the server's (off, wild, base, credit, burst, mclock,
        /// drr-vop; fifo = off) or a peer (qsd-static, qsd-burst, nbdkit-rate); default: the
        /// scenario's list.
        #[arg(long = "policy")]
        policies: Vec<String>,
        /// Print the JSON report instead of a table.
        #[arg(long)]
        json: bool,
        /// Folder for report.json, summary.txt, timeline.csv and SVG plots.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Run against this already running Headroom API (its own policy and device) instead
        /// of starting servers.
        #[arg(long, value_name = "URL")]
        target: Option<String>,
        /// API token of the --target server.
        #[arg(long, env = "HEADROOM_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
}

/// The report: `sim run`'s shape, plus what the lab could not honour.
#[derive(Debug, Serialize)]
pub struct LabReport {
    pub scenario: String,
    pub seed: u64,
    pub results: Vec<LabResult>,
    /// Scenario keys the lab did not honour, or only approximately.
    pub not_honoured: Vec<NotHonoured>,
}

/// One (variant, policy or peer).
#[derive(Debug, Serialize)]
pub struct LabResult {
    pub policy: String,
    pub groups: Vec<GroupResult>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub variant: String,
    pub details: LabDetails,
    #[serde(skip)]
    series: Vec<GroupSeries>,
}

/// A group's name, timeline `(s, IOPS)` and latency CDF `(µs, fraction)`, for the plots.
type GroupSeries = (String, Vec<(f64, f64)>, Vec<(f64, f64)>);

/// How the run went.
#[derive(Debug, Serialize)]
pub struct LabDetails {
    /// `headroom`, `qemu-storage-daemon` or `nbdkit`.
    pub server: String,
    /// PID of the server process the lab started (and stopped) for this row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_pid: Option<u32>,
    /// Wall time from the first request to the last reply, s.
    pub elapsed_s: f64,
    /// The generator's own CPU per completed I/O, ns.
    pub generator_cpu_ns_per_io: f64,
    /// The generator's CPU over the run, as a share of one core.
    pub generator_cpu_cores: f64,
    pub groups: Vec<LabGroupDetails>,
}

/// A group's counts over the whole run (warm-up and drain included).
#[derive(Debug, Serialize)]
pub struct LabGroupDetails {
    pub name: String,
    pub tenants: usize,
    /// I/Os in the statistics window.
    pub ios: u64,
    pub errors: u64,
    /// Open-loop arrivals dropped (backlog full) and never sent (backlog at the end).
    pub dropped: u64,
    pub unsent: u64,
    pub generator_reads: u64,
    pub generator_writes: u64,
    /// What the server's `/metrics` counted for the group's volumes (Headroom only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_reads: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_writes: Option<u64>,
}

/// Runs the command.
pub fn run(command: LabCommand) -> Result<()> {
    let LabCommand::Run {
        file,
        seed,
        policies,
        json,
        out,
        target,
        token,
    } = command;
    let scenario =
        Scenario::load(&file).with_context(|| format!("loading scenario {}", file.display()))?;
    let requested = policies.clone();
    let policies = if policies.is_empty() {
        scenario.default_policies()
    } else {
        policies
    };
    for p in &policies {
        if !lab_peers::is_peer(p) && lab_plan::server_policy(p).is_none() {
            bail!(
                "--policy {p}: neither a policy of the live server (off, wild, base, credit, burst, mclock, drr-vop; fifo = off) nor a peer ({})",
                lab_peers::PEERS.join(", ")
            );
        }
    }
    if target.is_some() && policies.iter().any(|p| lab_peers::is_peer(p)) {
        bail!("--target runs against one server: peers cannot be combined with it");
    }
    // Every variant is translated before anything starts, so a bad file fails at once.
    let mut plans = Vec::new();
    for (variant, spec) in scenario.variants() {
        plans.push(lab_plan::plan(&file, variant, spec, seed)?);
    }
    let mut not_honoured: Vec<NotHonoured> = Vec::new();
    for n in plans.iter().flat_map(|p| &p.not_honoured) {
        if !not_honoured.iter().any(|m| m.key == n.key) {
            not_honoured.push(n.clone());
        }
    }
    if policies.iter().any(|p| p.starts_with("qsd-")) || policies.iter().any(|p| p == "nbdkit-rate")
    {
        not_honoured.push(NotHonoured {
            key: "node.devices (peer rows)".into(),
            reason: "qemu-storage-daemon and nbdkit have no emulated device: their rows run at this machine's RAM and CPU speed".into(),
        });
    }
    if policies.iter().any(|p| p == "nbdkit-rate") {
        not_honoured.push(NotHonoured {
            key: "groups.*.qos (nbdkit-rate row)".into(),
            reason: "nbdkit's rate filter limits bandwidth only: each tenant gets its baseline bytes/s (else its ceiling), no IOPS limit, no burst".into(),
        });
    }
    if target.is_some() {
        not_honoured.push(NotHonoured {
            key: "node".into(),
            reason: "--target runs on the target's own device, scheduler workers and capacity"
                .into(),
        });
    }
    if target.is_some() && requested.is_empty() {
        not_honoured.push(NotHonoured {
            key: "policies".into(),
            reason: "--target runs the target's own policy (the row's \"policy\"), not the scenario's list".into(),
        });
    }
    for n in &not_honoured {
        eprintln!("lab: not honoured: {}: {}", n.key, n.reason);
    }
    let runs: Vec<(usize, String)> = if target.is_some() {
        (0..plans.len()).map(|i| (i, String::new())).collect()
    } else {
        (0..plans.len())
            .flat_map(|i| policies.iter().map(move |p| (i, p.clone())))
            .collect()
    };
    let bar = ProgressBar::with_draw_target(Some(1000), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {percent:>3}% {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    let mut results = Vec::new();
    let total = runs.len().max(1) as f64;
    for (done, (index, policy)) in runs.iter().enumerate() {
        let plan = &plans[*index];
        let label = if plan.variant.is_empty() {
            policy.clone()
        } else {
            format!("{policy} [{}]", plan.variant)
        };
        bar.set_message(format!("{} {label}", scenario.name()));
        let progress_bar = bar.clone();
        let progress: Box<dyn Fn(f64) + Send + Sync> = Box::new(move |f: f64| {
            progress_bar.set_position(((done as f64 + f) / total * 1000.0) as u64);
        });
        let result = match &target {
            Some(url) => run_target(plan, url, token.as_deref(), &requested, seed, progress),
            None if lab_peers::is_peer(policy) => lab_peers::run_peer(plan, policy, seed, progress),
            None => run_headroom(plan, policy, seed, progress),
        };
        let result = match result {
            Ok(r) => r,
            Err(e) => {
                bar.finish_and_clear();
                return Err(e.context(format!(
                    "lab run of {} ({label}, seed {seed})",
                    file.display()
                )));
            }
        };
        results.push(result);
    }
    bar.finish_and_clear();
    let report = LabReport {
        scenario: scenario.name().to_string(),
        seed,
        results,
        not_honoured,
    };
    if let Some(dir) = &out {
        write_outputs(&report, dir)?;
    }
    if json {
        print_json(&report)
    } else {
        emit(&table(&report));
        Ok(())
    }
}

/// A volume name for tenant `i` of a group: `lab-GROUP-i`, within the API's rules.
pub fn volume_name(prefix: &str, group: &str, i: u32) -> String {
    let clean: String = group
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let suffix = format!("-{i}");
    let mut name = format!("{prefix}{clean}");
    name.truncate(64 - suffix.len());
    name + &suffix
}

/// The generator's groups; tenant `i` of a group goes to `target(group, i)`.
pub fn group_loads(plan: &Plan, seed: u64, target: impl Fn(&str, u32) -> Target) -> Vec<GroupLoad> {
    plan.groups
        .iter()
        .enumerate()
        .map(|(gi, g)| GroupLoad {
            name: g.name.clone(),
            tenants: match g.mode {
                None => Vec::new(),
                Some(mode) => (0..g.tenants)
                    .map(|ti| TenantLoad {
                        target: target(&g.name, ti),
                        mode,
                        sizes: g.sizes.clone(),
                        read_permille: g.read_permille,
                        region_bytes: g.region_bytes,
                        sequential: g.sequential,
                        phases: g.phases[ti as usize].clone(),
                        seed: headroom_lab::SplitMix64::new(
                            seed ^ ((gi as u64) << 32 | u64::from(ti)).wrapping_mul(0x9e37_79b9),
                        )
                        .next_u64(),
                    })
                    .collect(),
            },
            stats_from: g.stats_from,
            stats_to: g.stats_to,
        })
        .collect()
}

/// Runs the generator on a fresh current-thread runtime (one core for the load; the server
/// has the rest).
pub fn drive(
    groups: &[GroupLoad],
    plan: &Plan,
    progress: Box<dyn Fn(f64) + Send + Sync>,
) -> Result<RunOutcome> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the generator's runtime")?;
    let run_plan = RunPlan {
        duration: plan.duration,
        timeline_bucket: plan.timeline,
        drain_timeout: Duration::from_secs(30),
    };
    runtime
        .block_on(headroom_lab::run(groups, run_plan, Some(progress)))
        .map_err(anyhow::Error::from)
}

/// A scratch directory for one server, removed when dropped.
#[derive(Debug)]
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Result<Scratch> {
        Self::under(&std::env::temp_dir(), tag)
    }

    /// A scratch directory under `base` (e.g. /dev/shm for images that must be in RAM).
    pub fn under(base: &Path, tag: &str) -> Result<Scratch> {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = base.join(format!("headroom-lab-{}-{n}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run_headroom(
    plan: &Plan,
    policy: &str,
    seed: u64,
    progress: Box<dyn Fn(f64) + Send + Sync>,
) -> Result<LabResult> {
    let server_policy = lab_plan::server_policy(policy).context("policy")?;
    let scratch = Scratch::new(&server_policy)?;
    let token = lab_server::lab_token()?;
    let mut server =
        lab_server::start_headroom(&scratch.0, &plan.server_config, &server_policy, &token)?;
    let outcome = measure(&server, plan, &token, seed, "lab-", progress);
    let outcome = match outcome {
        Ok(o) => o,
        Err(e) => {
            let tail = server.guard.log_tail();
            return Err(e.context(format!("server log (last lines):\n{tail}")));
        }
    };
    let pid = server.guard.pid();
    let status = server.guard.stop();
    if !status.is_some_and(|s| s.success()) {
        eprintln!(
            "lab: warning: {} (PID {pid}) exited with {status:?}; log tail:\n{}",
            server.guard.name,
            server.guard.log_tail()
        );
    }
    let (run, server_counts) = outcome;
    let mut row = result(policy, plan, "headroom", &run, Some(&server_counts));
    row.details.server_pid = Some(pid);
    Ok(row)
}

/// Creates the volumes, runs the load, reads the server's counters.
fn measure(
    server: &HeadroomServer,
    plan: &Plan,
    token: &str,
    seed: u64,
    prefix: &str,
    progress: Box<dyn Fn(f64) + Send + Sync>,
) -> Result<(RunOutcome, Vec<(u64, u64)>)> {
    for g in &plan.groups {
        for i in 0..g.tenants {
            lab_server::create_volume(
                &server.api,
                &volume_name(prefix, &g.name, i),
                g.volume_bytes,
                &g.qos,
            )?;
        }
    }
    let loads = group_loads(plan, seed, |g, i| Target {
        addr: server.nbd.clone(),
        export: volume_name(prefix, g, i),
    });
    let run = drive(&loads, plan, progress)?;
    let ops = lab_server::volume_ops(&server.api_url, token)?;
    let counts = plan
        .groups
        .iter()
        .map(|g| {
            (0..g.tenants)
                .filter_map(|i| ops.get(&volume_name(prefix, &g.name, i)))
                .fold((0, 0), |(r, w), (a, b)| (r + a, w + b))
        })
        .collect();
    Ok((run, counts))
}

/// One run against an already running server. `requested`: the `--policy` values given (none:
/// the target's own policy is run, whatever the scenario lists; given: it must be the target's).
fn run_target(
    plan: &Plan,
    url: &str,
    token: Option<&str>,
    requested: &[String],
    seed: u64,
    progress: Box<dyn Fn(f64) + Send + Sync>,
) -> Result<LabResult> {
    let token =
        token.context("--target needs the server's API token (--token or HEADROOM_TOKEN)")?;
    let api = lab_server::api_client(url, token)?;
    let node = api.get_json("/v1/node")?;
    let nbd = node["nbd_listen"]
        .as_str()
        .context("GET /v1/node: no nbd_listen")?
        .to_string();
    let policy = node["policy"].as_str().unwrap_or("unknown").to_string();
    let asked: Vec<String> = requested
        .iter()
        .filter_map(|p| lab_plan::server_policy(p))
        .collect();
    if !asked.is_empty() && (asked.len() > 1 || asked[0] != policy) {
        bail!(
            "--target {url} runs policy {policy}; --policy {} cannot be honoured against it (start that server with --policy, or leave --policy out)",
            requested.join(", --policy ")
        );
    }

    let server = HeadroomServer {
        guard: lab_server::ChildGuard::detached(),
        nbd,
        api,
        api_url: url.trim_end_matches('/').to_string(),
    };
    let prefix = format!("lab{}-", std::process::id());
    let outcome = measure(&server, plan, token, seed, &prefix, progress);
    for g in &plan.groups {
        for i in 0..g.tenants {
            let _ = server.api.delete(&volume_name(&prefix, &g.name, i));
        }
    }
    let (run, counts) = outcome?;
    Ok(result(
        &policy,
        plan,
        "headroom (--target)",
        &run,
        Some(&counts),
    ))
}

/// The JSON numbers of one group.
fn group_result(g: &GroupOutcome) -> GroupResult {
    let h = &g.latency_us;
    let q = |q: f64| {
        if h.is_empty() {
            0.0
        } else {
            h.value_at_quantile(q) as f64
        }
    };
    GroupResult {
        name: g.name.clone(),
        iops: g.iops(),
        bytes_per_s: g.bytes_per_s(),
        lat_mean_us: if h.is_empty() { 0.0 } else { h.mean() },
        lat_p50_us: q(0.5),
        lat_p99_us: q(0.99),
        lat_p999_us: q(0.999),
    }
}

pub fn result(
    policy: &str,
    plan: &Plan,
    server: &str,
    run: &RunOutcome,
    server_counts: Option<&[(u64, u64)]>,
) -> LabResult {
    let bucket_s = plan.timeline.as_secs_f64();
    let series = run
        .groups
        .iter()
        .map(|g| {
            let timeline = g
                .timeline
                .iter()
                .enumerate()
                .map(|(i, b)| ((i as f64 + 1.0) * bucket_s, b.ios as f64 / bucket_s))
                .collect();
            let total = g.latency_us.len().max(1) as f64;
            let mut seen = 0u64;
            let cdf = g
                .latency_us
                .iter_recorded()
                .map(|v| {
                    seen += v.count_at_value();
                    (v.value_iterated_to() as f64, seen as f64 / total)
                })
                .collect();
            (g.name.clone(), timeline, cdf)
        })
        .collect();
    LabResult {
        policy: policy.to_string(),
        groups: run.groups.iter().map(group_result).collect(),
        variant: plan.variant.clone(),
        details: LabDetails {
            server: server.to_string(),
            server_pid: None,
            elapsed_s: run.elapsed.as_secs_f64(),
            generator_cpu_ns_per_io: run.cpu_ns_per_io(),
            generator_cpu_cores: run.cpu_ns as f64 / 1e9 / run.elapsed.as_secs_f64().max(1e-9),
            groups: run
                .groups
                .iter()
                .enumerate()
                .map(|(i, g)| LabGroupDetails {
                    name: g.name.clone(),
                    tenants: g.tenants,
                    ios: g.ios,
                    errors: g.errors,
                    dropped: g.dropped,
                    unsent: g.unsent,
                    generator_reads: g.total_reads,
                    generator_writes: g.total_writes,
                    server_reads: server_counts.and_then(|c| c.get(i)).map(|c| c.0),
                    server_writes: server_counts.and_then(|c| c.get(i)).map(|c| c.1),
                })
                .collect(),
        },
        series,
    }
}

fn label(r: &LabResult) -> String {
    if r.variant.is_empty() {
        r.policy.clone()
    } else {
        format!("{} [{}]", r.policy, r.variant)
    }
}

fn table(report: &LabReport) -> String {
    let rows: Vec<(String, &GroupResult)> = report
        .results
        .iter()
        .flat_map(|r| r.groups.iter().map(move |g| (label(r), g)))
        .collect();
    let mut text = crate::sim_cmd::results_table(&report.scenario, report.seed, &rows);
    for r in &report.results {
        text.push_str(&format!(
            "{}: generator {:.0} ns CPU per I/O ({:.2} cores)\n",
            label(r),
            r.details.generator_cpu_ns_per_io,
            r.details.generator_cpu_cores
        ));
    }
    if !report.not_honoured.is_empty() {
        text.push_str("not honoured (see stderr or --json): ");
        text.push_str(
            &report
                .not_honoured
                .iter()
                .map(|n| n.key.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        );
        text.push('\n');
    }
    text
}

/// `report.json`, `summary.txt`, `timeline.csv`, and per result `timeline_TAG.svg` (IOPS
/// over time per group) and `latency_cdf_TAG.svg`, drawn with the simulator's plotter.
fn write_outputs(report: &LabReport, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    write("report.json", &serde_json::to_string_pretty(report)?)?;
    write("summary.txt", &table(report))?;
    let mut csv = String::from("variant,policy,group,t_s,iops\n");
    let mut tags: BTreeMap<String, usize> = BTreeMap::new();
    for r in &report.results {
        let raw = label(r);
        let mut tag: String = raw
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let seen = tags.entry(tag.clone()).or_default();
        *seen += 1;
        if *seen > 1 {
            tag = format!("{tag}_{seen}");
        }
        for (name, timeline, _) in &r.series {
            for (t, iops) in timeline {
                csv.push_str(&format!(
                    "{},{},{name},{t:.4},{iops:.3}\n",
                    r.variant, r.policy
                ));
            }
        }
        let timeline: Vec<Series> = r
            .series
            .iter()
            .map(|(name, points, _)| Series {
                name: name.clone(),
                points: points.clone(),
            })
            .collect();
        write(
            &format!("timeline_{tag}.svg"),
            &line_chart(
                &format!("{} (lab): throughput over time ({raw})", report.scenario),
                "time (s)",
                "IOPS",
                &timeline,
                false,
            ),
        )?;
        let cdf: Vec<Series> = r
            .series
            .iter()
            .map(|(name, _, points)| Series {
                name: name.clone(),
                points: points.clone(),
            })
            .collect();
        write(
            &format!("latency_cdf_{tag}.svg"),
            &line_chart(
                &format!("{} (lab): latency CDF ({raw})", report.scenario),
                "latency (us, log scale)",
                "fraction of I/Os",
                &cdf,
                true,
            ),
        )?;
    }
    write("timeline.csv", &csv)?;
    Ok(())
}
