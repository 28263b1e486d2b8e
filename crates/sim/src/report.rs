//! Results of a simulation: the JSON object of the issue, a text table, CSV files and plots.
//!
//! `SimReport` serialises to exactly `{"scenario", "seed", "results": [{"policy", "groups":
//! [{"name", "iops", "bytes_per_s", "lat_mean_us", "lat_p50_us", "lat_p99_us",
//! "lat_p999_us"}]}]}`; everything else (per-worker balance, phase shares, utilisations) sits
//! under other keys of each result so that consumers of the required shape are unaffected.
//! Time series and per-tenant numbers are kept out of the JSON and written as files.

use crate::error::SimError;
use crate::histogram::Histogram;
use crate::node::{RunData, TenantSummary, TimelineBucket};
use crate::plot::{Series, line_chart, stacked_chart};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;

/// The outcome of `run`: one entry per (variant, policy).
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    /// Scenario name.
    pub scenario: String,
    /// Seed of the run.
    pub seed: u64,
    /// One result per policy (and variant).
    pub results: Vec<PolicyResult>,
}

/// Results of one policy.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyResult {
    /// Policy name.
    pub policy: String,
    /// One entry per tenant group, in scenario order.
    pub groups: Vec<GroupResult>,
    /// Variant name (absent when the scenario has no variants).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub variant: String,
    /// Node-level details.
    pub details: RunDetails,
    /// Time series and per-tenant numbers (not serialised; written as CSV).
    #[serde(skip)]
    pub series: RunSeries,
}

/// Throughput and latency of one tenant group.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct GroupResult {
    /// Group name.
    pub name: String,
    /// Completed I/Os per second (whole group).
    pub iops: f64,
    /// Completed payload bytes per second (whole group).
    pub bytes_per_s: f64,
    /// Mean latency, µs.
    pub lat_mean_us: f64,
    /// Median latency, µs.
    pub lat_p50_us: f64,
    /// 99th percentile latency, µs.
    pub lat_p99_us: f64,
    /// 99.9th percentile latency, µs.
    pub lat_p999_us: f64,
}

/// Share of a group's I/Os dispatched in each phase.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct PhaseShare {
    /// Within the baseline.
    pub baseline: f64,
    /// Paid with burst credits.
    pub burst_credit: f64,
    /// On spare capacity.
    pub burst_spare: f64,
}

/// Extra numbers of one group.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct GroupDetails {
    /// Group name.
    pub name: String,
    /// Tenants in the group.
    pub tenants: usize,
    /// I/Os counted.
    pub ios: u64,
    /// Largest latency, µs.
    pub lat_max_us: f64,
    /// Phase shares.
    pub phase_share: PhaseShare,
    /// Lowest per-tenant IOPS.
    pub tenant_iops_min: f64,
    /// Highest per-tenant IOPS.
    pub tenant_iops_max: f64,
    /// min/max of per-tenant IOPS (1 = perfectly even).
    pub tenant_iops_min_max_ratio: f64,
    /// min/max of per-tenant bytes/s.
    pub tenant_bytes_min_max_ratio: f64,
    /// Open-loop arrivals dropped (backlog full).
    pub dropped: u64,
    /// Mean time queued in the policy (issue to dispatch), µs.
    pub sched_wait_mean_us: f64,
    /// Mean time queued after dispatch (NIC and device queues), µs.
    pub downstream_wait_mean_us: f64,
    /// min/max of per-tenant device time per second (1 = every tenant got the same share of
    /// the device, Libra's accuracy measure).
    pub tenant_device_time_min_max_ratio: f64,
    /// Volumes created over the run.
    pub volumes_created: u64,
    /// Provisioned capacity over the whole run, GiB-hours.
    pub provisioned_gib_hours: f64,
    /// Mirror rebuilds (only for groups an action rebuilds); their I/O is not in the
    /// group's IOPS, bytes or latencies, which are what the tenants see.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<RebuildDetails>,
}

