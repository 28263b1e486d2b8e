//! Errors of the simulator.
//!
//! A scenario is user input: every way it can be wrong (bad TOML, an unknown policy, a trace
//! line that does not parse) is a [`SimError`] with enough context to fix the file, never a
//! panic. A broken policy invariant found during a run is also reported here, with the seed,
//! so that the failing run can be replayed exactly.

use std::path::PathBuf;
use thiserror::Error;

/// Anything that can make a simulation fail.
#[derive(Debug, Error)]
pub enum SimError {
    /// The scenario file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// File that failed.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The scenario TOML does not parse or does not match the schema.
    #[error("invalid scenario: {0}")]
    Toml(String),
    /// The scenario parses but is inconsistent (a zero rate, an unknown size mix, ...).
    #[error("invalid scenario: {0}")]
    Invalid(String),
    /// A policy name is not known.
    #[error("unknown policy {0:?} (expected wild, base, credit, burst, mclock, drr-vop or fifo)")]
    UnknownPolicy(String),
    /// A trace file has a malformed line.
    #[error("{path}:{line}: {reason}")]
    Trace {
        /// Trace file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Writing the output folder failed.
    #[error("cannot write {path}: {source}")]
    Output {
        /// File that failed.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// A run failed; carries the seed so that it can be replayed.
    #[error("{source} (seed {seed}; replay with --seed {seed})")]
    Seeded {
        /// Seed of the failing run.
        seed: u64,
        /// What failed.
        source: Box<SimError>,
    },
    /// A policy broke one of its invariants during the run (a bug in the policy).
    #[error("policy {policy} broke an invariant at t={at_ns} ns (seed {seed}): {detail}")]
    Invariant {
        /// Policy name.
        policy: String,
        /// Simulated time of the check.
        at_ns: u64,
        /// Seed of the run, to replay it.
        seed: u64,
        /// The violation.
        detail: String,
    },
}

impl SimError {
    /// Wraps a failure with the seed of the run, so that a failing run prints its seed.
    pub fn with_seed(self, seed: u64) -> SimError {
        match self {
            SimError::Invariant { .. } | SimError::Seeded { .. } => self,
            other => SimError::Seeded {
                seed,
                source: Box::new(other),
            },
        }
    }
}
