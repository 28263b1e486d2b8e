//! A lab run's report: `sim run`'s JSON shape (per row a policy and its groups' throughput
//! and latency), plus how each row went (server, PIDs, the generator's own cost, the server's
//! counters) and what the lab could not honour.
//!
//! Why `sim run`'s shape: the same scenario runs in the simulator and in the lab, and the two
//! reports are meant to be read side by side (and diffed by tools) without a converter.

use headroom_sim::GroupResult;
use serde::Serialize;

use crate::plan::{NotHonoured, Plan};
use crate::{GroupOutcome, RunOutcome};

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
    /// Per group, for the plots (not in the JSON).
    #[serde(skip)]
    pub series: Vec<GroupSeries>,
}

/// A group's name, timeline `(s, IOPS)` and latency CDF `(µs, fraction)`, for the plots.
pub type GroupSeries = (String, Vec<(f64, f64)>, Vec<(f64, f64)>);

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

impl LabResult {
    /// `policy`, or `policy [variant]`.
    pub fn label(&self) -> String {
        if self.variant.is_empty() {
            self.policy.clone()
        } else {
            format!("{} [{}]", self.policy, self.variant)
        }
    }
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

/// A row from the generator's outcome and, for Headroom, the server's `(reads, writes)` per
/// group.
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