/// What the mirror rebuilds of one group cost, over the whole run (not only the statistics
/// window: a rebuild is an event, and its cost is what rotation pays per replacement).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RebuildDetails {
    /// Rebuilds started (one per replaced volume).
    pub started: u64,
    /// Rebuilds whose copy finished before the end of the run.
    pub copied: u64,
    /// Replacements skipped because the tenant's previous rebuild still held its old volume.
    pub skipped: u64,
    /// Bytes the copies wrote to new volumes.
    pub bytes_copied: u64,
    /// Copy reads from old volumes.
    pub copy_reads: u64,
    /// Copy writes to new volumes.
    pub copy_writes: u64,
    /// Tenant reads sent to an old volume (data not copied yet; `tenant_io = "raid1"`).
    pub tenant_reads_from_old: u64,
    /// Tenant writes also sent to an old volume (`tenant_io = "raid1"`).
    pub tenant_writes_mirrored: u64,
    /// Mean time from replacement to the last chunk written, over finished copies, s.
    pub copy_s_mean: f64,
    /// Longest finished copy, s.
    pub copy_s_max: f64,
    /// Mean time an old volume stayed provisioned after its replacement (until released, or
    /// the end of the run), s.
    pub overlap_s_mean: f64,
}

/// Extra numbers of one worker.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct WorkerDetails {
    /// I/Os executed per second.
    pub iops: f64,
    /// Fraction of time the CPU was busy.
    pub busy_fraction: f64,
    /// Steal operations.
    pub steals: u64,
    /// Requests stolen.
    pub stolen: u64,
    /// How often the policy answered `WaitUntil`, `Idle`, and `WaitUntil` a time not after now.
    pub policy_waits_idles_past: [u64; 3],
}

/// Node-level details of one run.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RunDetails {
    /// Simulated seconds.
    pub simulated_s: f64,
    /// Events processed.
    pub events: u64,
    /// I/Os completed (whole run, all groups).
    pub completed_ios: u64,
    /// Node throughput after warm-up, IOPS (all groups).
    pub node_iops: f64,
    /// Per-group extras.
    pub groups: Vec<GroupDetails>,
    /// Per-worker numbers.
    pub workers: Vec<WorkerDetails>,
    /// max/min of per-worker IOPS (1 = balanced).
    pub worker_max_min_ratio: f64,
    /// min/max of device time per tenant over every tenant of the node (Libra's accuracy).
    pub tenant_device_time_min_max_ratio: f64,
    /// Ingress link busy fraction.
    pub ingress_utilisation: f64,
    /// Egress link busy fraction.
    pub egress_utilisation: f64,
    /// Mean device busy fraction.
    pub device_utilisation: f64,
    /// Invariant checks that failed (scenarios with `invariants = "warn"`).
    pub invariant_violations: u64,
    /// The first failure, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_invariant_violation: Option<String>,
}

/// Time series of one group.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GroupSeries {
    /// Group name.
    pub name: String,
    /// One bucket per `bucket_s`.
    pub buckets: Vec<TimelineBucket>,
    /// Latency CDF points `(µs, fraction)`.
    pub cdf: Vec<(f64, f64)>,
}

/// Time series and per-tenant data of one run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunSeries {
    /// Width of a timeline bucket, seconds.
    pub bucket_s: f64,
    /// Per group.
    pub groups: Vec<GroupSeries>,
    /// Node-wide completed I/Os per bucket by phase.
    pub phases: Vec<[u64; 3]>,
    /// Per tenant.
    pub tenants: Vec<TenantSummary>,
}

fn ratio(min: f64, max: f64) -> f64 {
    if max > 0.0 { min / max } else { 1.0 }
}

fn device_ratio(tenants: &[&TenantSummary]) -> f64 {
    let v: Vec<f64> = tenants.iter().map(|t| t.device_ns).collect();
    let min = v.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = v.iter().cloned().fold(0.0, f64::max);
    if v.is_empty() { 1.0 } else { ratio(min, max) }
}

fn group_result(name: &str, h: &Histogram, ops: u64, bytes: u64, window_s: f64) -> GroupResult {
    GroupResult {
        name: name.to_string(),
        iops: ops as f64 / window_s,
        bytes_per_s: bytes as f64 / window_s,
        lat_mean_us: h.mean_ns() / 1e3,
        lat_p50_us: h.quantile_ns(0.5) / 1e3,
        lat_p99_us: h.quantile_ns(0.99) / 1e3,
        lat_p999_us: h.quantile_ns(0.999) / 1e3,
    }
}

