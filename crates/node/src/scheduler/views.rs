//! What the scheduler shows to metrics, the API and arbitration: credit balances, queued
//! requests, per-volume activity and cumulative demand. Reads only; nothing here changes a
//! decision.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use headroom_qos::{CostVector, VolumeQos};

use super::Scheduler;
use super::volume::VolumeHandle;
use crate::sync::{lock, read};

/// What the promise audit (`metrics::audit`) asks a scheduler, whatever job type it runs: the
/// metrics sit below the request path and must not name its job type.
pub trait VolumeCredits: Send + Sync {
    /// The volume's handle, if it is registered.
    fn volume_handle(&self, key: u64) -> Option<Arc<VolumeHandle>>;
    /// Its credit balances ([`Scheduler::credits`]).
    fn volume_credits(&self, handle: &VolumeHandle) -> (Option<u64>, Option<u64>);
}

impl<J: Send + 'static> VolumeCredits for Scheduler<J>
where
    Scheduler<J>: Send + Sync,
{
    fn volume_handle(&self, key: u64) -> Option<Arc<VolumeHandle>> {
        self.handle(key)
    }

    fn volume_credits(&self, handle: &VolumeHandle) -> (Option<u64>, Option<u64>) {
        self.credits(handle)
    }
}

impl<J: Send + 'static> Scheduler<J> {
    /// Credit balances summed over the workers (whole credits), or `None` per bucket the
    /// volume does not have.
    pub fn credits(&self, handle: &VolumeHandle) -> (Option<u64>, Option<u64>) {
        let mut iops: Option<u64> = None;
        let mut bytes: Option<u64> = None;
        // A pinned volume's balance is its home worker's (other workers may still hold the
        // share it had before a QoS change pinned it: stale, and not added).
        let pinned = handle.pinned.load(Ordering::Relaxed);
        for (w, worker) in self.workers.iter().enumerate() {
            if pinned && w != handle.home_worker {
                continue;
            }
            let state = lock(&worker.state);
            if let Some(s) = state.policy.snapshot(handle.id) {
                if let Some(v) = s.iops_credits {
                    iops = Some(iops.unwrap_or(0).saturating_add(v));
                }
                if let Some(v) = s.bytes_credits {
                    bytes = Some(bytes.unwrap_or(0).saturating_add(v));
                }
            }
        }
        (iops, bytes)
    }

    /// Requests queued in the policies for a volume.
    pub fn queued_requests(&self, handle: &VolumeHandle) -> usize {
        self.workers
            .iter()
            .filter_map(|w| lock(&w.state).policy.snapshot(handle.id))
            .map(|s| s.queued_requests)
            .sum()
    }

    /// Every registered volume: its key, its whole QoS, and the requests it has completed
    /// since start (cross-node arbitration sums the baselines of the volumes that were active).
    pub fn volume_activity(&self) -> Vec<(u64, VolumeQos, u64)> {
        let volumes = read(&self.volumes);
        volumes
            .values()
            .map(|h| {
                let ios = h
                    .counters
                    .ios
                    .iter()
                    .map(|a| a.load(Ordering::Relaxed))
                    .fold(0u64, u64::saturating_add);
                (h.key, h.qos(), ios)
            })
            .collect()
    }

    /// What the workers did since start, for measuring the node's demand over an interval:
    /// cost dispatched (all phases), cost dispatched in the baseline phase, and how many
    /// times a policy held requests back.
    pub fn demand_counters(&self) -> DemandCounters {
        self.workers
            .iter()
            .fold(DemandCounters::default(), |sum, worker| {
                let state = lock(&worker.state);
                DemandCounters {
                    dispatched: sum.dispatched.saturating_add(state.dispatched_total),
                    baseline: sum.baseline.saturating_add(state.baseline_total),
                    held_back: sum.held_back + state.held_back_total,
                }
            })
    }

    /// The estimated cost of every request dispatched since start, summed over the workers.
    /// Its growth over an interval, divided by [`Scheduler::capacity_per_second`] times the
    /// interval, is the node's utilisation per dimension as the scheduler sees it (the cost
    /// model's estimates, not measured device time).
    pub fn dispatched_cost_total(&self) -> CostVector {
        self.workers.iter().fold(CostVector::ZERO, |sum, worker| {
            sum.saturating_add(lock(&worker.state).dispatched_total)
        })
    }
}

/// Cumulative counters of the whole scheduler ([`Scheduler::demand_counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DemandCounters {
    pub dispatched: CostVector,
    pub baseline: CostVector,
    pub held_back: u64,
}
