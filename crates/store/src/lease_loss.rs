//! What a node knows once it has lost its lease on a RADOS store (lease.rs): why and when.
//!
//! Why a type of its own, outside the `rados` feature: the node reports the loss (`GET
//! /readyz`, the readiness metric, the exit status) on every build, and a build without
//! RADOS simply never has one.

use std::time::SystemTime;

/// Exit status of a process that lost its lease (after it lingered, see
/// `DEFAULT_LEASE_LOST_LINGER_MS`).
pub const LEASE_LOST_EXIT_STATUS: i32 = 3;

/// Default time a node that lost its lease keeps answering the management API (`/readyz`:
/// 503 naming the loss) before it exits with `LEASE_LOST_EXIT_STATUS`: long enough for a
/// probe or two to see why, short enough that a supervisor restarts it as a standby soon.
pub const DEFAULT_LEASE_LOST_LINGER_MS: u64 = 5_000;

/// The lease was lost: the store no longer takes any I/O from this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseLoss {
    /// One sentence: why the lease counts as lost.
    pub why: String,
    /// When this node noticed.
    pub at: SystemTime,
}