pub(crate) fn policy_result(policy: &str, variant: &str, data: RunData) -> PolicyResult {
    let mut groups = Vec::new();
    let mut gdetails = Vec::new();
    let mut gseries = Vec::new();
    for (gi, g) in data.groups.iter().enumerate() {
        let window_s = (g.to_ns.saturating_sub(g.from_ns)).max(1) as f64 / 1e9;
        groups.push(group_result(&g.name, &g.hist, g.ops, g.bytes, window_s));
        let members: Vec<&TenantSummary> = data.tenants.iter().filter(|t| t.group == gi).collect();
        let iops: Vec<f64> = members.iter().map(|t| t.ops as f64 / window_s).collect();
        let bps: Vec<f64> = members.iter().map(|t| t.bytes as f64 / window_s).collect();
        let min = |v: &[f64]| v.iter().cloned().fold(f64::INFINITY, f64::min);
        let max = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
        let total = g.phase_ops.iter().sum::<u64>().max(1) as f64;
        gdetails.push(GroupDetails {
            name: g.name.clone(),
            tenants: members.len(),
            ios: g.ops,
            lat_max_us: g.hist.max_ns() as f64 / 1e3,
            phase_share: PhaseShare {
                baseline: g.phase_ops[0] as f64 / total,
                burst_credit: g.phase_ops[1] as f64 / total,
                burst_spare: g.phase_ops[2] as f64 / total,
            },
            tenant_iops_min: if iops.is_empty() { 0.0 } else { min(&iops) },
            tenant_iops_max: max(&iops),
            tenant_iops_min_max_ratio: if iops.is_empty() {
                1.0
            } else {
                ratio(min(&iops), max(&iops))
            },
            tenant_bytes_min_max_ratio: if bps.is_empty() {
                1.0
            } else {
                ratio(min(&bps), max(&bps))
            },
            dropped: members.iter().map(|t| t.dropped).sum(),
            tenant_device_time_min_max_ratio: device_ratio(&members),
            volumes_created: g.volumes_created,
            provisioned_gib_hours: g.provisioned_gib_s / 3600.0,
            rebuild: g.rebuild.map(|r| RebuildDetails {
                started: r.started,
                copied: r.copied,
                skipped: r.skipped,
                bytes_copied: r.bytes_copied,
                copy_reads: r.copy_reads,
                copy_writes: r.copy_writes,
                tenant_reads_from_old: r.tenant_reads_from_old,
                tenant_writes_mirrored: r.tenant_writes_mirrored,
                copy_s_mean: r.copy_ns_sum as f64 / r.copied.max(1) as f64 / 1e9,
                copy_s_max: r.copy_ns_max as f64 / 1e9,
                overlap_s_mean: r.overlap_ns_sum as f64 / r.started.max(1) as f64 / 1e9,
            }),
            sched_wait_mean_us: g.sched_wait_ns as f64 / g.ops.max(1) as f64 / 1e3,
            downstream_wait_mean_us: g.downstream_wait_ns as f64 / g.ops.max(1) as f64 / 1e3,
        });
        gseries.push(GroupSeries {
            name: g.name.clone(),
            buckets: g.timeline.clone(),
            cdf: g
                .hist
                .cdf_points()
                .into_iter()
                .map(|(ns, f)| (ns / 1e3, f))
                .collect(),
        });
    }
    let run_s = (data.duration_ns.saturating_sub(data.warmup_ns)).max(1) as f64 / 1e9;
    let workers: Vec<WorkerDetails> = data
        .workers
        .iter()
        .map(|w| WorkerDetails {
            iops: w.ops as f64 / run_s,
            busy_fraction: w.busy_fraction,
            steals: w.steals,
            stolen: w.stolen,
            policy_waits_idles_past: w.decisions,
        })
        .collect();
    let wmin = workers.iter().map(|w| w.iops).fold(f64::INFINITY, f64::min);
    let wmax = workers.iter().map(|w| w.iops).fold(0.0, f64::max);
    let node_ops: u64 = data.workers.iter().map(|w| w.ops).sum();
    PolicyResult {
        policy: policy.to_string(),
        groups,
        variant: variant.to_string(),
        details: RunDetails {
            simulated_s: data.duration_ns as f64 / 1e9,
            events: data.events,
            completed_ios: data.completed,
            node_iops: node_ops as f64 / run_s,
            groups: gdetails,
            workers,
            worker_max_min_ratio: if wmin > 0.0 {
                wmax / wmin
            } else {
                f64::INFINITY
            },
            tenant_device_time_min_max_ratio: device_ratio(
                &data.tenants.iter().collect::<Vec<_>>(),
            ),
            ingress_utilisation: data.ingress_utilisation,
            egress_utilisation: data.egress_utilisation,
            device_utilisation: data.device_utilisation,
            invariant_violations: data.violations,
            first_invariant_violation: data.first_violation.clone(),
        },
        series: RunSeries {
            bucket_s: data.timeline_ns as f64 / 1e9,
            groups: gseries,
            phases: data.phase_timeline,
            tenants: data.tenants,
        },
    }
}

