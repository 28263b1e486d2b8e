//! The node's capacity between the workers: the global pool that moves capacity from idle
//! workers to busy ones every rebalancing period, and run-time capacity changes (cross-node
//! arbitration).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use headroom_qos::{CostVector, NodeCapacity};

use super::config::QosConfig;
use super::{Ready, Scheduler};
use crate::clock::Clock;
use crate::sync::lock;
use headroom_qos::global_pool::{self, WorkerUse};

/// The node's capacity and when it was last split between the workers.
pub(super) struct GlobalPool {
    pub(super) node: Mutex<CostVector>,
    pub(super) period_ns: u64,
    pub(super) last_ns: AtomicU64,
}

const NS_PER_S: u64 = 1_000_000_000;

impl GlobalPool {
    /// The pool of a node started with `config`, last split now.
    pub(super) fn new(config: &QosConfig, clock: Clock) -> Self {
        GlobalPool {
            node: Mutex::new(config.capacity.per_second),
            period_ns: config.params.window_ns.max(global_pool::MIN_PERIOD_NS),
            last_ns: AtomicU64::new(clock.now_ns()),
        }
    }
}

impl<J: Send + 'static> Scheduler<J> {
    /// Moves capacity between the workers if a rebalancing period has passed
    /// (`headroom_qos::global_pool`); appends what the new shares let run to `ready`. Runs on whichever
    /// thread submits or completes a request first after the period: an idle node does no work.
    pub(super) fn maybe_rebalance(&self, now: u64, ready: &mut Vec<Ready<J>>) {
        let Some(pool) = &self.pool else {
            return;
        };
        let last = pool.last_ns.load(Ordering::Relaxed);
        if now < last.saturating_add(pool.period_ns)
            || pool
                .last_ns
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        self.rebalance(now, now - last, ready);
    }

    /// Splits the node between the workers by what they did over the last `elapsed_ns`.
    pub(super) fn rebalance(&self, now: u64, elapsed_ns: u64, ready: &mut Vec<Ready<J>>) {
        let Some(pool) = &self.pool else {
            return;
        };
        let per_second = |v: CostVector| v.mul_ratio_floor(NS_PER_S, elapsed_ns.max(1));
        let uses: Vec<WorkerUse> = self
            .workers
            .iter()
            .map(|worker| {
                let mut state = lock(&worker.state);
                WorkerUse {
                    used: per_second(std::mem::replace(&mut state.used, CostVector::ZERO)),
                    baseline: per_second(std::mem::replace(
                        &mut state.used_baseline,
                        CostVector::ZERO,
                    )),
                    share: state.share,
                    held_back: std::mem::replace(&mut state.held_back, false),
                }
            })
            .collect();
        let node = *lock(&pool.node);
        self.apply_shares(now, global_pool::split(node, &uses), ready);
    }

    /// Gives worker `w` the share `shares[w]` (those whose share changed), and appends what
    /// the new shares let run to `ready`, through the burst gate.
    pub(super) fn apply_shares(
        &self,
        now: u64,
        shares: Vec<CostVector>,
        ready: &mut Vec<Ready<J>>,
    ) {
        let from = ready.len();
        for (w, share) in shares.into_iter().enumerate() {
            let mut state = lock(&self.workers[w].state);
            if state.share == share {
                continue;
            }
            state.share = share;
            state.policy.set_capacity(now, NodeCapacity::new(share));
            self.drain(w, &mut state, now, ready);
        }
        self.gate.admit(ready, from);
    }

    /// The node's capacity per second, as configured (`u64::MAX` in a dimension: unlimited).
    pub fn capacity_per_second(&self) -> CostVector {
        *lock(&self.capacity_per_second)
    }

    /// Changes the node's capacity at run time (cross-node arbitration gives the node its
    /// share of a shared backend every epoch). With the global pool each worker's share is
    /// scaled to the new capacity in its current proportion (`global_pool::rescale`; the next
    /// rebalancing period re-splits by use, as always); without it each worker gets `1/N`.
    /// Whatever the new capacity lets run is started.
    pub fn set_capacity_per_second(&self, capacity: CostVector) {
        {
            let mut current = lock(&self.capacity_per_second);
            if *current == capacity {
                return;
            }
            *current = capacity;
        }
        let now = self.clock.now_ns();
        let mut ready = Vec::new();
        match &self.pool {
            Some(pool) => {
                *lock(&pool.node) = capacity;
                let shares = global_pool::rescale(capacity, &self.worker_shares());
                self.apply_shares(now, shares, &mut ready);
            }
            None => {
                let n = self.workers.len() as u64;
                let share = capacity.map(|v| if v == u64::MAX { v } else { v / n });
                for w in 0..self.workers.len() {
                    let mut state = lock(&self.workers[w].state);
                    state.share = share;
                    state.policy.set_capacity(now, NodeCapacity::new(share));
                    self.drain(w, &mut state, now, &mut ready);
                }
                self.gate.admit(&mut ready, 0);
            }
        }
        self.run_elsewhere(ready);
    }

    /// Each worker's current share of the node (per second).
    pub fn worker_shares(&self) -> Vec<CostVector> {
        self.workers.iter().map(|w| lock(&w.state).share).collect()
    }
}
