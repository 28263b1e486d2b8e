//! `headroom lab run`: a scenario file run on real I/O. The run itself is `headroom-lab`'s
//! ([`headroom_lab::Session`]: the scenario translated, Headroom servers with an emulated
//! device started per policy or a running one targeted, peers as further rows, every tenant
//! driven from this process, the server's counters checked against the generator's). This
//! command parses the flags, gives the lab this binary (to start as `serve`) and the API
//! client, shows what the lab does not honour and a progress bar on stderr, and prints the
//! report in the JSON shape of `sim run` (or a table), with `--out` files and plots.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Subcommand;
use headroom_lab::api::{ApiFailure, Connector, NodeInfo, ServerApi};
use headroom_lab::report::LabReport;
use headroom_lab::{Session, SessionSpec};
use headroom_node::api::{ApiToken, CreateVolume};
use headroom_qos::QosSpec;
use headroom_sim::GroupResult;
use headroom_sim::plot::{Series, line_chart};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::client::{Api, ApiCallError};
use crate::output::{emit, print_json};
use crate::token;

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
    let session = Session::prepare(SessionSpec {
        file: file.clone(),
        seed,
        policies,
        target,
        token,
    })?;
    for n in session.not_honoured() {
        eprintln!("lab: not honoured: {}: {}", n.key, n.reason);
    }
    let exe = std::env::current_exe().context("finding this executable")?;
    let bar = ProgressBar::with_draw_target(Some(1000), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {percent:>3}% {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    let mut results = Vec::new();
    let total = session.rows().len().max(1) as f64;
    for (done, row) in session.rows().iter().enumerate() {
        bar.set_message(format!("{} {}", session.scenario(), row.label));
        let progress_bar = bar.clone();
        let progress: Box<dyn Fn(f64) + Send + Sync> = Box::new(move |f: f64| {
            progress_bar.set_position(((done as f64 + f) / total * 1000.0) as u64);
        });
        match session.run_row(row, &exe, &LabConnector, progress) {
            Ok(r) => results.push(r),
            Err(e) => {
                bar.finish_and_clear();
                return Err(anyhow::Error::new(e).context(format!(
                    "lab run of {} ({}, seed {seed})",
                    file.display(),
                    row.label
                )));
            }
        }
    }
    bar.finish_and_clear();
    let report = session.report(results);
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

/// The lab's way to the servers' APIs: this binary's client, so a failed call keeps its typed
/// error (and `main`'s exit code for it).
struct LabConnector;

impl Connector for LabConnector {
    fn new_token(&self) -> Result<String, ApiFailure> {
        Ok(ApiToken::random()
            .map_err(|e| anyhow::anyhow!("API token: {e}"))?
            .expose()
            .to_string())
    }

    fn connect(&self, url: &str, token_text: &str) -> Result<Box<dyn ServerApi>, ApiFailure> {
        let token = ApiToken::new(token_text).map_err(|e| anyhow::anyhow!("API token: {e}"))?;
        Ok(Box::new(LabApi {
            api: Api::new(url, token::Found::Environment(token)),
            url: url.trim_end_matches('/').to_string(),
            token: token_text.to_string(),
        }))
    }
}

/// An API client's error as the lab keeps it. A typed [`ApiCallError`] (what `Api` returns for
/// every failed call) is boxed as itself, so that `main` still finds it in the chain and exits
/// with its code; anyhow's own boxing would hide its type.
fn failure(err: anyhow::Error) -> ApiFailure {
    match err.downcast::<ApiCallError>() {
        Ok(typed) => Box::new(typed),
        Err(other) => other.into(),
    }
}

/// One server's API for the lab.
struct LabApi {
    api: Api,
    url: String,
    token: String,
}

impl ServerApi for LabApi {
    fn create_volume(&self, name: &str, size_bytes: u64, qos: &QosSpec) -> Result<(), ApiFailure> {
        self.api
            .create(&CreateVolume {
                name: name.to_string(),
                size_bytes,
                qos: (!qos.is_empty()).then(|| qos.clone()),
                tenant: None,
                read_only: false,
                replicas: None,
            })
            .map_err(failure)?;
        Ok(())
    }

    fn delete_volume(&self, name: &str) -> Result<(), ApiFailure> {
        self.api.delete(name).map_err(failure)
    }

    fn node(&self) -> Result<NodeInfo, ApiFailure> {
        let node = self.api.get_json("/v1/node").map_err(failure)?;
        Ok(NodeInfo {
            nbd_listen: node["nbd_listen"].as_str().map(str::to_string),
            policy: node["policy"].as_str().map(str::to_string),
        })
    }

    fn metrics(&self) -> Result<String, ApiFailure> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        let text = agent
            .get(format!("{}/metrics", self.url))
            .header("Authorization", format!("Bearer {}", self.token))
            .call()
            .context("GET /metrics")?
            .body_mut()
            .read_to_string()
            .context("reading /metrics")?;
        Ok(text)
    }
}

fn table(report: &LabReport) -> String {
    let rows: Vec<(String, &GroupResult)> = report
        .results
        .iter()
        .flat_map(|r| r.groups.iter().map(move |g| (r.label(), g)))
        .collect();
    let mut text = crate::sim_cmd::results_table(&report.scenario, report.seed, &rows);
    for r in &report.results {
        text.push_str(&format!(
            "{}: generator {:.0} ns CPU per I/O ({:.2} cores)\n",
            r.label(),
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
        let raw = r.label();
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
