//! `headroom sim run`: runs a scenario through the discrete-event simulator with the shipped
//! QoS policies and prints a table or the JSON report. A progress bar on stderr follows the
//! simulator's own progress callback (fraction of simulated time over every policy); it is
//! hidden when stderr is not a terminal, so logs and CI output stay clean.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Subcommand;
use headroom_sim::{GroupResult, RunOptions, Scenario, SimReport, run as run_scenario};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::output::{Align, Table, emit, mb_per_s, print_json};

#[derive(Subcommand, Debug)]
pub enum SimCommand {
    /// Run a scenario file.
    Run {
        /// Scenario TOML (see scenarios/).
        file: PathBuf,
        /// Seed for every random choice; the same seed gives the same report.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Policies to compare (repeatable); default: the scenario's own list.
        #[arg(long = "policy")]
        policies: Vec<String>,
        /// Print the JSON report instead of a table.
        #[arg(long)]
        json: bool,
        /// Folder for CSV, JSON and SVG outputs.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// Steps of the bar: per mille of the whole run.
const BAR_STEPS: u64 = 1000;

pub fn run(command: SimCommand) -> Result<()> {
    match command {
        SimCommand::Run {
            file,
            seed,
            policies,
            json,
            out,
        } => {
            let scenario = Scenario::load(&file)
                .with_context(|| format!("loading scenario {}", file.display()))?;
            // Hidden by indicatif itself when stderr is not a terminal.
            let bar = ProgressBar::with_draw_target(Some(BAR_STEPS), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {bar:30} {percent:>3}% simulated, {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_message(scenario.name().to_string());
            bar.enable_steady_tick(Duration::from_millis(200));
            let progress_bar = bar.clone();
            let options = RunOptions {
                seed,
                policies,
                out_dir: out,
                progress: Some(Box::new(move |fraction: f64| {
                    let step = (fraction.clamp(0.0, 1.0) * BAR_STEPS as f64) as u64;
                    progress_bar.set_position(step);
                })),
            };
            let report = run_scenario(&scenario, options);
            bar.finish_and_clear();
            let report = report.with_context(|| format!("simulation failed (seed {seed})"))?;
            if json {
                print_json(&report)
            } else {
                emit(&table(&report));
                Ok(())
            }
        }
    }
}

/// Per policy (and variant) and tenant group: throughput and latency percentiles.
fn table(report: &SimReport) -> String {
    let rows: Vec<(String, &GroupResult)> = report
        .results
        .iter()
        .flat_map(|result| {
            let policy = if result.variant.is_empty() {
                result.policy.clone()
            } else {
                format!("{} [{}]", result.policy, result.variant)
            };
            result.groups.iter().map(move |g| (policy.clone(), g))
        })
        .collect();
    results_table(&report.scenario, report.seed, &rows)
}

/// The table `sim run` and `lab run` print: one row per (policy label, group).
pub(crate) fn results_table(scenario: &str, seed: u64, rows: &[(String, &GroupResult)]) -> String {
    let mut table = Table::new(&[
        ("POLICY", Align::Left),
        ("GROUP", Align::Left),
        ("IOPS", Align::Right),
        ("THROUGHPUT", Align::Right),
        ("MEAN µS", Align::Right),
        ("P50 µS", Align::Right),
        ("P99 µS", Align::Right),
        ("P99.9 µS", Align::Right),
    ]);
    for (policy, group) in rows {
        table.row(vec![
            policy.clone(),
            group.name.clone(),
            format!("{:.0}", group.iops),
            mb_per_s(group.bytes_per_s),
            format!("{:.1}", group.lat_mean_us),
            format!("{:.1}", group.lat_p50_us),
            format!("{:.1}", group.lat_p99_us),
            format!("{:.1}", group.lat_p999_us),
        ]);
    }
    format!(
        "scenario {scenario} (seed {seed})\n{}",
        table.render(crate::output::stdout_styled())
    )
}
