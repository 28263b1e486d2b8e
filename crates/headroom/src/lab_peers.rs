//! `headroom lab run`, part three: the peers as extra rows.

use anyhow::{Result, bail};

use crate::lab_cmd::LabResult;
use crate::lab_plan::Plan;

/// The peer rows `--policy` accepts.
pub const PEERS: [&str; 3] = ["qsd-static", "qsd-burst", "nbdkit-rate"];

pub fn is_peer(name: &str) -> bool {
    PEERS.contains(&name)
}

pub fn run_peer(
    _plan: &Plan,
    policy: &str,
    _seed: u64,
    _progress: Box<dyn Fn(f64) + Send + Sync>,
) -> Result<LabResult> {
    bail!("peer {policy} is not implemented yet")
}
