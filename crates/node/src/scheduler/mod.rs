//! The QoS scheduler on the I/O path: every request the server runs passes through a policy of
//! `headroom-qos`.
//!
//! The node has `N` scheduler workers. Each worker is one instance of the configured policy over
//! `1/N` of the node's capacity vector (BurstCBS's per-thread scheduler), with its own cost
//! model; a request is sent to a worker by the dispatch mode (1-to-N spraying by default).
//!
//! A worker is a policy behind a mutex, not a thread. Whoever touches it drives it: a session
//! that submits a request enqueues it and asks the policy what may run now; a request that
//! completes reports it; the wake-up thread asks again when a `WaitUntil` falls due. Whatever
//! the policy dispatches is handed back to the caller as [`Ready`] jobs, which the caller runs
//! (inline when small, on the I/O executor otherwise). So a request that the policy admits at
//! once runs on the thread that received it, as on the unscheduled path, and QoS costs two
//! short critical sections per request instead of a thread hop (the hop would cost more CPU
//! than a 4 KiB request itself). Time comes from the node's [`Clock`]: the policies stay pure.
//!
//! # The burst gate
//!
//! A policy paces work at the node's capacity, but a device serves what it was given in
//! arrival order, on a fixed number of internal channels. Rate alone lets spare-capacity work
//! fill every channel and queue behind them (a pacer that may run ahead by a millisecond keeps
//! a millisecond of burst work queued for as long as a burster has demand), and every baseline
//! request then waits for a channel. So the node also bounds the burst work *in flight*
//! (dispatched and not yet completed), with `burst_in_flight` = the device's parallelism `P`
//! minus one by default:
//!
//! - *Protected* requests, the baseline requests of volumes that are not bursting, never wait.
//! - *Bursting* requests are the burst requests (phases burst-credit and burst-spare) and the
//!   baseline requests of a volume that is bursting, i.e. has bursting requests waiting at
//!   the gate or in flight (so a run of baseline-phase requests amid a burst keeps it
//!   bursting: they would otherwise pass as protected and fill the device). One starts only while fewer than `P − 1` bursting requests are in
//!   flight (one channel is kept for baseline work) and fewer than `P` requests of both kinds
//!   (burst work never makes the device queue). Otherwise it waits for completions, baseline
//!   requests of bursting volumes ahead of burst requests, each in dispatch order.
//!
//! So a volume within its baseline finds a free channel unless other baseline requests hold
//! it, and then waits only for the next completion, never behind queued burst work. A bursting
//! volume competes with itself: its baseline is served first, but never on the channel kept
//! for the others (when a 128 KiB burster's baseline requests passed freely, the victim's p99
//! was 9× alone on a 4-channel device: docs/results.md, "Neighbour interference"). The price
//! is one channel of `P` taken from bursters, plus the time between a device completion and
//! the next start (the completion is handled, then the next request submitted).
//!
//! The policy's decisions and charges are unchanged (a gated request was already charged); the
//! gate only decides how far ahead of the device burst work may run. It is off without a limit,
//! and under Wild (the policy without isolation, kept as the reference for what bursters get
//! without it).
//!
//! Bounds: the scheduler holds only requests that their sessions already hold in-flight permits
//! for, so a throttled volume fills its own connection's budget and its reader stops reading
//! the socket; nothing here grows without a bound.
//!
//! # Files
//!
//! The scheduler's parts, one per file: the state kept per volume and its registration
//! (`volume.rs`), a worker's policy and queue (`worker.rs`), what a dispatched request carries
//! (`ticket.rs`), submission and the policy's decisions (`dispatch.rs`), completion reports
//! (`completion.rs`), the burst gate (`gate.rs`), the node's capacity between the workers
//! (`pool.rs`), the wake-up thread (`wakeup.rs`), what metrics and the API read (`views.rs`),
//! and the policies' invariant checks on a live node (`invariants.rs`).

mod completion;
pub mod config;
mod dispatch;
mod gate;
mod invariants;
mod pool;
mod ticket;
mod views;
mod volume;
mod wakeup;
mod worker;

use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex, RwLock, Weak};

use headroom_qos::{CostVector, OpKind};
use rustc_hash::FxHashMap;

use crate::clock::Clock;
use crate::sync::lock;
use config::{DispatchMode, QosConfig};
use gate::BurstGate;
use pool::GlobalPool;
use wakeup::Wakeups;
use worker::Worker;

pub use ticket::Ticket;
pub use views::{DemandCounters, VolumeCredits};
pub use volume::{PhaseCounters, PhaseStats, VolumeHandle};

