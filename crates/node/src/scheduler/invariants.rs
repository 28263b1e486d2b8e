//! The policies' invariant checks on a live node: request accounting, capacity and ceilings
//! per window, the baseline guarantee and work conservation, as `headroom_qos`'s tracker
//! checks them in the simulator and the property tests.
//!
//! Why here: the tracker is on in debug builds (`QosConfig::server_params`), so every debug
//! server and every in-process test runs its scheduling under the same bookkeeping the
//! simulator is checked against; `Scheduler::check_invariants` asks each worker's policy
//! whether it holds, and the harness and a debug node's shutdown ask it.

use headroom_qos::InvariantViolation;

use super::Scheduler;
use crate::sync::lock;

impl<J> Scheduler<J> {
    /// Whether every worker's policy holds its invariants (the first violation otherwise).
    /// Without tracking (`track_invariants` off: release builds) only the node-wide request
    /// accounting is checked.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        for worker in &self.workers {
            lock(&worker.state).policy.check_invariants()?;
        }
        Ok(())
    }
}