fn label(r: &PolicyResult) -> String {
    if r.variant.is_empty() {
        r.policy.clone()
    } else {
        format!("{} [{}]", r.policy, r.variant)
    }
}

fn file_tag(r: &PolicyResult) -> String {
    let raw = if r.variant.is_empty() {
        r.policy.clone()
    } else {
        format!("{}_{}", r.variant, r.policy)
    };
    raw.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

impl SimReport {
    /// A plain-text table: one row per (policy, group).
    pub fn to_table(&self) -> String {
        let mut rows: Vec<[String; 8]> = vec![[
            "policy".into(),
            "group".into(),
            "iops".into(),
            "MB/s".into(),
            "mean us".into(),
            "p50 us".into(),
            "p99 us".into(),
            "p99.9 us".into(),
        ]];
        for r in &self.results {
            for g in &r.groups {
                rows.push([
                    label(r),
                    g.name.clone(),
                    format!("{:.0}", g.iops),
                    format!("{:.1}", g.bytes_per_s / 1e6),
                    format!("{:.1}", g.lat_mean_us),
                    format!("{:.1}", g.lat_p50_us),
                    format!("{:.1}", g.lat_p99_us),
                    format!("{:.1}", g.lat_p999_us),
                ]);
            }
        }
        let mut widths = [0usize; 8];
        for row in &rows {
            for (i, c) in row.iter().enumerate() {
                widths[i] = widths[i].max(c.len());
            }
        }
        let mut out = format!("scenario {} (seed {})\n", self.scenario, self.seed);
        for (ri, row) in rows.iter().enumerate() {
            for (i, c) in row.iter().enumerate() {
                if i < 2 {
                    let _ = write!(out, "{:<w$}  ", c, w = widths[i]);
                } else {
                    let _ = write!(out, "{:>w$}  ", c, w = widths[i]);
                }
            }
            out = out.trim_end().to_string();
            out.push('\n');
            if ri == 0 {
                let total: usize = widths.iter().sum::<usize>() + 2 * 7;
                out.push_str(&"-".repeat(total));
                out.push('\n');
            }
        }
        out
    }

    /// Writes `report.json`, CSV files and SVG plots into `dir` (created if needed).
    pub fn write_outputs(&self, dir: &Path) -> Result<(), SimError> {
        std::fs::create_dir_all(dir).map_err(|source| SimError::Output {
            path: dir.to_path_buf(),
            source,
        })?;
        let write = |name: &str, text: &str| -> Result<(), SimError> {
            let path = dir.join(name);
            std::fs::write(&path, text).map_err(|source| SimError::Output { path, source })
        };
        let json = serde_json::to_string_pretty(self)
            .map_err(|e| SimError::Invalid(format!("cannot serialise report: {e}")))?;
        write("report.json", &json)?;
        write("summary.txt", &self.to_table())?;

        let mut groups_csv = String::from(
            "variant,policy,group,iops,bytes_per_s,lat_mean_us,lat_p50_us,lat_p99_us,lat_p999_us,baseline_share,burst_credit_share,burst_spare_share\n",
        );
        let mut timeline_csv =
            String::from("variant,policy,group,t_s,iops,bytes_per_s,lat_mean_us\n");
        let mut phases_csv =
            String::from("variant,policy,t_s,baseline_iops,burst_credit_iops,burst_spare_iops\n");
        let mut tenants_csv = String::from(
            "variant,policy,group,tenant,iops,bytes_per_s,lat_mean_us,issued,dropped\n",
        );
        let mut workers_csv =
            String::from("variant,policy,worker,iops,busy_fraction,steals,stolen\n");
        for r in &self.results {
            let v = &r.variant;
            let p = &r.policy;
            for (g, d) in r.groups.iter().zip(&r.details.groups) {
                let _ = writeln!(
                    groups_csv,
                    "{v},{p},{},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.4},{:.4},{:.4}",
                    g.name,
                    g.iops,
                    g.bytes_per_s,
                    g.lat_mean_us,
                    g.lat_p50_us,
                    g.lat_p99_us,
                    g.lat_p999_us,
                    d.phase_share.baseline,
                    d.phase_share.burst_credit,
                    d.phase_share.burst_spare
                );
            }
            let bs = r.series.bucket_s.max(1e-12);
            for g in &r.series.groups {
                for (i, b) in g.buckets.iter().enumerate() {
                    let lat = if b.ops > 0 {
                        b.lat_sum_ns as f64 / b.ops as f64 / 1e3
                    } else {
                        0.0
                    };
                    let _ = writeln!(
                        timeline_csv,
                        "{v},{p},{},{:.4},{:.3},{:.3},{:.3}",
                        g.name,
                        (i as f64 + 1.0) * bs,
                        b.ops as f64 / bs,
                        b.bytes as f64 / bs,
                        lat
                    );
                }
            }
            for (i, ph) in r.series.phases.iter().enumerate() {
                let _ = writeln!(
                    phases_csv,
                    "{v},{p},{:.4},{:.3},{:.3},{:.3}",
                    (i as f64 + 1.0) * bs,
                    ph[0] as f64 / bs,
                    ph[1] as f64 / bs,
                    ph[2] as f64 / bs
                );
            }
            for (ti, t) in r.series.tenants.iter().enumerate() {
                let gname = r.groups.get(t.group).map_or("", |g| g.name.as_str());
                let window = self.window_of(r, t.group);
                let _ = writeln!(
                    tenants_csv,
                    "{v},{p},{gname},{ti},{:.3},{:.3},{:.3},{},{}",
                    t.ops as f64 / window,
                    t.bytes as f64 / window,
                    t.lat_mean_us,
                    t.issued,
                    t.dropped
                );
            }
            for (wi, w) in r.details.workers.iter().enumerate() {
                let _ = writeln!(
                    workers_csv,
                    "{v},{p},{wi},{:.3},{:.4},{},{}",
                    w.iops, w.busy_fraction, w.steals, w.stolen
                );
            }
            // Plots.
            let tag = file_tag(r);
            let cdf: Vec<Series> = r
                .series
                .groups
                .iter()
                .map(|g| Series {
                    name: g.name.clone(),
                    points: g.cdf.clone(),
                })
                .collect();
            write(
                &format!("latency_cdf_{tag}.svg"),
                &line_chart(
                    &format!("{}: latency CDF ({})", self.scenario, label(r)),
                    "latency (us, log scale)",
                    "fraction of I/Os",
                    &cdf,
                    true,
                ),
            )?;
            let thr: Vec<Series> = r
                .series
                .groups
                .iter()
                .map(|g| Series {
                    name: g.name.clone(),
                    points: g
                        .buckets
                        .iter()
                        .enumerate()
                        .map(|(i, b)| ((i as f64 + 1.0) * bs, b.ops as f64 / bs))
                        .collect(),
                })
                .collect();
            write(
                &format!("throughput_{tag}.svg"),
                &line_chart(
                    &format!("{}: throughput over time ({})", self.scenario, label(r)),
                    "time (s)",
                    "IOPS",
                    &thr,
                    false,
                ),
            )?;
            let phase_names = ["baseline", "burst_credit", "burst_spare"];
            let phases: Vec<Series> = (0..3)
                .map(|k| Series {
                    name: phase_names[k].to_string(),
                    points: r
                        .series
                        .phases
                        .iter()
                        .enumerate()
                        .map(|(i, ph)| ((i as f64 + 1.0) * bs, ph[k] as f64 / bs))
                        .collect(),
                })
                .collect();
            write(
                &format!("phases_{tag}.svg"),
                &stacked_chart(
                    &format!("{}: service by phase ({})", self.scenario, label(r)),
                    "time (s)",
                    "IOPS",
                    &phases,
                ),
            )?;
        }
        write("groups.csv", &groups_csv)?;
        write("timeline.csv", &timeline_csv)?;
        write("phases.csv", &phases_csv)?;
        write("tenants.csv", &tenants_csv)?;
        write("workers.csv", &workers_csv)?;
        Ok(())
    }

    fn window_of(&self, r: &PolicyResult, group: usize) -> f64 {
        // iops = ios / window  =>  window = ios / iops
        match (r.groups.get(group), r.details.groups.get(group)) {
            (Some(g), Some(d)) if g.iops > 0.0 => d.ios as f64 / g.iops,
            _ => r.details.simulated_s.max(1e-9),
        }
    }
}
