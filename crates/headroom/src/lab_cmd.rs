//! `headroom lab run`: a scenario file run on real I/O. The run itself is `headroom-lab`'s
//! ([`headroom_lab::Session`]: the scenario translated, Headroom servers with an emulated
//! device started per policy or a running one targeted, peers as further rows, every tenant
//! driven from this process, the server's counters checked against the generator's). This
//! command parses the flags, gives the lab this binary (to start as `serve`) and the API
//! client, shows what the lab does not honour and a progress bar on stderr, and prints the
//! report in the JSON shape of `sim run` (or a table), with `--out` files and plots.
//!
//! `headroom lab vhost-load`: the lab's closed-loop generator over vhost-user-blk
//! ([`headroom_lab::vhost_user::load`]) against any backend's socket, Headroom's or
//! qemu-storage-daemon's, or paced at `--rate-iops` ([`headroom_lab::vhost_user::pacing`]);
//! this command parses the flags and prints the report (a table, or JSON for scripts such as
//! scripts/bench-vhost and scripts/bench-interference), and fails when any request failed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Subcommand;
use headroom_lab::api::{ApiFailure, Connector, NodeInfo, ServerApi};
use headroom_lab::report::LabReport;
use headroom_lab::vhost_user::load::{self, Pattern, VhostLoadSpec};
use headroom_lab::{Session, SessionSpec};
use headroom_node::api::{ApiToken, CreateVolume};
use headroom_qos::QosSpec;
use headroom_sim::GroupResult;
use headroom_sim::plot::{Series, line_chart};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::client::{Api, ApiCallError};
use crate::output::{Fields, emit, human_bytes, print_json};
use crate::size::parse_size;
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
    /// Closed-loop load on a vhost-user-blk socket (any backend: Headroom's `volume attach
    /// --vhost-user`, qemu-storage-daemon's vhost-user-blk export): IOPS, MB/s, latency.
    VhostLoad {
        /// The backend's vhost-user-blk socket.
        #[arg(long)]
        socket: PathBuf,
        /// randread, randwrite, read (sequential) or write (sequential).
        #[arg(long, default_value = "randread", value_parser = parse_pattern)]
        rw: Pattern,
        /// Request size (a multiple of 512).
        #[arg(long, default_value = "4k", value_parser = parse_size)]
        bs: u64,
        /// Requests in flight per queue.
        #[arg(long, default_value_t = 32)]
        iodepth: u16,
        /// Virtqueues, each driven by a thread of its own over one connection.
        #[arg(long, default_value_t = 1)]
        queues: u16,
        /// The measured window, seconds.
        #[arg(long = "runtime-s", default_value_t = 5.0)]
        runtime_s: f64,
        /// Load before the window, not counted, seconds.
        #[arg(long = "ramp-s", default_value_t = 1.0)]
        ramp_s: f64,
        /// The range addressed from offset 0 (default: the device's capacity).
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        /// Seed of the random offsets.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Start requests on a schedule of N per second for the device (each queue its
        /// share) instead of a closed loop, as fio's rate_iops for one job: never more than
        /// --iodepth in flight per queue; a start due while the queue is full goes as soon as
        /// a slot frees; at most --iodepth starts owed (more are skipped and counted: no
        /// catch-up burst). Latency is measured from each request's actual start, as fio's
        /// clat, not from when it was due (the lag shows as start lag).
        #[arg(long = "rate-iops", value_name = "N")]
        rate_iops: Option<u64>,
        /// Print the JSON report instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn parse_pattern(text: &str) -> Result<Pattern, String> {
    Pattern::parse(text)
        .ok_or_else(|| format!("unknown --rw {text:?}: randread, randwrite, read or write"))
}

fn seconds(what: &str, s: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| anyhow::anyhow!("{what} {s}: not a duration"))
}

/// `lab vhost-load`: runs the generator, prints its report, fails if a request failed.
fn vhost_load(command: LabCommand) -> Result<()> {
    let LabCommand::VhostLoad {
        socket,
        rw,
        bs,
        iodepth,
        queues,
        runtime_s,
        ramp_s,
        size,
        seed,
        rate_iops,
        json,
    } = command
    else {
        anyhow::bail!("not a vhost-load command");
    };
    let spec = VhostLoadSpec {
        socket: socket.clone(),
        pattern: rw,
        block_bytes: u32::try_from(bs).context("--bs too large")?,
        iodepth,
        queues,
        runtime: seconds("--runtime-s", runtime_s)?,
        ramp: seconds("--ramp-s", ramp_s)?,
        size_bytes: size,
        seed,
        rate_iops,
    };
    let report =
        load::run(&spec).with_context(|| format!("vhost-user-blk load on {}", socket.display()))?;
    if json {
        print_json(&report)?;
    } else {
        print_vhost_load(&report);
    }
    if report.errors > 0 {
        anyhow::bail!(
            "{} of {} requests failed (IOERR {}, UNSUPP {}, other {})",
            report.errors,
            report.all_completions,
            report.errors_ioerr,
            report.errors_unsupp,
            report.errors_other
        );
    }
    Ok(())
}

/// `lab vhost-load`'s report as a table.
fn print_vhost_load(report: &load::VhostLoadReport) {
    let mut fields = Fields::new();
    fields.add(
        "load",
        format!(
            "{} {} QD{} x {} queue(s), {:.1} s after {:.1} s ramp",
            report.rw,
            human_bytes(u64::from(report.block_bytes)),
            report.iodepth,
            report.queues,
            report.runtime_s,
            report.ramp_s
        ),
    );
    fields.add(
        "device",
        format!(
            "{} ({} addressed), queue size {}, EVENT_IDX {}",
            human_bytes(report.capacity_bytes),
            human_bytes(report.size_bytes),
            report.queue_size,
            if report.event_idx { "on" } else { "off" }
        ),
    );
    fields.add("IOPS", format!("{:.0}", report.iops));
    fields.add("MB/s", format!("{:.1}", report.mb_per_s));
    fields.add(
        "latency",
        format!(
            "mean {:.1} us, p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us, max {:.1} us \
             (from each request's start)",
            report.mean_us, report.p50_us, report.p99_us, report.p999_us, report.max_us
        ),
    );
    if let Some(rate) = report.rate_iops {
        fields.add(
            "pacing",
            format!(
                "{rate} IOPS asked; start lag p50 {:.1} us, p99 {:.1} us, max {:.1} us; \
                 {} starts skipped (more than the depth owed)",
                report.start_lag_p50_us,
                report.start_lag_p99_us,
                report.start_lag_max_us,
                report.starts_skipped
            ),
        );
    }
    fields.add(
        "errors",
        format!(
            "{} (IOERR {}, UNSUPP {}, other {})",
            report.errors, report.errors_ioerr, report.errors_unsupp, report.errors_other
        ),
    );
    fields.add(
        "requests",
        format!(
            "{} in the window, {} in all; {} kicks, {} waits",
            report.completions, report.all_completions, report.kicks, report.waits
        ),
    );
    fields.add(
        "generator CPU",
        format!(
            "{:.0} ns per I/O ({:.2} cores)",
            report.generator_cpu_ns_per_io, report.generator_cpu_cores
        ),
    );
    emit(&fields.render());
}

/// Runs the command.
pub fn run(command: LabCommand) -> Result<()> {
    if matches!(command, LabCommand::VhostLoad { .. }) {
        return vhost_load(command);
    }
    let LabCommand::Run {
        file,
        seed,
        policies,
        json,
        out,
        target,
        token,
    } = command
    else {
        anyhow::bail!("not a run command");
    };
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
