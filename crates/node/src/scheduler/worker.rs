//! One scheduler worker: an instance of the policy over its share of the node, its cost
//! model, the jobs it holds while the policy queues them, and what it dispatched (read by the
//! global pool and the demand counters).

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use headroom_qos::{CostModel, CostVector, NodeCapacity, Policy, PolicyKind, build_policy};
use rustc_hash::FxHashMap;

use super::config::QosConfig;
use super::volume::VolumeHandle;

pub(super) struct Pending<J> {
    pub(super) job: J,
    pub(super) volume: Arc<VolumeHandle>,
    pub(super) sequential: bool,
    /// The submission that enqueued it is still draining (a dispatch now is not a hold-back).
    pub(super) own_drain: bool,
}

pub(super) struct WorkerState<J> {
    pub(super) policy: Box<dyn Policy>,
    pub(super) cost_model: CostModel,
    pub(super) pending: FxHashMap<u64, Pending<J>>,
    pub(super) next_request_id: u64,
    /// The wake-up time armed for this worker (`u64::MAX`: none).
    pub(super) armed_ns: u64,
    /// This worker's share of the node (per second), set by the global pool.
    pub(super) share: CostVector,
    /// Cost dispatched since the last rebalancing, all phases and baseline phase only.
    pub(super) used: CostVector,
    pub(super) used_baseline: CostVector,
    /// The policy held requests back since the last rebalancing.
    pub(super) held_back: bool,
    /// Cost dispatched since start, never reset (node utilisation per dimension:
    /// [`Scheduler::dispatched_cost_total`]).
    pub(super) dispatched_total: CostVector,
    /// Cost dispatched in the baseline phase since start, never reset.
    pub(super) baseline_total: CostVector,
    /// Times the policy held requests back since start, never reset.
    pub(super) held_back_total: u64,
}

pub(super) struct Worker<J> {
    pub(super) state: Mutex<WorkerState<J>>,
    /// Requests queued in the policy (read without the lock by stealing dispatch).
    pub(super) queued: AtomicUsize,
}

impl<J> Worker<J> {
    /// Worker `index` of the node: the configured policy over `share`, its seed made distinct
    /// from the other workers'.
    pub(super) fn new(
        config: &QosConfig,
        kind: PolicyKind,
        share: NodeCapacity,
        index: usize,
    ) -> Self {
        let mut params = config.params;
        params.seed ^= 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(index as u64 + 1);
        let policy = build_policy(kind, share, &params);
        Worker {
            state: Mutex::new(WorkerState {
                policy,
                cost_model: config.cost_model.clone(),
                pending: FxHashMap::default(),
                next_request_id: 0,
                armed_ns: u64::MAX,
                share: share.per_second,
                used: CostVector::ZERO,
                used_baseline: CostVector::ZERO,
                held_back: false,
                dispatched_total: CostVector::ZERO,
                baseline_total: CostVector::ZERO,
                held_back_total: 0,
            }),
            queued: AtomicUsize::new(0),
        }
    }
}