/// Most syncs one request is charged for (a FLUSH of a pool with more dirty devices pays for
/// this many: the bound keeps one charge within what a policy window can absorb).
pub const MAX_CHARGED_SYNCS: u32 = 64;

/// What the scheduler needs to know of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoDesc {
    pub op: OpKind,
    pub offset_bytes: u64,
    pub len_bytes: u32,
    /// Device syncs the request causes besides its own work, each charged
    /// [`CostModel::estimate_sync`]: 1 for a FUA request, one per device a FLUSH syncs.
    pub syncs: u32,
}

/// A job the policy dispatched, with what its completion must report.
#[derive(Debug)]
pub struct Ready<J> {
    pub job: J,
    pub ticket: Ticket,
}

/// A request waiting in a batch for [`Scheduler::submit_batch`], with the worker and the
/// sequential flag [`Scheduler::queue`] gave it.
#[derive(Debug)]
pub struct Queued<J> {
    worker: usize,
    sequential: bool,
    io: IoDesc,
    /// Taken when it is submitted.
    job: Option<J>,
}

/// Runs jobs the policy dispatched outside a caller's own submission (when a timer falls due).
pub trait Runner<J>: Send + Sync {
    fn run(&self, scheduler: &Arc<Scheduler<J>>, ready: Vec<Ready<J>>);
}

/// The node's scheduler workers.
pub struct Scheduler<J> {
    clock: Clock,
    workers: Vec<Worker<J>>,
    dispatch: DispatchMode,
    volumes: RwLock<FxHashMap<u64, Arc<VolumeHandle>>>,
    next_volume_id: AtomicU32,
    wakeups: Arc<Wakeups>,
    runner: Arc<dyn Runner<J>>,
    gate: BurstGate<J>,
    /// The whole node's capacity, shared between the workers (`None`: fixed `1/N` shares).
    pool: Option<GlobalPool>,
    /// The node's capacity per second, every dimension (`u64::MAX`: unlimited); set at start,
    /// changed at run time by cross-node arbitration ([`Scheduler::set_capacity_per_second`]).
    capacity_per_second: Mutex<CostVector>,
    policy_name: &'static str,
    /// This scheduler, for handing jobs to the runner from `&self` methods.
    me: Weak<Scheduler<J>>,
}

impl<J> std::fmt::Debug for Scheduler<J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("policy", &self.policy_name)
            .field("workers", &self.workers.len())
            .field("dispatch", &self.dispatch)
            .finish_non_exhaustive()
    }
}

/// Errors of the scheduler layer.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    #[error("the QoS configuration has no policy (policy = \"off\")")]
    NoPolicy,
    #[error("starting the wake-up thread: {0}")]
    Thread(std::io::Error),
}

impl<J: Send + 'static> Scheduler<J> {
    /// Builds the workers and starts the wake-up thread.
    /// `device_parallelism`: the emulated device's channels, if there is one (it sets the
    /// burst gate's default).
    pub fn start(
        config: &QosConfig,
        clock: Clock,
        runner: Arc<dyn Runner<J>>,
        device_parallelism: Option<u32>,
    ) -> Result<Arc<Scheduler<J>>, SchedulerError> {
        let kind = config.policy.kind().ok_or(SchedulerError::NoPolicy)?;
        let count = config.workers.max(1);
        let share = headroom_qos::NodeCapacity::new(
            config
                .capacity
                .per_second
                .map(|v| if v == u64::MAX { v } else { v / count as u64 }),
        );
        let workers: Vec<Worker<J>> = (0..count)
            .map(|index| Worker::new(config, kind, share, index))
            .collect();
        let policy_name = lock(&workers[0].state).policy.name();
        let wakeups = Arc::new(Wakeups::new(count));
        let scheduler = Arc::new_cyclic(|me| Scheduler {
            clock,
            workers,
            dispatch: config.dispatch,
            volumes: RwLock::new(FxHashMap::default()),
            next_volume_id: AtomicU32::new(0),
            wakeups: Arc::clone(&wakeups),
            runner,
            gate: BurstGate::new(config, device_parallelism),
            pool: (config.global_pool && count > 1).then(|| GlobalPool::new(config, clock)),
            capacity_per_second: Mutex::new(config.capacity.per_second),
            policy_name,
            me: me.clone(),
        });
        let weak = Arc::downgrade(&scheduler);
        std::thread::Builder::new()
            .name("headroom-wake".into())
            .spawn(move || wakeup::wake_loop(weak, wakeups, clock))
            .map_err(SchedulerError::Thread)?;
        Ok(scheduler)
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy_name
    }

    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// Stops the wake-up thread (queued requests stay queued; call when no session is left).
    pub fn stop(&self) {
        self.wakeups.stop();
    }
}

#[cfg(test)]
mod tests;
