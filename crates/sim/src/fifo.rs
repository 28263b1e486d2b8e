//! The executor without a scheduler: first come, first served, no limits.
//!
//! Not a QoS policy (those live in `headroom-qos` and are never re-implemented here). It exists
//! so that the node model itself can be checked against queueing theory (an M/D/1 device must
//! show the Pollaczek–Khinchine mean wait) without any policy's behaviour in the way, and as
//! the "no isolation at all" reference point in scaling runs. Selected with `--policy fifo`.

use headroom_qos::{
    Decision, InvariantViolation, IoRequest, NodeCapacity, Observed, Phase, Policy, VolumeId,
    VolumeQos, VolumeSnapshot,
};
use std::collections::VecDeque;

/// FIFO pass-through.
#[derive(Debug, Default)]
pub struct Fifo {
    queue: VecDeque<IoRequest>,
}

impl Policy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }
    fn add_volume(&mut self, _now_ns: u64, _id: VolumeId, _qos: &VolumeQos) {}
    fn update_qos(&mut self, _now_ns: u64, _id: VolumeId, _qos: &VolumeQos) {}
    fn remove_volume(&mut self, _now_ns: u64, id: VolumeId) {
        self.queue.retain(|r| r.volume != id);
    }
    /// FIFO enforces no capacity: nothing to change.
    fn set_capacity(&mut self, _now_ns: u64, _capacity: NodeCapacity) {}
    fn enqueue(&mut self, _now_ns: u64, req: IoRequest) {
        self.queue.push_back(req);
    }
    fn next(&mut self, _now_ns: u64) -> Decision {
        match self.queue.pop_front() {
            Some(r) => Decision::Dispatch(r, Phase::Baseline),
            None => Decision::Idle,
        }
    }
    fn complete(&mut self, _now_ns: u64, _req: &IoRequest, _observed: Observed) {}
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        Ok(())
    }
    fn queued_requests(&self) -> usize {
        self.queue.len()
    }
    fn snapshot(&self, _id: VolumeId) -> Option<VolumeSnapshot> {
        None
    }
}
