//! headroom-sim: a discrete-event simulator of one Headroom storage node.
//!
//! Headroom's claim — base-level tenants keep their latency while others burst on idle
//! capacity — must hold for thousands of tenants and hours of traffic, which no small machine
//! can generate for real. This crate models the node (worker CPUs, NIC, devices, dispatch
//! modes) and drives the *shipped* `headroom-qos` policies through their public trait, so what
//! the simulator shows is what the server's scheduler does. There is no tokio, no clock, no
//! thread: one seed drives every random number, and the same seed gives the same report.
//!
//! ```no_run
//! use headroom_sim::{RunOptions, Scenario, run};
//! let scenario = Scenario::load(std::path::Path::new("scenarios/burstcbs-victims.toml"))?;
//! let report = run(&scenario, RunOptions { seed: 1, ..RunOptions::default() })?;
//! println!("{}", report.to_table());
//! # Ok::<(), headroom_sim::SimError>(())
//! ```

pub mod costs;
pub mod device;
pub mod error;
pub mod event_queue;
pub mod fastmath;
pub mod fifo;
pub mod histogram;
pub mod link;
pub mod node;
pub mod plot;
pub mod report;
pub mod rng;
pub mod scenario;
pub mod trace;
pub mod worker_cpu;
pub mod workload;

pub use error::SimError;
pub use node::PolicyChoice;
pub use report::{GroupResult, PolicyResult, RebuildDetails, RunDetails, SimReport};
pub use scenario::Scenario;

use std::path::PathBuf;

/// How to run a scenario.
#[derive(Default)]
pub struct RunOptions {
    /// Seed of every random number in the run.
    pub seed: u64,
    /// Policies to run; empty = the scenario's list.
    pub policies: Vec<String>,
    /// Where to write CSV, JSON and SVG outputs (none = no files).
    pub out_dir: Option<PathBuf>,
    /// Called with the fraction done (0..=1) during long runs.
    pub progress: Option<Box<dyn FnMut(f64)>>,
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("seed", &self.seed)
            .field("policies", &self.policies)
            .field("out_dir", &self.out_dir)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

/// Runs every (variant, policy) of a scenario and collects the report. A failure carries the
/// seed, so that it can be replayed with `--seed`.
pub fn run(scenario: &Scenario, mut opts: RunOptions) -> Result<SimReport, SimError> {
    let seed = opts.seed;
    let names = if opts.policies.is_empty() {
        scenario.default_policies()
    } else {
        opts.policies.clone()
    };
    let choices: Vec<PolicyChoice> = names
        .iter()
        .map(|n| PolicyChoice::parse(n))
        .collect::<Result<_, _>>()?;
    let total = (choices.len() * scenario.variants.len()).max(1) as f64;
    let mut results = Vec::new();
    let mut done = 0.0;
    for (variant, spec) in &scenario.variants {
        for choice in &choices {
            let node = node::Node::build(spec, &scenario.base_dir, *choice, seed)
                .map_err(|e| e.with_seed(seed))?;
            let base = done;
            let mut cb = |f: f64| {
                if let Some(p) = opts.progress.as_mut() {
                    p((base + f) / total);
                }
            };
            let data = node.run(&mut cb).map_err(|e| e.with_seed(seed))?;
            results.push(report::policy_result(choice.name(), variant, data));
            done += 1.0;
        }
    }
    let report = SimReport {
        scenario: scenario.name().to_string(),
        seed,
        results,
    };
    if let Some(dir) = &opts.out_dir {
        report.write_outputs(dir).map_err(|e| e.with_seed(seed))?;
    }
    Ok(report)
}
