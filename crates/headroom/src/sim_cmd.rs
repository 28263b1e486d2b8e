//! `headroom sim run`: runs a scenario through the discrete-event simulator with the shipped
//! QoS policies and prints a table or the JSON report.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use headroom_sim::{RunOptions, Scenario, run as run_scenario};

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
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Folder for CSV, JSON and SVG outputs.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

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
            let show_progress = !json;
            let progress: Option<Box<dyn FnMut(f64)>> = if show_progress {
                Some(Box::new(|fraction: f64| {
                    eprint!("\r{:5.1}%", fraction * 100.0);
                    let _ = std::io::stderr().flush();
                }))
            } else {
                None
            };
            let options = RunOptions {
                seed,
                policies,
                out_dir: out,
                progress,
            };
            let report = run_scenario(&scenario, options)
                .with_context(|| format!("simulation failed (seed {seed})"))?;
            if show_progress {
                eprintln!();
            }
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", report.to_table());
            }
            Ok(())
        }
    }
}
